"""Scale-factor layouts (kernels/layout.py): MN-major TMA-aligned copies and the layouts the
GEMMs read, on CPU and GPU; the GEMMs give the same result on every layout they accept."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.testing.numeric import calc_diff

kNeedsCuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("mn,element_size,expected", [(0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (129, 4, 132),
                                                      (7, 2, 8), (17, 1, 32)])
def test_tma_aligned_size(mn, element_size, expected):
    assert kernels.get_tma_aligned_size(mn, element_size) == expected


@pytest.mark.parametrize("args,match", [((-1, 4), "mn must be"), ((4, 0), "element_size must be"),
                                        ((4, 3), "must divide 16"), ((True, 4), "mn must be")])
def test_tma_aligned_size_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        kernels.get_tma_aligned_size(*args)


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (128, 56), (129, 56), (3, 37, 16), (1, 5, 1), (0, 4)])
def test_mn_major_tma_aligned_values_and_strides(shape, seed):
    x = torch.rand(shape) + 0.5
    y = kernels.get_mn_major_tma_aligned_tensor(x)
    assert y.shape == x.shape and torch.equal(y, x)
    mn, k = shape[-2:]
    aligned = kernels.get_tma_aligned_size(mn, 4)
    if x.numel() == 0:
        assert y is x
        return
    if mn > 1:
        assert y.stride(-2) == 1
    if k > 1:
        assert y.stride(-1) == aligned
    if len(shape) == 3 and shape[0] > 1:
        assert y.stride(0) == aligned * k
    assert kernels.get_mn_major_tma_aligned_tensor(y) is y  # already in the layout: no copy


@pytest.mark.parametrize("x,match,kind", [
    ([1.0], "must be a torch.Tensor", TypeError),
    (torch.ones(4, 4, dtype=torch.float64), "float32 scales", TypeError),
    (torch.ones(4), r"\[MN, K\] or \[G, MN, K\]", ValueError),
    (torch.ones(4, 4).to_sparse(), "get_mn_major_tma_aligned_tensor: x must be a dense .*sparse_coo", ValueError),
    (torch._neg_view(torch.ones(4, 4)), "get_mn_major_tma_aligned_tensor: x must not be a lazily negated view",
     ValueError),
])
def test_mn_major_bad_arguments(x, match, kind):
    with pytest.raises(kind, match=match):
        kernels.get_mn_major_tma_aligned_tensor(x)


def test_transform_sf_layouts(seed):
    sfa = torch.rand(129, 7) + 0.5
    out = kernels.transform_sf_into_required_layout(sfa, 129, 7 * 128, is_sfa=True)
    assert torch.equal(out, sfa) and out.stride() == (1, 132)
    sfa3 = (torch.rand(7, 3, 5) + 0.5).transpose(1, 2)  # [G=7, M=5, K=3/128 blocks], not stacked
    out3 = kernels.transform_sf_into_required_layout(sfa3, 5, 384, num_groups=7, is_sfa=True)
    assert torch.equal(out3, sfa3) and out3.is_contiguous()
    sfb = (torch.rand(4, 3, 2) + 0.5)[:, :, :1]
    outb = kernels.transform_sf_into_required_layout(sfb, 300, 128, num_groups=4)
    assert torch.equal(outb, sfb) and outb.is_contiguous()


@pytest.mark.parametrize("kwargs,match,kind", [
    (dict(sf=torch.ones(3, 2), mn=3, k=256, recipe=(1, 64, 128), is_sfa=True), "recipe", NotImplementedError),
    (dict(sf=torch.ones(3, 2), mn=3, k=300, is_sfa=True), r"must have shape \[3, 3\]", ValueError),
    (dict(sf=torch.ones(1, 2), mn=129, k=256), r"sf \(SFB\) must have shape \[2, 2\]", ValueError),
    (dict(sf=torch.ones(3, 2, dtype=torch.int32), mn=3, k=256, is_sfa=True), "SM100 layout", NotImplementedError),
    (dict(sf=torch.ones(3, 2), mn=-1, k=256), "mn must be a non-negative int", ValueError),
    (dict(sf=torch.ones(2, 3, 2), mn=3, k=256, num_groups=0, is_sfa=True), "num_groups must be", ValueError),
    (dict(sf=torch.ones(3, 2), mn=3, k=256, is_sfa=1), "must be bools", TypeError),
    (dict(sf=torch.ones(3, 2).to_sparse(), mn=3, k=256, is_sfa=True),
     r"sf \(SFA\) must be a dense \(strided\) tensor, got layout torch.sparse_coo", ValueError),
    (dict(sf=torch._neg_view(torch.ones(3, 2)), mn=3, k=256, is_sfa=True),
     r"sf \(SFA\) must not be a lazily negated view", ValueError),
])
def test_transform_sf_bad_arguments(kwargs, match, kind):
    with pytest.raises(kind, match=match):
        kernels.transform_sf_into_required_layout(**kwargs)


def _dense_case(m, n, k, device):
    a = kernels.per_token_cast_to_fp8(torch.randn(m, k, device=device, dtype=torch.bfloat16))
    b = kernels.per_block_cast_to_fp8(torch.randn(n, k, device=device, dtype=torch.bfloat16))
    return a, b


def _run_dense_layouts(m, n, k, device):
    (a, sfa), b = _dense_case(m, n, k, device)
    outs = []
    for layout in (sfa, kernels.get_mn_major_tma_aligned_tensor(sfa),
                   kernels.transform_sf_into_required_layout(sfa, m, k, is_sfa=True)):
        d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        kernels.fp8_gemm_nt((a, layout), b, d)
        outs.append(d)
    return outs


def _run_contiguous_layouts(device):
    groups, rows, n, k = 3, 128, 256, 384
    a, sfa = kernels.per_token_cast_to_fp8(torch.randn(groups * rows, k, device=device, dtype=torch.bfloat16))
    b = kernels.per_block_cast_to_fp8(torch.randn(groups, n, k, device=device, dtype=torch.bfloat16))
    m_indices = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(rows)
    outs = []
    for layout in (sfa, kernels.get_mn_major_tma_aligned_tensor(sfa)):
        d = torch.full((groups * rows, n), float("nan"), dtype=torch.bfloat16, device=device)
        kernels.m_grouped_fp8_gemm_nt_contiguous((a, layout), b, d, m_indices)
        outs.append(d)
    return outs


@pytest.mark.parametrize("m,n,k", [(7, 128, 256), (129, 64, 384)])
def test_cpu_gemms_read_every_layout(m, n, k, seed):
    first, *rest = _run_dense_layouts(m, n, k, "cpu")
    assert torch.isfinite(first).all() and all(torch.equal(first, other) for other in rest)
    first, second = _run_contiguous_layouts("cpu")
    assert torch.equal(first, second)


@pytest.mark.gpu
@kNeedsCuda
@pytest.mark.parametrize("m,n,k", [(7, 2112, 7168), (129, 576, 7168), (4096, 7168, 2048)])
def test_gpu_gemms_read_every_layout(m, n, k, seed):
    first, *rest = _run_dense_layouts(m, n, k, "cuda")
    assert torch.isfinite(first).all(), "rows not fully written"
    for other in rest:
        assert torch.equal(first, other)
    first, second = _run_contiguous_layouts("cuda")
    assert torch.equal(first, second)
    assert calc_diff(first, second) == 0.0


@pytest.mark.gpu
@kNeedsCuda
@pytest.mark.parametrize("shape,view", [((3, 131, 56), None), ((1, 1), None), ((4097, 56), None), ((33, 5), None),
                                        ((2, 70, 129), None), ((300, 40), "columns"), ((40, 300), "transposed"),
                                        ((5, 64, 16), "groups")])
def test_gpu_layouts_match_cpu(shape, view, seed):
    """The copy kernel (mn_major_sf, on SM90) against the CPU's strided copy, on fresh values: tails of
    the kernel's 32 x 32 tiles in rows and K blocks, groups, and sources with gaps (every other
    column), transposed (stride 1 along M already, K stride unaligned) or with groups apart."""
    x = torch.rand(shape) * 3 - 1
    if view == "columns":
        x = torch.rand(shape[0], 2 * shape[1])[:, ::2]
    elif view == "transposed":
        x = torch.rand(shape[1], shape[0]).t()
    elif view == "groups":
        x = torch.rand(shape[0], shape[1] + 3, shape[2])[:, 1:-2]
    y = kernels.get_mn_major_tma_aligned_tensor(x.cuda())
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), x)
    expected = kernels.get_mn_major_tma_aligned_tensor(x)
    assert y.stride() == expected.stride()


@pytest.mark.parametrize("m,groups", [(0, 3), (1, 56), (5, 16), (8, 1), (129, 7)])
def test_empty_activation_scales_layouts(m, groups):
    """K-major: contiguous [m, groups]. MN-major: the layout get_mn_major_tma_aligned_tensor makes
    (M stride 1, K stride m rounded up to 4 floats), which the quantizers write in place."""
    from kernels.layout import empty_activation_scales

    k_major = empty_activation_scales(m, groups, False, torch.device("cpu"))
    assert k_major.shape == (m, groups) and k_major.dtype == torch.float32 and k_major.is_contiguous()
    mn = empty_activation_scales(m, groups, True, torch.device("cpu"))
    assert mn.shape == (m, groups) and mn.dtype == torch.float32
    if m:  # an empty tensor's strides say nothing
        assert mn.stride() == (1, -(-m // 4) * 4)
    if m and groups > 1:  # (one group: get_mn_major_tma_aligned_tensor keeps any stride of the K dimension)
        assert mn.stride() == kernels.get_mn_major_tma_aligned_tensor(torch.randn(m, groups)).stride()
