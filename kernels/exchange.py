"""The staged backend's row exchange between the ranks of an expert-parallel group, once the host
knows every rank's layout (after its count exchange):

* :func:`exchange_dispatch`: each sent (token, slot) pair's FP8 row, scales, top-k weight and slot
  word written into the row its owner's contiguous layout gives it;
* :func:`exchange_combine`: each received row's expert output written back into its source
  rank's combine buffer, at the pair's slot.

On CUDA each is one launch (a warp per row, 16-byte vectors, peer writes through the addresses of
:class:`ExchangePeers`), on the CPU the same moves as torch index copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _checks, _descriptors, jit

kExchangeViews = ("acts", "acts_sf", "weights", "slots", "combine")
_DTYPES = {"acts": torch.uint8, "acts_sf": torch.float32, "weights": torch.float32, "slots": torch.int32,
           "combine": torch.bfloat16}


@dataclass(frozen=True, eq=False)
class ExchangePeers:
    """Every rank's exchange views as this process sees them (its own tensors for this rank, peer
    views of a symmetric buffer for the others), one tuple entry per rank:

    ``acts`` uint8 [R, H] (E4M3 bits), ``acts_sf`` float32 [R, H/128], ``weights`` float32 [R],
    ``slots`` int32 [R] (slot word ``source * pairs_per_rank + t * k + j``), ``combine`` bfloat16
    [C, H] with C >= ``pairs_per_rank``; ``rank``: this process's rank; ``pairs_per_rank``: a
    rank's (token, slot) pairs at most (T_cap * k). On CUDA ``tables`` holds the views' addresses,
    int64 [5, P] on the device (built once here)."""

    acts: tuple[torch.Tensor, ...]
    acts_sf: tuple[torch.Tensor, ...]
    weights: tuple[torch.Tensor, ...]
    slots: tuple[torch.Tensor, ...]
    combine: tuple[torch.Tensor, ...]
    rank: int
    pairs_per_rank: int
    tables: torch.Tensor | None = field(init=False, repr=False)

    @property
    def num_ranks(self) -> int:
        return len(self.acts)

    @property
    def hidden(self) -> int:
        return self.acts[0].shape[1]

    def __post_init__(self):
        fn = "ExchangePeers"
        views = {name: tuple(getattr(self, name)) for name in kExchangeViews}
        num_ranks = len(views["acts"])
        if num_ranks < 1 or any(len(v) != num_ranks for v in views.values()):
            _checks.fail(fn, ValueError, f"every view needs one tensor per rank, got "
                                         f"{ {name: len(v) for name, v in views.items()} }")
        for name, value in (("rank", self.rank), ("pairs_per_rank", self.pairs_per_rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                _checks.fail(fn, ValueError, f"{name} must be an int, got {value!r}")
        if not 0 <= self.rank < num_ranks or self.pairs_per_rank < 1:
            _checks.fail(fn, ValueError, f"need 0 <= rank < {num_ranks} and pairs_per_rank >= 1, got rank={self.rank}, "
                                         f"pairs_per_rank={self.pairs_per_rank}")
        if num_ranks * self.pairs_per_rank >= 2**31:
            _checks.fail(fn, ValueError, f"ranks x pairs_per_rank = {num_ranks * self.pairs_per_rank} must fit the "
                                         "int32 slot word")
        hidden = views["acts"][0].shape[-1] if views["acts"][0].dim() == 2 else -1
        if hidden < 128 or hidden % 128:
            _checks.fail(fn, ValueError, f"acts must be [R, H] with H a positive multiple of 128, got "
                                         f"{list(views['acts'][0].shape)}")
        for q in range(num_ranks):
            rows = views["acts"][q].shape[0]
            expected = {"acts": (rows, hidden), "acts_sf": (rows, hidden // 128), "weights": (rows,),
                        "slots": (rows,), "combine": (views["combine"][q].shape[0], hidden)}
            for name, shape in expected.items():
                t = views[name][q]
                if not isinstance(t, torch.Tensor) or t.dtype != _DTYPES[name] or tuple(t.shape) != shape \
                        or not t.is_contiguous():
                    _checks.fail(fn, ValueError, f"{name}[{q}] must be a contiguous {_DTYPES[name]} tensor of shape "
                                                 f"{list(shape)}, got {getattr(t, 'dtype', type(t).__name__)} "
                                                 f"{list(getattr(t, 'shape', ()))}")
            if views["combine"][q].shape[0] < self.pairs_per_rank:
                _checks.fail(fn, ValueError, f"combine[{q}] has {views['combine'][q].shape[0]} rows, fewer than "
                                             f"pairs_per_rank={self.pairs_per_rank}")
        devices = {t.device for v in views.values() for t in v}
        if len(devices) != 1:
            _checks.fail(fn, ValueError, f"every view must be on one device (peer views included), got {devices}")
        device = devices.pop()
        tables = None
        if device.type == "cuda":
            if any(t.data_ptr() % 16 for name in ("acts", "combine") for t in views[name]):
                _checks.fail(fn, ValueError, "acts and combine views must be 16-byte aligned")
            tables = torch.tensor([[t.data_ptr() for t in views[name]] for name in kExchangeViews], dtype=torch.int64,
                                  device=device)
        for name, v in views.items():
            object.__setattr__(self, name, v)
        object.__setattr__(self, "tables", tables)

    def native(self) -> tuple:
        return (self.tables.data_ptr(), self.num_ranks, self.rank, self.pairs_per_rank)


def _check_index(fn: str, name: str, t: object, n: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or (n is not None and t.numel() != n):
        _checks.fail(fn, ValueError, f"{name} must be a 1-D int64 tensor{'' if n is None else f' of {n} elements'}, "
                                     f"got {getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")
    return t.contiguous()


def exchange_dispatch(peers: ExchangePeers, xq: torch.Tensor, xs: torch.Tensor, topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor, order: torch.Tensor, rows: torch.Tensor, num_local_experts: int) -> None:
    """Sorted pair ``i`` (pair id ``order[i] = t * k + j``, global expert ``e = topk_idx[t, j]``)
    into row ``rows[i]`` of rank ``e // num_local_experts``: ``acts`` <- ``xq[t]``, ``acts_sf`` <-
    ``xs[t]``, ``weights`` <- ``topk_weights[t, j]``, ``slots`` <- ``rank * pairs_per_rank + t * k + j``.

    ``xq`` E4M3 [T, H] (float8_e4m3fn or uint8 bits), ``xs`` float32 [T, H/128], ``topk_idx`` int64
    [T, k], ``topk_weights`` float32 [T, k], ``order`` and ``rows`` int64 [n]. The experts of the
    pairs in ``order`` must be in [0, P * num_local_experts) and ``rows`` inside their owner's views:
    the caller's plan guarantees both, and checking them on CUDA would sync."""
    fn = "exchange_dispatch"
    hidden = peers.hidden
    xq, num_tokens, k = _checks.check_token_pairs(fn, xq, xs, topk_idx, topk_weights, hidden)
    order = _check_index(fn, "order", order)
    rows = _check_index(fn, "rows", rows, order.numel())
    if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts < 1:
        _checks.fail(fn, ValueError, f"num_local_experts must be a positive int, got {num_local_experts!r}")
    if num_tokens * k > peers.pairs_per_rank:
        _checks.fail(fn, ValueError, f"{num_tokens} x {k} pairs exceed pairs_per_rank={peers.pairs_per_rank}")
    device = _checks.check_same_device(fn, [xq, xs, topk_idx, topk_weights, order, rows, peers.acts[0]])
    if order.numel() == 0:
        return
    if device.type == "cpu":
        owner = topk_idx.reshape(-1).index_select(0, order) // num_local_experts
        tokens = order // k
        for q in range(peers.num_ranks):
            mine = (owner == q).nonzero().view(-1)
            if mine.numel() == 0:
                continue
            to, pairs = rows.index_select(0, mine), order.index_select(0, mine)
            peers.acts[q].index_copy_(0, to, xq.index_select(0, tokens.index_select(0, mine)))
            peers.acts_sf[q].index_copy_(0, to, xs.index_select(0, tokens.index_select(0, mine)))
            peers.weights[q].index_copy_(0, to, topk_weights.reshape(-1).index_select(0, pairs))
            peers.slots[q].index_copy_(0, to, (pairs + peers.rank * peers.pairs_per_rank).to(torch.int32))
        return
    # The kernel reads 16-byte vectors of xq's rows.
    xq = xq.contiguous() if not xq.is_contiguous() else (xq.clone() if xq.data_ptr() % 16 else xq)
    xs, topk_idx, topk_weights = xs.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
    jit.native_module().moe_exchange_dispatch(peers.native(), num_local_experts, k, hidden, order.data_ptr(),
                                              rows.data_ptr(), order.numel(), topk_idx.data_ptr(),
                                              topk_weights.data_ptr(), xq.data_ptr(), xs.data_ptr(), device.index,
                                              _descriptors.current_stream(device))


def exchange_combine(peers: ExchangePeers, expert_out: torch.Tensor, rows: torch.Tensor) -> None:
    """Received row ``rows[i]`` of this rank's layout, slot word ``s = slots[rank][rows[i]]``:
    ``expert_out[rows[i]]`` into row ``s % pairs_per_rank`` of rank ``s // pairs_per_rank``'s
    ``combine`` view.

    ``expert_out`` bfloat16 [M, H], ``rows`` int64 [n], rows that :func:`exchange_dispatch` wrote
    (inside ``expert_out`` and this rank's views: not checked on CUDA, which would sync)."""
    fn = "exchange_combine"
    hidden = peers.hidden
    if not isinstance(expert_out, torch.Tensor) or expert_out.dtype != torch.bfloat16 or expert_out.dim() != 2 \
            or expert_out.shape[1] != hidden:
        _checks.fail(fn, ValueError, f"expert_out must be a bfloat16 tensor of shape [M, {hidden}], got "
                                     f"{getattr(expert_out, 'dtype', type(expert_out).__name__)} "
                                     f"{list(getattr(expert_out, 'shape', ()))}")
    rows = _check_index(fn, "rows", rows)
    device = _checks.check_same_device(fn, [expert_out, rows, peers.acts[0]])
    if rows.numel() == 0:
        return
    if device.type == "cpu":
        slots = peers.slots[peers.rank].index_select(0, rows).to(torch.int64)
        source, pair = slots // peers.pairs_per_rank, slots % peers.pairs_per_rank
        for p in range(peers.num_ranks):
            mine = (source == p).nonzero().view(-1)
            if mine.numel():
                peers.combine[p].index_copy_(0, pair.index_select(0, mine),
                                             expert_out.index_select(0, rows.index_select(0, mine)))
        return
    expert_out = expert_out.contiguous() if not expert_out.is_contiguous() else (
        expert_out.clone() if expert_out.data_ptr() % 16 else expert_out)
    jit.native_module().moe_exchange_combine(peers.native(), hidden, rows.data_ptr(), rows.numel(),
                                             expert_out.data_ptr(), device.index, _descriptors.current_stream(device))
