"""The dense FP8 GEMM's schedules on the GPU, each against float64 and against its twin with the
switch off (clusters, ping-pong of 128-row tiles, the tail split and a single wave's split
over K, 256-row tiles, graph captures without a workspace, programmatic dependent launch)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kernels
from gemm_cases import assert_settings_agree, make_operands, outputs_per_setting, reference_f64, with_switch_off
from kernels.testing import calc_diff


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
    a_fp8, b_fp8, d, single = with_switch_off(m, n, k, "MOE_FP8_MULTICAST", monkeypatch)
    assert calc_diff(single, reference_f64(a_fp8, b_fp8)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(300, 2112, 7168), (4096, 2112, 7168), (257, 7168, 2048), (1000, 7168, 1536),
                                   (700, 576, 7168), (200, 24576, 1536), (129, 32768, 512)])  # pairs by default
def test_gpu_clusters_sharing_b_match_single_ctas(m, n, k, seed, monkeypatch):
    """Two CTAs on adjacent 128-row m-blocks share B (MOE_FP8_MULTICAST=b), each loading half of its
    rows for both: an odd m-block count (the last pair's second block past M runs in step and stores
    nothing), a residual C. The same wgmmas and FFMAs per tile as single CTAs
    (MOE_FP8_MULTICAST=0), so D is bit for bit theirs."""
    def pairs(value, cfg):
        if value == "b":
            assert (cfg["block_m"], cfg["multicast"], cfg["share_b"], cfg["tail_splits"]) == (128, 2, 1, 1), cfg

    c = torch.randn(m, n, device="cuda")
    a_fp8, b_fp8, outputs = outputs_per_setting(m, n, k, "MOE_FP8_MULTICAST", ("b", "0"), monkeypatch, c=c,
                                                check=pairs)
    assert_settings_agree(outputs, a_fp8, b_fp8, c)



def d_with_and_without_c(a_fp8, b_fp8, c, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """D of one call, NaN-poisoned first, without and then with the residual C."""
    d = torch.full((a_fp8[0].shape[0], b_fp8[0].shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda")
    with_c = torch.full_like(d, float("nan"))
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d, **kwargs)
    kernels.fp8_gemm_nt(a_fp8, b_fp8, with_c, c=c, **kwargs)
    return d, with_c


def assert_same_outputs(got, expected, a_fp8, b_fp8, c) -> None:
    """got = d_with_and_without_c(...): fully written, right, and bit for bit `expected`."""
    torch.cuda.synchronize()
    d, with_c = got
    assert torch.isfinite(d).all() and torch.isfinite(with_c).all(), "output not fully written"
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3
    assert calc_diff(with_c, reference_f64(a_fp8, b_fp8, c)) < 1e-3
    assert torch.equal(d, expected[0]) and torch.equal(with_c, expected[1])


def _env_id(value):
    """Test ids: the switches a case sets, `default` for none."""
    if not isinstance(value, dict):
        return None
    return "-".join(f"{key.lower()}={val}" for key, val in value.items()) or "default"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,mn_scales,layout,multicast,env", [
    (1, 2112, 7168, False, "gather", 1, {}), (7, 576, 7168, False, "gather", 1, {}),      # a split tail
    (63, 2112, 1536, False, "gather", 1, {"compiled_dims": "mnk"}),                     # M compiled in
    (16, 4096, 7168, False, "tma_k_major_table", 1, {}), (33, 4096, 7168, False, "tma_k_major_table", 1, {}),
    (1, 2112, 7168, True, "tma_mn_major", 1, {}), (5, 4096, 7168, True, "tma_mn_major", 1, {}),
    (62, 576, 7168, True, "tma_mn_major", 1, {}),
    (100, 24576, 1536, False, "gather", 1, {}), (65, 32768, 512, True, "tma_mn_major", 1, {}),  # 128-row tiles
    (200, 4096, 7168, True, "tma_mn_major", 1, {"MOE_GEMM_BLOCK_M": "256"}),
    (1, 7168, 16384, False, "gather", 2, {}), (32, 7168, 16384, True, "tma_mn_major", 2, {}),  # clusters sharing A
    (13, 7168, 2048, True, "tma_mn_major", 2, {"MOE_FP8_MULTICAST": "2"}),
    (5, 7168, 16384, False, "gather", 2, {}),
    (33, 7168, 16384, True, "tma_mn_major", 2, {}), (48, 7168, 16384, False, "gather", 2, {}),  # the 2nd CTA's cut
    (100, 2112, 7168, False, "tma_k_major_table", 1, {}), (144, 2112, 7168, True, "tma_mn_major", 1, {}),
    (300, 4096, 7168, False, "gather", 1, {}), (4095, 2112, 7168, True, "tma_mn_major", 1, {}),
    (1000, 7168, 2048, False, "gather", 2, {}), (4000, 7168, 2048, True, "tma_mn_major", 2, {}),
    (1088, 7168, 2048, False, "gather", 2, {}),                                        # M ends a share
    (1040, 7168, 2048, False, "gather", 2, {}), (4100, 7168, 2048, True, "tma_mn_major", 2, {}),  # 2nd CTA: none
    (33, 576, 7168, True, "tma_mn_major", 1, {}), (100, 576, 7168, False, "gather", 1, {}),  # split tails
    (144, 4096, 7168, True, "tma_mn_major", 1, {}), (128, 576, 7168, False, "gather", 1, {}),  # N cuts B's too
    (256, 4232, 2048, False, "gather", 2, {}), (1024, 7168, 2048, True, "tma_mn_major", 2, {}),  # N's alone
    (300, 2112, 7168, False, "gather", 1, {}), (1000, 576, 7168, True, "tma_mn_major", 1, {}),  # 64-row tiles
    (200, 7168, 2048, False, "gather", 2, {"MOE_FP8_TIGHT_BOXES": "pairs"}),            # pairs sharing B: A's cut
    (200, 24576, 1536, True, "tma_mn_major", 2, {"MOE_FP8_TIGHT_BOXES": "pairs"}),
    (129, 32768, 512, False, "gather", 2, {"MOE_FP8_TIGHT_BOXES": "pairs"}),
], ids=_env_id)
def test_gpu_tight_boxes_match_whole_boxes(m, n, k, mn_scales, layout, multicast, env, seed, monkeypatch):
    """Where M cuts the last m-block its boxes end at row M, through tail maps (in clusters the CTA
    whose share M cuts loads the rest, one past M none), and so do B's in the last n-block where N
    cuts it (its stale rows may reach only columns past N; pairs sharing B, opt-in, cut A's only). D bit
    for bit that of whole boxes (MOE_FP8_TIGHT_BOXES=0), NaN-poisoned, with and without a residual C, on
    gathered, table and MN-major A scales (M not a multiple of 4 included). Before the tight run a
    whole-box GEMM on the same tiles and shared-memory layout, on at least as many CTAs, loads NaN A
    bytes and infinite scales into the stages, so the rows past the tight boxes hold them: they must
    not reach a row below M. (Over several waves the last m-block's stale rows come from the run's
    own earlier tiles instead: there bit equality with whole boxes is the check.)"""
    native = kernels.jit.native_module()
    sl = 1 if mn_scales else -1
    env = dict(env)
    compiled_dims = env.pop("compiled_dims", "nk")
    tight_setting = env.pop("MOE_FP8_TIGHT_BOXES", None)

    def tight_boxes(on: bool) -> None:
        if on and tight_setting is not None:
            monkeypatch.setenv("MOE_FP8_TIGHT_BOXES", tight_setting)
        elif on:
            monkeypatch.delenv("MOE_FP8_TIGHT_BOXES", raising=False)
        else:
            monkeypatch.setenv("MOE_FP8_TIGHT_BOXES", "0")

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    if mn_scales:
        a_fp8 = (a_fp8[0], kernels.get_mn_major_tma_aligned_tensor(a_fp8[1]))
    c = torch.randn(m, n, device="cuda")
    tight_boxes(True)
    tight = native.fp8_gemm_nt_config(m, n, k, kernels.get_num_sms(), scale_load=sl)
    assert (tight["tight_boxes"], tight["scale_load"], tight["multicast"]) == (1, layout, multicast), tight
    assert tight["share_b"] == int(tight_setting == "pairs"), tight
    tight_boxes(False)
    whole = d_with_and_without_c(a_fp8, b_fp8, c, compiled_dims=compiled_dims)
    # The poison: NaN rows (E4M3 0x7F) with infinite scales on the tight plan's tiles and stages, as
    # many m-blocks as one wave holds (at least M's).
    n_blocks = -(-n // tight["block_n"])
    rows = max(-(-m // tight["block_m"]), kernels.get_num_sms() // n_blocks) * tight["block_m"]
    for name, value in (("MOE_GEMM_BLOCK_M", tight["block_m"]), ("MOE_GEMM_BLOCK_N", tight["block_n"]),
                        ("MOE_GEMM_STAGES", tight["num_stages"])):
        monkeypatch.setenv(name, str(value))
    poison_plan = native.fp8_gemm_nt_config(rows, n, k, kernels.get_num_sms(), scale_load=sl)
    layout_keys = ("block_m", "block_n", "num_stages", "smem_bytes", "scale_load", "table_slots")
    assert {key: poison_plan[key] for key in layout_keys} == {key: tight[key] for key in layout_keys}, poison_plan
    assert poison_plan["grid"] >= tight["grid"], poison_plan
    nan_a = torch.full((rows, k), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    inf_sf = torch.full((rows, k // 128), float("inf"), device="cuda")
    poison_a = (nan_a, kernels.get_mn_major_tma_aligned_tensor(inf_sf) if mn_scales else inf_sf)
    kernels.fp8_gemm_nt(poison_a, b_fp8, torch.empty(rows, n, dtype=torch.bfloat16, device="cuda"))
    for name in ("MOE_GEMM_BLOCK_M", "MOE_GEMM_BLOCK_N", "MOE_GEMM_STAGES"):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tight_boxes(True)
    # Non-finite values in rows below M would come from the stale rows past the tight boxes.
    tight_out = d_with_and_without_c(a_fp8, b_fp8, c, compiled_dims=compiled_dims)
    assert_same_outputs(tight_out, whole, a_fp8, b_fp8, c)


def scale_load(m, n, k, sfa, sfb) -> str:
    return kernels.jit.native_module().fp8_gemm_scale_load(0, m, n, k, 1, sfa.data_ptr(), *sfa.stride(),
                                                             sfb.data_ptr(), 0, *sfb.stride())


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 2112, 7168), (7, 576, 7168), (129, 2112, 7168), (1000, 24576, 1536),
                                   (4096, 4096, 7168), (4096, 7168, 16384), (8191, 32768, 512), (4095, 4232, 2048)])
def test_gpu_scale_tma_matches_gather(m, n, k, seed, monkeypatch):
    """Scales loaded by TMA with the tiles, K-major A scales (the quantizer's layout; 256-row tiles
    only) and MN-major TMA-aligned ones (get_mn_major_tma_aligned_tensor; every tile), against the
    scale warps' gathers (MOE_FP8_SCALE_TMA=0): the same scales reach the same FFMAs, so D is bit
    for bit the same. The cases cover one-row problems, tiles of 64, 128 (ping-pong) and 256 rows,
    clusters, the tail split and M tails (4095, 8191) whose boxes run past the last row."""
    a_fp8, b_fp8, d, gathered = with_switch_off(m, n, k, "MOE_FP8_SCALE_TMA", monkeypatch)
    assert torch.equal(d, gathered)
    monkeypatch.delenv("MOE_FP8_SCALE_TMA")
    sfa_mn = kernels.get_mn_major_tma_aligned_tensor(a_fp8[1])
    assert [scale_load(m, n, k, sf, b_fp8[1]) for sf in (a_fp8[1], sfa_mn)] == ["tma_k_major", "tma_mn_major"]
    d_mn = torch.full_like(d, float("nan"))
    kernels.fp8_gemm_nt((a_fp8[0], sfa_mn), b_fp8, d_mn)
    torch.cuda.synchronize()
    assert torch.equal(d, d_mn)


# (switch, m, n, k, A scales' view): the default copies for 256-row tiles only, =all for every tile.
SFA_COPY_CASES = [("1", *case) for case in [
    (4096, 7168, 2048, None), (4095, 24576, 1536, None), (2049, 32768, 512, None), (4096, 7168, 16384, None),
    (3001, 4096, 7168, "columns"), (8191, 4232, 2048, None), (2304, 6144, 16384, None),
]] + [("all", *case) for case in [
    (1, 2112, 7168, None), (7, 576, 7168, None), (64, 2112, 7168, None), (128, 4096, 7168, None),
    (129, 7168, 2048, "columns"), (1000, 7168, 1536, None), (128, 7168, 16384, None), (4095, 2112, 7168, None),
    (300, 4232, 512, None),
]]


@pytest.mark.gpu
@pytest.mark.parametrize("switch,m,n,k,sfa_view", SFA_COPY_CASES)
def test_gpu_sfa_copy_matches_mn_major_and_k_major_kernels(switch, m, n, k, sfa_view, seed, monkeypatch):
    """A scales that are not MN-major: copied MN-major into the workspace (mn_major_sf), then the
    MN-major kernel; under MOE_FP8_SFA_COPY=all for tiles of any height. D bit for bit the call's on the
    caller's own MN-major copy (get_mn_major_tma_aligned_tensor) and the call's without the copy
    (MOE_FP8_SFA_COPY=0: K-major boxes per stage, or the gathers): the same scales reach the same
    FFMAs. Default cases: M tails of a 32-row copy tile and of a 256-row tile (4095, 2049, 3001, 8191),
    K blocks past one copy tile (128), K = 512 (gathers without the copy), the tail split (2304 x 6144
    x 16384). =all: one- and 7-row problems, 64- and 128-row tiles (clusters at 128 x 7168 x 16384, a
    single wave split over K), fewer K blocks than stages (K = 512). Both: scales with gaps between
    rows ("columns": every other column of a wider tensor)."""
    monkeypatch.setenv("MOE_FP8_SFA_COPY", switch)
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    if sfa_view == "columns":
        wide = torch.rand(m, 2 * (k // 128), device="cuda")
        wide[:, ::2] = a_fp8[1]
        a_fp8 = (a_fp8[0], wide[:, ::2])
    cfg = kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())
    assert cfg["sfa_copy"] == 1, cfg
    assert switch == "all" or cfg["block_m"] == 256, cfg
    outputs = {}
    for name, sfa, copy in (("copy", a_fp8[1], switch),
                            ("mn", kernels.get_mn_major_tma_aligned_tensor(a_fp8[1]), switch),
                            ("k_major", a_fp8[1], "0")):
        monkeypatch.setenv("MOE_FP8_SFA_COPY", copy)
        outputs[name] = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.fp8_gemm_nt((a_fp8[0], sfa), b_fp8, outputs[name])
    torch.cuda.synchronize()
    assert torch.isfinite(outputs["copy"]).all(), "output not fully written"
    assert calc_diff(outputs["copy"], reference_f64(a_fp8, b_fp8)) < 1e-3
    assert torch.equal(outputs["copy"], outputs["mn"])
    assert torch.equal(outputs["copy"], outputs["k_major"])


@pytest.mark.gpu
def test_gpu_sfa_copy_all_reads_what_the_kernels_before_just_wrote(seed, monkeypatch):
    """MOE_FP8_SFA_COPY=all with PDL: each call's A and its scales are made by the GPU quantizer right
    before it, with no sync (the usual pattern). The copy waits for the quantizer, the GEMM for the
    copy. Every D must be its own operands' product. (The quantizer launches without PDL, so the
    GEMM before it has finished when it starts: the chains of PDL launches are in
    test_gpu_sfa_copy_back_to_back_calls.)"""
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "all")
    m, n, k = 128, 4096, 7168
    b_fp8 = make_operands(8, n, k, "cuda")[1]
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * (1 + i) for i in range(6)]
    assert kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["sfa_copy"] == 1
    torch.cuda.synchronize()
    results = []
    for x in xs:
        a_fp8 = kernels.per_token_cast_to_fp8(x)
        d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
        results.append((a_fp8, d))
    torch.cuda.synchronize()
    for a_fp8, d in results:
        assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("switch,m", [("1", 4096), ("all", 4096), ("all", 128)])
def test_gpu_sfa_copy_back_to_back_calls(switch, m, pdl, seed, monkeypatch):
    """Calls on one stream without a sync or any other kernel between them, each with its own A
    scales copied into the one workspace: each copy waits for the GEMM before it, which reads the
    previous copy (with PDL that GEMM starts its dependents early). Every D must be its own operands'
    product."""
    monkeypatch.setenv("MOE_GEMM_PDL", pdl)
    monkeypatch.setenv("MOE_FP8_SFA_COPY", switch)
    n, k = 7168, 2048
    b_fp8 = make_operands(8, n, k, "cuda")[1]
    calls = []
    for i in range(6):
        a_fp8 = make_operands(m, 8, k, "cuda")[0]
        a_fp8 = (a_fp8[0], a_fp8[1] * (1 + i))  # scales apart, so a stale copy shows in D
        calls.append((a_fp8, torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")))
    assert kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["sfa_copy"] == 1
    torch.cuda.synchronize()
    for a_fp8, d in calls:
        kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    torch.cuda.synchronize()
    for a_fp8, d in calls:
        assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("switch,m,grouped", [("1", 4096, False), ("all", 128, False), ("all", 4096, True)])
def test_gpu_sfa_copy_threads_sharing_a_stream(switch, m, grouped, seed, monkeypatch):
    """Four threads issue copying calls on the same stream (and so the same workspace) at once: a
    call's copy and its GEMM launch as a pair that no other call's copy lands between, whichever entry
    point (grouped: every other call contiguous, two groups of the same weights, under =all). Every D
    must be its own operands' product."""
    monkeypatch.setenv("MOE_FP8_SFA_COPY", switch)
    n, k = 7168, 2048
    b_fp8 = make_operands(8, n, k, "cuda")[1]
    b_grouped = tuple(t.unsqueeze(0).expand(2, *t.shape).contiguous() for t in b_fp8)
    m_indices = torch.arange(2, device="cuda", dtype=torch.int32).repeat_interleave(m // 2)
    native = kernels.jit.native_module()
    assert native.fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["sfa_copy"] == 1
    if grouped:
        assert native.fp8_gemm_nt_config(m, n, k, kernels.get_num_sms(), gemm_type=1, num_groups=2)["sfa_copy"] == 1
    jobs = []
    for i in range(16):
        a_fp8 = make_operands(m, 8, k, "cuda")[0]
        jobs.append(((a_fp8[0], a_fp8[1] * (1 + i)), torch.full((m, n), float("nan"), dtype=torch.bfloat16,
                                                                 device="cuda"), grouped and i % 2 == 1))

    def call(a_fp8, d, contiguous):
        if contiguous:
            kernels.m_grouped_fp8_gemm_nt_contiguous(a_fp8, b_grouped, d, m_indices)
        else:
            kernels.fp8_gemm_nt(a_fp8, b_fp8, d)

    for job in jobs[:2]:  # compiled before the threads start
        call(*job)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()

    def run(share):
        with torch.cuda.stream(stream):
            for job in share:
                call(*job)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(run, [jobs[i::4] for i in range(4)]))
    torch.cuda.synchronize()
    for a_fp8, d, _ in jobs:
        assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,block_m,unroll", [
    (1, 2112, 7168, "", ""), (64, 4096, 7168, "", ""), (128, 4096, 7168, "", ""), (64, 32768, 512, "", ""),
    (33, 7168, 2048, "", ""), (128, 7168, 16384, "", ""), (1216, 1024, 8192, "64", ""),
    (64, 4096, 7168, "", "8"), (128, 7168, 16384, "", "8"), (1216, 1024, 8192, "64", "8"),
])
def test_gpu_overlap_matches_plain_loop(m, n, k, block_m, unroll, seed, monkeypatch):
    """Block M 64, block N <= 128: K block i + 1's wgmmas in flight while K block i is promoted (a
    second accumulator set), against the plain loop (MOE_FP8_OVERLAP=0): the same FFMAs in the same
    order, so D is bit for bit the same. Clusters (128 rows), one-row problems, and overlapped whole
    tiles beside the plain loop's split tail units on one CTA (1216 x 1024 x 8192 at block M 64:
    190 tiles on 132 CTAs, the last 58 split in two). MOE_GEMM_K_UNROLL=8: rounds of 8 K blocks."""
    if block_m:
        monkeypatch.setenv("MOE_GEMM_BLOCK_M", block_m)
    if unroll:
        monkeypatch.setenv("MOE_GEMM_K_UNROLL", unroll)
    cfg = kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())
    assert (cfg["block_m"], cfg["overlap"], cfg["k_unroll"]) == (64, 1, int(unroll or 1)), cfg
    assert (cfg["tail_splits"] > 1) == bool(block_m), cfg
    _, _, d, plain = with_switch_off(m, n, k, "MOE_FP8_OVERLAP", monkeypatch)
    assert torch.equal(d, plain)


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
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")  # ping-pong takes one wave of 128 rows
    monkeypatch.setenv("MOE_FP8_PINGPONG", "1")
    assert kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())["pingpong"] == 1
    _, _, d, plain = with_switch_off(m, n, k, "MOE_FP8_PINGPONG", monkeypatch)
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
        # The GPU sleeps (about 1 ms) while the host enqueues both launches, so that on a stream too
        # the dependent launch is queued before the long GEMM runs: without PDL it would still wait.
        torch.cuda._sleep(2_000_000)
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


def _split_against_whole_tiles(m, n, k, monkeypatch):
    """A call whose plan splits tiles over K, against float64 and against the same tiles whole
    (MOE_GEMM_TAIL_SPLIT=0), both NaN-poisoned; a second call gives the same bits (the partials are
    added in split order and the counters were left zero) and a residual C is added once.
    Returns (d, whole)."""
    a_fp8, b_fp8, d, whole = with_switch_off(m, n, k, "MOE_GEMM_TAIL_SPLIT", monkeypatch)
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
@pytest.mark.parametrize("m,n,k", [(4096, 2112, 7168), (1000, 24576, 1152)])
def test_gpu_k_unroll_on_128_row_tiles_matches_plain_loop(m, n, k, seed, monkeypatch):
    """Dense 128 x 192 tiles with the math K loop unrolled 4 times on ping-pong and 8 times without
    against the plain ping-pong loop (MOE_GEMM_K_UNROLL=1; 9 K blocks at K = 1152: a partial round):
    bit for bit the same D."""
    native = kernels.jit.native_module()
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    outputs = {}
    for pingpong, unroll in (("1", "4"), ("1", "1"), ("0", "8")):
        monkeypatch.setenv("MOE_GEMM_K_UNROLL", unroll)
        monkeypatch.setenv("MOE_FP8_PINGPONG", pingpong)
        cfg = native.fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())
        assert (cfg["block_m"], cfg["pingpong"], cfg["k_unroll"]) == (128, int(pingpong), int(unroll)), cfg
        outputs[pingpong, unroll] = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.fp8_gemm_nt(a_fp8, b_fp8, outputs[pingpong, unroll])
    torch.cuda.synchronize()
    assert calc_diff(outputs["1", "4"], reference_f64(a_fp8, b_fp8)) < 1e-3
    assert torch.equal(outputs["1", "4"], outputs["1", "1"])
    assert torch.equal(outputs["0", "8"], outputs["1", "1"]), "no ping-pong, unrolled 8 times"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,env", [
    (4096, 4096, 7168, {}),                                                  # 256 x 128, clusters sharing A
    (300, 7168, 2048, {}),                                                   # the last tile's second wave past M
    (1000, 4232, 1536, {"MOE_GEMM_BLOCK_M": "256"}),                         # a partial m-block, a partial n-block
    (257, 264, 640, {"MOE_GEMM_BLOCK_M": "256", "MOE_FP8_MULTICAST": "0"}),  # one row past the first tile
    (4096, 2112, 7168, {}),                                                  # 128 x 192, no turns
    (4096, 2112, 16384, {"MOE_GEMM_BLOCK_M": "256", "MOE_FP8_MULTICAST": "2"}),  # a split tail
    (200, 576, 7168, {"MOE_GEMM_BLOCK_M": "128", "MOE_FP8_PINGPONG": "0"}),  # 128-row tiles, rows 192-199 past M
])
def test_gpu_wg_store_matches_tile_store(m, n, k, env, seed, monkeypatch):
    """Per-warpgroup epilogues (MOE_FP8_WG_STORE=1: each math warpgroup stores its own 64-row
    stripes in 64-row TMA boxes) against the tile-wide epilogue: bit for bit the same D, NaN-poisoned,
    also with a residual C; stripes past M are not stored."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    native = kernels.jit.native_module()
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    c = torch.randn(m, n, device="cuda")
    outputs = {}
    for wg_store in ("0", "1"):
        monkeypatch.setenv("MOE_FP8_WG_STORE", wg_store)
        cfg = native.fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())
        assert cfg["block_m"] >= 128 and cfg["wg_store"] == int(wg_store), cfg
        outputs[wg_store] = d_with_and_without_c(a_fp8, b_fp8, c)
    assert_same_outputs(outputs["1"], outputs["0"], a_fp8, b_fp8, c)
