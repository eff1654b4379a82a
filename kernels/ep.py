"""Low-latency expert-parallel transport (decode sizes): dispatch into, and combine out of, the
masked layout of every rank's local experts by peer writes into each rank's symmetric buffer, with
no host synchronisation, so a forward can sit in a CUDA graph (CUDA only).

The buffers (:func:`ep_buffer_views`, allocated by the caller, e.g. as views of a
``moe_runtime.symm.SymmBuffer``; P ranks, E_l local experts, T_cap tokens per rank at most, top-k,
hidden H, R = P * T_cap rows per expert):

* ``ep_x`` uint8 [E_l, R, H], ``ep_sf`` float32 [E_l, R, H/128], ``ep_w`` float32 [E_l, R]: the FP8
  rows, 1x128 scales and top-k weights this rank's experts receive (the masked layout of
  ``m_grouped_*_gemm_nt_masked``; rows of an expert in no particular order);
* ``ep_src`` int32 [E_l, R]: each row's source (rank * T_cap * k + t * k + j);
* ``ep_combine`` bfloat16 [T_cap * k, H]: the expert outputs of this rank's (token, slot) pairs;
* ``ep_signals`` int32 [2 E_l + 2 P + 4]: slot counters, flags and this rank's step counts, zero
  before the first forward.

One forward on every rank of the group, in this order: :func:`ep_dispatch` (returns ``masked_m``),
the experts on ``ep_x`` / ``ep_sf`` / ``ep_w`` -> bfloat16 [E_l, R, H], :func:`ep_combine`, then
``kernels.moe_combine(ep_combine[:T * k], None, routed, T, k)``. Each step waits on the device for
the other ranks (bounded: a rank that never arrives makes the kernel trap after ``MOE_EP_TIMEOUT_S``
seconds, default 120, instead of hanging; so does a dispatch without its combine). Every rank must
run the same number of forwards. See csrc/include/moe_kernels/impls/moe_ep_ll.cuh for the protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import _checks, _descriptors, jit

kEpMaxRanks = 64
kEpMaxLocalExperts = 1024
kEpViews = ("ep_x", "ep_sf", "ep_w", "ep_src", "ep_combine", "ep_signals")


def ep_signal_ints(num_ranks: int, num_local_experts: int) -> int:
    """Words of a rank's signal area: two sets of E_l slot counters, P dispatch and P combine flags,
    the dispatches and the combines this rank finished, two grid-completion counters."""
    _checks.check_ints("ep_signal_ints", (("num_ranks", num_ranks, 1), ("num_local_experts", num_local_experts, 1)))
    return 2 * num_local_experts + 2 * num_ranks + 4


def ep_buffer_views(num_ranks: int, num_local_experts: int, max_tokens: int, top_k: int,
                    hidden: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of each transport view, in :data:`kEpViews` order."""
    fn = "ep_buffer_views"
    _checks.check_ints(fn, (("num_ranks", num_ranks, 1), ("num_local_experts", num_local_experts, 1),
                            ("max_tokens", max_tokens, 1), ("top_k", top_k, 1), ("hidden", hidden, 128)))
    if hidden % 128:
        _checks.fail(fn, ValueError, f"hidden must be a multiple of 128 (the 1x128 scale groups), got {hidden}")
    rows = num_ranks * max_tokens
    return [("ep_x", (num_local_experts, rows, hidden), torch.uint8),
            ("ep_sf", (num_local_experts, rows, hidden // 128), torch.float32),
            ("ep_w", (num_local_experts, rows), torch.float32),
            ("ep_src", (num_local_experts, rows), torch.int32),
            ("ep_combine", (max_tokens * top_k, hidden), torch.bfloat16),
            ("ep_signals", (ep_signal_ints(num_ranks, num_local_experts),), torch.int32)]


def _view_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, eq=False)
class EpLayout:
    """A group's transport buffers as this process sees them.

    ``bases``: every rank's buffer base address in this process's address space (this rank's own
    included), 16-byte aligned; ``offsets``: byte offset of each view of :data:`kEpViews` from a
    base (the same on every rank); ``buffer_bytes``: a rank's buffer size. The views must lie inside
    the buffer without overlapping (checked here: a wrong offset would send peer writes astray).
    ``device``: this rank's GPU, where ``peers`` (int64 [P], the bases) is placed for the kernels."""

    bases: tuple[int, ...]
    offsets: tuple[int, ...]
    buffer_bytes: int
    rank: int
    num_ranks: int
    num_local_experts: int
    max_tokens: int
    top_k: int
    hidden: int
    device: torch.device
    peers: torch.Tensor = field(init=False, repr=False)

    @property
    def rows_per_expert(self) -> int:
        return self.num_ranks * self.max_tokens

    def __post_init__(self):
        fn = "EpLayout"
        for name in ("rank", "num_ranks", "num_local_experts", "max_tokens", "top_k", "hidden", "buffer_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                _checks.fail(fn, ValueError, f"{name} must be an int, got {value!r}")
        if not 1 <= self.num_ranks <= kEpMaxRanks or not 0 <= self.rank < self.num_ranks:
            _checks.fail(fn, ValueError, f"rank {self.rank} of num_ranks {self.num_ranks}: need 0 <= rank < "
                                         f"num_ranks <= {kEpMaxRanks}")
        if not 1 <= self.num_local_experts <= kEpMaxLocalExperts:
            _checks.fail(fn, ValueError, f"num_local_experts must be in [1, {kEpMaxLocalExperts}], got "
                                         f"{self.num_local_experts}")
        if self.max_tokens < 1 or not 1 <= self.top_k <= 64 or self.hidden < 128 or self.hidden % 128:
            _checks.fail(fn, ValueError, f"need max_tokens >= 1, top_k in [1, 64] and hidden a positive multiple of "
                                         f"128, got {self.max_tokens}, {self.top_k}, {self.hidden}")
        if self.num_ranks * self.max_tokens * self.top_k >= 2**31:
            _checks.fail(fn, ValueError, f"num_ranks x max_tokens x top_k = "
                                         f"{self.num_ranks * self.max_tokens * self.top_k} must stay below 2^31 "
                                         "(the int32 source words)")
        bases = tuple(self.bases)
        if len(bases) != self.num_ranks or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % 16
                                               for b in bases):
            _checks.fail(fn, ValueError, f"bases must be {self.num_ranks} positive 16-byte aligned addresses, got "
                                         f"{[hex(b) if isinstance(b, int) else b for b in bases]}")
        if len(self.offsets) != len(kEpViews) or any(isinstance(o, bool) or not isinstance(o, int) or o < 0
                                                     for o in self.offsets):
            _checks.fail(fn, ValueError, f"offsets must be {len(kEpViews)} non-negative ints ({', '.join(kEpViews)}), "
                                         f"got {self.offsets!r}")
        x, sf, w, src, combine, signals = self.offsets
        if x % 16 or combine % 16 or sf % 4 or w % 4 or src % 4 or signals % 4:
            _checks.fail(fn, ValueError, f"view offsets must be aligned (ep_x and ep_combine to 16 bytes, the rest "
                                         f"to 4), got {self.offsets}")
        spans = sorted((offset, offset + _view_bytes(shape, dtype), name) for offset, (name, shape, dtype) in zip(
            self.offsets, ep_buffer_views(self.num_ranks, self.num_local_experts, self.max_tokens, self.top_k,
                                          self.hidden)))
        for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
            if end > start:
                _checks.fail(fn, ValueError, f"views {name} and {following} overlap (offsets {self.offsets})")
        if spans[-1][1] > self.buffer_bytes:
            _checks.fail(fn, ValueError, f"view {spans[-1][2]} ends at byte {spans[-1][1]}, past the "
                                         f"{self.buffer_bytes}-byte buffer")
        device = torch.device(self.device)
        if device.type != "cuda":
            _checks.fail(fn, ValueError, f"the low-latency transport runs on CUDA devices, got {device}")
        object.__setattr__(self, "bases", bases)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "peers", torch.tensor(bases, dtype=torch.int64, device=device))

    def native(self) -> tuple:
        return (self.peers.data_ptr(), *self.offsets, self.rank, self.num_ranks, self.num_local_experts,
                self.max_tokens, self.top_k, self.hidden)


def _check_layout(fn: str, layout: object) -> None:
    if not isinstance(layout, EpLayout):
        _checks.fail(fn, TypeError, f"layout must be an EpLayout, got {type(layout).__name__}")


def ep_dispatch(layout: EpLayout, x: torch.Tensor, xs: torch.Tensor | None, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, masked_m: torch.Tensor | None = None,
                routed: torch.Tensor | None = None) -> torch.Tensor:
    """Sends this rank's (token, slot) pairs to their experts' ranks and waits until every rank's
    pairs for this rank have arrived (one launch); returns ``masked_m`` int32 [E_l] (rows received
    per local expert, written into ``masked_m`` when given). ``routed``, when given (bool [T, k],
    contiguous), receives which pairs were written into their expert's rows (routed, and not dropped
    by an expert that ran out of rows): the mask :func:`kernels.moe_combine` takes after the combine.

    ``x`` [T, H]: E4M3 rows (float8_e4m3fn or its uint8 bits) with ``xs`` float32 [T, H/128] (1x128
    scales), or bfloat16 / float16 / float32 rows with ``xs=None``, quantized in the kernel exactly as
    ``kernels.per_token_cast_to_fp8(x, gran_k=128)`` would (no separate cast launch); the last dim
    contiguous, 16-byte aligned rows. ``topk_idx`` int64 [T, k] global expert ids (expert e lives on
    rank e // E_l; -1 or ids outside [0, P E_l): not sent), ``topk_weights`` float32 [T, k];
    T <= max_tokens. A token's ids must be distinct (as a router's are): a repeated one can overflow
    its expert's R rows, and the pairs that would are dropped."""
    fn = "ep_dispatch"
    _checks.check_dense_args(fn, x=x, xs=xs, topk_idx=topk_idx, topk_weights=topk_weights, masked_m=masked_m,
                             routed=routed)
    _check_layout(fn, layout)
    x, num_tokens, _ = _checks.check_token_pairs(fn, x, xs, topk_idx, topk_weights, layout.hidden, layout.top_k,
                                                 x_name="x", unquantized=True)
    if num_tokens > layout.max_tokens:
        _checks.fail(fn, ValueError, f"{num_tokens} tokens, more than the {layout.max_tokens} the buffers hold")
    device = _checks.check_same_device(fn, [x, topk_idx, topk_weights, layout.peers] + ([] if xs is None else [xs]))
    if masked_m is None:
        masked_m = torch.empty((layout.num_local_experts,), dtype=torch.int32, device=device)
    elif not isinstance(masked_m, torch.Tensor) or masked_m.dtype != torch.int32 \
            or tuple(masked_m.shape) != (layout.num_local_experts,) or masked_m.device != device \
            or not masked_m.is_contiguous():
        _checks.fail(fn, ValueError, f"masked_m must be a contiguous int32 tensor of shape "
                                     f"[{layout.num_local_experts}] on {device}")
    k = layout.top_k
    if routed is None:
        routed = torch.empty((num_tokens, k), dtype=torch.bool, device=device)
    elif not isinstance(routed, torch.Tensor) or routed.dtype != torch.bool or tuple(routed.shape) != (num_tokens, k) \
            or routed.device != device or not routed.is_contiguous():
        _checks.fail(fn, ValueError, f"routed must be a contiguous bool tensor of shape [{num_tokens}, {k}] on {device}")
    x = _checks.vector_rows(x, layout.hidden)
    xs = xs.contiguous() if xs is not None else None
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    jit.native_module().moe_ep_dispatch(layout.native(), topk_idx.data_ptr(), topk_weights.data_ptr(), x.data_ptr(),
                                        _descriptors.dtype_code(x, "x"), x.stride(0),
                                        0 if xs is None else xs.data_ptr(), num_tokens, masked_m.data_ptr(),
                                        routed.data_ptr(), device.index, _descriptors.current_stream(device))
    return masked_m


def ep_combine(layout: EpLayout, expert_out: torch.Tensor) -> None:
    """Sends each row this rank received in the last :func:`ep_dispatch` back to its source rank as
    its expert output, and waits until every rank has sent this rank's: then (in stream order) this
    rank's ``ep_combine`` view holds the output of its pair (t, j) in row t * k + j (rows of pairs
    not written by the dispatch, unrouted or dropped, are stale).

    ``expert_out`` bfloat16 [E_l, R, H], valid in the rows the dispatch counted (its ``masked_m``;
    the transport reads its own counts, not the caller's)."""
    fn = "ep_combine"
    _checks.check_dense_args(fn, expert_out=expert_out)
    _check_layout(fn, layout)
    shape = (layout.num_local_experts, layout.rows_per_expert, layout.hidden)
    if not isinstance(expert_out, torch.Tensor) or expert_out.dtype != torch.bfloat16 \
            or tuple(expert_out.shape) != shape:
        _checks.fail(fn, ValueError, f"expert_out must be a bfloat16 tensor of shape {list(shape)}, got "
                                     f"{getattr(expert_out, 'dtype', type(expert_out).__name__)} "
                                     f"{list(getattr(expert_out, 'shape', ()))}")
    device = _checks.check_same_device(fn, [expert_out, layout.peers])
    expert_out = _checks.contiguous_aligned(expert_out)
    jit.native_module().moe_ep_combine(layout.native(), expert_out.data_ptr(), device.index,
                                       _descriptors.current_stream(device))
