"""The FP4 (E2M1) quantizer references: rounding, scales, packing, batching, errors."""

import math

import pytest
import torch

from kernels.reference.fp4 import cast_back_from_fp4, kE2M1Magnitudes, per_token_cast_to_fp4, unpack_fp4

_kTable = torch.tensor(kE2M1Magnitudes, dtype=torch.float64)


def _naive_codes(v: torch.Tensor) -> torch.Tensor:
    """Nearest magnitude by exhaustive search; ties to the even code; saturate at 6."""
    out = torch.empty(v.shape, dtype=torch.int64)
    for idx, value in enumerate(v.double().flatten().tolist()):
        a = min(abs(value), 6.0)
        dist = (_kTable - a).abs()
        best = dist.min()
        candidates = [i for i in range(8) if dist[i] == best]
        code = candidates[0] if len(candidates) == 1 else next(i for i in candidates if i % 2 == 0)
        out.view(-1)[idx] = code | (8 if math.copysign(1.0, value) < 0 else 0)
    return out


def _codes_of(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()


@pytest.mark.parametrize("value,code", [
    (0.0, 0), (0.25, 0), (0.26, 1), (0.5, 1), (0.75, 2), (1.25, 2), (1.26, 3), (1.75, 4), (2.5, 4),
    (2.51, 5), (3.5, 6), (5.0, 6), (5.01, 7), (6.0, 7), (-0.75, 10), (-6.0, 15), (-0.1, 8),
])
def test_rounding_and_ties_to_even(value, code):
    # amax is pinned at 6 by the last element so that sf = 1 and values are coded unscaled.
    x = torch.tensor([[value, 6.0]], dtype=torch.float32)
    packed, sf = per_token_cast_to_fp4(x, gran_k=2)
    assert sf.item() == 1.0
    assert int(packed[0, 0] & 0xF) == code
    assert int(packed[0, 0] >> 4) == 7


def test_packing_low_nibble_is_even_element():
    x = torch.tensor([[0.5, 1.0, 6.0, -2.0]], dtype=torch.float32)
    packed, _ = per_token_cast_to_fp4(x, gran_k=4)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[(2 << 4) | 1, (12 << 4) | 7]]


@pytest.mark.parametrize("m,n,gran_k", [(7, 64, 32), (3, 96, 32), (5, 48, 32), (4, 256, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_naive_rounding(m, n, gran_k, dtype):
    torch.manual_seed(m * n + gran_k)
    x = (torch.randn(m, n) * torch.logspace(-3, 3, m).unsqueeze(1)).to(dtype)
    packed, sf = per_token_cast_to_fp4(x, gran_k=gran_k)
    assert packed.shape == (m, n // 2) and sf.shape == (m, math.ceil(n / gran_k))
    sf_full = sf.repeat_interleave(gran_k, dim=1)[:, :n]
    assert torch.equal(_codes_of(packed), _naive_codes(x.float() * (1.0 / sf_full)))


@pytest.mark.parametrize("seed", range(3))
def test_ue8m0_scale_is_exact_power_of_two_ceiling(seed):
    torch.manual_seed(seed)
    amax = torch.rand(64, dtype=torch.float64) * 100 + 1e-3
    # Exact powers of two times 6 must give exactly that power, not the next one.
    amax[:8] = 6.0 * torch.pow(2.0, torch.arange(-4, 4, dtype=torch.float64))
    x = torch.zeros(64, 32, dtype=torch.float32)
    x[:, 5] = -amax.float()
    _, sf = per_token_cast_to_fp4(x, gran_k=32)
    expected = torch.pow(2.0, torch.ceil(torch.log2(amax.float().double() / 6.0)))
    assert torch.equal(sf[:, 0].double(), expected)


def test_amax_floor_and_non_ue8m0_scale():
    x = torch.zeros(2, 32)
    x[1, 3] = 3.0
    _, sf = per_token_cast_to_fp4(x, use_ue8m0=True)
    assert sf[0, 0].item() == 2.0 ** math.ceil(math.log2(1e-4 / 6))
    _, sf_plain = per_token_cast_to_fp4(x, use_ue8m0=False)
    assert sf_plain[1, 0].item() == pytest.approx(0.5, rel=1e-7)


@pytest.mark.parametrize("use_ue8m0", [True, False])
def test_cast_back_error_bound(use_ue8m0):
    torch.manual_seed(1)
    x = torch.randn(16, 128)
    packed, sf = per_token_cast_to_fp4(x, use_ue8m0=use_ue8m0)
    back = cast_back_from_fp4(packed, sf)
    assert back.dtype == torch.float32 and back.shape == x.shape
    # The widest gap between E2M1 magnitudes is 2 (4 -> 6): half of it, times the scale.
    assert bool(((back - x).abs() <= sf.repeat_interleave(32, dim=1) * 1.0 + 1e-7).all())
    assert torch.equal(unpack_fp4(packed) * sf.repeat_interleave(32, dim=1), back)


def test_batched_equals_per_slice():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    packed, sf = per_token_cast_to_fp4(x)
    assert packed.shape == (3, 5, 32) and sf.shape == (3, 5, 2)
    for g in range(3):
        p, s = per_token_cast_to_fp4(x[g])
        assert torch.equal(packed[g], p) and torch.equal(sf[g], s)
    assert torch.equal(cast_back_from_fp4(packed, sf)[1], cast_back_from_fp4(packed[1], sf[1]))


def test_errors():
    with pytest.raises(ValueError, match="even"):
        per_token_cast_to_fp4(torch.randn(2, 33))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        per_token_cast_to_fp4(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="gran_k"):
        per_token_cast_to_fp4(torch.randn(2, 32), gran_k=0)
    packed, sf = per_token_cast_to_fp4(torch.randn(2, 64))
    with pytest.raises(ValueError, match="sf must have shape"):
        cast_back_from_fp4(packed, sf[:, :1])
    with pytest.raises(TypeError, match="uint8"):
        cast_back_from_fp4(packed.to(torch.int16), sf)
