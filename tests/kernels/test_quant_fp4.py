"""The public FP4 (E2M1) weight quantizers kernels.per_token_cast_to_fp4 / cast_back_from_fp4 and
kernels.transform_sf_for_fp4_gemm: bit-exact with the references of kernels/reference/fp4.py,
UE8M0 scales, nearest-value decoding, round trip, argument checks; CUDA == CPU bit for bit (GPU)."""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels.reference import fp4 as reference

E2M1 = torch.tensor(reference.kE2M1Magnitudes, dtype=torch.float64)

SHAPES = [  # (shape, gran_k): odd m, batched, n not a multiple of gran_k, other granularities
    ((7, 64), 32), ((1, 2), 32), ((13, 96), 32), ((5, 50), 32), ((3, 9, 160), 32), ((2, 3, 4, 70), 32),
    ((33, 256), 16), ((4, 200), 128), ((6, 30), 4),
]


def make_input(shape, dtype, device="cpu") -> torch.Tensor:
    """Random rows over 12 binades, with a few exact zeros and one all-zero row."""
    x = torch.randn(shape, device=device) * torch.logspace(-4, 4, shape[-2], base=2.0, device=device).unsqueeze(1)
    x[..., ::7] = 0
    x[..., -1, :] = 0
    return x.to(dtype)


def decode(packed: torch.Tensor, sf: torch.Tensor, gran_k: int) -> torch.Tensor:
    """float64 values straight from the nibbles, without the reference's helpers."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    values = E2M1[codes & 7] * (1 - 2 * (codes >> 3)).double()
    return values * sf.double().repeat_interleave(gran_k, dim=-1)[..., :values.shape[-1]]


def full_scales(sf: torch.Tensor, gran_k: int, n: int) -> torch.Tensor:
    return sf.double().repeat_interleave(gran_k, dim=-1)[..., :n]


@pytest.mark.parametrize("use_ue8m0", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,gran_k", SHAPES, ids=str)
def test_matches_reference_bit_for_bit(seed, shape, gran_k, dtype, use_ue8m0):
    x = make_input(shape, dtype)
    packed, sf = kernels.per_token_cast_to_fp4(x, use_ue8m0=use_ue8m0, gran_k=gran_k)
    want_packed, want_sf = reference.per_token_cast_to_fp4(x, use_ue8m0, gran_k)
    *lead, n = shape
    assert packed.dtype == torch.int8 and sf.dtype == torch.float32
    assert packed.shape == (*lead, n // 2) and sf.shape == (*lead, math.ceil(n / gran_k))
    assert packed.is_contiguous() and sf.is_contiguous()
    assert torch.equal(packed.view(torch.uint8), want_packed)
    assert torch.equal(sf.view(torch.int32), want_sf.view(torch.int32))
    back = kernels.cast_back_from_fp4(packed, sf, gran_k)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert torch.equal(back, reference.cast_back_from_fp4(want_packed, want_sf, gran_k))
    assert torch.equal(kernels.cast_back_from_fp4(packed.view(torch.uint8), sf, gran_k), back)


@pytest.mark.parametrize("shape,gran_k", SHAPES, ids=str)
def test_scales_are_power_of_two_ceilings(seed, shape, gran_k):
    x = make_input(shape, torch.float32)
    _, sf = kernels.per_token_cast_to_fp4(x, gran_k=gran_k)
    *lead, n = shape
    groups = math.ceil(n / gran_k)
    padded = torch.zeros(*lead, groups * gran_k, dtype=torch.float64)
    padded[..., :n] = x.double()
    amax = padded.view(*lead, groups, gran_k).abs().amax(-1)
    # amax / 6 in float32 first (the reference's division), then the power-of-two ceiling.
    quotient = (amax.float().clamp(min=1e-4) / torch.tensor(6.0)).double()
    assert torch.equal(sf.double(), torch.pow(2.0, torch.ceil(torch.log2(quotient))))
    assert torch.equal(sf.double(), torch.pow(2.0, torch.ceil(torch.log2(amax.clamp(min=1e-4) / 6))))


@pytest.mark.parametrize("shape,gran_k", SHAPES, ids=str)
def test_values_decode_to_the_nearest_e2m1_value(seed, shape, gran_k):
    x = make_input(shape, torch.bfloat16)
    packed, sf = kernels.per_token_cast_to_fp4(x, gran_k=gran_k)
    n = shape[-1]
    scale = full_scales(sf, gran_k, n)
    got = decode(packed, sf, gran_k)
    # Distance to the nearest representable value sf * {0, +-.5, ..., +-6} (no saturation with
    # UE8M0: |x| / sf <= 6). The chosen value is at that distance, with the sign of x.
    candidates = E2M1 * scale.unsqueeze(-1)
    best = (x.double().abs().unsqueeze(-1) - candidates).abs().amin(-1)
    assert torch.equal((got.abs() - x.double().abs()).abs(), best)
    assert bool(((got == 0) | (torch.sign(got) == torch.sign(x.double()))).all())
    assert bool((x.double().abs() <= 6 * scale).all())


@pytest.mark.parametrize("use_ue8m0", [True, False])
def test_round_trip_error_bound(seed, use_ue8m0):
    x = make_input((3, 17, 256), torch.float32)
    packed, sf = kernels.per_token_cast_to_fp4(x, use_ue8m0=use_ue8m0)
    back = kernels.cast_back_from_fp4(packed, sf)
    scale = full_scales(sf, 32, 256)
    err = (back.double() - x.double()).abs()
    # Half the widest gap between E2M1 magnitudes (4 -> 6), times the scale; and from the
    # smallest nonzero magnitude 0.5 up, at most a third of the value (0.75 -> 1 is the worst).
    assert bool((err <= scale).all())
    big = x.double().abs() >= 0.5 * scale
    assert bool((err[big] <= x.double().abs()[big] / 3 + 1e-12).all())


def test_hand_example():
    x = torch.tensor([[0.5, 1.0, 6.0, -2.0, 0.2, -0.3, 3.2, 0.0] + [0.0] * 24], dtype=torch.float32)
    packed, sf = kernels.per_token_cast_to_fp4(x)
    assert sf.tolist() == [[1.0]]
    # codes: .5 = 1, 1 = 2, 6 = 7, -2 = 12, .2 -> 0, -.3 -> -.5 = 9, 3.2 -> 3 = 5, 0 = 0
    assert packed.view(torch.uint8)[0, :4].tolist() == [0x21, 0xC7, 0x90, 0x05]
    assert packed[0, 1].item() == 0xC7 - 256  # int8 view of the same byte


def test_empty_rows():
    packed, sf = kernels.per_token_cast_to_fp4(torch.randn(0, 64))
    assert packed.shape == (0, 32) and sf.shape == (0, 2) and packed.dtype == torch.int8
    packed, sf = kernels.per_token_cast_to_fp4(torch.randn(2, 0, 100))
    assert packed.shape == (2, 0, 50) and sf.shape == (2, 0, 4)
    assert kernels.cast_back_from_fp4(packed, sf).shape == (2, 0, 100)


def test_non_contiguous_input(seed):
    x = torch.randn(64, 40, dtype=torch.bfloat16).t()  # [40, 64], column-major
    packed, sf = kernels.per_token_cast_to_fp4(x)
    want_packed, want_sf = reference.per_token_cast_to_fp4(x.contiguous())
    assert torch.equal(packed.view(torch.uint8), want_packed) and torch.equal(sf, want_sf)


def test_transform_sf_for_fp4_gemm(seed):
    exponents = torch.randint(-40, 20, (3, 16, 8))
    sf = torch.pow(2.0, exponents.double()).float()
    got = kernels.transform_sf_for_fp4_gemm(sf)
    assert got.dtype == torch.uint8 and got.shape == sf.shape and got.is_contiguous()
    assert torch.equal(got.long(), exponents + 127)
    assert torch.equal(got.view(torch.float8_e8m0fnu).float(), sf)
    strided = sf.transpose(1, 2)
    assert torch.equal(kernels.transform_sf_for_fp4_gemm(strided), got.transpose(1, 2))
    _, sf_q = kernels.per_token_cast_to_fp4(torch.randn(2, 8, 256))
    assert torch.equal(kernels.transform_sf_for_fp4_gemm(sf_q).view(torch.float8_e8m0fnu).float(), sf_q)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_negated_views_give_the_values_they_show(seed, dtype):
    """Lazily negated views (the negative bit, as conj().imag sets) of the input, the packed codes or
    the scales: these functions run torch ops on the values shown, as on the resolved tensors."""
    x = torch.randn(3, 8, 64)
    packed, sf = kernels.per_token_cast_to_fp4(x)
    packed = packed.view(dtype)
    got = kernels.per_token_cast_to_fp4(torch._neg_view(-x))
    assert torch.equal(got[0], packed.view(torch.int8)) and torch.equal(got[1], sf)
    want = kernels.cast_back_from_fp4(packed, sf)
    assert torch.equal(kernels.cast_back_from_fp4(torch._neg_view(packed.neg()), sf), want)
    assert torch.equal(kernels.cast_back_from_fp4(packed, torch._neg_view(-sf)), want)
    assert torch.equal(kernels.transform_sf_for_fp4_gemm(torch._neg_view(-sf)), kernels.transform_sf_for_fp4_gemm(sf))


@pytest.mark.parametrize("value", [0.75, 0.0, -0.0, -2.0, float("inf"), float("nan"), 2.0 ** -127, 2.0 ** -149])
def test_transform_sf_rejects_non_powers_of_two(value):
    sf = torch.ones(2, 4, 4)
    sf[1, 2, 3] = value
    with pytest.raises(ValueError, match="transform_sf_for_fp4_gemm: sf must hold positive normal powers of two"):
        kernels.transform_sf_for_fp4_gemm(sf)


@pytest.mark.parametrize("call,error,match", [
    (lambda: kernels.per_token_cast_to_fp4([[1.0, 2.0]]), TypeError, "x must be a torch.Tensor"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32, dtype=torch.int32)), TypeError,
     "x must be bfloat16, float16 or float32"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32, dtype=torch.float64)), TypeError, "got torch.float64"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(32)), ValueError, "x must have >= 2 dims"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 33)), ValueError, "positive and even"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 0)), ValueError, "positive and even"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32), gran_k=0), ValueError, "gran_k must be a positive even"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32), gran_k=3), ValueError, "gran_k"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32), gran_k=32.0), ValueError, "gran_k"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32), gran_k=True), ValueError, "gran_k"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32), use_ue8m0=1), TypeError, "use_ue8m0 must be a bool"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32, device="meta")), ValueError, "CPU or CUDA"),
    (lambda: kernels.cast_back_from_fp4(torch.ones(2, 16), torch.ones(2, 1)), TypeError,
     "packed must be an int8 or uint8 tensor"),
    (lambda: kernels.cast_back_from_fp4(torch.zeros(16, dtype=torch.int8), torch.ones(1)), ValueError,
     "packed must have >= 2 dims"),
    (lambda: kernels.cast_back_from_fp4(torch.zeros(2, 16, dtype=torch.int8), torch.ones(2, 1, dtype=torch.float64)),
     TypeError, "sf must be a float32 tensor"),
    (lambda: kernels.cast_back_from_fp4(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1)), ValueError,
     r"sf must have shape \[2, 2\]"),
    (lambda: kernels.cast_back_from_fp4(torch.zeros(2, 16, dtype=torch.int8), torch.ones(2, 1), gran_k=-2),
     ValueError, "gran_k"),
    (lambda: kernels.transform_sf_for_fp4_gemm(torch.ones(2, 4, dtype=torch.uint8)), TypeError,
     "sf must be a float32 tensor"),
    (lambda: kernels.per_token_cast_to_fp4(torch.ones(2, 32).to_sparse()), ValueError,
     "per_token_cast_to_fp4: x must be a dense .*sparse_coo"),
    (lambda: kernels.cast_back_from_fp4(torch.zeros(2, 16, dtype=torch.int8).to_sparse(), torch.ones(2, 1)),
     ValueError, "cast_back_from_fp4: packed must be a dense .*sparse_coo"),
    (lambda: kernels.cast_back_from_fp4(torch.zeros(2, 16, dtype=torch.int8), torch.ones(2, 1).to_sparse()),
     ValueError, "cast_back_from_fp4: sf must be a dense .*sparse_coo"),
    (lambda: kernels.transform_sf_for_fp4_gemm(torch.ones(2, 4).to_sparse()), ValueError,
     "transform_sf_for_fp4_gemm: sf must be a dense .*sparse_coo"),
    # A lazily negated view shows -1: named as a value that is not a positive power of two.
    (lambda: kernels.transform_sf_for_fp4_gemm(torch._neg_view(torch.ones(2, 4))), ValueError,
     "transform_sf_for_fp4_gemm: sf must hold positive normal powers of two .* e.g. -1.0"),
])
def test_bad_arguments_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---- GPU ----------------------------------------------------------------------------------------

GPU_SHAPES = SHAPES + [((7168, 2048), 32), ((4, 576, 7168), 32), ((129, 4098), 32)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("use_ue8m0", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,gran_k", GPU_SHAPES, ids=str)
def test_gpu_equals_cpu_bit_for_bit(seed, shape, gran_k, dtype, use_ue8m0):
    x = make_input(shape, dtype, device="cuda")
    x_before = x.clone()
    packed, sf = kernels.per_token_cast_to_fp4(x, use_ue8m0=use_ue8m0, gran_k=gran_k)
    assert packed.is_cuda and sf.is_cuda and packed.dtype == torch.int8 and sf.dtype == torch.float32
    want_packed, want_sf = kernels.per_token_cast_to_fp4(x.cpu(), use_ue8m0=use_ue8m0, gran_k=gran_k)
    sf_bad = (sf.cpu().view(torch.int32) != want_sf.view(torch.int32)).sum().item()
    packed_bad = (packed.cpu() != want_packed).sum().item()
    assert sf_bad == 0 and packed_bad == 0, f"{sf_bad} scales and {packed_bad} bytes differ"
    assert torch.equal(x, x_before)
    back = kernels.cast_back_from_fp4(packed, sf, gran_k)
    assert back.is_cuda and torch.equal(back.cpu(), kernels.cast_back_from_fp4(want_packed, want_sf, gran_k))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_transform_sf_matches_cpu(seed):
    _, sf = kernels.per_token_cast_to_fp4(torch.randn(4, 512, 1024, device="cuda"))
    got = kernels.transform_sf_for_fp4_gemm(sf)
    assert got.is_cuda and torch.equal(got.cpu(), kernels.transform_sf_for_fp4_gemm(sf.cpu()))
    sf[1, 2, 3] = 0.3
    with pytest.raises(ValueError, match="powers of two"):
        kernels.transform_sf_for_fp4_gemm(sf)
