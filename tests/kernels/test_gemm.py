"""fp8_gemm_nt: reference semantics and argument checks (CPU), code generation compiled for
sm_90a with NVRTC (CPU, CI), and the JIT kernel against a float64 reference (GPU). The tile
heuristic's plans: test_gemm_heuristic.py; the kernel's schedules against their twins (clusters,
ping-pong, splits over K, 256-row tiles, PDL): test_gemm_schedules.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kernels
from gemm_cases import (DEEPSEEK_NK, GPU_MS, H200_SMS, RandomDraws, TensorSubclass, inference_tensor, make_operands,
                        reference_f64, strided_nested)
from kernels.testing import calc_diff

# ---- CPU -------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k", [(1, 8, 128), (37, 136, 384), (130, 264, 256)])
def test_cpu_matches_float64(m, n, k, seed):
    a_fp8, b_fp8 = make_operands(m, n, k, "cpu")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-4


def test_cpu_residual_and_mn_major_scales(seed):
    m, n, k = 70, 256, 512
    a_fp8, b_fp8 = make_operands(m, n, k, "cpu")
    sfa_mn = a_fp8[1].t().contiguous().t()  # same values, MN-major strides
    c = torch.randn(m, n, dtype=torch.float32)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    kernels.fp8_gemm_nt((a_fp8[0], sfa_mn), b_fp8, d, c=c)
    assert calc_diff(d, reference_f64(a_fp8, b_fp8, c)) < 1e-4


def _bad_call(**overrides):
    m, n, k = 8, 16, 128
    a = (torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.ones(m, 1))
    b = (torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    args = dict(a=a, b=b, d=torch.empty(m, n, dtype=torch.bfloat16))
    args.update(overrides)
    kernels.fp8_gemm_nt(**args)


@pytest.mark.parametrize("overrides,match", [
    (dict(a=(torch.zeros(8, 128, dtype=torch.bfloat16), torch.ones(8, 1))), "a\\[0\\] \\(A\\) must be float8_e4m3fn"),
    (dict(a=(torch.zeros(8, 100, dtype=torch.float8_e4m3fn), torch.ones(8, 1)),
          b=(torch.zeros(16, 100, dtype=torch.float8_e4m3fn), torch.ones(1, 1))), "K must be a positive multiple of 128"),
    (dict(a=(torch.zeros(8, 256, dtype=torch.float8_e4m3fn)[:, ::2], torch.ones(8, 1))),
     "a\\[0\\] \\(A\\) must be K-major"),
    (dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 1).to_sparse())),
     "a\\[1\\] \\(SFA\\) must be a dense \\(strided\\) tensor"),
    (dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1).to_sparse())),
     "b\\[1\\] \\(SFB\\) must be a dense"),
    (dict(d=torch.empty(8, 16, dtype=torch.bfloat16).to_sparse()), "d must be a dense"),
    (dict(d=strided_nested(torch.empty(8, 16, dtype=torch.bfloat16), 3)), "d must be a dense .*got a nested tensor"),
    (dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), strided_nested(torch.ones(8, 1), 3))),
     "a\\[1\\] \\(SFA\\) must be a dense .*nested"),
    (dict(c=strided_nested(torch.empty(8, 16), 3)), "c must be a dense .*nested"),
    (dict(d=torch.empty(8, 16, dtype=torch.bfloat16).requires_grad_()), "d is written in place but requires grad"),
    (dict(d=torch.nn.Parameter(torch.empty(8, 16, dtype=torch.bfloat16))), "d is written in place but requires grad"),
    (dict(d=inference_tensor(8, 16)), "d is written in place but is an inference tensor"),
    (dict(b=(torch.zeros(16, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2))), "b\\[0\\] \\(B\\) must have shape"),
    (dict(b=(torch.zeros(12, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1)),
          d=torch.empty(8, 12, dtype=torch.bfloat16)), "N must be a positive multiple of 8"),
    (dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 2))), "SFA\\) must have shape \\[8, 1\\]"),
    (dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.float16))),
     "SFB\\) must be float32"),
    (dict(d=torch.empty(8, 16, dtype=torch.float32)), "d must be a bfloat16 tensor of shape \\[8, 16\\]"),
    (dict(d=torch.empty(16, 8, dtype=torch.bfloat16).t()), "d must be row-major"),
    (dict(recipe=(1, 1, 128)), "recipe"),
    (dict(compiled_dims="nkx"), "compiled_dims"),
    (dict(c=torch.empty(8, 16, dtype=torch.float16)), "c must be None or"),
    (dict(a=torch.zeros(8, 128)), "a must be a \\(tensor, scales\\) pair"),
    (dict(c=torch._neg_view(torch.zeros(8, 16))), "fp8_gemm_nt: c must not be a lazily negated view"),
])
def test_bad_arguments(overrides, match):
    with pytest.raises((TypeError, ValueError, NotImplementedError), match=match):
        _bad_call(**overrides)


class _TensorLike:
    """Not a tensor, though it answers every attribute the fast path reads."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __getattr__(self, name):
        return getattr(self._tensor, name)


# The two fast argument checks: the Python one, and the C++ one that fp8_gemm_nt runs first on
# CUDA tensors (kernels._C.fp8_gemm_nt_args is its check alone, CPU tensors included). Each must
# refuse what the full checks refuse; the C++ one must take what the Python one takes, the same way.
kFastChecks = {"python": lambda *args: kernels.gemm._launch_args(*args),
               "c++": lambda *args: kernels.jit.native_module().fp8_gemm_nt_args(*args)}


def _fast_path(check="python", **overrides):
    m, n, k = 8, 16, 128
    args = dict(a=(torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.ones(m, 1)),
                b=(torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(1, 1)),
                d=torch.empty(m, n, dtype=torch.bfloat16), c=None)
    args.update(overrides)
    return kFastChecks[check](args["a"], args["b"], args["d"], args["c"], False)


@pytest.mark.parametrize("overrides", [
    dict(a=(torch.zeros(8, 128, dtype=torch.bfloat16), torch.ones(8, 1))),
    dict(a=(torch.zeros(8, 100, dtype=torch.float8_e4m3fn), torch.ones(8, 1))),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn)[None], torch.ones(8, 1))),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8))),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 2))),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), "scales")),
    dict(a=torch.zeros(2, 8, 128, dtype=torch.float8_e4m3fn)),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn),)),
    dict(b=(torch.zeros(16, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2))),
    dict(b=(torch.zeros(12, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1)),
         d=torch.empty(8, 12, dtype=torch.bfloat16)),
    dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.float16))),
    dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1))),
    dict(d=torch.empty(8, 16, dtype=torch.float32)),
    dict(d=torch.empty(8, 24, dtype=torch.bfloat16)),
    dict(d=torch.empty(16, 8, dtype=torch.bfloat16).t()),
    dict(d=torch.empty(8, 16, dtype=torch.bfloat16)[None]),
    dict(c=torch.empty(8, 16, dtype=torch.float16)),
    dict(c=torch.empty(16, 8).t()),
    dict(c=torch.empty(8, 8)),
    dict(c="residual"),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 1).to_sparse())),
    dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1).to_sparse())),
    dict(d=torch.empty(8, 16, dtype=torch.bfloat16).requires_grad_()),
    dict(d=strided_nested(torch.empty(8, 16, dtype=torch.bfloat16), 3)),
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), strided_nested(torch.ones(8, 1), 3))),
    dict(c=strided_nested(torch.empty(8, 16), 3)),
    dict(d=inference_tensor(8, 16)),
    dict(a=(_TensorLike(torch.zeros(8, 128, dtype=torch.float8_e4m3fn)), torch.ones(8, 1))),
    dict(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), _TensorLike(torch.ones(1, 1)))),
    # Lazily negated views (the negative bit, as conj().imag sets): the kernel would read the memory.
    dict(a=(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch._neg_view(torch.ones(8, 1)))),
    dict(b=(torch._neg_view(torch.zeros(16, 128, dtype=torch.float8_e4m3fn)), torch.ones(1, 1))),
    dict(d=torch._neg_view(torch.empty(8, 16, dtype=torch.bfloat16))),
    dict(c=torch._neg_view(torch.zeros(8, 16))),
])
@pytest.mark.parametrize("check", kFastChecks)
def test_fast_path_refuses_what_the_checks_refuse(check, overrides):
    """The per-call fast paths (one read of each shape and stride) refuse every argument the full
    checks refuse, so that _validate runs and names the argument."""
    assert _fast_path(check) is not None
    assert _fast_path(check, **overrides) is None


@pytest.mark.parametrize("check", kFastChecks)
def test_fast_path_takes_the_accepted_layouts(check):
    """Padded rows of A and B, MN-major (transposed) scales, a list for a pair, a residual of either
    dtype, an nn.Parameter: accepted, with their strides passed on."""
    m, n, k = 8, 16, 256
    a = torch.zeros(m, k + 128, dtype=torch.float8_e4m3fn)[:, :k]
    sfa = torch.ones(2, m).t()
    b = [torch.zeros(n, k + 16, dtype=torch.float8_e4m3fn)[:, :k], torch.nn.Parameter(torch.ones(1, 2))]
    d = torch.empty(m, n, dtype=torch.bfloat16)
    for c in (None, torch.zeros(m, n, dtype=torch.bfloat16), torch.zeros(m, n + 8)[:, :n]):
        args = kFastChecks[check]((a, sfa), b, d, c, True)
        assert args is not None
        assert args[1] == k + 128 and args[3:5] == (1, m) and args[6] == k + 16 and args[15:19] == (m, n, k, True)
        assert args[13:15] == ((-1, 0) if c is None else (kernels._descriptors.DTYPE_CODES[c.dtype], c.stride(0)))
        assert args == kernels.gemm._launch_args((a, sfa), b, d, c, True)


def test_cpp_check_leaves_subclasses_and_meta_tensors_to_python():
    """A tensor subclass may redefine its storage, a meta tensor has none: the C++ check declines
    both (the Python path then takes the subclass as it always did, and names the meta device)."""
    d = torch.empty(8, 16, dtype=torch.bfloat16)
    assert _fast_path("c++", d=d.as_subclass(TensorSubclass)) is None
    assert _fast_path("python", d=d.as_subclass(TensorSubclass)) is not None
    assert _fast_path("c++", d=torch.empty(8, 16, dtype=torch.bfloat16, device="meta")) is None


def _random_call(g: torch.Generator):
    """Arguments of one fp8_gemm_nt call: valid layouts drawn at random, each of about a dozen
    aspects wrong with probability 1/16 (half the calls stay valid)."""
    draws = RandomDraws(g)
    pick, bad = draws.pick, draws.bad
    m, n, k = pick(0, 1, 7, 64, 129), 12 if bad() else pick(8, 16, 136, 264), 100 if bad() else pick(128, 256, 384)
    kb, nb = max(k // 128, 1) + bad(), (n + 127) // 128 - bad()
    fp8 = torch.float8_e4m3fn
    a = torch.zeros(m, k + (8 if bad() else pick(0, 16, 128)), dtype=torch.bfloat16 if bad() else fp8)[:, :k]
    sfa = torch.ones(m, kb, dtype=torch.float16) if bad() else pick(torch.ones(m, kb), torch.ones(kb, m).t())
    b = torch.zeros(n, k + (4 if bad() else pick(0, 16)), dtype=fp8)[:, :k]
    sfb = torch.ones(nb, kb)[None] if bad() else pick(torch.ones(nb, kb), torch.ones(kb, nb).t())
    d = torch.empty(m, n + 8, dtype=torch.bfloat16)[:, :n] if pick(0, 1) else torch.empty(m, n, dtype=torch.bfloat16)
    if bad():
        d = pick(torch.empty(n, m, dtype=torch.bfloat16).t(), torch.empty(m, n + 4, dtype=torch.bfloat16)[:, :n],
                 torch.empty(m, n))
    c = pick(None, None, torch.zeros(m, n), torch.zeros(m, n, dtype=torch.bfloat16), torch.zeros(m, n + 8)[:, :n])
    if bad():
        c = pick(torch.zeros(m, n, dtype=torch.float16), torch.zeros(m, 8), "c")
    return (a, sfa), pick((b, sfb), [b, sfb]), d, c, pick(True, False)


def test_cpp_check_agrees_with_python_on_random_calls():
    """300 random calls, about half of them valid: the C++ check returns exactly the Python one's
    launch arguments, or declines where it declines."""
    g = torch.Generator().manual_seed(7)
    accepted = 0
    for _ in range(300):
        args = _random_call(g)
        want = kernels.gemm._launch_args(*args)
        assert kFastChecks["c++"](*args) == want, [getattr(t, "shape", t) for t in args[:3]]
        accepted += want is not None
    assert 50 < accepted < 250


def test_meta_tensor_among_cpu_ones_is_named():
    """CPU and meta tensors share the device index -1 that the fast path compares: the full checks
    still run on the CPU path and name the devices."""
    with pytest.raises(ValueError, match="one device"):
        _bad_call(b=(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, device="meta")))


def test_c_and_recipe_of_the_wrong_type_raise():
    a = (torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 1))
    b = (torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    with pytest.raises(ValueError, match="c must be None or a row-major"):
        kernels.fp8_gemm_nt(a, b, torch.empty(8, 16, dtype=torch.bfloat16), c="x")
    with pytest.raises(NotImplementedError, match="recipe 5 is not supported"):
        kernels.fp8_gemm_nt(a, b, torch.empty(8, 16, dtype=torch.bfloat16), recipe=5)


def test_strides_past_32_bits_raise():
    """The kernel's scale offsets and C's row stride are 32-bit: views spanning 2^32 elements are
    refused (meta tensors: no storage needed for such strides)."""
    m, n, k = 4, 16, 256
    a = (torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta"), torch.empty(m, 2, device="meta"))
    b = (torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta"), torch.empty(1, 2, device="meta"))
    d = torch.empty(m, n, dtype=torch.bfloat16, device="meta")
    wide_sfb = torch.empty_strided((1, 2), (1, 1 << 32), device="meta")
    with pytest.raises(ValueError, match=r"b\[1\] \(SFB\) spans 2\^32"):
        kernels.fp8_gemm_nt(a, (b[0], wide_sfb), d)
    wide_c = torch.empty_strided((m, n), (1 << 32, 1), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="c's row stride"):
        kernels.fp8_gemm_nt(a, b, d, c=wide_c)


def test_k_not_multiple_of_128():
    a = (torch.zeros(8, 96, dtype=torch.float8_e4m3fn), torch.ones(8, 1))
    b = (torch.zeros(16, 96, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    with pytest.raises(ValueError, match="K must be a positive multiple of 128"):
        kernels.fp8_gemm_nt(a, b, torch.empty(8, 16, dtype=torch.bfloat16))


# ---- compile-only (CPU, NVRTC for sm_90a) ------------------------------------------------------

@pytest.mark.parametrize("m,n,k,c_dtype", [(64, 2112, 7168, -1), (4096, 7168, 2048, -1), (129, 576, 7168, 1),
                                           (8191, 32768, 512, 0)])
def test_compiles_for_sm90a(m, n, k, c_dtype):
    name, code = kernels.jit.native_module().fp8_gemm_nt_code(m, n, k, H200_SMS, False, c_dtype)
    first = kernels.jit.build(name, code, "sm_90a")
    assert first.cubin_path.endswith(".cubin")
    again = kernels.jit.build(name, code, "sm_90a")
    assert again.from_cache and again.key == first.key


# ---- GPU ---------------------------------------------------------------------------------------

def _warm_cache(shapes) -> None:
    """Compile the grid's kernels in parallel before the tests time out on serial JIT."""
    native = kernels.jit.native_module()
    sms = kernels.get_num_sms()
    sources = {native.fp8_gemm_nt_code(m, n, k, sms, False, -1) for m, n, k in shapes}
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda src: kernels.jit.build(src[0], src[1], "sm_90a"), sources))


@pytest.fixture(scope="module")
def warm_gemm_cache():
    if torch.cuda.is_available():
        _warm_cache([(m, n, k) for m in GPU_MS for n, k in DEEPSEEK_NK])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", DEEPSEEK_NK)
@pytest.mark.parametrize("m", GPU_MS)
def test_gpu_matches_float64(m, n, k, warm_gemm_cache, seed):
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    torch.cuda.synchronize()
    assert torch.isfinite(d).all(), "output not fully written"
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("c_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(77, 576, 7168), (300, 2112, 1536)])
def test_gpu_residual_ue8m0_mn_major(m, n, k, c_dtype, seed):
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda", ue8m0=True)
    sfa_mn = a_fp8[1].t().contiguous().t()
    c = torch.randn(m, n, device="cuda", dtype=c_dtype)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemm_nt((a_fp8[0], sfa_mn), b_fp8, d, c=c)
    torch.cuda.synchronize()
    assert calc_diff(d, reference_f64(a_fp8, b_fp8, c)) < 1e-3


@pytest.mark.gpu
def test_gpu_strided_rows_and_compiled_m(seed):
    m, n, k = 100, 264, 640
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    a_wide = torch.empty(m, k + 128, dtype=torch.float8_e4m3fn, device="cuda")
    a_wide[:, :k] = a_fp8[0]
    d_wide = torch.full((m, n + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    d = d_wide[:, :n]
    kernels.fp8_gemm_nt((a_wide[:, :k], a_fp8[1]), b_fp8, d, compiled_dims="mnk")
    torch.cuda.synchronize()
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3
    assert torch.isnan(d_wide[:, n:]).all(), "wrote outside D"


# ---- bf16_gemm_nt ----------------------------------------------------------------------------

BF16_NK = [(2112, 7168), (7168, 2048), (4096, 7168), (264, 320)]


def bf16_reference(a, b, c=None) -> torch.Tensor:
    out = a.double() @ b.double().t()
    return out if c is None else out + c.double()


def test_bf16_cpu_matches_float64(seed):
    a, b = torch.randn(37, 192, dtype=torch.bfloat16), torch.randn(136, 192, dtype=torch.bfloat16)
    c = torch.randn(37, 136)
    d = torch.full((37, 136), float("nan"), dtype=torch.bfloat16)
    kernels.bf16_gemm_nt(a, b, d, c=c)
    assert calc_diff(d, bf16_reference(a, b, c)) < 1e-4


@pytest.mark.parametrize("a,b,match", [
    (torch.zeros(8, 64), torch.zeros(16, 64, dtype=torch.bfloat16), "a must be a 2-D bfloat16 tensor"),
    (torch.zeros(8, 96, dtype=torch.bfloat16), torch.zeros(16, 96, dtype=torch.bfloat16), "K of 64"),
    (torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(16, 128, dtype=torch.bfloat16), "b must have shape"),
])
def test_bf16_bad_arguments(a, b, match):
    with pytest.raises((TypeError, ValueError), match=match):
        kernels.bf16_gemm_nt(a, b, torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16))


@pytest.mark.parametrize("m,n,k", [(64, 2112, 7168), (4096, 7168, 2048), (300, 264, 320)])
def test_bf16_compiles_for_sm90a(m, n, k):
    name, code = kernels.jit.native_module().bf16_gemm_nt_code(m, n, k, H200_SMS)
    assert kernels.jit.build(name, code, "sm_90a").cubin_path.endswith(".cubin")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", BF16_NK)
@pytest.mark.parametrize("m", [1, 77, 128, 129, 4096])
def test_bf16_gpu_matches_float64(m, n, k, seed):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.bf16_gemm_nt(a, b, d)
    torch.cuda.synchronize()
    assert torch.isfinite(d).all(), "output not fully written"
    assert calc_diff(d, bf16_reference(a, b)) < 1e-4


@pytest.mark.gpu
def test_bf16_gpu_residual(seed):
    a = torch.randn(200, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(576, 512, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(200, 576, device="cuda", dtype=torch.float32)
    d = torch.empty(200, 576, device="cuda", dtype=torch.bfloat16)
    kernels.bf16_gemm_nt(a, b, d, c=c)
    torch.cuda.synchronize()
    assert calc_diff(d, bf16_reference(a, b, c)) < 1e-4


@pytest.mark.parametrize("recipe,compiled_dims", [((1, 128, 128), "nk"), (None, "k"), (None, ""), (None, "mnk")])
def test_accepted_recipe_and_compiled_dims_reach_the_fast_path(recipe, compiled_dims, seed):
    """Every recipe / compiled_dims the checks accept must also pass the per-call fast path (on a
    GPU a refusal there is an error)."""
    m, n, k = 9, 16, 256
    a_fp8, b_fp8 = make_operands(m, n, k, "cpu")
    d = torch.empty(m, n, dtype=torch.bfloat16)
    assert kernels.gemm._launch_args(a_fp8, b_fp8, d, None, "m" in compiled_dims) is not None
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d, recipe=recipe, compiled_dims=compiled_dims)
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-4


@pytest.mark.gpu
def test_gpu_plain_cuda_tensors_take_the_cpp_path(seed):
    """fp8_gemm_nt's first step, the C++ checks and launch, takes plain CUDA tensors (a silent
    decline would only cost host time: this asserts it does not happen), M = 0 included, and
    declines an output of a tensor subclass, leaving it untouched for the Python path, which then
    runs it. Both outputs are right against float64."""
    native, (m, n, k) = kernels.jit.native_module(), (77, 576, 7168)
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    stream = torch.cuda.current_stream().cuda_stream
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    subclass = d.clone().as_subclass(TensorSubclass)
    assert native.fp8_gemm_nt_tensors(a_fp8, b_fp8, d, None, False, d.get_device(), stream, 0, 0) is True
    assert native.fp8_gemm_nt_tensors(a_fp8, b_fp8, subclass, None, False, d.get_device(), stream, 0, 0) is False
    empty = (a_fp8[0][:0], a_fp8[1][:0])
    assert native.fp8_gemm_nt_tensors(empty, b_fp8, d[:0], None, False, d.get_device(), stream, 0, 0) is True
    torch.cuda.synchronize()
    assert torch.isnan(subclass).all(), "a declined call wrote its output"
    kernels.fp8_gemm_nt(a_fp8, b_fp8, subclass)
    for got in (d, subclass.as_subclass(torch.Tensor)):
        assert torch.isfinite(got).all(), "output not fully written"
        assert calc_diff(got, reference_f64(a_fp8, b_fp8)) < 1e-3


def test_cpp_entry_points_serve_the_torch_they_were_built_with():
    """_C reads tensors with the layout of the torch it was built with: its tensor entry points are
    used under that torch only (kernels.jit.TENSOR_API; another torch takes the Python checks)."""
    assert kernels.jit.native_module().tensor_api_torch_version == torch.__version__
    assert kernels.jit.TENSOR_API
