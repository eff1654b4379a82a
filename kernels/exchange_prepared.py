"""The staged exchange's per-call path on CUDA: :class:`PreparedExchange` runs the launches of
:func:`~kernels.exchange.exchange_count_sizes`, :func:`~kernels.exchange.exchange_dispatch` and
:func:`~kernels.exchange.exchange_combine` (each with the group's barrier) over buffers fixed for its
lifetime, whose checks it makes once."""

from __future__ import annotations

import torch

from . import _checks, _descriptors, jit
from .exchange import (ExchangeBarrier, ExchangeIndex, ExchangePeers, PendingLayoutSizes, _barrier_args, _check_counts,
                       _check_num_experts, _check_row_addresses)


class PreparedExchange:
    """One rank's staged exchange on CUDA over buffers fixed for its lifetime, each fixed argument
    checked once here; a call then checks only the tensors it is given and launches into buffers
    this object keeps (the positions, the sizes, the layout index), so each call's results stay
    valid until the next call of the same method, as the peers' rows do.

    ``peers``: :class:`ExchangePeers` (CUDA); ``counts`` int32 [P, >= P E_l + 1]: this rank's count
    matrix, which the peers fill; ``count_rows`` int64 [P]: the addresses of this rank's row in
    every rank's matrix; ``barrier``: :class:`ExchangeBarrier` of the group (count-sizes, dispatch
    and combine each pass it once); ``capacity``: rows of the layout index (the receive views'
    rows at most). The same launches as :func:`exchange_count_sizes`, :func:`exchange_dispatch` and
    :func:`exchange_combine` with a barrier.

    One stream, calls in order (as the staged backend makes them): the count scratch, the
    positions, the sizes, the index and the barrier's epochs are shared by every call, so a second
    call in flight on another stream would corrupt them, and a result (``within``, the pending
    sizes, the index) holds the newest call's values once the next call of its method is queued."""

    def __init__(self, peers: ExchangePeers, counts: torch.Tensor, count_rows: torch.Tensor,
                 barrier: ExchangeBarrier, num_local_experts: int, capacity: int):
        fn = "PreparedExchange"
        if not isinstance(peers, ExchangePeers):
            _checks.fail(fn, TypeError, f"peers must be ExchangePeers, got {type(peers).__name__}")
        _checks.check_ints(fn, (("num_local_experts", num_local_experts, 1), ("capacity", capacity, 0)))
        _checks.check_dense_args(fn, counts=counts, count_rows=count_rows)
        num_ranks = peers.num_ranks
        device = peers.acts[0].device
        if device.type != "cuda":
            _checks.fail(fn, ValueError, f"runs on CUDA only (the module's functions on the CPU), got {device}")
        if not isinstance(barrier, ExchangeBarrier):
            _checks.fail(fn, TypeError, f"barrier must be an ExchangeBarrier, got {type(barrier).__name__}")
        barrier_args = _barrier_args(fn, barrier, peers, device)
        counts = _check_counts(fn, counts, num_ranks, num_ranks * num_local_experts + 1)
        count_rows = _check_row_addresses(fn, "count_rows", count_rows, num_ranks)
        _check_num_experts(fn, num_ranks * num_local_experts)
        view_rows = min(t.shape[0] for t in peers.acts)
        if capacity > view_rows:
            _checks.fail(fn, ValueError, f"capacity={capacity} exceeds the peers' {view_rows} rows")
        _checks.check_same_device(fn, [counts, count_rows, peers.acts[0]])
        self.peers, self.device, self.num_local = peers, device, num_local_experts
        self._native = jit.native_module()
        self._barrier = barrier_args
        self._count = (count_rows.data_ptr(), barrier.flag_rows.data_ptr(), barrier.flags.data_ptr(), counts.data_ptr(),
                       counts.stride(0), num_ranks, peers.rank, num_local_experts)
        self._counts = (counts.data_ptr(), counts.stride(0), num_local_experts)
        self._scratch = torch.zeros(num_ranks * num_local_experts + 2, dtype=torch.int32, device=device)
        self._within = torch.empty(peers.pairs_per_rank, dtype=torch.int32, device=device)
        self._sizes = torch.empty(3 * num_ranks + 1, dtype=torch.int32, device=device)
        self._index = ExchangeIndex(torch.empty(capacity, dtype=torch.int32, device=device),
                                    torch.empty(capacity, dtype=torch.int64, device=device),
                                    torch.empty(num_local_experts, dtype=torch.int32, device=device))
        self._capacity, self._view_rows = capacity, view_rows
        # The zeroed scratch before the first launch, whichever stream that is on.
        torch.cuda.current_stream(device).synchronize()

    def _tokens(self, fn: str, name: str, t: object, dtypes: tuple, shape: tuple) -> torch.Tensor:
        _checks.check_dense_args(fn, **{name: t})
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != shape or t.device != self.device:
            _checks.fail(fn, ValueError, f"{name} must be a {' or '.join(map(str, dtypes))} tensor of shape {list(shape)} "
                                         f"on {self.device}, got {getattr(t, 'dtype', type(t).__name__)} "
                                         f"{list(getattr(t, 'shape', ()))} on {getattr(t, 'device', '-')}")
        return t

    def _pairs(self, fn: str, topk_idx: object) -> torch.Tensor:
        _checks.check_dense_args(fn, topk_idx=topk_idx)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            _checks.fail(fn, ValueError, "topk_idx must be an int64 tensor [T, k]")
        topk_idx = self._tokens(fn, "topk_idx", topk_idx, (torch.int64,), tuple(topk_idx.shape))
        if topk_idx.numel() > self.peers.pairs_per_rank:
            _checks.fail(fn, ValueError, f"{topk_idx.shape[0]} x {topk_idx.shape[1]} pairs exceed pairs_per_rank="
                                         f"{self.peers.pairs_per_rank}")
        return topk_idx

    def count_sizes(self, topk_idx: torch.Tensor, alignment: int,
                    masked_max_rows: int = 0) -> tuple[torch.Tensor, PendingLayoutSizes]:
        """:func:`exchange_count_sizes`: ``within`` int32 [T * k] and the launched sizes."""
        fn = "PreparedExchange.count_sizes"
        flat = self._pairs(fn, topk_idx).reshape(-1).contiguous()
        _checks.check_ints(fn, (("alignment", alignment, 1), ("masked_max_rows", masked_max_rows, 0)))
        rows, flag_rows, flags, counts, stride, num_ranks, rank, num_local = self._count
        self._native.moe_exchange_count_sizes(flat.data_ptr(), flat.numel(), self._within.data_ptr(),
                                              self._scratch.data_ptr(), rows, flag_rows,
                                              flags, counts, stride, num_ranks, rank, num_local, alignment,
                                              masked_max_rows, self._sizes.data_ptr(), self.device.index,
                                              _descriptors.current_stream(self.device))
        return self._within[: flat.numel()], PendingLayoutSizes(rank, sizes=self._sizes)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, within: torch.Tensor,
                 alignment: int, masked_max_rows: int, first_expert: int) -> ExchangeIndex:
        """:func:`exchange_dispatch` of bfloat16 / float16 / float32 rows ``x`` [T, H] (quantized in
        the kernel) with ``within`` from :meth:`count_sizes`; the index over the whole capacity."""
        fn = "PreparedExchange.dispatch"
        topk_idx = self._pairs(fn, topk_idx).contiguous()
        num_tokens, k = topk_idx.shape
        x = self._tokens(fn, "x", x, (torch.bfloat16, torch.float16, torch.float32), (num_tokens, self.peers.hidden))
        topk_weights = self._tokens(fn, "topk_weights", topk_weights, (torch.float32,), (num_tokens, k)).contiguous()
        # An empty slice's data_ptr() is 0, so the storage is compared (no tokens: within is [0]).
        if (not isinstance(within, torch.Tensor) or within.storage_offset() != 0 or within.numel() != num_tokens * k
                or within.untyped_storage().data_ptr() != self._within.untyped_storage().data_ptr()):
            _checks.fail(fn, ValueError, "within must be this object's count_sizes result for these pairs")
        _checks.check_ints(fn, (("alignment", alignment, 1), ("masked_max_rows", masked_max_rows, 0),
                                ("first_expert", first_expert, 0)))
        x = _checks.vector_rows(x, self.peers.hidden)
        index = self._index
        layout = (*self._counts, alignment, masked_max_rows, self._view_rows, self._capacity, first_expert,
                  index.m_indices.data_ptr(), index.global_ids.data_ptr(), index.masked_m.data_ptr())
        self._native.moe_exchange_dispatch(self.peers.native(), layout, k, self.peers.hidden, self._within.data_ptr(),
                                           within.numel(), topk_idx.data_ptr(), topk_weights.data_ptr(), x.data_ptr(),
                                           _descriptors.dtype_code(x, "x"), x.stride(0), 0, self.device.index,
                                           _descriptors.current_stream(self.device), self._barrier)
        return index

    def combine(self, expert_out: torch.Tensor, m_indices: torch.Tensor) -> None:
        """:func:`exchange_combine` of ``expert_out`` bfloat16 [M, H] by ``m_indices`` int32 [M]
        (M at most the capacity), then the group's barrier (also at M = 0)."""
        fn = "PreparedExchange.combine"
        if not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 2:
            _checks.fail(fn, ValueError, f"expert_out must be a bfloat16 tensor [M, {self.peers.hidden}]")
        num_rows = expert_out.shape[0]
        self._tokens(fn, "expert_out", expert_out, (torch.bfloat16,), (num_rows, self.peers.hidden))
        self._tokens(fn, "m_indices", m_indices, (torch.int32,), (num_rows,))
        if num_rows > self._capacity:
            _checks.fail(fn, ValueError, f"{num_rows} rows exceed the capacity of {self._capacity}")
        expert_out = _checks.contiguous_aligned(expert_out)
        self._native.moe_exchange_combine(self.peers.native(), self.peers.hidden, m_indices.contiguous().data_ptr(),
                                          num_rows, expert_out.data_ptr(), self.device.index,
                                          _descriptors.current_stream(self.device), self._barrier)
