"""FP8 quantizers: reference semantics, argument checks, NVRTC compilation, GPU bit-exactness.

The GPU kernels must equal the CPU references of kernels/reference/quant.py bit for bit. The
oracle always runs on CPU: torch on CUDA divides by a Python scalar as a multiply by its
reciprocal, which is not the IEEE ``amax / 448`` that the references define.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import kernels

import kernels.jit
import kernels.quant as quant
from kernels.reference import quant as reference

E4M3 = torch.float8_e4m3fn


def e4m3_bytes(values: torch.Tensor) -> list[int]:
    return values.to(E4M3).view(torch.uint8).tolist()


def row_of(values, n: int = 128, dtype=torch.float32) -> torch.Tensor:
    x = torch.zeros(1, n, dtype=dtype)
    x[0, :len(values)] = torch.tensor(values, dtype=torch.float32).to(dtype)
    return x


def f32(value: float) -> float:
    return float(np.float32(value))


# ---------------------------------------------------------------------------------------------
# Reference semantics (CPU)

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hand_example_unit_scale(dtype):
    # amax 448 gives sf 1: the bytes are the E4M3 encodings of the inputs, with RNE at the ties.
    values = [448.0, -224.0, 1.0625, 1.1875, -2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10]
    x_fp8, sf = quant.per_token_cast_to_fp8(row_of(values, dtype=dtype))
    assert sf.tolist() == [[1.0]]
    got = x_fp8.view(torch.uint8)[0].tolist()
    # 448 = 0x7e, -224 = 0xf6, 1.0625 ties to 1.0 (even) = 0x38, 1.1875 ties to 1.25 = 0x3a,
    # -2^-9 is the smallest subnormal 0x81, 2^-10 ties to 0, 3 * 2^-10 ties to 2^-8 = 0x02.
    assert got[:7] == [0x7E, 0xF6, 0x38, 0x3A, 0x81, 0x00, 0x02]
    assert got[7:] == [0] * (128 - 7)


def test_hand_example_ue8m0_scale():
    x = row_of([1.0, 0.5, -0.25, 0.3])
    plain_fp8, plain_sf = quant.per_token_cast_to_fp8(x)
    assert plain_sf.item() == f32(np.float32(1.0) / np.float32(448.0))
    x_fp8, sf = quant.per_token_cast_to_fp8(x, use_ue8m0=True)
    assert sf.item() == 2.0 ** -8  # 1/448 = 0.00223 rounds up to 2^-8
    # x * 256: 256 = 0x78, 128 = 0x70, -64 = 0xe8, 76.8 -> 80 = 0x6a.
    assert x_fp8.view(torch.uint8)[0, :4].tolist() == [0x78, 0x70, 0xE8, 0x6A]
    inv = torch.tensor(1.0, dtype=torch.float32) / plain_sf[0, 0]
    assert plain_fp8.view(torch.uint8)[0, :4].tolist() == e4m3_bytes(x[0, :4] * inv)


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_all_zero_group_gets_the_floor_scale(use_ue8m0):
    x = torch.randn(2, 256)
    x[1, 128:] = 0
    x_fp8, sf = quant.per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    floor = f32(np.float32(1e-4) / np.float32(448.0))
    assert sf[1, 1].item() == (2.0 ** -22 if use_ue8m0 else floor)
    assert (x_fp8[1, 128:].view(torch.uint8) == 0).all()
    assert sf[0, 0].item() > floor


def test_ue8m0_scale_of_inf_and_nan_passes_through():
    """A group with inf (or NaN) gets an inf (NaN) scale, as the kernels give, not a false 1.0."""
    x = torch.randn(3, 256)
    x[0, 5], x[1, 130] = float("inf"), float("nan")
    _, sf = quant.per_token_cast_to_fp8(x, use_ue8m0=True)
    assert sf[0, 0].item() == float("inf") and math.isnan(sf[1, 1].item())
    assert bool(torch.isfinite(sf[2]).all()) and sf[0, 1].item() < float("inf")
    assert kernels.ceil_to_ue8m0(torch.tensor([3.0, float("inf")])).tolist() == [4.0, float("inf")]
    with pytest.raises(ValueError, match="values > 0"):
        kernels.ceil_to_ue8m0(torch.tensor([1.0, 0.0]))


def test_ue8m0_one_ulp_above_a_power_of_two():
    # amax 56 gives sf = 0.125 exactly; one ulp more makes sf one ulp above 0.125 -> 0.25.
    exact = row_of([56.0])
    above = row_of([float(torch.nextafter(torch.tensor(56.0), torch.tensor(100.0)))])
    assert quant.per_token_cast_to_fp8(exact, use_ue8m0=True)[1].item() == 0.125
    assert quant.per_token_cast_to_fp8(above, use_ue8m0=True)[1].item() == 0.25
    assert quant.per_token_cast_to_fp8(above)[1].item() > 0.125


def test_ceil_to_ue8m0_exact_at_every_exponent():
    powers = torch.ldexp(torch.ones(277), torch.arange(-149, 128))
    assert torch.equal(quant.ceil_to_ue8m0(powers), powers)
    up = torch.nextafter(powers, torch.full_like(powers, math.inf))
    expected_up = torch.cat([powers[1:], torch.tensor([math.inf])])
    assert torch.equal(quant.ceil_to_ue8m0(up), expected_up)
    # One ulp below 2^e rounds back up to 2^e (below 2^-147 that ulp lands on a power of two).
    down = torch.nextafter(powers[2:], torch.zeros(275))
    assert torch.equal(quant.ceil_to_ue8m0(down), powers[2:])


def test_ceil_to_ue8m0_random_values(seed):
    x = torch.exp(torch.empty(100_000).uniform_(-80, 80))
    r = quant.ceil_to_ue8m0(x)
    mantissa, _ = torch.frexp(r)
    assert (mantissa == 0.5).all()
    assert (r >= x).all() and (r / 2 < x).all()


@pytest.mark.parametrize("gran_k", [32, 64, 128])
def test_partial_last_group(seed, gran_k):
    n = 2 * gran_k + 3
    x = torch.randn(4, n)
    x_fp8, sf = quant.per_token_cast_to_fp8(x, gran_k=gran_k)
    assert x_fp8.shape == (4, n) and sf.shape == (4, 3)
    tail_amax = x[:, 2 * gran_k:].abs().amax(dim=1).clamp(min=1e-4)
    assert torch.equal(sf[:, 2], tail_amax / 448.0)
    assert torch.equal(x_fp8.view(torch.uint8)[:, 2 * gran_k:],
                       (x[:, 2 * gran_k:] * (1.0 / sf[:, 2:3])).to(E4M3).view(torch.uint8))


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_batched_per_block_equals_each_slice(seed, use_ue8m0):
    x = torch.randn(3, 200, 300, dtype=torch.bfloat16)
    x_fp8, sf = quant.per_block_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    assert x_fp8.shape == (3, 200, 300) and sf.shape == (3, 2, 3)
    for i in range(3):
        one_fp8, one_sf = quant.per_block_cast_to_fp8(x[i], use_ue8m0=use_ue8m0)
        assert torch.equal(x_fp8[i].view(torch.uint8), one_fp8.view(torch.uint8))
        assert torch.equal(sf[i], one_sf)
    # The corner tile covers rows 128..199 and columns 256..299 only.
    corner = x[1, 128:, 256:].float().abs().amax().clamp(min=1e-4) / 448.0
    assert sf[1, 1, 2].item() == (reference.ceil_to_ue8m0(corner) if use_ue8m0 else corner).item()


def _round_trip_bound(x: torch.Tensor, deq: torch.Tensor, sf_full: torch.Tensor) -> None:
    # E4M3 keeps 3 mantissa bits (relative error <= 2^-4) down to 2^-6 * sf; below that the
    # subnormal step is 2^-9 * sf.
    err = (x.float() - deq).abs()
    assert (err <= x.float().abs() * 2.0 ** -4 + sf_full * 2.0 ** -10).all()


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("gran_k", [32, 128])
def test_per_token_round_trip(seed, use_ue8m0, gran_k):
    x = (torch.randn(64, 1000) * torch.exp(torch.randn(64, 1) * 4)).to(torch.bfloat16)
    x_fp8, sf = quant.per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0, gran_k=gran_k)
    deq = reference.dequantize_per_token(x_fp8, sf, gran_k)
    _round_trip_bound(x, deq, sf.repeat_interleave(gran_k, dim=1)[:, :1000])
    assert torch.nn.functional.cosine_similarity(deq.flatten(), x.float().flatten(), dim=0) > 0.999


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_per_block_round_trip(seed, use_ue8m0):
    x = torch.randn(2, 300, 260) * 3
    x_fp8, sf = quant.per_block_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    deq = reference.dequantize_per_block(x_fp8, sf)
    sf_full = sf.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :300, :260]
    _round_trip_bound(x, deq, sf_full)


@pytest.mark.parametrize("m, n, gran_k", [(1, 128, 128), (7, 1000, 64), (64, 7168, 128), (130, 300, 32)])
def test_per_token_mn_major_sf(seed, m, n, gran_k):
    """mn_major_sf: the same scales, stored MN-major with the M stride rounded up to 4 floats
    (get_mn_major_tma_aligned_tensor's layout, which it then returns unchanged)."""
    x = torch.randn(m, n, dtype=torch.bfloat16) * 3
    want_fp8, want_sf = quant.per_token_cast_to_fp8(x, gran_k=gran_k)
    got_fp8, got_sf = quant.per_token_cast_to_fp8(x, gran_k=gran_k, mn_major_sf=True)
    assert torch.equal(got_fp8.view(torch.uint8), want_fp8.view(torch.uint8)) and torch.equal(got_sf, want_sf)
    assert got_sf.stride() == (1, -(-m // 4) * 4)
    assert kernels.get_mn_major_tma_aligned_tensor(got_sf) is got_sf
    empty = quant.per_token_cast_to_fp8(x[:0], gran_k=gran_k, mn_major_sf=True)[1]
    assert empty.shape == (0, -(-n // gran_k))
    with pytest.raises(TypeError, match="mn_major_sf must be a bool"):
        quant.per_token_cast_to_fp8(x, mn_major_sf=1)


def test_per_token_empty_rows():
    x_fp8, sf = quant.per_token_cast_to_fp8(torch.randn(0, 300), gran_k=64)
    assert x_fp8.shape == (0, 300) and x_fp8.dtype == E4M3
    assert sf.shape == (0, 5) and sf.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Argument checks: Python layer

@dataclass
class BadCall:
    fn: str
    kwargs: dict
    error: type
    match: str


def _bad_calls() -> list[BadCall]:
    x = torch.randn(4, 256)
    return [
        BadCall("per_token_cast_to_fp8", {"x": x.numpy()}, TypeError, "x must be a torch.Tensor"),
        BadCall("per_token_cast_to_fp8", {"x": x.double()}, TypeError, "torch.float64"),
        BadCall("per_token_cast_to_fp8", {"x": x.to(torch.int32)}, TypeError, "torch.int32"),
        BadCall("per_token_cast_to_fp8", {"x": x[0]}, ValueError, r"2-D, got shape \(256,\)"),
        BadCall("per_token_cast_to_fp8", {"x": x[None]}, ValueError, "2-D"),
        BadCall("per_token_cast_to_fp8", {"x": x.t()}, ValueError, "contiguous"),
        BadCall("per_token_cast_to_fp8", {"x": x[:, :0]}, ValueError, ">= 1"),
        BadCall("per_token_cast_to_fp8", {"x": x, "gran_k": 16}, ValueError, "gran_k .* got 16"),
        BadCall("per_token_cast_to_fp8", {"x": x, "gran_k": 256}, ValueError, "got 256"),
        BadCall("per_token_cast_to_fp8", {"x": x, "gran_k": True}, ValueError, "got True"),
        BadCall("per_token_cast_to_fp8", {"x": x, "gran_k": 128.0}, ValueError, "got 128.0"),
        BadCall("per_token_cast_to_fp8", {"x": x.to_sparse_csr()}, ValueError, "dense .*sparse_csr"),
        BadCall("per_block_cast_to_fp8", {"x": x.to_sparse()}, ValueError, "dense .*sparse_coo"),
        BadCall("per_token_cast_to_fp8", {"x": x, "use_ue8m0": 1}, TypeError, "use_ue8m0"),
        BadCall("per_token_cast_to_fp8", {"x": x.to("meta")}, ValueError, "meta"),
        BadCall("per_block_cast_to_fp8", {"x": x[0]}, ValueError, "2-D or 3-D"),
        BadCall("per_block_cast_to_fp8", {"x": x[None, None]}, ValueError, "2-D or 3-D"),
        BadCall("per_block_cast_to_fp8", {"x": x.half().t()}, ValueError, "contiguous"),
        BadCall("per_block_cast_to_fp8", {"x": x.double()}, TypeError, "float64"),
        BadCall("per_block_cast_to_fp8", {"x": x, "use_ue8m0": "yes"}, TypeError, "use_ue8m0"),
        BadCall("ceil_to_ue8m0", {"x": 1.0}, TypeError, "torch.Tensor"),
        BadCall("ceil_to_ue8m0", {"x": x.double()}, TypeError, "float32"),
        BadCall("ceil_to_ue8m0", {"x": x.abs().to("meta")}, ValueError, "ceil_to_ue8m0: x must hold values .*meta"),
        BadCall("ceil_to_ue8m0", {"x": x.abs().to_sparse()}, ValueError,
                "ceil_to_ue8m0: x must be a dense .*sparse_coo"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: f"{c.fn}-{c.match}")
def test_bad_arguments_raise(case):
    with pytest.raises(case.error, match=case.match):
        getattr(quant, case.fn)(**case.kwargs)


def test_negated_views_and_integer_likes_are_taken_as_values():
    """A lazily negated view (negative bit) is quantized as the values it shows, not its memory; a
    numpy integer gran_k is an integer."""
    negated = torch._neg_view(torch.randn(4, 256))  # what conj().imag of a complex tensor gives, contiguous
    assert negated.is_neg()
    assert quant._check_input("f", negated, (2,)).is_neg() is False
    got = quant.per_token_cast_to_fp8(negated)
    want = quant.per_token_cast_to_fp8(negated.clone())
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    got, want = quant.per_block_cast_to_fp8(negated[None]), quant.per_block_cast_to_fp8(negated.clone()[None])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert torch.equal(quant.per_token_cast_to_fp8(want[1].new_ones(4, 256), gran_k=np.int64(64))[1],
                       quant.per_token_cast_to_fp8(want[1].new_ones(4, 256), gran_k=64)[1])


# ---------------------------------------------------------------------------------------------
# Argument checks: C++ layer (they fire before any device is touched)

def _native():
    return kernels.jit.native_module()


_TOKEN_ARGS = dict(x=256, x_dtype=1, m=4, n=256, x_row_stride=256, out=512, sf=1024, sf_stride_m=2,
                   sf_stride_k=1, gran_k=128, use_ue8m0=False, device=0, stream=0)
_BLOCK_ARGS = dict(x=256, x_dtype=1, batch=1, n=256, k=256, x_batch_stride=0, x_row_stride=256,
                   out=512, sf=1024, use_ue8m0=False, device=0, stream=0)


@pytest.mark.parametrize("override, match", [
    ({"x_dtype": 3}, "x_dtype must be the code of float32, bfloat16 or float16, got 3"),
    ({"x_dtype": 42}, "got 42"),
    ({"n": 0}, r"n must be in \[1, 2\^31 - 1\], got 0"),
    ({"m": -1}, "m must be >= 0, got -1"),
    ({"gran_k": 96}, "gran_k must be 32, 64 or 128, got 96"),
    ({"x_row_stride": -5}, "x_row_stride must be >= 0, got -5"),
    ({"out": 0}, "null data pointer"),
    ({"m": 1 << 31, "n": 128}, "exceeds 2"),
    ({"sf_stride_m": 1, "sf_stride_k": 1}, r"sf strides \(1, 1\) overlap for 4 x 2 scales"),
    ({"sf_stride_m": 1, "sf_stride_k": 3}, "overlap"),
    ({"sf_stride_m": 0}, "overlap"),
    ({"sf_stride_k": 1 << 32, "sf_stride_m": 1}, "overlap"),
])
def test_native_per_token_checks(override, match):
    with pytest.raises(RuntimeError, match=match):
        _native().per_token_cast_to_fp8(**{**_TOKEN_ARGS, **override})


@pytest.mark.parametrize("override, match", [
    ({"x_dtype": 6}, "got 6"),
    ({"k": 0}, "k must be in"),
    ({"batch": -2}, "batch = -2"),
    ({"n": 128 * 65536}, "more than 65535 row tiles"),
    ({"batch": 65536}, "batch = 65536 exceeds 65535"),
    ({"x_row_stride": -1}, "x_row_stride = -1"),
    ({"sf": 0}, "null data pointer"),
])
def test_native_per_block_checks(override, match):
    with pytest.raises(RuntimeError, match=match):
        _native().per_block_cast_to_fp8(**{**_BLOCK_ARGS, **override})


# ---------------------------------------------------------------------------------------------
# Code generation and NVRTC compilation (no GPU needed)

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CUDA_NAME = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}


@pytest.mark.parametrize("dtype, n, expected_vec", [
    (torch.bfloat16, 7168, 8), (torch.bfloat16, 7172, 4), (torch.bfloat16, 2050, 2),
    (torch.bfloat16, 7001, 1), (torch.float32, 7168, 4), (torch.float32, 2050, 2),
    (torch.float16, 16, 8),
])
def test_code_picks_the_widest_aligned_vector(dtype, n, expected_vec):
    _, code = _native().per_token_cast_to_fp8_code(DTYPE_CODE[dtype], n, 128, False, "sm_90a")
    assert f"<{CUDA_NAME[dtype]}, {n}, 128, false, {expected_vec}, " in code
    _, code = _native().per_block_cast_to_fp8_code(DTYPE_CODE[dtype], n, True, "sm_90a")
    assert f"<{CUDA_NAME[dtype]}, {n}, true, {expected_vec}, " in code


@pytest.mark.parametrize("call, match", [
    (lambda c: c.per_token_cast_to_fp8_code(1, 7168, 128, False, "sm_80"), "sm_89 or newer"),
    (lambda c: c.per_token_cast_to_fp8_code(1, 7168, 128, False, "gfx90a"), "got 'gfx90a'"),
    (lambda c: c.per_token_cast_to_fp8_code(1, 7168, 100, False, "sm_90a"), "gran_k"),
    (lambda c: c.per_token_cast_to_fp8_code(1, 7168, 128, False, "sm_90a", 3), "vec"),
    (lambda c: c.per_token_cast_to_fp8_code(1, 7168, 128, False, "sm_90a", 16), "<= 8"),
    (lambda c: c.per_block_cast_to_fp8_code(0, 7170, False, "sm_90a", 4), "divides .* 7170"),
    (lambda c: c.per_block_cast_to_fp8_code(4, 7168, False, "sm_90a"), "x_dtype"),
])
def test_code_rejects_bad_parameters(call, match):
    with pytest.raises(RuntimeError, match=match):
        call(_native())


@pytest.fixture(scope="module")
def fresh_jit_cache(tmp_path_factory):
    """JIT settings with an empty disk cache and ptxas -v; the environment's settings after."""
    import dataclasses

    from kernels import jit
    settings = dataclasses.replace(jit.resolve_settings(), ptxas_verbose=True,
                                   cache_dir=str(tmp_path_factory.mktemp("jit_cache")))
    jit.configure(settings)
    yield settings
    jit.configure()


COMPILE_VARIANTS = [
    ("per_token", torch.bfloat16, 7168, 128, False),
    ("per_token", torch.bfloat16, 7172, 64, True),
    ("per_token", torch.bfloat16, 2050, 32, False),
    ("per_token", torch.bfloat16, 7001, 128, True),
    ("per_token", torch.float16, 2048, 32, True),
    ("per_token", torch.float16, 4097, 64, False),
    ("per_token", torch.float32, 7168, 128, True),
    ("per_token", torch.float32, 2050, 64, False),
    ("per_token", torch.float32, 33, 32, True),
    ("per_block", torch.bfloat16, 7168, None, False),
    ("per_block", torch.bfloat16, 7001, None, True),
    ("per_block", torch.float16, 2052, None, True),
    ("per_block", torch.float32, 7168, None, False),
    ("per_block", torch.float32, 130, None, True),
]


@pytest.mark.parametrize("variant", COMPILE_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_nvrtc_compiles_without_spills_and_caches(fresh_jit_cache, capfd, variant):
    from kernels import jit
    family, dtype, n, gran_k, use_ue8m0 = variant
    if family == "per_token":
        name, code = _native().per_token_cast_to_fp8_code(DTYPE_CODE[dtype], n, gran_k, use_ue8m0,
                                                          "sm_90a")
    else:
        name, code = _native().per_block_cast_to_fp8_code(DTYPE_CODE[dtype], n, use_ue8m0, "sm_90a")
    first = jit.build(name, code, "sm_90a")
    assert not first.from_cache and first.cubin[:4] == b"\x7fELF"
    report = capfd.readouterr().err
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "bytes stack frame" in report and " 0 bytes stack frame" in report, report
    second = jit.build(name, code, "sm_90a")
    assert second.from_cache and second.memory_hit and second.cubin == first.cubin


# ---------------------------------------------------------------------------------------------
# GPU: bit-exact equality with the CPU reference

def poison_allocator(*nbytes: int, pattern: int = 0xFF) -> None:
    """Make the next allocations of these sizes return memory full of ``pattern``.

    The outputs are allocated inside the functions, so they cannot be filled beforehand. Instead
    the caching allocator is emptied, blocks of the same sizes are allocated, filled (0xFF is NaN
    in E4M3 and in float32) and freed; the allocator then hands the same blocks to the next
    allocations of these sizes on this stream. test_poisoning_reaches_new_allocations checks it.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in nbytes]
    for block in blocks:
        block.fill_(pattern)
    del blocks


def make_input(shape, dtype, row_pad: int, group: tuple[int, int],
               zero_fraction: float = 0.1) -> torch.Tensor:
    """Random CUDA input of ``shape`` whose rows are ``n + row_pad`` elements apart (last dim
    contiguous), with per-row magnitudes over many binades. Some ``group`` = (rows, cols) blocks
    are set to zero and some scaled below the amax floor, edge blocks included."""
    *lead, n = shape
    full = torch.randn(*lead, n + row_pad, device="cuda")
    span = 8 if dtype == torch.float16 else 30  # float16 overflows beyond 2^16
    full *= torch.exp2(torch.randint(-span, span + 1, (*lead, 1), device="cuda").float())
    rows, cols = group
    block_of_row = torch.arange(lead[-1] if lead else 1, device="cuda") // rows
    block_of_col = torch.arange(n, device="cuda") // cols
    pick = torch.rand(*lead[:-1], int(block_of_row[-1]) + 1, int(block_of_col[-1]) + 1,
                      device="cuda")[..., block_of_row[:, None], block_of_col[None, :]]
    body = full[..., :n]
    body[pick < zero_fraction] = 0
    tiny = 1e-3 if dtype == torch.float16 else 1e-9
    body[pick > 1 - zero_fraction / 2] *= tiny
    return full.to(dtype)[..., :n]


@dataclass
class TokenCase:
    m: int
    n: int
    dtype: torch.dtype
    gran_k: int
    use_ue8m0: bool
    row_pad: int = 0

    def __str__(self):
        return (f"{self.m}x{self.n}-{str(self.dtype)[6:]}-g{self.gran_k}-ue8m0{int(self.use_ue8m0)}"
                f"-pad{self.row_pad}")


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOKEN_CASES = [
    TokenCase(1, 128, BF16, 128, False), TokenCase(1, 7168, BF16, 128, True),
    TokenCase(3, 1, FP32, 32, False), TokenCase(7, 33, FP16, 32, True, 5),
    TokenCase(16, 2048, BF16, 64, False), TokenCase(64, 7168, FP16, 128, False),
    TokenCase(128, 7168, BF16, 128, True), TokenCase(129, 4097, BF16, 128, False),
    TokenCase(255, 2050, FP32, 64, True, 2), TokenCase(256, 7172, BF16, 32, False, 4),
    TokenCase(333, 16384, BF16, 128, True), TokenCase(1000, 1000, FP16, 64, True, 24),
    TokenCase(1024, 576, FP32, 128, False), TokenCase(2048, 4096, BF16, 32, True),
    TokenCase(4096, 7168, BF16, 128, False), TokenCase(4096, 7168, BF16, 128, True),
    TokenCase(4097, 257, FP32, 32, False, 3), TokenCase(8192, 2112, FP16, 128, True, 64),
    TokenCase(16384, 512, BF16, 64, False), TokenCase(16384, 4096, BF16, 128, True),
    TokenCase(5, 16384, FP32, 128, True), TokenCase(2, 16383, BF16, 32, False, 1),
    TokenCase(31, 130, BF16, 128, True), TokenCase(100, 8, FP32, 32, False),
]


def assert_bit_exact(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    got_fp8, got_sf = (t.cpu() for t in got)
    want_fp8, want_sf = want
    assert got_fp8.dtype == E4M3 and got_fp8.shape == want_fp8.shape
    assert got_sf.dtype == torch.float32 and got_sf.shape == want_sf.shape
    assert got_fp8.is_contiguous() and got_sf.is_contiguous()
    sf_bad = (got_sf.view(torch.int32) != want_sf.view(torch.int32)).sum().item()
    fp8_bad = (got_fp8.view(torch.uint8) != want_fp8.view(torch.uint8)).sum().item()
    assert sf_bad == 0 and fp8_bad == 0, f"{sf_bad} scales and {fp8_bad} bytes differ"


@pytest.mark.parametrize("case", TOKEN_CASES, ids=str)
@pytest.mark.parametrize("pattern", [0xFF, 0x7F])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_per_token_bit_exact(seed, case, pattern):
    x = make_input((case.m, case.n), case.dtype, case.row_pad, (1, case.gran_k))
    x_before = x.clone()
    want = reference.per_token_cast_to_fp8(x.cpu(), case.use_ue8m0, case.gran_k)
    num_groups = -(-case.n // case.gran_k)
    poison_allocator(case.m * case.n, case.m * num_groups * 4, pattern=pattern)
    got = quant.per_token_cast_to_fp8(x, use_ue8m0=case.use_ue8m0, gran_k=case.gran_k)
    assert_bit_exact(got, want)
    assert torch.equal(x, x_before)


# Every third case, plus single rows and band tails with several groups.
MN_MAJOR_CASES = TOKEN_CASES[::3] + [TokenCase(1, 7168, BF16, 128, True), TokenCase(9, 300, FP32, 64, False),
                                     TokenCase(5, 16384, FP32, 128, True), TokenCase(129, 4097, BF16, 128, False)]


@pytest.mark.parametrize("case", MN_MAJOR_CASES, ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_per_token_mn_major_sf_bit_exact(seed, case):
    """The kernel writing MN-major TMA-aligned scales: the reference's bits at every (row, group),
    in the layout the GEMMs load without a gather, into poisoned memory."""
    x = make_input((case.m, case.n), case.dtype, case.row_pad, (1, case.gran_k))
    want_fp8, want_sf = reference.per_token_cast_to_fp8(x.cpu(), case.use_ue8m0, case.gran_k)
    aligned_m = -(-case.m // 4) * 4
    poison_allocator(case.m * case.n, aligned_m * want_sf.shape[1] * 4)
    got_fp8, got_sf = quant.per_token_cast_to_fp8(x, use_ue8m0=case.use_ue8m0, gran_k=case.gran_k, mn_major_sf=True)
    assert got_sf.shape == want_sf.shape and got_sf.stride() == (1, aligned_m)
    assert torch.equal(got_fp8.cpu().view(torch.uint8), want_fp8.view(torch.uint8))
    assert torch.equal(got_sf.cpu().view(torch.int32), want_sf.view(torch.int32))


@dataclass
class BlockCase:
    shape: tuple[int, ...]
    dtype: torch.dtype
    use_ue8m0: bool
    row_pad: int = 0

    def __str__(self):
        return "x".join(map(str, self.shape)) + f"-{str(self.dtype)[6:]}-ue8m0{int(self.use_ue8m0)}" \
            f"-pad{self.row_pad}"


BLOCK_CASES = [
    BlockCase((128, 128), BF16, False), BlockCase((1, 1), FP32, True),
    BlockCase((256, 7168), BF16, True), BlockCase((7168, 2048), BF16, False),
    BlockCase((200, 300), FP16, True, 4), BlockCase((4, 200, 300), BF16, False),
    BlockCase((3, 129, 4097), FP32, True), BlockCase((8, 512, 7168), BF16, True),
    BlockCase((1000, 1001), BF16, False, 3), BlockCase((130, 257), FP16, True),
    BlockCase((2, 4096, 2048), FP32, False, 16), BlockCase((5, 4096, 7168), FP16, True, 8),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_per_block_bit_exact(seed, case):
    x = make_input(case.shape, case.dtype, case.row_pad, (128, 128))
    if x.dim() == 3:  # a batch stride beyond the rows, too
        x = torch.cat([x, x[:, :1]], dim=1)[:, :-1]
    x_before = x.clone()
    want = reference.per_block_cast_to_fp8(x.cpu(), case.use_ue8m0)
    *lead, n, k = case.shape
    batch = lead[0] if lead else 1
    poison_allocator(x.numel(), batch * -(-n // 128) * -(-k // 128) * 4)
    got = quant.per_block_cast_to_fp8(x, use_ue8m0=case.use_ue8m0)
    assert_bit_exact(got, want)
    assert torch.equal(x, x_before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gran_k", [32, 128])
def test_per_token_checked_path_matches_fast_path(seed, gran_k, monkeypatch):
    """A tensor subclass (nn.Parameter) reaches the kernel through the full checks, a plain tensor
    and a one-column view whose column stride is not 1 (its rows 1 element apart) through the fast
    path (the checks counted): each gives the reference's bits."""
    checks = []
    checked = quant._check_input
    monkeypatch.setattr(quant, "_check_input", lambda *args: checks.append(args[1]) or checked(*args))
    x = make_input((300, 1000), torch.bfloat16, 24, (1, gran_k))
    want = reference.per_token_cast_to_fp8(x.cpu(), False, gran_k)
    assert_bit_exact(quant.per_token_cast_to_fp8(x, gran_k=gran_k), want)
    column = x.t().contiguous().t()[:, :1]
    assert column.stride() == (1, 300)
    assert_bit_exact(quant.per_token_cast_to_fp8(column, gran_k=gran_k),
                     reference.per_token_cast_to_fp8(column.cpu(), False, gran_k))
    assert not checks
    assert_bit_exact(quant.per_token_cast_to_fp8(torch.nn.Parameter(x, requires_grad=False), gran_k=gran_k), want)
    assert len(checks) == 1 and type(checks[0]) is torch.nn.Parameter


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_poisoning_reaches_new_allocations():
    poison_allocator(4096 * 7168, 4096 * 56 * 4)
    out = torch.empty(4096, 7168, dtype=E4M3, device="cuda")
    sf = torch.empty(4096, 56, dtype=torch.float32, device="cuda")
    assert (out.view(torch.uint8) == 0xFF).all() and sf.isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_on_the_current_stream(seed):
    x = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16)
    want = reference.per_token_cast_to_fp8(x.cpu())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = quant.per_token_cast_to_fp8(x)
        got_cpu = tuple(t.to("cpu", non_blocking=True) for t in got)
    stream.synchronize()
    assert_bit_exact(got_cpu, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_empty_inputs_launch_nothing():
    x_fp8, sf = quant.per_token_cast_to_fp8(torch.randn(0, 7168, device="cuda"))
    assert x_fp8.shape == (0, 7168) and sf.shape == (0, 56) and x_fp8.is_cuda
    x_fp8, sf = quant.per_block_cast_to_fp8(torch.randn(2, 0, 300, device="cuda"))
    assert x_fp8.shape == (2, 0, 300) and sf.shape == (2, 0, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_ceil_to_ue8m0_matches_cpu(seed):
    x = torch.exp(torch.empty(1 << 20).uniform_(-80, 80))
    assert torch.equal(quant.ceil_to_ue8m0(x.cuda()).cpu(), quant.ceil_to_ue8m0(x))
