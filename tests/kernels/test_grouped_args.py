"""m_grouped_fp8_gemm_nt_contiguous / _masked (kernels/grouped.py): bad arguments get their named
errors, and the per-call fast checks (Python's and the C++ entry points') refuse what the full
checks refuse, pass the accepted layouts' strides on, and agree with each other on random calls.
CPU tensors only: no GPU needed."""

from __future__ import annotations

import pytest
import torch

import kernels

from gemm_cases import RandomDraws, inference_tensor, strided_nested


def _contig_args(**over):
    m, n, k, g = 128, 16, 128, 2
    args = dict(a=(torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.ones(m, 1)),
                b=(torch.zeros(g, n, k, dtype=torch.float8_e4m3fn), torch.ones(g, 1, 1)),
                d=torch.empty(m, n, dtype=torch.bfloat16), m_indices=torch.zeros(m, dtype=torch.int32))
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(m_indices=torch.zeros(128, dtype=torch.int64)), "m_indices must be an int32 tensor of shape \\[128\\]"),
    (dict(m_indices=torch.zeros(64, dtype=torch.int32)), "m_indices must be an int32 tensor"),
    (dict(b=(torch.zeros(2, 16, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 1, 2))), "b\\[0\\] \\(B\\) must have shape"),
    (dict(b=(torch.zeros(2, 16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, 1))), "SFB\\) must have shape \\[2, 1, 1\\]"),
    (dict(b=(torch.zeros(3, 16, 128, dtype=torch.float8_e4m3fn)[::2], torch.ones(2, 1, 1))), "without gaps"),
    (dict(b=(torch.zeros(2, 128, 16, dtype=torch.float8_e4m3fn).transpose(1, 2), torch.ones(2, 1, 1))), "K-major"),
    (dict(d=torch.empty(128, 8, dtype=torch.bfloat16)), "d must be a bfloat16 tensor of shape \\[128, 16\\]"),
    (dict(recipe=(1, 128, 64)), "recipe"),
])
def test_contiguous_bad_arguments(over, match):
    with pytest.raises((TypeError, ValueError, NotImplementedError), match=match):
        kernels.m_grouped_fp8_gemm_nt_contiguous(**_contig_args(**over))


class _TensorLike:
    """Not a tensor, though it answers every attribute the fast path reads."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __getattr__(self, name):
        return getattr(self._tensor, name)


_FP8 = torch.float8_e4m3fn


# The fast argument checks in Python and the C++ ones the entry points run first on CUDA tensors
# (kernels._C.*_args: the check alone, CPU tensors included), called with the same keywords.
kContiguousChecks = {
    "python": kernels.grouped._contiguous_launch_args,
    "c++": lambda a, b, d, m_indices: kernels.jit.native_module().m_grouped_fp8_gemm_nt_contiguous_args(
        a, b, d, m_indices, kernels.get_mk_alignment_for_contiguous_layout())}
kMaskedChecks = {
    "python": kernels.grouped._masked_launch_args,
    "c++": lambda a, b, d, masked_m, expected_m: kernels.jit.native_module().m_grouped_fp8_gemm_nt_masked_args(
        a, b, d, masked_m, expected_m)}


@pytest.mark.parametrize("over", [
    dict(a=(torch.zeros(128, 128, dtype=torch.bfloat16), torch.ones(128, 1))),
    dict(a=(torch.zeros(128, 100, dtype=_FP8), torch.ones(128, 1))),
    dict(a=(torch.zeros(128, 256, dtype=_FP8)[:, ::2], torch.ones(128, 1))),       # not K-major
    dict(a=(torch.zeros(128, 136, dtype=_FP8)[:, :128], torch.ones(128, 1))),     # row stride not 16-aligned
    dict(a=(torch.zeros(128, 128, dtype=_FP8), torch.ones(128, 2))),
    dict(a=(torch.zeros(128, 128, dtype=_FP8), torch.ones(128, 1, dtype=torch.float64))),
    dict(a=(torch.zeros(128, 128, dtype=_FP8),)),
    dict(a=(_TensorLike(torch.zeros(128, 128, dtype=_FP8)), torch.ones(128, 1))),
    dict(b=(torch.zeros(2, 16, 256, dtype=_FP8), torch.ones(2, 1, 2))),
    dict(b=(torch.zeros(2, 16, 128, dtype=_FP8), torch.ones(1, 1, 1))),
    dict(b=(torch.zeros(3, 16, 128, dtype=_FP8)[::2], torch.ones(2, 1, 1))),
    dict(b=(torch.zeros(2, 128, 16, dtype=_FP8).transpose(1, 2), torch.ones(2, 1, 1))),
    dict(b=(torch.zeros(2, 12, 128, dtype=_FP8), torch.ones(2, 1, 1)), d=torch.empty(128, 12, dtype=torch.bfloat16)),
    dict(b=(torch.zeros(0, 16, 128, dtype=_FP8), torch.ones(0, 1, 1))),
    dict(b=(torch.zeros(2, 16, 128, dtype=_FP8), _TensorLike(torch.ones(2, 1, 1)))),
    dict(d=torch.empty(128, 8, dtype=torch.bfloat16)),
    dict(d=torch.empty(128, 16, dtype=torch.float32)),
    dict(d=torch.empty(16, 128, dtype=torch.bfloat16).t()),
    dict(m_indices=torch.zeros(128, dtype=torch.int64)),
    dict(m_indices=torch.zeros(64, dtype=torch.int32)),
    dict(m_indices=torch.zeros(256, dtype=torch.int32)[::2]),
    dict(m_indices=torch.zeros(1, 128, dtype=torch.int32)),
    dict(a=(torch.zeros(128, 128, dtype=_FP8), torch.ones(128, 1).to_sparse())),
    dict(a=(torch.zeros(128, 128, dtype=_FP8), strided_nested(torch.ones(128, 1), 5))),
    dict(d=strided_nested(torch.empty(128, 16, dtype=torch.bfloat16), 5)),
    dict(m_indices=strided_nested(torch.zeros(128, dtype=torch.int32), 5)),
    dict(b=(torch.zeros(2, 16, 128, dtype=_FP8), torch.ones(2, 1, 1).to_sparse())),
    dict(d=torch.empty(128, 16, dtype=torch.bfloat16).requires_grad_()),
    dict(d=inference_tensor(128, 16)),
    dict(b=(torch.zeros(2, 16, 128, dtype=_FP8), torch._neg_view(torch.ones(2, 1, 1)))),  # read unnegated
    dict(d=torch._neg_view(torch.empty(128, 16, dtype=torch.bfloat16))),
])
@pytest.mark.parametrize("check", kContiguousChecks)
def test_contiguous_fast_path_refuses_what_the_checks_refuse(check, over):
    """The per-call fast paths (one read of each shape and stride) refuse every argument the full
    checks refuse, so that they run and name it."""
    assert kContiguousChecks[check](**_contig_args()) is not None
    assert kContiguousChecks[check](**_contig_args(**over)) is None
    with pytest.raises((TypeError, ValueError)):
        kernels.m_grouped_fp8_gemm_nt_contiguous(**_contig_args(**over))


@pytest.mark.parametrize("check", kContiguousChecks)
def test_contiguous_fast_path_takes_the_accepted_layouts(check):
    """Padded rows of A and B, MN-major (transposed) A scales, lists for pairs: accepted, with their
    strides passed on; CPU tensors give device index -1 (the caller then takes the checked CPU path)."""
    m, n, k, g = 128, 16, 256, 2
    a = [torch.zeros(m, k + 128, dtype=_FP8)[:, :k], torch.ones(2, m).t()]
    b = [torch.zeros(g, n, k + 16, dtype=_FP8)[:, :, :k], torch.ones(g, 1, 2)]
    d = torch.empty(m, n + 8, dtype=torch.bfloat16)[:, :n]
    args = kContiguousChecks[check](a, b, d, torch.zeros(m, dtype=torch.int32))
    assert args is not None
    assert args[1] == k + 128 and args[3:5] == (1, m) and args[6] == k + 16 and args[8:11] == (2, 2, 1)
    assert args[12] == n + 8 and args[14:] == (m, n, k, g, kernels.get_mk_alignment_for_contiguous_layout(), -1)


def _masked_args(**over):
    g, max_m, n, k = 2, 8, 16, 128
    args = dict(a=(torch.zeros(g, max_m, k, dtype=_FP8), torch.ones(g, max_m, 1)),
                b=(torch.zeros(g, n, k, dtype=_FP8), torch.ones(g, 1, 1)),
                d=torch.empty(g, max_m, n, dtype=torch.bfloat16), masked_m=torch.zeros(g, dtype=torch.int32),
                expected_m=4)
    args.update(over)
    return args


@pytest.mark.parametrize("over", [
    dict(expected_m=0), dict(expected_m=True), dict(expected_m=4.0),
    dict(masked_m=torch.zeros(3, dtype=torch.int32)), dict(masked_m=torch.zeros(2, dtype=torch.int64)),
    dict(masked_m=torch.zeros(4, dtype=torch.int32)[::2]),
    dict(a=(torch.zeros(3, 8, 128, dtype=_FP8), torch.ones(3, 8, 1))),
    dict(a=(torch.zeros(2, 16, 128, dtype=_FP8)[:, :8], torch.ones(2, 8, 1))),      # groups with gaps
    dict(a=(torch.zeros(2, 8, 128, dtype=_FP8), torch.ones(2, 16, 1)[:, :8])),     # scale groups with gaps
    dict(a=(torch.zeros(2, 8, 128, dtype=_FP8), torch.ones(2, 8, 2))),
    dict(a=(torch.zeros(8, 128, dtype=_FP8), torch.ones(8, 1))),
    dict(b=(torch.zeros(2, 16, 128, dtype=torch.bfloat16), torch.ones(2, 1, 1))),
    dict(d=torch.empty(2, 16, 16, dtype=torch.bfloat16)[:, :8]),                   # output groups with gaps
    dict(d=torch.empty(2, 8, 24, dtype=torch.bfloat16)),
    dict(a=(torch.zeros(2, 8, 128, dtype=_FP8), torch.ones(2, 8, 1).to_sparse())),
    dict(d=strided_nested(torch.empty(2, 8, 16, dtype=torch.bfloat16), 1)),
    dict(masked_m=strided_nested(torch.full((2,), 3, dtype=torch.int32), 1)),
    dict(d=torch.empty(2, 8, 16, dtype=torch.bfloat16).requires_grad_()),
    dict(d=inference_tensor(2, 8, 16)),
    dict(masked_m=torch._neg_view(torch.full((2,), -3, dtype=torch.int32))),  # shows 3, holds -3
])
@pytest.mark.parametrize("check", kMaskedChecks)
def test_masked_fast_path_refuses_what_the_checks_refuse(check, over):
    assert kMaskedChecks[check](**_masked_args()) is not None
    assert kMaskedChecks[check](**_masked_args(**over)) is None
    with pytest.raises((TypeError, ValueError)):
        kernels.m_grouped_fp8_gemm_nt_masked(**_masked_args(**over))


@pytest.mark.parametrize("check", kMaskedChecks)
def test_masked_fast_path_passes_strides_on(check):
    g, max_m, n, k = 2, 8, 16, 256
    a = (torch.zeros(g, max_m, k + 128, dtype=_FP8)[:, :, :k], torch.ones(g, 2, max_m).transpose(1, 2))
    args = kMaskedChecks[check](a, (torch.zeros(g, n, k, dtype=_FP8), torch.ones(g, 1, 2)),
                                               torch.empty(g, max_m, n, dtype=torch.bfloat16),
                                               torch.zeros(g, dtype=torch.int32), 5)
    assert args is None  # MN-major scales of a 3-D A stack their groups with a gap (2 * max_m, not max_m)
    sfa = torch.ones(g * max_m, 2).reshape(g, max_m, 2)
    args = kMaskedChecks[check]((a[0], sfa), (torch.zeros(g, n, k, dtype=_FP8), torch.ones(g, 1, 2)),
                                               torch.empty(g, max_m, n, dtype=torch.bfloat16),
                                               torch.zeros(g, dtype=torch.int32), 5)
    assert args[1] == k + 128 and args[3:5] == (2, 1) and args[14:] == (max_m, 5, n, k, g, -1)


def _random_grouped_call(g: torch.Generator, masked: bool) -> dict:
    """Keyword arguments of one contiguous or masked call: valid layouts drawn at random, each of
    about a dozen aspects wrong with probability 1/16."""
    draws = RandomDraws(g)
    pick, bad = draws.pick, draws.bad
    groups, m = pick(1, 2, 3), 0 if bad() else pick(1, 8, 128, 200)
    n, k = 12 if bad() else pick(8, 16, 136), 100 if bad() else pick(128, 256)
    kb = max(k // 128, 1) + bad()
    rows = (groups, m) if masked else (m,)
    lead = (groups + bad(),) if masked else ()
    a = torch.zeros(*lead, m, k + (8 if bad() else pick(0, 16)), dtype=torch.bfloat16 if bad() else _FP8)[..., :k]
    sfa = torch.ones(*rows, kb) if masked or pick(0, 1) else torch.ones(kb, m).t()
    if bad():
        sfa = torch.ones(*rows, 2 * kb)[..., :kb]
    b = torch.zeros(groups, n, k + (4 if bad() else pick(0, 16)), dtype=_FP8)[..., :k]
    if bad():
        b = torch.zeros(groups + 1, n, k, dtype=_FP8)[1:] if pick(0, 1) else b[:, :, :k].transpose(1, 2)
    sfb = torch.ones(groups, (n + 127) // 128 - bad(), kb)
    d = torch.empty(*rows, n + pick(0, 8), dtype=torch.float32 if bad() else torch.bfloat16)[..., :n]
    index = torch.zeros(groups if masked else m, dtype=torch.int64 if bad() else torch.int32)
    if bad():
        index = torch.zeros(2 * index.numel(), dtype=torch.int32)[::2]
    args = dict(a=pick((a, sfa), [a, sfa]), b=(b, sfb), d=d)
    if masked:
        return dict(args, masked_m=index, expected_m=pick(1, 4, 100) if not bad() else pick(0, True, 4.0))
    return dict(args, m_indices=index)


@pytest.mark.parametrize("masked", [False, True])
def test_cpp_checks_agree_with_python_on_random_calls(masked):
    """300 random calls of each layout: the C++ check returns exactly the Python one's launch
    arguments, or declines where it declines."""
    g = torch.Generator().manual_seed(11)
    checks = kMaskedChecks if masked else kContiguousChecks
    accepted = 0
    for _ in range(300):
        args = _random_grouped_call(g, masked)
        want = checks["python"](**args)
        assert checks["c++"](**args) == want, {name: getattr(t, "shape", t) for name, t in args.items()}
        accepted += want is not None
    assert 50 < accepted < 250, accepted


@pytest.mark.parametrize("expected_m,masked_m,match", [
    (0, torch.zeros(2, dtype=torch.int32), "expected_m must be a positive int"),
    (4, torch.zeros(3, dtype=torch.int32), "masked_m must be an int32 tensor of shape \\[2\\]"),
])
def test_masked_bad_arguments(expected_m, masked_m, match):
    a = (torch.zeros(2, 8, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 8, 1))
    b = (torch.zeros(2, 16, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1, 1))
    with pytest.raises(ValueError, match=match):
        kernels.m_grouped_fp8_gemm_nt_masked(a, b, torch.empty(2, 8, 16, dtype=torch.bfloat16), masked_m, expected_m)


# ---- DeepGEMM's other arguments: per-operand recipes, the psum contiguous layout ------------------


@pytest.mark.parametrize("weights", ["fp8", "fp4"])
def test_psum_layout_reads_the_rows_of_m_indices(weights, seed):
    """use_psum_layout=True: the same output as the m_indices the psum stands for (CPU reference)."""
    import grouped_cases
    import grouped_fp4_cases

    counts, n, k = [5, 0, 130, 1], 64, 256
    a, m_indices = grouped_cases.make_contiguous(counts, k, "cpu")
    if weights == "fp8":
        b, fn = grouped_cases.make_weights(len(counts), n, k, "cpu"), kernels.m_grouped_fp8_gemm_nt_contiguous
    else:
        b, fn = grouped_fp4_cases.make_weights(len(counts), n, k, "cpu"), kernels.m_grouped_fp8_fp4_gemm_nt_contiguous
    outs = [torch.full((m_indices.shape[0], n), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    fn(a, b, outs[0], m_indices)
    fn(a, b, outs[1], grouped_cases.psum_layout(counts), use_psum_layout=True, ensure_zero_padding=False, expected_m_for_psum_layout=64)
    assert torch.equal(outs[0].isnan(), outs[1].isnan()) and torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())
    assert torch.isfinite(outs[1][m_indices >= 0]).all()


@pytest.mark.parametrize("kwargs,kind,match", [
    (dict(recipe_a=(1, 64)), NotImplementedError, r"recipe_a \(1, 64\) is not supported; only \(1, 128\)"),
    (dict(recipe_b=(1, 32)), NotImplementedError, r"recipe_b \(1, 32\) is not supported; only \(128, 128\)"),
    (dict(use_psum_layout=1), TypeError, "use_psum_layout must be a bool"),
    (dict(expected_m_for_psum_layout=8), ValueError, "expected_m_for_psum_layout must be None"),
    (dict(use_psum_layout=True), ValueError, r"grouped_layout \(use_psum_layout=True\) must be a contiguous int32"),
])
def test_deepgemm_arguments_are_checked(kwargs, kind, match):
    with pytest.raises(kind, match=f"m_grouped_fp8_gemm_nt_contiguous: {match}"):
        kernels.m_grouped_fp8_gemm_nt_contiguous(**_contig_args(), **kwargs)


def test_deepgemm_recipes_name_the_supported_granularities():
    """recipe_a (1, 128) and recipe_b (128, 128) (FP4: (1, 32)) are DeepSeek-V3's and run."""
    call = _contig_args()
    kernels.m_grouped_fp8_gemm_nt_contiguous(**call, recipe_a=(1, 128), recipe_b=(128, 128))
    kernels.fp8_gemm_nt(call["a"], (call["b"][0][0], call["b"][1][0]), call["d"], recipe_a=(1, 128),
                        recipe_b=(128, 128))
    with pytest.raises(NotImplementedError, match="fp8_gemm_nt: recipe_b"):
        kernels.fp8_gemm_nt(call["a"], (call["b"][0][0], call["b"][1][0]), call["d"], recipe_b=(1, 32))
