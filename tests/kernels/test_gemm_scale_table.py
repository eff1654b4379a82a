"""The scale table: a dense 64- or 128-row tile's K-major A scales, every K block, in one TMA box into
a table slot beside the stages (two slots where a CTA runs a second tile; launchers/sm90_fp8_gemm_heuristic.hpp,
kScaleTmaKMajorTable), on every such tile under MOE_FP8_SCALE_TABLE=1 and, unset, on one-wave 64 x 32
tiles (sm90_fp8_gemm_rules.hpp): where the plan takes it, what it leaves of the stages, its SASS, and
its D against the gathers'."""

from __future__ import annotations

import pytest
import torch

import kernels
from gemm_cases import H200_SMS, with_switch_off
from test_sass import _innermost_k_loops, sass


def _table_cols(k: int) -> int:
    """The table's floats per row: the K blocks rounded up to 16 bytes, then to an odd count of them."""
    cols = -(-(k // 128) // 4) * 4
    return cols + (4 if cols // 4 % 2 == 0 else 0)


@pytest.mark.parametrize("m,n,k,block_m", [(64, 2112, 7168, 64), (128, 4096, 7168, 64), (100, 7168, 16384, 64),
                                           (128, 24576, 1536, 128), (64, 32768, 512, 64), (1100, 4096, 2048, 128)])
def test_scale_table_on_dense_tiles_of_one_wave(m, n, k, block_m, monkeypatch):
    """K-major A scales of dense 64- and 128-row tiles come in one TMA box per tile (no scale
    warps), the table's slots beside the stages, which still number at least 4: one slot where no
    CTA runs a second tile, else two. Under =0 the same tiles gather; the table changes only the
    stages."""
    native = kernels.jit.native_module()
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "0")
    gather = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "1")
    table = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert (gather["scale_load"], table["scale_load"], table["scale_warps"]) == ("gather", "tma_k_major_table", 0)
    assert (table["block_m"], table["block_n"]) == (gather["block_m"], gather["block_n"]) and table["block_m"] == block_m
    stage = (table["block_m"] + table["block_n"]) * 128 + 128
    d_tile = table["block_m"] * table["block_n"] * 2
    slots = 1 if table["num_tiles"] <= H200_SMS else 2
    assert table["table_slots"] == slots and gather["table_slots"] == 0
    assert table["smem_bytes"] == d_tile + table["num_stages"] * (stage + 16) + slots * (block_m * _table_cols(k) * 4 + 16)
    assert 4 <= table["num_stages"] and table["smem_bytes"] <= 232448
    assert table["smem_bytes"] + stage + 16 > 232448 or table["num_stages"] == 32, "a stage more would fit"


@pytest.mark.parametrize("m,n,k,expected", [
    (128, 2112, 7168, "tma_k_major_table"),  # 64 x 32 tiles, 2 x 66 = 132: one wave
    (16, 4096, 7168, "tma_k_major_table"),   # 64 x 32, 128 tiles
    (64, 4096, 2048, "tma_k_major_table"),   # 16 K blocks
    (1, 4096, 2048, "gather"),               # fewer than 16 rows
    (15, 4096, 7168, "gather"),
    (64, 2112, 7168, "gather"),              # 64 x 16 tiles
    (128, 4096, 7168, "gather"),             # 64 x 64
    (128, 576, 7168, "gather"),              # 64 x 40
    (128, 7168, 16384, "gather"),            # 64 x 112, 128 K blocks
    (128, 2112, 9216, "gather"),             # 64 x 32 tiles of 72 K blocks
    (1000, 2112, 7168, "gather"),            # 128-row tiles
])
def test_scale_table_by_default_on_one_wave_of_narrow_tiles(m, n, k, expected, monkeypatch):
    """Unset, the table only where it was timed faster than the gathers: 64 x 32 tiles in one wave with
    at most 64 K blocks and at least 16 rows; its plan keeps the gathers' tiles and loses one stage.
    =0 gathers there."""
    native = kernels.jit.native_module()
    monkeypatch.delenv("MOE_FP8_SCALE_TABLE", raising=False)
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert cfg["scale_load"] == expected, cfg
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "0")
    gather = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert gather["scale_load"] == "gather" and gather["table_slots"] == 0, gather
    if expected == "tma_k_major_table":
        assert (cfg["block_m"], cfg["block_n"], cfg["table_slots"]) == (64, 32, 1), cfg
        assert (gather["block_m"], gather["block_n"]) == (64, 32) and cfg["num_stages"] < gather["num_stages"]
        assert cfg["num_tiles"] <= H200_SMS


@pytest.mark.parametrize("m,n,k,switch,slots", [
    (384, 5632, 2048, "b", 2), (300, 4224, 2048, "b", 2), (128, 5632, 2048, "b", 1), (128, 2112, 7168, "2", 1),
    (1000, 7168, 1536, "2", 2),
])
def test_scale_table_slots_count_the_clusters_tiles(m, n, k, switch, slots, monkeypatch):
    """One slot only where no CTA runs a second tile, counted on the tiles as the clusters round them:
    pairs sharing B (MOE_FP8_MULTICAST=b) round the m-blocks up to pairs (384 x 5632: 4 x 44 = 176
    tiles on 132 SMs), clusters sharing A the n-blocks. Under MOE_FP8_SFA_COPY=all the table plan
    still loads its own scales (no copy)."""
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "1")
    monkeypatch.setenv("MOE_FP8_MULTICAST", switch)
    native = kernels.jit.native_module()
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert (cfg["scale_load"], cfg["table_slots"]) == ("tma_k_major_table", slots), cfg
    assert (cfg["num_tiles"] > H200_SMS) == (slots == 2), cfg
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "all")
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert (cfg["scale_load"], cfg["sfa_copy"]) == ("tma_k_major_table", 0), cfg


@pytest.mark.parametrize("m,n,k,gemm_type,groups,scale_load,expected", [
    (4096, 4096, 7168, 0, 1, -1, "tma_k_major"),      # 256-row tiles keep their K-major plan (and copy)
    (4096, 32768, 512, 0, 1, -1, "gather"),           # 256-row tiles of K < 1024 gather
    (64, 2112, 7168, 0, 1, 1, "tma_mn_major"),        # MN-major scales stay MN-major
    (64, 2112, 640, 0, 1, -1, "gather"),              # K / 128 = 5: no TMA view of B's scales
    (8192, 4096, 7168, 1, 4, -1, "gather"),           # contiguous: a tile's rows are its group's
    (16, 7168, 2048, 2, 32, -1, "gather"),            # masked
    (64, 2112, 32768, 0, 1, -1, "gather"),            # 256 K blocks: 260 columns, past a TMA box's 256
    (64, 2112, 32256, 0, 1, -1, "tma_k_major_table"),  # 252 K blocks: 252 columns
])
def test_scale_table_only_where_it_applies(m, n, k, gemm_type, groups, scale_load, expected, monkeypatch):
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "1")
    native = kernels.jit.native_module()
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, gemm_type, groups, scale_load=scale_load)
    assert cfg["scale_load"] == expected, cfg


def test_scale_table_gives_way_to_stages(monkeypatch):
    """A table that would leave fewer than 4 stages is not taken, and MOE_GEMM_STAGES caps the
    table's stages like any other's: a 128-row tile at K = 7168 has slots of 128 x 60 floats (30 KB),
    beside one of which 128 x 192 stages (41 KB) fit 3 times; 128 x 64 stages (24 KB) fit 7 times
    beside one (112 tiles: one a CTA), 6 times beside two (224 tiles)."""
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "1")
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", "192")
    native = kernels.jit.native_module()
    assert native.fp8_gemm_nt_config(128, 7168, 7168, H200_SMS)["scale_load"] == "gather"
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", "64")
    plan = lambda m: native.fp8_gemm_nt_config(m, 7168, 7168, H200_SMS)  # noqa: E731
    assert [(plan(m)["scale_load"], plan(m)["table_slots"], plan(m)["num_stages"]) for m in (128, 256)] == \
        [("tma_k_major_table", 1, 7), ("tma_k_major_table", 2, 6)]
    monkeypatch.setenv("MOE_GEMM_STAGES", "5")
    assert plan(256)["num_stages"] == 5
    monkeypatch.setenv("MOE_FP8_SCALE_TMA", "0")
    assert (plan(256)["scale_load"], plan(256)["table_slots"]) == ("gather", 0)


@pytest.mark.parametrize("m,n,k", [(64, 2112, 7168), (128, 4096, 7168), (64, 576, 7168), (128, 24576, 1536),
                                   (1100, 4096, 2048), (64, 7168, 16384)])
def test_fp8_gemm_scale_table_loads_by_tma_alone(m, n, k, monkeypatch):
    """A tile's K-major A scales arrive in one TMA box, so no scale warp copies (no LDGSTS),
    nothing spills, and the innermost K loops are at most a few instructions per K block longer
    than the gathers' (the table's row and column addressing against the stage's)."""
    native = kernels.jit.native_module()
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "0")
    gathered = sass(*native.fp8_gemm_nt_code(m, n, k, H200_SMS))
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "1")
    config = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert config["scale_load"] == "tma_k_major_table"
    code = sass(*native.fp8_gemm_nt_code(m, n, k, H200_SMS))
    for instruction in ("QGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"):
        assert instruction in code, instruction
    assert "LDGSTS" not in code and "LDGSTS" in gathered
    assert "LDL" not in code and "STL" not in code, "register spills"

    def per_k_block(listing):
        """Instructions per K block of the longest K loop: bodies of four QGMMAs and block_n / 2
        FFMAs per K block (the barrier waits' out-of-line retries branch back over whole loops)."""
        loops = []
        for body in _innermost_k_loops(listing, 8192):
            ops = [op for op in body.splitlines() if op.strip()]
            k_blocks = sum("QGMMA" in op for op in ops) // 4
            if k_blocks and sum("FFMA" in op for op in ops) == k_blocks * config["block_n"] // 2:
                loops.append(len(ops) / k_blocks)
        assert loops
        return max(loops)
    assert per_k_block(code) <= per_k_block(gathered) + 8


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,env", [
    (64, 2112, 7168, ""), (2, 4096, 7168, ""), (100, 7168, 16384, ""), (127, 576, 7168, ""), (128, 4096, 7168, ""),
    (128, 2112, 7168, ""), (128, 24576, 1536, ""), (64, 32768, 512, ""), (1100, 4096, 2048, ""),
    (700, 7168, 1536, "MOE_FP8_MULTICAST=2"), (1216, 1024, 8192, "MOE_GEMM_BLOCK_M=64"),
    (300, 4232, 2048, "MOE_GEMM_STAGES=4"), (1000, 7168, 1536, "MOE_FP8_MULTICAST=b"),
    (129, 2112, 7168, "MOE_GEMM_BLOCK_M=128,MOE_FP8_PINGPONG=1"), (1100, 7168, 1536, "MOE_FP8_MULTICAST=b"),
    (4096, 4232, 2048, "MOE_GEMM_BLOCK_M=128,MOE_GEMM_BLOCK_N=104,MOE_FP8_MULTICAST=2"),
    (4096, 4096, 7168, "MOE_GEMM_BLOCK_M=128"), (1024, 4096, 512, "MOE_GEMM_BLOCK_M=64,MOE_FP8_MULTICAST=0"),
])
def test_gpu_scale_table_matches_gather(m, n, k, env, seed, monkeypatch):
    """Each dense tile's K-major A scales in one TMA box, against the scale warps' gathers
    (MOE_FP8_SCALE_TMA=0): the same scales reach the same FFMAs, so D is bit for bit the same. The
    cases cover 64- and 128-row tiles, M tails whose box runs past the last row (2, 100, 127, 1000,
    1100), table rows with columns past K (K / 128 = 56, 16, 64, 128: zeros the kernel never reads),
    the overlapped and the ping-pong loops, split tail units after whole tiles (1216 x 1024 x 8192),
    clusters sharing A and sharing B with tiles after an idle padding n-block or an invalid m-block
    (4096 x 4232, 1100 x 7168), CTAs that refill both slots many times over several m-blocks (4096 x
    4096 x 7168: ~8 tiles per CTA; 1024 x 4096 x 512: 4 K blocks a tile against 8 stages), and the
    fewest stages a table allows."""
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "1")
    for setting in filter(None, env.split(",")):
        name, value = setting.split("=")
        monkeypatch.setenv(name, value)
    cfg = kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())
    assert cfg["scale_load"] == "tma_k_major_table", cfg
    _, _, d, gathered = with_switch_off(m, n, k, "MOE_FP8_SCALE_TMA", monkeypatch)
    assert torch.equal(d, gathered)
