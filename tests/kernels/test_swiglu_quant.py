"""kernels.swiglu_quant_fp8 (kernels/moe.py): SwiGLU x top-k weight quantized per 1x128 in one pass.
CPU: the definition (torch silu, products, per_token_cast_to_fp8) and argument checks; GPU: the
kernel against the same torch code on fresh data, the masked layout's unwritten rows, odd sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.testing import calc_diff
from test_quant import poison_allocator
from test_sass import sass


def _definition(h: torch.Tensor, w: torch.Tensor):
    inter = h.shape[1] // 2
    act = F.silu(h[:, :inter].float()) * h[:, inter:].float() * w.view(-1, 1)
    return kernels.per_token_cast_to_fp8(act, use_ue8m0=False, gran_k=128)


def _dequant(q, sf):
    return q.float() * sf.repeat_interleave(128, dim=1)


@pytest.mark.parametrize("m,inter", [(1, 128), (7, 256), (33, 2048)])
def test_cpu_is_the_definition(seed, m, inter):
    h = (torch.randn(m, 2 * inter) * 3).to(torch.bfloat16)
    w = torch.rand(m, 1)
    q, sf = kernels.swiglu_quant_fp8(h, w)
    q_ref, sf_ref = _definition(h, w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)


def test_cpu_takes_any_layout_of_h(seed):
    """The CUDA path copies an h whose rows are not dense; the CPU path takes such an h too (a
    column-major one once reached the quantizer and failed there, naming per_token_cast_to_fp8's x)."""
    h = (torch.randn(2 * 256, 5) * 3).to(torch.bfloat16).t()
    w = torch.rand(5)
    q, sf = kernels.swiglu_quant_fp8(h, w)
    q_ref, sf_ref = _definition(h.contiguous(), w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)


@pytest.mark.parametrize("m,inter", [(1, 256), (7, 384), (130, 256)])
def test_cpu_mn_major_sf(seed, m, inter):
    """mn_major_sf: the same scales, stored MN-major TMA-aligned (M rounded up to 4 floats)."""
    h = (torch.randn(m, 2 * inter) * 3).to(torch.bfloat16)
    w = torch.rand(m)
    q, sf = kernels.swiglu_quant_fp8(h, w, mn_major_sf=True)
    q_ref, sf_ref = _definition(h, w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)
    assert sf.stride() == (1, -(-m // 4) * 4) and kernels.get_mn_major_tma_aligned_tensor(sf) is sf
    with pytest.raises(TypeError, match="mn_major_sf must be a bool"):
        kernels.swiglu_quant_fp8(h, w, mn_major_sf="yes")


@pytest.mark.parametrize("kwargs,match", [
    (dict(h=torch.zeros(4, 200, dtype=torch.bfloat16)), "h must be a bfloat16 \\[M, 2I\\]"),
    (dict(h=torch.zeros(4, 256, dtype=torch.bfloat16).to_sparse()),
     r"h must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    (dict(weights=torch.zeros(3)), "weights must be a float32 \\[4\\]"),
    (dict(masked_m=torch.zeros(2, dtype=torch.int32), rows_per_group=3), "rows_per_group must be a positive int"),
    (dict(masked_m=torch.zeros(3, dtype=torch.int32), rows_per_group=2), "masked_m must be an int32 tensor of shape \\[2\\]"),
])
def test_bad_arguments(kwargs, match):
    args = dict(h=torch.zeros(4, 256, dtype=torch.bfloat16), weights=torch.zeros(4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kernels.swiglu_quant_fp8(**args)


@pytest.mark.parametrize("strides", [(1, 1), (1, 3), (0, 1), (2, 0), (1 << 32, 1)])
def test_native_scale_strides_must_not_overlap(strides):
    """The launcher refuses scale strides under which two of the 4 x 2 scales would share an address,
    before touching a device."""
    args = (256, 512, 0, 1, 4, 256, 1024, 2048, *strides, 0, 0)
    with pytest.raises(RuntimeError, match="sf strides .* overlap for 4 x 2 scales"):
        kernels.jit.native_module().swiglu_quant_fp8(*args)


def test_kernel_machine_code():
    text = sass(*kernels.jit.native_module().swiglu_quant_code(2048))
    for op in ("LDG.E.NA.128", "F2FP.SATFINITE.E4M3", "MUFU.EX2"):
        assert op in text, op
    assert "LDL" not in text and "STL" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,inter", [(1, 128), (37, 384), (1000, 2048), (4097, 256)])
def test_gpu_matches_the_definition(seed, m, inter):
    h = (torch.randn(m, 2 * inter, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(m, device="cuda")
    q, sf = kernels.swiglu_quant_fp8(h, w)
    q_ref, sf_ref = _definition(h, w)
    # The kernel's expf may differ from torch's in the last bit, which can move a scale by an ulp
    # or a value across an E4M3 rounding boundary: judged on the dequantized values.
    assert torch.allclose(sf, sf_ref, rtol=1e-6, atol=0)
    assert calc_diff(_dequant(q, sf), _dequant(q_ref, sf_ref)) < 1e-6
    assert (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean() > 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("m,inter", [(1, 2048), (9, 256), (37, 384), (4097, 2048)])
def test_gpu_mn_major_sf_matches_k_major(seed, m, inter):
    """The kernel writing MN-major TMA-aligned scales gives the K-major call's bits, every scale of
    the poisoned allocation that falls inside the [m, I/128] view written."""
    h = (torch.randn(m, 2 * inter, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(m, device="cuda")
    q_k, sf_k = kernels.swiglu_quant_fp8(h, w)
    groups, aligned = inter // 128, -(-m // 4) * 4
    poison_allocator(m * inter, groups * aligned * 4)
    q, sf = kernels.swiglu_quant_fp8(h, w, mn_major_sf=True)
    assert sf.stride() == (1, aligned)
    assert torch.equal(q.view(torch.uint8), q_k.view(torch.uint8))
    assert torch.equal(sf.view(torch.int32), sf_k.view(torch.int32))


@pytest.mark.gpu
def test_gpu_masked_rows_only():
    groups, rows, inter = 5, 40, 256
    h = torch.randn(groups * rows, 2 * inter, device="cuda").to(torch.bfloat16)
    w = torch.rand(groups * rows, 1, device="cuda")
    masked_m = torch.tensor([0, 40, 1, 39, 17], dtype=torch.int32, device="cuda")
    h[groups * rows - 1] = float("nan")  # a row past its group's count: never read
    q, sf = kernels.swiglu_quant_fp8(h, w, masked_m, rows)
    q_ref, sf_ref = _definition(h, w)
    valid = (torch.arange(rows, device="cuda").view(1, -1) < masked_m.view(-1, 1)).flatten()
    assert calc_diff(_dequant(q[valid], sf[valid]), _dequant(q_ref[valid], sf_ref[valid])) < 1e-6
    assert torch.isfinite(sf[valid]).all()
    q_mn, sf_mn = kernels.swiglu_quant_fp8(h, w, masked_m, rows, mn_major_sf=True)  # the same rows, MN-major
    assert torch.equal(q_mn[valid].view(torch.uint8), q[valid].view(torch.uint8))
    assert torch.equal(sf_mn[valid], sf[valid])


@pytest.mark.gpu
@pytest.mark.parametrize("masked,mn_major", [(False, False), (False, True), (True, False), (True, True)])
def test_gpu_fast_path_is_the_checked_path(seed, monkeypatch, masked, mn_major):
    """Plain contiguous CUDA tensors take the fast path (the full checks are not reached: patched to
    fail here); layouts it leaves to the checks (h with a row stride past 2I, a negative view, weights
    and masked_m not contiguous) give the same bits through them."""
    groups, rows, inter = 3, 24, 384
    h = (torch.randn(groups * rows, 2 * inter, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(groups * rows, device="cuda")
    counts = torch.tensor([24, 0, 7], dtype=torch.int32, device="cuda")
    extra = (counts, rows) if masked else ()
    valid = (torch.arange(rows, device="cuda").view(1, -1) < counts.view(-1, 1)).flatten() if masked else \
        torch.ones(groups * rows, dtype=torch.bool, device="cuda")
    with monkeypatch.context() as patch:
        patch.setattr(kernels._checks, "check_dense_args", lambda *_, **__: pytest.fail("the checked path ran"))
        q, sf = kernels.swiglu_quant_fp8(h, w, *extra, mn_major_sf=mn_major)
    wide = torch.zeros(groups * rows, 2 * inter + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, :2 * inter] = h
    odd_counts = torch.zeros(2 * groups, dtype=torch.int32, device="cuda")
    odd_counts[::2] = counts
    variants = {"h row stride": (wide[:, :2 * inter], w, counts),
                "h negative view": (torch._neg_view(-h), w, counts),
                "weights strided": (h, torch.stack([w, w], 1)[:, 0], counts),
                "weights negative view": (h, torch._neg_view(-w), counts),
                "masked_m strided": (h, w, odd_counts[::2])}
    for name, (h2, w2, counts2) in variants.items():
        if not masked and h2 is h and w2 is w:
            continue  # masked_m's variant: nothing differs without it
        poison_allocator(groups * rows * inter, groups * rows * inter // 128 * 4)  # stale right bytes can't pass
        q2, sf2 = kernels.swiglu_quant_fp8(h2, w2, *((counts2, rows) if masked else ()), mn_major_sf=mn_major)
        assert torch.isfinite(sf2[valid]).all(), name
        assert torch.equal(q2[valid].view(torch.uint8), q[valid].view(torch.uint8)), name
        assert torch.equal(sf2[valid].view(torch.int32), sf[valid].view(torch.int32)), name
    q_ref, sf_ref = _definition(h, w)
    assert calc_diff(_dequant(q[valid], sf[valid]), _dequant(q_ref[valid], sf_ref[valid])) < 1e-6
