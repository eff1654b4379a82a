"""Mega MoE weight layouts: gate/up interleave, SM90 and SM100 scale layouts, round trips."""

import pytest
import torch

from kernels.reference.fp4 import cast_back_from_fp4, per_token_cast_to_fp4
from kernels.reference.quant import dequantize_per_block, per_block_cast_to_fp8
from moe_runtime.mega import (dequantize_mega_moe_weights, inverse_transform_weights_for_mega_moe,
                              transform_weights_for_mega_moe)
from moe_runtime.weight_layout import interleave_permutation


def _make(fmt, e, i, h, seed, use_ue8m0=True):
    torch.manual_seed(seed)
    # Per-row magnitudes spread over decades so that every scale block differs.
    gate_up = torch.randn(e, 2 * i, h) * torch.logspace(-2, 2, 2 * i).unsqueeze(1)
    down = torch.randn(e, h, i) * torch.logspace(-2, 2, h).unsqueeze(1)
    if fmt == "fp8":
        return per_block_cast_to_fp8(gate_up, use_ue8m0=use_ue8m0), per_block_cast_to_fp8(down, use_ue8m0=use_ue8m0)
    return per_token_cast_to_fp4(gate_up), per_token_cast_to_fp4(down)


def _dequant(pair, fmt):
    return dequantize_per_block(*pair) if fmt == "fp8" else cast_back_from_fp4(*pair)


def test_interleave_permutation_by_hand():
    perm = interleave_permutation(16).tolist()
    assert perm == list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))
    with pytest.raises(ValueError, match="% 8"):
        interleave_permutation(12)


_kShapes = [(1, 128, 256), (3, 64, 128), (2, 192, 384), (2, 256, 128)]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("e,i,h", _kShapes)
def test_round_trip_and_dequantized_interleave(target, fmt, e, i, h):
    if target == "sm100" and (2 * i) % 128:
        pytest.skip("sm100 needs 128-row blocks")
    l1, l2 = _make(fmt, e, i, h, seed=e * i + h)
    out = transform_weights_for_mega_moe(l1, l2, target=target)
    back_l1, back_l2 = inverse_transform_weights_for_mega_moe(out.l1, out.l2, target=target)
    assert torch.equal(back_l1.weight.view(torch.uint8), l1[0].view(torch.uint8))
    assert torch.equal(back_l1.sf, l1[1]) and torch.equal(back_l2.sf, l2[1])
    assert torch.equal(back_l2.weight.view(torch.uint8), l2[0].view(torch.uint8))
    d1, d2 = dequantize_mega_moe_weights(out.l1, out.l2, target=target)
    perm = interleave_permutation(i)
    assert torch.equal(d1, _dequant(l1, fmt)[:, perm])
    assert torch.equal(d2, _dequant(l2, fmt))


def test_interleaved_l1_output_pairs_gate_and_up_in_each_slab():
    i, h = 64, 128
    l1, l2 = _make("fp8", 1, i, h, seed=5)
    out = transform_weights_for_mega_moe(l1, l2, target="sm90")
    x = torch.randn(4, h)
    plain = x @ _dequant(l1, "fp8")[0].t()
    fused = x @ dequantize_mega_moe_weights(out.l1, out.l2)[0][0].t()
    for j in range(i // 8):
        torch.testing.assert_close(fused[:, 16 * j: 16 * j + 8], plain[:, 8 * j: 8 * j + 8], rtol=0, atol=0)
        torch.testing.assert_close(fused[:, 16 * j + 8: 16 * j + 16], plain[:, i + 8 * j: i + 8 * j + 8], rtol=0, atol=0)


def test_sm90_fp8_scale_halves():
    # I = 192: new block 1 holds gate rows 64..127 (original block 0) and up rows 256..319 (block 2).
    i, h = 192, 128
    l1, l2 = _make("fp8", 1, i, h, seed=6, use_ue8m0=False)
    sf = transform_weights_for_mega_moe(l1, l2, target="sm90").l1.sf
    assert sf.shape == (1, 3, 2, 1)
    orig = l1[1]
    assert sf[0, 1, 0, 0] == orig[0, 0, 0] and sf[0, 1, 1, 0] == orig[0, 2, 0]
    assert sf[0, 2, 0, 0] == orig[0, 1, 0] and sf[0, 2, 1, 0] == orig[0, 2, 0]


def test_sm100_layout_details():
    e, i, h = 2, 128, 640  # H / 128 = 5 groups -> 2 int32 words, the second padded
    l1, l2 = _make("fp8", e, i, h, seed=7)
    out = transform_weights_for_mega_moe(l1, l2, target="sm100")
    sf1 = out.l1.sf
    assert sf1.dtype == torch.int32 and sf1.shape == (e, 2 * i, 2)
    assert sf1.stride() == (2 * 2 * i, 1, 2 * i)  # MN-major
    perm = interleave_permutation(i)
    row_exponents = (l1[1].repeat_interleave(128, dim=1)[:, perm].view(torch.int32) >> 23) & 0xFF
    for row in (0, 1, 37, 100, 127, 200):
        block, within = divmod(row, 128)
        a, b = divmod(within, 32)
        stored = sf1[:, block * 128 + 4 * b + a]  # UTCCP: row 32a + b sits at 4b + a
        as_bytes = stored.contiguous().view(torch.uint8).view(e, 8)
        assert torch.equal(as_bytes[:, :5].long(), row_exponents[:, row].long())
        assert bool((as_bytes[:, 5:] == 0).all())
    assert out.l2.sf.shape == (e, h, 1)


def test_sm100_rejects_non_power_of_two_scales():
    l1, l2 = _make("fp8", 1, 64, 128, seed=8, use_ue8m0=False)
    with pytest.raises(ValueError, match="UE8M0"):
        transform_weights_for_mega_moe(l1, l2, target="sm100")


@pytest.mark.parametrize("call,match", [
    # Scales on another device than their weights.
    (lambda l1, l2: transform_weights_for_mega_moe((l1[0], l1[1].to("meta")), l2),
     r"l1 and l2 weights and scale factors must be on one device, got \['cpu', 'meta'\]"),
    # intermediate_size 0: no layer to lay out.
    (lambda l1, l2: transform_weights_for_mega_moe((l1[0][:, :0], l1[1][:, :0]), (l2[0][:, :, :0], l2[1][:, :, :0])),
     r"l1 weight must be \[E, 2I, H\] with I and H >= 1, got \(2, 0, 128\)"),
    # sm90 FP8 scales of the wrong shape (an IndexError from the gather before).
    (lambda l1, l2: dequantize_mega_moe_weights((transform_weights_for_mega_moe(l1, l2)[0][0], torch.ones(3)),
                                                transform_weights_for_mega_moe(l1, l2)[1]),
     r"sm90 l1 sf must be float32 \[2, 1, 2, 1\]"),
    (lambda l1, l2: dequantize_mega_moe_weights(transform_weights_for_mega_moe(l1, l2)[0], (l2[0], l2[1][:, :, :0])),
     r"sm90 l2 sf must be float32 \[2, 1, 1\]"),
])
def test_shape_and_device_errors(call, match):
    l1, l2 = _make("fp8", 2, 64, 128, seed=9)
    with pytest.raises(ValueError, match=match):
        call(l1, l2)


def test_errors():
    l1, l2 = _make("fp8", 2, 64, 128, seed=9)
    with pytest.raises(ValueError, match="target"):
        transform_weights_for_mega_moe(l1, l2, target="sm80")
    with pytest.raises(TypeError, match=r"\(weight, sf\) pair"):
        transform_weights_for_mega_moe(l1[0], l2)
    with pytest.raises(ValueError, match="l2 weight must be"):
        transform_weights_for_mega_moe(l1, (l2[0][:, :64], l2[1]))
    with pytest.raises(ValueError, match="l1 sf must be float32"):
        transform_weights_for_mega_moe((l1[0], l1[1][:1]), l2)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        transform_weights_for_mega_moe((l1[0].float(), l1[1]), l2)
    f4 = _make("fp4", 2, 64, 128, seed=9)
    with pytest.raises(ValueError, match="share a format"):
        transform_weights_for_mega_moe(l1, f4[1])
    odd = _make("fp8", 1, 32, 128, seed=10)
    with pytest.raises(ValueError, match="% 64"):
        transform_weights_for_mega_moe(*odd, target="sm90")
    with pytest.raises(ValueError, match="multiple of 128"):
        transform_weights_for_mega_moe(*odd, target="sm100")
