"""M-grouped BF16 GEMMs for MoE experts with bfloat16 weights, with DeepGEMM's signatures.

``b`` [G, N, K] bfloat16, K-major, groups stacked without gaps; FP32 accumulation, bfloat16 ``d``.
The layouts of the activations are those of :mod:`kernels.grouped`:

* Contiguous (prefill): ``a`` [M, K], ``m_indices`` int32 [M] gives each row's group (or DeepGEMM's
  psum layout, turned into it); every
  aligned block of :func:`kernels.get_mk_alignment_for_contiguous_layout` rows belongs to one
  group or is padding (-1). The GPU reads a block's group from its first row and does not check
  the rest: a block that mixes groups is computed with the first row's weights. Rows of padding
  blocks, and of blocks whose id is outside [0, G), are not written; padding rows inside a group's
  last block are computed from whatever A holds there (the CPU reference writes no -1 row).
* Masked (decode, CUDA graphs): ``a`` [G, max_m, K], ``masked_m`` int32 [G] on the device (values
  clamped to [0, max_m]). On the GPU, rows of ``d[g]`` from ``masked_m[g]`` rounded up to a
  multiple of 8 on are left untouched, and the up to 7 rows between hold unspecified values; the
  CPU reference writes rows below ``masked_m[g]`` only. ``expected_m`` only steers the heuristic.

CUDA tensors run the SM90 BF16 kernel (``impls/sm90_bf16_gemm.cuh``) on the current stream; CPU
tensors run :mod:`kernels.reference.gemm`. ``compiled_dims`` is checked and otherwise ignored: the
grouped kernels compile N and K and keep M (rows, or max_m) a run-time argument.
"""

from __future__ import annotations

import torch

from . import _checks, _descriptors, jit
from .gemm import _check_compiled_dims
from .grouped import _check_expected_m, _check_index, check_psum_flags, psum_to_m_indices
from .reference import gemm as reference

_BF16 = torch.bfloat16


def _check_operand(fn: str, name: str, t: object, dims: int) -> torch.Tensor:
    """A K-major bfloat16 tensor of ``dims`` dimensions, rows 16-byte aligned, groups (dims 3) stacked."""
    _checks.check_dense_args(fn, **{name: t})
    if not isinstance(t, torch.Tensor) or t.dtype != _BF16 or t.dim() != dims:
        _checks.fail(fn, TypeError, f"{name} must be a {dims}-D bfloat16 tensor, got "
                                    f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")
    stride = t.stride()
    # K = 0 has no layout to check (torch gives such a tensor unit strides): the K check names it.
    if t.shape[-1] and (stride[-1] != 1 or stride[-2] % 8 or stride[-2] < t.shape[-1]):
        _checks.fail(fn, ValueError, f"{name} must be K-major with a row stride that is a multiple of 8, "
                                     f"got strides {stride}")
    if dims == 3 and t.shape[0] > 1 and t.shape[1] > 0 and stride[0] != t.shape[1] * stride[1]:
        _checks.fail(fn, ValueError, f"{name} must stack its groups without gaps (stride[0] == "
                                     f"{t.shape[1]} * stride[1]), got strides {stride}")
    return t


def _check_weights(fn: str, b: object, k: int) -> tuple[int, int]:
    """``b`` [G, N, K]: returns ``(G, N)``."""
    b = _check_operand(fn, "b", b, 3)
    g, n, b_k = b.shape
    if b_k != k:
        _checks.fail(fn, ValueError, f"b must have shape [G, N, {k}] (K of a), got {list(b.shape)}")
    if k == 0 or k % 64 or n == 0 or n % 8:
        _checks.fail(fn, ValueError, f"N must be a positive multiple of 8 and K of 64, got N={n}, K={k}")
    if g == 0:
        _checks.fail(fn, ValueError, "b must hold at least one group, got G = 0")
    return g, n


def _run(fn: str, tensors: tuple[torch.Tensor, ...], rows: int, sizes: tuple[int, ...]) -> None:
    """The checked call ``fn`` on (A, B, D, index): the reference on CPU tensors, else (rows > 0) the
    native entry point of the same name with the four pointers, then ``sizes`` (strides and shapes in
    its argument order), the device and the current stream."""
    device = _checks.check_same_device(fn, list(tensors))
    a, b, d, index = tensors
    if device.type == "cpu":
        getattr(reference, fn)(a, b, index, d)
    elif rows:
        pointers = (a.data_ptr(), b.data_ptr(), d.data_ptr(), index.data_ptr())
        getattr(jit.native_module(), fn)(*pointers, *sizes, device.index, _descriptors.current_stream(device))


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      grouped_layout: torch.Tensor, compiled_dims: str = "nk",
                                      use_psum_layout: bool = False, ensure_zero_padding: bool = True,
                                      expected_m_for_psum_layout: int | None = None) -> None:
    """``d[r] = A[r] @ B[g]^T`` for each row ``r`` of group ``g``, in place.

    ``a`` [M, K] bf16, ``b`` [G, N, K] bf16, ``d`` [M, N] bf16. N a multiple of 8, K of 64.
    ``grouped_layout``: m_indices int32 [M] (each row's group, -1 for padding), or with
    ``use_psum_layout`` DeepGEMM's int32 [G] of row prefix sums (group g's rows from psum[g - 1]
    rounded up to :func:`kernels.get_mk_alignment_for_contiguous_layout` to psum[g]), turned into
    m_indices on the device. ``compiled_dims``, ``ensure_zero_padding`` and
    ``expected_m_for_psum_layout`` are accepted for DeepGEMM compatibility (its SM90 kernels ignore
    the zero padding, which Blackwell's psum kernels write; M is planned from A's rows).
    """
    fn = "m_grouped_bf16_gemm_nt_contiguous"
    check_psum_flags(fn, use_psum_layout, ensure_zero_padding, expected_m_for_psum_layout)
    _check_compiled_dims(compiled_dims, fn)
    a = _check_operand(fn, "a", a, 2)
    m, k = a.shape
    g, n = _check_weights(fn, b, k)
    _checks.check_output(fn, d, (m, n))
    if use_psum_layout:
        m_indices = psum_to_m_indices(fn, grouped_layout, m, g, a.device)
    else:
        m_indices = _check_index(fn, "grouped_layout", grouped_layout, m)
    _run(fn, (a, b, d, m_indices), m, (a.stride(0), b.stride(1), d.stride(0), m, n, k, g))


def m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor,
                                  expected_m: int, compiled_dims: str = "nk") -> None:
    """``d[g, :masked_m[g]] = A[g, :masked_m[g]] @ B[g]^T`` for every group, in place.

    ``a`` [G, max_m, K] bf16 and ``d`` [G, max_m, N] bf16 with groups stacked without gaps, ``b``
    [G, N, K] bf16, ``masked_m`` int32 [G] (clamped to [0, max_m] on the GPU), ``expected_m`` a
    positive int (the heuristic's rows per group). On the GPU, rows of ``d[g]`` from ``masked_m[g]``
    rounded up to a multiple of 8 on are left untouched; the rows between hold unspecified values.
    """
    fn = "m_grouped_bf16_gemm_nt_masked"
    _check_expected_m(fn, expected_m)
    _check_compiled_dims(compiled_dims, fn)
    a = _check_operand(fn, "a", a, 3)
    groups, max_m, k = a.shape
    g, n = _check_weights(fn, b, k)
    if groups != g:
        _checks.fail(fn, ValueError, f"a has {groups} groups but b has {g}")
    _checks.check_output(fn, d, (g, max_m, n))
    masked_m = _check_index(fn, "masked_m", masked_m, g)
    _run(fn, (a, b, d, masked_m), max_m, (a.stride(1), b.stride(1), d.stride(1), max_m, expected_m, n, k, g))
