"""The dense FP8 GEMM's tile heuristic and launch plans (launchers/sm90_fp8_gemm_heuristic.hpp get_config,
gemm_common.hpp choose_tiles / tail_split): CPU only, no kernel runs."""

from __future__ import annotations

import pytest

import kernels
from gemm_cases import DEEPSEEK_NK, H200_SMS


@pytest.mark.parametrize("m", [1, 64, 128, 4096])
@pytest.mark.parametrize("n,k", DEEPSEEK_NK)
def test_heuristic_is_valid(m, n, k):
    cfg = kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert cfg["block_n"] % 8 == 0 and cfg["block_n"] <= 192
    assert cfg["smem_bytes"] <= 232448 and cfg["num_stages"] >= 2
    assert 1 <= cfg["grid"] <= H200_SMS
    if m <= 128:  # memory-bound: the weights must be spread over (nearly) every SM
        assert cfg["grid"] >= min(cfg["num_tiles"], 0.8 * H200_SMS) or cfg["num_tiles"] < H200_SMS


def test_tile_overrides_replace_the_heuristic(monkeypatch):
    """MOE_GEMM_BLOCK_M / _BLOCK_N / _STAGES (A/B timing) replace the heuristic's tiles, and a value
    the kernel cannot take raises naming the switch."""
    native = kernels.jit.native_module()
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    base = native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)
    assert (base["block_m"], base["block_n"]) == (256, 128)
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")
    base = native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)
    assert (base["block_m"], base["block_n"]) == (128, 128)
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", "192")
    monkeypatch.setenv("MOE_GEMM_STAGES", "3")
    cfg = native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)
    assert (cfg["block_m"], cfg["block_n"], cfg["num_stages"]) == (128, 192, 3)
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "64")
    assert native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)["block_m"] == 64
    # 256 rows: dense only, block N 128 (a forced other one raises), whatever N.
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "256")
    for block_n in ("192", "120"):
        monkeypatch.setenv("MOE_GEMM_BLOCK_N", block_n)
        with pytest.raises(RuntimeError, match="MOE_GEMM_BLOCK_N"):
            native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)
    monkeypatch.delenv("MOE_GEMM_BLOCK_N")
    for n in (4096, 2112, 264, 8):
        cfg = native.fp8_gemm_nt_config(4096, n, 7168, H200_SMS)
        assert (cfg["block_m"], cfg["block_n"], cfg["pingpong"]) == (256, 128, 0)
    with pytest.raises(RuntimeError, match="MOE_GEMM_BLOCK_M"):
        native.fp8_gemm_nt_config(8192, 4096, 7168, H200_SMS, gemm_type=1, num_groups=4)
    monkeypatch.delenv("MOE_GEMM_BLOCK_M")
    for name, value in (("MOE_GEMM_BLOCK_N", "100"), ("MOE_GEMM_BLOCK_N", "264"), ("MOE_GEMM_BLOCK_M", "96"),
                        ("MOE_GEMM_STAGES", "1")):
        monkeypatch.setenv(name, value)
        with pytest.raises(RuntimeError, match=name):
            native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)
        monkeypatch.delenv(name)


@pytest.mark.parametrize("m,n,k,tiles,splits", [
    (4096, 7168, 16384, 1216, 4),   # 608 cluster tiles on 66 clusters: 14 left, 4 units of 32 K blocks
    (4096, 7168, 8192, 1216, 2),    # 64 K blocks: 2 units of 32
    (4096, 4096, 7168, 1024, 1),    # 56 K blocks: too few to split (block 128 x 128 then)
    (4096, 7168, 2048, 1216, 1),    # 16 K blocks
    (4096, 2112, 16384, 352, 1),    # 88 tiles left over 132 SMs: one unit each is the whole tile
    (128, 7168, 16384, 128, 1),     # one partial wave: the grid shrinks to the tiles
])
def test_tail_split_follows_the_last_wave(m, n, k, tiles, splits, monkeypatch):
    """Dense FP8: the tiles of a last, partial wave are split over K, as many units per tile as the
    clusters hold and each unit at least 32 K blocks (at most 8); MOE_GEMM_TAIL_SPLIT=0 turns it
    off (and the tile choice then counts whole waves); grouped GEMMs never split."""
    native = kernels.jit.native_module()
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")  # the 128-row tiles' split (256-row: test_wide_tiles_...)
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert (cfg["num_tiles"], cfg["tail_splits"]) == (tiles, splits)
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS, gemm_type=1, num_groups=4)["tail_splits"] == 1
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS)["tail_splits"] == 1


@pytest.mark.parametrize("m,n,k,tile", [
    (4096, 4096, 7168, "256x128c2"), (4096, 7168, 2048, "256x128c2"), (4096, 7168, 16384, "256x128c2"),
    (4096, 24576, 1536, "256x128c2"), (4096, 32768, 512, "256x128c2"), (2048, 4096, 7168, "256x128c2"),
    (4096, 2112, 7168, "128x192"), (4096, 576, 7168, "128x144"), (2048, 7168, 2048, "128x192c2"),
    (1024, 4096, 7168, "256x128c2"), (512, 7168, 16384, "256x128c2"),  # one wave against two
    (768, 7168, 16384, "128x112c2"), (1024, 7168, 2048, "128x160c2"),   # two waves either way
    (1552, 2112, 7168, "128x112"),    # one wave, but a partial n-block
    (256, 4096, 7168, "128x64"), (128, 4096, 7168, "64x64"), (64, 4096, 7168, "64x32"),
    (64, 7168, 16384, "64x56c2"),
])
def test_wide_tiles_where_they_measured_faster(m, n, k, tile, monkeypatch):
    """Dense FP8 runs 256 x 128 tiles in 2-CTA clusters where their waves, at 14/16 of two 128-row
    tiles' cost each, beat the 128-row heuristic's (bench/RESULTS.md, session 8: every N a multiple
    of 128 from 4096 up at M 2048-8192), and at 512-2047 rows where they run in one wave and the
    128-row tiles in more (session 47); N = 2112 and 576 (a padded last n-block, few waves) keep
    128-row tiles, and so do grouped GEMMs and a forced block M or N."""
    native = kernels.jit.native_module()
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert f"{cfg['block_m']}x{cfg['block_n']}" + ("c2" if cfg["multicast"] > 1 else "") == tile
    assert cfg["pingpong"] == 0 or cfg["block_m"] == 128
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS, gemm_type=1, num_groups=4)["block_m"] <= 128
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", "128")
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS)["block_m"] <= 128


def test_wide_tiles_min_rows_moves_with_its_switch(monkeypatch):
    """MOE_GEMM_WIDE_MIN_ROWS moves the fewest rows where 256 x 128 tiles are weighed by their waves'
    cost (2048 unset), for timing the rule's edge; below it they are taken only for one wave."""
    native = kernels.jit.native_module()
    tile = lambda m, n, k: (lambda c: (c["block_m"], c["block_n"], c["multicast"]))(  # noqa: E731
        native.fp8_gemm_nt_config(m, n, k, H200_SMS))
    assert tile(1024, 7168, 2048) == (128, 160, 2)
    assert tile(1024, 4096, 7168) == (256, 128, 2)
    monkeypatch.setenv("MOE_GEMM_WIDE_MIN_ROWS", "1024")
    assert tile(1024, 7168, 2048) == (256, 128, 2)   # 224 tiles against 368
    assert tile(1023, 7168, 2048) == (128, 160, 2)
    monkeypatch.setenv("MOE_GEMM_WIDE_MIN_ROWS", "4096")
    assert tile(2048, 4096, 7168) == (128, 128, 1)
    assert tile(1024, 4096, 7168) == (256, 128, 2)   # one wave: below the switch's rows too


@pytest.mark.parametrize("m,n,k,block_n,ways,tiles,splits,grid", [
    (64, 2112, 7168, "128", "8", 18, 7, 126),   # 9 cluster tiles on 66 clusters: 7 units each
    (64, 576, 7168, "128", "8", 6, 8, 48),      # capped at 8
    (64, 4096, 7168, "128", "4", 32, 4, 128),
    (128, 264, 640, "", "9", 0, 5, 0),          # 5 K blocks: at most 5 units of one
    (128, 7168, 2048, "112", "4", 128, 1, 128),  # 64 cluster tiles fill the 66 clusters: no room
])
def test_split_k_of_a_single_wave(m, n, k, block_n, ways, tiles, splits, grid, monkeypatch):
    """MOE_GEMM_SPLIT_K=<ways> splits every tile of a single, partial wave over K (capped by the free
    clusters, the K blocks and 8), its units taking SMs the wave leaves idle; unset (the default)
    or MOE_GEMM_TAIL_SPLIT=0, none."""
    native = kernels.jit.native_module()
    if block_n:
        monkeypatch.setenv("MOE_GEMM_BLOCK_N", block_n)
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS)["tail_splits"] == 1
    monkeypatch.setenv("MOE_FP8_MULTICAST", "2")  # n-blocks counted in whole clusters
    monkeypatch.setenv("MOE_GEMM_SPLIT_K", ways)
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert cfg["tail_splits"] == splits
    if tiles:
        assert (cfg["num_tiles"], cfg["grid"]) == (tiles, grid)
    assert cfg["grid"] <= H200_SMS and cfg["grid"] == min(cfg["num_tiles"] * splits, H200_SMS) // 2 * 2
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS)["tail_splits"] == 1


@pytest.mark.parametrize("m", [1, 64, 65, 128, 129, 256, 4096])
@pytest.mark.parametrize("n,k", DEEPSEEK_NK)
def test_small_m_rows_and_single_wave_split(m, n, k, monkeypatch):
    """65 to 128 rows take one 128-row m-block where it needs fewer waves than two 64-row ones (wide
    N), else 64; whole tiles leaving over a quarter of the SMs idle (N = 576 up to 256 rows) split
    over K into 4 units, not inside a CUDA graph capture (no workspace) nor with MOE_GEMM_SPLIT_K=1.
    At 129-192 rows N = 576 takes 108 whole 64 x 16 tiles instead (test_64_row_tiles_where_...)."""
    native = kernels.jit.native_module()
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    if 64 < m <= 128:
        assert cfg["block_m"] == (128 if (n, k) in {(24576, 1536), (32768, 512)} else 64), cfg
    split = n == 576 and m <= 256 and m != 129
    assert cfg["tail_splits"] == (4 if split else 1), cfg
    whole = native.fp8_gemm_nt_config(m, n, k, H200_SMS, split_workspace=False)
    assert whole["tail_splits"] == 1
    assert (whole["num_tiles"] * 4 < 3 * H200_SMS) == split, whole
    if split:
        assert cfg["grid"] == cfg["num_tiles"] * 4 <= H200_SMS, cfg
        assert whole["block_n"] < cfg["block_n"]
        monkeypatch.setenv("MOE_GEMM_SPLIT_K", "1")
        assert native.fp8_gemm_nt_config(m, n, k, H200_SMS) == whole


@pytest.mark.parametrize("m", [1, 64, 128, 300, 1024, 4096, 8191])
@pytest.mark.parametrize("n,k", DEEPSEEK_NK)
def test_without_workspace_tiles_are_planned_whole(m, n, k, monkeypatch):
    """A launch without the split workspace (inside a CUDA graph capture) runs every tile whole, so
    its tiles are the heuristic's whole-tile choice (as with MOE_GEMM_TAIL_SPLIT=0), not a plan
    made for a split that would not happen; the config reports no split (nor the copy of A's scales
    into the workspace)."""
    native = kernels.jit.native_module()
    whole = native.fp8_gemm_nt_config(m, n, k, H200_SMS, split_workspace=False)
    assert whole["tail_splits"] == 1 and whole["sfa_copy"] == 0
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    with_workspace = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert with_workspace.pop("sfa_copy") == (with_workspace["block_m"] == 256)
    assert with_workspace == {key: value for key, value in whole.items() if key != "sfa_copy"}


def test_tail_split_has_no_workspace_inside_a_graph_capture(monkeypatch):
    """A GEMM captured in a CUDA graph gets no tail-split workspace (so it runs every tile whole):
    graphs captured on one stream would share one, and one made during a capture would be zeroed
    only when that graph runs. Nothing is allocated or remembered for the capture."""
    monkeypatch.setattr(kernels.gemm, "_capturing", lambda: True)
    monkeypatch.setattr(kernels.gemm, "_current_device", lambda: 0)
    before = dict(kernels.gemm._workspaces)
    assert kernels.gemm.fp8_workspace(0, 12345) == (0, 0)
    assert kernels.gemm._workspaces == before


def test_capture_is_asked_of_the_calls_device(monkeypatch):
    """The capture check asks torch about the call's device: with another device current, that
    device is made current for the question (torch answers for the current device's stream)."""
    import contextlib

    state = {"current": 0, "capturing_on": 1}

    @contextlib.contextmanager
    def device(index):
        saved, state["current"] = state["current"], index
        try:
            yield
        finally:
            state["current"] = saved

    monkeypatch.setattr(kernels.gemm, "_current_device", lambda: state["current"])
    monkeypatch.setattr(kernels.gemm, "_capturing", lambda: state["current"] == state["capturing_on"])
    monkeypatch.setattr(kernels.gemm.torch.cuda, "device", device)
    assert kernels.gemm._device_capturing(1) and not kernels.gemm._device_capturing(0)
    assert state["current"] == 0
    assert kernels.gemm.fp8_workspace(1, 12345) == (0, 0)


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_pingpong_follows_block_n(env, monkeypatch):
    """Block M 128: the math warpgroups take turns by default only at block N > 144 (where it
    measured faster), except on 128 x 192 tiles, dense, contiguous or masked (unrolled 8 times in
    step, faster still); MOE_FP8_PINGPONG=0 turns it off, =1 on at any block N; block M 64 and 256 never
    (256-row tiles taking turns per wave measured 1.02-1.05x slower, bench/RESULTS.md, session 10)."""
    if env is not None:
        monkeypatch.setenv("MOE_FP8_PINGPONG", env)
    native = kernels.jit.native_module()
    seen = set()
    for m, n, k, gemm_type, groups in [(4096, 4096, 7168, 0, 1), (4096, 7168, 16384, 0, 1), (4096, 576, 7168, 0, 1),
                                       (64, 7168, 2048, 0, 1), (4096, 2112, 7168, 0, 1), (1000, 7168, 1536, 0, 1),
                                       (1024, 4096, 7168, 2, 8)]:
        cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, gemm_type, groups)
        in_step = cfg["block_n"] == 192
        wanted = cfg["block_n"] > 144 and not in_step if env is None else env == "1"
        assert cfg["pingpong"] == int(cfg["block_m"] == 128 and wanted), (m, n, k, cfg)
        seen.add((cfg["block_m"], cfg["block_n"], gemm_type == 2))
    # The shapes cover a dense 128 x 192 tile, a dense wide one of another width and a masked 128 x 192.
    assert {(128, 192, False), (128, 160, False), (128, 192, True)} <= seen, seen


def test_k_loop_unrolled_on_dense_256_row_and_wide_128_row_tiles(monkeypatch):
    """The math K loop runs 4 K blocks per iteration on dense 256-row tiles and on dense or
    contiguous ping-pong tiles, 8 on 128 x 192 tiles (dense, contiguous or masked) and on the other
    dense 128-row tiles, which run without ping-pong (each measured faster); once elsewhere (64-row
    tiles, narrower grouped 128-row tiles without ping-pong, grouped 256-row tiles, other masked
    tiles: not measured faster). Masked wide
    128-row tiles of block N 152-184 and dense ones keep ping-pong. MOE_FP8_PINGPONG and
    MOE_GEMM_K_UNROLL override."""
    monkeypatch.delenv("MOE_GEMM_K_UNROLL", raising=False)
    monkeypatch.delenv("MOE_FP8_PINGPONG", raising=False)
    native = kernels.jit.native_module()
    dense = native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)
    assert (dense["block_m"], dense["k_unroll"]) == (256, 4)
    wide = native.fp8_gemm_nt_config(4096, 2112, 7168, H200_SMS)
    assert (wide["block_m"], wide["block_n"], wide["pingpong"], wide["k_unroll"]) == (128, 192, 0, 8)
    narrower = native.fp8_gemm_nt_config(1000, 7168, 1536, H200_SMS)  # 128 x 160: ping-pong, unrolled 4
    assert (narrower["block_m"], narrower["block_n"], narrower["pingpong"], narrower["k_unroll"]) == (128, 160, 1, 4)
    contiguous = native.fp8_gemm_nt_config(32768, 4096, 7168, H200_SMS, False, -1, 1, 4)
    assert (contiguous["block_m"], contiguous["pingpong"], contiguous["k_unroll"]) == (128, 0, 8)
    narrow = native.fp8_gemm_nt_config(384, 4096, 7168, H200_SMS)  # DeepGEMM's 128 x 96 plan
    assert (narrow["block_m"], narrow["block_n"], narrow["pingpong"], narrow["k_unroll"]) == (128, 96, 0, 8)
    plain = native.fp8_gemm_nt_config(8192, 576, 7168, H200_SMS, False, -1, 1, 4)  # contiguous 128 x 144
    assert (plain["block_m"], plain["block_n"], plain["pingpong"], plain["k_unroll"]) == (128, 144, 0, 1)
    assert native.fp8_gemm_nt_config(64, 2112, 7168, H200_SMS)["k_unroll"] == 1
    grouped = native.fp8_gemm_nt_config(32768, 4096, 7168, H200_SMS, False, -1, 1, 4, alignment=256)
    assert (grouped["block_m"], grouped["k_unroll"]) == (256, 1)
    masked = native.fp8_gemm_nt_config(1024, 4096, 7168, H200_SMS, False, -1, 2, 8)
    assert (masked["block_m"], masked["block_n"], masked["pingpong"], masked["k_unroll"]) == (128, 192, 0, 8), masked
    # Masked in step only where the K blocks come in whole rounds of 8 (the timed shapes).
    masked_short_k = native.fp8_gemm_nt_config(512, 4096, 1536, H200_SMS, False, -1, 2, 32)
    assert (masked_short_k["block_n"], masked_short_k["pingpong"], masked_short_k["k_unroll"]) == (192, 1, 1)
    masked_narrower = native.fp8_gemm_nt_config(256, 7168, 2048, H200_SMS, False, -1, 2, 32)
    assert (masked_narrower["block_n"], masked_narrower["pingpong"], masked_narrower["k_unroll"]) == (160, 1, 1)
    monkeypatch.setenv("MOE_FP8_PINGPONG", "1")
    forced = native.fp8_gemm_nt_config(4096, 2112, 7168, H200_SMS)
    assert (forced["pingpong"], forced["k_unroll"]) == (1, 4)
    monkeypatch.delenv("MOE_FP8_PINGPONG")
    monkeypatch.setenv("MOE_GEMM_K_UNROLL", "2")
    assert native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)["k_unroll"] == 2
    assert native.fp8_gemm_nt_config(64, 2112, 7168, H200_SMS)["k_unroll"] == 2


def test_overlap_on_lone_warpgroup_tiles(monkeypatch):
    """Block M 64 with block N <= 128 and whole rounds of max(4, k_unroll) K blocks (an even count)
    overlap promotion with the next K block's wgmmas; wider tiles (three accumulator sets would not
    fit) and two math warpgroups do not; MOE_FP8_OVERLAP=0 turns it off."""
    native = kernels.jit.native_module()
    def cfg(m, n, k, *rest):
        c = native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, *rest)
        return c["block_m"], c["block_n"], c["overlap"]
    for m, n, k, rest in ((64, 2112, 7168, ()), (128, 4096, 7168, ()), (16, 4096, 7168, (2, 32))):
        block_m, block_n, overlap = cfg(m, n, k, *rest)
        assert block_m == 64 and block_n <= 128 and overlap == 1
    assert cfg(64, 24576, 1536)[1:] == (192, 0)      # block N 192
    assert cfg(4096, 4096, 7168)[2] == 0             # 256-row tiles
    assert cfg(64, 2112, 640)[2] == 0                # 5 K blocks: no whole round
    monkeypatch.setenv("MOE_GEMM_K_UNROLL", "8")     # rounds of 8 K blocks
    assert cfg(64, 2112, 7168)[2] == 1 and cfg(64, 2112, 1536)[2] == 0  # 56 K blocks; 12
    monkeypatch.setenv("MOE_GEMM_K_UNROLL", "6")     # rounds of 6: 48 K blocks
    assert cfg(64, 2112, 6144)[2] == 1
    monkeypatch.setenv("MOE_GEMM_K_UNROLL", "5")     # an odd round: the plain loop
    assert cfg(64, 2112, 640)[2] == 0 and cfg(64, 2112, 6400)[2] == 0
    monkeypatch.delenv("MOE_GEMM_K_UNROLL")
    monkeypatch.setenv("MOE_FP8_OVERLAP", "0")
    assert cfg(64, 2112, 7168)[2] == 0


@pytest.mark.parametrize("groups,rows,n,k,block_n", [
    (32, 4, 7168, 2048, 128), (32, 16, 7168, 2048, 128), (256, 1, 7168, 2048, 128), (256, 64, 7168, 2048, 128),
    (32, 16, 4096, 7168, 128),    # long K: the score's own choice
    (256, 1, 4096, 7168, 192),    # long K: the score's 64 x 192 stays (it measured faster than 64 x 128)
    (32, 256, 7168, 2048, 160),   # 256 rows per group: 128-row tiles, not decode tiles
])
def test_masked_decode_tiles_of_short_k_stay_narrow(groups, rows, n, k, block_n, monkeypatch):
    """Masked GEMMs of at most 128 rows per group and at most 16 K blocks search block N up to 128
    only; a forced block N may still go past it."""
    native = kernels.jit.native_module()
    for name in ("MOE_GEMM_BLOCK_M", "MOE_GEMM_BLOCK_N", "MOE_GEMM_STAGES"):
        monkeypatch.delenv(name, raising=False)
    assert native.fp8_gemm_nt_config(rows, n, k, H200_SMS, False, -1, 2, groups)["block_n"] == block_n
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", "160")
    assert native.fp8_gemm_nt_config(rows, n, k, H200_SMS, False, -1, 2, groups)["block_n"] == 160


@pytest.mark.parametrize("m,n,k,clusters_mn_major", [
    (128, 2112, 7168, False), (100, 4096, 7168, False), (128, 32768, 512, False),
    (128, 7168, 2048, True), (65, 7168, 16384, True), (128, 24576, 1536, False), (128, 7168, 1536, False),
])
def test_clusters_at_65_to_128_rows_only_for_tma_scales_of_wide_n(m, n, k, clusters_mn_major):
    """Dense GEMMs of 65-128 rows: single CTAs on K-major A scales (gathered, or a table at 128 x
    2112 x 7168) at every shape, and on MN-major scales (TMA) below N = 7168 or K = 2048; A-sharing
    clusters on MN-major scales from there."""
    native = kernels.jit.native_module()
    k_major = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    table = (m, n, k) == (128, 2112, 7168)
    assert (k_major["scale_load"], k_major["multicast"]) == ("tma_k_major_table" if table else "gather", 1), k_major
    mn_major = native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=1)
    assert mn_major["scale_load"] == "tma_mn_major"
    assert mn_major["multicast"] == (2 if clusters_mn_major else 1), mn_major


@pytest.mark.parametrize("m,n,k,gemm_type,groups,share_b,by_default", [
    (4096, 2112, 7168, 0, 1, 1, 0),     # 128 x 192: 16 pairs of m-blocks per n-block
    (300, 2112, 7168, 0, 1, 1, 0),      # 3 m-blocks: the last pair's second block past M
    (144, 24576, 1536, 0, 1, 1, 1),     # dense clusters over two m-blocks: pairs by default
    (256, 32768, 512, 0, 1, 1, 1),
    (384, 24576, 1536, 0, 1, 1, 0),     # three m-blocks: clusters sharing A
    (32768, 4096, 7168, 1, 4, 1, 1),    # contiguous 128 x 192
    (8192, 7168, 2048, 1, 4, 1, 1),     # contiguous 128 x 192, short K
    (1024, 4096, 7168, 1, 4, 1, 0),     # contiguous 128 x 128
    (128, 2112, 7168, 0, 1, 0, 0),      # one m-block: nothing to pair
    (4096, 4096, 7168, 0, 1, 0, 0),     # 256-row tiles (two waves)
    (1000, 4232, 1536, 0, 1, 0, 0),     # block N 136: half of B is not whole 8-row atoms
    (256, 4096, 7168, 2, 32, 1, 0),     # masked: pairs of m-blocks inside each group (opt-in at 256 rows)
    (512, 4096, 7168, 2, 256, 1, 1),    # masked from 512 rows per group: pairs by default
    (1024, 7168, 2048, 2, 32, 1, 1),
    (100, 4096, 7168, 2, 32, 0, 0),     # masked, one m-block per group: nothing to pair
])
def test_clusters_sharing_b_only_where_the_kernel_can(m, n, k, gemm_type, groups, share_b, by_default, monkeypatch):
    """MOE_FP8_MULTICAST=b pairs adjacent 128-row m-blocks of one n-block in 2-CTA clusters sharing
    B (dense, contiguous, or masked pairing inside each group), one wave per tile, block N a multiple
    of 16, at least two m-blocks;
    elsewhere the heuristic's plan stays. Every tile of such pairs runs whole (no tail split); the
    tiles count whole pairs. Unset, contiguous 128 x 192 tiles share B, masked ones from 512 rows
    per group and dense clusters of two m-blocks; =a keeps A-sharing clusters there."""
    native = kernels.jit.native_module()
    monkeypatch.delenv("MOE_FP8_MULTICAST", raising=False)
    default = native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, gemm_type, groups)
    assert default["share_b"] == by_default, default
    monkeypatch.setenv("MOE_FP8_MULTICAST", "a")
    shares_a = native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, gemm_type, groups)
    assert shares_a["share_b"] == 0
    if by_default:
        assert (default["block_m"], default["multicast"]) == (128, 2), default
        assert default["block_n"] == (192 if gemm_type else shares_a["block_n"]), default
        assert (shares_a["block_m"], shares_a["block_n"]) == (128, default["block_n"])
        assert gemm_type or shares_a["multicast"] == 2, shares_a
    monkeypatch.setenv("MOE_FP8_MULTICAST", "b")
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, gemm_type, groups)
    assert cfg["share_b"] == share_b, cfg
    if share_b:
        m_blocks = (m + 127) // 128
        assert (cfg["block_m"], cfg["multicast"], cfg["tail_splits"]) == (128, 2, 1)
        assert cfg["block_n"] % 16 == 0
        assert cfg["num_tiles"] == (m_blocks + 1) // 2 * 2 * ((n + cfg["block_n"] - 1) // cfg["block_n"])
        assert cfg["grid"] % 2 == 0 and cfg["grid"] <= H200_SMS
    else:
        assert {key: cfg[key] for key in ("block_m", "block_n")} == {key: default[key] for key in ("block_m", "block_n")}


def test_plans_are_memoized_per_environment(monkeypatch):
    """The launchers keep each shape's plan until the environment changes (jit/env_memo.hpp): a
    switch set, changed, removed or set again between two calls applies to the second, for the FP8,
    FP8 x FP4 and BF16 families alike; an unrelated variable changes no plan."""
    native = kernels.jit.native_module()
    for name in ("MOE_GEMM_BLOCK_N", "MOE_GEMM_TAIL_SPLIT", "MOE_FP4_DECODE_K_BLOCKS"):
        monkeypatch.delenv(name, raising=False)

    def fp8():
        cfg = native.fp8_gemm_nt_config(4096, 4096, 7168, H200_SMS)
        return cfg["block_n"], cfg["tail_splits"]

    def fp4_decode():
        return native.fp8_fp4_gemm_nt_swap_ab_code(8, 4096, 7168, H200_SMS, 32)[2]["k_blocks"]

    def bf16():  # the kernel's block N, its fifth template argument
        code = native.bf16_gemm_nt_code(4096, 4096, 7168, H200_SMS)[1]
        return int(code.split("sm90_bf16_gemm_nt<")[1].split(",")[4])

    base, base_fp4, base_bf16 = fp8(), fp4_decode(), bf16()
    assert fp8() == base and fp4_decode() == base_fp4 and bf16() == base_bf16
    # A repeated shape takes the plan without running the heuristic; any change of the environment
    # empties the memo once.
    misses = native.fp8_gemm_plan_misses()
    assert fp8() == base and native.fp8_gemm_plan_misses() == misses
    monkeypatch.setenv("MOE_RUNTIME_UNRELATED_VARIABLE", "0")
    assert fp8() == base and native.fp8_gemm_plan_misses() == misses + 1
    assert fp8() == base and native.fp8_gemm_plan_misses() == misses + 1
    for _ in range(2):  # the second round sets the same strings again (glibc may reuse them)
        monkeypatch.setenv("MOE_GEMM_BLOCK_N", "64")
        assert fp8()[0] == 64 and bf16() == 64
        monkeypatch.setenv("MOE_GEMM_BLOCK_N", "128")
        assert fp8()[0] == 128
        monkeypatch.delenv("MOE_GEMM_BLOCK_N")
        assert fp8() == base and bf16() == base_bf16
        monkeypatch.setenv("MOE_FP4_DECODE_K_BLOCKS", "1" if base_fp4 == 2 else "2")
        assert fp4_decode() != base_fp4
        monkeypatch.delenv("MOE_FP4_DECODE_K_BLOCKS")
        assert fp4_decode() == base_fp4
    # 128-row tiles of 4096 x 7168 x 16384 split their last wave over K; the switch, read when
    # planned, turns that off.
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")
    assert native.fp8_gemm_nt_config(4096, 7168, 16384, H200_SMS)["tail_splits"] == 4
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    assert native.fp8_gemm_nt_config(4096, 7168, 16384, H200_SMS)["tail_splits"] == 1
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT")
    assert native.fp8_gemm_nt_config(4096, 7168, 16384, H200_SMS)["tail_splits"] == 4
    monkeypatch.delenv("MOE_GEMM_BLOCK_M")
    monkeypatch.setenv("MOE_RUNTIME_UNRELATED_VARIABLE", "1")
    assert fp8() == base and fp4_decode() == base_fp4 and bf16() == base_bf16


def test_wg_store_where_legal_unless_turned_off(monkeypatch):
    """Per-warpgroup epilogues on tiles of two math warpgroups without turns and with 2-D stores
    (dense, contiguous); block M 64, ping-pong and masked tiles keep the tile-wide epilogue, and
    MOE_FP8_WG_STORE=0 turns them off everywhere."""
    monkeypatch.delenv("MOE_FP8_PINGPONG", raising=False)
    native = kernels.jit.native_module()
    cases = {
        "dense 256": ((4096, 4096, 7168, H200_SMS), 1),
        "dense 128 x 192": ((4096, 2112, 7168, H200_SMS), 1),
        "dense ping-pong": ((1000, 7168, 1536, H200_SMS), 0),
        "dense 64": ((64, 2112, 7168, H200_SMS), 0),
        "contiguous": ((32768, 4096, 7168, H200_SMS, False, -1, 1, 4), 1),
        "masked": ((1024, 4096, 7168, H200_SMS, False, -1, 2, 8), 0),
    }
    monkeypatch.setenv("MOE_FP8_WG_STORE", "0")
    for name, (args, _) in cases.items():
        assert native.fp8_gemm_nt_config(*args)["wg_store"] == 0, name
    monkeypatch.delenv("MOE_FP8_WG_STORE")
    for name, (args, expected) in cases.items():
        cfg = native.fp8_gemm_nt_config(*args)
        assert cfg["wg_store"] == expected, (name, cfg)


@pytest.mark.parametrize("m,n,k,group_n", [
    (128, 4096, 7168, 1),     # 64 x 64 tiles, two m-blocks, one wave of lone CTAs
    (128, 2112, 7168, 1),     # 132 tiles: exactly one wave
    (256, 4096, 7168, 1),     # 128-row tiles, two m-blocks
    (64, 4096, 7168, 8),      # one m-block: the order is the same either way
    (128, 7168, 16384, 8),    # clusters of two CTAs sharing A
    (4096, 32768, 512, 8),    # several waves: bands for L2 reuse between them
    (4096, 2112, 7168, 8),
])
def test_one_n_block_bands_for_a_single_wave_of_lone_ctas(m, n, k, group_n, monkeypatch):
    """The scheduler's band width: one n-block where every tile of several m-blocks runs at once on
    lone CTAs (the CTAs reading one B tile adjacent), kGroupN = 8 with clusters or several waves;
    MOE_GEMM_GROUP_N overrides either."""
    native = kernels.jit.native_module()
    for name in ("MOE_GEMM_GROUP_N", "MOE_FP8_MULTICAST", "MOE_GEMM_BLOCK_M", "MOE_GEMM_BLOCK_N"):
        monkeypatch.delenv(name, raising=False)
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=1)
    assert cfg["group_n"] == group_n, cfg
    assert (cfg["multicast"] == 1 and cfg["num_tiles"] <= H200_SMS and m > cfg["block_m"]) == (group_n == 1), cfg
    # Gathered (K-major) scales keep 128 x 7168 x 16384 on lone CTAs: one-n-block bands there.
    k_major = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert k_major["group_n"] == (1 if (m, n, k) == (128, 7168, 16384) else group_n), k_major
    monkeypatch.setenv("MOE_GEMM_GROUP_N", "4")
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=1)["group_n"] == 4


@pytest.mark.parametrize("m,n,k,block_m,multicast", [
    (144, 2112, 7168, 64, None), (192, 4096, 7168, 64, None), (224, 576, 7168, 64, None),
    (255, 2112, 7168, 64, None), (129, 4096, 7168, 64, None),
    (256, 4096, 7168, 128, None),     # whole 128-row m-blocks (64 x 128 would read as many rows)
    (192, 24576, 1536, 128, "0"),     # lone CTAs, but 64-row tiles would take another wave
    (144, 7168, 16384, 64, None),     # one wave of lone 64 x 192 tiles instead of 128 x 112 pairs
    (192, 7168, 2048, 64, None),
    (224, 7168, 16384, 128, None),    # pairs: 64-row tiles would take another wave
    (160, 32768, 512, 128, None),     # pairs: several waves either way (not measured)
    (144, 7168, 16384, 128, "2"),     # clusters forced
    (144, 7168, 16384, 128, "b"),     # pairs sharing B asked for
    (200, 2112, 7168, 64, "b"),       # no clusters wanted: =b leaves the 64-row tiles
])
def test_64_row_tiles_where_a_128_row_tile_would_mostly_lie_past_m(m, n, k, block_m, multicast, monkeypatch):
    """129-255 rows: 64-row tiles where they take no more waves, instead of a second 128-row
    m-block that mostly lies past M; in place of 2-CTA clusters only where they run in one wave."""
    for name in ("MOE_GEMM_BLOCK_M", "MOE_GEMM_BLOCK_N", "MOE_FP8_MULTICAST", "MOE_GEMM_TAIL_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    if multicast is not None:
        monkeypatch.setenv("MOE_FP8_MULTICAST", multicast)
    native = kernels.jit.native_module()
    for scale_load in (-1, 1):
        cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=scale_load)
        assert cfg["block_m"] == block_m, cfg
        if block_m == 64:
            assert cfg["num_tiles"] <= H200_SMS and cfg["multicast"] == 1, cfg


@pytest.mark.parametrize("m,n,k,lean,off", [
    (256, 2112, 7168, (64, 64), (128, 32)),     # 128 rows of A and B per K block against 160
    (384, 2112, 7168, (64, 96), (128, 48)),
    (384, 576, 7168, (64, 32), (128, 16)),
    (1024, 576, 7168, (64, 72), (128, 40)),
    (256, 576, 7168, (128, 40), (128, 40)),     # 128 x 16 would leave a quarter of the SMs idle: split
    (512, 576, 7168, (128, 72), (128, 72)),
    (256, 4096, 7168, (128, 64), (128, 64)),    # 64 x 128 reads as many rows: kept
    (384, 4096, 7168, (128, 96), (128, 96)),    # 64 x 192 would read more
    (4096, 7168, 16384, (256, 128), (256, 128)),  # clusters
])
def test_lean_tiles_from_256_rows(m, n, k, lean, off, monkeypatch):
    """From 256 rows on lone CTAs, 64-row tiles where they take no more waves, each CTA reads fewer
    rows of A and B per K block, and the 128-row tiles fill three quarters of the SMs;
    MOE_GEMM_LEAN_TILES=0 keeps 128-row tiles."""
    for name in ("MOE_GEMM_BLOCK_M", "MOE_GEMM_BLOCK_N", "MOE_FP8_MULTICAST", "MOE_GEMM_LEAN_TILES"):
        monkeypatch.delenv(name, raising=False)
    native = kernels.jit.native_module()
    for setting, expected in (("", lean), ("0", off)):
        monkeypatch.setenv("MOE_GEMM_LEAN_TILES", setting)
        for scale_load in (-1, 1):
            cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=scale_load)
            assert (cfg["block_m"], cfg["block_n"]) == expected, (setting, cfg)
            if expected[0] == 64:
                assert cfg["num_tiles"] <= H200_SMS and cfg["multicast"] == 1, cfg
                assert cfg["num_tiles"] * 2 >= H200_SMS, cfg


@pytest.mark.parametrize("m,n,k,tight", [
    (200, 7168, 2048, 1), (200, 24576, 1536, 1), (129, 32768, 512, 1),  # M cuts the pair's second m-block
    (256, 7168, 2048, 0),                                               # nothing cut
    (256, 4760, 2048, 0),                                               # N alone cuts: B's halves stay whole
])
def test_tight_boxes_of_pairs_sharing_b_are_opt_in(m, n, k, tight, monkeypatch):
    """Dense pairs sharing B keep whole boxes by default; MOE_FP8_TIGHT_BOXES=pairs gives the CTA whose
    m-block M cuts a tail box of A, never one of B. The plan is otherwise the same."""
    for name in ("MOE_FP8_MULTICAST", "MOE_GEMM_BLOCK_M", "MOE_GEMM_BLOCK_N", "MOE_FP8_TIGHT_BOXES"):
        monkeypatch.delenv(name, raising=False)
    native = kernels.jit.native_module()
    default = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert (default["share_b"], default["tight_boxes"]) == (1, 0), default
    monkeypatch.setenv("MOE_FP8_TIGHT_BOXES", "pairs")
    pairs = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert {**pairs, "tight_boxes": 0} == default and pairs["tight_boxes"] == tight, pairs


@pytest.mark.parametrize("m,n,k,scale_load,tight", [
    (1, 2112, 7168, -1, 1),         # gathered A scales
    (1, 2112, 7168, 1, 1),          # MN-major A scales by TMA
    (16, 4096, 7168, -1, 1),        # the scale table
    (63, 576, 7168, -1, 1),
    (64, 2112, 7168, 1, 0),         # a whole m-block (64 x 48: N whole too)
    (100, 2112, 7168, -1, 1),       # the second of two m-blocks
    (4095, 2112, 7168, 1, 1),
    (4096, 7168, 16384, 1, 0),      # whole m-blocks and n-blocks
    (1, 7168, 16384, -1, 1),        # clusters sharing A: the first CTA loads the rows for both
    (32, 7168, 16384, 1, 1),
    (33, 7168, 16384, 1, 1),        # rows past the first CTA's half
    (200, 24576, 1536, -1, 0),      # clusters sharing B
    (200, 4096, 7168, -1, 0),       # MOE_GEMM_BLOCK_M=256 (below): K-major scale boxes by TMA
    (200, 4096, 7168, 1, 1),        # the same on MN-major scales
    (1024, 7168, 2048, 1, 1),       # whole m-blocks, N cuts the last n-block (block N 160)
])
def test_tight_boxes_where_m_or_n_cuts_a_block(m, n, k, scale_load, tight, monkeypatch):
    """Dense GEMMs, on lone CTAs or in clusters sharing A: where M cuts the last m-block or N the last
    n-block, tail maps whose boxes end at row M and N (1); MOE_FP8_TIGHT_BOXES=0 turns them off. The
    plan is otherwise the same."""
    for name in ("MOE_FP8_MULTICAST", "MOE_GEMM_BLOCK_M", "MOE_GEMM_BLOCK_N", "MOE_FP8_TIGHT_BOXES"):
        monkeypatch.delenv(name, raising=False)
    if (m, n) == (200, 4096):
        monkeypatch.setenv("MOE_GEMM_BLOCK_M", "256")
    native = kernels.jit.native_module()
    plans = {}
    for setting, expected in (("", tight), ("0", 0)):
        monkeypatch.setenv("MOE_FP8_TIGHT_BOXES", setting)
        plans[setting] = cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=scale_load)
        assert cfg["tight_boxes"] == expected, (setting, cfg)
        assert not expected or ((m % cfg["block_m"] or n % cfg["block_n"]) and cfg["share_b"] == 0), cfg
        assert cfg["multicast"] == (2 if n in (7168, 24576) else 1), cfg
        assert {**cfg, "tight_boxes": 0} == {**plans[""], "tight_boxes": 0}, cfg
    if (m, n) == (200, 4096):
        assert plans[""]["block_m"] == 256
        assert plans[""]["scale_load"] == ("tma_mn_major" if scale_load == 1 else "tma_k_major")
