"""m_grouped_fp8_gemm_nt_swiglu_contiguous / _masked (kernels/grouped_swiglu.py): the L1 GEMM with
SwiGLU x top-k weight and the 1 x 128 quantization in its epilogue. CPU: the reference against the
staged definition (grouped GEMM on the checkpoint-order weights into bf16, then swiglu_quant_fp8),
argument checks, the plan and the kernel's SASS; GPU: the kernel byte for byte against the staged
kernels and against float64, on fresh data with poisoned outputs, at odd sizes and layouts."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.reference.gemm import dequantize_a, dequantize_b
from kernels.reference.quant import per_token_cast_to_fp8
from kernels.reference.swiglu import deinterleave_gate_up, dequantize_b_interleaved
from kernels.testing import calc_diff
from moe_runtime.weight_layout import transform_weights_for_mega_moe

from gemm_cases import H200_SMS, TensorSubclass
from grouped_cases import make_contiguous, make_weights
from test_sass import sass

_E4M3_NAN = 0x7F


def make_l1_weights(g: int, n: int, k: int, device):
    """FP8 L1 weights whose 128 x 128 block scales differ by powers of two, so that a gate scale taken
    for an up one (or a neighbouring block's) changes the result."""
    w, sf = make_weights(g, n, k, device)
    return w, sf * 2.0 ** torch.randint(-4, 5, sf.shape, device=device)


def interleaved(w, sf):
    """Checkpoint-order FP8 L1 weights [G, 2I, K] -> the SwiGLU GEMM's (transform_weights_for_mega_moe)."""
    g, n, k = w.shape
    down = (torch.zeros(g, k, n // 2, dtype=torch.float8_e4m3fn, device=w.device),
            torch.ones(g, k // 128, n // 256, dtype=torch.float32, device=w.device))
    return tuple(transform_weights_for_mega_moe((w, sf), down).l1)


def poisoned(rows: tuple[int, ...], inter: int, device, mn_major: bool = False):
    """(act, act_sf) filled with NaN: E4M3 0x7f and float NaN."""
    act = torch.full((*rows, inter), _E4M3_NAN, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    if mn_major:
        sf = kernels.get_mn_major_tma_aligned_tensor(torch.zeros(rows[0], inter // 128, device=device))
        sf.fill_(float("nan"))
    else:
        sf = torch.full((*rows, inter // 128), float("nan"), dtype=torch.float32, device=device)
    return act, sf


def staged(a, w, m_indices, weights):
    """The staged definition: grouped GEMM into bf16 on the checkpoint-order weights, then swiglu_quant_fp8."""
    h = torch.zeros(a[0].shape[0], w[0].shape[1], dtype=torch.bfloat16, device=a[0].device)
    kernels.m_grouped_fp8_gemm_nt_contiguous(a, w, h, m_indices)
    return kernels.swiglu_quant_fp8(h, weights)


def float64_act(a, w, m_indices, weights):
    """SwiGLU x weight in float64 on the dequantized operands (checkpoint order), zero for padding."""
    lhs = dequantize_a(*a).double()
    out = torch.zeros(lhs.shape[0], w[0].shape[1] // 2, dtype=torch.float64, device=lhs.device)
    inter = out.shape[1]
    for g in range(w[0].shape[0]):
        rows = m_indices == g
        if rows.any():
            h = lhs[rows] @ dequantize_b(w[0][g], w[1][g]).double().t()
            out[rows] = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:] * weights[rows].double().view(-1, 1)
    return out


def dequant(act, sf):
    return act.float() * sf.float().repeat_interleave(128, dim=-1)


def contiguous_case(counts, inter, k, device, mn_major=False, pad_blocks=0, trim=0):
    """One contiguous call; mn_major: A's and act's scales MN-major TMA-aligned (A's then load by TMA);
    pad_blocks: whole 128-row blocks of padding (m_indices -1) in front; trim: rows cut off the end (M
    then not a multiple of 128)."""
    w = make_l1_weights(len(counts), 2 * inter, k, device)
    (x, sf), m_indices = make_contiguous(counts, k, device)
    if pad_blocks:
        (px, psf), _ = make_contiguous([128 * pad_blocks], k, device)
        x, sf = torch.cat([px, x]), torch.cat([psf, sf])
        m_indices = torch.cat([torch.full((128 * pad_blocks,), -1, dtype=torch.int32, device=device), m_indices])
    if trim:
        x, sf, m_indices = x[:-trim], sf[:-trim], m_indices[:-trim]
    a = (x, sf)
    if mn_major:
        a = (a[0], kernels.get_mn_major_tma_aligned_tensor(a[1]))
    weights = torch.rand(m_indices.shape[0], device=device)
    d = poisoned((m_indices.shape[0],), inter, device, mn_major)
    kernels.m_grouped_fp8_gemm_nt_swiglu_contiguous(a, interleaved(*w), d, m_indices, weights)
    return a, w, m_indices, weights, d


def masked_activations(g: int, max_m: int, k: int, device):
    """Random A [G, max_m, K] e4m3 with its 1 x 128 scales [G, max_m, K/128], groups stacked."""
    x, sf = per_token_cast_to_fp8(torch.randn(g * max_m, k, dtype=torch.bfloat16, device=device))
    return x.view(g, max_m, k), sf.view(g, max_m, -1)


def assert_rows_match(d, want, rows) -> None:
    act, sf = d
    assert torch.equal(act[rows].view(torch.uint8), want[0][rows].view(torch.uint8)), "act differs"
    assert torch.equal(sf[rows], want[1][rows]), "act_sf differs"


def assert_untouched(d, rows) -> None:
    act, sf = d
    assert (act[rows].view(torch.uint8) == _E4M3_NAN).all() and sf[rows].isnan().all(), "rows written that must not be"


# ---- CPU ----------------------------------------------------------------------------------------

def test_reference_deinterleaves_rows_and_scales(seed):
    w = make_l1_weights(2, 512, 256, "cpu")
    w1, sf1 = interleaved(*w)
    assert sf1.shape == (2, 4, 2, 2)
    got = deinterleave_gate_up(dequantize_b_interleaved(w1, sf1).transpose(1, 2)).transpose(1, 2)
    assert torch.equal(got, dequantize_b(*w))


@pytest.mark.parametrize("counts,inter,k,pad_blocks,trim", [([5, 0, 130, 1], 128, 256, 0, 0),
                                                        ([200, 3], 384, 384, 1, 0), ([200, 3], 128, 256, 0, 100)])
def test_cpu_contiguous_is_the_staged_definition(seed, counts, inter, k, pad_blocks, trim):
    a, w, m_indices, weights, d = contiguous_case(counts, inter, k, "cpu", pad_blocks=pad_blocks, trim=trim)
    valid = m_indices >= 0
    want = staged(a, w, m_indices, weights)
    assert calc_diff(dequant(*d)[valid], dequant(*want)[valid]) < 1e-5
    assert torch.allclose(d[1][valid], want[1][valid], rtol=1e-2)
    assert_untouched(d, ~valid)


def test_cpu_masked_writes_rows_below_masked_m(seed):
    g, max_m, inter, k = 3, 9, 128, 256
    w = make_l1_weights(g, 2 * inter, k, "cpu")
    a = masked_activations(g, max_m, k, "cpu")
    masked = [0, 9, 4]
    weights = torch.rand(g, max_m)
    d = poisoned((g, max_m), inter, "cpu")
    kernels.m_grouped_fp8_gemm_nt_swiglu_masked(a, interleaved(*w), d, torch.tensor(masked, dtype=torch.int32),
                                                max_m, weights)
    for i, count in enumerate(masked):
        rows = torch.arange(max_m) < count
        if count:
            m_indices = torch.full((count,), i, dtype=torch.int32)
            want = staged((a[0][i, :count], a[1][i, :count]), w, m_indices, weights[i, :count])
            assert calc_diff(dequant(d[0][i, :count], d[1][i, :count]), dequant(*want)) < 1e-5
        assert_untouched((d[0][i], d[1][i]), ~rows)


def _args(g=2, m=8, inter=128, k=256):
    w = make_weights(g, 2 * inter, k, "cpu")
    a, m_indices = make_contiguous([m] * g, k, "cpu")
    return dict(a=a, b=interleaved(*w), d=poisoned((m_indices.shape[0],), inter, "cpu"), m_indices=m_indices,
                weights=torch.rand(m_indices.shape[0]))


@pytest.mark.parametrize("change,match", [
    (lambda kw: kw.update(b=make_weights(2, 256, 256, "cpu")), r"b\[1\] \(SFB\) must"),
    (lambda kw: kw.update(b=(kw["b"][0][:, :128].contiguous(), kw["b"][1][:, :1])), r"I a positive multiple of 128"),
    (lambda kw: kw.update(b=(kw["b"][0], kw["b"][1].transpose(1, 2).contiguous().transpose(1, 2))),
     r"stride\[1\] == 2 \* stride\[2\]"),
    (lambda kw: kw.update(d=(kw["d"][0].float(), kw["d"][1])), r"d\[0\] \(act\) must be a float8_e4m3fn"),
    (lambda kw: kw.update(d=(kw["d"][0], kw["d"][1][:, :0])), r"d\[1\] \(act_sf\) must be a float32 tensor"),
    (lambda kw: kw.update(d=kw["d"][0]), r"d must be a \(tensor, scales\) pair"),
    (lambda kw: kw.update(d=(kw["d"][0].as_strided((256, 128), (64, 1)), kw["d"][1])),
     r"row stride of at least I = 128"),
    (lambda kw: kw.update(d=(kw["d"][0], torch.zeros(1, 1).expand(256, 1))), r"its own address"),
    (lambda kw: kw.update(d=(kw["d"][0], torch.zeros(256, 1, requires_grad=True))),
     r"d\[1\] \(act_sf\) is written in place but requires grad"),
    (lambda kw: kw.update(d=(kw["d"][0], torch.zeros(1, 1).as_strided((256, 1), (0, 1)))), r"its own address"),
    (lambda kw: kw.update(weights=kw["weights"][:3]), r"weights must be a contiguous float32 tensor of shape \[256\]"),
    (lambda kw: kw.update(weights=kw["weights"].double()), r"weights must be a contiguous float32"),
    (lambda kw: kw.update(m_indices=kw["m_indices"].long()), r"m_indices must be an int32 tensor"),
])
def test_bad_arguments_name_what_is_wrong(change, match):
    kw = _args()
    change(kw)
    with pytest.raises((TypeError, ValueError), match=match):
        kernels.m_grouped_fp8_gemm_nt_swiglu_contiguous(kw["a"], kw["b"], kw["d"], kw["m_indices"], kw["weights"])


@pytest.mark.parametrize("mn_major", [False, True])
def test_masked_scales_of_groups_must_not_overlap(seed, mn_major):
    """Masked act_sf is addressed as [G x max_m, I/128]: a layout whose groups overlap another's columns
    (each group MN-major on its own, the groups max_m apart) is refused; the stacked MN-major layout
    of the whole [G x max_m] rows, and the contiguous one, are taken."""
    g, max_m, inter, k = 3, 8, 256, 256
    w = make_l1_weights(g, 2 * inter, k, "cpu")
    a = masked_activations(g, max_m, k, "cpu")
    act = torch.empty(g, max_m, inter, dtype=torch.float8_e4m3fn)
    masked_m = torch.tensor([8, 3, 0], dtype=torch.int32)
    weights = torch.rand(g, max_m)
    groups = inter // 128
    good = torch.empty(groups, g * max_m).t().view(g, max_m, groups) if mn_major else torch.empty(g, max_m, groups)
    kernels.m_grouped_fp8_gemm_nt_swiglu_masked(a, interleaved(*w), (act, good), masked_m, 4, weights)
    bad = torch.empty(g * max_m + groups * max_m).as_strided((g, max_m, groups), (max_m, 1, max_m))
    with pytest.raises(ValueError, match="its own address"):
        kernels.m_grouped_fp8_gemm_nt_swiglu_masked(a, interleaved(*w), (act, bad), masked_m, 4, weights)


def test_masked_bad_expected_m():
    with pytest.raises(ValueError, match="expected_m must be a positive int"):
        kernels.m_grouped_fp8_gemm_nt_swiglu_masked(None, None, None, None, 0, None)


@pytest.mark.parametrize("m,n,k,gemm_type,groups,scale_load", [
    (8192, 4096, 7168, 1, 32, 1), (8192, 4096, 7168, 1, 32, 2), (4096, 512, 384, 1, 4, 0),
    (16, 4096, 7168, 2, 32, 0), (256, 4096, 7168, 2, 8, 0),
])
def test_kernel_is_lean_and_writes_act(m, n, k, gemm_type, groups, scale_load):
    """Pairs of 128 x 128 tiles (64-row at decode sizes), no clusters; the SASS issues QGMMAs and TMA
    loads, raises the math registers, never spills (the first tile's act waits in registers) and stores
    act two bytes per slab and row (the 2 x 2 x 8 STG.U16 of the pair's epilogue)."""
    native = kernels.jit.native_module()
    name, code, config = native.fp8_gemm_nt_swiglu_code(m, n, k, H200_SMS, gemm_type, groups, scale_load)
    assert config["swiglu"] == 1 and config["block_n"] == 128 and config["multicast"] == 1
    assert config["block_m"] == (64 if m <= 128 else 128)
    assert config["scale_load"] == ("tma_mn_major" if gemm_type == 1 and scale_load == 1 else "gather")
    assert_lean_swiglu_sass(sass(name, code), "QGMMA")


def assert_lean_swiglu_sass(text: str, wgmma: str) -> None:
    """``wgmma`` instructions, TMA loads and raised math registers, no D store and no spills, and act stored
    two bytes per slab and row (the 2 x 2 x 8 STG.U16 of a scale group's epilogue)."""
    for instruction in (wgmma, "UTMALDG", "USETMAXREG"):
        assert instruction in text, instruction
    assert "UTMASTG" not in text, "the SwiGLU epilogue stores no D"
    assert "LDL" not in text and "STL" not in text, "register spills"
    assert text.count("STG.E.U16") == 32


@pytest.mark.parametrize("m,gemm_type,groups", [(8192, 1, 32), (256, 2, 8)])
def test_shared_b_pairs_compile(monkeypatch, m, gemm_type, groups):
    """MOE_FP8_MULTICAST=b: 2-CTA clusters of adjacent 128-row m-blocks load B once by multicast; an
    m-block past M or a masked group's count computes only for its partner and reads no weights."""
    monkeypatch.setenv("MOE_FP8_MULTICAST", "b")
    native = kernels.jit.native_module()
    name, code, config = native.fp8_gemm_nt_swiglu_code(m, 4096, 7168, H200_SMS, gemm_type, groups, 0)
    assert (config["multicast"], config["share_b"], config["block_m"]) == (2, 1, 128)
    text = sass(name, code)
    assert "UTMALDG.2D.MULTICAST" in text
    assert "LDL" not in text and "STL" not in text, "register spills"


@pytest.mark.parametrize("m,n,gemm_type,groups,scale_load,share_b", [
    (8192, 4096, 1, 32, 1, False), (8192, 4096, 1, 32, 0, False), (16, 4096, 2, 32, 0, False),
    (256, 4096, 2, 8, 0, True), (8192, 768, 1, 32, 0, False),  # N = 3 x 256: an odd count of tiles
])
def test_wide_tiles_are_lean(monkeypatch, m, n, gemm_type, groups, scale_load, share_b):
    """MOE_SWIGLU_WIDE=1: 256-column tiles, two 64 x 128 wgmma halves a K block, the act scale group
    stored at once (the same 32 two-byte stores a thread), no spills with or without clusters sharing B."""
    monkeypatch.setenv("MOE_SWIGLU_WIDE", "1")
    if share_b:
        monkeypatch.setenv("MOE_FP8_MULTICAST", "b")
    native = kernels.jit.native_module()
    name, code, config = native.fp8_gemm_nt_swiglu_code(m, n, 7168, H200_SMS, gemm_type, groups, scale_load)
    # One tile per act scale group (N / 256) and m-block (of a masked group's m rows).
    assert config["block_n"] == 256 and config["num_tiles"] == n // 256 * -(-m // config["block_m"])
    assert config["share_b"] == int(share_b)
    assert_lean_swiglu_sass(sass(name, code), "QGMMA.64x128x32")


# ---- GPU ----------------------------------------------------------------------------------------

# The default kernels, 2-CTA clusters sharing B, and 256-column tiles (alone, sharing B, the math
# warpgroups taking turns).
KERNEL_VARIANTS = {"single": {}, "share_b": {"MOE_FP8_MULTICAST": "b"}, "wide": {"MOE_SWIGLU_WIDE": "1"},
                   "wide_share_b": {"MOE_SWIGLU_WIDE": "1", "MOE_FP8_MULTICAST": "b"},
                   "wide_turns": {"MOE_SWIGLU_WIDE": "2"}}

@pytest.mark.gpu
@pytest.mark.parametrize("counts,inter,k,mn_major,pad_blocks,trim", [
    ([5, 0, 130, 1, 257], 256, 512, False, 0, 28),  # M not a multiple of 128, 7 m-blocks (one unpaired)
    ([300, 129, 64], 384, 7168, True, 1, 0),        # a padding block
    ([1000, 37, 700, 1], 2048, 7168, True, 2, 0),
])
@pytest.mark.parametrize("env", KERNEL_VARIANTS.values(), ids=KERNEL_VARIANTS.keys())
def test_gpu_contiguous_matches_staged_kernels_byte_for_byte(seed, counts, inter, k, mn_major, pad_blocks, trim,
                                                             env, monkeypatch):
    """Also in 2-CTA clusters sharing B (MOE_FP8_MULTICAST=b), whose last pair may hold an m-block past M,
    and in 256-column tiles (at I = 384 an odd count of them; most CTAs have no tile)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    a, w, m_indices, weights, d = contiguous_case(counts, inter, k, "cuda", mn_major, pad_blocks, trim)
    valid = m_indices >= 0
    assert_rows_match(d, staged(a, w, m_indices, weights), valid)
    assert calc_diff(dequant(*d)[valid], float64_act(a, w, m_indices, weights)[valid]) < 1e-3
    # Padding blocks (whose first row is -1) are left as they were.
    rows = torch.arange(m_indices.shape[0], device="cuda")
    padding = m_indices[rows // 128 * 128] < 0
    assert int(padding.sum()) == 128 * pad_blocks
    assert_untouched(d, padding)


@pytest.mark.gpu
@pytest.mark.parametrize("masked,max_m,inter,k,expected_m", [
    ([0, 1, 7, 64, 100], 128, 256, 512, 16),
    ([3, 0, 17], 24, 2048, 7168, 4),
    ([256, 255, 1, 0], 256, 384, 1024, 200),  # 128-row tiles: group 2's one m-block pairs with none
])
@pytest.mark.parametrize("env", KERNEL_VARIANTS.values(), ids=KERNEL_VARIANTS.keys())
def test_gpu_masked_matches_staged_kernels_byte_for_byte(seed, masked, max_m, inter, k, expected_m, env,
                                                         monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    g = len(masked)
    w = make_l1_weights(g, 2 * inter, k, "cuda")
    a = masked_activations(g, max_m, k, "cuda")
    weights = torch.rand(g, max_m, device="cuda")
    d = poisoned((g, max_m), inter, "cuda")
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    kernels.m_grouped_fp8_gemm_nt_swiglu_masked(a, interleaved(*w), d, masked_m, expected_m, weights)
    for i, count in enumerate(masked):
        rows = torch.arange(max_m, device="cuda") < count
        if count:
            m_indices = torch.full((count,), i, dtype=torch.int32, device="cuda")
            sub = (a[0][i, :count], a[1][i, :count])
            want = staged(sub, w, m_indices, weights[i, :count])
            assert_rows_match((d[0][i, :count], d[1][i, :count]), want, slice(None))
            ref = float64_act(sub, w, m_indices, weights[i, :count])
            assert calc_diff(dequant(d[0][i, :count], d[1][i, :count]), ref) < 1e-3
        assert_untouched((d[0][i], d[1][i]), ~rows)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_plain_cuda_tensors_take_the_cpp_path(seed, masked):
    """The C++ checks and launch take plain CUDA tensors (a silent decline would only cost host time:
    this asserts it does not happen) and decline row weights of a tensor subclass without writing; the
    Python path then runs that call, byte for byte the C++ path's output."""
    native, inter, k = kernels.jit.native_module(), 256, 1024
    stream = torch.cuda.current_stream().cuda_stream
    if masked:
        counts, max_m, expected_m = [5, 0, 130], 136, 64
        w = make_l1_weights(len(counts), 2 * inter, k, "cuda")
        a = masked_activations(len(counts), max_m, k, "cuda")
        index = torch.tensor(counts, dtype=torch.int32, device="cuda")
        weights = torch.rand(len(counts), max_m, device="cuda")
        rows, extra = (len(counts), max_m), (expected_m,)
        launch, call = native.m_grouped_fp8_gemm_nt_swiglu_masked_tensors, kernels.m_grouped_fp8_gemm_nt_swiglu_masked
    else:
        w = make_l1_weights(3, 2 * inter, k, "cuda")
        a, index = make_contiguous([130, 0, 7], k, "cuda")
        weights = torch.rand(index.shape[0], device="cuda")
        rows, extra = (index.shape[0],), ()
        launch = native.m_grouped_fp8_gemm_nt_swiglu_contiguous_tensors
        call = kernels.m_grouped_fp8_gemm_nt_swiglu_contiguous
    b = interleaved(*w)
    d_cpp, d_python = poisoned(rows, inter, "cuda"), poisoned(rows, inter, "cuda")
    subclass = weights.clone().as_subclass(TensorSubclass)
    tail = (weights.get_device(), stream)
    assert launch(a, b, d_cpp, index, *extra, weights, *tail) is True
    assert launch(a, b, d_python, index, *extra, subclass, *tail) is False
    torch.cuda.synchronize()
    assert_untouched(d_python, slice(None))
    call(a, b, d_python, index, *extra, subclass)
    for got, want in zip(d_cpp, d_python):  # bits, so that rows left NaN compare equal
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "the two paths differ"
    valid = (torch.arange(max_m, device="cuda") < index.view(-1, 1)) if masked else index >= 0
    assert not d_cpp[1][valid].isnan().any(), "a row the call owns left unwritten"
