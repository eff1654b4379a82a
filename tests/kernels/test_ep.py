"""kernels.ep_dispatch / kernels.ep_combine (kernels/ep.py): the low-latency expert-parallel
transport. GPU: P ranks simulated in one process on one GPU (each rank's buffer an ordinary
allocation, "peer" addresses plain device pointers, each rank's kernels on its own stream so the
device-side waits see the other ranks' sends), several forwards in a row (epochs, both counter
sets), against the same expert step applied to the pairs directly. CPU: argument checks and the
kernels' machine code."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kernels
from test_sass import sass

kAlign = 128


@dataclass
class Group:
    layouts: list
    buffers: list
    offsets: list
    views: list

    def view(self, rank: int, name: str) -> torch.Tensor:
        i = [v[0] for v in self.views].index(name)
        _, shape, dtype = self.views[i]
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self.buffers[rank][self.offsets[i]: self.offsets[i] + nbytes].view(dtype).view(shape)


def make_group(num_ranks, num_local, max_tokens, top_k, hidden) -> Group:
    views = kernels.ep_buffer_views(num_ranks, num_local, max_tokens, top_k, hidden)
    offsets, total = [], 0
    for _, shape, dtype in views:
        total = (total + kAlign - 1) // kAlign * kAlign
        offsets.append(total)
        total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    # Poisoned everywhere but the signals, which the protocol needs zero before the first forward.
    buffers = [torch.full((total,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(num_ranks)]
    group = Group([], buffers, offsets, views)
    for r in range(num_ranks):
        group.view(r, "ep_signals").zero_()
    peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
    group.layouts = [kernels.EpLayout(peers, tuple(offsets), r, num_ranks, num_local, max_tokens, top_k, hidden)
                     for r in range(num_ranks)]
    return group


def expert_step(x_bits: torch.Tensor, sf: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A row-local stand-in for the experts: dequantize, times (global expert id + 1) and the pair's
    weight, rounded to bfloat16. ``x_bits`` uint8 [..., H], ``sf`` [..., H/128], ``w`` and ``ids``
    [...]."""
    x = x_bits.view(torch.float8_e4m3fn).float() * sf.repeat_interleave(128, dim=-1)
    return (x * (ids.float() + 1).unsqueeze(-1) * w.unsqueeze(-1)).to(torch.bfloat16)


def routing(num_tokens, top_k, num_experts, unrouted, gen):
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty((0, top_k), dtype=torch.int64)
    drop = torch.rand(num_tokens, top_k, generator=gen) < unrouted
    return torch.where(drop, torch.full_like(idx, -1), idx)


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,num_local,max_tokens,top_k,hidden", [
    (1, 4, 8, 2, 256), (2, 4, 16, 8, 256), (3, 3, 8, 4, 384), (4, 8, 32, 8, 7168)])
def test_gpu_transport_round_trips_every_pair(seed, num_ranks, num_local, max_tokens, top_k, hidden):
    gen = torch.Generator().manual_seed(seed)
    num_experts = num_ranks * num_local
    top_k = min(top_k, num_experts)
    group = make_group(num_ranks, num_local, max_tokens, top_k, hidden)
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    rows = num_ranks * max_tokens
    for forward in range(3):
        # Token counts per rank vary per forward: a full rank, an empty one, a few tokens.
        counts = [[max_tokens, 0, 1 + forward][(r + forward) % 3] for r in range(num_ranks)]
        inputs = []
        for r in range(num_ranks):
            x = torch.randn(counts[r], hidden, generator=gen).to("cuda", torch.bfloat16)
            xq, xs = kernels.per_token_cast_to_fp8(x)
            idx = routing(counts[r], top_k, num_experts, 0.2, gen).cuda()
            w = torch.rand(counts[r], top_k, generator=gen).cuda()
            inputs.append((xq.view(torch.uint8), xs, idx, w))
        torch.cuda.synchronize()
        masked, outs = [None] * num_ranks, [None] * num_ranks
        # Every rank's step is enqueued before the next step of any: the waits are on the device.
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                masked[r] = kernels.ep_dispatch(group.layouts[r], *inputs[r])
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                src = group.view(r, "ep_src")
                ids = torch.where(src >= 0, torch.arange(num_local, device="cuda").view(-1, 1) + r * num_local, 0)
                out = expert_step(group.view(r, "ep_x"), group.view(r, "ep_sf"), group.view(r, "ep_w"), ids)
                kernels.ep_combine(group.layouts[r], out.view(num_local, rows, hidden), masked[r])
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                t, routed = counts[r], inputs[r][2] >= 0
                outs[r] = kernels.moe_combine(group.view(r, "ep_combine")[: t * top_k], None, routed, t, top_k)
        torch.cuda.synchronize()

        all_ids = torch.cat([inp[2].reshape(-1) for inp in inputs])
        for r in range(num_ranks):
            xq, xs, idx, w = inputs[r]
            expected_m = torch.stack([(all_ids == r * num_local + e).sum() for e in range(num_local)]).int()
            assert torch.equal(masked[r].cpu(), expected_m.cpu()), f"forward {forward} rank {r}"
            t = counts[r]
            pairs = expert_step(xq.unsqueeze(1).expand(t, top_k, hidden), xs.unsqueeze(1).expand(t, top_k, -1), w,
                                idx.clamp(min=0)).reshape(t * top_k, hidden)
            expected = kernels.moe_combine(pairs, None, idx >= 0, t, top_k)
            assert torch.equal(outs[r], expected), f"forward {forward} rank {r}"
    for r in range(num_ranks):
        signals = group.view(r, "ep_signals").cpu()
        assert signals[2 * num_local + 2 * num_ranks] == 3, "three forwards counted"


@pytest.mark.gpu
def test_gpu_bad_arguments_raise_before_any_launch():
    group = make_group(2, 2, 4, 2, 128)
    layout = group.layouts[0]
    xq = torch.zeros(5, 128, dtype=torch.uint8, device="cuda")
    xs = torch.ones(5, 1, device="cuda")
    idx = torch.zeros(5, 2, dtype=torch.int64, device="cuda")
    w = torch.ones(5, 2, device="cuda")
    with pytest.raises(ValueError, match="5 tokens, more than the 4"):
        kernels.ep_dispatch(layout, xq, xs, idx, w)
    with pytest.raises(ValueError, match="topk_idx must be"):
        kernels.ep_dispatch(layout, xq[:4], xs[:4], idx[:4].int(), w[:4])
    with pytest.raises(ValueError, match="expert_out must be"):
        kernels.ep_combine(layout, torch.zeros(2, 8, 64, dtype=torch.bfloat16, device="cuda"),
                           torch.zeros(2, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(rank=2), "rank 2 of num_ranks 2"),
    (dict(num_local_experts=0), "num_local_experts must be"),
    (dict(hidden=100), "hidden a positive multiple of 128"),
    (dict(offsets=(0, 4, 8, 12, 20, 24)), "aligned"),
    (dict(offsets=(0, 16)), "offsets must be 6"),
])
def test_layout_checks(kwargs, match):
    args = dict(peers=torch.zeros(2, dtype=torch.int64), offsets=(0, 128, 256, 384, 512, 640), rank=0, num_ranks=2,
                num_local_experts=2, max_tokens=4, top_k=2, hidden=128)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kernels.EpLayout(**args)


def test_layout_needs_peers_on_the_gpu():
    with pytest.raises(ValueError, match="peers must be a contiguous int64 CUDA tensor"):
        kernels.EpLayout(torch.zeros(2, dtype=torch.int64), (0, 128, 256, 384, 512, 640), 0, 2, 2, 4, 2, 128)


def test_buffer_views_and_signal_words():
    views = dict((name, (shape, dtype)) for name, shape, dtype in kernels.ep_buffer_views(4, 8, 16, 8, 7168))
    assert tuple(views) == kernels.ep.kEpViews
    assert views["ep_x"] == ((8, 64, 7168), torch.uint8) and views["ep_combine"] == ((128, 7168), torch.bfloat16)
    assert views["ep_signals"] == ((2 * 8 + 2 * 4 + 3,), torch.int32)


@pytest.mark.parametrize("kernel", range(4))
def test_transport_kernels_machine_code(kernel):
    """Sends: 16-byte row copies, the slot from a system-scope atomic on the owner, one system fence
    per thread and relaxed flag stores after it (not a fence per flag). Waits: acquire loads, a
    sleep between them, a trap when a rank never arrives."""
    text = sass(*kernels.jit.native_module().moe_ep_ll_code(kernel, 8, 7168))
    if kernel in (0, 2):
        assert "LDG.E.128" in text and "ST.E.128" in text
        assert "MEMBAR.SC.SYS" in text and "MEMBAR.ALL.SYS" not in text
        assert "STG.E.STRONG.SYS" in text
    if kernel == 0:
        assert "ATOM.E.ADD.STRONG.SYS" in text
    if kernel in (1, 3):
        assert "LD.E.STRONG.SYS" in text and "NANOSLEEP" in text and "BPT.TRAP" in text
