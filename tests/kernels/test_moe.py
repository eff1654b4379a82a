"""kernels.moe_combine: the slot-ordered float32 combine against an explicit per-token loop (CPU),
the CUDA kernel bit for bit against the torch path, argument checks."""

from __future__ import annotations

import pytest
import torch

import kernels


def _problem(num_tokens: int, top_k: int, hidden: int, spare: int, device="cpu"):
    src = torch.randn(num_tokens * top_k + spare, hidden, device=device).to(torch.bfloat16)
    rows = torch.randperm(src.shape[0], device=device)[: num_tokens * top_k]
    routed = torch.rand(num_tokens, top_k, device=device) < 0.8
    return src, rows, routed


def _explicit(src, rows, routed, num_tokens, top_k, out_dtype):
    out = torch.empty(num_tokens, src.shape[1], dtype=out_dtype)
    for t in range(num_tokens):
        acc = torch.zeros(src.shape[1], dtype=torch.float32)
        for j in range(top_k):
            if routed is None or routed[t, j]:
                acc = acc + src[t * top_k + j if rows is None else rows[t * top_k + j]].float()
        out[t] = acc.to(out_dtype)
    return out


@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 256), (7, 3, 64), (20, 1, 1024), (5, 8, 40)])
@pytest.mark.parametrize("with_rows,with_routed", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_combine_sums_routed_slots_in_order(seed, num_tokens, top_k, hidden, with_rows, with_routed, out_dtype):
    src, rows, routed = _problem(num_tokens, top_k, hidden, spare=5)
    rows, routed = (rows if with_rows else None), (routed if with_routed else None)
    got = kernels.moe_combine(src, rows, routed, num_tokens, top_k, out_dtype)
    assert got.dtype == out_dtype and got.shape == (num_tokens, hidden)
    assert torch.equal(got, _explicit(src, rows, routed, num_tokens, top_k, out_dtype))


def test_unrouted_rows_are_not_read(seed):
    src, rows, routed = _problem(4, 2, 64, spare=0)
    routed[1, 0] = False
    src[rows[2]] = float("nan")  # token 1, slot 0
    out = kernels.moe_combine(src, rows, routed, 4, 2)
    assert torch.isfinite(out).all()


def test_zero_tokens():
    out = kernels.moe_combine(torch.zeros(3, 16, dtype=torch.bfloat16), None, None, 0, 4, torch.float32)
    assert out.shape == (0, 16) and out.dtype == torch.float32


@pytest.mark.parametrize("kwargs,match", [
    (dict(src=torch.zeros(4, 16)), "src must be a contiguous bfloat16"),
    (dict(rows=torch.zeros(3, dtype=torch.int64)), r"rows must be None or a contiguous int64 tensor of shape \[4\]"),
    (dict(rows=torch.tensor([0, 1, 2, 9])), "rows must index src's 4 rows"),
    (dict(routed=torch.ones(2, 3, dtype=torch.bool)), r"routed must be None or a contiguous bool tensor of shape \[2, 2\]"),
    (dict(out_dtype=torch.float16), "out_dtype must be bfloat16 or float32"),
    (dict(top_k=0), "top_k must be a positive int"),
    (dict(src=torch.zeros(3, 16, dtype=torch.bfloat16)), "fewer than num_tokens \\* top_k = 4"),
])
def test_bad_input(kwargs, match):
    args = dict(src=torch.zeros(4, 16, dtype=torch.bfloat16), rows=None, routed=None, num_tokens=2, top_k=2,
                out_dtype=torch.bfloat16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kernels.moe_combine(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 7168), (33, 8, 7168), (5, 3, 1024), (300, 2, 256)])
@pytest.mark.parametrize("with_rows,with_routed", [(True, True), (False, False)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_combine_equals_the_torch_path(seed, num_tokens, top_k, hidden, with_rows, with_routed, out_dtype):
    src, rows, routed = _problem(num_tokens, top_k, hidden, spare=7, device="cuda")
    if with_routed:
        src[rows[~routed.flatten()]] = float("nan")  # unrouted rows must not be read
    rows, routed = (rows if with_rows else None), (routed if with_routed else None)
    got = kernels.moe_combine(src, rows, routed, num_tokens, top_k, out_dtype)
    from kernels.moe import _combine_reference
    assert torch.equal(got, _combine_reference(src, rows, routed, num_tokens, top_k, out_dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_combine_row_out_of_range_gives_nan():
    src = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    rows = torch.tensor([0, 1, 2, 100], device="cuda")
    out = kernels.moe_combine(src, rows, None, 2, 2)
    torch.cuda.synchronize()
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
