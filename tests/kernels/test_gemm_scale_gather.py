"""The GEMMs' scale warps in chunks (common/scale_gather.cuh, MOE_FP8_GATHER_CHUNK): K-major A scales
(and the FP8 x FP4 GEMM's exponent words) loaded several K blocks per row into registers and stored a
K block at a time, against the 4-byte cp.async gathers. The same scales reach the same FFMAs, so D is
bit for bit the same."""

from __future__ import annotations

import pytest
import torch

import grouped_fp4_cases as fp4
import kernels
from gemm_cases import H200_SMS, assert_settings_agree, outputs_per_setting
from grouped_cases import (assert_contiguous_rows, assert_masked_rows, assert_same_output,
                           contiguous_outputs_per_setting, make_masked, make_weights, run_masked)


def native():
    return kernels.jit.native_module()


@pytest.mark.parametrize("m,n,k,block_m,setting,chunk", [
    (64, 2112, 7168, 64, "4", 4), (128, 4096, 7168, 64, "2", 2), (64, 7168, 16384, 64, "1", 1),
    (384, 7168, 16384, 128, "4", 2), (384, 4096, 7168, 128, "2", 2), (384, 4096, 7168, 128, "1", 1),
])
def test_chunk_follows_the_setting_and_block_m(m, n, k, block_m, setting, chunk, monkeypatch):
    """0 keeps the cp.async copies; 1, 2 or 4 K blocks per load at block M 64, up to 2 at 128 (the
    producers' registers); the scale warps that may take turns shrink with the chunk, and 128-row
    chunks of 2 go to one pair of warps splitting the rows."""
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "0")
    base = native().fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert (base["scale_load"], base["gather_chunk"], base["block_m"]) == ("gather", 0, block_m), base
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", setting)
    cfg = native().fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert cfg["gather_chunk"] == chunk, cfg
    turns = (base["num_stages"] - 1) // chunk + 1
    pair = block_m == 128 and chunk > 1
    assert cfg["scale_warps"] == (2 if pair else min(base["scale_warps"], turns)), cfg
    # Everything else is the default's plan.
    for key in ("block_m", "block_n", "num_stages", "multicast", "share_b", "tail_splits"):
        assert cfg[key] == base[key], key


@pytest.mark.parametrize("m,n,k,chunk", [
    (384, 7168, 16384, 2), (1024, 7168, 16384, 2),  # 128 x 192 in clusters sharing A, 128 K blocks
    (384, 7168, 2048, 0), (384, 24576, 1536, 0),    # 128 x 192, 16 and 12 K blocks
    (384, 4096, 7168, 0),                           # 128 x 96
    (256, 7168, 16384, 0),                          # 128 x 112 pairs sharing B
    (144, 2112, 7168, 0), (1000, 576, 7168, 0),     # 64-row tiles
])
def test_default_chunk_on_wide_clusters_over_long_k(m, n, k, chunk, monkeypatch):
    """Unset: chunks of 2 (a pair of warps) only on dense 128 x 192 tiles in clusters sharing A over 64
    K blocks or more, the plans timed faster (session 50); copies elsewhere; K-major scales only."""
    monkeypatch.delenv("MOE_FP8_GATHER_CHUNK", raising=False)
    cfg = native().fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert cfg["gather_chunk"] == chunk, cfg
    assert cfg["scale_warps"] == (2 if chunk else min(3, cfg["num_stages"])), cfg
    if chunk:
        assert (cfg["block_m"], cfg["block_n"], cfg["multicast"], cfg["share_b"]) == (128, 192, 2, 0), cfg
        assert native().fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=0)["gather_chunk"] == 0  # any strides
        monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "0")
        assert native().fp8_gemm_nt_config(m, n, k, H200_SMS)["gather_chunk"] == 0


@pytest.mark.parametrize("value", ["3", "8", "x"])
def test_chunk_setting_refuses_other_values(value, monkeypatch):
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", value)
    with pytest.raises(Exception, match=f"MOE_FP8_GATHER_CHUNK must be 0, 1, 2 or 4, got '{value}'"):
        native().fp8_gemm_nt_config(384, 7168, 16384, H200_SMS)
    with pytest.raises(Exception, match=f"MOE_FP8_GATHER_CHUNK must be 0, 1, 2 or 4, got '{value}'"):
        native().fp8_fp4_gemm_nt_code(8192, 4096, 7168, H200_SMS, 1, 32)


def test_chunks_need_k_major_scales(monkeypatch):
    """Chunks beyond one K block need K-major scales on 16 bytes: any strides (scale_load 0) or K
    blocks not a multiple of 4 load one K block at a time; MN-major scales come by TMA, and masked
    GEMMs gather one K block at a time; 256-row tiles keep the copies."""
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "4")
    config = native().fp8_gemm_nt_config
    assert config(64, 2112, 7168, H200_SMS, scale_load=0)["gather_chunk"] == 1
    assert config(64, 2112, 7168, H200_SMS, scale_load=1)["gather_chunk"] == 0
    assert config(64, 2112, 640, H200_SMS)["gather_chunk"] == 1
    assert config(16, 4096, 7168, H200_SMS, gemm_type=2, num_groups=32)["gather_chunk"] == 1
    monkeypatch.setenv("MOE_FP8_SCALE_WARPS", "1")
    cfg = config(384, 7168, 16384, H200_SMS)
    assert (cfg["block_m"], cfg["gather_chunk"], cfg["scale_warps"]) == (128, 1, 1), cfg  # no pair to split rows
    monkeypatch.delenv("MOE_FP8_SCALE_WARPS")
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "256")
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "0")
    cfg = config(4096, 4232, 640, H200_SMS)
    assert (cfg["block_m"], cfg["scale_load"], cfg["gather_chunk"]) == (256, "gather", 0), cfg


def test_chunked_kernel_has_no_cp_async_copies(monkeypatch):
    """The chunked scale warps issue vector loads and shared stores, no LDGSTS, and the producers
    spill nothing (compiled here with NVRTC for sm_90a)."""
    from test_sass import sass
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "4")
    # 64 x 16 tiles in chunks of 4; 128-row pairs of warps in chunks of 2: 128 x 192, 128 x 112 clusters
    # sharing B, 128 x 160 ping-pong (chunks of 4 spilled in the last three, at K = 2048).
    for m, n, k in ((64, 2112, 7168), (384, 7168, 16384), (384, 7168, 2048), (256, 7168, 2048), (1024, 7168, 2048)):
        chunk = native().fp8_gemm_nt_config(m, n, k, H200_SMS)["gather_chunk"]
        assert chunk == (4 if m == 64 else 2)
        text = sass(*native().fp8_gemm_nt_code(m, n, k, H200_SMS))
        assert "LDGSTS" not in text
        assert f"LDG.E.NA.{32 * chunk}.CONSTANT" in text  # not allocated in L1
        assert "LDL" not in text and "STL" not in text, f"register spills at {m} x {n} x {k}"


@pytest.mark.parametrize("m,n,k,setting,tile,rows,two_sets", [
    (64, 2112, 7168, "1", (64, 16), 2, True),
    (64, 2112, 7168, "2", (64, 16), 2, True),
    (384, 4096, 7168, "2", (128, 96), 2, True),    # a pair of warps, 64 rows each
    (384, 4096, 7168, "1", (128, 96), 4, True),
    (384, 7168, 16384, "2", (128, 192), 2, False),  # 96 accumulators a set: the math keeps 232 registers
])
def test_chunks_in_flight(m, n, k, setting, tile, rows, two_sets, monkeypatch):
    """64-row tiles, and 128-row tiles up to block N 160, prefetch the next chunk into a second register
    set: their A loads come from three places (the first chunk, then each set in the unrolled loop),
    at least three times the rows a lane holds; one set loads from fewer. Nothing spills (NVRTC)."""
    from test_sass import sass
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", setting)
    cfg = native().fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert ((cfg["block_m"], cfg["block_n"]), cfg["gather_chunk"]) == (tile, int(setting)), cfg
    text = sass(*native().fp8_gemm_nt_code(m, n, k, H200_SMS))
    load = "LDG.E.NA.CONSTANT" if setting == "1" else "LDG.E.NA.64.CONSTANT"
    assert (text.count(load) >= 3 * rows) == two_sets, text.count(load)
    assert "LDL" not in text and "STL" not in text


def _chunks_or_copies(value, cfg):
    assert (cfg["gather_chunk"] > 0) == (value != "0"), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,env,settings", [
    (64, 2112, 7168, {}, "421"),            # 64 x 16 tiles, 21 stages: chunks of 4; of 2 and 1 two in flight
    (1, 576, 7168, {}, "4"),                                       # one row: 63 rows of every chunk past M
    (100, 7168, 16384, {}, "4"),                                   # a partial 64-row m-block
    (384, 7168, 16384, {}, "42"),           # 128 x 192 tiles, 4 stages: a pair splitting the rows, chunks of 2
    (300, 7168, 16384, {}, "1"),                                   # one K block, one warp per K block's rows
    (1000, 4096, 7168, {"MOE_GEMM_BLOCK_M": "128"}, "41"),         # several tiles per CTA, the tail split
    (200, 24576, 1536, {"MOE_FP8_MULTICAST": "b"}, "4"),           # pairs of CTAs sharing B
    (1024, 7168, 2048, {}, "4"),                                   # 128 x 160 ping-pong
    (37, 7168, 2048, {"MOE_GEMM_BLOCK_N": "112", "MOE_GEMM_SPLIT_K": "3"}, "42"),  # units of 6 and 5 K blocks
    (128, 264, 1536, {"MOE_GEMM_BLOCK_N": "24", "MOE_GEMM_SPLIT_K": "3"}, "42"),  # units start inside a chunk
    (100, 2112, 1536, {"MOE_GEMM_BLOCK_M": "128", "MOE_GEMM_SPLIT_K": "4"}, "4"),  # ... of 2 (units of 3)
])
def test_gpu_chunked_gathers_match_copies(m, n, k, env, settings, seed, monkeypatch):
    """Dense: D bit for bit that of the 4-byte copies, NaN-poisoned, against float64 too, with a
    residual; rows past M (zero scales), split units whose K ranges start and end inside a chunk."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    c = torch.randn(m, n, device="cuda")
    a_fp8, b_fp8, outputs = outputs_per_setting(m, n, k, "MOE_FP8_GATHER_CHUNK", (*settings, "0"), monkeypatch, c=c,
                                                check=_chunks_or_copies)
    assert_settings_agree(outputs, a_fp8, b_fp8, c)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,n,k", [([1000, 0, 513, 2048], 4096, 1536), ([5, 300], 7168, 2048)])
def test_gpu_contiguous_chunked_gathers_match_copies(counts, n, k, seed, monkeypatch):
    """Contiguous: padding rows and an empty group, bit for bit the copies' output."""
    a_fp8, b_fp8, m_indices, outputs = contiguous_outputs_per_setting(counts, n, k, "MOE_FP8_GATHER_CHUNK", ("4", "0"),
                                                                      monkeypatch, _chunks_or_copies)
    assert_contiguous_rows(outputs["4"], a_fp8, b_fp8, m_indices)
    assert_same_output(outputs["4"], outputs["0"], "chunked gathers")


@pytest.mark.gpu
@pytest.mark.parametrize("masked,max_m,expected_m,n,k", [
    ([20] * 32, 32, 20, 4096, 7168),                    # decode: 64-row tiles
    ([0, 5, 100, 0, 77, 1, 128, 3], 128, 8, 7168, 2048),  # empty groups, rows past masked_m
    ([300, 0, 129], 384, 256, 4096, 7168),              # 128-row tiles
])
def test_gpu_masked_gathers_in_registers_match_copies(masked, max_m, expected_m, n, k, seed, monkeypatch):
    """Masked: scales loaded a K block at a time into registers, bit for bit the copies' output, the
    rows from masked_m (rounded up to 8) left NaN."""
    g = len(masked)
    b_fp8 = make_weights(g, n, k, "cuda")
    a, masked_m = make_masked(masked, max_m, k)
    outputs = {}
    for chunk in ("4", "0"):
        monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", chunk)
        cfg = native().fp8_gemm_nt_config(min(expected_m, max_m), n, k, kernels.get_num_sms(), False, -1, 2, g)
        assert cfg["gather_chunk"] == (1 if chunk == "4" else 0), cfg
        outputs[chunk] = run_masked(a, b_fp8, masked_m, expected_m, n)
    torch.cuda.synchronize()
    assert_same_output(outputs["4"], outputs["0"], "gathers in registers")
    assert_masked_rows(outputs["4"], a, b_fp8, masked)


# ---- The FP8 x FP4 GEMM's converter kernel -----------------------------------------------------

CONVERTER = {"MOE_FP4_SWAP_AB": "0", "MOE_FP4_STAGED": "0"}


def _fp4_plan(m, n, k, gemm_type, groups):
    return native().fp8_fp4_gemm_nt_code(m, n, k, H200_SMS, gemm_type, groups)[2]


@pytest.mark.parametrize("m,n,k,gemm_type,groups,setting,tile,chunk,warps", [
    (8192, 4096, 7168, 1, 32, "4", (128, 128), 2, 2),  # B's 4 rows per lane: chunks of 2; a pair splits A's rows
    (4000, 136, 2048, 1, 32, "4", (128, 48), 4, 2),    # B's 2 rows per lane: chunks of 4
    (64, 136, 2048, 2, 32, "4", (64, 48), 4, 3),       # 64-row tiles, 12 stages: 3 warps take turns
    (64, 4096, 7168, 2, 32, "1", (64, 128), 1, 3),
    (256, 4096, 1152, 1, 2, "4", (128, 64), 1, 3),     # 9 K blocks: rows off 16 bytes
])
def test_fp4_chunk_follows_the_setting_and_tile(m, n, k, gemm_type, groups, setting, tile, chunk, warps, monkeypatch):
    """As the FP8 GEMM's: chunks as large as keep a lane's A rows and B rows within 8 registers each, 1
    where K blocks are not a multiple of 4; one scale warp keeps 128-row tiles at 1."""
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "0")
    base = _fp4_plan(m, n, k, gemm_type, groups)
    assert ((base["block_m"], base["block_n"]), base["gather_chunk"], base["scale_warps"]) == (tile, 0, 3), base
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", setting)
    cfg = _fp4_plan(m, n, k, gemm_type, groups)
    assert (cfg["gather_chunk"], cfg["scale_warps"]) == (chunk, warps), cfg
    assert (cfg["block_m"], cfg["block_n"], cfg["num_stages"]) == (base["block_m"], base["block_n"], base["num_stages"])
    if tile[0] == 128 and chunk > 1:
        monkeypatch.setenv("MOE_FP8_SCALE_WARPS", "1")
        assert _fp4_plan(m, n, k, gemm_type, groups)["gather_chunk"] == 1


@pytest.mark.parametrize("m,n,k,gemm_type,groups,chunk", [
    (8192, 4096, 7168, 1, 32, 2), (256, 7168, 2048, 2, 32, 2),  # 128 x 128: a pair of warps, chunks of 2
    (64, 4096, 7168, 2, 32, 0),                                 # 64 x 128
    (256, 4096, 1152, 1, 2, 0), (4000, 136, 2048, 1, 32, 0),    # 9 K blocks; 128 x 48
])
def test_fp4_default_chunk_on_128_by_128_tiles(m, n, k, gemm_type, groups, chunk, monkeypatch):
    """Unset: chunks of 2 on 128 x 128 tiles (timed faster, session 50), the copies elsewhere."""
    monkeypatch.delenv("MOE_FP8_GATHER_CHUNK", raising=False)
    cfg = _fp4_plan(m, n, k, gemm_type, groups)
    assert (cfg["gather_chunk"], cfg["scale_warps"]) == (chunk, 2 if chunk else 3), cfg


def test_fp4_chunked_kernel_has_no_cp_async_copies(monkeypatch):
    """The chunked converter kernels (a pair at 128 rows, turns at 64, clusters sharing B) load with
    vector loads and spill nothing (NVRTC, sm_90a)."""
    from test_sass import sass
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "4")
    for m, n, k, gemm_type, groups, share_b in ((8192, 4096, 7168, 1, 32, "0"), (64, 136, 2048, 2, 32, "0"),
                                                (256, 4096, 7168, 2, 32, "1")):
        monkeypatch.setenv("MOE_FP4_SHARE_B", share_b)
        name, code, cfg = native().fp8_fp4_gemm_nt_code(m, n, k, H200_SMS, gemm_type, groups)
        assert cfg["gather_chunk"] > 1 and cfg["multicast"] == (2 if share_b == "1" else 1), cfg
        text = sass(name, code)
        assert "LDGSTS" not in text
        assert f"LDG.E.NA.{32 * cfg['gather_chunk']}.CONSTANT" in text
        assert "LDL" not in text and "STL" not in text, f"register spills at {m} x {n} x {k}"


def _fp4_outputs(run, settings, seed, monkeypatch):
    """D per setting of MOE_FP8_GATHER_CHUNK from one call each on the same operands (reseeded)."""
    outputs = {}
    for setting in settings:
        monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", setting)
        torch.manual_seed(seed)
        outputs[setting] = run()[-1]
    torch.cuda.synchronize()
    return outputs


@pytest.mark.gpu
@pytest.mark.parametrize("counts,n,k,chunk", [
    ([300, 0, 129, 1], 4096, 7168, 2),   # 128 x 128: a pair of warps, chunks of 2
    ([5, 300, 77], 136, 2048, 4),        # 128 x 16: chunks of 4, B's rows on half the lanes
    ([37, 5], 576, 1152, 1),             # 9 K blocks: one K block a load
])
def test_gpu_fp4_contiguous_chunked_gathers_match_copies(counts, n, k, chunk, seed, monkeypatch):
    """Converter kernel, contiguous: padding rows and an empty group, bit for bit the copies' output and
    against float64 on the dequantized weights (fresh operands)."""
    for name, value in CONVERTER.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "4")
    assert _fp4_plan(fp4.contiguous_rows(counts), n, k, 1, len(counts))["gather_chunk"] == chunk
    fp4.check_contiguous(counts, n, k, "cuda")
    outputs = _fp4_outputs(lambda: fp4.run_contiguous(counts, n, k, "cuda"), ("4", "1", "0"), seed, monkeypatch)
    assert_same_output(outputs["4"], outputs["0"], "chunked gathers")
    assert_same_output(outputs["1"], outputs["0"], "gathers a K block at a time")


@pytest.mark.gpu
@pytest.mark.parametrize("masked,max_m,expected_m,n,k,share_b,chunk", [
    ([64, 0, 17, 50], 64, 64, 136, 2048, "0", 4),       # 64 x 16 tiles, turns over chunks of 4
    ([256, 100, 0, 129], 256, 256, 4096, 7168, "1", 2),  # 128 x 128 pairs of CTAs sharing B
])
def test_gpu_fp4_masked_chunked_gathers_match_copies(masked, max_m, expected_m, n, k, share_b, chunk, seed,
                                                     monkeypatch):
    """Converter kernel, masked: groups of 0 rows and rows past masked_m, bit for bit the copies'
    output and against float64."""
    for name, value in {**CONVERTER, "MOE_FP4_SHARE_B": share_b}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "4")
    assert _fp4_plan(expected_m, n, k, 2, len(masked))["gather_chunk"] == chunk
    fp4.check_masked(masked, max_m, n, k, expected_m, "cuda")
    outputs = _fp4_outputs(lambda: fp4.run_masked(masked, max_m, n, k, expected_m, "cuda"), ("4", "0"), seed,
                           monkeypatch)
    assert_same_output(outputs["4"], outputs["0"], "chunked gathers")
