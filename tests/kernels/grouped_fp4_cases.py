"""Shared cases of the FP8 x FP4 grouped GEMM tests (test_grouped_fp4.py, test_grouped_fp4_staged.py):
FP4 weights in the SFB forms the GEMMs accept, contiguous and masked calls on NaN-poisoned outputs,
and their float64 references on the dequantized weights."""

from __future__ import annotations

import torch

import kernels
from kernels.reference.gemm import dequantize_a, dequantize_b_fp4
from kernels.reference.quant import per_token_cast_to_fp8
from kernels.testing import calc_diff

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
TOLERANCE = 2e-3
SF_FORMS = {  # the SFB forms the GEMMs accept, from the float32 scales of per_token_cast_to_fp4
    "float32": lambda sf: sf,
    "uint8": kernels.transform_sf_for_fp4_gemm,
    "e8m0": lambda sf: kernels.transform_sf_for_fp4_gemm(sf).view(E8M0),
}


def make_weights(g: int, n: int, k: int, device: str, spread: int = 0):
    """FP4 weights ``(B int8 [g, n, k/2], SFB float32 [g, n, k/32])``. With ``spread``, each 1x32
    group gets the scale 2^-r, r uniform in [0, spread], exactly (its first element is +-6 * 2^-r,
    the others uniform below), so scales within a 128-K block differ by up to 2^spread."""
    if not spread:
        return kernels.per_token_cast_to_fp4(torch.randn(g, n, k, device=device, dtype=torch.bfloat16))
    w = (torch.rand(g, n, k // 32, 32, device=device) * 12 - 6)
    w[..., 0] = torch.where(torch.rand(g, n, k // 32, device=device) < 0.5, -6.0, 6.0)
    r = torch.randint(0, spread + 1, (g, n, k // 32, 1), device=device, dtype=torch.int32)
    scale = ((127 - r) << 23).view(torch.float32)  # 2^-r, built from its bits: exact on every device
    b, sf = kernels.per_token_cast_to_fp4((w * scale).view(g, n, k).to(torch.bfloat16))
    assert torch.equal(sf, scale[..., 0])
    return b, sf


def weights_of(b, group: int) -> torch.Tensor:
    """float64 [N, K] dequantized weights of one group (float32 SFB)."""
    return dequantize_b_fp4(b[0][group], b[1][group]).double()


def make_contiguous(counts: list[int], k: int, device: str, pad_blocks: int = 0):
    """Rows of each group padded to the alignment, plus ``pad_blocks`` whole padding blocks at the
    front and at the back; returns ((A, SFA), m_indices)."""
    align = kernels.get_mk_alignment_for_contiguous_layout()
    m_indices = [-1] * (align * pad_blocks)
    for g, c in enumerate(counts):
        m_indices += [g] * c + [-1] * (-c % align)
    m_indices += [-1] * (align * pad_blocks)
    m_indices = torch.tensor(m_indices, dtype=torch.int32, device=device)
    a = torch.randn(len(m_indices), k, device=device, dtype=torch.bfloat16)
    return per_token_cast_to_fp8(a), m_indices


def contiguous_rows(counts: list[int], pad_blocks: int = 1) -> int:
    """Rows of make_contiguous's layout."""
    align = kernels.get_mk_alignment_for_contiguous_layout()
    return sum(-(-c // align) * align for c in counts) + 2 * pad_blocks * align


def untouched_rows(m_indices: torch.Tensor) -> torch.Tensor:
    """Rows ``d`` must keep: every -1 row on the CPU; on the GPU the rows of whole padding blocks
    (a padding row inside a group's last block is computed from whatever A holds there)."""
    if m_indices.device.type == "cpu":
        return m_indices < 0
    align = kernels.get_mk_alignment_for_contiguous_layout()
    return (m_indices.view(-1, align)[:, :1] < 0).expand(-1, align).reshape(-1)


def expected_contiguous(a_fp8, b, m_indices) -> torch.Tensor:
    lhs = dequantize_a(*a_fp8).double()
    out = torch.zeros(lhs.shape[0], b[0].shape[1], dtype=torch.float64, device=lhs.device)
    for g in torch.unique(m_indices).tolist():
        if 0 <= g < b[0].shape[0]:
            rows = m_indices == g
            out[rows] = lhs[rows] @ weights_of(b, g).t()
    return out


def run_contiguous(counts, n, k, device, sf_form="float32", spread=0, pad_blocks=1):
    b = make_weights(len(counts), n, k, device, spread)
    a_fp8, m_indices = make_contiguous(counts, k, device, pad_blocks)
    d = torch.full((m_indices.shape[0], n), float("nan"), dtype=torch.bfloat16, device=device)
    kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a_fp8, (b[0], SF_FORMS[sf_form](b[1])), d, m_indices)
    return a_fp8, b, m_indices, d


def check_contiguous(counts, n, k, device, sf_form="float32", spread=0):
    a_fp8, b, m_indices, d = run_contiguous(counts, n, k, device, sf_form, spread)
    valid = m_indices >= 0
    assert torch.isfinite(d[valid]).all(), "valid rows not fully written"
    if valid.any():
        assert calc_diff(d[valid], expected_contiguous(a_fp8, b, m_indices)[valid]) < TOLERANCE
    assert torch.isnan(d[untouched_rows(m_indices)]).all(), "padding rows written"


def run_masked(masked, max_m, n, k, expected_m, device, sf_form="float32", spread=0):
    g = len(masked)
    b = make_weights(g, n, k, device, spread)
    a_fp8, sfa = per_token_cast_to_fp8(torch.randn(g * max_m, k, device=device, dtype=torch.bfloat16))
    a_fp8 = (a_fp8.view(g, max_m, k), sfa.view(g, max_m, -1))
    masked_m = torch.tensor(masked, dtype=torch.int32, device=device)
    d = torch.full((g, max_m, n), float("nan"), dtype=torch.bfloat16, device=device)
    kernels.m_grouped_fp8_fp4_gemm_nt_masked(a_fp8, (b[0], SF_FORMS[sf_form](b[1])), d, masked_m, expected_m)
    return a_fp8, b, d


def check_masked(masked, max_m, n, k, expected_m, device, sf_form="float32", spread=0):
    a_fp8, b, d = run_masked(masked, max_m, n, k, expected_m, device, sf_form, spread)
    for i, count in enumerate(masked):
        count = max(0, min(count, max_m))
        if count:
            got = d[i, :count]
            assert torch.isfinite(got).all(), f"group {i}: rows not fully written"
            ref = dequantize_a(a_fp8[0][i, :count], a_fp8[1][i, :count]).double() @ weights_of(b, i).t()
            assert calc_diff(got, ref) < TOLERANCE, f"group {i}"
        # The GPU stores boxes of 8 rows up to masked_m; the rows between are unspecified.
        untouched = count if device == "cpu" else -(-count // 8) * 8
        assert torch.isnan(d[i, untouched:]).all(), f"group {i}: rows past masked_m written"
