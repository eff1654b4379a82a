"""m_grouped_fp8_fp4_gemm_nt_contiguous / _masked (FP8 activations x FP4 weights): CPU reference
and argument checks, the three SFB forms, and the kernels against a float64 computation on the
dequantized weights (GPU), including the edge cases of the MoE layouts."""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from grouped_fp4_cases import (E4M3, E8M0, SF_FORMS, TOLERANCE, check_contiguous, check_masked, contiguous_rows,
                               expected_contiguous, make_contiguous, make_weights, weights_of)
from kernels.reference.fp4 import cast_back_from_fp4
from kernels.reference.gemm import dequantize_a, dequantize_b_fp4
from kernels.reference.quant import per_token_cast_to_fp8
from kernels.testing import calc_diff

# ---- CPU ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("counts,n,k", [
    ([5, 0, 130, 1], 136, 256),        # an empty group, tails
    ([0, 0, 200, 0], 24, 384),         # all tokens in one group
    ([1], 8, 128),                     # G = 1
    ([300], 16, 256),                  # G = 1, several blocks
    ([i % 4 for i in range(256)], 8, 128),  # G = 256
])
def test_cpu_contiguous(seed, counts, n, k):
    check_contiguous(counts, n, k, "cpu")


@pytest.mark.parametrize("masked,max_m,expected_m,n,k", [
    ([3, 0, 17], 20, 8, 64, 128),        # a group with masked_m = 0
    ([0, 0, 0, 0], 64, 64, 16, 128),     # nothing to do
    ([70, 3, 100], 100, 600, 24, 256),   # max_m not a multiple of 64, expected far above
    ([1, 90, 0, 2], 100, 1, 24, 384),    # expected far below
    ([37], 50, 4, 8, 128),               # G = 1
    ([i % 3 for i in range(256)], 3, 1, 8, 128),  # G = 256
    ([-5, 40, 7], 20, 8, 16, 128),       # masked_m outside [0, max_m]: clamped
])
def test_cpu_masked(seed, masked, max_m, expected_m, n, k):
    check_masked(masked, max_m, n, k, expected_m, "cpu")


@pytest.mark.parametrize("sf_form", list(SF_FORMS))
def test_cpu_sfb_spread_within_a_block(seed, sf_form):
    check_contiguous([130, 0, 7], 40, 512, "cpu", sf_form, spread=10)
    check_masked([9, 0, 33], 33, 40, 512, 16, "cpu", sf_form, spread=10)


def test_cpu_sfb_forms_and_b_dtypes_agree(seed):
    b_packed, sfb = make_weights(3, 24, 256, "cpu", spread=4)
    a_fp8, m_indices = make_contiguous([100, 0, 29], 256, "cpu")
    a_masked = (a_fp8[0][:192].view(3, 64, 256), a_fp8[1][:192].view(3, 64, 2))
    masked_m = torch.tensor([64, 0, 17], dtype=torch.int32)
    outputs = []
    for b in (b_packed, b_packed.view(torch.uint8)):
        for form in SF_FORMS.values():
            d = torch.full((m_indices.shape[0], 24), float("nan"), dtype=torch.bfloat16)
            kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a_fp8, (b, form(sfb)), d, m_indices)
            d_masked = torch.full((3, 64, 24), float("nan"), dtype=torch.bfloat16)
            kernels.m_grouped_fp8_fp4_gemm_nt_masked(a_masked, (b, form(sfb)), d_masked, masked_m, 32)
            outputs.append((d, d_masked))
    for d, d_masked in outputs[1:]:
        assert torch.equal(d.view(torch.int16), outputs[0][0].view(torch.int16))
        assert torch.equal(d_masked.view(torch.int16), outputs[0][1].view(torch.int16))
    # Strided float32 scales are accepted (converted); strided bytes with 4-byte rows too.
    wide = torch.zeros(3, 24, 16)
    wide[:, :, :8] = sfb
    d = torch.full_like(outputs[0][0], float("nan"))
    kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a_fp8, (b_packed, wide[:, :, :8]), d, m_indices)
    assert torch.equal(d.view(torch.int16), outputs[0][0].view(torch.int16))
    wide_bytes = torch.zeros(3, 24, 12, dtype=torch.uint8)
    wide_bytes[:, :, :8] = kernels.transform_sf_for_fp4_gemm(sfb)
    kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a_fp8, (b_packed, wide_bytes[:, :, :8]), d, m_indices)
    assert torch.equal(d.view(torch.int16), outputs[0][0].view(torch.int16))


def test_cpu_empty_m():
    a = (torch.zeros(0, 128, dtype=E4M3), torch.ones(0, 1))
    b = make_weights(2, 16, 128, "cpu")
    d = torch.empty(0, 16, dtype=torch.bfloat16)
    kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, torch.zeros(0, dtype=torch.int32))
    a = (torch.zeros(2, 0, 128, dtype=E4M3), torch.ones(2, 0, 1))
    kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, b, torch.empty(2, 0, 16, dtype=torch.bfloat16),
                                             torch.zeros(2, dtype=torch.int32), 1)


def test_reference_dequantize_b_fp4(seed):
    b, sf = make_weights(2, 16, 256, "cpu", spread=3)
    got = dequantize_b_fp4(b, sf)
    assert got.dtype == torch.float32 and got.shape == (2, 16, 256)
    assert torch.equal(got, cast_back_from_fp4(b.view(torch.uint8), sf))
    assert torch.equal(dequantize_b_fp4(b.view(torch.uint8), sf), got)
    assert torch.equal(got, kernels.cast_back_from_fp4(b, sf))


def _sfb_bytes_with_strides(shape, strides):
    return torch.full((4096,), 127, dtype=torch.uint8).as_strided(shape, strides)


def _contig_args(**over):
    m, n, k, g = 128, 16, 128, 2
    args = dict(a=(torch.zeros(m, k, dtype=E4M3), torch.ones(m, 1)),
                b=(torch.zeros(g, n, k // 2, dtype=torch.int8), torch.ones(g, n, k // 32)),
                d=torch.empty(m, n, dtype=torch.bfloat16), m_indices=torch.zeros(m, dtype=torch.int32))
    args.update(over)
    return args


def _b(b_t=None, sfb=None):
    return (torch.zeros(2, 16, 64, dtype=torch.int8) if b_t is None else b_t,
            torch.ones(2, 16, 4) if sfb is None else sfb)


def _not_pow2(value):
    sfb = torch.ones(2, 16, 4)
    sfb[1, 3, 2] = value
    return sfb


CONTIGUOUS_BAD = [
    (dict(recipe=(1, 128, 64)), NotImplementedError, "recipe"),
    (dict(a=torch.zeros(128, 128, dtype=E4M3)), TypeError, "a must be a \\(tensor, scales\\) pair"),
    (dict(a=(torch.zeros(128, 128, dtype=torch.bfloat16), torch.ones(128, 1))), TypeError,
     "a\\[0\\] \\(A\\) must be float8_e4m3fn"),
    (dict(a=(torch.zeros(128, 64, dtype=E4M3), torch.ones(128, 1))), ValueError, "K must be a positive multiple of 128"),
    (dict(a=(torch.zeros(128, 128, dtype=E4M3), torch.ones(128, 2))), ValueError,
     "a\\[1\\] \\(SFA\\) must have shape \\[128, 1\\]"),
    (dict(a=(torch.zeros(128, 128, dtype=E4M3), torch.ones(128, 1, dtype=torch.bfloat16))), TypeError,
     "a\\[1\\] \\(SFA\\) must be float32"),
    (dict(b=torch.zeros(2, 16, 64, dtype=torch.int8)), TypeError, "b must be a \\(tensor, scales\\) pair"),
    (dict(b=_b(b_t=[[0]])), TypeError, "b\\[0\\] \\(B\\) must be a torch.Tensor"),
    (dict(b=_b(b_t=torch.zeros(2, 16, 128, dtype=E4M3))), TypeError, "b\\[0\\] \\(B\\) must be int8 or uint8"),
    (dict(b=_b(b_t=torch.zeros(16, 64, dtype=torch.int8))), ValueError, "b\\[0\\] \\(B\\) must have shape \\[G, N, K/2\\]"),
    (dict(b=_b(b_t=torch.zeros(2, 16, 128, dtype=torch.int8))), ValueError,
     "b\\[0\\] \\(B\\) must have shape \\[\\*, \\*, K/2\\] = \\[\\*, \\*, 64\\]"),
    (dict(b=_b(b_t=torch.zeros(2, 12, 64, dtype=torch.int8)), d=torch.empty(128, 12, dtype=torch.bfloat16)),
     ValueError, "N must be a positive multiple of 8, got 12"),
    (dict(b=_b(b_t=torch.zeros(2, 0, 64, dtype=torch.int8))), ValueError, "N must be a positive multiple of 8, got 0"),
    (dict(b=_b(b_t=torch.zeros(2, 64, 16, dtype=torch.int8).transpose(1, 2))), ValueError, "K-major"),
    (dict(b=_b(b_t=torch.zeros(2, 16, 72, dtype=torch.int8)[:, :, :64])), ValueError,
     "multiple of 16 bytes\\), got strides \\(1152, 72, 1\\)"),
    (dict(b=_b(b_t=torch.zeros(3, 16, 64, dtype=torch.int8)[::2])), ValueError, "without gaps"),
    (dict(b=(torch.zeros(0, 16, 64, dtype=torch.int8), torch.ones(0, 16, 4))), ValueError, "at least one group"),
    (dict(b=_b(sfb=2.0)), TypeError, "b\\[1\\] \\(SFB\\) must be a torch.Tensor"),
    (dict(b=_b(sfb=torch.ones(2, 16, 4, dtype=torch.float16))), TypeError,
     "b\\[1\\] \\(SFB\\) must be float8_e8m0fnu or uint8 \\(UE8M0 exponent bytes\\) or float32"),
    (dict(b=_b(sfb=torch.ones(2, 1, 1))), ValueError, "b\\[1\\] \\(SFB\\) must have shape \\[2, 16, 4\\]"),
    (dict(b=_b(sfb=torch.ones(2, 16, 8, dtype=torch.uint8)[:, :, ::2])), ValueError,
     "b\\[1\\] \\(SFB\\) must be contiguous in its last dim"),
    (dict(b=_b(sfb=_sfb_bytes_with_strides((2, 16, 4), (96, 6, 1)))), ValueError, "multiples of 4 bytes"),
    (dict(b=_b(sfb=_sfb_bytes_with_strides((2, 16, 4), (66, 4, 1)).view(E8M0))), ValueError, "multiples of 4 bytes"),
    (dict(b=_b(sfb=_not_pow2(0.75))), ValueError,
     "m_grouped_fp8_fp4_gemm_nt_contiguous: b\\[1\\] \\(SFB\\) must hold positive normal powers of two"),
    (dict(b=_b(sfb=_not_pow2(0.0))), ValueError, "b\\[1\\] \\(SFB\\) must hold positive normal powers of two"),
    (dict(b=_b(sfb=_not_pow2(-1.0))), ValueError, "1 of 128 values are not, e.g. -1.0"),
    (dict(b=_b(sfb=_not_pow2(float("inf")))), ValueError, "powers of two"),
    (dict(b=_b(sfb=_not_pow2(2.0 ** -140))), ValueError, "powers of two"),
    (dict(b=_b(sfb=torch._neg_view(torch.ones(2, 16, 4)))), ValueError, "values are not, e.g. -1.0"),
    (dict(b=_b(sfb=torch.ones(2, 16, 4).to_sparse())), ValueError,
     "b\\[1\\] \\(SFB\\) must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
    (dict(b=_b(b_t=torch.zeros(2, 16, 64, dtype=torch.int8).to_sparse())), ValueError,
     "b\\[0\\] \\(B\\) must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
    (dict(d=torch.empty(128, 8, dtype=torch.bfloat16)), ValueError, "d must be a bfloat16 tensor of shape \\[128, 16\\]"),
    (dict(d=torch.empty(128, 16, dtype=torch.float32)), ValueError, "d must be a bfloat16 tensor"),
    (dict(m_indices=torch.zeros(128, dtype=torch.int64)), ValueError, "m_indices must be an int32 tensor of shape \\[128\\]"),
    (dict(m_indices=torch.zeros(64, dtype=torch.int32)), ValueError, "m_indices must be an int32 tensor"),
    (dict(m_indices=torch.zeros(128, dtype=torch.int32, device="meta")), ValueError, "all tensors must be on one device"),
]


@pytest.mark.parametrize("over,error,match", CONTIGUOUS_BAD)
def test_contiguous_bad_arguments(over, error, match):
    with pytest.raises(error, match=match):
        kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(**_contig_args(**over))


def _masked_args(**over):
    args = dict(a=(torch.zeros(2, 8, 128, dtype=E4M3), torch.ones(2, 8, 1)), b=_b(),
                d=torch.empty(2, 8, 16, dtype=torch.bfloat16), masked_m=torch.zeros(2, dtype=torch.int32),
                expected_m=4)
    args.update(over)
    return args


@pytest.mark.parametrize("over,error,match", [
    (dict(expected_m=0), ValueError, "expected_m must be a positive int below 2\\^31, got 0"),
    (dict(expected_m=True), ValueError, "expected_m must be a positive int"),
    (dict(expected_m=2.0), ValueError, "expected_m must be a positive int"),
    (dict(recipe=(128, 128, 128)), NotImplementedError, "recipe"),
    (dict(a=(torch.zeros(16, 128, dtype=E4M3), torch.ones(16, 1))), ValueError,
     "a\\[0\\] \\(A\\) must have shape \\[\\*, \\*, \\*\\]"),
    (dict(a=(torch.zeros(2, 8, 128, dtype=E4M3), torch.ones(2, 16, 1)[:, :8])), ValueError,
     "a\\[1\\] \\(SFA\\) must stack its groups without gaps"),
    (dict(a=(torch.zeros(2, 8, 256, dtype=E4M3), torch.ones(2, 8, 2))), ValueError,
     "b\\[0\\] \\(B\\) must have shape \\[\\*, \\*, K/2\\] = \\[\\*, \\*, 128\\] \\(K = 256 from A\\)"),
    (dict(a=(torch.zeros(3, 8, 128, dtype=E4M3), torch.ones(3, 8, 1))), ValueError,
     "a\\[0\\] \\(A\\) has 3 groups but b\\[0\\] \\(B\\) has 2"),
    (dict(b=_b(sfb=_not_pow2(3.0))), ValueError,
     "m_grouped_fp8_fp4_gemm_nt_masked: b\\[1\\] \\(SFB\\) must hold positive normal powers of two"),
    (dict(b=_b(sfb=torch.ones(2, 16, 4, dtype=torch.int32))), TypeError, "b\\[1\\] \\(SFB\\) must be float8_e8m0fnu"),
    (dict(d=torch.empty(2, 8, 24, dtype=torch.bfloat16)), ValueError, "d must be a bfloat16 tensor of shape \\[2, 8, 16\\]"),
    (dict(masked_m=torch.zeros(3, dtype=torch.int32)), ValueError, "masked_m must be an int32 tensor of shape \\[2\\]"),
    (dict(masked_m=torch.zeros(2, dtype=torch.int64)), ValueError, "masked_m must be an int32 tensor"),
])
def test_masked_bad_arguments(over, error, match):
    with pytest.raises(error, match=match):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(**_masked_args(**over))


@pytest.mark.parametrize("byte", [0, 255])
def test_exponent_bytes_outside_ue8m0_normals_are_refused(byte):
    """Bytes 0 and 255 mean 2^-127 and NaN in UE8M0 but a zero and a finite or infinite scale to
    the kernels: the CPU path refuses them (as does the decode-layout transform)."""
    sfb = torch.full((2, 16, 4), 127, dtype=torch.uint8)
    sfb[1, 2, 3] = byte
    with pytest.raises(ValueError, match="exponent bytes 0 or 255"):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(**_masked_args(b=_b(sfb=sfb)))
    with pytest.raises(ValueError, match="exponent bytes 0 or 255"):
        kernels.transform_fp4_for_decode(torch.zeros(2, 16, 64, dtype=torch.uint8), sfb)


def test_decode_config_overrides(monkeypatch):
    """MOE_FP4_DECODE_WG / MOE_FP4_DECODE_K_BLOCKS replace the decode kernel's heuristic (for A/B
    runs); values the kernel cannot take are refused by name."""
    native = kernels.jit.native_module()
    monkeypatch.delenv("MOE_FP4_DECODE_WG", raising=False)
    monkeypatch.delenv("MOE_FP4_DECODE_K_BLOCKS", raising=False)
    default = native.fp8_fp4_gemm_nt_swap_ab_code(16, 7168, 2048, 132, 32, True)[2]
    assert (default["block_w"], default["k_blocks"]) == (256, 2)
    monkeypatch.setenv("MOE_FP4_DECODE_WG", "2")
    monkeypatch.setenv("MOE_FP4_DECODE_K_BLOCKS", "1")
    name, code, forced = native.fp8_fp4_gemm_nt_swap_ab_code(16, 7168, 2048, 132, 32, True)
    assert (forced["block_w"], forced["k_blocks"]) == (128, 1) and forced["num_stages"] > default["num_stages"]
    assert "sm90_fp8_fp4_gemm_nt_swap_ab<2, 7168, 2048, 16, 2, 1," in code
    for variable, value in [("MOE_FP4_DECODE_WG", "3"), ("MOE_FP4_DECODE_K_BLOCKS", "4")]:
        monkeypatch.setenv(variable, value)
        with pytest.raises(Exception, match=variable):
            native.fp8_fp4_gemm_nt_swap_ab_code(16, 7168, 2048, 132, 32, True)
        monkeypatch.delenv(variable)
    monkeypatch.setenv("MOE_FP4_DECODE_WG", "4")
    with pytest.raises(Exception, match="MOE_FP4_DECODE_WG"):  # four accumulator sets past 16 tokens
        native.fp8_fp4_gemm_nt_swap_ab_code(24, 7168, 2048, 132, 32, True)
    monkeypatch.delenv("MOE_FP4_DECODE_WG")
    monkeypatch.setenv("MOE_FP4_DECODE_K_BLOCKS", "2")
    with pytest.raises(Exception, match="MOE_FP4_DECODE_K_BLOCKS"):  # 3 K blocks of 128
        native.fp8_fp4_gemm_nt_swap_ab_code(16, 7168, 384, 132, 32, True)


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_kernel_plans(monkeypatch, setting):
    """Which kernel a call on packed weights runs: the swapped one for masked calls of up to 32
    expected rows (decode tiles) and of 65-128 (128-token tiles), the converter kernel for contiguous
    layouts and other masked calls; MOE_FP4_SWAP_AB=0 runs the converter kernel everywhere, =1 the
    swapped one everywhere (a masked group past 128 rows takes several tiles). The decode layout
    refuses what it cannot take, by name."""
    native = kernels.jit.native_module()
    if setting is None:
        monkeypatch.delenv("MOE_FP4_SWAP_AB", raising=False)
    else:
        monkeypatch.setenv("MOE_FP4_SWAP_AB", setting)
    uses = lambda m, gemm_type: native.fp8_fp4_gemm_nt_uses_swap_ab(m, 4096, 7168, 132, gemm_type, 32)  # noqa: E731
    expected = {None: (False, True, False, True, False), "0": (False,) * 5, "1": (True,) * 5}
    assert (uses(8192, 1), uses(32, 2), uses(64, 2), uses(65, 2), uses(129, 2)) == expected[setting]
    name, code, cfg = native.fp8_fp4_gemm_nt_swap_ab_code(32768, 4096, 7168, 132, 4, gemm_type=1)
    assert (cfg["block_t"], cfg["block_w"], cfg["k_blocks"]) == (128, 128, 1)
    assert "sm90_fp8_fp4_gemm_nt_swap_ab<1, 4096, 7168, 128, 2, 1," in code
    assert [native.fp8_fp4_gemm_nt_swap_ab_code(m, 576, 2048, 132, 4)[2]["block_t"] for m in (24, 40, 64, 65)] == [
        24, 64, 64, 128]
    assert native.fp8_fp4_gemm_nt_swap_ab_code(256, 576, 2048, 132, 4)[2]["block_t"] == 128
    with pytest.raises(Exception, match="the decode layout takes 1..32 expected rows, got 33"):
        native.fp8_fp4_gemm_nt_swap_ab_code(33, 576, 2048, 132, 4, True)
    with pytest.raises(Exception, match="the decode layout serves masked calls"):
        native.fp8_fp4_gemm_nt_swap_ab_code(32, 576, 2048, 132, 4, True, 1)


@pytest.mark.parametrize("value", ["2", "yes", "01"])
def test_kernel_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("MOE_FP4_SWAP_AB", value)
    with pytest.raises(Exception, match=f"MOE_FP4_SWAP_AB must be 0 or 1, got '{value}'"):
        kernels.jit.native_module().fp8_fp4_gemm_nt_uses_swap_ab(64, 4096, 7168, 132, 1, 4)


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_block_reference_switch(monkeypatch, setting):
    """The swapped kernel on packed weights takes the tile's reference exponent where it fits unless
    MOE_FP4_BLOCK_REF=0; the decode layout never does (its scales are applied per K step)."""
    if setting is None:
        monkeypatch.delenv("MOE_FP4_BLOCK_REF", raising=False)
    else:
        monkeypatch.setenv("MOE_FP4_BLOCK_REF", setting)
    native = kernels.jit.native_module()
    on = setting != "0"
    for m, gemm_type, fragment in ((16, 2, False), (100, 2, False), (8192, 1, False), (16, 2, True)):
        name, code, cfg = native.fp8_fp4_gemm_nt_swap_ab_code(m, 4096, 7168, 132, 32, fragment, gemm_type)
        expected = on and not fragment
        assert cfg["block_ref"] is expected, (m, gemm_type, fragment)
        flags = ", ".join("true" if flag else "false" for flag in (fragment, expected))
        assert code.rstrip().endswith(f"{flags}>);\n}}"), code


@pytest.mark.parametrize("value", ["2", "no"])
def test_block_reference_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("MOE_FP4_BLOCK_REF", value)
    with pytest.raises(Exception, match=f"MOE_FP4_BLOCK_REF must be 0 or 1, got '{value}'"):
        kernels.jit.native_module().fp8_fp4_gemm_nt_swap_ab_code(16, 4096, 7168, 132, 32)


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_converter_clusters_where_groups_have_two_m_blocks(monkeypatch, setting):
    """MOE_FP4_SHARE_B=1: the converter kernel runs in 2-CTA clusters (multicast 2) where a group has
    more rows than one m-block (contiguous: M / G; masked: expected rows); unset or 0 it never does."""
    if setting is None:
        monkeypatch.delenv("MOE_FP4_SHARE_B", raising=False)
    else:
        monkeypatch.setenv("MOE_FP4_SHARE_B", setting)
    native = kernels.jit.native_module()
    for m, gemm_type, groups in ((256, 2, 32), (8192, 1, 32), (100, 2, 32), (2048, 1, 32)):
        cfg = native.fp8_fp4_gemm_nt_code(m, 4096, 7168, 132, gemm_type, groups)[2]
        rows_per_group = m if gemm_type == 2 else m // groups
        assert cfg["multicast"] == (2 if setting == "1" and rows_per_group > cfg["block_m"] else 1), (m, cfg)


@pytest.mark.parametrize("value", ["2", "yes"])
def test_cluster_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("MOE_FP4_SHARE_B", value)
    with pytest.raises(Exception, match=f"MOE_FP4_SHARE_B must be 0 or 1, got '{value}'"):
        kernels.jit.native_module().fp8_fp4_gemm_nt_code(256, 4096, 7168, 132, 2, 32)


# ---- GPU ----------------------------------------------------------------------------------------

CONTIGUOUS_CASES = [  # (counts, n, k)
    ([2048] * 4, 4096, 7168),                      # prefill, 4 experts
    ([3000, 0, 129, 1], 7168, 2048),               # an empty group, tails
    ([0, 0, 5000, 0], 576, 7168),                  # all tokens in one group
    ([1], 24, 256),                                # G = 1
    ([(i * 37) % 300 for i in range(32)], 136, 384),  # G = 32, empty groups among them
    ([i % 5 for i in range(256)], 24, 256),        # G = 256
]
MASKED_CASES = [  # (masked, max_m, expected_m, n, k)
    ([20] * 32, 32, 20, 4096, 7168),               # decode, 32 experts
    ([0, 100, 3, 128], 128, 8, 7168, 2048),        # zero groups, expected far below
    ([1] * 256, 8, 1, 136, 384),                   # 256 experts, one token each
    ([0] * 4, 64, 64, 576, 7168),                  # nothing to do
    ([70, 3, 100, 0], 100, 600, 576, 7168),        # max_m not a multiple of 64, expected far above
    ([37], 50, 4, 24, 256),                        # G = 1
    ([64] * 8, 64, 64, 4096, 7168),                # 64 tokens per expert
    ([50, 0, 33, 128], 128, 40, 136, 384),         # 33-128 expected rows: the swapped prefill tiles
    ([70, 3, 100, 0], 100, 100, 576, 2048),        # 128-token blocks past max_m
    ([300, 0, 129, 256], 300, 256, 576, 2048),     # groups of several 128-token blocks
]


def _case_id(case):
    counts = case[0]
    head = f"G{len(counts)}-" + ("x".join(map(str, counts)) if len(counts) <= 4 else f"{sum(counts)}rows")
    return head + "-" + "-".join(map(str, case[1:]))


# The kernel a call runs: the default plan; MOE_FP4_SWAP_AB=0 the converter kernel, =1 the swapped
# kernel wherever it can run (both unstaged); MOE_FP4_SHARE_B=1 the converter kernel in 2-CTA
# clusters converting each weight tile once; MOE_FP4_STAGED=1 the FP4 -> FP8 cast and the FP8 GEMM.
KERNELS = {
    "default": {},
    "converter": {"MOE_FP4_SWAP_AB": "0", "MOE_FP4_STAGED": "0"},
    "converter-shared": {"MOE_FP4_SWAP_AB": "0", "MOE_FP4_STAGED": "0", "MOE_FP4_SHARE_B": "1"},
    "swapped": {"MOE_FP4_SWAP_AB": "1", "MOE_FP4_STAGED": "0"},
    "staged": {"MOE_FP4_STAGED": "1"},
}
SWITCHES = ("MOE_FP4_SWAP_AB", "MOE_FP4_STAGED", "MOE_FP4_SHARE_B")


def kernel_of(rows_per_group: float, m: int, n: int, k: int, gemm_type: int, groups: int) -> str:
    """The kernel the current switches pick for a call (m: contiguous rows or expected rows)."""
    staged = os.environ.get("MOE_FP4_STAGED", "")
    if staged == "1" or (staged == "" and rows_per_group >= kernels._fp4.STAGED_MIN_ROWS):
        return "staged"
    native = kernels.jit.native_module()
    if native.fp8_fp4_gemm_nt_uses_swap_ab(m, n, k, 132, gemm_type, groups):
        return "swapped"
    return "converter-shared" if native.fp8_fp4_gemm_nt_code(m, n, k, 132, gemm_type, groups)[2]["multicast"] == 2 \
        else "converter"


@pytest.fixture(params=list(KERNELS))
def fp4_kernel(request, monkeypatch):
    """Sets the switches; returns whether the kernel a call of (rows per group, m, n, k, gemm_type,
    groups) runs differs from the default plan's, so a case runs once per distinct kernel."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)

    def differs(*call):
        if not KERNELS[request.param]:
            return True
        default = kernel_of(*call)
        with monkeypatch.context() as patch:
            for name, value in KERNELS[request.param].items():
                patch.setenv(name, value)
            return kernel_of(*call) != default

    for name, value in KERNELS[request.param].items():
        monkeypatch.setenv(name, value)
    return differs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("counts,n,k", CONTIGUOUS_CASES, ids=list(map(_case_id, CONTIGUOUS_CASES)))
def test_gpu_contiguous(counts, n, k, seed, fp4_kernel):
    m = contiguous_rows(counts)
    if not fp4_kernel(m / len(counts), m, n, k, 1, len(counts)):
        pytest.skip("the default plan's kernel")
    check_contiguous(counts, n, k, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("masked,max_m,expected_m,n,k", MASKED_CASES, ids=list(map(_case_id, MASKED_CASES)))
def test_gpu_masked(masked, max_m, expected_m, n, k, seed, fp4_kernel):
    rows = min(expected_m, max_m)
    if not fp4_kernel(rows, rows, n, k, 2, len(masked)):
        pytest.skip("the default plan's kernel")
    check_masked(masked, max_m, n, k, expected_m, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sf_form", ["uint8", "e8m0"])
def test_gpu_sfb_spread_within_a_block(seed, sf_form):
    """Scales up to 2^10 apart inside a 128-K block: the relative exponents folded into the
    E2M1 -> E4M3 conversion stay exact."""
    check_contiguous([300, 0, 77, 129], 576, 7168, "cuda", sf_form, spread=10)
    check_masked([5, 64, 0, 17], 64, 16, 4096, 2048, "cuda", sf_form, spread=10)
    check_masked([5, 64, 0, 17], 64, 4096, 2048, 64, "cuda", sf_form, spread=10)  # the converter kernel
    check_masked([5, 100, 0, 17], 100, 4096, 2048, 100, "cuda", sf_form, spread=10)  # 128-token swapped tiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sfb_far_below_is_flushed(seed, fp4_kernel):
    """Scales up to 2^14 apart: groups more than 2^11 below their block's largest scale are flushed
    to zero on the GPU, a change below 6 * 2^-12 of that scale, invisible at the tolerance."""
    check_contiguous([200, 60], 136, 1024, "cuda", "uint8", spread=14)


SWAPPED_CASES = [  # (masked, max_m, expected_m, n, k): swapped tiles of each kind
    ([16] * 32, 16, 16, 4096, 2048),           # decode, four warpgroups (256 weight rows), 2 K blocks a stage
    ([8] * 8, 8, 8, 576, 384),                 # decode, one warpgroup, 1 K block a stage (3 K blocks)
    ([1] * 256, 8, 1, 576, 256),               # 256 experts: the last tile's rows past N (576 = 2 x 256 + 64)
    ([50, 0, 33, 64], 64, 64, 136, 384),       # 64-token tiles, 8 of the last tile's 128 rows below N
    ([100, 3, 128, 0], 128, 100, 576, 2048),   # 128-token tiles
]


def _weights_for_references(kind: str, g: int, n: int, k: int):
    """FP4 weights for the tile-reference test. in_range: scales 2^-10..1, every tile within the window.
    boundary: scales 2^-11..1 (within the window, at its edge) but row 5 halved, so that its tile's K
    blocks span 2^12 and take the rows' own references. small_rows: scales 2^-2..1 but three rows 2^16
    lower, so that their tiles leave the loop on the tile's reference at K block 0 (row 3, in every
    K block), 1 (row n / 2) and 2 (row n - 1)."""
    if kind == "in_range":
        return make_weights(g, n, k, "cuda", spread=10)
    if kind == "boundary":
        b, sf = make_weights(g, n, k, "cuda", spread=11)
        sf[:, 5] *= 0.5
        return b, sf
    b, sf = make_weights(g, n, k, "cuda", spread=2)
    k_block = torch.arange(k // 32, device="cuda") // 4
    for row, first in ((3, 0), (n // 2, 1), (n - 1, 2)):
        sf[:, row] = torch.where(k_block >= first, sf[:, row] * 2.0**-16, sf[:, row])
    return b, sf


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weights", ["in_range", "boundary", "small_rows"])
@pytest.mark.parametrize("masked,max_m,expected_m,n,k", SWAPPED_CASES, ids=list(map(_case_id, SWAPPED_CASES)))
def test_gpu_block_reference_matches_rows_own(masked, max_m, expected_m, n, k, weights, seed, monkeypatch):
    """The swapped kernel's K blocks on the tile's reference exponent give the bits of the rows' own
    references (MOE_FP4_BLOCK_REF=0): the same E4M3 values up to a power of two per row. Tiles whose
    K blocks span more than 2^11 finish on the rows' own references from there and stay exact
    (flushed on the tile's, row 5's deepest groups would differ, and row 3 would read zero)."""
    g = len(masked)
    b = _weights_for_references(weights, g, n, k)
    a_fp8, sfa = per_token_cast_to_fp8(torch.randn(g * max_m, k, device="cuda", dtype=torch.bfloat16))
    a = (a_fp8.view(g, max_m, k), sfa.view(g, max_m, -1))
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    monkeypatch.setenv("MOE_FP4_SWAP_AB", "1")
    monkeypatch.setenv("MOE_FP4_STAGED", "0")
    outputs = []
    for setting in ("1", "0"):
        monkeypatch.setenv("MOE_FP4_BLOCK_REF", setting)
        d = torch.full((g, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, expected_m)
        outputs.append(d)
    for i, count in enumerate(masked):
        if not count:
            continue
        got, own = outputs[0][i, :count], outputs[1][i, :count]
        assert torch.equal(got.view(torch.int16), own.view(torch.int16)), f"group {i}"
        ref = dequantize_a(a[0][i, :count], a[1][i, :count]).double() @ weights_of(b, i).t()
        assert calc_diff(got, ref) < TOLERANCE, f"group {i}"
        if weights == "small_rows":
            assert calc_diff(got[:, 3], ref[:, 3]) < TOLERANCE, f"group {i}: row 3"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weights", ["in_range", "boundary", "small_rows"])
def test_gpu_block_reference_matches_rows_own_contiguous(weights, seed, monkeypatch):
    """As above for the swapped kernel's contiguous 128-token tiles (MOE_FP4_SWAP_AB=1)."""
    counts, n, k = [300, 0, 129, 1], 576, 2048
    b = _weights_for_references(weights, len(counts), n, k)
    a, m_indices = make_contiguous(counts, k, "cuda", pad_blocks=1)
    monkeypatch.setenv("MOE_FP4_SWAP_AB", "1")
    monkeypatch.setenv("MOE_FP4_STAGED", "0")
    outputs = []
    for setting in ("1", "0"):
        monkeypatch.setenv("MOE_FP4_BLOCK_REF", setting)
        d = torch.full((m_indices.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, m_indices)
        outputs.append(d)
    valid = m_indices >= 0
    assert torch.equal(outputs[0][valid].view(torch.int16), outputs[1][valid].view(torch.int16))
    assert calc_diff(outputs[0][valid], expected_contiguous(a, b, m_indices)[valid]) < TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sfb_forms_and_b_dtypes_agree(seed):
    b_packed, sfb = make_weights(4, 576, 2048, "cuda", spread=6)
    a_fp8, m_indices = make_contiguous([300, 0, 5, 129], 2048, "cuda")
    outputs = []
    for b in (b_packed, b_packed.view(torch.uint8)):
        for form in SF_FORMS.values():
            d = torch.full((m_indices.shape[0], 576), float("nan"), dtype=torch.bfloat16, device="cuda")
            kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a_fp8, (b, form(sfb)), d, m_indices)
            outputs.append(d)
    valid = m_indices >= 0
    for d in outputs[1:]:
        assert torch.equal(d[valid].view(torch.int16), outputs[0][valid].view(torch.int16))
    assert calc_diff(outputs[0][valid], expected_contiguous(a_fp8, (b_packed, sfb), m_indices)[valid]) < TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_contiguous_bad_group_ids_are_skipped(seed, fp4_kernel):
    b = make_weights(2, 256, 256, "cuda")
    a_fp8, m_indices = make_contiguous([128, 128], 256, "cuda")
    m_indices[128:] = 7  # past G: must not read past B
    d = torch.full((256, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a_fp8, b, d, m_indices)
    torch.cuda.synchronize()
    assert torch.isnan(d[128:]).all()
    assert calc_diff(d[:128], expected_contiguous(a_fp8, b, m_indices)[:128]) < TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("staged", ["0", "1"])
def test_gpu_masked_in_a_cuda_graph(seed, staged, monkeypatch):
    """With UE8M0 bytes nothing syncs: the masked call can be captured and replayed, staged too."""
    monkeypatch.setenv("MOE_FP4_STAGED", staged)
    g, max_m, n, k = 8, 64, 576, 2048
    b_packed, sfb = make_weights(g, n, k, "cuda")
    b = (b_packed, kernels.transform_sf_for_fp4_gemm(sfb))
    a_fp8 = torch.zeros(g, max_m, k, dtype=E4M3, device="cuda")
    sfa = torch.ones(g, max_m, k // 128, device="cuda")
    masked_m = torch.zeros(g, dtype=torch.int32, device="cuda")
    d = torch.zeros(g, max_m, n, dtype=torch.bfloat16, device="cuda")
    kernels.m_grouped_fp8_fp4_gemm_nt_masked((a_fp8, sfa), b, d, masked_m, 16)  # compile and load first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked((a_fp8, sfa), b, d, masked_m, 16)
    new_a, new_sfa = per_token_cast_to_fp8(torch.randn(g * max_m, k, device="cuda", dtype=torch.bfloat16))
    a_fp8.copy_(new_a.view(g, max_m, k))
    sfa.copy_(new_sfa.view(g, max_m, -1))
    counts = [0, 1, 17, 64, 5, 0, 33, 2]
    masked_m.copy_(torch.tensor(counts, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    for i, count in enumerate(counts):
        if count:
            ref = dequantize_a(a_fp8[i, :count], sfa[i, :count]).double() @ weights_of((b_packed, sfb), i).t()
            assert calc_diff(d[i, :count], ref) < TOLERANCE, f"group {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pointer_alignment_checks():
    m, n, k, g = 128, 16, 128, 2
    a = (torch.zeros(m, k, dtype=E4M3, device="cuda"), torch.ones(m, 1, device="cuda"))
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    m_indices = torch.zeros(m, dtype=torch.int32, device="cuda")
    sfb = torch.full((g, n, k // 32), 127, dtype=torch.uint8, device="cuda")
    b_shifted = torch.zeros(g * n * k // 2 + 16, dtype=torch.int8, device="cuda")[8:-8].view(g, n, k // 2)
    with pytest.raises(ValueError, match="b\\[0\\] \\(B\\) must start at a 16-byte aligned address"):
        kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a, (b_shifted, sfb), d, m_indices)
    sfb_shifted = torch.full((g * n * k // 32 + 4,), 127, dtype=torch.uint8, device="cuda")[2:-2].view(g, n, k // 32)
    b_t = torch.zeros(g, n, k // 2, dtype=torch.int8, device="cuda")
    with pytest.raises(ValueError, match="b\\[1\\] \\(SFB\\) must start at a 4-byte aligned address"):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked((a[0].view(g, 64, k), a[1].view(g, 64, 1)), (b_t, sfb_shifted),
                                                 d.view(g, 64, n), m_indices[:g], 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_empty_m():
    b = make_weights(2, 16, 128, "cuda")
    a = (torch.zeros(0, 128, dtype=E4M3, device="cuda"), torch.ones(0, 1, device="cuda"))
    kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, torch.empty(0, 16, dtype=torch.bfloat16, device="cuda"),
                                                 torch.zeros(0, dtype=torch.int32, device="cuda"))
    a = (torch.zeros(2, 0, 128, dtype=E4M3, device="cuda"), torch.ones(2, 0, 1, device="cuda"))
    kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, b, torch.empty(2, 0, 16, dtype=torch.bfloat16, device="cuda"),
                                             torch.zeros(2, dtype=torch.int32, device="cuda"), 1)

