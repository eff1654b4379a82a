"""kernels/_checks.py: the argument helpers every public function shares (CPU)."""

from __future__ import annotations

import pytest
import torch

import kernels
from gemm_cases import strided_nested
from kernels import _checks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_vector_rows_keeps_aligned_rows_and_copies_the_rest(dtype):
    """Rows a kernel reads 16 bytes at a time: contiguous, 16-byte aligned rows (also with a wider,
    aligned row stride) pass through as the same tensor; a misaligned base or row stride, or a
    strided last dim, come back as a contiguous copy with the same values."""
    hidden = 128
    wide = torch.arange(8 * (hidden + 64)).to(dtype).view(8, hidden + 64)
    for x in (wide[:, :hidden].contiguous(), wide[:, :hidden]):
        assert _checks.vector_rows(x, hidden) is x
    misaligned_base = wide.view(-1)[1:1 + 7 * (hidden + 64)].view(7, hidden + 64)[:, :hidden]
    odd_stride = torch.arange(8 * (hidden + 1)).to(dtype).view(8, hidden + 1)[:, :hidden]
    strided_last = wide[:, : 2 * 64 : 2]
    for x, row_elems in ((misaligned_base, hidden), (odd_stride, hidden), (strided_last, 64)):
        y = _checks.vector_rows(x, row_elems)
        assert y is not x and y.is_contiguous() and torch.equal(y, x)
        assert y.data_ptr() % 16 == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_contiguous_aligned_keeps_dense_aligned_rows_and_copies_the_rest(dtype):
    """Rows addressed by their width alone: a contiguous tensor on a 16-byte aligned base passes
    through as the same tensor; a padded row stride or a misaligned base comes back as a contiguous,
    aligned copy with the same values."""
    hidden = 128
    wide = torch.arange(8 * (hidden + 64)).to(dtype).view(8, hidden + 64)
    dense = wide[:, :hidden].contiguous()
    assert _checks.contiguous_aligned(dense) is dense
    misaligned = dense.view(-1)[1:1 + 7 * hidden].view(7, hidden)
    assert misaligned.is_contiguous() and misaligned.data_ptr() % 16
    for x in (wide[:, :hidden], misaligned):
        y = _checks.contiguous_aligned(x)
        assert y is not x and y.is_contiguous() and torch.equal(y, x)
        assert y.data_ptr() % 16 == 0


_FP8 = torch.float8_e4m3fn


def _pair(rows: int, k: int, sf_cols: int | None = None):
    return torch.zeros(rows, k, dtype=_FP8), torch.ones(rows, max(k // 128, 1) if sf_cols is None else sf_cols)


# Through the public GEMMs (CPU): check_fp8_operand with K = 0 names K, not A's strides (torch gives an
# [M, 0] tensor unit strides); check_scales refuses a sparse scale tensor before the reference reads
# it. bf16_gemm_nt's own checks (kernels/gemm.py) sit here too: tests/kernels/test_gemm.py is not ours.
@pytest.mark.parametrize("call,error,match", [
    (lambda: kernels.fp8_gemm_nt((torch.zeros(4, 0, dtype=_FP8), torch.ones(4, 0)),
                                 (torch.zeros(16, 0, dtype=_FP8), torch.ones(1, 0)),
                                 torch.empty(4, 16, dtype=torch.bfloat16)),
     ValueError, "fp8_gemm_nt: K must be a positive multiple of 128, got 0"),
    (lambda: kernels.m_grouped_fp8_gemm_nt_contiguous((torch.zeros(4, 0, dtype=_FP8), torch.ones(4, 0)),
                                                      (torch.zeros(1, 16, 0, dtype=_FP8), torch.ones(1, 1, 0)),
                                                      torch.empty(4, 16, dtype=torch.bfloat16),
                                                      torch.zeros(4, dtype=torch.int32)),
     ValueError, "m_grouped_fp8_gemm_nt_contiguous: K must be a positive multiple of 128, got 0"),
    (lambda: kernels.fp8_gemm_nt((torch.zeros(4, 128, dtype=_FP8), torch.ones(4, 1).to_sparse()), _pair(16, 128),
                                 torch.empty(4, 16, dtype=torch.bfloat16)),
     ValueError, r"fp8_gemm_nt: a\[1\] \(SFA\) must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    (lambda: kernels.bf16_gemm_nt(torch.zeros(4, 0, dtype=torch.bfloat16), torch.zeros(16, 0, dtype=torch.bfloat16),
                                  torch.empty(4, 16, dtype=torch.bfloat16)),
     ValueError, "bf16_gemm_nt: N must be a positive multiple of 8 and K of 64, got N=16, K=0"),
    (lambda: kernels.bf16_gemm_nt(torch.zeros(4, 64, dtype=torch.bfloat16).to_sparse(),
                                  torch.zeros(16, 64, dtype=torch.bfloat16), torch.empty(4, 16, dtype=torch.bfloat16)),
     ValueError, "bf16_gemm_nt: a must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
    (lambda: kernels.bf16_gemm_nt(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16),
                                  torch.empty(4, 16, dtype=torch.bfloat16),
                                  strided_nested(torch.empty(4, 16, dtype=torch.bfloat16), 1)),
     ValueError, "bf16_gemm_nt: c must be a dense \\(strided\\) tensor, got a nested tensor"),
    (lambda: kernels.bf16_gemm_nt(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16),
                                  strided_nested(torch.empty(4, 16, dtype=torch.bfloat16), 1)),
     ValueError, "bf16_gemm_nt: d must be a dense \\(strided\\) tensor, got a nested tensor"),
    (lambda: kernels.bf16_gemm_nt(torch._neg_view(torch.zeros(4, 64, dtype=torch.bfloat16)),
                                  torch.zeros(16, 64, dtype=torch.bfloat16), torch.empty(4, 16, dtype=torch.bfloat16)),
     ValueError, "bf16_gemm_nt: a must not be a lazily negated view"),
    (lambda: kernels.bf16_gemm_nt(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16),
                                  torch.empty(4, 16, dtype=torch.bfloat16), torch._neg_view(torch.zeros(4, 16))),
     ValueError, "bf16_gemm_nt: c must not be a lazily negated view"),
])
def test_public_gemms_name_empty_k_and_sparse_operands(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _routing_args() -> dict:
    """Valid CPU arguments of the routing and exchange entry points (T = 4 tokens, k = 2, H = 256, E = 8)."""
    tokens, hidden, top_k, experts = 4, 256, 2, 8
    return {
        "xq": torch.randn(tokens, hidden).to(_FP8), "xs": torch.rand(tokens, hidden // 128),
        "topk_idx": torch.randint(0, experts, (tokens, top_k)), "topk_weights": torch.rand(tokens, top_k),
        "src": torch.randn(tokens * top_k, hidden, dtype=torch.bfloat16), "rows": torch.arange(tokens * top_k),
        "routed": torch.ones(tokens, top_k, dtype=torch.bool), "logits": torch.randn(tokens, experts),
        "score_bias": torch.rand(experts), "h": torch.randn(tokens, 512, dtype=torch.bfloat16),
        "weights": torch.rand(tokens), "counts": torch.randint(0, 3, (2, 2 * experts + 1), dtype=torch.int32),
    }


# Each entry point with the tensors it takes (the rest fixed); the base call runs on the CPU.
_ROUTING_CALLS = {
    "moe_combine": (lambda a: kernels.moe_combine(a["src"], a["rows"], a["routed"], 4, 2), ("src", "rows", "routed")),
    "moe_local_dispatch": (lambda a: kernels.moe_local_dispatch(a["xq"], a["xs"], a["topk_idx"], a["topk_weights"], 8),
                           ("xq", "xs", "topk_idx", "topk_weights")),
    "moe_route": (lambda a: kernels.moe_route(a["logits"], 2, score_bias=a["score_bias"]), ("logits", "score_bias")),
    "swiglu_quant_fp8": (lambda a: kernels.swiglu_quant_fp8(a["h"], a["weights"]), ("h", "weights")),
    "exchange_count": (lambda a: kernels.exchange_count(a["topk_idx"], 8), ("topk_idx",)),
    "exchange_sizes": (lambda a: kernels.exchange_sizes(a["counts"], 0, 8, 128), ("counts",)),
}


def _not_dense(kind: str, t: torch.Tensor) -> torch.Tensor:
    return strided_nested(t, 1) if kind == "nested" else t.to_sparse()


@pytest.mark.parametrize("kind", ["nested", "sparse"])
@pytest.mark.parametrize("fn", sorted(_ROUTING_CALLS))
def test_routing_entry_points_name_a_tensor_that_is_not_dense(fn, kind):
    """A nested or sparse tensor in any tensor argument is named before its shape is read (torch's own
    errors there, an internal RuntimeError or a sparse op's NotImplementedError, name nothing)."""
    call, names = _ROUTING_CALLS[fn]
    args = _routing_args()
    call(args)
    for name in names:
        bad = _not_dense(kind, args[name].view(torch.uint8) if args[name].dtype == _FP8 else args[name])
        expected = "a nested tensor" if kind == "nested" else "layout torch.sparse_coo"
        with pytest.raises(ValueError, match=rf"{fn}: {name} must be a dense \(strided\) tensor, got {expected}"):
            call({**args, name: bad})


# The CUDA-only and peer-taking entry points check density first, before their peers or layout.
_EXCHANGE_AND_EP_CALLS = [
    (lambda t: kernels.exchange_count_sizes(t, 4, None, None, None, 0, 128), "topk_idx"),
    (lambda t: kernels.exchange_barrier(t, None, 0), "flag_rows"),
    (lambda t: kernels.exchange_dispatch(None, t, None, None, None, None, None, 4, 128, 0, 0), "xq"),
    (lambda t: kernels.exchange_combine(None, t, None), "expert_out"),
    (lambda t: kernels.ep_dispatch(None, t, None, None, None), "x"),
    (lambda t: kernels.ep_combine(None, t), "expert_out"),
]


@pytest.mark.parametrize("call,name", _EXCHANGE_AND_EP_CALLS)
@pytest.mark.parametrize("kind", ["nested", "sparse"])
def test_exchange_and_ep_entry_points_name_a_tensor_that_is_not_dense(call, name, kind):
    bad = _not_dense(kind, torch.randint(0, 8, (4, 2)))
    with pytest.raises(ValueError, match=rf": {name} must be a dense \(strided\) tensor"):
        call(bad)


@pytest.mark.parametrize("call,name", _EXCHANGE_AND_EP_CALLS)
def test_exchange_and_ep_entry_points_refuse_a_negated_view(call, name):
    """A lazily negated view, which their kernels would read as its memory, is named as early."""
    with pytest.raises(ValueError, match=rf": {name} must not be a lazily negated view"):
        call(torch._neg_view(torch.randint(0, 8, (4, 2))))


# Lazily negated views (the negative bit; what conj().imag of a complex tensor gives): the kernels
# read memory, so the entry points that hand a tensor to one refuse it by name, and those that
# resolve it first (routing, SwiGLU) give the values it shows.
_kRefusesNegated = ("moe_combine", "moe_local_dispatch", "exchange_count", "exchange_sizes")


@pytest.mark.parametrize("fn", sorted(_ROUTING_CALLS))
def test_routing_entry_points_and_negated_views(fn):
    call, names = _ROUTING_CALLS[fn]
    args = _routing_args()
    for name in names:
        if args[name].dtype in (torch.bool, _FP8):
            continue  # no negative bit for these in torch
        negated = torch._neg_view(-args[name])
        assert negated.is_neg() and torch.equal(negated, args[name])
        if fn in _kRefusesNegated:
            with pytest.raises(ValueError, match=rf"{fn}: {name} must not be a lazily negated view"):
                call({**args, name: negated})
        else:
            want, got = call(args), call({**args, name: negated})
            assert all(torch.equal(w, g) for w, g in zip(want, got))
