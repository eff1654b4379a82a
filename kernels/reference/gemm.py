"""Pure-torch references of the GEMM kernels (CPU path and test oracle).

Scale conventions (DeepSeek-V3): A [M, K] E4M3 with one float32 scale per 1x128 (token x K
block), B [N, K] E4M3 with one float32 scale per 128x128 block. The reference dequantizes both
operands, multiplies in float32 (or ``accum_dtype``) and rounds once to the output dtype.

FP4 weights (the ``fp8_fp4`` grouped GEMMs): B [G, N, K/2] packed E2M1 (two codes per byte,
element ``2 j`` in the low nibble, see :mod:`kernels.reference.fp4`) with one float32 scale per
1x32 (weight row x 32-deep K group), dequantized exactly to float32.
"""

from __future__ import annotations

import torch

from .fp4 import cast_back_from_fp4


def dequantize_a(a: torch.Tensor, sfa: torch.Tensor, block_k: int = 128) -> torch.Tensor:
    """[M, K] E4M3 x [M, ceil(K/128)] float32 -> [M, K] float32."""
    k = a.shape[-1]
    return a.float() * sfa.float().repeat_interleave(block_k, dim=-1)[..., :k]


def dequantize_b(b: torch.Tensor, sfb: torch.Tensor, block: int = 128) -> torch.Tensor:
    """[(G,) N, K] E4M3 x [(G,) ceil(N/128), ceil(K/128)] float32 -> [(G,) N, K] float32."""
    n, k = b.shape[-2:]
    sf = sfb.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return b.float() * sf[..., :n, :k]


def dequantize_b_fp4(b_packed: torch.Tensor, sfb: torch.Tensor, gran_k: int = 32) -> torch.Tensor:
    """[G, N, K/2] packed E2M1 (int8 or uint8) x [G, N, ceil(K/gran_k)] float32 -> [G, N, K] float32."""
    packed = b_packed.view(torch.uint8) if b_packed.dtype == torch.int8 else b_packed
    return cast_back_from_fp4(packed, sfb.float(), gran_k)


def fp8_gemm_nt(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                c: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                accum_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(A * SFA) @ (B * SFB)^T (+ C)`` -> [M, N] ``out_dtype``."""
    lhs = dequantize_a(*a).to(accum_dtype)
    rhs = dequantize_b(*b).to(accum_dtype)
    out = lhs @ rhs.t()
    if c is not None:
        out = out + c.to(accum_dtype)
    return out.to(out_dtype)


def bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None,
                 accum_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``A @ B^T (+ C)`` for bf16 A [M, K] and B [N, K] -> [M, N] bf16."""
    out = a.to(accum_dtype) @ b.to(accum_dtype).t()
    if c is not None:
        out = out + c.to(accum_dtype)
    return out.to(torch.bfloat16)


def _grouped_contiguous(lhs: torch.Tensor, rhs: torch.Tensor, m_indices: torch.Tensor, d: torch.Tensor) -> None:
    """float32 ``lhs`` [M, K] and ``rhs`` [G, N, K]: ``d[r] = lhs[r] @ rhs[m_indices[r]]^T``."""
    for g in torch.unique(m_indices).tolist():
        if g < 0 or g >= rhs.shape[0]:  # padding, or an id the kernel skips too
            continue
        rows = (m_indices == g).nonzero().squeeze(1)
        d[rows] = (lhs[rows] @ rhs[g].t()).to(d.dtype)


def _grouped_masked(a: tuple[torch.Tensor, torch.Tensor], rhs: torch.Tensor, masked_m: torch.Tensor,
                    d: torch.Tensor) -> None:
    """float32 ``rhs`` [G, N, K]: ``d[g, :masked_m[g]] = dequantize_a(A[g]) @ rhs[g]^T``."""
    for g, count in enumerate(masked_m.tolist()):
        count = max(0, min(int(count), d.shape[1]))
        if count:
            lhs = dequantize_a(a[0][g, :count], a[1][g, :count])
            d[g, :count] = (lhs @ rhs[g].t()).to(d.dtype)


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, m_indices: torch.Tensor,
                                      d: torch.Tensor) -> None:
    """bf16 A [M, K] rows grouped by ``m_indices`` [M] (-1 or an id outside [0, G): left untouched in
    ``d``): ``d[r] = A[r] @ B[g]^T`` in float32 with ``g = m_indices[r]``, B [G, N, K] bf16."""
    _grouped_contiguous(a.float(), b.float(), m_indices, d)


def m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor, d: torch.Tensor) -> None:
    """``d[g, :masked_m[g]] = A[g, :masked_m[g]] @ B[g]^T`` in float32 for bf16 A [G, max_m, K] and
    B [G, N, K]; other rows of ``d`` [G, max_m, N] are left untouched."""
    for g, count in enumerate(masked_m.tolist()):
        count = max(0, min(int(count), d.shape[1]))
        if count:
            d[g, :count] = (a[g, :count].float() @ b[g].float().t()).to(d.dtype)


def m_grouped_fp8_gemm_nt_contiguous(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                     m_indices: torch.Tensor, d: torch.Tensor) -> None:
    """Rows of A grouped by ``m_indices`` [M] (-1 or an id outside [0, G): left untouched in ``d``):
    ``d[r] = (A[r] * SFA[r]) @ (B[g] * SFB[g])^T`` with ``g = m_indices[r]``; writes ``d`` [M, N]."""
    _grouped_contiguous(dequantize_a(*a), dequantize_b(*b), m_indices, d)


def m_grouped_fp8_gemm_nt_masked(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                 masked_m: torch.Tensor, d: torch.Tensor) -> None:
    """``d[g, :masked_m[g]] = (A[g] * SFA[g]) @ (B[g] * SFB[g])^T`` for each group; other rows of
    ``d`` [G, max_m, N] are left untouched."""
    _grouped_masked(a, dequantize_b(*b), masked_m, d)


def m_grouped_fp8_fp4_gemm_nt_contiguous(a: tuple[torch.Tensor, torch.Tensor],
                                         b: tuple[torch.Tensor, torch.Tensor], m_indices: torch.Tensor,
                                         d: torch.Tensor) -> None:
    """As :func:`m_grouped_fp8_gemm_nt_contiguous` with ``b`` = (B [G, N, K/2] packed E2M1 int8 or
    uint8, SFB [G, N, K/32] float32): B dequantized by :func:`dequantize_b_fp4`."""
    _grouped_contiguous(dequantize_a(*a), dequantize_b_fp4(*b), m_indices, d)


def m_grouped_fp8_fp4_gemm_nt_masked(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                     masked_m: torch.Tensor, d: torch.Tensor) -> None:
    """As :func:`m_grouped_fp8_gemm_nt_masked` with ``b`` = (B [G, N, K/2] packed E2M1 int8 or
    uint8, SFB [G, N, K/32] float32): B dequantized by :func:`dequantize_b_fp4`."""
    _grouped_masked(a, dequantize_b_fp4(*b), masked_m, d)
