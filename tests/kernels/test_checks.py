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
])
def test_public_gemms_name_empty_k_and_sparse_operands(call, error, match):
    with pytest.raises(error, match=match):
        call()
