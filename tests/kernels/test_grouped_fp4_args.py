"""m_grouped_fp8_fp4_gemm_nt_contiguous / _masked (kernels/grouped.py): the per-call fast checks of
packed FP4 weights with byte scales (Python's, and the C++ ones the entry points run first on CUDA
tensors) refuse what the full checks refuse, leave float32 scales and misaligned pointers to them,
pass the accepted layouts' pointers and strides on, and agree with each other. CPU tensors only: no
GPU needed."""

from __future__ import annotations

import re

import pytest
import torch

import kernels

from gemm_cases import RandomDraws

_FP8, _E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
kFast = {"contiguous": kernels.grouped._contiguous_launch_args, "masked": kernels.grouped._masked_launch_args}
# kernels._C.*_args: the C++ check alone (CPU tensors included), called with the same keywords.
kCpp = {"contiguous": lambda a, b, d, m_indices: kernels.jit.native_module().m_grouped_fp8_fp4_gemm_nt_contiguous_args(
            a, b, d, m_indices),
        "masked": lambda a, b, d, masked_m, expected_m: kernels.jit.native_module().m_grouped_fp8_fp4_gemm_nt_masked_args(
            a, b, d, masked_m, expected_m)}
kChecks = ["python", "c++"]
kCalls = {"contiguous": kernels.m_grouped_fp8_fp4_gemm_nt_contiguous, "masked": kernels.m_grouped_fp8_fp4_gemm_nt_masked}


def _weights(g: int, n: int, k: int, dtype=torch.uint8, sf_dtype=torch.uint8):
    return (torch.zeros(g, n, k // 2, dtype=dtype), torch.full((g, n, k // 32), 127, dtype=torch.uint8).view(sf_dtype)
            if sf_dtype is not torch.float32 else torch.ones(g, n, k // 32))


def _args(layout: str, **over) -> dict:
    g, n, k = 2, 16, 256
    if layout == "contiguous":
        m = 128
        args = dict(a=(torch.zeros(m, k, dtype=_FP8), torch.ones(m, k // 128)), b=_weights(g, n, k),
                    d=torch.empty(m, n, dtype=torch.bfloat16), m_indices=torch.zeros(m, dtype=torch.int32))
    else:
        max_m = 8
        args = dict(a=(torch.zeros(g, max_m, k, dtype=_FP8), torch.ones(g, max_m, k // 128)), b=_weights(g, n, k),
                    d=torch.empty(g, max_m, n, dtype=torch.bfloat16), masked_m=torch.zeros(g, dtype=torch.int32),
                    expected_m=4)
    args.update(over)
    return args


def _fast(layout: str, check: str = "python", **args):
    if check == "c++":
        return kCpp[layout](**args)
    return kFast[layout](**args, weights="fp4")


_BAD_WEIGHTS = [
    _weights(2, 16, 256, dtype=_FP8),                                                # FP8, not packed
    (torch.zeros(2, 16, 256, dtype=torch.uint8), _weights(2, 16, 256)[1]),           # K, not K/2
    (torch.zeros(2, 128, 16, dtype=torch.uint8).transpose(1, 2), _weights(2, 16, 256)[1]),  # not K-major
    (torch.zeros(3, 16, 128, dtype=torch.uint8)[::2], _weights(2, 16, 256)[1]),      # groups with gaps
    (torch.zeros(2, 16, 136, dtype=torch.uint8)[:, :, :128], _weights(2, 16, 256)[1]),  # row stride not 16-byte
    (_weights(2, 16, 256)[0], torch.full((2, 16, 4), 127, dtype=torch.uint8)),       # SFB shape
    (_weights(2, 16, 256)[0], torch.full((2, 16, 10), 127, dtype=torch.uint8)[:, :, :8]),  # SFB row stride 10
    (_weights(2, 16, 256)[0], torch.full((2, 8, 16), 127, dtype=torch.uint8).transpose(1, 2)),  # SFB not K-contiguous
    (_weights(2, 16, 256)[0], torch.ones(2, 16, 8, dtype=torch.float64)),            # SFB dtype
    _weights(0, 16, 256),                                                            # no group
    # Lazily negated views (the negative bit): the kernel would read the memory, not the values shown.
    (torch._neg_view(_weights(2, 16, 256)[0]), _weights(2, 16, 256)[1]),
    (_weights(2, 16, 256)[0], torch._neg_view(_weights(2, 16, 256)[1])),
    (_weights(2, 16, 256)[0], torch._neg_view(_weights(2, 16, 256, sf_dtype=_E8M0)[1])),
]


@pytest.mark.parametrize("check", kChecks)
@pytest.mark.parametrize("layout", list(kFast))
@pytest.mark.parametrize("bad", range(len(_BAD_WEIGHTS) + 4))
def test_fast_path_refuses_what_the_checks_refuse(layout, bad, check):
    """Weights and outputs the full checks refuse: the fast paths decline, so that they run and
    name what is wrong."""
    assert _fast(layout, check, **_args(layout)) is not None
    if bad < len(_BAD_WEIGHTS):
        over = dict(b=_BAD_WEIGHTS[bad])
    else:
        rows = (128,) if layout == "contiguous" else (2, 8)
        over = [dict(d=torch.empty(*rows, 16, dtype=torch.float32)),
                dict(d=torch.empty(*rows, 24, dtype=torch.bfloat16)),
                dict(a=(torch.zeros(*rows, 256, dtype=torch.bfloat16), torch.ones(*rows, 2))),
                dict(b=_weights(2, 12, 256), d=torch.empty(*rows, 12, dtype=torch.bfloat16))][bad - len(_BAD_WEIGHTS)]
    args = _args(layout, **over)
    assert _fast(layout, check, **args) is None
    with pytest.raises((TypeError, ValueError)):
        kCalls[layout](**args)


@pytest.mark.parametrize("layout", list(kFast))
@pytest.mark.parametrize("sf_dtype", [torch.uint8, _E8M0, torch.float32])
def test_negated_weights(layout, sf_dtype):
    """A lazily negated B or byte SFB is refused by name (the kernels take their memory as it is); a
    negated float32 SFB is resolved by its conversion to bytes: the result of the values it shows."""
    fn = f"m_grouped_fp8_fp4_gemm_nt_{layout}"
    g, n, k = 2, 16, 256
    gen = torch.Generator().manual_seed(3)
    b_t = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8, generator=gen)
    sfb = torch.randint(120, 130, (g, n, k // 32), dtype=torch.uint8, generator=gen)
    sfb = sfb.view(_E8M0).float() if sf_dtype is torch.float32 else sfb.view(sf_dtype)
    args = _args(layout, b=(b_t, sfb))
    a_t = torch.randn(args["a"][0].shape, generator=gen).to(_FP8)
    args.update(a=(a_t, args["a"][1]), **({"masked_m": torch.full((g,), 8, dtype=torch.int32)}
                                          if layout == "masked" else {}))
    with pytest.raises(ValueError, match=rf"{fn}: b\[0\] \(B\) must not be a lazily negated view"):
        kCalls[layout](**{**args, "b": (torch._neg_view(b_t), sfb)})
    negated = (b_t, torch._neg_view(-sfb) if sf_dtype is torch.float32 else torch._neg_view(sfb))
    if sf_dtype is not torch.float32:
        with pytest.raises(ValueError, match=rf"{fn}: b\[1\] \(SFB\) must not be a lazily negated view"):
            kCalls[layout](**{**args, "b": negated})
        return
    want, got = torch.zeros_like(args["d"]), torch.zeros_like(args["d"])
    kCalls[layout](**{**args, "d": want})
    kCalls[layout](**{**args, "b": negated, "d": got})
    assert torch.equal(want, got) and bool(want.abs().sum() > 0)


@pytest.mark.parametrize("check", kChecks)
@pytest.mark.parametrize("layout", list(kFast))
def test_float32_scales_and_misaligned_pointers_take_the_full_path(layout, check):
    """float32 scales are converted (and checked) per call, misaligned B or SFB are refused by name
    on CUDA: the fast path leaves both to the full checks, which accept these on the CPU."""
    g, n, k = 2, 16, 256
    weights = [_weights(g, n, k, sf_dtype=torch.float32),
               (torch.zeros(g * n * k // 2 + 8, dtype=torch.uint8)[8:].view(g, n, k // 2), _weights(g, n, k)[1]),
               (_weights(g, n, k)[0], torch.full((g * n * k // 32 + 2,), 127, dtype=torch.uint8)[2:].view(g, n, -1))]
    for b in weights:
        args = _args(layout, b=b)
        assert _fast(layout, check, **args) is None
        kCalls[layout](**args)


@pytest.mark.parametrize("check", kChecks)
@pytest.mark.parametrize("layout", list(kFast))
@pytest.mark.parametrize("sf_dtype", [torch.uint8, _E8M0])
def test_fast_path_passes_pointers_and_strides_on(layout, sf_dtype, check):
    """Padded weight and scale rows, e8m0 or uint8 scales, lists for pairs: the native call gets
    the packed rows' byte stride, the scale bytes' group and row strides, and no alignment."""
    g, n, k = 2, 16, 256
    b_t = torch.zeros(g, n, k // 2 + 16, dtype=torch.int8)[:, :, :k // 2]
    sfb = torch.full((g, n, k // 32 + 4), 127, dtype=torch.uint8)[:, :, :k // 32].view(sf_dtype)
    args = _args(layout, b=[b_t, sfb])
    got = _fast(layout, check, **args)
    a_t, sfa = args["a"]
    d = args["d"]
    index = args["m_indices"] if layout == "contiguous" else args["masked_m"]
    weights = (b_t.data_ptr(), k // 2 + 16, sfb.data_ptr(), n * (k // 32 + 4), k // 32 + 4)
    if layout == "contiguous":
        want = (a_t.data_ptr(), k, sfa.data_ptr(), k // 128, 1, *weights, d.data_ptr(), n, index.data_ptr(), 128, n,
                k, g, -1)
    else:
        want = (a_t.data_ptr(), k, sfa.data_ptr(), k // 128, 1, *weights, d.data_ptr(), n, index.data_ptr(), 8, 4,
                n, k, g, -1)
    assert got == want


def _random_call(g: torch.Generator, layout: str) -> dict:
    """A call of small random sizes, each of about ten aspects wrong with probability 1/16."""
    draws = RandomDraws(g)
    pick, bad = draws.pick, draws.bad
    groups, n, k = pick(1, 2, 3), 12 if bad() else pick(8, 16, 24), 100 if bad() else pick(128, 256)
    rows = (pick(1, 128, 200),) if layout == "contiguous" else (groups, pick(1, 8, 16))
    a = torch.zeros(*rows, k + pick(0, 16), dtype=torch.bfloat16 if bad() else _FP8)[..., :k]
    sfa = torch.ones(*rows, max(k // 128, 1) + bad())
    b = torch.zeros(groups + bad(), n, k // 2 + pick(0, 16) + (4 if bad() else 0), dtype=pick(torch.int8, torch.uint8))
    b = b[..., :k // 2 + (2 if bad() else 0)]
    sfb = torch.full((groups, n, k // 32 + pick(0, 4) + (2 if bad() else 0)), 127, dtype=torch.uint8)
    sfb = sfb[..., :k // 32 + (1 if bad() else 0)].view(pick(torch.uint8, _E8M0))
    d = torch.empty(*rows, n, dtype=torch.float32 if bad() else torch.bfloat16)
    index = torch.zeros(groups if layout == "masked" else rows[0], dtype=torch.int64 if bad() else torch.int32)
    args = dict(a=pick((a, sfa), [a, sfa]), b=pick((b, sfb), [b, sfb]), d=d)
    if layout == "masked":
        return dict(args, masked_m=index, expected_m=pick(1, 4, 100) if not bad() else pick(0, True))
    return dict(args, m_indices=index)


@pytest.mark.parametrize("layout", list(kFast))
def test_fast_path_agrees_with_the_checks_on_random_calls(layout):
    """200 random calls: whatever the fast path takes, the full checks take (and the CPU reference
    runs); whatever they refuse, it declines. The C++ check returns exactly the Python one's
    arguments, or declines where it declines."""
    g = torch.Generator().manual_seed(5)
    taken = refused = 0
    for _ in range(200):
        args = _random_call(g, layout)
        fast = _fast(layout, **args)
        assert _fast(layout, "c++", **args) == fast, {name: getattr(t, "shape", t) for name, t in args.items()}
        try:
            kCalls[layout](**args)
        except (TypeError, ValueError):
            assert fast is None, {name: getattr(t, "shape", t) for name, t in args.items()}
            refused += 1
        else:
            taken += fast is not None
    assert taken > 20 and refused > 20, (taken, refused)


@pytest.mark.parametrize("layout", list(kFast))
def test_fast_arguments_fill_the_native_signature(layout):
    """The native entry point takes the fast path's arguments and the stream, in that order (its
    pybind signature counts them; the CUDA call itself needs a GPU)."""
    native = getattr(kernels.jit.native_module(), f"m_grouped_fp8_fp4_gemm_nt_{layout}")
    params = re.findall(r"\barg\d+:", native.__doc__.splitlines()[0])
    assert len(params) == len(_fast(layout, **_args(layout))) + 1


# ---- weights in transform_fp4_for_decode's layout (masked, decode sizes) ------------------------

def _fragment_args(**over) -> dict:
    g, max_m, n, k = 2, 8, 16, 256
    packed, sf = _weights(g, n, k)
    args = dict(a=(torch.zeros(g, max_m, k, dtype=_FP8), torch.ones(g, max_m, k // 128)),
                b=kernels.transform_fp4_for_decode(packed, sf), d=torch.empty(g, max_m, n, dtype=torch.bfloat16),
                masked_m=torch.zeros(g, dtype=torch.int32), expected_m=4)
    args.update(over)
    return args


def _fragment_fast(check: str = "python", **args):
    if check == "c++":
        return kernels.jit.native_module().m_grouped_fp8_fp4_gemm_nt_masked_fragment_args(
            args["a"], args["b"], args["d"], args["masked_m"], args["expected_m"])
    return kernels.grouped._masked_launch_args(**args, weights="fragment")


def _layout(g: int, n: int, k: int) -> torch.Tensor:
    return kernels.transform_fp4_for_decode(*_weights(g, n, k))


_BAD_FRAGMENTS = [
    dict(b=_layout(2, 16, 256).view(torch.int8)),                       # not uint8
    dict(b=_layout(2, 72, 256)),                                        # two row blocks for N = 16
    dict(b=_layout(2, 16, 512)),                                        # K blocks for K = 512
    dict(b=_layout(3, 16, 256)[:2].transpose(0, 1).contiguous().transpose(0, 1)),  # not contiguous
    dict(b=(_layout(2, 16, 256), None)),                                # a pair
    dict(d=torch.empty(2, 8, 12, dtype=torch.bfloat16)),                # N = 12
    dict(d=torch.empty(2, 8, 16, dtype=torch.float32)),
    dict(masked_m=torch.zeros(3, dtype=torch.int32)),
    dict(expected_m=0),
    dict(b=torch._neg_view(_layout(2, 16, 256))),                        # lazily negated: read as its memory
]


@pytest.mark.parametrize("check", kChecks)
@pytest.mark.parametrize("bad", range(len(_BAD_FRAGMENTS)))
def test_fragment_fast_path_refuses_what_the_checks_refuse(bad, check):
    assert _fragment_fast(check, **_fragment_args()) is not None
    args = _fragment_args(**_BAD_FRAGMENTS[bad])
    assert _fragment_fast(check, **args) is None
    with pytest.raises((TypeError, ValueError)):
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(**args)


@pytest.mark.parametrize("check", kChecks)
def test_fragment_fast_path_leaves_larger_batches_and_misaligned_weights_to_the_full_path(check):
    """More than 32 rows per group (refused by name on CUDA) and a misaligned layout (TMA): the fast
    path declines; on the CPU the full path runs the reference."""
    g, n, k = 2, 16, 256
    layout = _layout(g, n, k)
    shifted = torch.zeros(layout.numel() + 8, dtype=torch.uint8)[8:].view(layout.shape)
    for over in (dict(a=(torch.zeros(g, 64, k, dtype=_FP8), torch.ones(g, 64, 2)),
                      d=torch.empty(g, 64, n, dtype=torch.bfloat16), expected_m=33), dict(b=shifted.copy_(layout))):
        args = _fragment_args(**over)
        assert _fragment_fast(check, **args) is None
        kernels.m_grouped_fp8_fp4_gemm_nt_masked(**args)


@pytest.mark.parametrize("check", kChecks)
def test_fragment_fast_path_passes_pointers_and_strides_on(check):
    args = _fragment_args(expected_m=40)  # min(expected_m, max_m) = 8 rows
    a_t, sfa = args["a"]
    want = (a_t.data_ptr(), 256, sfa.data_ptr(), 2, 1, args["b"].data_ptr(), args["d"].data_ptr(), 16,
            args["masked_m"].data_ptr(), 8, 40, 16, 256, 2, -1)
    assert _fragment_fast(check, **args) == want
    native = kernels.jit.native_module().m_grouped_fp8_fp4_gemm_nt_masked_fragment
    assert len(re.findall(r"\barg\d+:", native.__doc__.splitlines()[0])) == len(want) + 1
