"""fp8_gemm_nt: reference semantics and argument checks (CPU), code generation compiled for
sm_90a with NVRTC (CPU, CI), and the JIT kernel against a float64 reference (GPU)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kernels
from kernels.reference.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from kernels.testing import calc_diff

DEEPSEEK_NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
GPU_MS = [1, 7, 64, 128, 129, 1000, 4096, 8191]
H200_SMS = 132


def make_operands(m: int, n: int, k: int, device: str, ue8m0: bool = False):
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    a_fp8 = per_token_cast_to_fp8(a, use_ue8m0=ue8m0)
    b_fp8 = per_block_cast_to_fp8(b, use_ue8m0=ue8m0)
    return a_fp8, b_fp8


def reference_f64(a_fp8, b_fp8, c=None) -> torch.Tensor:
    a = kernels.reference.gemm.dequantize_a(*a_fp8).double()
    b = kernels.reference.gemm.dequantize_b(*b_fp8).double()
    out = a @ b.t()
    return out if c is None else out + c.double()


# ---- CPU -------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k", [(1, 8, 128), (37, 136, 384), (130, 264, 256)])
def test_cpu_matches_float64(m, n, k, seed):
    a_fp8, b_fp8 = make_operands(m, n, k, "cpu")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-4


def test_cpu_residual_and_mn_major_scales(seed):
    m, n, k = 70, 256, 512
    a_fp8, b_fp8 = make_operands(m, n, k, "cpu")
    sfa_mn = a_fp8[1].t().contiguous().t()  # same values, MN-major strides
    c = torch.randn(m, n, dtype=torch.float32)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    kernels.fp8_gemm_nt((a_fp8[0], sfa_mn), b_fp8, d, c=c)
    assert calc_diff(d, reference_f64(a_fp8, b_fp8, c)) < 1e-4


def _bad_call(**overrides):
    m, n, k = 8, 16, 128
    a = (torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.ones(m, 1))
    b = (torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    args = dict(a=a, b=b, d=torch.empty(m, n, dtype=torch.bfloat16))
    args.update(overrides)
    kernels.fp8_gemm_nt(**args)


@pytest.mark.parametrize("overrides,match", [
    (dict(a=(torch.zeros(8, 128, dtype=torch.bfloat16), torch.ones(8, 1))), "a\\[0\\] \\(A\\) must be float8_e4m3fn"),
    (dict(a=(torch.zeros(8, 100, dtype=torch.float8_e4m3fn), torch.ones(8, 1))), "a\\[0\\] \\(A\\) must be K-major"),
    (dict(b=(torch.zeros(16, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2))), "b\\[0\\] \\(B\\) must have shape"),
    (dict(b=(torch.zeros(12, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1)),
          d=torch.empty(8, 12, dtype=torch.bfloat16)), "N must be a positive multiple of 8"),
    (dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 2))), "SFA\\) must have shape \\[8, 1\\]"),
    (dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.float16))),
     "SFB\\) must be float32"),
    (dict(d=torch.empty(8, 16, dtype=torch.float32)), "d must be a bfloat16 tensor of shape \\[8, 16\\]"),
    (dict(d=torch.empty(16, 8, dtype=torch.bfloat16).t()), "d must be row-major"),
    (dict(recipe=(1, 1, 128)), "recipe"),
    (dict(compiled_dims="nkx"), "compiled_dims"),
    (dict(c=torch.empty(8, 16, dtype=torch.float16)), "c must be None or"),
    (dict(a=torch.zeros(8, 128)), "a must be a \\(tensor, scales\\) pair"),
])
def test_bad_arguments(overrides, match):
    with pytest.raises((TypeError, ValueError, NotImplementedError), match=match):
        _bad_call(**overrides)


class _TensorLike:
    """Not a tensor, though it answers every attribute the fast path reads."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __getattr__(self, name):
        return getattr(self._tensor, name)


def _fast_path(**overrides):
    m, n, k = 8, 16, 128
    args = dict(a=(torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.ones(m, 1)),
                b=(torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(1, 1)),
                d=torch.empty(m, n, dtype=torch.bfloat16), c=None)
    args.update(overrides)
    return kernels.gemm._launch_args(args["a"], args["b"], args["d"], args["c"], False)


@pytest.mark.parametrize("overrides", [
    dict(a=(torch.zeros(8, 128, dtype=torch.bfloat16), torch.ones(8, 1))),
    dict(a=(torch.zeros(8, 100, dtype=torch.float8_e4m3fn), torch.ones(8, 1))),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn)[None], torch.ones(8, 1))),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8))),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 2))),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), "scales")),
    dict(a=torch.zeros(2, 8, 128, dtype=torch.float8_e4m3fn)),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn),)),
    dict(b=(torch.zeros(16, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2))),
    dict(b=(torch.zeros(12, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1)),
         d=torch.empty(8, 12, dtype=torch.bfloat16)),
    dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.float16))),
    dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1))),
    dict(d=torch.empty(8, 16, dtype=torch.float32)),
    dict(d=torch.empty(8, 24, dtype=torch.bfloat16)),
    dict(d=torch.empty(16, 8, dtype=torch.bfloat16).t()),
    dict(d=torch.empty(8, 16, dtype=torch.bfloat16)[None]),
    dict(c=torch.empty(8, 16, dtype=torch.float16)),
    dict(c=torch.empty(16, 8).t()),
    dict(c=torch.empty(8, 8)),
    dict(c="residual"),
    dict(a=(_TensorLike(torch.zeros(8, 128, dtype=torch.float8_e4m3fn)), torch.ones(8, 1))),
    dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), _TensorLike(torch.ones(1, 1)))),
])
def test_fast_path_refuses_what_the_checks_refuse(overrides):
    """The per-call fast path (one read of each shape and stride, unpacked) refuses every argument
    the full checks refuse, so that _validate runs and names the argument."""
    assert _fast_path() is not None
    assert _fast_path(**overrides) is None


def test_fast_path_takes_the_accepted_layouts():
    """Padded rows of A and B, MN-major (transposed) scales, a list for a pair, a residual of either
    dtype: accepted, with their strides passed on."""
    m, n, k = 8, 16, 256
    a = torch.zeros(m, k + 128, dtype=torch.float8_e4m3fn)[:, :k]
    sfa = torch.ones(2, m).t()
    b = [torch.zeros(n, k + 16, dtype=torch.float8_e4m3fn)[:, :k], torch.ones(1, 2)]
    d = torch.empty(m, n, dtype=torch.bfloat16)
    for c in (None, torch.zeros(m, n, dtype=torch.bfloat16), torch.zeros(m, n + 8)[:, :n]):
        args = kernels.gemm._launch_args((a, sfa), b, d, c, True)
        assert args is not None
        assert args[1] == k + 128 and args[3:5] == (1, m) and args[6] == k + 16 and args[15:19] == (m, n, k, True)
        assert args[13:15] == ((-1, 0) if c is None else (kernels._descriptors.DTYPE_CODES[c.dtype], c.stride(0)))


def test_meta_tensor_among_cpu_ones_is_named():
    """CPU and meta tensors share the device index -1 that the fast path compares: the full checks
    still run on the CPU path and name the devices."""
    with pytest.raises(ValueError, match="one device"):
        _bad_call(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, device="meta")))


def test_c_and_recipe_of_the_wrong_type_raise():
    a = (torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 1))
    b = (torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    with pytest.raises(ValueError, match="c must be None or a row-major"):
        kernels.fp8_gemm_nt(a, b, torch.empty(8, 16, dtype=torch.bfloat16), c="x")
    with pytest.raises(NotImplementedError, match="recipe 5 is not supported"):
        kernels.fp8_gemm_nt(a, b, torch.empty(8, 16, dtype=torch.bfloat16), recipe=5)


def test_strides_past_32_bits_raise():
    """The kernel's scale offsets and C's row stride are 32-bit: views spanning 2^32 elements are
    refused (meta tensors: no storage needed for such strides)."""
    m, n, k = 4, 16, 256
    a = (torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta"), torch.empty(m, 2, device="meta"))
    b = (torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta"), torch.empty(1, 2, device="meta"))
    d = torch.empty(m, n, dtype=torch.bfloat16, device="meta")
    wide_sfb = torch.empty_strided((1, 2), (1, 1 << 32), device="meta")
    with pytest.raises(ValueError, match=r"b\[1\] \(SFB\) spans 2\^32"):
        kernels.fp8_gemm_nt(a, (b[0], wide_sfb), d)
    wide_c = torch.empty_strided((m, n), (1 << 32, 1), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="c's row stride"):
        kernels.fp8_gemm_nt(a, b, d, c=wide_c)


def test_k_not_multiple_of_128():
    a = (torch.zeros(8, 96, dtype=torch.float8_e4m3fn), torch.ones(8, 1))
    b = (torch.zeros(16, 96, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    with pytest.raises(ValueError, match="K must be a positive multiple of 128"):
        kernels.fp8_gemm_nt(a, b, torch.empty(8, 16, dtype=torch.bfloat16))


# ---- heuristic and compile-only (CPU, NVRTC for sm_90a) -----------------------------------------

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
    (1024, 4096, 7168, "128x128"), (512, 7168, 16384, "128x112c2"),  # below the rows measured
    (256, 4096, 7168, "128x64"), (128, 4096, 7168, "64x64c2"), (64, 4096, 7168, "64x32"),
    (64, 7168, 16384, "64x56c2"),
])
def test_wide_tiles_where_they_measured_faster(m, n, k, tile, monkeypatch):
    """Dense FP8 runs 256 x 128 tiles in 2-CTA clusters where their waves, at 14/16 of two 128-row
    tiles' cost each, beat the 128-row heuristic's (bench/RESULTS.md, session 8: every N a multiple
    of 128 from 4096 up at M 2048-8192); N = 2112 and 576 (a padded last n-block, few waves) keep
    128-row tiles, and so do grouped GEMMs and a forced block M or N."""
    native = kernels.jit.native_module()
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert f"{cfg['block_m']}x{cfg['block_n']}" + ("c2" if cfg["multicast"] > 1 else "") == tile
    assert cfg["pingpong"] == 0 or cfg["block_m"] == 128
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS, gemm_type=1, num_groups=4)["block_m"] <= 128
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", "128")
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS)["block_m"] <= 128


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
    over K into 4 units, not inside a CUDA graph capture (no workspace) nor with MOE_GEMM_SPLIT_K=1."""
    native = kernels.jit.native_module()
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    if 64 < m <= 128:
        assert cfg["block_m"] == (128 if (n, k) in {(24576, 1536), (32768, 512)} else 64), cfg
    split = n == 576 and m <= 256
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
    made for a split that would not happen; the config reports no split."""
    native = kernels.jit.native_module()
    whole = native.fp8_gemm_nt_config(m, n, k, H200_SMS, split_workspace=False)
    assert whole["tail_splits"] == 1
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS) == whole


def test_tail_split_has_no_workspace_inside_a_graph_capture(monkeypatch):
    """A GEMM captured in a CUDA graph gets no tail-split workspace (so it runs every tile whole):
    graphs captured on one stream would share one, and one made during a capture would be zeroed
    only when that graph runs. Nothing is allocated or remembered for the capture."""
    monkeypatch.setattr(kernels.gemm, "_capturing", lambda: True)
    before = dict(kernels.gemm._split_workspaces)
    assert kernels.gemm._split_workspace(0, 12345) == (0, 0)
    assert kernels.gemm._split_workspaces == before


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_pingpong_follows_block_n(env, monkeypatch):
    """Block M 128: the math warpgroups take turns by default only at block N > 144 (where it
    measured faster); MOE_FP8_PINGPONG=0 turns it off, =1 on at any block N and for 256-row tiles
    (a turn per wave); block M 64 never."""
    if env is not None:
        monkeypatch.setenv("MOE_FP8_PINGPONG", env)
    native = kernels.jit.native_module()
    for m, n, k in [(4096, 4096, 7168), (4096, 7168, 16384), (4096, 576, 7168), (64, 7168, 2048)]:
        cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
        wanted = cfg["block_n"] > 144 if env is None else env == "1"
        assert cfg["pingpong"] == int((cfg["block_m"] == 128 and wanted) or (cfg["block_m"] == 256 and env == "1")), \
            (m, n, k, cfg)


@pytest.mark.parametrize("m,n,k,c_dtype", [(64, 2112, 7168, -1), (4096, 7168, 2048, -1), (129, 576, 7168, 1),
                                           (8191, 32768, 512, 0)])
def test_compiles_for_sm90a(m, n, k, c_dtype):
    name, code = kernels.jit.native_module().fp8_gemm_nt_code(m, n, k, H200_SMS, False, c_dtype)
    first = kernels.jit.build(name, code, "sm_90a")
    assert first.cubin_path.endswith(".cubin")
    again = kernels.jit.build(name, code, "sm_90a")
    assert again.from_cache and again.key == first.key


# ---- GPU ---------------------------------------------------------------------------------------

def _warm_cache(shapes) -> None:
    """Compile the grid's kernels in parallel before the tests time out on serial JIT."""
    native = kernels.jit.native_module()
    sms = kernels.get_num_sms()
    sources = {native.fp8_gemm_nt_code(m, n, k, sms, False, -1) for m, n, k in shapes}
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda src: kernels.jit.build(src[0], src[1], "sm_90a"), sources))


@pytest.fixture(scope="module")
def warm_gemm_cache():
    if torch.cuda.is_available():
        _warm_cache([(m, n, k) for m in GPU_MS for n, k in DEEPSEEK_NK])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", DEEPSEEK_NK)
@pytest.mark.parametrize("m", GPU_MS)
def test_gpu_matches_float64(m, n, k, warm_gemm_cache, seed):
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    torch.cuda.synchronize()
    assert torch.isfinite(d).all(), "output not fully written"
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3


def _with_switch_off(m, n, k, switch, monkeypatch):
    """Fresh operands; D from the kernel as configured (fully written, against float64), then from
    the same call with ``switch=0``, both outputs NaN-poisoned first. Returns (a, b, d, d_off)."""
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    monkeypatch.setenv(switch, "0")
    off = torch.full_like(d, float("nan"))
    kernels.fp8_gemm_nt(a_fp8, b_fp8, off)
    torch.cuda.synchronize()
    assert torch.isfinite(d).all(), "output not fully written"
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3
    return a_fp8, b_fp8, d, off


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(540, 4232, 1536), (1025, 7168, 2048), (4096, 7168, 16384),
                                   (1, 2112, 7168), (33, 576, 7168), (128, 7168, 16384)])
def test_gpu_clusters_match_single_ctas(m, n, k, seed, monkeypatch):
    """Two CTAs share A (multicast): M tails past the second CTA's half of A (block M 64 and 128),
    odd n-block counts padded to whole clusters. Same inputs with the clusters off
    (MOE_FP8_MULTICAST=0). MOE_FP8_MULTICAST=2 keeps the clusters where the heuristic would not
    (few rows and K < 8192)."""
    monkeypatch.setenv("MOE_FP8_MULTICAST", "2")
    assert kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["multicast"] == 2
    a_fp8, b_fp8, d, single = _with_switch_off(m, n, k, "MOE_FP8_MULTICAST", monkeypatch)
    assert calc_diff(single, reference_f64(a_fp8, b_fp8)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(129, 2112, 7168), (170, 264, 640), (4096, 576, 7168), (4096, 4096, 7168),
                                   (540, 4232, 1536), (300, 7168, 2048), (4096, 7168, 16384)])
def test_gpu_pingpong_matches_no_pingpong(m, n, k, seed, monkeypatch):
    """Block M 128, the two math warpgroups taking turns on the tensor cores: a last m-block whose
    second warpgroup has no valid row (M = 129, 170), block N 8, a scale split known only at run
    time (block N 144), a CTA with more tiles than others (1024 tiles on 132 SMs), 2-CTA clusters
    with an n-block past N (540 x 4232), 7168 x 16384. Same inputs with MOE_FP8_PINGPONG=0: the same
    wgmmas and FFMAs per warpgroup, only their issue order differs, so D is bit for bit the same.
    MOE_FP8_PINGPONG=1 turns it on where the heuristic would not (block N <= 128)."""
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")  # one wave of 128 rows (256: test_gpu_256_row_pingpong_matches_in_step)
    monkeypatch.setenv("MOE_FP8_PINGPONG", "1")
    assert kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["pingpong"] == 1
    _, _, d, plain = _with_switch_off(m, n, k, "MOE_FP8_PINGPONG", monkeypatch)
    assert torch.equal(d, plain)


def _split_against_whole_tiles(m, n, k, monkeypatch):
    """A call whose plan splits tiles over K, against float64 and against the same tiles whole
    (MOE_GEMM_TAIL_SPLIT=0), both NaN-poisoned; a second call gives the same bits (the partials are
    added in split order and the counters were left zero) and a residual C is added once.
    Returns (d, whole)."""
    a_fp8, b_fp8, d, whole = _with_switch_off(m, n, k, "MOE_GEMM_TAIL_SPLIT", monkeypatch)
    assert calc_diff(whole, reference_f64(a_fp8, b_fp8)) < 1e-3
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT")
    again = torch.full_like(d, float("nan"))
    kernels.fp8_gemm_nt(a_fp8, b_fp8, again)
    c = torch.randn(m, n, device="cuda")
    with_c = torch.full_like(d, float("nan"))
    kernels.fp8_gemm_nt(a_fp8, b_fp8, with_c, c=c)
    torch.cuda.synchronize()
    assert torch.equal(again, d)
    assert calc_diff(with_c, reference_f64(a_fp8, b_fp8, c)) < 1e-3
    return d, whole


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,multicast", [(4096, 4096, 7168, "2"), (1000, 4104, 1536, "2"), (257, 264, 640, "0"),
                                             (300, 7168, 2048, "2"), (4096, 2112, 16384, "2")])
def test_gpu_256_row_pingpong_matches_in_step(m, n, k, multicast, seed, monkeypatch):
    """256-row tiles whose two math warpgroups take turns per wave (MOE_FP8_PINGPONG=1): 2-CTA
    clusters with an n-block past N (33 n-blocks) and a partial last m-block (1000 x 4104), one row past the first
    tile without clusters (257), a last tile whose second wave is past M (300), a split tail (4096 x
    2112 x 16384). Against float64 and, bit for bit, against the warpgroups in step (the same wgmmas
    and FFMAs per warpgroup in another issue order)."""
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "256")
    monkeypatch.setenv("MOE_FP8_MULTICAST", multicast)
    monkeypatch.setenv("MOE_FP8_PINGPONG", "1")
    cfg = kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())
    assert (cfg["block_m"], cfg["pingpong"]) == (256, 1), cfg
    _, _, d, plain = _with_switch_off(m, n, k, "MOE_FP8_PINGPONG", monkeypatch)
    assert torch.equal(d, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 2048), (64, 7168, 2048), (1000, 576, 7168)])
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_orders_reads_and_writes(m, n, k, graph, seed, monkeypatch):
    """MOE_GEMM_PDL=1: every GEMM may launch while the previous one runs (each lets the next start
    at once) and waits for it before touching global memory. GEMM 1 writes D1; GEMM 2 adds D1 as
    its residual (read after write); GEMM 3 overwrites D1 (write after GEMM 2's read). On a stream
    and in a CUDA graph (whole tiles), NaN-poisoned outputs, against float64."""
    monkeypatch.setenv("MOE_GEMM_PDL", "1")
    assert kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["pdl"] == 1
    ops = [make_operands(m, n, k, "cuda") for _ in range(3)]
    d1 = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    d2 = torch.full_like(d1, float("nan"))

    def chain():
        kernels.fp8_gemm_nt(*ops[0], d1)
        kernels.fp8_gemm_nt(*ops[1], d2, c=d1)
        kernels.fp8_gemm_nt(*ops[2], d1)

    chain()  # compiled outside any capture
    torch.cuda.synchronize()
    d1.fill_(float("nan"))
    d2.fill_(float("nan"))
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        d1.fill_(float("nan"))
        d2.fill_(float("nan"))
        g.replay()
    else:
        chain()
    torch.cuda.synchronize()
    first = reference_f64(*ops[0])
    assert calc_diff(d2, reference_f64(*ops[1], c=first)) < 1e-3
    assert calc_diff(d1, reference_f64(*ops[2])) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_dependent_starts_early_and_waits(graph, seed, monkeypatch):
    """MOE_GEMM_PDL=1 where a missing wait could not go unseen: a long GEMM on few SMs (64 x 576 x
    16384, 72 CTAs, K unsplit) writes D1, then a short one (K = 128) adds D1 as its residual. The
    short kernel starts before the long one ends (the launch attribute took effect, in a CUDA graph
    too), yet reads D1 only once written: D1 holds NaN until then."""
    monkeypatch.setenv("MOE_GEMM_PDL", "1")
    monkeypatch.setenv("MOE_GEMM_SPLIT_K", "1")
    m, n = 64, 576
    long_ops, short_ops = make_operands(m, n, 16384, "cuda"), make_operands(m, n, 128, "cuda")
    d1 = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    d2 = torch.full_like(d1, float("nan"))

    def chain():
        kernels.fp8_gemm_nt(*long_ops, d1)
        kernels.fp8_gemm_nt(*short_ops, d2, c=d1)

    chain()
    run = chain
    if graph:
        for _ in range(2):  # the first capture compiles the whole-tile kernels a capture plans
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
        run = g.replay
    torch.cuda.synchronize()
    d1.fill_(float("nan"))
    d2.fill_(float("nan"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    gemms = sorted((e for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and "sm90_fp8_gemm_nt" in e.name),
                   key=lambda e: e.time_range.start)
    assert len(gemms) == 2, [e.name for e in gemms]
    assert gemms[1].time_range.start < gemms[0].time_range.end, "the dependent GEMM did not start early"
    first = reference_f64(*long_ops)
    assert calc_diff(d1, first) < 1e-3
    assert calc_diff(d2, reference_f64(*short_ops, c=first)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,num_sms", [(4096, 7168, 8192, None), (1000, 7168, 16384, None), (4096, 4096, 16384, None),
                                           (300, 3080, 12288, 16), (520, 3080, 16384, 16), (1000, 2056, 8192, 16)])
def test_gpu_tail_split_matches_whole_tiles(m, n, k, num_sms, seed, monkeypatch):
    """The last wave's tiles split over K (2-CTA clusters, 2 and 3 units, a partial m-block; no
    clusters at N = 4096, 3 units; on a grid cut to 16 SMs, 3, 4 and 2 units with partial m- and
    n-blocks among the split tiles, block N 136 (a run-time scale split), 160 and 192, and
    counters where a 132-SM plan leaves them): D against
    float64 and against the same call with MOE_GEMM_TAIL_SPLIT=0, both NaN-poisoned. A second
    call gives the same bits (the partials are added in split order, and the counters were left
    zero), and a residual C is added once."""
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")  # 256-row tiles' split: test_gpu_256_row_tiles
    if num_sms is not None:
        kernels.set_num_sms(num_sms)
    try:
        assert kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["tail_splits"] > 1
        _split_against_whole_tiles(m, n, k, monkeypatch)
    finally:
        kernels.jit.reset_num_sms()


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,block_m,block_n,ways", [
    (64, 2112, 7168, "", "128", "8"),     # 7 units of 8 K blocks per tile, a partial n-block
    (1, 576, 7168, "", "64", "4"),        # one row
    (100, 4096, 7168, "", "128", "4"),    # a partial m-block; 64 tiles leave room for 2 units each
    (37, 7168, 2048, "", "112", "3"),     # a run-time scale split (block N 112); 2 units of 8 K blocks
    (128, 264, 640, "", "24", "5"),       # units of one K block
    (300, 2112, 7168, "256", "128", "4"),  # 256-row tiles, 3 units each, the second wave past M
])
def test_gpu_split_k_of_a_single_wave(m, n, k, block_m, block_n, ways, seed, monkeypatch):
    """MOE_GEMM_SPLIT_K: every tile of a single wave split over K, against float64 and against the
    same tiles whole (MOE_GEMM_TAIL_SPLIT=0), both NaN-poisoned; a second call gives the same bits
    and a residual C is added once."""
    if block_m:
        monkeypatch.setenv("MOE_GEMM_BLOCK_M", block_m)
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", block_n)
    monkeypatch.setenv("MOE_GEMM_SPLIT_K", ways)
    if kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["tail_splits"] == 1:
        pytest.skip(f"{kernels.get_num_sms()} SMs leave no room for a second unit per tile (132 do)")
    d, whole = _split_against_whole_tiles(m, n, k, monkeypatch)
    # The same tiles, summed in another order: bf16 roundings apart at most.
    assert calc_diff(d, whole) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,env", [(64, 2112, 7168, {"MOE_GEMM_BLOCK_N": "128", "MOE_GEMM_SPLIT_K": "8"}),
                                       (64, 576, 7168, {}), (200, 576, 7168, {})])
def test_gpu_split_k_planned_but_captured_runs_whole_tiles(m, n, k, env, seed, monkeypatch):
    """Inside a CUDA graph capture a GEMM gets no split workspace: a single wave planned as split-K
    (forced, or the heuristic's at N = 576) runs its tiles whole, the heuristic's planned for whole
    tiles; the replayed graph's D matches float64."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["tail_splits"] > 1
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)  # compiled outside the capture
    d.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    d.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(d).all(), "output not fully written"
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,multicast,splits", [
    (257, 264, 640, "0", 1),         # one row past the first tile, a partial n-block
    (1000, 4232, 1536, "2", 1),      # a partial m-block past its second wave's first row
    (4096, 4096, 7168, "2", 1),
    (8191, 576, 7168, "0", 1),       # the last m-block's second wave ends a row short
    (300, 7168, 2048, "2", 1),       # 44 rows in the last tile: its second wave is past M
    (4096, 2112, 16384, "2", 4),     # the last wave's tiles split over K, a partial n-block among them
])
def test_gpu_256_row_tiles(m, n, k, multicast, splits, seed, monkeypatch):
    """Block 256 x 128 (two waves of 128 rows on the two math warpgroups), with and without 2-CTA
    clusters, forced by MOE_GEMM_BLOCK_M=256: D against float64, NaN-poisoned, partial m- and
    n-blocks, a split tail, and a residual C added once."""
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "256")
    monkeypatch.setenv("MOE_FP8_MULTICAST", multicast)
    cfg = kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())
    assert (cfg["block_m"], cfg["block_n"], cfg["multicast"], cfg["tail_splits"]) == (
        256, 128, int(multicast) or 1, splits), cfg
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    c = torch.randn(m, n, device="cuda")
    with_c = torch.full_like(d, float("nan"))
    kernels.fp8_gemm_nt(a_fp8, b_fp8, with_c, c=c)
    torch.cuda.synchronize()
    assert torch.isfinite(d).all(), "output not fully written"
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3
    assert calc_diff(with_c, reference_f64(a_fp8, b_fp8, c)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("c_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(77, 576, 7168), (300, 2112, 1536)])
def test_gpu_residual_ue8m0_mn_major(m, n, k, c_dtype, seed):
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda", ue8m0=True)
    sfa_mn = a_fp8[1].t().contiguous().t()
    c = torch.randn(m, n, device="cuda", dtype=c_dtype)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemm_nt((a_fp8[0], sfa_mn), b_fp8, d, c=c)
    torch.cuda.synchronize()
    assert calc_diff(d, reference_f64(a_fp8, b_fp8, c)) < 1e-3


@pytest.mark.gpu
def test_gpu_strided_rows_and_compiled_m(seed):
    m, n, k = 100, 264, 640
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    a_wide = torch.empty(m, k + 128, dtype=torch.float8_e4m3fn, device="cuda")
    a_wide[:, :k] = a_fp8[0]
    d_wide = torch.full((m, n + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    d = d_wide[:, :n]
    kernels.fp8_gemm_nt((a_wide[:, :k], a_fp8[1]), b_fp8, d, compiled_dims="mnk")
    torch.cuda.synchronize()
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3
    assert torch.isnan(d_wide[:, n:]).all(), "wrote outside D"


# ---- bf16_gemm_nt ----------------------------------------------------------------------------

BF16_NK = [(2112, 7168), (7168, 2048), (4096, 7168), (264, 320)]


def bf16_reference(a, b, c=None) -> torch.Tensor:
    out = a.double() @ b.double().t()
    return out if c is None else out + c.double()


def test_bf16_cpu_matches_float64(seed):
    a, b = torch.randn(37, 192, dtype=torch.bfloat16), torch.randn(136, 192, dtype=torch.bfloat16)
    c = torch.randn(37, 136)
    d = torch.full((37, 136), float("nan"), dtype=torch.bfloat16)
    kernels.bf16_gemm_nt(a, b, d, c=c)
    assert calc_diff(d, bf16_reference(a, b, c)) < 1e-4


@pytest.mark.parametrize("a,b,match", [
    (torch.zeros(8, 64), torch.zeros(16, 64, dtype=torch.bfloat16), "a must be a 2-D bfloat16 tensor"),
    (torch.zeros(8, 96, dtype=torch.bfloat16), torch.zeros(16, 96, dtype=torch.bfloat16), "K of 64"),
    (torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(16, 128, dtype=torch.bfloat16), "b must have shape"),
])
def test_bf16_bad_arguments(a, b, match):
    with pytest.raises((TypeError, ValueError), match=match):
        kernels.bf16_gemm_nt(a, b, torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16))


@pytest.mark.parametrize("m,n,k", [(64, 2112, 7168), (4096, 7168, 2048), (300, 264, 320)])
def test_bf16_compiles_for_sm90a(m, n, k):
    name, code = kernels.jit.native_module().bf16_gemm_nt_code(m, n, k, H200_SMS)
    assert kernels.jit.build(name, code, "sm_90a").cubin_path.endswith(".cubin")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", BF16_NK)
@pytest.mark.parametrize("m", [1, 77, 128, 129, 4096])
def test_bf16_gpu_matches_float64(m, n, k, seed):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.bf16_gemm_nt(a, b, d)
    torch.cuda.synchronize()
    assert torch.isfinite(d).all(), "output not fully written"
    assert calc_diff(d, bf16_reference(a, b)) < 1e-4


@pytest.mark.gpu
def test_bf16_gpu_residual(seed):
    a = torch.randn(200, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(576, 512, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(200, 576, device="cuda", dtype=torch.float32)
    d = torch.empty(200, 576, device="cuda", dtype=torch.bfloat16)
    kernels.bf16_gemm_nt(a, b, d, c=c)
    torch.cuda.synchronize()
    assert calc_diff(d, bf16_reference(a, b, c)) < 1e-4


@pytest.mark.parametrize("recipe,compiled_dims", [((1, 128, 128), "nk"), (None, "k"), (None, ""), (None, "mnk")])
def test_accepted_recipe_and_compiled_dims_reach_the_fast_path(recipe, compiled_dims, seed):
    """Every recipe / compiled_dims the checks accept must also pass the per-call fast path (on a
    GPU a refusal there is an error)."""
    m, n, k = 9, 16, 256
    a_fp8, b_fp8 = make_operands(m, n, k, "cpu")
    d = torch.empty(m, n, dtype=torch.bfloat16)
    assert kernels.gemm._launch_args(a_fp8, b_fp8, d, None, "m" in compiled_dims) is not None
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d, recipe=recipe, compiled_dims=compiled_dims)
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-4
