"""The staged backend's row exchange between the ranks of an expert-parallel group:

* :func:`exchange_count`: each pair's position among its expert's pairs and this rank's row of the
  count matrix;
* :func:`exchange_sizes`: after the count exchange, the few ints the host needs (every rank's
  layout size, masked rows, invalid ids; this rank's pairs sent), the dispatch's one host sync;
* :func:`exchange_dispatch`: each sent (token, slot) pair's FP8 row, scales, top-k weight and slot
  word written into the row its owner's layout gives it (the layouts computed on the device from
  the count matrix), and this rank's layout index;
* :func:`exchange_combine`: each received row's expert output written back into its source
  rank's combine buffer, at the pair's slot;
* :func:`exchange_barrier`: the group's barrier between those steps, on the device (CUDA);
* :func:`exchange_count_sizes`: count, barrier and sizes in one launch (CUDA), the staged dispatch's
  first step;
* :class:`~kernels.exchange_prepared.PreparedExchange` (its own module): count-sizes, dispatch and
  combine over fixed buffers, checked once (CUDA), the staged backend's per-call path.

On CUDA each is one launch (a warp per token or row, 16-byte vectors, peer writes through the
addresses of :class:`ExchangePeers`), on the CPU the same moves as torch index copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _checks, _descriptors, jit, quant
from .reference import exchange as reference_exchange

kExchangeViews = ("acts", "acts_sf", "weights", "slots", "combine")
kExchangeMaxExperts = 2048  # the CUDA kernels' shared-memory layout and histogram (launchers/moe_exchange.hpp)
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
        for name, v in views.items():
            for q, t in enumerate(v):
                if not isinstance(t, torch.Tensor):
                    _checks.fail(fn, TypeError, f"{name}[{q}] must be a torch.Tensor, got {type(t).__name__}")
                _checks.check_dense(fn, f"{name}[{q}]", t)  # the kernels read and write it through its address
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


@dataclass(frozen=True, eq=False)
class ExchangeBarrier:
    """The group's barrier that :func:`exchange_dispatch` and :func:`exchange_combine` raise from
    their last CTA instead of a separate :func:`exchange_barrier` launch (CUDA): ``flag_rows`` int64
    [P] and ``flags`` int32 [P + 1] as :func:`exchange_barrier`'s, ``done`` int32 [1] (this rank's
    memory, zero, touched by nothing else: the grid's finished CTAs). Checked once, here."""

    flag_rows: torch.Tensor
    flags: torch.Tensor
    done: torch.Tensor

    def __post_init__(self):
        fn = "ExchangeBarrier"
        _checks.check_dense_args(fn, flag_rows=self.flag_rows, flags=self.flags, done=self.done)
        num_ranks = self.flag_rows.numel() if isinstance(self.flag_rows, torch.Tensor) else 0
        for name, t, dtype, shape in (("flag_rows", self.flag_rows, torch.int64, (max(num_ranks, 1),)),
                                      ("flags", self.flags, torch.int32, (num_ranks + 1,)),
                                      ("done", self.done, torch.int32, (1,))):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                _checks.fail(fn, ValueError, f"{name} must be a contiguous {dtype} tensor of shape {list(shape)}, got "
                                             f"{getattr(t, 'dtype', type(t).__name__)} "
                                             f"{list(getattr(t, 'shape', ()))}")
        device = _checks.check_same_device(fn, [self.flag_rows, self.flags, self.done])
        if device.type != "cuda":
            _checks.fail(fn, ValueError, f"the device barrier runs on CUDA, got {device}")

    @property
    def num_ranks(self) -> int:
        return self.flag_rows.numel()

    def native(self) -> tuple:
        return (self.flag_rows.data_ptr(), self.flags.data_ptr(), self.done.data_ptr())


def _barrier_args(fn: str, barrier: ExchangeBarrier | None, peers: "ExchangePeers", device: torch.device) -> tuple:
    """The native (flag_rows, flags, done) of ``barrier``, (0, 0, 0) for None; raises where it
    cannot serve ``peers`` on ``device``."""
    if barrier is None:
        return (0, 0, 0)
    if not isinstance(barrier, ExchangeBarrier):
        _checks.fail(fn, TypeError, f"barrier must be None or an ExchangeBarrier, got {type(barrier).__name__}")
    if barrier.num_ranks != peers.num_ranks or barrier.done.device != device:
        _checks.fail(fn, ValueError, f"barrier must be for the peers' {peers.num_ranks} ranks on {device}, got "
                                     f"{barrier.num_ranks} ranks on {barrier.done.device}")
    return barrier.native()


def exchange_count(topk_idx: torch.Tensor, num_experts: int,
                   peer_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's side of the count exchange: ``(within, row)`` from ``topk_idx`` int64 [T, k].

    ``within`` int32 [T * k]: the pair's position among this rank's pairs of its expert, in [0,
    row[expert]), or -1 for a pair not sent (-1 or an id outside [0, E)); the CPU path numbers them
    in pair order, the CUDA kernel in any order (its atomics'), which only moves rows inside their
    expert's segment. ``row`` int32 [E + 1]: pairs per expert, then the count of ids outside [-1, E)
    (invalid). One launch on CUDA.

    ``peer_rows`` (CUDA only): int64 [P] on the device, the addresses of P int32 [E + 1] rows (this
    rank's row of every rank's count matrix, peer memory included) that the kernel fills instead
    of a new ``row``; then ``row`` is None."""
    fn = "exchange_count"
    _checks.check_dense_args(fn, topk_idx=topk_idx, peer_rows=peer_rows)
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
        _checks.fail(fn, ValueError, f"topk_idx must be an int64 tensor [T, k], got "
                                     f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)} "
                                     f"{list(getattr(topk_idx, 'shape', ()))}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        _checks.fail(fn, ValueError, f"num_experts must be a positive int, got {num_experts!r}")
    if topk_idx.device.type not in ("cpu", "cuda"):
        _checks.fail(fn, ValueError, f"topk_idx must be on a CPU or CUDA device, got {topk_idx.device}")
    if peer_rows is not None and (not isinstance(peer_rows, torch.Tensor) or peer_rows.dtype != torch.int64
                                  or peer_rows.dim() != 1 or not peer_rows.is_contiguous()
                                  or peer_rows.device != topk_idx.device or peer_rows.device.type != "cuda"):
        _checks.fail(fn, ValueError, f"peer_rows must be None or a contiguous 1-D int64 tensor of row addresses on "
                                     f"topk_idx's CUDA device ({topk_idx.device}), got "
                                     f"{getattr(peer_rows, 'dtype', type(peer_rows).__name__)} on "
                                     f"{getattr(peer_rows, 'device', '-')}")
    flat = topk_idx.reshape(-1)
    if topk_idx.device.type == "cpu":
        sent = (flat >= 0) & (flat < num_experts)
        key = torch.where(sent, flat, num_experts)
        row = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
        row.scatter_add_(0, key, sent.to(torch.int32))
        row[num_experts] = ((flat < -1) | (flat >= num_experts)).sum()
        order = torch.argsort(key, stable=True)
        first = reference_exchange.exclusive_cumsum(torch.bincount(key, minlength=num_experts + 1))
        within = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
        within.scatter_(0, order, (torch.arange(flat.numel(), device=flat.device) - first[key[order]]).to(torch.int32))
        return within.masked_fill_(~sent, -1), row
    flat = flat.contiguous()
    within = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    row = torch.empty(num_experts + 1, dtype=torch.int32, device=flat.device) if peer_rows is None else None
    jit.native_module().moe_exchange_count(flat.data_ptr(), flat.numel(), num_experts, within.data_ptr(),
                                           0 if row is None else row.data_ptr(),
                                           0 if peer_rows is None else peer_rows.data_ptr(),
                                           0 if peer_rows is None else peer_rows.numel(), topk_idx.device.index,
                                           _descriptors.current_stream(topk_idx.device))
    return within, row


def _check_counts(fn: str, counts: object, num_ranks: int, min_width: int) -> torch.Tensor:
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 or counts.dim() != 2 \
            or counts.shape[0] != num_ranks or counts.shape[1] < min_width or counts.stride(1) != 1:
        _checks.fail(fn, ValueError, f"counts must be an int32 tensor [{num_ranks}, >= {min_width}] with unit column "
                                     f"stride, got {getattr(counts, 'dtype', type(counts).__name__)} "
                                     f"{list(getattr(counts, 'shape', ()))}")
    return counts


def _check_row_addresses(fn: str, name: str, t: object, num_ranks: int) -> torch.Tensor:
    """``t``: int64 [P], contiguous, one address per rank (this rank's row in every rank's count matrix)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (num_ranks,) \
            or not t.is_contiguous():
        _checks.fail(fn, ValueError, f"{name} must be a contiguous torch.int64 tensor of shape [{num_ranks}] (one "
                                     f"address per rank), got {getattr(t, 'dtype', type(t).__name__)} "
                                     f"{list(getattr(t, 'shape', ()))}")
    return t


def _check_peers(fn: str, peers: object) -> None:
    if not isinstance(peers, ExchangePeers):
        _checks.fail(fn, TypeError, f"peers must be ExchangePeers, got {type(peers).__name__}")


def _check_num_experts(fn: str, num_experts: int) -> None:
    if num_experts > kExchangeMaxExperts:
        _checks.fail(fn, ValueError, f"at most {kExchangeMaxExperts} experts on CUDA, got {num_experts}")


@dataclass
class PendingLayoutSizes:
    """:func:`exchange_sizes` launched, not yet read: ``sizes`` int32 [3 P + 1] (every rank's layout
    rows, masked rows, invalid ids, then this rank's pairs sent) on the device, or the result
    already computed (CPU). :meth:`wait` reads it: a host sync on CUDA, which also waits for what
    the stream ran after the launch unless :meth:`start_copy` began the read before that."""

    rank: int
    sizes: torch.Tensor | None = None
    result: reference_exchange.LayoutSizes | None = None
    _host: torch.Tensor | None = None      # start_copy's pinned buffer
    _copied: object | None = None          # its torch.cuda.Event, recorded after the copy

    def start_copy(self, host: torch.Tensor, stream) -> None:
        """Reads the sizes into ``host`` (pinned int32 [3 P + 1]) on ``stream``, after what the
        current stream queued so far (the launch that computes them): :meth:`wait` then waits for
        that copy alone, not for the work queued after this call (the dispatch kernel), so the host
        goes on while it runs. A no-op off CUDA or when the result is known."""
        if self.result is not None or self.sizes is None or self.sizes.device.type != "cuda":
            return
        if not isinstance(host, torch.Tensor) or host.dtype != torch.int32 or host.device.type != "cpu" \
                or host.numel() != self.sizes.numel() or not host.is_pinned():
            _checks.fail("PendingLayoutSizes.start_copy", ValueError,
                         f"host must be a pinned CPU int32 tensor of {self.sizes.numel()} elements")
        stream.wait_stream(torch.cuda.current_stream(self.sizes.device))
        with torch.cuda.stream(stream):
            host.copy_(self.sizes, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(stream)
        self.sizes.record_stream(stream)  # the allocator keeps it until the copy has run
        self._host = host

    def wait(self) -> reference_exchange.LayoutSizes:
        if self.result is None:
            if self._copied is not None:
                self._copied.synchronize()
                host = self._host.tolist()
            else:
                host = self.sizes.tolist()
            p = (self.sizes.numel() - 1) // 3
            self.result = reference_exchange.LayoutSizes(self.rank, tuple(host[:p]), tuple(host[p: 2 * p]), host[3 * p],
                                                         tuple(host[2 * p: 3 * p]))
        return self.result


def exchange_sizes(counts: torch.Tensor, rank: int, num_local_experts: int, alignment: int,
                   masked_max_rows: int = 0, wait: bool = True):
    """What the host needs of the layouts, from the count matrix ``counts`` int32 [P, >= P E_l + 1]
    (row ``src``: the rows rank ``src`` sends to each global expert, then its invalid ids): every
    rank's layout rows and masked rows, every source's invalid ids and the pairs rank ``rank``
    sends (:class:`kernels.reference.exchange.LayoutSizes`, host ints). On CUDA one one-CTA launch
    and one read of 3 P + 1 ints: the staged dispatch's only host sync. ``wait=False`` returns a
    :class:`PendingLayoutSizes` instead, to read after more work is queued."""
    fn = "exchange_sizes"
    _checks.check_dense_args(fn, counts=counts)
    _checks.check_ints(fn, (("num_local_experts", num_local_experts, 1), ("alignment", alignment, 1),
                     ("masked_max_rows", masked_max_rows, 0), ("rank", rank, 0)))
    num_ranks = counts.shape[0] if isinstance(counts, torch.Tensor) and counts.dim() == 2 else 0
    num_experts = num_ranks * num_local_experts
    counts = _check_counts(fn, counts, max(num_ranks, 1), num_experts + 1)
    if rank >= num_ranks:
        _checks.fail(fn, ValueError, f"rank must be in [0, {num_ranks}), got {rank}")
    if counts.device.type not in ("cpu", "cuda"):
        _checks.fail(fn, ValueError, f"counts must be on a CPU or CUDA device, got {counts.device}")
    if counts.device.type == "cpu":
        sizes = reference_exchange.layout_sizes(_counts_matrix(counts, num_ranks, num_local_experts), rank, alignment,
                                                masked_max_rows)
        pending = PendingLayoutSizes(rank, result=reference_exchange.LayoutSizes(
            rank, sizes.padded_rows, sizes.masked_rows, sizes.num_send_rows, tuple(counts[:, num_experts].tolist())))
        return pending.wait() if wait else pending
    _check_num_experts(fn, num_experts)
    out = torch.empty(3 * num_ranks + 1, dtype=torch.int32, device=counts.device)
    jit.native_module().moe_exchange_sizes(counts.data_ptr(), counts.stride(0), num_ranks, rank, num_local_experts,
                                           alignment, masked_max_rows, out.data_ptr(), counts.device.index,
                                           _descriptors.current_stream(counts.device))
    pending = PendingLayoutSizes(rank, sizes=out)
    return pending.wait() if wait else pending


def exchange_count_sizes(topk_idx: torch.Tensor, num_local_experts: int, peer_rows: torch.Tensor,
                         barrier: ExchangeBarrier, counts: torch.Tensor, rank: int,
                         alignment: int, masked_max_rows: int = 0,
                         scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, PendingLayoutSizes]:
    """:func:`exchange_count` into every rank's count matrix, :func:`exchange_barrier` and
    :func:`exchange_sizes` in one launch (CUDA only; a CTA per 4096 pairs, the last to finish
    passes the barrier and reduces the sizes): the staged dispatch's steps before its rows move,
    which the host used to launch one after another. Calls that share a ``scratch`` must run in
    order on one stream: its counters are exact only between launches.

    ``topk_idx`` int64 [T, k] of P E_l = E experts; ``peer_rows`` int64 [P]: the addresses of this
    rank's row (int32 [E + 1]) in every rank's count matrix; ``barrier``: the group's
    :class:`ExchangeBarrier` (its flags; the kernel counts its own CTAs in ``scratch``); ``counts``
    int32 [P, >= E + 1]: this rank's matrix, which the peers
    fill; ``scratch`` int32 [E + 2] on the device, zero, which the kernel leaves zero (its CTAs'
    counts; None: a zeroed one per call). Returns ``within`` int32 [T * k] (as
    :func:`exchange_count`'s) and the launched sizes (:class:`PendingLayoutSizes`, read after more
    work is queued)."""
    fn = "exchange_count_sizes"
    _checks.check_dense_args(fn, topk_idx=topk_idx, peer_rows=peer_rows, counts=counts, scratch=scratch)
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
        _checks.fail(fn, ValueError, f"topk_idx must be an int64 tensor [T, k], got "
                                     f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)} "
                                     f"{list(getattr(topk_idx, 'shape', ()))}")
    _checks.check_ints(fn, (("num_local_experts", num_local_experts, 1), ("alignment", alignment, 1),
                     ("masked_max_rows", masked_max_rows, 0), ("rank", rank, 0)))
    if not isinstance(barrier, ExchangeBarrier):
        _checks.fail(fn, TypeError, f"barrier must be an ExchangeBarrier, got {type(barrier).__name__}")
    num_ranks = barrier.num_ranks
    peer_rows = _check_row_addresses(fn, "peer_rows", peer_rows, num_ranks)
    num_experts = num_ranks * num_local_experts
    counts = _check_counts(fn, counts, num_ranks, num_experts + 1)
    if rank >= num_ranks:
        _checks.fail(fn, ValueError, f"rank must be in [0, {num_ranks}), got {rank}")
    _check_num_experts(fn, num_experts)
    device = _checks.check_same_device(fn, [topk_idx, peer_rows, barrier.flags, counts])
    if device.type != "cuda":
        _checks.fail(fn, ValueError, f"runs on CUDA only (exchange_count, exchange_barrier and exchange_sizes on "
                                     f"the CPU), got {device}")
    if scratch is None:
        scratch = torch.zeros(num_experts + 2, dtype=torch.int32, device=device)
    elif not isinstance(scratch, torch.Tensor) or scratch.dtype != torch.int32 \
            or tuple(scratch.shape) != (num_experts + 2,) or not scratch.is_contiguous() or scratch.device != device:
        _checks.fail(fn, ValueError, f"scratch must be None or a contiguous int32 tensor of shape [{num_experts + 2}] on "
                                     f"{device}")
    flat = topk_idx.reshape(-1).contiguous()
    within = torch.empty(flat.numel(), dtype=torch.int32, device=device)
    sizes = torch.empty(3 * num_ranks + 1, dtype=torch.int32, device=device)
    jit.native_module().moe_exchange_count_sizes(flat.data_ptr(), flat.numel(), within.data_ptr(), scratch.data_ptr(),
                                                 peer_rows.data_ptr(), barrier.flag_rows.data_ptr(),
                                                 barrier.flags.data_ptr(), counts.data_ptr(),
                                                 counts.stride(0), num_ranks, rank, num_local_experts, alignment,
                                                 masked_max_rows, sizes.data_ptr(), device.index,
                                                 _descriptors.current_stream(device))
    return within, PendingLayoutSizes(rank, sizes=sizes)


def exchange_barrier(flag_rows: torch.Tensor, flags: torch.Tensor, rank: int) -> None:
    """The group's barrier on the device, in stream order (CUDA only; one one-CTA launch): what this
    rank's stream wrote before it, peers' memory included, is visible to every rank's work queued
    after theirs. ``flag_rows`` int64 [P]: the address of every rank's ``flags`` int32 [P + 1] (in
    symmetric memory, mapped in this process), this rank's ``flags`` included, all zero before the
    group's first barrier and touched by nothing else. Every rank must run the same barriers; one
    that never arrives makes the others' kernels trap after ``MOE_EP_TIMEOUT_S`` seconds."""
    fn = "exchange_barrier"
    _checks.check_dense_args(fn, flag_rows=flag_rows, flags=flags)
    if not isinstance(flag_rows, torch.Tensor) or flag_rows.dtype != torch.int64 or flag_rows.dim() != 1 \
            or not flag_rows.is_contiguous() or flag_rows.numel() < 1:
        _checks.fail(fn, ValueError, "flag_rows must be a contiguous int64 tensor [P] of the ranks' flag addresses")
    num_ranks = flag_rows.numel()
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.int32 or tuple(flags.shape) != (num_ranks + 1,) \
            or not flags.is_contiguous():
        _checks.fail(fn, ValueError, f"flags must be a contiguous int32 tensor [{num_ranks + 1}] (P flags, then the "
                                     f"barrier count)")
    _checks.check_ints(fn, (("rank", rank, 0),))
    if rank >= num_ranks:
        _checks.fail(fn, ValueError, f"rank must be in [0, {num_ranks}), got {rank}")
    device = _checks.check_same_device(fn, [flag_rows, flags])
    if device.type != "cuda":
        _checks.fail(fn, ValueError, f"the device barrier runs on CUDA, got {device}")
    jit.native_module().moe_exchange_barrier(flag_rows.data_ptr(), flags.data_ptr(), rank, num_ranks, device.index,
                                             _descriptors.current_stream(device))


@dataclass
class ExchangeIndex:
    """This rank's layout after :func:`exchange_dispatch`, M rows: ``m_indices`` int32 [M] (local
    expert of each row, -1 on padding rows), ``global_ids`` int64 [M] (global expert or -1) and
    ``masked_m`` int32 [E_l] (rows each local expert received)."""

    m_indices: torch.Tensor
    global_ids: torch.Tensor
    masked_m: torch.Tensor


def _counts_matrix(counts: torch.Tensor, num_ranks: int, num_local: int) -> torch.Tensor:
    """int32 [P_src, >= E] per-source rows -> int64 [P_dst, P_src, E_l] on the CPU (plan_exchange's)."""
    return counts[:, : num_ranks * num_local].to(device="cpu", dtype=torch.int64).view(
        num_ranks, num_ranks, num_local).transpose(0, 1)


def exchange_dispatch(peers: ExchangePeers, xq: torch.Tensor, xs: torch.Tensor | None, topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor, within: torch.Tensor, counts: torch.Tensor, num_local_experts: int,
                      alignment: int, masked_max_rows: int, num_layout_rows: int,
                      first_expert: int = 0, barrier: ExchangeBarrier | None = None) -> ExchangeIndex:
    """Sends this rank's pairs into their owners' layouts and indexes this rank's layout.

    Layouts: :func:`kernels.reference.exchange.plan_exchange` of the count matrix ``counts`` int32
    [P, C >= P E_l] (row ``src``: the rows rank ``src`` sends to each global expert; on CUDA the
    kernel computes them on the device from this tensor). Pair ``p = t * k + j`` with global expert
    ``e = topk_idx[t, j]`` in [0, E) goes to the row of its owner ``e // num_local_experts``'s layout
    that this rank's ``within[p]``-th row of expert ``e`` takes: ``acts`` <- ``xq[t]``, ``acts_sf``
    <- ``xs[t]``, ``weights`` <- ``topk_weights[t, j]``, ``slots`` <- ``rank * pairs_per_rank + p``.

    ``xq`` E4M3 [T, H] (float8_e4m3fn or uint8 bits) with ``xs`` float32 [T, H/128], or bfloat16 /
    float16 / float32 rows [T, H] with ``xs=None``: the kernel quantizes each token's row once, bit
    for bit as ``kernels.per_token_cast_to_fp8(xq, gran_k=128)`` would, and sends it to each of its
    pairs (no cast launch; the CPU path casts first); 16-byte aligned rows. ``topk_idx`` int64
    [T, k], ``topk_weights`` float32 [T, k], ``within`` int32 [T * k] (:func:`exchange_count`'s:
    distinct positions in [0, counts[rank, e]) per expert; on CUDA a pair whose id or position the
    counts do not cover is dropped rather than written, the CPU path raises); ``num_layout_rows``:
    rows of the returned index, normally this rank's layout's (:func:`exchange_sizes`'s); a caller
    that learns the size only after the launch passes its receive capacity and slices the index to
    the layout (rows past the layout are left unwritten on CUDA, -1 on the CPU). A row at or past
    the peers' view rows (a layout larger than the buffers) is dropped and the layout's rows past
    ``num_layout_rows`` are not indexed: the caller raises on such sizes after a collective step,
    so that every rank raises together. On the CPU path, a ``num_layout_rows`` below a layout that
    fits the views raises. ``barrier`` (CUDA): the kernel's last CTA raises the group's barrier
    after every row is written (:class:`ExchangeBarrier`), so no :func:`exchange_barrier` launch
    follows."""
    fn = "exchange_dispatch"
    _checks.check_dense_args(fn, xq=xq, xs=xs, topk_idx=topk_idx, topk_weights=topk_weights, within=within,
                             counts=counts)
    _check_peers(fn, peers)
    hidden = peers.hidden
    xq, num_tokens, k = _checks.check_token_pairs(fn, xq, xs, topk_idx, topk_weights, hidden, unquantized=True)
    if not isinstance(within, torch.Tensor) or within.dtype != torch.int32 or tuple(within.shape) != (num_tokens * k,):
        _checks.fail(fn, ValueError, f"within must be an int32 tensor of shape [{num_tokens * k}] (T x k), got "
                                     f"{getattr(within, 'dtype', type(within).__name__)} "
                                     f"{list(getattr(within, 'shape', ()))}")
    _checks.check_ints(fn, (("num_local_experts", num_local_experts, 1), ("alignment", alignment, 1),
                     ("masked_max_rows", masked_max_rows, 0), ("num_layout_rows", num_layout_rows, 0),
                     ("first_expert", first_expert, 0)))
    num_ranks, num_experts = peers.num_ranks, peers.num_ranks * num_local_experts
    counts = _check_counts(fn, counts, num_ranks, num_experts)
    if num_tokens * k > peers.pairs_per_rank:
        _checks.fail(fn, ValueError, f"{num_tokens} x {k} pairs exceed pairs_per_rank={peers.pairs_per_rank}")
    device = _checks.check_same_device(fn, [xq, topk_idx, topk_weights, within, counts, peers.acts[0]]
                                       + ([] if xs is None else [xs]))
    barrier_args = _barrier_args(fn, barrier, peers, device)
    within = within.contiguous()  # the kernel indexes it by pair
    index = ExchangeIndex(torch.empty((num_layout_rows,), dtype=torch.int32, device=device),
                          torch.empty((num_layout_rows,), dtype=torch.int64, device=device),
                          torch.empty((num_local_experts,), dtype=torch.int32, device=device))
    if device.type == "cpu":
        if xs is None:
            xq, xs = quant.per_token_cast_to_fp8(xq if xq.stride(-1) == 1 else xq.contiguous(), use_ue8m0=False,
                                                 gran_k=128)
            xq = xq.view(torch.uint8)
        _dispatch_reference(peers, xq, xs, topk_idx, topk_weights, within, counts, num_local_experts, alignment,
                            masked_max_rows, first_expert, index)
        return index
    xq = _checks.vector_rows(xq, hidden)
    xs = xs.contiguous() if xs is not None else None
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    layout = (counts.data_ptr(), counts.stride(0), num_local_experts, alignment, masked_max_rows,
              min(t.shape[0] for t in peers.acts), num_layout_rows, first_expert, index.m_indices.data_ptr(),
              index.global_ids.data_ptr(), index.masked_m.data_ptr())
    jit.native_module().moe_exchange_dispatch(peers.native(), layout, k, hidden, within.data_ptr(), within.numel(),
                                              topk_idx.data_ptr(), topk_weights.data_ptr(), xq.data_ptr(),
                                              _descriptors.dtype_code(xq, "xq"), xq.stride(0),
                                              0 if xs is None else xs.data_ptr(), device.index,
                                              _descriptors.current_stream(device), barrier_args)
    return index


def _dispatch_reference(peers: ExchangePeers, xq, xs, topk_idx, topk_weights, within, counts, num_local: int,
                        alignment: int, masked_max_rows: int, first_expert: int, index: ExchangeIndex) -> None:
    fn = "exchange_dispatch"
    plan = reference_exchange.plan_exchange(_counts_matrix(counts, peers.num_ranks, num_local), peers.rank,
                                            alignment, masked_max_rows)
    flat = topk_idx.reshape(-1)
    pairs = ((flat >= 0) & (flat < plan.send_counts.numel())).nonzero().view(-1)
    expert, position = flat.index_select(0, pairs), within.index_select(0, pairs).to(torch.int64)
    per_expert = plan.send_counts.index_select(0, expert)
    capacity = min(t.shape[0] for t in peers.acts)
    if index.m_indices.numel() < plan.num_layout_rows <= capacity:
        _checks.fail(fn, ValueError, f"num_layout_rows={index.m_indices.numel()} is below this rank's layout of "
                                     f"{plan.num_layout_rows} rows")
    if plan.num_send_rows != pairs.numel() \
            or bool(((position < 0) | (position >= per_expert)).any()) \
            or torch.unique(expert * (pairs.numel() + 1) + position).numel() != pairs.numel():
        _checks.fail(fn, ValueError, f"counts say {plan.num_send_rows} pairs to send, got {pairs.numel()} routed pairs "
                                     "or positions that are not distinct in [0, counts[rank, expert]) per expert")
    # The row on its owner of this rank's first pair of each global expert, plus the pair's position.
    rows = (plan.send_delta + reference_exchange.exclusive_cumsum(plan.send_counts)).index_select(0, expert) + position
    owner = expert // num_local
    tokens = pairs // topk_idx.shape[1]
    for q in range(peers.num_ranks):
        mine = ((owner == q) & (rows < capacity)).nonzero().view(-1)
        if mine.numel() == 0:
            continue
        to, sent = rows.index_select(0, mine), pairs.index_select(0, mine)
        peers.acts[q].index_copy_(0, to, xq.index_select(0, tokens.index_select(0, mine)))
        peers.acts_sf[q].index_copy_(0, to, xs.index_select(0, tokens.index_select(0, mine)))
        peers.weights[q].index_copy_(0, to, topk_weights.reshape(-1).index_select(0, sent))
        peers.slots[q].index_copy_(0, to, (sent + peers.rank * peers.pairs_per_rank).to(torch.int32))
    index.m_indices.fill_(-1)
    valid = reference_exchange.expand_rows(plan.expert_delta, plan.expert_rows, plan.num_recv_rows)
    experts = torch.repeat_interleave(torch.arange(num_local, dtype=torch.int32), plan.expert_rows,
                                      output_size=plan.num_recv_rows)
    indexed = valid < index.m_indices.numel()  # the index may be shorter than the layout (a caller's error)
    index.m_indices.index_copy_(0, valid[indexed], experts[indexed])
    index.global_ids.copy_(torch.where(index.m_indices >= 0, index.m_indices.to(torch.int64) + first_expert, -1))
    index.masked_m.copy_(plan.expert_rows)


def exchange_combine(peers: ExchangePeers, expert_out: torch.Tensor, m_indices: torch.Tensor,
                     barrier: ExchangeBarrier | None = None) -> None:
    """Every received row ``r`` of this rank's layout (``m_indices[r] >= 0``), slot word ``s =
    slots[rank][r]``: ``expert_out[r]`` into row ``s % pairs_per_rank`` of rank ``s //
    pairs_per_rank``'s ``combine`` view.

    ``expert_out`` bfloat16 [M, H] and ``m_indices`` int32 [M] (:func:`exchange_dispatch`'s);
    ``barrier`` as the dispatch's (raised also when M = 0)."""
    fn = "exchange_combine"
    _checks.check_dense_args(fn, expert_out=expert_out, m_indices=m_indices)
    _check_peers(fn, peers)
    hidden = peers.hidden
    if not isinstance(expert_out, torch.Tensor) or expert_out.dtype != torch.bfloat16 or expert_out.dim() != 2 \
            or expert_out.shape[1] != hidden:
        _checks.fail(fn, ValueError, f"expert_out must be a bfloat16 tensor of shape [M, {hidden}], got "
                                     f"{getattr(expert_out, 'dtype', type(expert_out).__name__)} "
                                     f"{list(getattr(expert_out, 'shape', ()))}")
    num_rows = expert_out.shape[0]
    if not isinstance(m_indices, torch.Tensor) or m_indices.dtype != torch.int32 \
            or tuple(m_indices.shape) != (num_rows,) or num_rows > peers.slots[peers.rank].shape[0]:
        _checks.fail(fn, ValueError, f"m_indices must be an int32 tensor of shape [{num_rows}] (expert_out's rows, at "
                                     f"most the {peers.slots[peers.rank].shape[0]} of the views), got "
                                     f"{getattr(m_indices, 'dtype', type(m_indices).__name__)} "
                                     f"{list(getattr(m_indices, 'shape', ()))}")
    device = _checks.check_same_device(fn, [expert_out, m_indices, peers.acts[0]])
    barrier_args = _barrier_args(fn, barrier, peers, device)
    if num_rows == 0 and barrier is None:
        return
    if device.type == "cpu":
        rows = (m_indices >= 0).nonzero().view(-1)
        slots = peers.slots[peers.rank].index_select(0, rows).to(torch.int64)
        source, pair = slots // peers.pairs_per_rank, slots % peers.pairs_per_rank
        for p in range(peers.num_ranks):
            mine = (source == p).nonzero().view(-1)
            if mine.numel():
                peers.combine[p].index_copy_(0, pair.index_select(0, mine),
                                             expert_out.index_select(0, rows.index_select(0, mine)))
        return
    expert_out = _checks.contiguous_aligned(expert_out)
    jit.native_module().moe_exchange_combine(peers.native(), hidden, m_indices.contiguous().data_ptr(), num_rows,
                                             expert_out.data_ptr(), device.index, _descriptors.current_stream(device),
                                             barrier_args)

