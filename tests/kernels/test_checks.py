"""kernels/_checks.py: the argument helpers every public function shares (CPU)."""

from __future__ import annotations

import pytest
import torch

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
