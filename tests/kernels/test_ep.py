"""kernels.ep_dispatch / kernels.ep_combine (kernels/ep.py): the low-latency expert-parallel
transport. GPU: P ranks simulated in one process on one GPU (each rank's buffer an ordinary
allocation, "peer" addresses plain device pointers, each rank's kernels on its own stream so the
device-side waits see the other ranks' sends), several forwards in a row (both counter sets),
against the same expert step applied to the pairs directly; a dispatch without its combine times
out. These run in a child process: a wait kernel that traps ends the CUDA context, which would
fail every later GPU test of the session. This bookkeeping test cannot see system-scope ordering
between GPUs: the multi-rank layer tests do (tests/moe_runtime). CPU: argument checks and the
kernels' machine code."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

import kernels
from device_waits import assert_passed, assert_timed_out, child_main, run_in_child
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
    bases = tuple(b.data_ptr() for b in buffers)
    group.layouts = [kernels.EpLayout(bases, tuple(offsets), total, r, num_ranks, num_local, max_tokens, top_k,
                                      hidden, "cuda") for r in range(num_ranks)]
    return group


def expert_step(x_bits: torch.Tensor, sf: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A row-local stand-in for the experts: dequantize, times (global expert id + 1) and the pair's
    weight, rounded to bfloat16. ``x_bits`` uint8 [..., H], ``sf`` [..., H/128], ``w`` and ``ids``
    [...]."""
    x = x_bits.view(torch.float8_e4m3fn).float() * sf.repeat_interleave(128, dim=-1)
    return (x * (ids.float() + 1).unsqueeze(-1) * w.unsqueeze(-1)).to(torch.bfloat16)


def experts_then_combine(group: Group, r: int, num_local: int, rows: int, hidden: int) -> None:
    """Rank r's step after its dispatch, on the current stream: :func:`expert_step` on the rows it
    received (each row's global expert from its segment), then ``kernels.ep_combine``."""
    src = group.view(r, "ep_src")
    ids = torch.where(src >= 0, torch.arange(num_local, device="cuda").view(-1, 1) + r * num_local, 0)
    out = expert_step(group.view(r, "ep_x"), group.view(r, "ep_sf"), group.view(r, "ep_w"), ids)
    kernels.ep_combine(group.layouts[r], out.view(num_local, rows, hidden))


def routing(num_tokens, top_k, num_experts, unrouted, gen):
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty((0, top_k), dtype=torch.int64)
    drop = torch.rand(num_tokens, top_k, generator=gen) < unrouted
    return torch.where(drop, torch.full_like(idx, -1), idx)


def round_trip(seed, num_ranks, num_local, max_tokens, top_k, hidden, rows="e4m3"):
    """Three forwards of every simulated rank; raises on the first mismatch. ``rows``: what the
    dispatch gets, E4M3 rows with their scales, or bfloat16 / float32 rows (every other row
    stride wider than hidden) that it quantizes itself: the outputs must then match those of
    kernels.per_token_cast_to_fp8's rows bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    num_experts = num_ranks * num_local
    top_k = min(top_k, num_experts)
    group = make_group(num_ranks, num_local, max_tokens, top_k, hidden)
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    rows = num_ranks * max_tokens
    for forward in range(3):
        # Token counts per rank vary per forward: a full rank, an empty one, a few tokens.
        counts = [[max_tokens, 0, 1 + forward][(r + forward) % 3] for r in range(num_ranks)]
        inputs, sends = [], []
        for r in range(num_ranks):
            dtype = torch.float32 if rows == "float32" else torch.bfloat16
            pad = 64 if (r + forward) % 2 else 0
            x = torch.randn(counts[r], hidden + pad, generator=gen).to("cuda", dtype)[:, :hidden]
            xq, xs = kernels.per_token_cast_to_fp8(x)
            idx = routing(counts[r], top_k, num_experts, 0.2, gen).cuda()
            w = torch.rand(counts[r], top_k, generator=gen).cuda()
            inputs.append((xq.view(torch.uint8), xs, idx, w))
            sends.append(inputs[-1] if rows == "e4m3" else (x, None, idx, w))
        # Poisoned on the default stream: filled before the ranks' streams write them.
        sent = [torch.ones(counts[r], top_k, dtype=torch.bool, device="cuda") for r in range(num_ranks)]
        torch.cuda.synchronize()
        masked, outs = [None] * num_ranks, [None] * num_ranks
        # Every rank's step is enqueued before the next step of any: the waits are on the device.
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                masked[r] = kernels.ep_dispatch(group.layouts[r], *sends[r], routed=sent[r])
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                experts_then_combine(group, r, num_local, rows, hidden)
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                t = counts[r]
                outs[r] = kernels.moe_combine(group.view(r, "ep_combine")[: t * top_k], None, sent[r], t, top_k)
        torch.cuda.synchronize()
        for r in range(num_ranks):
            assert torch.equal(sent[r], inputs[r][2] >= 0), "routed: the pairs sent"

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
        steps = 2 * num_local + 2 * num_ranks
        assert signals[steps] == 3 and signals[steps + 1] == 3, "three dispatches and three combines counted"


def overflow(seed):
    """Repeated ids overflow expert 0's R = 4 rows (6 pairs from 2 ranks): the dropped pairs are
    not in the routed mask (whichever rank's the atomics dropped), so the combine sums only written
    slots (the combine views are NaN-poisoned first)."""
    num_ranks, num_local, max_tokens, top_k, hidden = 2, 2, 2, 2, 128
    group = make_group(num_ranks, num_local, max_tokens, top_k, hidden)
    rows = num_ranks * max_tokens
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.tensor([[0, 0], [0, 0]]), torch.tensor([[0, 1], [0, 1]])]
    inputs = []
    for r in range(num_ranks):
        xq, xs = kernels.per_token_cast_to_fp8(torch.randn(max_tokens, hidden, generator=gen).to("cuda", torch.bfloat16))
        inputs.append((xq.view(torch.uint8), xs, ids[r].cuda(), torch.rand(max_tokens, top_k, generator=gen).cuda()))
        group.view(r, "ep_combine").fill_(float("nan"))
    sent = [torch.ones(max_tokens, top_k, dtype=torch.bool, device="cuda") for _ in range(num_ranks)]
    torch.cuda.synchronize()  # the fills above, on the default stream, before the ranks' streams
    for r in range(num_ranks):
        with torch.cuda.stream(streams[r]):
            kernels.ep_dispatch(group.layouts[r], *inputs[r], routed=sent[r])
    outs = [None] * num_ranks
    for r in range(num_ranks):
        with torch.cuda.stream(streams[r]):
            experts_then_combine(group, r, num_local, rows, hidden)
    for r in range(num_ranks):
        with torch.cuda.stream(streams[r]):
            outs[r] = kernels.moe_combine(group.view(r, "ep_combine")[: max_tokens * top_k], None, sent[r],
                                          max_tokens, top_k)
    torch.cuda.synchronize()
    written = sum(int((sent[r] & (inputs[r][2] == 0)).sum()) for r in range(num_ranks))
    assert written == rows, f"expert 0 has {rows} rows: {written} of its 6 pairs marked written"
    for r in range(num_ranks):
        xq, xs, idx, w = inputs[r]
        assert bool((sent[r] <= (idx >= 0)).all()), "only routed pairs are marked"
        pairs = expert_step(xq.unsqueeze(1).expand(max_tokens, top_k, hidden),
                            xs.unsqueeze(1).expand(max_tokens, top_k, -1), w, idx).reshape(-1, hidden)
        assert torch.isfinite(outs[r]).all(), f"rank {r}: a dropped pair's slot was summed"
        assert torch.equal(outs[r], kernels.moe_combine(pairs, None, sent[r], max_tokens, top_k)), f"rank {r}"


def dispatch_twice(seed):
    """Rank 0 dispatches twice without a combine: its second wait can never be satisfied."""
    group = make_group(2, 2, 4, 2, 128)
    streams = [torch.cuda.Stream() for _ in range(2)]
    batch = [(torch.zeros(4, 128, dtype=torch.uint8, device="cuda"), torch.ones(4, 1, device="cuda"),
              torch.tensor([[0, 3]] * 4, device="cuda"), torch.ones(4, 2, device="cuda")) for _ in range(2)]
    for r in range(2):
        with torch.cuda.stream(streams[r]):
            kernels.ep_dispatch(group.layouts[r], *batch[r])
    with torch.cuda.stream(streams[0]):
        kernels.ep_dispatch(group.layouts[0], *batch[0])
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,num_local,max_tokens,top_k,hidden,rows", [
    (1, 4, 8, 2, 256, "e4m3"), (2, 4, 16, 8, 256, "e4m3"), (3, 3, 8, 4, 384, "e4m3"), (4, 8, 32, 8, 7168, "e4m3"),
    (1, 4, 8, 2, 256, "bfloat16"), (3, 3, 8, 4, 384, "float32"), (2, 8, 160, 8, 7168, "bfloat16")])
def test_gpu_transport_round_trips_every_pair(seed, num_ranks, num_local, max_tokens, top_k, hidden, rows):
    assert_passed(run_in_child(__file__, "round_trip", 20, seed=seed, num_ranks=num_ranks, num_local=num_local,
                               max_tokens=max_tokens, top_k=top_k, hidden=hidden, rows=rows))


@pytest.mark.gpu
def test_gpu_pairs_past_an_experts_rows_are_not_combined(seed):
    assert_passed(run_in_child(__file__, "overflow", 20, seed=seed))


@pytest.mark.gpu
def test_gpu_dispatch_without_its_combine_times_out():
    assert_timed_out(run_in_child(__file__, "dispatch_twice", 2, seed=0), "the dispatch of rank 1")


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
    with pytest.raises(ValueError, match="routed must be"):
        kernels.ep_dispatch(layout, xq[:4], xs[:4], idx[:4], w[:4], routed=torch.ones(4, 3, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="x must be a E4M3"):
        kernels.ep_dispatch(layout, xq[:4].bfloat16(), xs[:4], idx[:4], w[:4])
    with pytest.raises(ValueError, match="x must be a bfloat16, float16 or float32"):
        kernels.ep_dispatch(layout, xq[:4].double(), None, idx[:4], w[:4])
    with pytest.raises(ValueError, match="expert_out must be"):
        kernels.ep_combine(layout, torch.zeros(2, 8, 64, dtype=torch.bfloat16, device="cuda"))


def _layout_args(**overrides):
    views = kernels.ep_buffer_views(2, 2, 4, 2, 128)
    offsets, total = [], 0
    for _, shape, dtype in views:
        offsets.append(total)
        total += (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() + 127) // 128 * 128
    args = dict(bases=(1 << 20, 2 << 20), offsets=tuple(offsets), buffer_bytes=total, rank=0, num_ranks=2,
                num_local_experts=2, max_tokens=4, top_k=2, hidden=128, device="cpu")
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,match", [
    (dict(rank=2), "rank 2 of num_ranks 2"),
    (dict(num_local_experts=0), "num_local_experts must be"),
    (dict(hidden=100), "hidden a positive multiple of 128"),
    (dict(bases=(1 << 20, (2 << 20) + 8)), "16-byte aligned"),
    (dict(bases=(1 << 20,)), "bases must be 2"),
    (dict(offsets=(0, 16)), "offsets must be 6"),
    (dict(offsets=(0, 4, 8, 12, 20, 24)), "aligned"),
    (dict(offsets=(0, 128, 256, 384, 512, 640)), "overlap"),
    (dict(buffer_bytes=1024), "past the 1024-byte buffer"),
    (dict(max_tokens=2**29, top_k=4), "must stay below 2\\^31"),
    (dict(), "runs on CUDA devices, got cpu"),
])
def test_layout_checks(overrides, match):
    with pytest.raises(ValueError, match=match):
        kernels.EpLayout(**_layout_args(**overrides))


@pytest.mark.parametrize("call,error,match", [
    (lambda: kernels.ep_dispatch(None, torch.zeros(1, 128), None, torch.zeros(1, 2, dtype=torch.int64),
                                 torch.ones(1, 2)), TypeError, "ep_dispatch: layout must be an EpLayout, got NoneType"),
    (lambda: kernels.ep_combine("layout", torch.zeros(2, 8, 128, dtype=torch.bfloat16)), TypeError,
     "ep_combine: layout must be an EpLayout, got str"),
    (lambda: kernels.ep_buffer_views(0, 2, 4, 2, 128), ValueError, "ep_buffer_views: num_ranks must be an int >= 1, got 0"),
    (lambda: kernels.ep_buffer_views(2, 2, -4, 2, 128), ValueError, "max_tokens must be an int >= 1, got -4"),
    (lambda: kernels.ep_buffer_views(2, 2, 4, 2.0, 128), ValueError, "top_k must be an int >= 1, got 2.0"),
    (lambda: kernels.ep_buffer_views(2, 2, 4, 2, 200), ValueError, "hidden must be a multiple of 128 .*got 200"),
    (lambda: kernels.ep_signal_ints(2, -1), ValueError, "ep_signal_ints: num_local_experts must be an int >= 1"),
])
def test_cpu_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_buffer_views_and_signal_words():
    views = dict((name, (shape, dtype)) for name, shape, dtype in kernels.ep_buffer_views(4, 8, 16, 8, 7168))
    assert tuple(views) == kernels.ep.kEpViews
    assert views["ep_x"] == ((8, 64, 7168), torch.uint8) and views["ep_combine"] == ((128, 7168), torch.bfloat16)
    assert views["ep_signals"] == ((2 * 8 + 2 * 4 + 4,), torch.int32)


@pytest.mark.parametrize("kernel,in_dtype", [(0, torch.bfloat16), (0, torch.float8_e4m3fn), (0, torch.float32),
                                             (1, torch.bfloat16)])
def test_transport_kernels_machine_code(kernel, in_dtype):
    """Sends: 16-byte row loads and stores, the slot from a system-scope atomic on the owner, one
    system fence per thread and relaxed flag stores after it (not a fence per flag); the dispatch
    quantizes with the E4M3 conversion instruction. The last CTA's waits: acquire loads, a sleep
    between them, a trap when a rank never arrives. No spills (loads from local memory: the trap's
    printf stores its arguments there)."""
    code = kernels.jit.native_module().moe_ep_ll_code(kernel, 8, 7168, kernels._descriptors.DTYPE_CODES[in_dtype])
    text = sass(*code)
    assert re.search(r"LDG\.E[.A-Z]*\.128", text) and re.search(r"STG\.E[.A-Z]*\.128", text)
    assert "MEMBAR.SC.SYS" in text and "MEMBAR.ALL.SYS" not in text
    assert "STG.E.STRONG.SYS" in text
    # ld.acquire.sys: a strong system-scope load, then the L1 invalidation that makes later loads
    # see what the peer released.
    assert "LDG.E.STRONG.SYS" in text and "CCTL.IVALL" in text
    assert "NANOSLEEP" in text and "BPT.TRAP" in text
    assert "LDL" not in text, "register spills"
    if kernel == 0:
        assert "ATOM.E.ADD.STRONG.SYS" in text
        assert ("F2FP.SATFINITE.E4M3" in text) == (in_dtype != torch.float8_e4m3fn), "in-kernel quantization"


if __name__ == "__main__":  # a child of run_in_child
    child_main(globals())
