"""The experts' L1 GEMM with SwiGLU in its epilogue: ``act = silu(gate) * up * w`` quantized to E4M3
with one float32 scale per 1 x 128, written by the GEMM itself, so the bf16 ``[gate | up]`` rows
([M, 2I], 4 I bytes a row) are neither stored nor read back by a second kernel
(:func:`kernels.swiglu_quant_fp8`). The result is what ``m_grouped_fp8_gemm_nt_*`` into bf16 followed
by ``swiglu_quant_fp8`` give: every accumulator is rounded to bf16 before SwiGLU, as that path's D is.
Not yet faster than that pair (H100, 32 experts of 4096 x 7168: 0.70-0.83x its time at 512-8192 rows per
expert, 0.90-1.01x masked; bench/RESULTS.md, sessions 37-38): its 128-column tiles run slower than the
pair's 128 x 192 ones: pairs of 128 x 128 tiles move 1.5x the staged GEMM's bytes from L2 and 2.3x from
DRAM (ncu, session 39), and neither a shorter epilogue (session 38) nor one warpgroup's epilogue beside the
other's K loop (a stagger, session 39) bought time. ``MOE_SWIGLU_WIDE=1`` runs 128 x 256 tiles instead (both
n-blocks of an act scale group in one K loop): a third of the DRAM bytes, not yet faster (session 39).

Weights (the ``l1`` of ``moe_runtime.transform_weights_for_mega_moe(..., target="sm90")``):
``b = (B [G, 2I, K] float8_e4m3fn, SFB [G, 2I/128, 2, K/128] float32)``. B's rows are gate/up
interleaved in 16-row slabs (rows ``16j .. 16j + 7`` are gate rows ``8j ..``, rows ``16j + 8 .. 16j +
15`` the up rows of the same channels), so a thread of the GEMM holds a channel's gate and up
accumulators together; SFB holds one scale per 128-row block of B and half (``[g, b, 0]`` its gate
rows', ``[g, b, 1]`` its up rows'), with ``stride[1] == 2 * stride[2]``. I must be a multiple of 128
(one act scale per 128 channels).

Outputs, written in place: ``d = (act, act_sf)`` with act float8_e4m3fn ``[M, I]`` (masked: ``[G,
max_m, I]``) with unit stride along I and an even row stride, and act_sf float32 ``[M, I/128]``
(masked: ``[G, max_m, I/128]``) in any strides (contiguous, or MN-major as the next GEMM loads it by
TMA: :func:`kernels.empty_activation_scales`). ``weights`` float32 ``[M]`` (masked ``[G, max_m]``),
contiguous: each row's top-k weight.

Layouts as :mod:`kernels.grouped`'s. Contiguous: rows of padding blocks are left untouched, padding
rows inside a group's last block get unspecified values. Masked: rows from ``masked_m[g]`` on are left
untouched. CUDA tensors run the SM90 kernel (impls/sm90_fp8_gemm.cuh, ``kSwiGlu``) on the current
stream, CPU tensors :mod:`kernels.reference.swiglu`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _checks, _descriptors, jit
from .grouped import (_check_expected_m, _check_groups, _check_index, _contiguous_activations, _launch_fast,
                      _masked_activations)
from .reference import swiglu as reference

_BLOCK = _checks.BLOCK


def _check_weights(fn: str, b: object, k: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``b`` = (B [G, 2I, K] e4m3 interleaved, SFB [G, 2I/128, 2, K/128] f32); returns (B, SFB, G, 2I)."""
    b_t, sfb = _checks.unpack(fn, "b", b)
    b_t = _checks.check_fp8_operand(fn, "b[0] (B)", b_t, (None, None, k))
    g, n, _ = b_t.shape
    if g == 0:
        _checks.fail(fn, ValueError, "b must hold at least one group, got G = 0")
    if n == 0 or n % (2 * _BLOCK):
        _checks.fail(fn, ValueError, f"b[0] (B) must have 2I rows with I a positive multiple of 128 (one act scale "
                                     f"per 128 channels), got {n}")
    _checks.check_scales(fn, "b[1] (SFB)", sfb, (g, n // _BLOCK, 2, k // _BLOCK))
    if sfb.stride(1) != 2 * sfb.stride(2):
        _checks.fail(fn, ValueError, f"b[1] (SFB) must hold a block's two halves as consecutive rows (stride[1] == "
                                     f"2 * stride[2]), got strides {sfb.stride()}")
    return b_t, sfb, g, n


def _check_outputs(fn: str, d: object, rows: tuple[int, ...], inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    act, act_sf = _checks.unpack(fn, "d", d)
    _checks.check_dense_args(fn, **{"d[0] (act)": act, "d[1] (act_sf)": act_sf})
    if not isinstance(act, torch.Tensor) or act.dtype != torch.float8_e4m3fn or tuple(act.shape) != (*rows, inter):
        _checks.fail(fn, ValueError, f"d[0] (act) must be a float8_e4m3fn tensor of shape {[*rows, inter]}, got "
                                     f"{getattr(act, 'dtype', type(act).__name__)} {list(getattr(act, 'shape', ()))}")
    if act.stride(-1) != 1 or act.stride(-2) % 2 or act.stride(-2) < inter or act.data_ptr() % 2:
        _checks.fail(fn, ValueError, f"d[0] (act) must have unit stride along I and an even row stride of at least "
                                     f"I = {inter} at an even address, got strides {act.stride()}")
    sf_shape = (*rows, inter // _BLOCK)
    if not isinstance(act_sf, torch.Tensor) or act_sf.dtype != torch.float32 or tuple(act_sf.shape) != sf_shape:
        _checks.fail(fn, ValueError, f"d[1] (act_sf) must be a float32 tensor of shape {list(sf_shape)}, got "
                                     f"{getattr(act_sf, 'dtype', type(act_sf).__name__)} "
                                     f"{list(getattr(act_sf, 'shape', ()))}")
    for name, t in (("d[0] (act)", act), ("d[1] (act_sf)", act_sf)):
        _checks.check_writable(fn, name, t)
        if len(rows) == 2 and rows[0] > 1 and rows[1] and t.stride(0) != rows[1] * t.stride(1):
            _checks.fail(fn, ValueError, f"{name} must stack its groups without gaps (stride[0] == max_m * "
                                         f"stride[1]), got strides {t.stride()}")
    # The kernel addresses the scales as [G x max_m, I/128] (masked groups stacked, as just checked).
    if not _rows_apart(act_sf, math.prod(rows)):
        _checks.fail(fn, ValueError, f"d[1] (act_sf) must hold every (row, group) scale at its own address "
                                     f"(no overlapping or broadcast elements), got strides {act_sf.stride()}")
    return act, act_sf


def _rows_apart(sf: torch.Tensor, rows: int) -> bool:
    """Whether ``rows`` rows of ``sf`` at its second-to-last stride, by its last dim, address distinct
    elements: non-negative strides, the larger one past the whole extent of the smaller (K-major or
    MN-major layouts, padded or not)."""
    groups, (stride_m, stride_k) = sf.shape[-1], sf.stride()[-2:]
    if rows <= 1 or groups <= 1:
        return min(stride_m if rows > 1 else 1, stride_k if groups > 1 else 1) >= 1
    (inner, inner_n), (outer, _) = sorted([(stride_m, rows), (stride_k, groups)])
    return inner >= 1 and outer >= inner * inner_n


def _check_row_weights(fn: str, weights: object, rows: tuple[int, ...]) -> torch.Tensor:
    _checks.check_dense_args(fn, weights=weights)
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 or tuple(weights.shape) != rows \
            or not weights.is_contiguous():
        _checks.fail(fn, ValueError, f"weights must be a contiguous float32 tensor of shape {list(rows)}, got "
                                     f"{getattr(weights, 'dtype', type(weights).__name__)} "
                                     f"{list(getattr(weights, 'shape', ()))}")
    return weights


@dataclass
class _Call:
    """A checked call: what the CPU reference takes, and the native entry point's arguments (device
    last: -1 on the CPU; the stream follows)."""
    a: tuple[torch.Tensor, torch.Tensor]
    b: tuple[torch.Tensor, torch.Tensor]
    index: torch.Tensor
    weights: torch.Tensor
    act: torch.Tensor
    act_sf: torch.Tensor
    rows: int  # M (contiguous) or max_m (masked): 0 launches nothing
    native: tuple


def _contiguous_call(a: object, b: object, d: object, m_indices: object, weights: object) -> _Call:
    fn = "m_grouped_fp8_gemm_nt_swiglu_contiguous"
    a_t, sfa, m, k = _contiguous_activations(fn, a)
    b_t, sfb, g, n = _check_weights(fn, b, k)
    act, act_sf = _check_outputs(fn, d, (m,), n // 2)
    m_indices = _check_index(fn, "m_indices", m_indices, m)
    weights = _check_row_weights(fn, weights, (m,))
    device = _checks.check_same_device(fn, [a_t, sfa, b_t, sfb, act, act_sf, m_indices, weights])
    native = (*_native_head(0, a_t, sfa, b_t, sfb, act, act_sf, weights, m_indices), m, n, k, g, _device_index(device))
    return _Call((a_t, sfa), (b_t, sfb), m_indices, weights, act, act_sf, m, native)


def _masked_call(a: object, b: object, d: object, masked_m: object, expected_m: object, weights: object) -> _Call:
    fn = "m_grouped_fp8_gemm_nt_swiglu_masked"
    _check_expected_m(fn, expected_m)
    a_t, sfa, groups, max_m, k = _masked_activations(fn, a)
    b_t, sfb, g, n = _check_weights(fn, b, k)
    _check_groups(fn, groups, g)
    act, act_sf = _check_outputs(fn, d, (g, max_m), n // 2)
    masked_m = _check_index(fn, "masked_m", masked_m, g)
    weights = _check_row_weights(fn, weights, (g, max_m))
    device = _checks.check_same_device(fn, [a_t, sfa, b_t, sfb, act, act_sf, masked_m, weights])
    native = (*_native_head(1, a_t, sfa, b_t, sfb, act, act_sf, weights, masked_m), max_m, expected_m, n, k, g,
              _device_index(device))
    return _Call((a_t, sfa), (b_t, sfb), masked_m, weights, act, act_sf, max_m, native)


def _native_head(r: int, a_t, sfa, b_t, sfb, act, act_sf, weights, index) -> tuple:
    """Both native entry points' arguments up to the index: pointers and strides, rows along dim ``r``
    (0 contiguous, 1 masked)."""
    return (a_t.data_ptr(), a_t.stride(r), sfa.data_ptr(), sfa.stride(r), sfa.stride(r + 1),
            b_t.data_ptr(), b_t.stride(1), sfb.data_ptr(), sfb.stride(0), sfb.stride(2), sfb.stride(3),
            act.data_ptr(), act.stride(r), act_sf.data_ptr(), act_sf.stride(r), act_sf.stride(r + 1),
            weights.data_ptr(), index.data_ptr())


def _device_index(device: torch.device) -> int:
    return -1 if device.type == "cpu" else device.index


def _contiguous_launch_args(a, b, d, m_indices, weights) -> tuple:
    """The full checks' native arguments (device last), for the tests against the C++ checks."""
    return _contiguous_call(a, b, d, m_indices, weights).native


def _masked_launch_args(a, b, d, masked_m, expected_m, weights) -> tuple:
    return _masked_call(a, b, d, masked_m, expected_m, weights).native


def _launch(name: str, call: _Call, cpu_reference) -> None:
    """A checked call: the CPU reference on CPU tensors, else ``_C.<name>`` where there are rows."""
    if call.native[-1] < 0:
        cpu_reference(call.a, call.b, call.index, call.weights, call.act, call.act_sf)
    elif call.rows:
        getattr(jit.native_module(), name)(*call.native, _descriptors.current_stream_of(call.native[-1]))


def m_grouped_fp8_gemm_nt_swiglu_contiguous(a: tuple[torch.Tensor, torch.Tensor],
                                            b: tuple[torch.Tensor, torch.Tensor],
                                            d: tuple[torch.Tensor, torch.Tensor], m_indices: torch.Tensor,
                                            weights: torch.Tensor) -> None:
    """``act[r], act_sf[r] = quant(SwiGLU((A[r] * SFA[r]) @ (B[g] * SFB[g])^T) * weights[r])`` with
    ``g = m_indices[r]``, in place.

    ``a`` = (A [M, K] e4m3, SFA [M, K/128] f32), ``b`` and ``d`` = (act [M, I], act_sf [M, I/128]) as in
    the module docstring, ``m_indices`` int32 [M] (aligned blocks of
    ``get_mk_alignment_for_contiguous_layout()`` rows), ``weights`` float32 [M].
    """
    name = "m_grouped_fp8_gemm_nt_swiglu_contiguous"
    # The C++ checks and launch first (the weights name the device); where they decline, the full checks.
    if not _launch_fast(name, weights, (a, b, d, m_indices, weights), lambda: None):
        _launch(name, _contiguous_call(a, b, d, m_indices, weights),
                reference.m_grouped_fp8_gemm_nt_swiglu_contiguous)


def m_grouped_fp8_gemm_nt_swiglu_masked(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                        d: tuple[torch.Tensor, torch.Tensor], masked_m: torch.Tensor,
                                        expected_m: int, weights: torch.Tensor) -> None:
    """The masked layout of :func:`m_grouped_fp8_gemm_nt_swiglu_contiguous`: rows ``r < masked_m[g]`` of
    each group, in place.

    ``a`` = (A [G, max_m, K] e4m3, SFA [G, max_m, K/128] f32, groups stacked without gaps), ``d`` = (act
    [G, max_m, I], act_sf [G, max_m, I/128]), ``masked_m`` int32 [G] (clamped to [0, max_m] on the GPU),
    ``expected_m`` a positive int (steers the tile choice only), ``weights`` float32 [G, max_m].
    """
    name = "m_grouped_fp8_gemm_nt_swiglu_masked"
    if not _launch_fast(name, weights, (a, b, d, masked_m, expected_m, weights), lambda: None):
        _launch(name, _masked_call(a, b, d, masked_m, expected_m, weights),
                reference.m_grouped_fp8_gemm_nt_swiglu_masked)
