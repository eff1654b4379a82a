"""Reference of the L1 GEMM with the SwiGLU epilogue (:mod:`kernels.grouped_swiglu`): the grouped
GEMM into bf16, then ``act = silu(gate) * up * w`` in float32, quantized with one float32 scale per
1 x 128 — the staged path's two steps, so both paths share one numerics contract.

Weights are gate/up interleaved in 16-row slabs (rows ``16j .. 16j + 7`` gate rows ``8j ..``, rows
``16j + 8 .. 16j + 15`` the matching up rows) with one scale per 128-row block and half: SFB
[G, 2I/128, 2, K/128], ``[g, b, 0]`` for the gate rows of block ``b``, ``[g, b, 1]`` for its up rows.
"""

from __future__ import annotations

import torch

from .gemm import _grouped_contiguous, _grouped_masked, dequantize_a
from .quant import per_token_cast_to_fp8

kSlab = 16


def deinterleave_gate_up(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up interleaved in 16-column slabs -> [..., 2I] as ``[gate | up]``."""
    *lead, n = x.shape
    slabs = x.reshape(*lead, n // kSlab, 2, kSlab // 2)
    return torch.cat([slabs[..., 0, :].reshape(*lead, n // 2), slabs[..., 1, :].reshape(*lead, n // 2)], dim=-1)


def dequantize_b_interleaved(b: torch.Tensor, sfb: torch.Tensor, block: int = 128) -> torch.Tensor:
    """[G, N, K] E4M3 (gate/up interleaved) x [G, N/128, 2, ceil(K/128)] float32 -> [G, N, K] float32."""
    n, k = b.shape[-2:]
    rows = torch.arange(n, device=b.device)
    row_sf = sfb.float()[:, rows // block, (rows % kSlab >= kSlab // 2).long()]  # [G, N, K blocks]
    return b.float() * row_sf.repeat_interleave(block, dim=-1)[..., :k]


def swiglu_quant(h: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``h`` [M, 2I] as ``[gate | up]``, float32 ``weights`` [M] -> (act E4M3 [M, I], sf float32 [M, I/128])."""
    inter = h.shape[-1] // 2
    act = torch.nn.functional.silu(h[:, :inter].float()).mul_(h[:, inter:].float()).mul_(weights.reshape(-1, 1))
    # ``act`` follows h's layout: a column-major h must not reach the quantizer, which takes rows with a
    # contiguous last dim.
    return per_token_cast_to_fp8(act.contiguous(), use_ue8m0=False, gran_k=128)


def _write_rows(rows: torch.Tensor, h: torch.Tensor, weights: torch.Tensor, act: torch.Tensor,
                act_sf: torch.Tensor) -> None:
    if rows.numel() == 0:
        return
    out, sf = swiglu_quant(deinterleave_gate_up(h[rows]), weights[rows])
    act[rows] = out
    act_sf[rows] = sf


def m_grouped_fp8_gemm_nt_swiglu_contiguous(a: tuple[torch.Tensor, torch.Tensor],
                                            b: tuple[torch.Tensor, torch.Tensor], m_indices: torch.Tensor,
                                            weights: torch.Tensor, act: torch.Tensor, act_sf: torch.Tensor) -> None:
    """Rows with a group id in [0, G) get ``act[r], act_sf[r]`` of ``SwiGLU(A[r] @ B[g]^T) * weights[r]``;
    the other rows of ``act`` [M, I] and ``act_sf`` [M, I/128] are left untouched."""
    b_t, sfb = b
    h = torch.zeros((a[0].shape[0], b_t.shape[1]), dtype=torch.bfloat16, device=a[0].device)
    _grouped_contiguous(dequantize_a(*a), dequantize_b_interleaved(b_t, sfb), m_indices, h)
    valid = ((m_indices >= 0) & (m_indices < b_t.shape[0])).nonzero().squeeze(1)
    _write_rows(valid, h, weights.reshape(-1), act, act_sf)


def m_grouped_fp8_gemm_nt_swiglu_masked(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                        masked_m: torch.Tensor, weights: torch.Tensor, act: torch.Tensor,
                                        act_sf: torch.Tensor) -> None:
    """``act[g, :masked_m[g]]`` and ``act_sf[g, :masked_m[g]]`` for each group (``act`` [G, max_m, I],
    ``act_sf`` [G, max_m, I/128], ``weights`` [G, max_m]); other rows are left untouched."""
    b_t, sfb = b
    groups, max_m = a[0].shape[:2]
    h = torch.zeros((groups, max_m, b_t.shape[1]), dtype=torch.bfloat16, device=a[0].device)
    _grouped_masked(a, dequantize_b_interleaved(b_t, sfb), masked_m, h)
    for g, count in enumerate(masked_m.tolist()):
        count = max(0, min(int(count), max_m))
        _write_rows(torch.arange(count, device=h.device), h[g], weights[g].reshape(-1), act[g], act_sf[g])
