"""Shared cases of the grouped GEMM tests (test_grouped.py, test_grouped_sfa_copy.py): FP8 weights and
contiguous layouts, their float64 reference, one NaN-poisoned contiguous or masked call and its kernel plan."""

from __future__ import annotations

import torch

import kernels
from kernels.reference.gemm import dequantize_a, dequantize_b
from kernels.reference.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from kernels.testing import calc_diff

GROUPED_NK = [(4096, 7168), (7168, 2048)]


def make_weights(g: int, n: int, k: int, device: str):
    """[G, N, K] E4M3 weights and their block scales, quantized a group at a time: 256 experts of
    4096 x 7168 whole would take the reference quantizer's ~60 GB of float32 temporaries, more than
    an H100 holds beside the other test workers."""
    w = torch.empty(g, n, k, device=device, dtype=torch.float8_e4m3fn)
    sf = torch.empty(g, (n + 127) // 128, (k + 127) // 128, device=device, dtype=torch.float32)
    for i in range(g):
        w[i], sf[i] = per_block_cast_to_fp8(torch.randn(n, k, device=device, dtype=torch.bfloat16))
    return w, sf


def make_contiguous(counts: list[int], k: int, device: str, align: int = 128):
    """Rows of each group padded to ``align``; returns (a_fp8, m_indices, row groups)."""
    m_indices = []
    for g, c in enumerate(counts):
        padded = (c + align - 1) // align * align
        m_indices += [g] * c + [-1] * (padded - c)
    m_indices = torch.tensor(m_indices, dtype=torch.int32, device=device)
    a = torch.randn(len(m_indices), k, device=device, dtype=torch.bfloat16)
    return per_token_cast_to_fp8(a), m_indices


def expected_contiguous(a_fp8, b_fp8, m_indices) -> torch.Tensor:
    lhs = dequantize_a(*a_fp8).double()
    out = torch.zeros(lhs.shape[0], b_fp8[0].shape[1], dtype=torch.float64, device=lhs.device)
    for g in range(b_fp8[0].shape[0]):
        rows = m_indices == g
        if rows.any():
            out[rows] = lhs[rows] @ dequantize_b(b_fp8[0][g], b_fp8[1][g]).double().t()
    return out


def assert_contiguous_rows(d, a_fp8, b_fp8, m_indices) -> None:
    """Every valid row written and right against float64."""
    valid = m_indices >= 0
    assert torch.isfinite(d[valid]).all(), "valid rows not fully written"
    assert calc_diff(d[valid], expected_contiguous(a_fp8, b_fp8, m_indices)[valid]) < 1e-3


def assert_same_output(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit the same output, NaN (never written) in the same places."""
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: other rows written"
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), what


def run_contiguous(a_fp8, b_fp8, m_indices, n: int) -> torch.Tensor:
    """D of one contiguous call, poisoned with NaN before it."""
    d = torch.full((m_indices.shape[0], n), float("nan"), dtype=torch.bfloat16, device=m_indices.device)
    kernels.m_grouped_fp8_gemm_nt_contiguous(a_fp8, b_fp8, d, m_indices)
    return d


def contiguous_outputs_per_setting(counts, n, k, switch, values, monkeypatch, check=None):
    """Fresh weights and contiguous rows (`counts` per group); one NaN-poisoned call per value of the
    environment `switch` (`check(value, plan)` on each plan first). Returns (a_fp8, b_fp8, m_indices,
    {value: d}), synchronized."""
    b_fp8 = make_weights(len(counts), n, k, "cuda")
    a_fp8, m_indices = make_contiguous(counts, k, "cuda")
    outputs = {}
    for value in values:
        monkeypatch.setenv(switch, value)
        if check is not None:
            check(value, contiguous_config(m_indices, n, k, len(counts)))
        outputs[value] = run_contiguous(a_fp8, b_fp8, m_indices, n)
    torch.cuda.synchronize()
    return a_fp8, b_fp8, m_indices, outputs


def contiguous_config(m_indices, n: int, k: int, num_groups: int) -> dict:
    """The kernel plan of a contiguous call on this device (alignment 128)."""
    return kernels.jit.native_module().fp8_gemm_nt_config(m_indices.shape[0], n, k, kernels.get_num_sms(),
                                                          gemm_type=1, num_groups=num_groups, alignment=128)


def make_masked(masked: list[int], max_m: int, k: int, device: str = "cuda"):
    """Activations of a masked call, max_m rows per group (a [G, max_m, K] E4M3 and its K-major scales
    [G, max_m, K / 128]), and masked_m (int32 [G]) from `masked`. Returns (a, masked_m)."""
    g = len(masked)
    a_fp8, sfa = per_token_cast_to_fp8(torch.randn(g * max_m, k, device=device, dtype=torch.bfloat16))
    a = (a_fp8.view(g, max_m, k), sfa.view(g, max_m, -1))
    return a, torch.tensor(masked, dtype=torch.int32, device=device)


def run_masked(a, b_fp8, masked_m, expected_m: int, n: int) -> torch.Tensor:
    """D of one masked call, poisoned with NaN before it."""
    g, max_m = a[0].shape[:2]
    d = torch.full((g, max_m, n), float("nan"), dtype=torch.bfloat16, device=masked_m.device)
    kernels.m_grouped_fp8_gemm_nt_masked(a, b_fp8, d, masked_m, expected_m)
    return d


def assert_masked_rows(d, a, b_fp8, masked: list[int]) -> None:
    """Each group's rows below masked_m written and right against float64; those from masked_m
    rounded up to 8 (on the GPU) left NaN."""
    for i, count in enumerate(masked):
        if count:
            got = d[i, :count]
            assert torch.isfinite(got).all(), f"group {i}: rows not fully written"
            rhs = dequantize_b(b_fp8[0][i], b_fp8[1][i]).double()
            ref = dequantize_a(a[0][i, :count], a[1][i, :count]).double() @ rhs.t()
            assert calc_diff(got, ref) < 1e-3, f"group {i}"
        assert torch.isnan(d[i, untouched_from(count, d.device.type):]).all(), f"group {i}: rows past masked_m written"


def untouched_from(count: int, device: str) -> int:
    """The first row of a masked group that the call leaves as it was: the GPU stores its tiles in
    boxes of 8 rows up to masked_m, the CPU reference writes the rows below masked_m."""
    return count if device == "cpu" else -(-count // 8) * 8


def psum_layout(counts: list[int], align: int = 128) -> torch.Tensor:
    """DeepGEMM's psum layout of contiguous rows (``counts`` per group, each group's start rounded up to
    ``align``): int32 [G] of each group's end row."""
    ends, start = [], 0
    for c in counts:
        ends.append(start + c)
        start = (start + c + align - 1) // align * align
    return torch.tensor(ends, dtype=torch.int32)
