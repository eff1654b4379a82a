"""The v2 FP4 decode layout (kernels/_fp4_fragment.py): the integer decode of every thread's words
gives the E4M3 bytes of E2M1 x 2^-6 at the wgmma A-fragment positions, each 64-row block carries its
rows' UE8M0 bytes (CPU); the decode kernel on that layout against the reference (GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import _fp4_fragment as frag
from kernels.reference.fp4 import unpack_fp4


def _words(layout: torch.Tensor) -> torch.Tensor:
    b = layout.to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _bytes(word: torch.Tensor) -> torch.Tensor:
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)


def _random_sf(g: int, n: int, k: int) -> torch.Tensor:
    return torch.randint(100, 150, (g, n, k // 32), dtype=torch.uint8)


def _fragments(layout: torch.Tensor) -> torch.Tensor:
    return layout[..., :frag.kWeightBytes].reshape(*layout.shape[:3], 2, 128, 4, 4)


@pytest.mark.parametrize("g,n,k", [(1, 64, 128), (2, 100, 256), (3, 136, 384)])
def test_decoded_fragments_are_e4m3_of_e2m1_times_2_to_minus_6(g, n, k, seed):
    packed = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8)
    layout = frag.transform_fp4_for_decode(packed, _random_sf(g, n, k))
    nb = (n + 63) // 64
    assert layout.shape == (g, k // 128, nb, 4352)
    a0, a2 = frag.decode_words(_words(_fragments(layout)))
    values = torch.zeros(g, nb * 64, k)
    values[:, :n] = unpack_fp4(packed)
    expected = (values * 2.0 ** -6).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(expected.view(torch.float8_e4m3fn).float() * 64, values), "E2M1 x 2^-6 is exact in E4M3"
    for t in (0, 5, 37, 127):
        w, lane = t // 32, t % 32
        q = lane % 4
        for h in (0, 1):
            row = 16 * w + lane // 4 + 8 * h
            for kb in range(k // 128):
                for s in range(4):
                    for rb in range(nb):
                        k0 = kb * 128 + 32 * s + 4 * q
                        want_a0 = expected[:, rb * 64 + row, k0:k0 + 4]
                        want_a2 = expected[:, rb * 64 + row, k0 + 16:k0 + 20]
                        assert torch.equal(_bytes(a0[:, kb, rb, h, t, s]), want_a0), (t, h, kb, s, rb)
                        assert torch.equal(_bytes(a2[:, kb, rb, h, t, s]), want_a2), (t, h, kb, s, rb)


@pytest.mark.parametrize("form", ["uint8", "e8m0", "float32"])
@pytest.mark.parametrize("g,n,k", [(1, 64, 128), (2, 100, 384)])
def test_blocks_carry_their_rows_scales(g, n, k, form, seed):
    sf = _random_sf(g, n, k)
    given = {"uint8": sf, "e8m0": sf.view(torch.float8_e8m0fnu), "float32": sf.view(torch.float8_e8m0fnu).float()}[form]
    layout = frag.transform_fp4_for_decode(torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8), given)
    scales = layout[..., frag.kWeightBytes:].reshape(*layout.shape[:3], 64, 4)
    nb = (n + 63) // 64
    padded = torch.zeros(g, nb * 64, k // 32, dtype=torch.uint8)
    padded[:, :n] = sf
    for kb in range(k // 128):
        for rb in range(nb):
            assert torch.equal(scales[:, kb, rb], padded[:, rb * 64:(rb + 1) * 64, 4 * kb:4 * kb + 4]), (kb, rb)


def test_rows_past_n_are_zero():
    packed = torch.full((1, 10, 64), 0x77, dtype=torch.uint8)
    layout = frag.transform_fp4_for_decode(packed, _random_sf(1, 10, 128))
    assert not layout[0, 0, 0, frag.kWeightBytes + 40:].any(), "scales of rows past N"
    a0, a2 = frag.decode_words(_words(_fragments(layout)))
    rows = torch.zeros(64, dtype=torch.bool)
    rows[:10] = True
    for t in range(128):
        for h in (0, 1):
            row = 16 * (t // 32) + (t % 32) // 4 + 8 * h
            assert bool((a0[0, 0, 0, h, t] != 0).all()) == bool(rows[row])


@pytest.mark.parametrize("packed,sf,match", [
    (torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 64, 4, dtype=torch.uint8), r"\[G, N, K/2\]"),
    (torch.zeros(1, 64, 32, dtype=torch.uint8), torch.zeros(1, 64, 2, dtype=torch.uint8), "multiple of 128"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8), torch.zeros(1, 64, 2, dtype=torch.uint8),
     r"transform_fp4_for_decode: sf must have shape \[1, 64, 4\]"),
    (torch.zeros(1, 64, 0, dtype=torch.uint8), torch.zeros(1, 64, 0), "K must be a positive multiple of 128, got 0"),
    (torch.zeros(1, 0, 64, dtype=torch.uint8), torch.zeros(1, 0, 4), r"N \(packed's rows per group\) must be >= 1"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8, device="meta"), torch.ones(1, 64, 4, device="meta"),
     "packed and sf must be on one CPU or CUDA device, got meta and meta"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8), torch.ones(1, 64, 4, device="meta"),
     "packed and sf must be on one CPU or CUDA device, got cpu and meta"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8).to_sparse(), torch.ones(1, 64, 4),
     "packed must be a dense \\(strided\\) tensor"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8), torch.ones(1, 64, 4).to_sparse(),
     "transform_fp4_for_decode: sf must be a dense \\(strided\\) tensor"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8), torch.full((1, 64, 4), 0.75),
     "transform_fp4_for_decode: sf must hold positive normal powers of two"),
    # Lazily negated views (the negative bit): refused by name, as the GEMMs' kernels would read their memory.
    (torch._neg_view(torch.zeros(1, 64, 64, dtype=torch.uint8)), torch.ones(1, 64, 4),
     "transform_fp4_for_decode: packed must not be a lazily negated view"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8), torch._neg_view(torch.full((1, 64, 4), 127, dtype=torch.uint8)),
     "transform_fp4_for_decode: sf must not be a lazily negated view"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8),
     torch._neg_view(torch.full((1, 64, 4), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)),
     "transform_fp4_for_decode: sf must not be a lazily negated view"),
    (torch.zeros(1, 64, 64, dtype=torch.uint8), torch._neg_view(torch.ones(1, 64, 4)),  # shows -1: resolved, refused
     "transform_fp4_for_decode: sf must hold positive normal powers of two"),
])
def test_bad_input(packed, sf, match):
    with pytest.raises((ValueError, TypeError), match=match):
        frag.transform_fp4_for_decode(packed, sf)


@pytest.mark.parametrize("g,n,k", [(1, 64, 128), (2, 100, 384), (3, 136, 256)])
def test_from_fragment_layout_inverts_the_transform(g, n, k, seed):
    packed = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8)
    sf = _random_sf(g, n, k)
    back_packed, back_sf = frag.from_fragment_layout(frag.transform_fp4_for_decode(packed, sf), n)
    assert torch.equal(back_packed, packed) and torch.equal(back_sf, sf)


def _masked_problem(masked, max_m, n, k, device):
    import kernels
    g = len(masked)
    packed, sf = kernels.per_token_cast_to_fp4(torch.randn(g, n, k, device=device, dtype=torch.bfloat16))
    a, sfa = kernels.per_token_cast_to_fp8(torch.randn(g * max_m, k, device=device, dtype=torch.bfloat16))
    a = (a.view(g, max_m, k), sfa.view(g, max_m, -1))
    masked_m = torch.tensor(masked, device=device, dtype=torch.int32)
    d = torch.full((g, max_m, n), float("nan"), device=device, dtype=torch.bfloat16)
    return a, packed, sf, masked_m, d


def test_cpu_decode_layout_runs_the_reference_on_the_same_weights(seed):
    import kernels
    a, packed, sf, masked_m, d = _masked_problem([3, 0, 5], 6, 104, 256, "cpu")
    kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, kernels.transform_fp4_for_decode(packed, sf), d, masked_m, 4)
    want = torch.full_like(d, float("nan"))
    kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, (packed, sf), want, masked_m, 4)
    for i, count in enumerate(masked_m.tolist()):
        assert torch.equal(d[i, :count], want[i, :count]), i


def test_decode_layout_bad_input():
    import kernels
    a, packed, sf, masked_m, d = _masked_problem([2], 4, 64, 128, "cpu")
    with pytest.raises(ValueError, match="from transform_fp4_for_decode"):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, packed, d, masked_m, 2)
    with pytest.raises(ValueError, match=r"b \(decode layout\) must be contiguous uint8 \[1, 1, 1, 4352\]"):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, kernels.transform_fp4_for_decode(packed, sf)[..., :4096], d,
                                                 masked_m, 2)
    with pytest.raises(ValueError, match=r"m_grouped_fp8_fp4_gemm_nt_masked: b \(decode layout\) must not be a lazily "
                                         r"negated view"):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, torch._neg_view(kernels.transform_fp4_for_decode(packed, sf)), d,
                                                 masked_m, 2)
    # N comes from d: an empty one is named as N, not as a decode layout of 0 row blocks.
    with pytest.raises(ValueError, match="m_grouped_fp8_fp4_gemm_nt_masked: N must be a positive multiple of 8, got 0"):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, kernels.transform_fp4_for_decode(packed, sf), d[..., :0],
                                                 masked_m, 2)


# ---- the decode kernel on the fragment layout (GPU) -------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("masked,max_m,expected_m,n,k", [
    ([20] * 32, 32, 20, 4096, 7168), ([1] * 256, 8, 1, 136, 384), ([0, 3, 16, 9], 16, 8, 7168, 2048),
    ([37], 50, 4, 24, 256), ([0, 0], 8, 8, 64, 128), ([32, 7, 32], 32, 32, 200, 512),
])
def test_gpu_decode_layout_against_the_reference(masked, max_m, expected_m, n, k, seed):
    import kernels
    from kernels.reference.gemm import dequantize_a
    from kernels.testing.numeric import calc_diff
    a, packed, sf, masked_m, d = _masked_problem(masked, max_m, n, k, "cuda")
    kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, kernels.transform_fp4_for_decode(packed, sf), d, masked_m,
                                             expected_m)
    weights = kernels.cast_back_from_fp4(packed, sf).double()
    for i, count in enumerate(masked):
        if count:
            lhs = dequantize_a(a[0][i, :count], a[1][i, :count]).double()
            got = d[i, :count]
            assert torch.isfinite(got).all(), f"group {i}: rows not fully written"
            assert calc_diff(got, lhs @ weights[i].t()) < 2e-3, i
        # Stored in boxes of 8 token rows up to masked_m: the rows from the next multiple of 8 stay as they were.
        assert torch.isnan(d[i, -(-count // 8) * 8:]).all(), f"group {i}: rows past masked_m written"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_layout_refuses_large_batches():
    import kernels
    a, packed, sf, masked_m, d = _masked_problem([40], 64, 64, 128, "cuda")
    with pytest.raises(ValueError, match="<= 32 rows per group, got 40"):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, kernels.transform_fp4_for_decode(packed, sf), d, masked_m, 40)
