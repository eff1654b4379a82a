"""M-grouped FP8 and FP8 x FP4 GEMMs for MoE experts, with DeepGEMM's signatures.

FP8 weights for every group: ``b = (B [G, N, K] float8_e4m3fn, SFB [G, ceil(N/128), K/128]
float32)``, groups stacked without gaps. Activations use 1x128 scales as in
:func:`kernels.fp8_gemm_nt` (the same for both weight formats).

FP4 weights (``m_grouped_fp8_fp4_gemm_nt_*``): ``b = (B [G, N, K/2] int8 or uint8, SFB [G, N,
K/32])``. B holds two E2M1 codes per byte (element ``2 j`` of a row in the low nibble of byte
``j``; bit 3 of a code is the sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}), K-major, groups
stacked without gaps. SFB holds one power-of-two scale per 1x32 (weight row x 32-deep K group),
as :func:`kernels.per_token_cast_to_fp4` makes them along K, in one of two forms:

* UE8M0 exponent bytes, ``float8_e8m0fnu`` or ``uint8`` (value ``2^(byte - 127)``), contiguous
  in the last dim with row and group strides that are multiples of 4 bytes: passed to the GPU as
  they are (the fast form);
* float32 powers of two (what ``per_token_cast_to_fp4`` returns): converted to exponent bytes on
  every call, which costs a pass over SFB and, on CUDA, one host sync to check that every value is
  a positive normal power of two. :func:`kernels.transform_sf_for_fp4_gemm` does the conversion
  once, ahead of time, and avoids both; a masked call with float32 SFB cannot be captured in a
  CUDA graph (its check syncs).

Layouts of the activations (both weight formats):

* Contiguous (prefill): rows sorted by group, ``m_indices`` int32 [M] gives each row's group;
  every aligned block of :func:`get_mk_alignment_for_contiguous_layout` rows belongs to one group
  or is padding (-1). The GPU reads a block's group from its first row and does not check the
  rest (that would cost a pass over ``m_indices``): a block that mixes groups is computed with the
  first row's weights. Rows of padding blocks, and of blocks whose id is outside [0, G), are not
  computed; padding rows inside a group's last block are computed from whatever A holds there.
  An alignment that is a multiple of 256 lets the FP8 kernel run 256-row tiles on large layouts
  (their group read from a tile's first row), at the cost of up to 255 padding rows per group.
* Masked (decode, CUDA graphs): ``A [G, max_m, K]``, ``masked_m`` int32 [G] on the device, so a
  call can be captured in a graph. On the GPU, rows of ``d[g]`` from ``masked_m[g]`` rounded up to
  a multiple of 8 on are left untouched, and the up to 7 rows between ``masked_m[g]`` and that
  multiple hold unspecified values; the CPU reference writes rows below ``masked_m[g]`` only.
  ``expected_m`` (rows per group you expect) only steers the heuristic.

CUDA tensors run the SM90 kernels (FP8: the one of :mod:`kernels.gemm`) on the current stream; CPU
tensors run the references in :mod:`kernels.reference.gemm`. For FP4 weights the GPU kernel
converts E2M1 to E4M3 in shared memory (exact) and runs the FP8 MMA. The per-32 scales are applied
as follows: within each 128-deep K block of a weight row, the four 1x32 scales are split into the
largest, ``2^e_max``, applied per output column in the FP32 promotion (with the activations' 1x128
scale), and the relative factors ``2^(e_j - e_max)``, folded into the conversion. Groups more than
2^11 below their block's largest scale are flushed to zero (their values are below 6 * 2^-12 of
that block's scale); the CPU reference keeps them. Calls with many rows per group (512 or more:
M / G contiguous, min(expected_m, max_m) masked; ``MOE_FP4_STAGED`` in the README) run staged
instead: :func:`kernels.cast_fp4_to_fp8_blocks` turns the weights into FP8 with 128 x 128 block
scales (exact for groups within 2^14 of their block's largest scale, rounded to E4M3's subnormal
step below), then the FP8 GEMM runs, so each weight is converted once per call rather than once per
M tile.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _checks, _descriptors, _fp4, _fp4_fragment, jit
from .gemm import fp8_workspace
from .quant import _cast_fp4_to_fp8_blocks_on_gpu
from .reference import gemm as reference

_BLOCK = _checks.BLOCK
_alignment = 128


def get_mk_alignment_for_contiguous_layout() -> int:
    """Rows per aligned block of the contiguous layout (each block belongs to one group)."""
    return _alignment


def set_mk_alignment_for_contiguous_layout(alignment: int) -> None:
    """Set the contiguous-layout alignment: a positive multiple of 128; multiples of 256 allow the FP8
    kernel's 256-row tiles. MoE layers size their exchange buffers with the alignment in force when
    they are built: set it before building them."""
    global _alignment
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment % 128:
        raise ValueError(f"set_mk_alignment_for_contiguous_layout: alignment must be a positive multiple of 128, "
                         f"got {alignment!r}")
    _alignment = alignment


def _check_weights(fn: str, b: object, k: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    b_t, sfb = _checks.unpack(fn, "b", b)
    b_t = _checks.check_fp8_operand(fn, "b[0] (B)", b_t, (None, None, k))
    g, n, _ = b_t.shape
    _checks.check_nk(fn, n, k)
    _checks.check_scales(fn, "b[1] (SFB)", sfb, (g, (n + _BLOCK - 1) // _BLOCK, k // _BLOCK))
    if g == 0:
        _checks.fail(fn, ValueError, "b must hold at least one group, got G = 0")
    return b_t, sfb, g, n


def _check_k(fn: str, k: int) -> None:
    if k % _BLOCK != 0 or k == 0:
        _checks.fail(fn, ValueError, f"K must be a positive multiple of 128, got {k}")


def _contiguous_activations(fn: str, a: object) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``a`` = (A [M, K] e4m3, SFA [M, K/128] f32); returns ``(A, SFA, M, K)``."""
    a_t, sfa = _checks.unpack(fn, "a", a)
    a_t = _checks.check_fp8_operand(fn, "a[0] (A)", a_t, (None, None))
    m, k = a_t.shape
    _check_k(fn, k)
    _checks.check_scales(fn, "a[1] (SFA)", sfa, (m, k // _BLOCK))
    return a_t, sfa, m, k


def _masked_activations(fn: str, a: object) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """``a`` = (A [G, max_m, K] e4m3, SFA [G, max_m, K/128] f32, groups stacked without gaps);
    returns ``(A, SFA, G, max_m, K)``."""
    a_t, sfa = _checks.unpack(fn, "a", a)
    a_t = _checks.check_fp8_operand(fn, "a[0] (A)", a_t, (None, None, None))
    groups, max_m, k = a_t.shape
    _check_k(fn, k)
    _checks.check_scales(fn, "a[1] (SFA)", sfa, (groups, max_m, k // _BLOCK))
    if groups > 1 and max_m and sfa.stride(0) != max_m * sfa.stride(1):
        _checks.fail(fn, ValueError, f"a[1] (SFA) must stack its groups without gaps (stride[0] == max_m * "
                                     f"stride[1]), got strides {sfa.stride()}")
    return a_t, sfa, groups, max_m, k


def _check_expected_m(fn: str, expected_m: object) -> None:
    # The launchers take it as a 32-bit int.
    if isinstance(expected_m, bool) or not isinstance(expected_m, int) or not 0 < expected_m < 2 ** 31:
        _checks.fail(fn, ValueError, f"expected_m must be a positive int below 2^31, got {expected_m!r}")


def _check_groups(fn: str, a_groups: int, b_groups: int) -> None:
    if a_groups != b_groups:
        _checks.fail(fn, ValueError, f"a[0] (A) has {a_groups} groups but b[0] (B) has {b_groups}")


def _check_index(fn: str, name: str, t: object, length: int) -> torch.Tensor:
    _checks.check_dense_args(fn, **{name: t})
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != length:
        _checks.fail(fn, ValueError, f"{name} must be an int32 tensor of shape [{length}], got "
                                     f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")
    if length and t.stride(0) != 1:
        _checks.fail(fn, ValueError, f"{name} must be contiguous, got stride {t.stride()}")
    return t


_FP8, _F32, _BF16, _I32 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int32


def psum_to_m_indices(fn: str, psum: object, m: int, groups: int, device: torch.device) -> torch.Tensor:
    """DeepGEMM's psum layout, ``psum`` int32 [G] (group g's rows end at psum[g] and start at psum[g - 1]
    rounded up to the contiguous alignment, group 0's at 0), as m_indices int32 [M] (-1 between groups
    and past the last), on the device without a host sync. Ends that decrease give ids in [0, G) that
    do not follow them; nothing reads outside the tensors."""
    _checks.check_dense_args(fn, grouped_layout=psum)
    if not isinstance(psum, torch.Tensor) or psum.dtype != torch.int32 or tuple(psum.shape) != (groups,) \
            or psum.stride(0) != 1:
        got = f"{getattr(psum, 'dtype', type(psum).__name__)} {list(getattr(psum, 'shape', ()))}"
        _checks.fail(fn, ValueError, f"grouped_layout (use_psum_layout=True) must be a contiguous int32 tensor "
                                     f"[{groups}] (one row end per group), got {got}")
    if psum.device != device:
        _checks.fail(fn, ValueError, f"all tensors must be on one device, got "
                                     f"{sorted({str(psum.device), str(device)})}")
    ends = psum.long()
    starts = torch.cat([ends.new_zeros(1), (ends[:-1] + _alignment - 1) // _alignment * _alignment])
    rows = torch.arange(m, device=device)
    group = torch.searchsorted(ends, rows, right=True)  # the first group whose rows end past r
    last = group.clamp(max=groups - 1)
    inside = (group < groups) & (rows >= starts[last])
    return torch.where(inside, group, -1).to(torch.int32)


def check_psum_flags(fn: str, use_psum_layout: object, ensure_zero_padding: object,
                     expected_m_for_psum_layout: object) -> bool:
    """DeepGEMM's contiguous-layout flags; returns ``use_psum_layout``. ``ensure_zero_padding`` and
    ``expected_m_for_psum_layout`` change nothing here (SM90 kernels write no zeros into padding rows,
    and M is planned from A's rows)."""
    _checks.check_bool(fn, "use_psum_layout", use_psum_layout)
    _checks.check_bool(fn, "ensure_zero_padding", ensure_zero_padding)
    if expected_m_for_psum_layout is not None and (not use_psum_layout or isinstance(expected_m_for_psum_layout, bool)
                                                   or not isinstance(expected_m_for_psum_layout, int)):
        _checks.fail(fn, ValueError, f"expected_m_for_psum_layout must be None, or an int with use_psum_layout=True, "
                                     f"got {expected_m_for_psum_layout!r}")
    return use_psum_layout


def _contiguous_indices(fn: str, a: object, b: object, grouped_layout: object, use_psum_layout: object,
                        ensure_zero_padding: object, expected_m_for_psum_layout: object) -> object:
    """The m_indices of an FP8 or FP8 x FP4 contiguous call: ``grouped_layout`` as it came, or with
    ``use_psum_layout`` the psum layout's, where ``a`` and ``b`` are (tensor, scales) pairs: M from A's
    rows, G from B's groups (their own checks come after). The common call compares three defaults."""
    if use_psum_layout is False and ensure_zero_padding is True and expected_m_for_psum_layout is None:
        return grouped_layout
    if not check_psum_flags(fn, use_psum_layout, ensure_zero_padding, expected_m_for_psum_layout):
        return grouped_layout
    a_t, _ = _checks.unpack(fn, "a", a)
    b_t, _ = _checks.unpack(fn, "b", b)
    if not isinstance(a_t, torch.Tensor) or a_t.dim() != 2 or not isinstance(b_t, torch.Tensor) or b_t.dim() != 3:
        _checks.fail(fn, ValueError, "a[0] must be [M, K] and b[0] [G, N, K] (packed: K / 2) tensors")
    return psum_to_m_indices(fn, grouped_layout, a_t.shape[0], b_t.shape[0], a_t.device)


def _same_device_index(tensors: tuple[torch.Tensor, ...]) -> int | None:
    """The tensors' common device index (-1: CPU or meta, which the full checks tell apart), or None."""
    device = tensors[0].get_device()
    return device if all(t.get_device() == device for t in tensors) else None


def _fast_tensors(a, b, d, index, pair: bool = True) -> tuple[torch.Tensor, ...] | None:
    """(A, SFA, B, SFB, D, index) where ``a`` and ``b`` are plain (tensor, scales) pairs (``pair``
    false: (A, SFA, B, D, index), ``b`` one tensor) and all are tensors, A, SFA, D and the index of
    the calls' dtypes (index int32), else None."""
    if type(a) not in (tuple, list) or len(a) != 2:
        return None
    if pair:
        if type(b) not in (tuple, list) or len(b) != 2:
            return None
        tensors = (a[0], a[1], b[0], b[1], d, index)
    else:
        tensors = (a[0], a[1], b, d, index)
    if not all(isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_neg() for t in tensors) \
            or tensors[0].dtype is not _FP8 or tensors[1].dtype is not _F32 or d.dtype is not _BF16 \
            or index.dtype is not _I32 or not _checks.writable(d):
        return None
    return tensors


def _fp8_weights_fast(b, k: int):
    """(G, N, the native call's weight arguments: B, ldb, SFB and its three strides) of FP8 weights
    as ``_check_weights`` accepts them (plain attribute reads), or None."""
    b_t, sfb = b
    if b_t.dtype is not _FP8 or sfb.dtype is not _F32:
        return None
    g, n, b_k = b_t.shape
    sfb_g, sfb_nb, sfb_kb = sfb.shape
    b_sg, ldb, b_inner = b_t.stride()
    sfb_sg, sfb_sn, sfb_sk = sfb.stride()
    if g == 0 or n == 0 or n % 8 or b_k != k or b_inner != 1 or ldb % 16 or ldb < k \
            or (g > 1 and b_sg != n * ldb) or (sfb_g, sfb_nb, sfb_kb) != (g, (n + _BLOCK - 1) // _BLOCK, k // _BLOCK) \
            or min(sfb_sg, sfb_sn, sfb_sk) < 0:
        return None
    return g, n, (b_t.data_ptr(), ldb, sfb.data_ptr(), sfb_sg, sfb_sn, sfb_sk)


_FP4_SCALE_BYTES = (torch.uint8, torch.float8_e8m0fnu)


def _fp4_weights_fast(b, k: int):
    """:func:`_fp8_weights_fast` for packed FP4 weights with UE8M0 byte scales (B, ldb in bytes, SFB
    and its group and row strides), as ``_fp4.check_weights`` and the CUDA path's pointer checks
    accept them; float32 scales (converted and checked per call) take the full path."""
    b_t, sfb = b
    if b_t.dtype not in _fp4.PACKED_DTYPES or sfb.dtype not in _FP4_SCALE_BYTES:
        return None
    g, n, half_k = b_t.shape
    b_sg, ldb, b_inner = b_t.stride()
    sfb_sg, sfb_sn, sfb_sk = sfb.stride()
    b_ptr, sfb_ptr = b_t.data_ptr(), sfb.data_ptr()
    if g == 0 or n == 0 or n % 8 or half_k * 2 != k or b_inner != 1 or ldb % 16 or ldb < half_k \
            or (g > 1 and b_sg != n * ldb) or tuple(sfb.shape) != (g, n, k // _fp4.GRAN_K) or sfb_sk != 1 \
            or sfb_sn % 4 or (g > 1 and sfb_sg % 4) or b_ptr % 16 or sfb_ptr % 4:
        return None
    return g, n, (b_ptr, ldb, sfb_ptr, sfb_sg, sfb_sn)


def _fragment_weights_fast(b, k: int, n: int, rows: int):
    """:func:`_fp8_weights_fast` for weights in ``transform_fp4_for_decode``'s layout (uint8 [G,
    K/128, ceil(N/64), 4352], contiguous, 16-byte aligned: B alone; N is D's) for calls of up to
    its ``rows`` = min(expected_m, max_m)."""
    if b.dtype is not torch.uint8 or rows > _fp4_fragment.kMaxDecodeRows or n == 0 or n % 8:
        return None
    g, kb, row_blocks, block_bytes = b.shape
    b_ptr = b.data_ptr()
    rows_per_block = _fp4_fragment.kRowsPerBlock
    if (kb, row_blocks, block_bytes) != (k // _BLOCK, (n + rows_per_block - 1) // rows_per_block,
                                         _fp4_fragment.kBlockBytes) or g == 0 \
            or b.stride() != (kb * row_blocks * block_bytes, row_blocks * block_bytes, block_bytes, 1) or b_ptr % 16:
        return None
    return g, n, (b_ptr,)


def _contiguous_launch_args(a, b, d, m_indices, weights: str = "fp8"):
    """The native call's arguments but the stream (the last one the device index, -1 for CPU and
    meta tensors), for tensors that the full checks would accept, or None: then the full checks
    run and name what is wrong. Plain attribute reads, each shape and stride unpacked once: this
    runs ahead of every launch. ``weights`` "fp4": the FP8 x FP4 call's (packed weights, byte
    scales; no alignment argument)."""
    fp4 = weights == "fp4"
    tensors = _fast_tensors(a, b, d, m_indices)
    if tensors is None:
        return None
    a_t, sfa = tensors[:2]
    try:
        m, k = a_t.shape
        if m == 0 or k == 0 or k % _BLOCK:
            return None
        weights = (_fp4_weights_fast if fp4 else _fp8_weights_fast)(b, k)
        if weights is None:
            return None
        g, n, weight_args = weights
        lda, a_inner = a_t.stride()
        sfa_m, sfa_kb = sfa.shape
        sfa_sm, sfa_sk = sfa.stride()
        d_m, d_n = d.shape
        ldd, d_inner = d.stride()
        (indices,) = m_indices.shape
        (index_stride,) = m_indices.stride()
    except (RuntimeError, TypeError, ValueError):  # RuntimeError: a nested tensor's shape
        return None
    if a_inner != 1 or lda % 16 or lda < k or (sfa_m, sfa_kb) != (m, k // _BLOCK) or min(sfa_sm, sfa_sk) < 0 \
            or (d_m, d_n) != (m, n) or d_inner != 1 or ldd % 8 or ldd < n or indices != m or index_stride != 1:
        return None
    device = _same_device_index(tensors)
    if device is None:
        return None
    return (a_t.data_ptr(), lda, sfa.data_ptr(), sfa_sm, sfa_sk, *weight_args, d.data_ptr(), ldd,
            m_indices.data_ptr(), m, n, k, g, *(() if fp4 else (_alignment,)), device)


def _masked_launch_args(a, b, d, masked_m, expected_m, weights: str = "fp8"):
    """:func:`_contiguous_launch_args` for the masked layout; ``weights``: "fp8", "fp4" (packed,
    byte scales) or "fragment" (``b`` in ``transform_fp4_for_decode``'s layout)."""
    tensors = _fast_tensors(a, b, d, masked_m, pair=weights != "fragment")
    if tensors is None or type(expected_m) is not int or expected_m <= 0:
        return None
    a_t, sfa = tensors[:2]
    try:
        groups, max_m, k = a_t.shape
        d_shape = d.shape
        if max_m == 0 or k == 0 or k % _BLOCK:
            return None
        if weights == "fragment":
            found = _fragment_weights_fast(b, k, d_shape[-1], min(expected_m, max_m))
        else:
            found = (_fp4_weights_fast if weights == "fp4" else _fp8_weights_fast)(b, k)
        if found is None:
            return None
        g, n, weight_args = found
        a_sg, lda, a_inner = a_t.stride()
        sfa_shape = sfa.shape
        sfa_sg, sfa_sm, sfa_sk = sfa.stride()
        d_sg, ldd, d_inner = d.stride()
        (masks,) = masked_m.shape
        (mask_stride,) = masked_m.stride()
    except (IndexError, RuntimeError, TypeError, ValueError):  # RuntimeError: a nested tensor's shape
        return None
    stacked = groups == 1 or (a_sg == max_m * lda and sfa_sg == max_m * sfa_sm and d_sg == max_m * ldd)
    if groups != g or a_inner != 1 or lda % 16 or lda < k or tuple(sfa_shape) != (g, max_m, k // _BLOCK) \
            or min(sfa_sg, sfa_sm, sfa_sk) < 0 or tuple(d_shape) != (g, max_m, n) or d_inner != 1 or ldd % 8 \
            or ldd < n or not stacked or masks != g or mask_stride != 1:
        return None
    device = _same_device_index(tensors)
    if device is None:
        return None
    return (a_t.data_ptr(), lda, sfa.data_ptr(), sfa_sm, sfa_sk, *weight_args, d.data_ptr(), ldd,
            masked_m.data_ptr(), max_m, expected_m, n, k, g, device)


def _launch_fast(name: str, d: object, call: tuple, launch_args: Callable[[], tuple | None]) -> bool:
    """The FP8 x FP4 and SwiGLU calls' fast paths, ahead of their full checks: on a plain CUDA ``d``
    (the tensor whose device the call runs on) the C++ entry point ``_C.<name>_tensors(*call, device,
    stream)`` checks and launches; where it declines, ``launch_args()`` (the Python fast check, or None
    where there is none) feeds ``_C.<name>``. False: neither took the call, and the full checks run and
    name what is wrong."""
    native = jit.native_module()
    if jit.TENSOR_API and type(d) is torch.Tensor:
        device = d.get_device()
        if device >= 0 and getattr(native, name + "_tensors")(*call, device, _descriptors.current_stream_of(device)):
            return True
    args = launch_args()
    if args is None or args[-1] < 0:
        return False
    getattr(native, name)(*args, _descriptors.current_stream_of(args[-1]))
    return True


def _fp4_staged(fn: str, a: object, b: object, expected_m: object = None) -> bool:
    """Whether an FP8 x FP4 call runs staged (``cast_fp4_to_fp8_blocks``, then the FP8 GEMM): CUDA
    weights with ``_fp4.STAGED_MIN_ROWS`` rows per group or more (contiguous: M / G; masked:
    ``min(expected_m, max_m)``), or as ``MOE_FP4_STAGED`` says. Malformed arguments answer False:
    the checks that follow name them."""
    policy = _fp4.staged_policy(fn)
    if policy is False:
        return False
    a_t = a[0] if isinstance(a, (tuple, list)) and len(a) == 2 else None  # pairs as every layer takes them
    b_t = b[0] if isinstance(b, (tuple, list)) and len(b) == 2 else None
    if not (isinstance(a_t, torch.Tensor) and isinstance(b_t, torch.Tensor) and b_t.is_cuda and b_t.dim() == 3
            and b_t.shape[0] > 0):
        return False
    if policy:
        return True
    if expected_m is None:
        rows = a_t.shape[0] / b_t.shape[0]
    elif type(expected_m) is int and a_t.dim() == 3:
        rows = min(expected_m, a_t.shape[1])
    else:
        return False
    return rows >= _fp4.STAGED_MIN_ROWS


def _staged_weights(fn: str, b_t: torch.Tensor, sfb_bytes: torch.Tensor, g0: int, g1: int, n: int, k: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups [g0, g1) of checked FP4 weights as FP8 weights with block scales."""
    return _cast_fp4_to_fp8_blocks_on_gpu(fn, b_t[g0:g1], sfb_bytes[g0:g1], g1 - g0, n, k, device)


def m_grouped_fp8_gemm_nt_contiguous(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                     d: torch.Tensor, m_indices: torch.Tensor, recipe=None, recipe_a=None,
                                     recipe_b=None, compiled_dims: str = "nk", disable_ue8m0_cast: bool = False,
                                     use_psum_layout: bool = False, ensure_zero_padding: bool = True,
                                     expected_m_for_psum_layout: int | None = None) -> None:
    """``d[r] = (A[r] * SFA[r]) @ (B[g] * SFB[g])^T`` with ``g = m_indices[r]``, in place.

    ``a`` = (A [M, K] e4m3, SFA [M, K/128] f32), ``b`` as in the module docstring, ``d`` [M, N]
    bf16, ``m_indices`` int32 [M]; with ``use_psum_layout`` DeepGEMM's int32 [G] of row prefix sums
    (:func:`psum_to_m_indices` turns it into m_indices on the device). The recipes,
    ``compiled_dims``, ``disable_ue8m0_cast``, ``ensure_zero_padding`` and
    ``expected_m_for_psum_layout`` are accepted for DeepGEMM compatibility (only the (1, 128, 128)
    recipe exists; :func:`check_psum_flags`).
    """
    fn = "m_grouped_fp8_gemm_nt_contiguous"
    m_indices = _contiguous_indices(fn, a, b, m_indices, use_psum_layout, ensure_zero_padding,
                                    expected_m_for_psum_layout)
    # Plain CUDA tensors and the default recipe: checked and launched in C++ (see fp8_gemm_nt).
    # The FP8 workspace: large layouts' K-major A scales are copied MN-major into it first.
    if jit.TENSOR_API and recipe is None and recipe_a is None and recipe_b is None and type(d) is torch.Tensor:
        device = d.get_device()
        if device >= 0:
            stream = _descriptors.current_stream_of(device)
            if jit.native_module().m_grouped_fp8_gemm_nt_contiguous_tensors(
                    a, b, d, m_indices, _alignment, device, stream, *fp8_workspace(device, stream)):
                return
    _checks.check_recipe(fn, recipe, recipe_a, recipe_b)
    args = _contiguous_launch_args(a, b, d, m_indices)
    if args is not None and args[-1] >= 0:
        stream = _descriptors.current_stream_of(args[-1])
        jit.native_module().m_grouped_fp8_gemm_nt_contiguous(*args, *fp8_workspace(args[-1], stream), stream)
        return
    a_t, sfa, m, k = _contiguous_activations(fn, a)
    b_t, sfb, g, n = _check_weights(fn, b, k)
    _checks.check_output(fn, d, (m, n))
    m_indices = _check_index(fn, "m_indices", m_indices, m)
    device = _checks.check_same_device(fn, [a_t, sfa, b_t, sfb, d, m_indices])
    if device.type == "cpu":
        reference.m_grouped_fp8_gemm_nt_contiguous((a_t, sfa), (b_t, sfb), m_indices, d)
        return
    if m == 0:
        return
    stream = _descriptors.current_stream(device)
    jit.native_module().m_grouped_fp8_gemm_nt_contiguous(
        a_t.data_ptr(), a_t.stride(0), sfa.data_ptr(), sfa.stride(0), sfa.stride(1),
        b_t.data_ptr(), b_t.stride(1), sfb.data_ptr(), sfb.stride(0), sfb.stride(1), sfb.stride(2),
        d.data_ptr(), d.stride(0), m_indices.data_ptr(), m, n, k, g, _alignment, device.index,
        *fp8_workspace(device.index, stream), stream)


def m_grouped_fp8_gemm_nt_masked(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                 d: torch.Tensor, masked_m: torch.Tensor, expected_m: int, recipe=None,
                                 recipe_a=None, recipe_b=None, compiled_dims: str = "nk",
                                 disable_ue8m0_cast: bool = False) -> None:
    """``d[g, :masked_m[g]] = (A[g] * SFA[g]) @ (B[g] * SFB[g])^T`` for every group, in place.

    ``a`` = (A [G, max_m, K] e4m3, SFA [G, max_m, K/128] f32 with groups stacked without gaps),
    ``d`` [G, max_m, N] bf16, ``masked_m`` int32 [G] (values are clamped to [0, max_m] on the
    GPU), ``expected_m`` a positive int. On the GPU, rows of ``d[g]`` from ``masked_m[g]`` rounded
    up to a multiple of 8 on are left untouched; the rows between hold unspecified values.
    """
    fn = "m_grouped_fp8_gemm_nt_masked"
    if jit.TENSOR_API and recipe is None and recipe_a is None and recipe_b is None and type(d) is torch.Tensor:
        device = d.get_device()
        if device >= 0 and jit.native_module().m_grouped_fp8_gemm_nt_masked_tensors(
                a, b, d, masked_m, expected_m, device, _descriptors.current_stream_of(device)):
            return
    _checks.check_recipe(fn, recipe, recipe_a, recipe_b)
    args = _masked_launch_args(a, b, d, masked_m, expected_m)
    if args is not None and args[-1] >= 0:
        jit.native_module().m_grouped_fp8_gemm_nt_masked(*args, _descriptors.current_stream_of(args[-1]))
        return
    _check_expected_m(fn, expected_m)
    a_t, sfa, groups, max_m, k = _masked_activations(fn, a)
    b_t, sfb, g, n = _check_weights(fn, b, k)
    _check_groups(fn, groups, g)
    _checks.check_output(fn, d, (g, max_m, n))
    masked_m = _check_index(fn, "masked_m", masked_m, g)
    device = _checks.check_same_device(fn, [a_t, sfa, b_t, sfb, d, masked_m])
    if device.type == "cpu":
        reference.m_grouped_fp8_gemm_nt_masked((a_t, sfa), (b_t, sfb), masked_m, d)
        return
    if max_m == 0:
        return
    jit.native_module().m_grouped_fp8_gemm_nt_masked(
        a_t.data_ptr(), a_t.stride(1), sfa.data_ptr(), sfa.stride(1), sfa.stride(2),
        b_t.data_ptr(), b_t.stride(1), sfb.data_ptr(), sfb.stride(0), sfb.stride(1), sfb.stride(2),
        d.data_ptr(), d.stride(1), masked_m.data_ptr(), max_m, expected_m, n, k, g, device.index,
        _descriptors.current_stream(device))


def m_grouped_fp8_fp4_gemm_nt_contiguous(a: tuple[torch.Tensor, torch.Tensor],
                                         b: tuple[torch.Tensor, torch.Tensor], d: torch.Tensor,
                                         m_indices: torch.Tensor, recipe=None, recipe_a=None, recipe_b=None,
                                         compiled_dims: str = "nk", disable_ue8m0_cast: bool = False,
                                         use_psum_layout: bool = False, ensure_zero_padding: bool = True,
                                         expected_m_for_psum_layout: int | None = None) -> None:
    """:func:`m_grouped_fp8_gemm_nt_contiguous` with FP4 weights, in place.

    ``a`` = (A [M, K] e4m3, SFA [M, K/128] f32), ``b`` = (B [G, N, K/2] int8/uint8, SFB [G, N,
    K/32] float8_e8m0fnu/uint8/float32) as in the module docstring, ``d`` [M, N] bf16,
    ``m_indices`` int32 [M] (the contiguous layout of the FP8 function).
    """
    fn = "m_grouped_fp8_fp4_gemm_nt_contiguous"
    _checks.check_recipe(fn, recipe, recipe_a, recipe_b, weights=(1, _fp4.GRAN_K))
    m_indices = _contiguous_indices(fn, a, b, m_indices, use_psum_layout, ensure_zero_padding,
                                    expected_m_for_psum_layout)
    # The C++ entry point leaves calls that may run staged to this function; so does the Python one.
    if _launch_fast(fn, d, (a, b, d, m_indices), lambda: None if _fp4_staged(fn, a, b) else
                    _contiguous_launch_args(a, b, d, m_indices, weights="fp4")):
        return
    staged = _fp4_staged(fn, a, b)
    a_t, sfa, m, k = _contiguous_activations(fn, a)
    b_t, sfb, g, n = _fp4.check_weights(fn, b, k)
    _checks.check_output(fn, d, (m, n))
    m_indices = _check_index(fn, "m_indices", m_indices, m)
    device = _checks.check_same_device(fn, [a_t, sfa, b_t, sfb, d, m_indices])
    sfb_bytes = _fp4.sfb_bytes(fn, sfb)
    if device.type == "cpu":
        reference.m_grouped_fp8_fp4_gemm_nt_contiguous((a_t, sfa), (b_t, _fp4.sfb_float32(fn, sfb_bytes)), m_indices, d)
        return
    _fp4.check_pointers(fn, b_t, sfb_bytes)
    if m == 0:
        return
    if staged:
        # A chunk of groups [g0, g1) sees group ids shifted by g0: the other groups' rows fall outside
        # [0, g1 - g0), which the FP8 kernel skips, as it does padding.
        for g0, g1 in _fp4.staged_chunks(g, n, k):
            m_grouped_fp8_gemm_nt_contiguous((a_t, sfa), _staged_weights(fn, b_t, sfb_bytes, g0, g1, n, k, device), d,
                                             m_indices if g0 == 0 and g1 == g else m_indices - g0)
        return
    jit.native_module().m_grouped_fp8_fp4_gemm_nt_contiguous(
        a_t.data_ptr(), a_t.stride(0), sfa.data_ptr(), sfa.stride(0), sfa.stride(1),
        b_t.data_ptr(), b_t.stride(1), sfb_bytes.data_ptr(), sfb_bytes.stride(0), sfb_bytes.stride(1),
        d.data_ptr(), d.stride(0), m_indices.data_ptr(), m, n, k, g, device.index,
        _descriptors.current_stream(device))


def m_grouped_fp8_fp4_gemm_nt_masked(a: tuple[torch.Tensor, torch.Tensor],
                                     b: tuple[torch.Tensor, torch.Tensor] | torch.Tensor, d: torch.Tensor,
                                     masked_m: torch.Tensor, expected_m: int, recipe=None, recipe_a=None,
                                     recipe_b=None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False) -> None:
    """:func:`m_grouped_fp8_gemm_nt_masked` with FP4 weights, in place.

    ``a`` = (A [G, max_m, K] e4m3, SFA [G, max_m, K/128] f32), ``b`` = (B [G, N, K/2]
    int8/uint8, SFB [G, N, K/32] float8_e8m0fnu/uint8/float32) as in the module docstring, or the
    same weights in the decode layout, ``transform_fp4_for_decode(B, SFB)`` (uint8 [G, K/128,
    ceil(N/64), 4352], min(expected_m, max_m) <= 32: about 1.8x faster than the packed form;
    the layout keeps only ceil(N/64), so N comes from ``d``, which must be the weights' N: a ``d``
    up to 63 columns wider gets zeros there instead of an error);
    ``d`` [G, max_m, N] bf16, ``masked_m`` int32 [G], ``expected_m`` a positive int. Rows of
    ``d[g]`` from ``masked_m[g]`` rounded up to a multiple of 8 on are left untouched on the GPU,
    the rows between are unspecified, as for the FP8 function. Packed weights run staged (the FP4 ->
    FP8 cast, then the FP8 kernel; see the module docstring) where min(expected_m, max_m) is 512 or
    more, else the swapped kernel (weights as wgmma's register operand) where it is at most 32 or
    65-128, the converter kernel elsewhere (``MOE_FP4_STAGED`` and ``MOE_FP4_SWAP_AB`` in the README
    pick one for A/B runs).
    """
    fn = "m_grouped_fp8_fp4_gemm_nt_masked"
    _checks.check_recipe(fn, recipe, recipe_a, recipe_b, weights=(1, _fp4.GRAN_K))
    if isinstance(b, torch.Tensor):
        _fp4_fragment.m_grouped_fp8_fp4_gemm_nt_masked_fragment(a, b, d, masked_m, expected_m, fn)
        return
    if _launch_fast(fn, d, (a, b, d, masked_m, expected_m), lambda: None if _fp4_staged(fn, a, b, expected_m) else
                    _masked_launch_args(a, b, d, masked_m, expected_m, weights="fp4")):
        return
    staged = _fp4_staged(fn, a, b, expected_m)
    _check_expected_m(fn, expected_m)
    a_t, sfa, groups, max_m, k = _masked_activations(fn, a)
    b_t, sfb, g, n = _fp4.check_weights(fn, b, k)
    _check_groups(fn, groups, g)
    _checks.check_output(fn, d, (g, max_m, n))
    masked_m = _check_index(fn, "masked_m", masked_m, g)
    device = _checks.check_same_device(fn, [a_t, sfa, b_t, sfb, d, masked_m])
    sfb_bytes = _fp4.sfb_bytes(fn, sfb)
    if device.type == "cpu":
        reference.m_grouped_fp8_fp4_gemm_nt_masked((a_t, sfa), (b_t, _fp4.sfb_float32(fn, sfb_bytes)), masked_m, d)
        return
    _fp4.check_pointers(fn, b_t, sfb_bytes)
    if max_m == 0:
        return
    if staged:
        for g0, g1 in _fp4.staged_chunks(g, n, k):
            # The cast inline: a chunk's FP8 weights are freed before the next chunk's are made.
            m_grouped_fp8_gemm_nt_masked((a_t[g0:g1], sfa[g0:g1]), _staged_weights(fn, b_t, sfb_bytes, g0, g1, n, k,
                                                                                    device),
                                         d[g0:g1], masked_m[g0:g1], expected_m)
        return
    jit.native_module().m_grouped_fp8_fp4_gemm_nt_masked(
        a_t.data_ptr(), a_t.stride(1), sfa.data_ptr(), sfa.stride(1), sfa.stride(2),
        b_t.data_ptr(), b_t.stride(1), sfb_bytes.data_ptr(), sfb_bytes.stride(0), sfb_bytes.stride(1),
        d.data_ptr(), d.stride(1), masked_m.data_ptr(), max_m, expected_m, n, k, g, device.index,
        _descriptors.current_stream(device))
