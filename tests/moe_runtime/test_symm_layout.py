"""SymmBuffer layouts (sizes, alignment, no overlap), Mega MoE sizing, and a single-process host buffer."""

import importlib.util
import random

import pytest
import torch

from moe_runtime.mega import (get_block_m, get_symm_buffer_for_mega_moe, make_mega_moe_config,
                              mega_moe_view_specs)
from moe_runtime.symm import SymmBuffer, ViewSpec, compute_layout, kViewAlignment

_kDtypes = [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.uint8]


def _check_layout(layout, specs):
    assert layout.names == tuple(s.name for s in specs)
    end = 0
    for view, spec in zip(layout.views, specs):
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        assert view.offset % layout.alignment == 0
        assert view.nbytes == itemsize * torch.Size(spec.shape).numel()
        assert view.offset >= end  # in order, no overlap
        end = view.offset + view.nbytes
    assert layout.total_bytes >= end and layout.total_bytes % layout.alignment == 0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("alignment", [16, kViewAlignment, 1024])
def test_random_layouts(seed, alignment):
    rng = random.Random(seed)
    specs = [ViewSpec(f"v{j}", tuple(rng.randint(0, 37) for _ in range(rng.randint(1, 3))), rng.choice(_kDtypes))
             for j in range(rng.randint(1, 9))]
    _check_layout(compute_layout(specs, alignment), specs)


def test_layout_by_hand_and_errors():
    layout = compute_layout([ViewSpec("a", (3,), torch.uint8), ViewSpec("b", (5, 2), torch.float32),
                             ViewSpec("c", (0,), torch.int64)])
    assert [(v.offset, v.nbytes) for v in layout.views] == [(0, 3), (128, 40), (256, 0)]
    assert layout.total_bytes == 256 and "b" in layout and layout["b"].shape == (5, 2)
    assert compute_layout([]).total_bytes == kViewAlignment
    with pytest.raises(KeyError, match="no view named 'z'"):
        layout["z"]
    with pytest.raises(ValueError, match="appears twice"):
        compute_layout([ViewSpec("a", (1,), torch.uint8)] * 2)
    with pytest.raises(ValueError, match="power of two"):
        compute_layout([], alignment=48)
    with pytest.raises(ValueError, match="non-negative"):
        compute_layout([ViewSpec("a", (-1,), torch.uint8)])
    with pytest.raises(TypeError, match="ViewSpec"):
        compute_layout([("a", (1,), torch.uint8)])


@pytest.mark.parametrize("ranks,experts,tokens,topk,hidden,inter,fp8,weights", [
    (8, 256, 4096, 8, 7168, 2048, True, "fp8"),
    (2, 8, 100, 2, 256, 512, True, "fp4"),
    (4, 16, 1, 6, 512, 128, False, "bf16"),
    (1, 4, 129, 4, 128, 256, False, "fp8"),
])
def test_mega_moe_sizes(ranks, experts, tokens, topk, hidden, inter, fp8, weights):
    cfg = make_mega_moe_config(ranks, experts, tokens, topk, hidden, inter, fp8, weights)
    block_m = get_block_m()
    t = cfg.num_max_tokens_per_rank
    assert t % block_m == 0 and tokens <= t < tokens + block_m
    e_local = experts // ranks
    # Worst case: every local expert's segment padded to block_m.
    assert cfg.num_max_recv_rows % block_m == 0
    assert cfg.num_max_recv_rows >= ranks * t * min(topk, e_local) + e_local * (block_m - 1)
    specs = mega_moe_view_specs(cfg)
    layout = compute_layout(specs)
    _check_layout(layout, specs)
    names = set(layout.names)
    assert ("x_sf" in names) == fp8 and ("l1_acts_sf" in names) == fp8
    assert ("l2_acts_sf" in names) == (weights != "bf16")
    assert layout["x"].dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert layout["x"].shape == (t, hidden) and layout["topk_idx"].shape == (t, topk)
    assert layout["l1_acts"].shape == (cfg.num_max_recv_rows, hidden)
    assert layout["l2_acts"].shape == (cfg.num_max_recv_rows, inter)
    assert layout["combine"].shape == (t, topk, hidden)
    slots = cfg.signal_slots
    assert layout["signals"].shape == (ranks + ranks * e_local + e_local,) == (slots.total,)
    assert slots.barrier == slice(0, ranks) and slots.expert_counters.stop == slots.total


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=10), "divisible"),
    (dict(hidden=200), "multiple of 128"),
    (dict(intermediate_hidden=64), "multiple of 128"),
    (dict(weights="int4"), "weights"),
    (dict(activation="gelu"), "activation"),
    (dict(weights="bf16"), "use_fp8_dispatch"),
    (dict(num_topk=0), "num_topk"),
    (dict(num_topk=40), "exceeds"),
    (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank"),
])
def test_mega_moe_config_errors(kwargs, match):
    args = dict(num_ranks=4, num_experts=32, num_max_tokens_per_rank=64, num_topk=4, hidden=256,
                intermediate_hidden=256)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        make_mega_moe_config(**args)


@pytest.mark.parametrize("value", ["yes", None, 1])
def test_mega_moe_config_use_fp8_dispatch_must_be_a_bool(value):
    with pytest.raises(TypeError, match=f"use_fp8_dispatch must be a bool, got {value!r}"):
        make_mega_moe_config(4, 32, 64, 4, 256, 256, use_fp8_dispatch=value)


def test_single_process_host_buffer():
    with get_symm_buffer_for_mega_moe(None, 8, 10, 2, 256, 128, backend="host") as buf:
        assert buf.backend == "host" and buf.world_size == 1 and buf.rank == 0
        assert buf.config.num_max_tokens_per_rank == get_block_m()
        assert bool((buf.view("signals") == 0).all())
        x = buf.view("x")
        assert x.dtype == torch.float8_e4m3fn and x.shape == (128, 256)
        assert x.data_ptr() % kViewAlignment == 0
        values = torch.randn(128, 256).to(torch.float8_e4m3fn)
        x.copy_(values)
        assert torch.equal(buf.peer_view("x", 0).view(torch.uint8), values.view(torch.uint8))
        assert buf.view_ptrs("x") == [buf.peer_ptrs[0] + buf.layout["x"].offset]
        assert buf["topk_idx"].dtype == torch.int64
        buf.barrier()
        with pytest.raises(ValueError, match="peer must be"):
            buf.peer_view("x", 1)
    assert buf.destroyed
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.view("x")
    buf.destroy()


def test_symm_buffer_errors():
    layout = compute_layout([ViewSpec("a", (4,), torch.float32)])
    with pytest.raises(ValueError, match="backend must be one of"):
        SymmBuffer(layout, backend="mpi")
    with pytest.raises(TypeError, match="SymmLayout"):
        SymmBuffer([ViewSpec("a", (4,), torch.float32)], backend="host")
    with pytest.raises(ValueError, match="CUDA device"):
        SymmBuffer(layout, backend="torch", device="cpu")
    with pytest.raises(ValueError, match="CPU memory"):
        SymmBuffer(layout, backend="host", device="meta")
    with pytest.raises(ValueError, match="device must be a torch.device or a device string .* got 'gpu0'"):
        SymmBuffer(layout, backend="host", device="gpu0")


def test_nvshmem_backend_missing_package_is_a_clear_error(monkeypatch):
    if importlib.util.find_spec("nvshmem") is not None:
        pytest.skip("nvshmem4py is installed here")
    import moe_runtime.symm as symm

    # The package is looked for once the device is settled; a machine without CUDA would stop at that.
    monkeypatch.setattr(symm, "as_device", lambda value, name: torch.device(value))
    layout = compute_layout([ViewSpec("a", (4,), torch.float32)])
    with pytest.raises(RuntimeError, match="nvshmem4py-cu13"):
        SymmBuffer(layout, backend="nvshmem", device="cuda:0")
