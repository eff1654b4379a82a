"""MoE data movement around the grouped GEMMs.

:func:`moe_combine`: each token's output as the float32 sum, in slot order, of the expert-output
rows of its top-k slots, rounded once — the combine of :mod:`moe_runtime.backends.staged` in one
launch on CUDA (the pure-torch version on the CPU, bit for bit the same arithmetic).
"""

from __future__ import annotations

import torch

from . import _checks, _descriptors, jit

_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _combine_reference(src: torch.Tensor, rows: torch.Tensor | None, routed: torch.Tensor | None, num_tokens: int,
                       top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    slots = (src[: num_tokens * top_k] if rows is None else src.index_select(0, rows)).view(num_tokens, top_k, -1)
    if routed is not None:
        slots = torch.where(routed.unsqueeze(-1), slots, 0)
    acc = slots[:, 0].float()
    for j in range(1, top_k):
        acc.add_(slots[:, j])
    return acc.to(out_dtype)


def moe_combine(src: torch.Tensor, rows: torch.Tensor | None, routed: torch.Tensor | None, num_tokens: int,
                top_k: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out[t] = sum_j src[rows[t * k + j]]`` over the slots ``j = 0..k-1`` with ``routed[t, j]``,
    added in float32 in slot order and rounded once to ``out_dtype``.

    ``src`` bfloat16 [R, H] (contiguous, H a multiple of 8); ``rows`` int64 [T * k] (indices into
    ``src``) or None for ``src``'s first T * k rows in order; ``routed`` bool [T, k] or None when
    every slot counts; returns ``out_dtype`` (bfloat16 or float32) [T, H]. Rows of unrouted slots
    are not read, so they may hold anything (even NaN). On CUDA a row index outside ``src`` is not
    checked on the host (that would sync): the kernel writes NaN for that token instead of reading."""
    fn = "moe_combine"
    if not isinstance(src, torch.Tensor) or src.dtype != torch.bfloat16 or src.dim() != 2 or not src.is_contiguous():
        _checks.fail(fn, ValueError, f"src must be a contiguous bfloat16 [R, H] tensor, got "
                                     f"{getattr(src, 'dtype', type(src).__name__)} {list(getattr(src, 'shape', ()))}")
    hidden = src.shape[1]
    for name, value in (("num_tokens", num_tokens), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_tokens" else 1):
            _checks.fail(fn, ValueError, f"{name} must be a {'non-negative' if name == 'num_tokens' else 'positive'} "
                                         f"int, got {value!r}")
    if out_dtype not in _OUT_DTYPES:
        _checks.fail(fn, ValueError, f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    pairs = num_tokens * top_k
    if rows is None:
        if src.shape[0] < pairs:
            _checks.fail(fn, ValueError, f"src has {src.shape[0]} rows, fewer than num_tokens * top_k = {pairs}")
    elif not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or tuple(rows.shape) != (pairs,) \
            or not rows.is_contiguous():
        _checks.fail(fn, ValueError, f"rows must be None or a contiguous int64 tensor of shape [{pairs}], got "
                                     f"{getattr(rows, 'dtype', type(rows).__name__)} {list(getattr(rows, 'shape', ()))}")
    if routed is not None and (not isinstance(routed, torch.Tensor) or routed.dtype != torch.bool
                               or tuple(routed.shape) != (num_tokens, top_k) or not routed.is_contiguous()):
        _checks.fail(fn, ValueError, f"routed must be None or a contiguous bool tensor of shape [{num_tokens}, {top_k}], "
                                     f"got {getattr(routed, 'dtype', type(routed).__name__)} "
                                     f"{list(getattr(routed, 'shape', ()))}")
    device = _checks.check_same_device(fn, [t for t in (src, rows, routed) if t is not None])
    if num_tokens == 0:
        return torch.empty((0, hidden), dtype=out_dtype, device=device)
    # The kernel reads 16-byte vectors; other widths and offsets take the torch path (same numbers).
    if device.type == "cpu" or hidden % 8 or src.data_ptr() % 16:
        if rows is not None and rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < src.shape[0]:
            _checks.fail(fn, ValueError, f"rows must index src's {src.shape[0]} rows")
        return _combine_reference(src, rows, routed, num_tokens, top_k, out_dtype)
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=device)
    jit.native_module().moe_combine(src.data_ptr(), src.shape[0], 0 if rows is None else rows.data_ptr(),
                                    0 if routed is None else routed.data_ptr(), out.data_ptr(), num_tokens, top_k,
                                    hidden, out_dtype == torch.float32, device.index,
                                    _descriptors.current_stream(device))
    return out
