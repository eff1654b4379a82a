"""Large contiguous layouts on A scales that are not MN-major: the launcher copies them MN-major into
its workspace (launchers/mn_major_sf.hpp, the rule in launchers/sm90_fp8_gemm_workspace.hpp) and runs
the MN-major kernel. Checked against the caller's own MN-major scales, the gathers and float64, and
across calls that share the workspace on one stream (GPU)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.reference.gemm import dequantize_a, dequantize_b
from kernels.testing import calc_diff

from grouped_cases import (GROUPED_NK, assert_same_output, contiguous_config, expected_contiguous, make_contiguous,
                           make_weights, run_contiguous)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,sfa_view", [
    ([4000, 0, 3900, 1], None),   # 8192 rows: an empty group, padding blocks, a one-row group
    ([2047, 2049], None),         # 4224 rows: the copy's last 32-row tile partly past the rows
    ([3000, 1500], "columns"),    # A scales with gaps between rows (every other column of a wider tensor)
])
@pytest.mark.parametrize("n,k", GROUPED_NK)
@pytest.mark.parametrize("switch", ["1", "all"])
def test_gpu_contiguous_sfa_copy_matches_mn_major_and_gathers(switch, counts, sfa_view, n, k, seed, monkeypatch):
    """Contiguous layouts of 4096 rows or more on A scales that are not MN-major: the scales copied
    MN-major into the workspace, then the MN-major kernel (by default from N = 4096, under
    MOE_FP8_SFA_COPY=all at any N). D bit for bit the call's on the caller's own MN-major
    scales and the call's without the copy (MOE_FP8_SFA_COPY=0: the gathers), the same rows written
    (padding blocks left NaN)."""
    monkeypatch.setenv("MOE_FP8_SFA_COPY", switch)
    b_fp8 = make_weights(len(counts), n, k, "cuda")
    a_fp8, m_indices = make_contiguous(counts, k, "cuda")
    rows = m_indices.shape[0]
    if sfa_view == "columns":
        wide = torch.rand(rows, 2 * (k // 128), device="cuda")
        wide[:, ::2] = a_fp8[1]
        a_fp8 = (a_fp8[0], wide[:, ::2])
    cfg = contiguous_config(m_indices, n, k, len(counts))
    assert cfg["sfa_copy"] == 1, cfg
    outputs = {}
    for name, sfa, copy in (("copy", a_fp8[1], switch),
                            ("mn", kernels.get_mn_major_tma_aligned_tensor(a_fp8[1]), switch),
                            ("gather", a_fp8[1], "0")):
        monkeypatch.setenv("MOE_FP8_SFA_COPY", copy)
        outputs[name] = run_contiguous((a_fp8[0], sfa), b_fp8, m_indices, n)
    torch.cuda.synchronize()
    valid = m_indices >= 0
    assert calc_diff(outputs["copy"][valid], expected_contiguous(a_fp8, b_fp8, m_indices)[valid]) < 1e-3
    assert_same_output(outputs["copy"], outputs["mn"], "copy against the caller's MN-major scales")
    assert_same_output(outputs["copy"], outputs["gather"], "copy against the gathers")


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("switch", ["1", "all"])
def test_gpu_contiguous_and_dense_copies_share_the_workspace(switch, pdl, seed, monkeypatch):
    """Contiguous and dense calls on one stream without a sync between them, each copying its own A
    scales into the one workspace (under MOE_FP8_SFA_COPY=all with PDL, each GEMM loading A and B
    before it waits for its copy, and 128-row dense calls copying too): every D must be its own
    operands' product."""
    monkeypatch.setenv("MOE_FP8_SFA_COPY", switch)
    monkeypatch.setenv("MOE_GEMM_PDL", pdl)
    n, k = 7168, 2048
    b_fp8 = make_weights(2, n, k, "cuda")
    calls = []
    for i in range(4):
        a_fp8, m_indices = make_contiguous([2048, 2048], k, "cuda")
        calls.append(((a_fp8[0], a_fp8[1] * (1 + i)), m_indices))  # scales apart, so a stale copy shows in D
    dense_b = (b_fp8[0][0], b_fp8[1][0])
    assert contiguous_config(calls[0][1], n, k, 2)["sfa_copy"] == 1
    for rows in (4096, 128):
        copies = rows == 4096 or switch == "all"  # 256-row tiles always, 64-row ones under =all
        assert kernels.jit.native_module().fp8_gemm_nt_config(rows, n, k, kernels.get_num_sms())["sfa_copy"] == copies
    outputs = []
    torch.cuda.synchronize()
    for a_fp8, m_indices in calls:
        d = torch.full((4096, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.m_grouped_fp8_gemm_nt_contiguous(a_fp8, b_fp8, d, m_indices)
        d_dense = torch.full((4096, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.fp8_gemm_nt((a_fp8[0], a_fp8[1] * 3), dense_b, d_dense)
        # 128 rows: 64-row tiles (copied under =all); their scales made by the kernel just before.
        d_small = torch.full((128, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.fp8_gemm_nt((a_fp8[0][:128], a_fp8[1][:128] * 5), dense_b, d_small)
        outputs.append((d, d_dense, d_small))
    torch.cuda.synchronize()
    rhs = dequantize_b(*dense_b).double().t()
    for (a_fp8, m_indices), (d, d_dense, d_small) in zip(calls, outputs):
        assert calc_diff(d, expected_contiguous(a_fp8, b_fp8, m_indices)) < 1e-3
        assert calc_diff(d_dense, dequantize_a(a_fp8[0], a_fp8[1] * 3).double() @ rhs) < 1e-3
        assert calc_diff(d_small, dequantize_a(a_fp8[0][:128], a_fp8[1][:128] * 5).double() @ rhs) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["1", "all"])
def test_gpu_contiguous_padding_only_layout_behind_the_copy(switch, seed, monkeypatch):
    """A contiguous layout of 4096 padding rows behind the copy (no tile anywhere; under
    MOE_FP8_SFA_COPY=all every CTA of the GEMM, which loads before it waits, still waits for the
    copy), then calls on the same stream that copy into the same workspace: D of the empty call
    untouched, the next ones right."""
    monkeypatch.setenv("MOE_FP8_SFA_COPY", switch)
    n, k = 4096, 7168
    b_fp8 = make_weights(2, n, k, "cuda")
    a_empty, m_empty = make_contiguous([2048, 2048], k, "cuda")
    m_empty.fill_(-1)
    assert contiguous_config(m_empty, n, k, 2)["sfa_copy"] == 1
    calls = [make_contiguous([2048, 2048], k, "cuda") for _ in range(2)]
    outputs = [torch.full((4096, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    torch.cuda.synchronize()
    kernels.m_grouped_fp8_gemm_nt_contiguous(a_empty, b_fp8, outputs[0], m_empty)
    for (a_fp8, m_indices), d in zip(calls, outputs[1:]):
        kernels.m_grouped_fp8_gemm_nt_contiguous(a_fp8, b_fp8, d, m_indices)
    torch.cuda.synchronize()
    assert torch.isnan(outputs[0]).all()
    for (a_fp8, m_indices), d in zip(calls, outputs[1:]):
        assert calc_diff(d, expected_contiguous(a_fp8, b_fp8, m_indices)) < 1e-3
