"""The dense FP8 GEMM's scale loads in its launch plans (launchers/sm90_fp8_gemm_heuristic.hpp,
sm90_fp8_gemm_workspace.hpp): which layout a call's scales take (TMA boxes MN- or K-major, or the scale
warps' gathers), the switches, and which plans copy A's scales MN-major first. CPU only, no kernel runs."""

from __future__ import annotations

import pytest

import kernels
from gemm_cases import H200_SMS


_KM = 0x7F0000001000  # a 16-byte aligned fake address: the scale-load rules read no memory


@pytest.mark.parametrize("gemm_type,m,n,k,groups,sfa,sfb,expected", [
    # dense, the quantizers' layouts: A [m, K/128] and B [ceil(N/128), K/128] contiguous, K/128 = 56
    (0, 4096, 4096, 7168, 1, (_KM, 56, 1), (_KM, 0, 56, 1), "tma_k_major"),
    (0, 1, 2112, 7168, 1, (_KM, 57, 1), (_KM, 0, 56, 1), "tma_k_major"),         # one row: any row stride
    (0, 300, 2112, 1536, 1, (_KM, 1, 300), (_KM, 0, 12, 1), "tma_mn_major"),     # MN-major, 16-byte rows
    (0, 77, 2112, 1536, 1, (_KM, 1, 77), (_KM, 0, 12, 1), "gather"),             # MN-major, 77 x 4 bytes
    (0, 100, 264, 640, 1, (_KM, 5, 1), (_KM, 0, 5, 1), "gather"),                # K/128 = 5: 20-byte rows
    (0, 4096, 4096, 7168, 1, (_KM + 4, 56, 1), (_KM, 0, 56, 1), "gather"),       # A's scales 4-byte aligned
    (0, 4096, 4096, 7168, 1, (_KM, 56, 1), (_KM, 0, 1, 32), "gather"),           # B's scales N-major
    (0, 4096, 4096, 7168, 1, (_KM, 60, 1), (_KM, 0, 60, 1), "tma_k_major"),      # padded rows
    (0, 4096, 4096, 7168, 1, (_KM, 1, 4096), (_KM, 0, 56, 1), "tma_mn_major"),
    # contiguous: B's groups must continue one another
    (1, 8192, 4096, 7168, 4, (_KM, 56, 1), (_KM, 32 * 56, 56, 1), "tma_k_major"),
    (1, 8192, 4096, 7168, 4, (_KM, 56, 1), (_KM, 33 * 56, 56, 1), "gather"),
    (1, 8192, 96, 7168, 4, (_KM, 56, 1), (_KM, 60, 7, 1), "tma_k_major"),        # one block per group
    # masked decode tiles gather, whatever the layout
    (2, 16, 7168, 2048, 32, (_KM, 16, 1), (_KM, 56 * 16, 16, 1), "gather"),
    (2, 20, 7168, 2048, 8, (_KM, 1, 160), (_KM, 56 * 16, 16, 1), "gather"),
])
def test_scale_load_follows_the_layouts(gemm_type, m, n, k, groups, sfa, sfb, expected):
    """Dense and contiguous GEMMs: TMA loads the scales where both have a 2-D view with 16-byte
    aligned base and rows (A MN-major first, then K-major with whole 4-block boxes; B K-major);
    every other layout, and masked GEMMs, are gathered by the scale warps."""
    native = kernels.jit.native_module()
    assert native.fp8_gemm_scale_load(gemm_type, m, n, k, groups, *sfa, *sfb) == expected


def test_scale_load_switch_and_stages(monkeypatch):
    """MOE_FP8_SCALE_TMA=0 keeps the gathers (A/B timing); the config states the load, and the TMA
    stages' larger scale slots (4 K blocks x 256 rows) still leave 256 x 128 its 3 stages."""
    native = kernels.jit.native_module()
    args = (0, 4096, 4096, 7168, 1, _KM, 56, 1, _KM, 0, 56, 1)
    tma = native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)
    gather = native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS, scale_load=0)
    assert (tma["scale_load"], tma["scale_warps"], gather["scale_load"], gather["scale_warps"]) == \
        ("tma_k_major", 0, "gather", 3)
    assert tma["smem_bytes"] > gather["smem_bytes"] and tma["num_stages"] == gather["num_stages"] == 3
    assert native.fp8_gemm_nt_config(64, 2112, 640, H200_SMS)["scale_load"] == "gather"
    # Tiles under 256 rows gather K-major scales (their 16-byte TMA rows measured up to 2x slower at
    # 64 rows, level at 128); MN-major ones stay on TMA.
    # So do 256-row tiles of short K (4 K blocks: 1.05x slower).
    for m, n, k, block_m in ((64, 2112, 7168, 64), (1200, 4096, 7168, 128), (4096, 2112, 7168, 128),
                             (4096, 32768, 512, 256)):
        cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
        assert (cfg["block_m"], cfg["scale_load"], cfg["scale_warps"]) == (block_m, "gather", 3)
        assert native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=1)["scale_load"] == "tma_mn_major"
    monkeypatch.setenv("MOE_FP8_SCALE_TMA", "0")
    assert native.fp8_gemm_scale_load(*args) == "gather"
    assert native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)["scale_load"] == "gather"
    with pytest.raises(RuntimeError, match="scale_load must be"):
        native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS, scale_load=3)
    with pytest.raises(RuntimeError, match="needs K a multiple of 512"):
        native.fp8_gemm_nt_config(4096, 4096, 640, H200_SMS, scale_load=1)
    assert native.fp8_gemm_nt_config(16, 7168, 2048, H200_SMS, gemm_type=2, num_groups=32,
                                      scale_load=1)["scale_load"] == "gather"


@pytest.mark.parametrize("m,n,k,scale_load,split_workspace,expected", [
    (4096, 7168, 2048, -1, True, 1),       # 256 x 128 on K-major boxes: copied
    (4096, 32768, 512, -1, True, 1),       # 256 x 128 gathering (K < 1024): copied
    (4096, 7168, 16384, 0, True, 1),       # any layout the gathers take
    (4096, 7168, 2048, 1, True, 0),        # MN-major already
    (4096, 7168, 2048, -1, False, 0),      # no workspace (a CUDA graph capture)
    (4096, 2112, 7168, -1, True, 0),       # 128-row tiles
    (128, 4096, 7168, -1, True, 0),        # 64-row tiles
    (16384, 7168, 16384, -1, True, 1),     # 16384 x 128 floats: the workspace's whole room
    (16388, 7168, 16384, -1, True, 0),     # past it
    (4096, 7168, 1152, -1, True, 0),       # 9 K blocks: B's scales not in whole TMA boxes of 4
])
def test_sfa_copy_on_wide_tiles(m, n, k, scale_load, split_workspace, expected, monkeypatch):
    """Dense 256-row tiles on A scales that are not MN-major copy them MN-major into the workspace
    first where they fit it; the kernel generated for such a plan is the MN-major one.
    MOE_FP8_SFA_COPY=0 and MOE_FP8_SCALE_TMA=0 turn the copy off."""
    native = kernels.jit.native_module()
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, split_workspace=split_workspace, scale_load=scale_load)
    assert cfg["sfa_copy"] == expected, cfg
    if expected:
        mn = native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=1)
        code = native.fp8_gemm_nt_code(m, n, k, H200_SMS, scale_load=scale_load)[1]
        assert code == native.fp8_gemm_nt_code(m, n, k, H200_SMS, scale_load=1)[1]
        assert (mn["block_m"], mn["scale_load"], mn["sfa_copy"]) == (256, "tma_mn_major", 0)
        for switch in ("MOE_FP8_SFA_COPY", "MOE_FP8_SCALE_TMA"):
            monkeypatch.setenv(switch, "0")
            assert native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=scale_load)["sfa_copy"] == 0
            monkeypatch.delenv(switch)


@pytest.mark.parametrize("m,n,k,alignment,scale_load,split_workspace,expected,expected_all", [
    (32768, 4096, 7168, 128, -1, True, 1, 1),   # 128 x 192 tiles gathering K-major scales: copied
    (32768, 7168, 2048, 128, -1, True, 1, 1),
    (32768, 4096, 7168, 256, -1, True, 1, 1),   # 256-row tiles on K-major boxes
    (4096, 7168, 2048, 128, 0, True, 1, 1),     # any layout the gathers take, from 4096 rows
    (4095, 7168, 2048, 128, -1, True, 0, 0),    # below them
    (32768, 2112, 7168, 128, -1, True, 0, 1),   # N below 4096 (the copy weighs more): under =all only
    (32768, 4096, 7168, 128, 1, True, 0, 0),    # MN-major already
    (32768, 4096, 7168, 128, -1, False, 0, 0),  # no workspace (a CUDA graph capture)
    (40960, 4096, 7168, 128, -1, True, 0, 0),   # 40960 x 56 floats: past the workspace's room
])
def test_sfa_copy_on_contiguous_layouts(m, n, k, alignment, scale_load, split_workspace, expected, expected_all,
                                        monkeypatch):
    """Contiguous layouts of 4096 rows or more and N >= 4096 on A scales that are not MN-major copy
    them MN-major into the workspace first where they fit, and the kernel generated for such a plan is
    the MN-major one with the same tiles; under MOE_FP8_SFA_COPY=all at any N. =0 turns every copy off."""
    native = kernels.jit.native_module()
    grouped = dict(gemm_type=1, num_groups=4, alignment=alignment)
    plan = lambda load, **kw: native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=load, **grouped, **kw)  # noqa: E731
    code = lambda load: native.fp8_gemm_nt_code(m, n, k, H200_SMS, scale_load=load, **grouped)[1]  # noqa: E731
    cfg = plan(scale_load, split_workspace=split_workspace)
    assert cfg["sfa_copy"] == expected, cfg
    if expected:
        mn = plan(1)
        assert (mn["scale_load"], mn["sfa_copy"]) == ("tma_mn_major", 0)
        assert (mn["block_m"], mn["block_n"]) == (cfg["block_m"], cfg["block_n"])
        assert code(scale_load) == code(1)  # the same kernel as on the caller's MN-major scales
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "all")
    cfg = plan(scale_load, split_workspace=split_workspace)
    assert cfg["sfa_copy"] == expected_all, cfg
    if expected_all:
        assert code(scale_load) == code(1)
        monkeypatch.setenv("MOE_FP8_SFA_COPY", "0")
        assert plan(scale_load)["sfa_copy"] == 0


@pytest.mark.parametrize("m,n,k,scale_load", [
    (1, 2112, 7168, -1), (64, 2112, 7168, -1), (128, 4096, 7168, -1), (129, 7168, 2048, 0), (1000, 7168, 1536, -1),
    (4096, 2112, 7168, -1), (4096, 7168, 2048, -1),
])
def test_sfa_copy_all_dense_tiles(m, n, k, scale_load, monkeypatch):
    """MOE_FP8_SFA_COPY=all copies A scales that are not MN-major for dense tiles of any height, the
    GEMM behind the copy on the MN-major plan (with PDL or without: MOE_GEMM_PDL=0 keeps the copy).
    Unset, only 256-row tiles copy."""
    native = kernels.jit.native_module()
    plan = lambda load=scale_load: native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=load)  # noqa: E731
    default = plan()
    assert default["sfa_copy"] == int(default["block_m"] == 256)
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "all")
    assert (plan()["sfa_copy"], plan()["pdl"]) == (1, 1)
    assert native.fp8_gemm_nt_code(m, n, k, H200_SMS, scale_load=scale_load)[1] == \
        native.fp8_gemm_nt_code(m, n, k, H200_SMS, scale_load=1)[1]
    monkeypatch.setenv("MOE_GEMM_PDL", "0")
    assert (plan()["sfa_copy"], plan()["pdl"]) == (1, 0)
    assert plan(1)["sfa_copy"] == 0


def test_sfa_copy_all_needs_whole_scale_boxes_of_b(monkeypatch):
    """The kernel behind the copy loads B's scales by TMA in boxes of 4 K blocks: K = 384 or 1152
    (3, 9 K blocks) plan no copy, under MOE_FP8_SFA_COPY=all too."""
    native = kernels.jit.native_module()
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "all")
    for m, n, k in [(128, 4096, 384), (4096, 7168, 1152), (64, 2112, 1152)]:
        cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
        assert (cfg["sfa_copy"], cfg["scale_load"]) == (0, "gather"), cfg
