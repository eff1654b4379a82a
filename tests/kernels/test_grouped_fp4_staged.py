"""The staged FP8 x FP4 path (kernels.cast_fp4_to_fp8_blocks, then the FP8 grouped GEMM): which calls
run it (rows per group against STAGED_MIN_ROWS, MOE_FP4_STAGED, pairs as lists), and chunks of groups
under STAGED_MAX_BYTES, against float64 math on the dequantized weights (GPU). Every contiguous and
masked edge case also runs staged in test_grouped_fp4.py (its "staged" kernel)."""

from __future__ import annotations

import pytest
import torch

import kernels
from grouped_fp4_cases import (TOLERANCE, check_contiguous, check_masked, expected_contiguous, make_contiguous,
                               make_weights, run_contiguous)
from kernels.testing import calc_diff

SWITCHES = ("MOE_FP4_SWAP_AB", "MOE_FP4_STAGED", "MOE_FP4_SHARE_B")


@pytest.fixture
def casts(monkeypatch) -> list:
    """The staged casts a call makes, recorded (each still runs)."""
    made = []
    cast = kernels.grouped._staged_weights
    monkeypatch.setattr(kernels.grouped, "_staged_weights", lambda *args: made.append(args) or cast(*args))
    return made


@pytest.mark.parametrize("setting,policy", [(None, None), ("", None), ("0", False), ("1", True)])
def test_staged_policy(monkeypatch, setting, policy):
    if setting is None:
        monkeypatch.delenv("MOE_FP4_STAGED", raising=False)
    else:
        monkeypatch.setenv("MOE_FP4_STAGED", setting)
    assert kernels._fp4.staged_policy("f") is policy


@pytest.mark.parametrize("value", ["2", "yes", "01", " 1"])
def test_staged_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("MOE_FP4_STAGED", value)
    with pytest.raises(ValueError, match="MOE_FP4_STAGED must be 0 or 1"):
        kernels._fp4.staged_policy("f")


def test_staged_chunks(monkeypatch):
    """Chunks hold as many [N, K] FP8 matrices as STAGED_MAX_BYTES, at least one, at most 65535."""
    assert kernels._fp4.staged_chunk(4096, 7168) == (1 << 30) // (4096 * 7168) == 36
    monkeypatch.setattr(kernels._fp4, "STAGED_MAX_BYTES", 100)
    assert kernels._fp4.staged_chunk(4096, 7168) == 1
    monkeypatch.setattr(kernels._fp4, "STAGED_MAX_BYTES", 2 * 136 * 384 + 1)
    assert list(kernels._fp4.staged_chunks(5, 136, 384)) == [(0, 2), (2, 4), (4, 5)]
    monkeypatch.setattr(kernels._fp4, "STAGED_MAX_BYTES", 1 << 40)
    assert kernels._fp4.staged_chunk(8, 128) == 65535


def test_cpu_calls_never_stage(monkeypatch, casts):
    """Staging is a CUDA path: CPU tensors run the reference even under MOE_FP4_STAGED=1."""
    monkeypatch.setenv("MOE_FP4_STAGED", "1")
    check_contiguous([5, 0, 130], 136, 256, "cpu")
    check_masked([5, 0, 30], 32, 136, 256, 16, "cpu")
    assert not casts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_staged_where_rows_per_group_reach_the_threshold(seed, monkeypatch, casts):
    """Unset MOE_FP4_STAGED: calls with STAGED_MIN_ROWS rows per group or more run staged (neither fast
    path may launch an in-kernel conversion for them), calls with fewer do not."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    threshold = kernels._fp4.STAGED_MIN_ROWS
    assert kernels.jit.native_module().FP8_FP4_STAGED_MIN_ROWS == threshold
    for rows, expect_staged in ((threshold - 128, False), (threshold, True)):
        casts.clear()
        check_masked([rows, 7], rows, 576, 2048, rows, "cuda", "uint8")
        assert bool(casts) == expect_staged, f"masked, {rows} rows per group"
        casts.clear()
        a_fp8, b, m_indices, d = run_contiguous([rows - 128, rows - 128], 576, 2048, "cuda", "uint8", pad_blocks=1)
        assert m_indices.shape[0] == 2 * rows
        assert bool(casts) == expect_staged, f"contiguous, {rows} rows per group"
        valid = m_indices >= 0
        assert calc_diff(d[valid], expected_contiguous(a_fp8, b, m_indices)[valid]) < TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_staged_takes_pairs_as_lists(seed, monkeypatch, casts):
    """(tensor, scales) pairs given as lists route like tuples: staged under MOE_FP4_STAGED=1."""
    monkeypatch.setenv("MOE_FP4_STAGED", "1")
    b = make_weights(2, 136, 384, "cuda")
    a_fp8, m_indices = make_contiguous([100, 30], 384, "cuda")
    d = torch.full((m_indices.shape[0], 136), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(list(a_fp8), [b[0], kernels.transform_sf_for_fp4_gemm(b[1])], d,
                                                 m_indices)
    assert casts, "a list pair ran an in-kernel conversion"
    valid = m_indices >= 0
    assert calc_diff(d[valid], expected_contiguous(a_fp8, b, m_indices)[valid]) < TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("groups_per_chunk", [1, 2])
def test_gpu_staged_in_chunks_of_groups(seed, monkeypatch, groups_per_chunk):
    """A staged call whose FP8 weights exceed STAGED_MAX_BYTES runs in chunks of groups: contiguous
    chunks see shifted group ids, so every other group's rows and the padding must stay untouched."""
    n, k = 136, 384
    monkeypatch.setenv("MOE_FP4_STAGED", "1")
    monkeypatch.setattr(kernels._fp4, "STAGED_MAX_BYTES", groups_per_chunk * n * k + 1)
    check_contiguous([300, 0, 77, 129, 5], n, k, "cuda", "uint8")
    check_masked([5, 64, 0, 17, 33], 64, n, k, 16, "cuda", "uint8")
