"""FP8 E4M3 quantization of activations (per token, 1 x gran_k groups) and weights (128 x 128);
FP4 E2M1 quantization of weights (1 x gran_k groups, packed two codes per byte), and the cast of
FP4 weights to FP8 weights with 128 x 128 block scales (the staged FP8 x FP4 GEMMs' first step).

FP8: CPU tensors run the pure-torch references in :mod:`kernels.reference.quant`; CUDA tensors run
the JIT-compiled kernels on ``torch.cuda.current_stream()``, which reproduce the references bit for
bit (see that module for the rounding of every step). FP4: offline weight quantizers, the pure-torch
references of :mod:`kernels.reference.fp4` on the tensor's device (CPU or CUDA, the same bits on
both). The FP4 -> FP8 cast runs a JIT-compiled kernel on CUDA and :mod:`kernels.reference.fp4`'s
reference on the CPU, bit for bit alike. Outputs are newly allocated.
"""

from __future__ import annotations

import numbers

import torch

from . import _checks, _descriptors, _fp4, jit
from .layout import empty_activation_scales
from .reference import fp4 as fp4_reference
from .reference import quant as reference

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INPUT_CODES = {dtype: _descriptors.DTYPE_CODES[dtype] for dtype in _INPUT_DTYPES}
_GRAN_KS = (32, 64, 128)
_BLOCK = _checks.BLOCK


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_input(fn: str, x: object, dims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16, float16 or float32, got {x.dtype}")
    _checks.check_dense(fn, "x", x, negated_ok=True)  # resolved below
    if x.dim() not in dims:
        expected = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{fn}: x must be {expected}, got shape {tuple(x.shape)}")
    if x.shape[-1] == 0:
        raise ValueError(f"{fn}: the last dim of x must be >= 1, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1 and x.shape[-1] != 1:
        raise ValueError(f"{fn}: the last dim of x must be contiguous (stride 1), got strides "
                         f"{x.stride()} for shape {tuple(x.shape)}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: x must be on a CPU or CUDA device, got {x.device}")
    # A lazily negated view (the negative bit, e.g. the imaginary part of a conjugate) would reach
    # the kernels as its unnegated memory.
    return x.resolve_neg() if x.is_neg() else x


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round positive float32 values up to a power of two, exactly; any shape, any device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"ceil_to_ue8m0: x must be a torch.Tensor, got {type(x).__name__}")
    _checks.check_dense("ceil_to_ue8m0", "x", x, negated_ok=True)  # torch ops
    if x.device.type == "meta":
        raise ValueError("ceil_to_ue8m0: x must hold values (a CPU or CUDA tensor, say), got a meta tensor")
    if x.dtype == torch.float32 and bool((x <= 0).any()):
        raise ValueError("ceil_to_ue8m0: x must hold values > 0 (NaN and inf pass through), got a value <= 0")
    return reference.ceil_to_ue8m0(x)


def _per_token_cast_on_gpu(x: torch.Tensor, code: int, m: int, n: int, row_stride: int, gran_k: int,
                           use_ue8m0: bool, mn_major_sf: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on checked arguments (m >= 1): new outputs, the launch on the current stream."""
    device, index = x.device, x.get_device()
    out = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=device)
    sf = empty_activation_scales(m, _ceil_div(n, gran_k), mn_major_sf, device)
    # Positional: pybind's keyword matching costs ~2 us per call. Order: x, x_dtype, m, n,
    # x_row_stride, out, sf, sf_stride_m, sf_stride_k, gran_k, use_ue8m0, device, stream.
    stride_m, stride_k = sf.stride()
    jit.native_module().per_token_cast_to_fp8(x.data_ptr(), code, m, n, row_stride, out.data_ptr(), sf.data_ptr(),
                                              stride_m, stride_k, gran_k, use_ue8m0, index,
                                              _descriptors.current_stream_of(index))
    return out, sf


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = 128,
                          mn_major_sf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to E4M3 with one float32 scale per ``1 x gran_k`` group.

    ``x``: [m, n] bfloat16 / float16 / float32, last dim contiguous (the row stride may exceed
    n), m >= 0, n >= 1; ``gran_k`` in {32, 64, 128}. Returns ``(x_fp8 [m, n] float8_e4m3fn,
    sf [m, ceil(n / gran_k)] float32)``. ``x_fp8`` is contiguous; ``sf`` too unless
    ``mn_major_sf``, which writes it MN-major TMA-aligned (stride 1 along m, ``m`` rounded up to 4
    along the groups: :func:`kernels.get_mn_major_tma_aligned_tensor`'s layout), the layout the
    dense and contiguous GEMMs load with one TMA box per K block (on an H200 the contiguous GEMM took
    0.90-0.99x its time on K-major scales, bench/RESULTS.md 2026-12-01). A last partial group is padded with zeros for its
    amax; ``use_ue8m0`` rounds the scales up to powers of two.
    """
    # Fast path, every call ahead of a microsecond-scale kernel: a plain 2-D CUDA tensor of a
    # supported dtype, non-empty, last dim contiguous, flags of the right types. Anything else takes
    # the checks below, which raise or run the reference.
    if type(x) is torch.Tensor and x.is_cuda and type(use_ue8m0) is bool and type(gran_k) is int \
            and type(mn_major_sf) is bool and gran_k in _GRAN_KS and x.layout is torch.strided and not x.is_nested \
            and not x.is_neg():
        code = _INPUT_CODES.get(x.dtype)
        shape, strides = x.shape, x.stride()
        if code is not None and len(shape) == 2 and shape[0] > 0 and shape[1] > 0 \
                and (strides[1] == 1 or shape[1] == 1):
            return _per_token_cast_on_gpu(x, code, shape[0], shape[1], strides[0], gran_k, use_ue8m0, mn_major_sf)
    fn = "per_token_cast_to_fp8"
    x = _check_input(fn, x, (2,))
    use_ue8m0 = _checks.check_bool(fn, "use_ue8m0", use_ue8m0)
    mn_major_sf = _checks.check_bool(fn, "mn_major_sf", mn_major_sf)
    if isinstance(gran_k, bool) or not isinstance(gran_k, numbers.Integral) or gran_k not in _GRAN_KS:
        raise ValueError(f"{fn}: gran_k must be one of {_GRAN_KS}, got {gran_k!r}")
    gran_k = int(gran_k)
    m, n = x.shape
    if m == 0:
        return (torch.empty((0, n), dtype=torch.float8_e4m3fn, device=x.device),
                empty_activation_scales(0, _ceil_div(n, gran_k), mn_major_sf, x.device))
    if x.device.type == "cpu":
        x_fp8, sf = reference.per_token_cast_to_fp8(x, use_ue8m0, gran_k)
        return x_fp8, (empty_activation_scales(m, sf.shape[1], True, x.device).copy_(sf) if mn_major_sf else sf)
    return _per_token_cast_on_gpu(x, _descriptors.dtype_code(x, "x"), m, n, x.stride(0), gran_k, use_ue8m0,
                                  mn_major_sf)


def per_block_cast_to_fp8(x: torch.Tensor,
                          use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to E4M3 with one float32 scale per 128 x 128 tile (weights).

    ``x``: [n, k] or [g, n, k] bfloat16 / float16 / float32, last dim contiguous, k >= 1.
    Returns ``(x_fp8, sf)``: ``x_fp8`` float8_e4m3fn of the shape of ``x`` and ``sf`` float32
    [(g,) ceil(n / 128), ceil(k / 128)], both contiguous. Partial edge tiles are padded with
    zeros for their amax; ``use_ue8m0`` rounds the scales up to powers of two.
    """
    fn = "per_block_cast_to_fp8"
    x = _check_input(fn, x, (2, 3))
    use_ue8m0 = _checks.check_bool(fn, "use_ue8m0", use_ue8m0)
    if x.device.type == "cpu":
        return reference.per_block_cast_to_fp8(x, use_ue8m0, _BLOCK)

    xb = x if x.dim() == 3 else x.unsqueeze(0)
    g, n, k = xb.shape
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    sf_shape = (*x.shape[:-2], _ceil_div(n, _BLOCK), _ceil_div(k, _BLOCK))
    sf = torch.empty(sf_shape, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out, sf
    # Order: x, x_dtype, batch, n, k, x_batch_stride, x_row_stride, out, sf, use_ue8m0, device,
    # stream.
    jit.native_module().per_block_cast_to_fp8(
        xb.data_ptr(), _descriptors.dtype_code(x, "x"), g, n, k, xb.stride(0), xb.stride(1),
        out.data_ptr(), sf.data_ptr(), use_ue8m0, x.device.index,
        _descriptors.current_stream(x.device))
    return out, sf


def _check_gran_k(fn: str, gran_k: object) -> int:
    if isinstance(gran_k, bool) or not isinstance(gran_k, int) or gran_k <= 0 or gran_k % 2:
        raise ValueError(f"{fn}: gran_k must be a positive even int, got {gran_k!r}")
    return gran_k


def per_token_cast_to_fp4(x: torch.Tensor, use_ue8m0: bool = True,
                          gran_k: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dim of ``x`` to packed E2M1 with one float32 scale per ``1 x gran_k``.

    ``x``: [m, n] or batched [g, m, n] (any number of leading dims) bfloat16 / float16 / float32 on
    a CPU or CUDA device, any strides, ``n`` positive and even; ``gran_k`` a positive even int (32
    for the FP8 x FP4 GEMMs' weights). Returns ``(packed [..., m, n / 2] int8, sf [..., m,
    ceil(n / gran_k)] float32)``, both contiguous: element ``2 j`` of a row in the low nibble of
    byte ``j``, bit 3 of a code the sign. ``use_ue8m0`` rounds the scales up to powers of two
    (``2^ceil(log2(max(amax, 1e-4) / 6))``), as the GEMMs need. Rounding: see
    :mod:`kernels.reference.fp4`.
    """
    fn = "per_token_cast_to_fp4"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16, float16 or float32, got {x.dtype}")
    _checks.check_dense(fn, "x", x, negated_ok=True)  # torch ops
    if x.dim() < 2:
        raise ValueError(f"{fn}: x must have >= 2 dims ([m, n] or [g, m, n]), got shape {tuple(x.shape)}")
    if x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"{fn}: the last dim of x must be positive and even (two codes per byte), got shape "
                         f"{tuple(x.shape)}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: x must be on a CPU or CUDA device, got {x.device}")
    use_ue8m0 = _checks.check_bool(fn, "use_ue8m0", use_ue8m0)
    gran_k = _check_gran_k(fn, gran_k)
    packed, sf = fp4_reference.per_token_cast_to_fp4(x, use_ue8m0, gran_k)
    return packed.view(torch.int8), sf.contiguous()


def cast_back_from_fp4(packed: torch.Tensor, sf: torch.Tensor, gran_k: int = 32) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp4`: float32 [..., m, n], exact.

    ``packed`` int8 or uint8 [..., m, n / 2] (>= 2 dims), ``sf`` float32 [..., m, ceil(n /
    gran_k)] on the same device (CPU or CUDA).
    """
    fn = "cast_back_from_fp4"
    if not isinstance(packed, torch.Tensor) or packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"{fn}: packed must be an int8 or uint8 tensor (two E2M1 codes per byte), got "
                        f"{getattr(packed, 'dtype', type(packed).__name__)}")
    if packed.dim() < 2:
        raise ValueError(f"{fn}: packed must have >= 2 dims, got shape {tuple(packed.shape)}")
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32:
        raise TypeError(f"{fn}: sf must be a float32 tensor, got {getattr(sf, 'dtype', type(sf).__name__)}")
    for name, t in (("packed", packed), ("sf", sf)):
        _checks.check_dense(fn, name, t, negated_ok=True)  # torch ops
    gran_k = _check_gran_k(fn, gran_k)
    expected = (*packed.shape[:-1], _ceil_div(packed.shape[-1] * 2, gran_k))
    if tuple(sf.shape) != expected:
        raise ValueError(f"{fn}: sf must have shape {list(expected)} for packed {list(packed.shape)} and "
                         f"gran_k={gran_k}, got {list(sf.shape)}")
    if packed.device != sf.device or packed.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: packed and sf must be on one CPU or CUDA device, got {packed.device} and "
                         f"{sf.device}")
    return fp4_reference.cast_back_from_fp4(packed.resolve_neg().view(torch.uint8), sf, gran_k)


def transform_sf_for_fp4_gemm(sf: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales (e.g. the SFB [G, N, K/32] of :func:`per_token_cast_to_fp4`)
    -> uint8 UE8M0 exponent bytes of the same shape, contiguous: ``byte = (bits >> 23) & 0xFF``,
    value ``2^(byte - 127)``.

    The FP8 x FP4 grouped GEMMs take these bytes as they are; given float32 they redo this
    conversion (and, on CUDA, a host sync for its check) on every call. Raises ValueError unless
    every value is a positive normal power of two; one host sync on CUDA.
    """
    fn = "transform_sf_for_fp4_gemm"
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32:
        raise TypeError(f"{fn}: sf must be a float32 tensor, got {getattr(sf, 'dtype', type(sf).__name__)}")
    _checks.check_dense(fn, "sf", sf, negated_ok=True)  # resolved (and refused) by its value check
    if sf.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: sf must be on a CPU or CUDA device, got {sf.device}")
    return _fp4.sf_to_ue8m0_bytes(fn, "sf", sf)


def cast_fp4_to_fp8_blocks(b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 weights -> FP8 weights with 128 x 128 block scales, the ``b`` of the FP8 grouped GEMMs.

    ``b`` = (B [G, N, K/2] int8/uint8, SFB [G, N, K/32] float8_e8m0fnu/uint8/float32), the FP4
    weights of :mod:`kernels.grouped` (K a multiple of 128), on a CPU or CUDA device. Returns
    ``(B e4m3 [G, N, K], SFB float32 [G, ceil(N/128), K/128])``, both contiguous. A block's scale is
    its largest 1x32 scale times 2^-6; a group more than 2^14 below it rounds to E4M3's subnormal
    step (exact otherwise): see :func:`kernels.reference.fp4.cast_fp4_to_fp8_blocks`, which CUDA
    reproduces bit for bit. The FP8 x FP4 GEMMs run this and the FP8 GEMM where a call has many
    rows per group (``MOE_FP4_STAGED`` in the README).
    """
    fn = "cast_fp4_to_fp8_blocks"
    packed, _ = _checks.unpack(fn, "b", b)
    k = 2 * packed.shape[2] if isinstance(packed, torch.Tensor) and packed.dim() == 3 else 0  # else named below
    b_t, sfb, g, n = _fp4.check_weights(fn, b, k)
    device = _checks.check_same_device(fn, [b_t, sfb])
    sfb_bytes = _fp4.sfb_bytes(fn, sfb)
    if device.type == "cpu":
        _fp4.check_sfb_range(fn, sfb_bytes)
        return fp4_reference.cast_fp4_to_fp8_blocks(b_t.view(torch.uint8), sfb_bytes)
    return _cast_fp4_to_fp8_blocks_on_gpu(fn, b_t, sfb_bytes, g, n, k, device)


def _cast_fp4_to_fp8_blocks_on_gpu(fn: str, b_t: torch.Tensor, sfb_bytes: torch.Tensor, g: int, n: int, k: int,
                                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA launch of :func:`cast_fp4_to_fp8_blocks` on checked weights (SFB as exponent bytes)."""
    _fp4.check_pointers(fn, b_t, sfb_bytes)
    out = torch.empty((g, n, k), dtype=torch.float8_e4m3fn, device=device)
    sf = torch.empty((g, _ceil_div(n, _BLOCK), k // _BLOCK), dtype=torch.float32, device=device)
    jit.native_module().cast_fp4_to_fp8_blocks(
        b_t.data_ptr(), b_t.stride(0), b_t.stride(1), sfb_bytes.data_ptr(), sfb_bytes.stride(0), sfb_bytes.stride(1),
        out.data_ptr(), sf.data_ptr(), g, n, k, device.index, _descriptors.current_stream(device))
    return out, sf
