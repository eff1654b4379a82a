"""m_grouped_fp8_gemm_nt_contiguous / _masked: CPU reference, the alignment setting, code generation
compiled for sm_90a (CPU, CI), and the JIT kernels against a float64 reference (GPU), including
the edge cases of the MoE layouts. Their argument checks: test_grouped_args.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kernels
from kernels.reference.gemm import dequantize_a, dequantize_b
from kernels.reference.quant import per_token_cast_to_fp8
from kernels.testing import calc_diff

from gemm_cases import H200_SMS, TensorSubclass
from grouped_cases import (GROUPED_NK, assert_contiguous_rows, assert_masked_rows, assert_same_output,
                           contiguous_config, contiguous_outputs_per_setting, make_masked, expected_contiguous, make_contiguous, make_weights, run_contiguous,
                           run_masked)


def check_contiguous(counts, n, k, device):
    b_fp8 = make_weights(len(counts), n, k, device)
    a_fp8, m_indices = make_contiguous(counts, k, device)
    d = run_contiguous(a_fp8, b_fp8, m_indices, n)
    if (m_indices >= 0).any():
        assert_contiguous_rows(d, a_fp8, b_fp8, m_indices)


def check_masked(masked: list[int], max_m: int, n: int, k: int, expected_m: int, device: str):
    g = len(masked)
    b_fp8 = make_weights(g, n, k, device)
    a = torch.randn(g * max_m, k, device=device, dtype=torch.bfloat16)
    a_fp8, sfa = per_token_cast_to_fp8(a)
    a_fp8, sfa = a_fp8.view(g, max_m, k), sfa.view(g, max_m, -1)
    masked_m = torch.tensor(masked, dtype=torch.int32, device=device)
    d = run_masked((a_fp8, sfa), b_fp8, masked_m, expected_m, n)
    assert_masked_rows(d, (a_fp8, sfa), b_fp8, masked)


# ---- CPU ----------------------------------------------------------------------------------------

def test_cpu_contiguous(seed):
    check_contiguous([5, 0, 130, 1], 136, 256, "cpu")


def test_cpu_masked(seed):
    check_masked([3, 0, 17], 20, 64, 128, 8, "cpu")


def test_alignment_setting():
    assert kernels.get_mk_alignment_for_contiguous_layout() == 128
    with pytest.raises(ValueError, match="multiple of 128"):
        kernels.set_mk_alignment_for_contiguous_layout(64)
    kernels.set_mk_alignment_for_contiguous_layout(256)
    assert kernels.get_mk_alignment_for_contiguous_layout() == 256
    kernels.set_mk_alignment_for_contiguous_layout(128)


@pytest.mark.parametrize("alignment,tile", [(128, "128x192c2b"), (256, "256x128c2")])
def test_contiguous_256_row_tiles_need_the_layout_aligned_to_256(alignment, tile, monkeypatch):
    """A 256-row tile reads its group from its first row: the heuristic takes it for contiguous
    layouts only when the caller's alignment (set_mk_alignment_for_contiguous_layout) is a multiple
    of 256, and a forced block M 256 raises otherwise; masked GEMMs never take it."""
    native = kernels.jit.native_module()
    cfg = native.fp8_gemm_nt_config(32768, 4096, 7168, 132, gemm_type=1, num_groups=4, alignment=alignment)
    assert f"{cfg['block_m']}x{cfg['block_n']}c{cfg['multicast']}{'b' * cfg['share_b']}" == tile
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "256")
    if alignment % 256:
        with pytest.raises(RuntimeError, match="MOE_GEMM_BLOCK_M"):
            native.fp8_gemm_nt_config(32768, 4096, 7168, 132, gemm_type=1, num_groups=4, alignment=alignment)
    else:
        assert native.fp8_gemm_nt_config(300, 4096, 7168, 132, gemm_type=1, num_groups=4,
                                         alignment=alignment)["block_m"] == 256
    with pytest.raises(RuntimeError, match="MOE_GEMM_BLOCK_M"):
        native.fp8_gemm_nt_config(64, 4096, 7168, 132, gemm_type=2, num_groups=4, alignment=alignment)
    with pytest.raises(RuntimeError, match="alignment"):
        native.fp8_gemm_nt_config(4096, 4096, 7168, 132, gemm_type=1, num_groups=4, alignment=192)


@pytest.mark.parametrize("gemm_type,m,groups", [(1, 8192, 4), (1, 128, 32), (2, 16, 32), (2, 1, 256), (2, 256, 8)])
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])
def test_grouped_compiles_for_sm90a(gemm_type, m, groups, n, k):
    name, code = kernels.jit.native_module().fp8_gemm_nt_code(m, n, k, H200_SMS, False, -1, gemm_type, groups)
    assert f"sm90_fp8_gemm_nt<{gemm_type}," in code
    assert kernels.jit.build(name, code, "sm_90a").cubin_path.endswith(".cubin")


# ---- GPU ----------------------------------------------------------------------------------------

CONTIGUOUS_COUNTS = [
    [8192, 8192, 8192, 8192],        # prefill, 4 experts
    [3000, 0, 129, 1, 0, 700],       # empty groups, tails
    [0, 0, 5000, 0],                 # all tokens in one group
    [1],                             # G = 1
]
MASKED_CASES = [
    ([20] * 32, 32, 20),                          # decode, 32 experts
    ([0, 5, 100, 0, 77, 1, 128, 3], 128, 8),       # zero groups, expected far below
    ([1] * 256, 8, 1),                            # 256 experts, one token each
    ([0] * 16, 64, 64),                           # nothing to do
    ([70, 3, 100], 100, 600),                     # max_m not a multiple of the block, expected far above
    ([37], 50, 4),                                # G = 1 (D's map stays 3-D)
    ([600, 0, 513], 1024, 600),                   # 2-CTA clusters sharing A (expected_m >= 512)
]


@pytest.fixture(scope="module")
def warm_grouped_cache():
    """Compile the GPU cases' kernels in parallel rather than one by one inside the tests."""
    if not torch.cuda.is_available():
        return
    native, sms = kernels.jit.native_module(), kernels.get_num_sms()
    sources = set()
    for n, k in GROUPED_NK:
        for counts in CONTIGUOUS_COUNTS:
            m = sum((c + 127) // 128 * 128 for c in counts)
            sources.add(native.fp8_gemm_nt_code(m, n, k, sms, False, -1, 1, len(counts)))
        for masked, max_m, expected_m in MASKED_CASES:
            sources.add(native.fp8_gemm_nt_code(min(expected_m, max_m), n, k, sms, False, -1, 2, len(masked)))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda src: kernels.jit.build(src[0], src[1], "sm_90a"), sources))

@pytest.fixture
def no_sfa_copy(monkeypatch):
    """The kernels a test compares read the A scales it hands them: large contiguous layouts would
    otherwise run on an MN-major copy of K-major scales (the copy's own tests, test_grouped_sfa_copy.py, name it)."""
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "0")


@pytest.mark.gpu
@pytest.mark.parametrize("counts", CONTIGUOUS_COUNTS)
@pytest.mark.parametrize("n,k", GROUPED_NK)
def test_gpu_contiguous(counts, n, k, warm_grouped_cache, seed):
    check_contiguous(counts, n, k, "cuda")


@pytest.mark.gpu
@pytest.mark.usefixtures("no_sfa_copy")
@pytest.mark.parametrize("counts,forced", [
    ([4000, 0, 3900, 1], ""),        # the heuristic's 256 x 128 (clusters), an empty group, a one-row group
    ([100, 300, 0, 256], "256"),     # second waves all padding (100 rows), a group of exactly one tile
    ([1], "256"),                    # G = 1, one row
    ([513, 700, 255], "256"),        # groups ending one row into a wave, one row short of a tile
])
@pytest.mark.parametrize("n,k", GROUPED_NK)
def test_gpu_contiguous_256_row_tiles(counts, forced, n, k, seed, monkeypatch):
    """Contiguous layouts aligned to 256 rows run 256-row tiles (two waves of 128): every valid row
    against float64, NaN-poisoned, padding rows and empty groups included."""
    if forced:
        monkeypatch.setenv("MOE_GEMM_BLOCK_M", forced)
    a_fp8, b_fp8, m_indices, [(cfg, d)] = run_contiguous_256(counts, n, k, [{}], monkeypatch)
    assert cfg["block_m"] == 256, cfg
    assert_contiguous_rows(d, a_fp8, b_fp8, m_indices)


def run_contiguous_256(counts, n, k, settings, monkeypatch):
    """Weights, a contiguous layout aligned to 256 rows, and (plan, D) of one call under each of
    ``settings`` (environment switches set in turn); the alignment is 128 again afterwards."""
    kernels.set_mk_alignment_for_contiguous_layout(256)
    try:
        b_fp8 = make_weights(len(counts), n, k, "cuda")
        a_fp8, m_indices = make_contiguous(counts, k, "cuda", align=256)
        results = []
        for env in settings:
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            cfg = kernels.jit.native_module().fp8_gemm_nt_config(m_indices.shape[0], n, k, kernels.get_num_sms(),
                                                                 gemm_type=1, num_groups=len(counts), alignment=256)
            results.append((cfg, run_contiguous(a_fp8, b_fp8, m_indices, n)))
        torch.cuda.synchronize()
    finally:
        kernels.set_mk_alignment_for_contiguous_layout(128)
    return a_fp8, b_fp8, m_indices, results


@pytest.mark.gpu
@pytest.mark.parametrize("masked,max_m,expected_m", [([20] * 32, 32, 20), ([0, 5, 100, 0, 77, 1, 128, 3], 128, 8)])
@pytest.mark.parametrize("n,k", [(4096, 7168), (4096, 2048)])
def test_gpu_masked_overlap_matches_plain_loop(masked, max_m, expected_m, n, k, seed, monkeypatch):
    """Masked decode tiles (block M 64, block N <= 128) overlapping promotion with the next K
    block's wgmmas, against the plain loop (MOE_FP8_OVERLAP=0): bit for bit the same output, rows
    past masked_m up to the next multiple of 8 included (unspecified but the same), and the rows
    from there left NaN, as the docstring says."""
    g = len(masked)
    cfg = kernels.jit.native_module().fp8_gemm_nt_config(min(expected_m, max_m), n, k, kernels.get_num_sms(),
                                                         False, -1, 2, g)
    assert (cfg["block_m"], cfg["overlap"]) == (64, 1), cfg
    b_fp8 = make_weights(g, n, k, "cuda")
    a, masked_m = make_masked(masked, max_m, k)
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("MOE_FP8_OVERLAP", switch)
        outputs.append(run_masked(a, b_fp8, masked_m, expected_m, n))
    torch.cuda.synchronize()
    assert_same_output(outputs[0], outputs[1], "overlapped against the plain loop")
    assert_masked_rows(outputs[0], a, b_fp8, masked)


@pytest.mark.gpu
@pytest.mark.parametrize("masked,max_m,expected_m,n,k", [  # shapes whose heuristic picks 128 x 192 tiles
    ([300, 0, 129], 384, 256, 4096, 7168),
    ([600, 1, 513], 640, 512, 4096, 2048),
    ([600, 0, 513, 256, 1], 640, 512, 7168, 2048),
])
def test_gpu_masked_wide_tiles_in_step_and_in_pairs_match_turns(masked, max_m, expected_m, n, k, seed, monkeypatch):
    """Masked 128 x 192 tiles: in step with the K loop unrolled 8 times (the default where K / 128 is
    a multiple of 8), and in 2-CTA clusters whose pairs of m-blocks inside a group share B
    (MOE_FP8_MULTICAST=b, the default from 512 rows per group), and in clusters sharing A (=2, where
    the kernel takes them), against the warpgroups' turns with the plain loop, both without clusters:
    the same wgmmas and FFMAs per tile, so D is bit for bit theirs (NaN where none wrote), groups of 0,
    1 and odd m-block counts included."""
    g = len(masked)
    b_fp8 = make_weights(g, n, k, "cuda")
    a, masked_m = make_masked(masked, max_m, k)
    native = kernels.jit.native_module()
    outputs = {}
    for name, env in (("in step", {"MOE_FP8_MULTICAST": "0"}), ("pairs", {"MOE_FP8_MULTICAST": "b"}),
                      ("sharing A", {"MOE_FP8_MULTICAST": "2"}),
                      ("turns", {"MOE_FP8_MULTICAST": "0", "MOE_FP8_PINGPONG": "1", "MOE_GEMM_K_UNROLL": "1"})):
        for variable in ("MOE_FP8_MULTICAST", "MOE_FP8_PINGPONG", "MOE_GEMM_K_UNROLL"):
            monkeypatch.delenv(variable, raising=False)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        cfg = native.fp8_gemm_nt_config(min(expected_m, max_m), n, k, kernels.get_num_sms(), False, -1, 2, g)
        assert (cfg["block_m"], cfg["block_n"]) == (128, 192), cfg
        assert (cfg["pingpong"], cfg["k_unroll"], cfg["share_b"]) == \
            {"in step": (0, 8, 0), "pairs": (0, 8, 1), "sharing A": (0, 8, 0), "turns": (1, 1, 0)}[name], (name, cfg)
        outputs[name] = run_masked(a, b_fp8, masked_m, expected_m, n)
    torch.cuda.synchronize()
    assert_masked_rows(outputs["in step"], a, b_fp8, masked)
    assert_same_output(outputs["in step"], outputs["turns"], "in step against the turns")
    assert_same_output(outputs["pairs"], outputs["turns"], "pairs sharing B against the turns")
    assert_same_output(outputs["sharing A"], outputs["turns"], "clusters sharing A against the turns")


@pytest.mark.gpu
def test_gpu_contiguous_bad_group_ids_are_skipped(seed):
    b_fp8 = make_weights(2, 256, 256, "cuda")
    a_fp8, m_indices = make_contiguous([128, 128], 256, "cuda")
    m_indices[128:] = 7  # past G: must not read past B
    d = torch.full((256, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.m_grouped_fp8_gemm_nt_contiguous(a_fp8, b_fp8, d, m_indices)
    torch.cuda.synchronize()
    assert torch.isnan(d[128:]).all()
    assert calc_diff(d[:128], expected_contiguous(a_fp8, b_fp8, m_indices)[:128]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("masked,max_m,expected_m", MASKED_CASES)
@pytest.mark.parametrize("n,k", GROUPED_NK)
def test_gpu_masked(masked, max_m, expected_m, n, k, warm_grouped_cache, seed):
    check_masked(masked, max_m, n, k, expected_m, "cuda")


@pytest.mark.gpu
@pytest.mark.usefixtures("no_sfa_copy")
@pytest.mark.parametrize("masked,max_m,expected_m,alignment", [
    ([0, 5, 100, 0, 77, 1, 128, 3], 128, 8, 128),  # masked m-blocks past a group's rows; contiguous tails
    ([600, 0, 513], 1024, 600, 128),                # 2-CTA clusters (masked expected_m >= 512)
    ([4000, 0, 3900, 1], 4000, 4000, 256),          # contiguous 256-row tiles
])
@pytest.mark.parametrize("n,k", GROUPED_NK)
def test_gpu_scale_tma_matches_gather(masked, max_m, expected_m, alignment, n, k, seed, monkeypatch):
    """Contiguous GEMMs whose scales TMA loads (MN-major A scales at every tile, K-major ones on
    256-row tiles, B's groups stacked) against the scale warps' gathers of either layout
    (MOE_FP8_SCALE_TMA=0), and masked GEMMs (which gather both layouts) on the same row counts:
    bit for bit the same valid rows."""
    native, sms = kernels.jit.native_module(), kernels.get_num_sms()
    g = len(masked)
    kernels.set_mk_alignment_for_contiguous_layout(alignment)
    try:
        a_c, m_indices = make_contiguous(masked, k, "cuda", align=alignment)
        b_fp8 = make_weights(g, n, k, "cuda")
        a, masked_m = make_masked(masked, max_m, k)
        # MN-major A scales: the rows (of every group) one run per K block.
        layouts = {"k_major": (a[1], a_c[1]),
                   "mn_major": (a[1].view(g * max_m, -1).t().contiguous().t().view(g, max_m, -1),
                                a_c[1].t().contiguous().t())}
        contiguous_args = (m_indices.shape[0], n, k, sms, False, -1, 1, g, alignment)
        masked_args = (min(expected_m, max_m), n, k, sms, False, -1, 2, g)
        for name, scale_load in (("k_major", 2), ("mn_major", 1)):
            sf_masked, sf_contiguous = layouts[name]
            assert native.fp8_gemm_scale_load(2, max_m, n, k, g, sf_masked.data_ptr(), sf_masked.stride(1),
                                              sf_masked.stride(2), b_fp8[1].data_ptr(), *b_fp8[1].stride()) == \
                "gather"
            assert native.fp8_gemm_scale_load(1, m_indices.shape[0], n, k, g, sf_contiguous.data_ptr(),
                                              *sf_contiguous.stride(), b_fp8[1].data_ptr(), *b_fp8[1].stride()) == \
                f"tma_{name}"
            # What the launches run: K-major scales go by TMA on 256-row tiles only.
            contiguous_cfg = native.fp8_gemm_nt_config(*contiguous_args, scale_load=scale_load)
            expected = "tma_k_major" if contiguous_cfg["block_m"] == 256 else "gather"
            assert contiguous_cfg["scale_load"] == (f"tma_{name}" if name == "mn_major" else expected)
            assert native.fp8_gemm_nt_config(*masked_args, scale_load=scale_load)["scale_load"] == "gather"
        outputs = {}
        for switch in ("1", "0"):
            monkeypatch.setenv("MOE_FP8_SCALE_TMA", switch)
            for name, (sf_masked, sf_contiguous) in layouts.items():
                d = torch.full((g, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                kernels.m_grouped_fp8_gemm_nt_masked((a[0], sf_masked), b_fp8, d, masked_m, expected_m)
                d_c = torch.full((m_indices.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
                kernels.m_grouped_fp8_gemm_nt_contiguous((a_c[0], sf_contiguous), b_fp8, d_c, m_indices)
                outputs[switch, name] = d, d_c
        torch.cuda.synchronize()
    finally:
        kernels.set_mk_alignment_for_contiguous_layout(128)
    gathered, gathered_c = outputs["0", "k_major"]
    valid = m_indices >= 0
    assert calc_diff(gathered_c[valid], expected_contiguous(a_c, b_fp8, m_indices)[valid]) < 1e-3
    rhs = dequantize_b(*b_fp8).double()
    for i, count in enumerate(masked):
        if count:
            ref = dequantize_a(a[0][i, :count], a[1][i, :count]).double() @ rhs[i].t()
            assert calc_diff(gathered[i, :count], ref) < 1e-3, f"group {i}"
    for key, (d, d_c) in outputs.items():
        assert torch.equal(d_c[valid], gathered_c[valid]), f"contiguous, {key}"
        for i, count in enumerate(masked):
            assert torch.equal(d[i, :count], gathered[i, :count]), f"masked group {i}, {key}"


@pytest.mark.gpu
@pytest.mark.usefixtures("no_sfa_copy")
@pytest.mark.parametrize("masked,max_m,expected_m", [
    ([0, 300, 0, 129, 1], 384, 256),  # empty groups, m-blocks whose second warpgroup has no valid row
    ([0, 0, 0, 0], 256, 256),         # masked: no tile on any CTA, the turns' first and last barriers only
    ([600, 0, 513], 1024, 600),       # 2-CTA clusters at N = 7168
])
@pytest.mark.parametrize("n,k", GROUPED_NK)
def test_gpu_pingpong_matches_no_pingpong(masked, max_m, expected_m, n, k, seed, monkeypatch):
    """Block M 128 with the two math warpgroups taking turns on the tensor cores, masked and
    contiguous (the same row counts, padding rows included), against MOE_FP8_PINGPONG=0: the same
    wgmmas and FFMAs per warpgroup, only their issue order differs, so bit for bit the same rows."""
    native, sms = kernels.jit.native_module(), kernels.get_num_sms()
    monkeypatch.setenv("MOE_FP8_PINGPONG", "1")
    g = len(masked)
    counts = masked if any(masked) else [129]
    a_c, m_indices = make_contiguous(counts, k, "cuda")
    assert native.fp8_gemm_nt_config(min(expected_m, max_m), n, k, sms, False, -1, 2, g)["pingpong"] == 1
    assert native.fp8_gemm_nt_config(m_indices.shape[0], n, k, sms, False, -1, 1, len(counts))["pingpong"] == 1
    b_fp8 = make_weights(g, n, k, "cuda")
    b_c = make_weights(len(counts), n, k, "cuda")
    a, masked_m = make_masked(masked, max_m, k)
    outputs = {}
    for pingpong in ("1", "0"):
        monkeypatch.setenv("MOE_FP8_PINGPONG", pingpong)
        d = torch.full((g, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.m_grouped_fp8_gemm_nt_masked(a, b_fp8, d, masked_m, expected_m)
        d_c = torch.full((m_indices.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.m_grouped_fp8_gemm_nt_contiguous(a_c, b_c, d_c, m_indices)
        outputs[pingpong] = d, d_c
    torch.cuda.synchronize()
    (d, d_c), (plain, plain_c) = outputs["1"], outputs["0"]
    valid = m_indices >= 0
    assert calc_diff(d_c[valid], expected_contiguous(a_c, b_c, m_indices)[valid]) < 1e-3
    assert torch.equal(d_c[valid], plain_c[valid])
    rhs = dequantize_b(*b_fp8).double()
    for i, count in enumerate(masked):
        if count:
            ref = dequantize_a(a[0][i, :count], a[1][i, :count]).double() @ rhs[i].t()
            assert calc_diff(d[i, :count], ref) < 1e-3, f"group {i}"
            assert torch.equal(d[i, :count], plain[i, :count]), f"group {i}"
        else:
            assert torch.isnan(d[i]).all(), f"group {i} has no rows but was written"


@pytest.mark.gpu
@pytest.mark.usefixtures("no_sfa_copy")
@pytest.mark.parametrize("counts,align,lead,n,k", [
    ([1000, 0, 513, 2048], 128, 0, 4096, 1152),  # a pair straddling two groups; the last block past M
    ([1000, 0, 513, 2048], 128, 128, 4096, 1152),  # a leading padding block: the first CTA's is invalid
    ([513, 100, 0, 1500], 256, 0, 7168, 2048),   # valid blocks paired with whole padding blocks
    ([10, 700, 3], 512, 0, 4096, 1024),          # pairs of two padding blocks, skipped
])
def test_gpu_contiguous_clusters_sharing_b_match_single_ctas(counts, align, lead, n, k, seed, monkeypatch):
    """2-CTA clusters on adjacent 128-row m-blocks sharing B (MOE_FP8_MULTICAST=b): a pair inside one
    group multicasts half of B each, a pair straddling two groups loads two B tiles, a padding block
    (either CTA's) or one past M beside a valid one runs in step and stores nothing. The same wgmmas
    and FFMAs per tile as single CTAs (MOE_FP8_MULTICAST=0), so D is bit for bit theirs, NaN where
    neither wrote. ``lead`` padding rows come before the first group."""
    b_fp8 = make_weights(len(counts), n, k, "cuda")
    a_fp8, m_indices = make_contiguous(counts, k, "cuda", align=align)
    if lead:
        pad_fp8, pad_sf = per_token_cast_to_fp8(torch.randn(lead, k, device="cuda", dtype=torch.bfloat16))
        a_fp8 = (torch.cat([pad_fp8, a_fp8[0]]), torch.cat([pad_sf, a_fp8[1]]))
        m_indices = torch.cat([torch.full((lead,), -1, dtype=torch.int32, device="cuda"), m_indices])
    outputs = {}
    for multicast in ("b", "0"):
        monkeypatch.setenv("MOE_FP8_MULTICAST", multicast)
        cfg = contiguous_config(m_indices, n, k, len(counts))
        assert (cfg["block_m"], cfg["share_b"]) == (128, int(multicast == "b")), cfg
        outputs[multicast] = run_contiguous(a_fp8, b_fp8, m_indices, n)
    torch.cuda.synchronize()
    assert_contiguous_rows(outputs["b"], a_fp8, b_fp8, m_indices)
    assert_same_output(outputs["b"], outputs["0"], "clusters sharing B")


@pytest.mark.gpu
@pytest.mark.usefixtures("no_sfa_copy")
@pytest.mark.parametrize("counts,n,k", [
    ([1000, 0, 513, 2048], 4096, 1152),  # 9 K blocks: a partial round of 4 after two whole ones
    ([4096, 4096], 7168, 2048),          # 2-CTA clusters
])
def test_gpu_contiguous_k_unroll_matches_plain_loop(counts, n, k, seed, monkeypatch):
    """Contiguous 128-row tiles (128 x 192) with the math K loop unrolled 2, 4 and 8 times
    (MOE_GEMM_K_UNROLL), with and without ping-pong (MOE_FP8_PINGPONG), against the plain ping-pong
    loop: the same wgmmas and FFMAs in the same order per warpgroup, so D is bit for bit the same,
    padding rows and an empty group included (the padding rows of a tile with valid rows are stored
    too, the same; NaN where neither wrote)."""
    b_fp8 = make_weights(len(counts), n, k, "cuda")
    a_fp8, m_indices = make_contiguous(counts, k, "cuda")
    outputs = {}
    for pingpong, unroll in (("1", "1"), ("1", "2"), ("1", "4"), ("0", "8"), ("0", "1")):
        monkeypatch.setenv("MOE_GEMM_K_UNROLL", unroll)
        monkeypatch.setenv("MOE_FP8_PINGPONG", pingpong)
        cfg = contiguous_config(m_indices, n, k, len(counts))
        assert (cfg["block_m"], cfg["pingpong"], cfg["k_unroll"]) == (128, int(pingpong), int(unroll)), cfg
        outputs[pingpong, unroll] = run_contiguous(a_fp8, b_fp8, m_indices, n)
    torch.cuda.synchronize()
    plain = outputs["1", "1"]
    assert_contiguous_rows(plain, a_fp8, b_fp8, m_indices)
    for (pingpong, unroll), d in outputs.items():
        assert_same_output(d, plain, f"K loop unrolled {unroll} times, ping-pong {pingpong}")


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_plain_cuda_tensors_take_the_cpp_path(masked, seed):
    """The entry points' first step, the C++ checks and launch, takes plain CUDA tensors (a silent
    decline would only cost host time: this asserts it does not happen) and declines an output of
    a tensor subclass, leaving it untouched for the Python path, which then runs it. Both outputs
    are right against float64."""
    native, n, k = kernels.jit.native_module(), 576, 512
    stream = torch.cuda.current_stream().cuda_stream
    if masked:
        counts, max_m, expected_m = [5, 0, 17], 24, 8
        b_fp8 = make_weights(len(counts), n, k, "cuda")
        a_fp8, sfa = per_token_cast_to_fp8(torch.randn(len(counts) * max_m, k, device="cuda", dtype=torch.bfloat16))
        a = (a_fp8.view(len(counts), max_m, k), sfa.view(len(counts), max_m, -1))
        index = torch.tensor(counts, dtype=torch.int32, device="cuda")
        d = torch.full((len(counts), max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch, extra, call = native.m_grouped_fp8_gemm_nt_masked_tensors, expected_m, kernels.m_grouped_fp8_gemm_nt_masked
    else:
        b_fp8 = make_weights(3, n, k, "cuda")
        a, index = make_contiguous([130, 0, 7], k, "cuda")
        d = torch.full((index.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch, extra = native.m_grouped_fp8_gemm_nt_contiguous_tensors, kernels.get_mk_alignment_for_contiguous_layout()
        call = kernels.m_grouped_fp8_gemm_nt_contiguous
    tail = (extra, d.get_device(), stream)
    if not masked:
        tail += kernels.gemm.fp8_workspace(d.get_device(), stream)
    subclass = d.clone().as_subclass(TensorSubclass)
    assert launch(a, b_fp8, d, index, *tail) is True
    assert launch(a, b_fp8, subclass, index, *tail) is False
    torch.cuda.synchronize()
    assert torch.isnan(subclass).all(), "a declined call wrote its output"
    call(a, b_fp8, subclass, index, *((expected_m,) if masked else ()))
    for got in (d, subclass.as_subclass(torch.Tensor)):
        if masked:
            assert_masked_rows(got, a, b_fp8, counts)
        else:
            assert_contiguous_rows(got, a, b_fp8, index)


@pytest.mark.gpu
@pytest.mark.usefixtures("no_sfa_copy")
@pytest.mark.parametrize("counts,n,k", [
    ([1000, 0, 513, 2048], 4096, 1152),  # padding rows, an empty group
    ([4096, 4096], 7168, 2048),          # clusters sharing B
])
def test_gpu_contiguous_wg_store_matches_tile_store(counts, n, k, seed, monkeypatch):
    """Contiguous 128-row tiles with per-warpgroup epilogues (MOE_FP8_WG_STORE=1) against the
    tile-wide one: bit for bit the same D (NaN where neither wrote)."""
    def check(wg_store, cfg):
        assert (cfg["block_m"], cfg["wg_store"]) == (128, int(wg_store)), cfg

    a_fp8, b_fp8, m_indices, outputs = contiguous_outputs_per_setting(counts, n, k, "MOE_FP8_WG_STORE", ("0", "1"),
                                                                      monkeypatch, check)
    assert_contiguous_rows(outputs["1"], a_fp8, b_fp8, m_indices)
    assert_same_output(outputs["1"], outputs["0"], "per-warpgroup epilogues")
