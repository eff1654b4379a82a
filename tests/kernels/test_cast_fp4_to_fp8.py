"""kernels.cast_fp4_to_fp8_blocks (FP4 weights -> FP8 weights with 128 x 128 block scales, the staged
FP8 x FP4 path's first step): the reference against a float64 decoding of the nibbles (exact within
2^14 of a block's largest scale, one rounding step below), argument checks, and CUDA == reference
bit for bit on fresh random weights with odd N, strided rows and deep groups (GPU)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.reference import fp4 as reference

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
E2M1 = torch.tensor(reference.kE2M1Magnitudes, dtype=torch.float64)


def make_weights(g: int, n: int, k: int, device: str, deep: tuple[int, ...] = ()):
    """(packed uint8 [g, n, k/2], exponent bytes uint8 [g, n, k/32]) from random weights; each shift
    in ``deep`` moves one random group that far below its block's largest exponent."""
    packed, sf = kernels.per_token_cast_to_fp4(torch.randn(g, n, k, device=device))
    exps = kernels.transform_sf_for_fp4_gemm(sf)
    for shift in deep:
        gi, row, col = (int(torch.randint(0, size, ())) for size in (g, n, k // 32))
        top = exps[gi, row // 128 * 128:row // 128 * 128 + 128, col // 4 * 4:col // 4 * 4 + 4].max()
        exps[gi, row, col] = max(1, int(top) - shift)
    return packed.view(torch.uint8), exps


def decode(packed: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """float64 weights straight from the nibbles and exponent bytes."""
    b = packed.long().cpu()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    values = E2M1[codes & 7] * (1 - 2 * (codes >> 3)).double()
    return values * torch.exp2(exps.cpu().double() - 127).repeat_interleave(32, dim=-1)


def expand_blocks(sf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return sf.cpu().double().repeat_interleave(128, dim=1)[:, :n].repeat_interleave(128, dim=2)[:, :, :k]


CASES = [(1, 8, 128), (3, 136, 384), (2, 200, 256), (1, 576, 1024)]  # (g, n, k)


@pytest.mark.parametrize("g,n,k", CASES, ids=str)
@pytest.mark.parametrize("deep", [(), (8, 11, 12, 14), (15, 20, 40)], ids=str)
def test_reference_matches_the_weights(seed, g, n, k, deep):
    """Exact where every group lies within 2^14 of its block's largest scale; a deeper group is off
    by at most half of E4M3's subnormal step, 2^-10 of the block scale times 2^6."""
    packed, exps = make_weights(g, n, k, "cpu", deep)
    b8, sf = kernels.cast_fp4_to_fp8_blocks((packed, exps))
    assert b8.dtype == E4M3 and b8.shape == (g, n, k) and b8.is_contiguous()
    assert sf.dtype == torch.float32 and sf.shape == (g, -(-n // 128), k // 128)
    got = b8.double() * expand_blocks(sf, n, k)
    want = decode(packed, exps)
    err = (got - want).abs()
    bound = expand_blocks(sf, n, k) * 2.0 ** -10
    assert (err <= bound).all()
    if not any(shift > reference.MAX_EXACT_STAGED_SHIFT for shift in deep):
        assert torch.equal(got, want)


def test_block_scale_is_the_largest_group_scale_over_64(seed):
    packed, exps = make_weights(2, 136, 256, "cpu")
    _, sf = kernels.cast_fp4_to_fp8_blocks((packed, exps))
    padded = torch.zeros(2, 256, 8, dtype=torch.int32)
    padded[:, :136] = exps.int()
    top = padded.view(2, 2, 128, 2, 4).amax(dim=(2, 4))
    assert torch.equal(sf, torch.exp2(top.float() - 127 - 6))


@pytest.mark.parametrize("form", ["uint8", "e8m0", "float32"])
def test_scale_forms_agree(seed, form):
    packed, exps = make_weights(2, 24, 256, "cpu", deep=(13,))
    sfb = {"uint8": exps, "e8m0": exps.view(E8M0), "float32": exps.view(E8M0).float()}[form]
    got = kernels.cast_fp4_to_fp8_blocks((packed.view(torch.int8), sfb))
    want = reference.cast_fp4_to_fp8_blocks(packed, exps)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("b,error,match", [
    (torch.zeros(2, 8, 64, dtype=torch.uint8), TypeError, "pair"),
    ((torch.zeros(2, 8, 64), torch.zeros(2, 8, 4, dtype=torch.uint8)), TypeError, "int8 or uint8"),
    ((torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 4, dtype=torch.uint8)), ValueError, r"\[G, N, K/2\]"),
    ((torch.zeros(2, 8, 96, dtype=torch.uint8), torch.zeros(2, 8, 6, dtype=torch.uint8)), ValueError,
     "multiple of 128"),
    ((torch.zeros(2, 12, 64, dtype=torch.uint8), torch.zeros(2, 12, 4, dtype=torch.uint8)), ValueError,
     "multiple of 8"),
    ((torch.zeros(2, 8, 64, dtype=torch.uint8), torch.zeros(2, 8, 3, dtype=torch.uint8)), ValueError, "shape"),
    ((torch.zeros(2, 8, 64, dtype=torch.uint8), torch.full((2, 8, 4), 255, dtype=torch.uint8)), ValueError,
     "bytes 0 or 255"),
    # Lazily negated views (the negative bit): the CUDA kernel would read their memory, not the values shown.
    ((torch._neg_view(torch.zeros(2, 8, 64, dtype=torch.uint8)), torch.full((2, 8, 4), 127, dtype=torch.uint8)),
     ValueError, r"cast_fp4_to_fp8_blocks: b\[0\] \(B\) must not be a lazily negated view"),
    ((torch.zeros(2, 8, 64, dtype=torch.uint8), torch._neg_view(torch.full((2, 8, 4), 127, dtype=torch.uint8))),
     ValueError, r"cast_fp4_to_fp8_blocks: b\[1\] \(SFB\) must not be a lazily negated view"),
    ((torch.zeros(2, 8, 64, dtype=torch.uint8),
      torch._neg_view(torch.full((2, 8, 4), 127, dtype=torch.uint8).view(E8M0))),
     ValueError, r"cast_fp4_to_fp8_blocks: b\[1\] \(SFB\) must not be a lazily negated view"),
])
def test_bad_arguments(b, error, match):
    with pytest.raises(error, match=match):
        kernels.cast_fp4_to_fp8_blocks(b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("g,n,k", CASES + [(4, 4096, 7168)], ids=str)
@pytest.mark.parametrize("deep", [(), (8, 11, 12, 14, 15, 20, 40)], ids=str)
@pytest.mark.parametrize("row_pad", [0, 16])
def test_gpu_matches_reference_bit_for_bit(seed, g, n, k, deep, row_pad):
    packed, exps = make_weights(g, n, k, "cuda", deep)
    if row_pad:  # rows further apart than K/2 bytes
        wide = torch.randint(0, 256, (g, n, k // 2 + row_pad), dtype=torch.uint8, device="cuda")
        wide[..., :k // 2] = packed
        packed = wide[..., :k // 2]
    # Poison what the outputs will be allocated from: every byte must be written.
    poison = torch.full((g * n * k + 4096,), 0x7F, dtype=torch.uint8, device="cuda")
    del poison
    b8, sf = kernels.cast_fp4_to_fp8_blocks((packed, exps))
    want = reference.cast_fp4_to_fp8_blocks(packed.cpu(), exps.cpu())
    assert torch.equal(b8.view(torch.uint8).cpu(), want[0].view(torch.uint8))
    assert torch.equal(sf.cpu(), want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_misaligned_rows_are_refused():
    packed = torch.zeros(2 * 8 * 64 + 16, dtype=torch.uint8, device="cuda")[8:-8].view(2, 8, 64)
    exps = torch.full((2, 8, 4), 127, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="16-byte aligned"):
        kernels.cast_fp4_to_fp8_blocks((packed, exps))
