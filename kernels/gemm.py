"""Dense GEMMs with DeepGEMM's signatures.

``fp8_gemm_nt((A, SFA), (B, SFB), D, C=None)`` computes ``D = (A * SFA) @ (B * SFB)^T (+ C)``:

* ``A`` [M, K] float8_e4m3fn, K-major (last dim contiguous; the row stride may exceed K, a
  multiple of 16 bytes); ``SFA`` [M, ceil(K/128)] float32, one scale per 1x128, any strides (the
  K-major layout of ``per_token_cast_to_fp8`` and DeepGEMM's MN-major TMA-aligned layout both
  work without a transpose; the MN-major one from :func:`kernels.get_mn_major_tma_aligned_tensor`
  is the fastest, its scales loaded by TMA with the tiles at every size, as are K-major ones of
  16-byte aligned rows at large M: ``kernels.jit.native_module().fp8_gemm_scale_load`` says which);
* ``B`` [N, K] float8_e4m3fn, K-major; ``SFB`` [ceil(N/128), ceil(K/128)] float32, one scale per
  128x128 block, any strides;
* ``D`` [M, N] bfloat16, last dim contiguous, written in place; ``C`` optional [M, N] bfloat16 or
  float32 added before rounding.

M >= 0, N a multiple of 8 (16-byte rows of D), K a multiple of 128. UE8M0 (power-of-two) scales
are ordinary float32 values here. CUDA tensors run the SM90 JIT kernel on the current stream; CPU
tensors run :func:`kernels.reference.gemm.fp8_gemm_nt`.
"""

from __future__ import annotations

import torch

from . import _checks, _descriptors, jit
from .reference import gemm as reference

_BLOCK = _checks.BLOCK



_FN = "fp8_gemm_nt"


def _fail(kind: type[Exception], message: str):
    _checks.fail(_FN, kind, message)


def _check_compiled_dims(compiled_dims: object, fn: str = _FN) -> bool:
    if not isinstance(compiled_dims, str) or not set(compiled_dims) <= set("mnk"):
        _checks.fail(fn, ValueError, f"compiled_dims must be a string of 'm', 'n', 'k', got {compiled_dims!r}")
    return "m" in compiled_dims


def _validate(a, b, d, c) -> None:
    """The full tensor checks with a message per failure; only run when the fast path refuses."""
    a_t, sfa = _checks.unpack(_FN, "a", a)
    b_t, sfb = _checks.unpack(_FN, "b", b)
    a_t = _checks.check_fp8_operand(_FN, "a[0] (A)", a_t, (None, None))
    m, k = a_t.shape
    b_t = _checks.check_fp8_operand(_FN, "b[0] (B)", b_t, (None, k))
    n = b_t.shape[0]
    _checks.check_nk(_FN, n, k)
    kb = k // _BLOCK
    _checks.check_scales(_FN, "a[1] (SFA)", sfa, (m, kb))
    _checks.check_scales(_FN, "b[1] (SFB)", sfb, ((n + _BLOCK - 1) // _BLOCK, kb))
    _checks.check_output(_FN, d, (m, n))
    for name, t, rows in (("a[1] (SFA)", sfa, m), ("b[1] (SFB)", sfb, (n + _BLOCK - 1) // _BLOCK)):
        if (rows - 1) * t.stride(0) >= _SPAN or (kb - 1) * t.stride(1) >= _SPAN:
            _fail(ValueError, f"{name} spans 2^32 elements or more (strides {t.stride()}): the kernel's scale "
                              "offsets are 32-bit; pass a compact copy")
    if c is not None:
        _checks.check_dense_args(_FN, c=c)
        if not isinstance(c, torch.Tensor) or c.dtype not in (torch.bfloat16, torch.float32) \
                or tuple(c.shape) != (m, n) or c.stride(1) != 1:
            _fail(ValueError, f"c must be None or a row-major bfloat16/float32 tensor of shape [{m}, {n}], got "
                              f"{getattr(c, 'dtype', type(c).__name__)} {tuple(getattr(c, 'shape', ()))}")
        if c.stride(0) >= _SPAN:
            _fail(ValueError, f"c's row stride {c.stride(0)} must be below 2^32 (the kernel's is 32-bit)")
    _checks.check_same_device(_FN, [a_t, sfa, b_t, sfb, d] + ([c] if c is not None else []))


_SPAN = 1 << 32  # the kernels' scale offsets and C's row stride are 32-bit
_COMPILED_DIMS = {dims: "m" in dims for dims in ("nk", "kn", "mnk", "mkn", "nmk", "nkm", "kmn", "knm")}
_FP8, _F32, _BF16, _STRIDED = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.strided


def _launch_args(a, b, d, c, compile_m: bool):
    """Everything the kernel call needs, or None when any tensor check fails (then ``_validate``
    says which). Kept to plain attribute reads, each tensor's shape and strides read once and
    unpacked (a wrong rank fails the unpacking): this runs on every call, ahead of
    a microsecond-scale kernel."""
    if not isinstance(a, (tuple, list)) or not isinstance(b, (tuple, list)) or len(a) != 2 or len(b) != 2:
        return None
    a_t, sfa = a
    b_t, sfb = b
    if not (isinstance(a_t, torch.Tensor) and isinstance(sfa, torch.Tensor) and isinstance(b_t, torch.Tensor)
            and isinstance(sfb, torch.Tensor)):
        return None
    try:
        if a_t.dtype is not _FP8 or b_t.dtype is not _FP8 or sfa.dtype is not _F32 or sfb.dtype is not _F32 \
                or d.dtype is not _BF16 or a_t.layout is not _STRIDED or sfa.layout is not _STRIDED \
                or b_t.layout is not _STRIDED or sfb.layout is not _STRIDED or d.layout is not _STRIDED \
                or not _checks.writable(d) or a_t.is_neg() or b_t.is_neg() or sfa.is_neg() or sfb.is_neg() \
                or d.is_neg():
            return None
        m, k = a_t.shape
        n, b_k = b_t.shape
        d_m, d_n = d.shape
        sfa_m, sfa_kb = sfa.shape
        sfb_n, sfb_kb = sfb.shape
        lda, a_inner = a_t.stride()
        ldb, b_inner = b_t.stride()
        ldd, d_inner = d.stride()
        sfa_sm, sfa_sk = sfa.stride()
        sfb_sn, sfb_sk = sfb.stride()
    except (AttributeError, RuntimeError, TypeError, ValueError):  # RuntimeError: a nested tensor's shape
        return None
    kb = k // _BLOCK
    if k == 0 or k % _BLOCK or n == 0 or n % 8 or b_k != k or d_m != m or d_n != n \
            or sfa_m != m or sfa_kb != kb or sfb_n != (n + _BLOCK - 1) // _BLOCK or sfb_kb != kb \
            or a_inner != 1 or lda % 16 or lda < k or b_inner != 1 or ldb % 16 or ldb < k \
            or d_inner != 1 or ldd % 8 or ldd < n or min(sfa_sm, sfa_sk, sfb_sn, sfb_sk) < 0 \
            or (m - 1) * sfa_sm >= _SPAN or (kb - 1) * sfa_sk >= _SPAN \
            or ((n - 1) // _BLOCK) * sfb_sn >= _SPAN or (kb - 1) * sfb_sk >= _SPAN:
        return None
    device = d.get_device()
    if a_t.get_device() != device or b_t.get_device() != device or sfa.get_device() != device \
            or sfb.get_device() != device:
        return None
    c_ptr, c_code, ldc = 0, -1, 0
    if c is not None:
        if not isinstance(c, torch.Tensor) or c.layout is not _STRIDED or c.is_nested or c.dtype not in (_BF16, _F32) \
                or c.is_neg() or c.shape != (m, n) or c.stride(1) != 1 \
                or c.stride(0) >= _SPAN \
                or c.get_device() != device:
            return None
        c_ptr, c_code, ldc = c.data_ptr(), _descriptors.DTYPE_CODES[c.dtype], c.stride(0)
    return (a_t.data_ptr(), lda, sfa.data_ptr(), sfa_sm, sfa_sk, b_t.data_ptr(), ldb, sfb.data_ptr(), sfb_sn,
            sfb_sk, d.data_ptr(), ldd, c_ptr, c_code, ldc, m, n, k, compile_m, device)


# The FP8 GEMMs' workspace (the dense tail split's partial sums, then counters the kernel leaves
# zero, then room for A's scales copied MN-major, dense and contiguous), one per (device, stream):
# launches on one stream run in order, so they can share it; another stream gets its own. Not inside
# a CUDA graph capture: a graph would bake in one workspace, which graphs captured on the same stream
# and replayed at the same time would share (and one made during a capture is zeroed only when that
# graph runs), so captured GEMMs run every tile whole and read A's scales where they are.
_workspaces: dict[tuple[int, int], tuple[int, int, torch.Tensor]] = {}
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
_current_device = getattr(torch._C, "_cuda_getDevice", lambda: 0)


def _device_capturing(device: int) -> bool:
    """Whether ``device``'s current stream is being captured. Torch answers for the current device's:
    a call on another device's tensors (a capture begun on that device's stream while this one is
    current) asks again with that device current."""
    if device == _current_device():
        return _capturing()
    with torch.cuda.device(device):
        return _capturing()


def fp8_workspace(device: int, stream: int) -> tuple[int, int]:
    """``(address, bytes)`` of the FP8 GEMMs' workspace of ``stream`` (the current stream of
    ``device``) on ``device``; ``(0, 0)`` (none) while that stream is being captured."""
    if _device_capturing(device):
        return 0, 0
    entry = _workspaces.get((device, stream))
    if entry is None:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        nbytes = jit.native_module().fp8_gemm_split_workspace_bytes(num_sms)
        workspace = torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
        entry = _workspaces[(device, stream)] = (workspace.data_ptr(), nbytes, workspace)
    return entry[0], entry[1]


def fp8_gemm_nt(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], d: torch.Tensor,
                c: torch.Tensor | None = None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims: str = "nk",
                disable_ue8m0_cast: bool = False) -> None:
    """``D = (A * SFA) @ (B * SFB)^T (+ C)`` in place; see the module docstring for layouts.

    DeepGEMM's signature: ``recipe`` (1, 128, 128), ``recipe_a`` (1, 128) and ``recipe_b`` (128, 128)
    are the only granularities (None: the same).

    ``compiled_dims`` containing ``"m"`` also compiles M into the kernel (N and K always are).
    ``disable_ue8m0_cast`` is accepted for DeepGEMM compatibility: SM90 kernels read float32
    scales as they are, so there is no cast to disable.
    """
    # The common call (plain CUDA tensors, the default recipe) is checked and launched in C++:
    # the checks below read ~25 tensor attributes, 3-4 us of host time per call on the H200's host.
    # What the C++ checks decline (False, nothing done) goes through the Python path as before.
    if jit.TENSOR_API and recipe is None and recipe_a is None and recipe_b is None and type(d) is torch.Tensor \
            and type(compiled_dims) is str:
        device = d.get_device()
        compile_m = _COMPILED_DIMS.get(compiled_dims)
        if device >= 0 and compile_m is not None:
            stream = _descriptors.current_stream_of(device)
            if jit.native_module().fp8_gemm_nt_tensors(a, b, d, c, compile_m, device, stream,
                                                       *fp8_workspace(device, stream)):
                return
    _checks.check_recipe(_FN, recipe, recipe_a, recipe_b)
    compile_m = _COMPILED_DIMS.get(compiled_dims) if isinstance(compiled_dims, str) else None
    if compile_m is None:
        compile_m = _check_compiled_dims(compiled_dims)
    args = _launch_args(a, b, d, c, compile_m) if isinstance(d, torch.Tensor) else None
    if args is None:
        _validate(a, b, d, c)
        if d.get_device() >= 0:  # _validate accepted what the fast path did not: a gap between them
            raise RuntimeError("fp8_gemm_nt: the fast argument check refused arguments the full check accepts; "
                               "please report this with the tensors' shapes, strides and dtypes")
    device = args[19] if args is not None else -1
    if device < 0:
        # CPU and meta tensors both have device index -1: the full checks tell them apart.
        if args is not None:
            _validate(a, b, d, c)
        if d.device.type != "cpu":
            _fail(ValueError, f"tensors must be on a CPU or CUDA device, got {d.device}")
        d.copy_(reference.fp8_gemm_nt(a, b, c))
        return
    if args[15] == 0:  # m == 0: nothing to compute
        return
    stream = _descriptors.current_stream_of(device)
    jit.native_module().fp8_gemm_nt(*args, *fp8_workspace(device, stream), stream)


def bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None,
                 compiled_dims: str = "nk") -> None:
    """``D = A @ B^T (+ C)`` in place, FP32 accumulation: ``A`` [M, K] and ``B`` [N, K] bfloat16,
    K-major (row strides multiples of 8 elements); ``D`` [M, N] bfloat16; ``C`` optional [M, N]
    bfloat16 or float32. N a multiple of 8, K a multiple of 64."""
    fn = "bf16_gemm_nt"
    for name, t in (("a", a), ("b", b)):
        _checks.check_dense_args(fn, **{name: t})
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 2:
            _checks.fail(fn, TypeError, f"{name} must be a 2-D bfloat16 tensor, got "
                                        f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")
        # K = 0 has no layout to check (torch gives such a tensor unit strides): the K check below names it.
        if t.shape[1] and (t.stride(1) != 1 or t.stride(0) % 8 or t.stride(0) < t.shape[1]):
            _checks.fail(fn, ValueError, f"{name} must be K-major with a row stride that is a multiple of 8, "
                                         f"got strides {t.stride()}")
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        _checks.fail(fn, ValueError, f"b must have shape [*, {k}], got {list(b.shape)}")
    if k == 0 or k % 64 or n == 0 or n % 8:
        _checks.fail(fn, ValueError, f"N must be a positive multiple of 8 and K of 64, got N={n}, K={k}")
    compile_m = _check_compiled_dims(compiled_dims, fn)
    _checks.check_output(fn, d, (m, n))
    _checks.check_dense_args(fn, c=c)
    if c is not None and (not isinstance(c, torch.Tensor) or c.dtype not in (_BF16, _F32) or c.shape != (m, n)
                          or c.stride(1) != 1):
        _checks.fail(fn, ValueError, f"c must be None or a row-major bfloat16/float32 tensor of shape [{m}, {n}]")
    device = _checks.check_same_device(fn, [a, b, d] + ([c] if c is not None else []))
    if device.type == "cpu":
        d.copy_(reference.bf16_gemm_nt(a, b, c))
        return
    if m == 0:
        return
    jit.native_module().bf16_gemm_nt(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), d.data_ptr(), d.stride(0),
                           c.data_ptr() if c is not None else 0,
                           _descriptors.DTYPE_CODES[c.dtype] if c is not None else -1,
                           c.stride(0) if c is not None else 0, m, n, k, compile_m, device.index,
                           _descriptors.current_stream(device))
