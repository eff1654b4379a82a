"""The staged backend: the Mega MoE data path as separate kernel launches.

One forward, every rank of the expert-parallel group together (``P`` ranks, ``E_l`` local experts):

1. (one rank's decode layout only: ``per_token_cast_to_fp8`` of this rank's tokens, 1x128 scales;
   otherwise the dispatch of step 3 quantizes each token's row itself, the same bits);
2. counts: one launch numbers each pair among its expert's pairs and writes how many rows this
   rank sends to each global expert into row ``p`` of every rank's ``signals`` view (the count
   matrix [P, E + 1]; ``kernels.exchange_count``); barrier; a one-CTA kernel reduces the
   matrix to the few ints the host needs (every rank's layout size, this rank's pairs, invalid ids:
   ``kernels.exchange_sizes``, :class:`LayoutSizes`); on CUDA with several ranks all three are one
   launch (``kernels.exchange_count_sizes``); with several ranks the sizes are read in the
   forward's one host sync after step 3 is queued (one rank: before it, to size its buffers);
3. dispatch: each (token, top-k slot) becomes one row (the token's row read once and quantized to
   E4M3 on the way), written straight into its place in the
   owner's ``l1_acts`` (FP8 row), ``l1_acts_sf`` (scales), ``l1_weights`` (top-k weight) and
   ``l1_slots`` (its slot word ``source rank * T_cap * k + t * k + j``), all in one launch
   (``kernels.exchange_dispatch``, which lays every rank's rows out on the device from the count
   matrix and writes this rank's ``m_indices``); barrier. The owner's rows are then already
   in the contiguous layout of the grouped GEMM: one segment per local expert, padded to
   ``kernels.get_mk_alignment_for_contiguous_layout()`` rows, sources in rank order inside a
   segment, a source's rows of one expert in the count kernel's order (its atomics');
4. L1 ``m_grouped_fp8_gemm_nt_contiguous`` (``m_indices``: the local expert of each row, -1 on
   padding rows) -> bf16 [M, 2I]; SwiGLU in float32 x top-k weight; ``per_token_cast_to_fp8``;
   L2 ``m_grouped_fp8_gemm_nt_contiguous`` -> bf16 [M, H] (FP4 weights: the
   ``m_grouped_fp8_fp4_gemm_nt_contiguous`` pair, scales as UE8M0 bytes prepared once).
   Decode: when no local expert of a rank receives more than :data:`kMaskedMaxRows` rows, that
   rank's segments all get the largest count's length instead (``[E_l, rows, H]``, the masked
   layout) and the ``m_grouped_*_masked`` pair runs, FP4 weights in the decode layout
   (``kernels.transform_fp4_for_decode``, made once on CUDA) — no 128-row padding per expert;
5. combine: each output row is written into the ``combine`` view [T, k, H] of its source rank at
   its slot (``kernels.exchange_combine``, one launch; on CUDA its last CTA raises the barrier that
   follows); barrier; each rank sums its slots in float32 in slot order and rounds once.

With one rank the "peer" buffers are this process's tensors, sized for the forward (a local
permutation, no symmetric memory). With several, they are views of a :class:`SymmBuffer` (the
``torch`` backend on CUDA, ``host`` on CPU, ``MOE_SYMM_BACKEND`` to override) and the writes are
peer writes.

Numerics: the contract of :mod:`moe_runtime.backends.reference`, except that the L1 output ``h``
is the GEMM's bf16 output rather than float32 (about 1e-5 in calc_diff). Padding rows of the
contiguous layout hold stale or uninitialised data; every step is row-local, so it never reaches
a valid row, and no padding row is combined.

CPU tensors run the kernels' pure-torch references, so the whole pipeline runs (and is tested)
without a GPU.

bf16 expert weights take another pair: the reference exchange around two bf16 grouped GEMMs
(:mod:`moe_runtime.backends.grouped_bf16`); the steps above are those of FP8 and FP4 weights.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

import kernels
from moe_runtime.backends.base import (CombineHandle, DispatchCombine, DispatchResult, Experts, LocalExperts,
                                       MoEProblem)
from moe_runtime.backends.grouped_bf16 import GroupedBf16Experts
from moe_runtime.backends.reference import ReferenceDispatchCombine
from kernels.exchange import ExchangeIndex, ExchangePeers
from kernels.reference.exchange import LayoutSizes
from moe_runtime.weight_layout import transform_weights_for_mega_moe
from moe_runtime.dist import group_rank, group_size
from moe_runtime.symm import SymmBuffer, ViewSpec, align_up, compute_layout

kActGroup = 128
kMaskedMaxRows = 32  # the FP4 decode-layout kernel's range; below the contiguous padding for FP8 as well


def contiguous_alignment() -> int:
    """Rows every expert segment of the contiguous layout is padded to (the grouped GEMM's block M)."""
    return kernels.get_mk_alignment_for_contiguous_layout()


def _device_supported(problem: MoEProblem) -> tuple[bool, str]:
    """Whether the problem's device runs the grouped GEMM kernels (or their CPU references)."""
    device = torch.device(problem.device)
    if device.type not in ("cpu", "cuda"):
        return False, f"device {device} is neither CPU nor CUDA"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if major != 9:
            return False, f"the grouped GEMM kernels target SM90 (Hopper); this GPU is sm_{major}{minor}"
    return True, ""


def is_supported(problem: MoEProblem) -> tuple[bool, str]:
    """``(True, how)`` when the staged backend can run ``problem``, else ``(False, why)``. bf16 weights
    run :mod:`moe_runtime.backends.grouped_bf16` (the reference exchange around bf16 grouped GEMMs)."""
    if problem.weights == "bf16":
        ok, reason = GroupedBf16Experts.is_supported(problem)
        if ok:
            on_device, why_not = _device_supported(problem)
            if not on_device:
                return False, why_not
        return ok, reason
    return fp8_is_supported(problem)


def fp8_is_supported(problem: MoEProblem) -> tuple[bool, str]:
    """:func:`is_supported` of the FP8 / FP4 weights' pair (:class:`StagedDispatchCombine`,
    :class:`StagedExperts`)."""
    if problem.weights not in ("fp8", "fp4"):
        return False, f"the staged exchange and experts run FP8 or FP4 expert weights, got weights={problem.weights!r}"
    if not problem.use_fp8_dispatch:
        return False, "the staged backend dispatches FP8 activations (use_fp8_dispatch=True)"
    if problem.dtype != torch.bfloat16:
        return False, (f"the grouped GEMMs write bfloat16 expert outputs, and the numerics contract rounds them "
                       f"to the layer dtype; got dtype={problem.dtype}")
    for value, name in ((problem.hidden, "hidden"), (problem.intermediate, "intermediate")):
        if value % kActGroup:
            return False, f"{name}={value} must be a multiple of {kActGroup} (the FP8 GEMMs' K block)"
    ok, reason = _device_supported(problem)
    if not ok:
        return False, reason
    device = torch.device(problem.device)
    if device.type == "cuda":
        if problem.num_experts > kernels.exchange.kExchangeMaxExperts:
            return False, (f"the CUDA exchange kernels lay out at most {kernels.exchange.kExchangeMaxExperts} experts, "
                           f"got {problem.num_experts}")
        if problem.ep_size > 1 and importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
            return False, "expert parallelism on CUDA needs torch.distributed._symmetric_memory"
    transport = "local permutation" if problem.ep_size == 1 else "peer writes into a SymmBuffer"
    return True, f"FP8 grouped GEMMs (contiguous layout) on {device.type}, {transport}"


# ---- buffers: every rank's receive and combine areas as seen from this process --------------------------


class _Pairs(NamedTuple):
    """``kernels.exchange_dispatch``'s per-pair inputs, in its argument order: the rows as E4M3
    with their scales, or unquantized with ``xs`` None."""

    xq: torch.Tensor
    xs: torch.Tensor | None
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    within: torch.Tensor


@dataclass(frozen=True)
class _LayoutArgs:
    num_experts: int
    num_local: int
    alignment: int
    masked_max_rows: int
    first_expert: int


def check_plan(plan: LayoutSizes, num_experts: int, capacity: int | None) -> None:
    """Raises on invalid expert ids (any rank's) and on a layout larger than the receive buffers
    (``capacity`` rows; None: sized per forward)."""
    if any(plan.invalid_ids):
        raise ValueError(f"topk_idx must hold expert ids in [0, {num_experts}) or -1; ids outside that per "
                         f"rank: {list(plan.invalid_ids)}")
    worst = max(plan.padded_rows)
    if capacity is not None and worst > capacity:
        owner = plan.padded_rows.index(worst)
        raise RuntimeError(f"staged dispatch: rank {owner} would receive {worst} rows (padding included), "
                           f"more than the {capacity} its SymmBuffer holds; a token's top-k experts must "
                           "be distinct")


class _LocalExchange:
    """One rank: buffers are allocated per forward at the size the plan needs."""

    rank, num_ranks = 0, 1

    def __init__(self, hidden: int, top_k: int, device: torch.device):
        self.hidden, self.top_k, self.device = hidden, top_k, device

    def count(self, topk_idx: torch.Tensor, layout: "_LayoutArgs") -> tuple[torch.Tensor, torch.Tensor, None]:
        """``kernels.exchange_count``'s positions, the count matrix int32 [1, E + 1] and no sizes
        launched yet (the dispatch reads them first)."""
        within, row = kernels.exchange_count(topk_idx, layout.num_experts)
        return within, row.view(1, -1), None

    def dispatch(self, pairs: "_Pairs", counts: torch.Tensor, layout: "_LayoutArgs", pending: None = None):
        """Sizes first (the buffers are allocated per forward at the plan's size), then the rows:
        returns (plan, peers, index)."""
        plan = kernels.exchange_sizes(counts, 0, layout.num_local, layout.alignment, layout.masked_max_rows)
        check_plan(plan, layout.num_experts, None)
        rows, dev, num_pairs = plan.num_layout_rows, self.device, max(pairs.topk_idx.numel(), 1)
        peers = ExchangePeers((torch.empty((rows, self.hidden), dtype=torch.uint8, device=dev),),
                              (torch.empty((rows, self.hidden // kActGroup), dtype=torch.float32, device=dev),),
                              (torch.empty((rows,), dtype=torch.float32, device=dev),),
                              (torch.empty((rows,), dtype=torch.int32, device=dev),),
                              (torch.empty((num_pairs, self.hidden), dtype=torch.bfloat16, device=dev),), 0, num_pairs)
        index = kernels.exchange_dispatch(peers, *pairs, counts, layout.num_local, layout.alignment,
                                          layout.masked_max_rows, rows, layout.first_expert)
        return plan, peers, index

    def send_back(self, peers: ExchangePeers, expert_out: torch.Tensor, m_indices: torch.Tensor) -> None:
        """``kernels.exchange_combine`` into this rank's own combine view."""
        kernels.exchange_combine(peers, expert_out, m_indices)

    def barrier(self) -> None:
        """Nothing crosses processes."""


def staged_view_specs(num_ranks: int, num_local_experts: int, num_max_tokens_per_rank: int, top_k: int,
                      hidden: int, alignment: int) -> tuple[list[ViewSpec], int]:
    """The staged backend's SymmBuffer views and ``R``, the rows of its receive area.

    ``R``: each token of each rank sends at most ``min(k, E_l)`` rows to one rank (its experts are
    distinct), and each local expert's segment adds at most ``alignment - 1`` padding rows.
    Views not in the Mega MoE layout: ``l1_weights`` and ``l1_slots`` (per received row), because
    rows are pushed whole and the receiver never reads the sender's routing; ``signals`` holds the
    count matrix, int32 [P, E + 1]: row ``p`` is written by rank ``p`` (its rows per global expert,
    then its count of invalid ids), then the device barrier's flags, int32 [P + 1]
    (:func:`kernels.exchange_barrier`), then the counter of finished CTAs that the dispatch and
    combine kernels raise that barrier with (:class:`kernels.ExchangeBarrier`), int32 [1].
    """
    rows = num_ranks * num_max_tokens_per_rank * min(top_k, num_local_experts)
    capacity = align_up(rows + num_local_experts * (alignment - 1), alignment)
    specs = [ViewSpec("l1_acts", (capacity, hidden), torch.float8_e4m3fn),
             ViewSpec("l1_acts_sf", (capacity, hidden // kActGroup), torch.float32),
             ViewSpec("l1_weights", (capacity,), torch.float32),
             ViewSpec("l1_slots", (capacity,), torch.int32),
             ViewSpec("combine", (num_max_tokens_per_rank * top_k, hidden), torch.bfloat16),
             ViewSpec("signals", (num_ranks * (num_ranks * num_local_experts + 1) + num_ranks + 2,), torch.int32)]
    return specs, capacity


class _SymmExchange:
    """Several ranks: peer views of one :class:`SymmBuffer` per rank (collective to build)."""

    def __init__(self, problem: MoEProblem, group, alignment: int):
        device = torch.device(problem.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.num_ranks = group_rank(group), group_size(group)
        if problem.num_experts != self.num_ranks * problem.num_local_experts:
            # The count rows are P E_l + 1 wide, the barrier's flags right after them.
            raise ValueError(f"num_experts={problem.num_experts} must be the {self.num_ranks} ranks' local experts "
                             f"together (a multiple of the group's size)")
        specs, self.capacity = staged_view_specs(self.num_ranks, problem.num_local_experts,
                                                 problem.num_max_tokens_per_rank, problem.top_k, problem.hidden,
                                                 alignment)
        self.buffer = SymmBuffer(compute_layout(specs), group=group, device=device)
        self.buffer.view("signals").zero_()
        ranks = range(self.num_ranks)
        # The count matrix int32 [P, E + 1] (row p: rank p's) and, on CUDA, the addresses of this
        # rank's row in every rank's matrix, which the count kernel writes directly.
        width = self.num_ranks * problem.num_local_experts + 1
        self._counts = self.buffer.view("signals")[: self.num_ranks * width].view(self.num_ranks, width)
        # The barrier's flags after the matrix: on CUDA the group's barriers run on the device
        # (one launch; torch's symmetric-memory barrier cost the host several times that).
        matrix = self.num_ranks * width
        self._barrier_flags = self.buffer.view("signals")[matrix: matrix + self.num_ranks + 1]
        self._count_rows = self._barrier_rows = self._grid_barrier = None
        self._sizes_host = self._copy_stream = None
        if device.type == "cuda":
            # The sizes are read on a side stream into pinned memory right after the count, so the
            # host goes on (slices the index, launches the experts' GEMMs) while the rows move.
            self._sizes_host = torch.empty(3 * self.num_ranks + 1, dtype=torch.int32, pin_memory=True)
            self._copy_stream = torch.cuda.Stream(device)
            signals = [self.buffer.peer_view("signals", q).data_ptr() for q in ranks]
            self._count_rows = torch.tensor([base + 4 * self.rank * width for base in signals], dtype=torch.int64,
                                            device=device)
            self._barrier_rows = torch.tensor([base + 4 * matrix for base in signals], dtype=torch.int64,
                                              device=device)
            # The dispatch and combine kernels raise the barrier that follows them from their last CTA.
            done = matrix + self.num_ranks + 1
            self._grid_barrier = kernels.ExchangeBarrier(self._barrier_rows, self._barrier_flags,
                                                         self.buffer.view("signals")[done: done + 1])
        self._peers = ExchangePeers(tuple(self.buffer.peer_view("l1_acts", r).view(torch.uint8) for r in ranks),
                                    *(tuple(self.buffer.peer_view(name, r) for r in ranks)
                                      for name in ("l1_acts_sf", "l1_weights", "l1_slots", "combine")),
                                    self.rank, problem.num_max_tokens_per_rank * problem.top_k)
        # On CUDA every forward's launches go through one object that checked the buffers once.
        self._prepared = None if self._grid_barrier is None else kernels.PreparedExchange(
            self._peers, self._counts, self._count_rows, self._grid_barrier, problem.num_local_experts, self.capacity)
        self.buffer.barrier()

    def count(self, topk_idx: torch.Tensor, layout: "_LayoutArgs"):
        """``kernels.exchange_count``'s positions, its row (this rank's rows per global expert, then
        its invalid ids) in every rank's count matrix (written by the kernel on CUDA, copied on the
        CPU), barrier; returns the positions, this rank's matrix int32 [P, E + 1] (which the sizes
        and dispatch kernels read: a peer rewrites its row only after the barrier that ends this
        forward's dispatch) and, on CUDA, the sizes already launched: count, barrier and sizes are
        one launch there (``kernels.exchange_count_sizes``); None on the CPU."""
        if self._prepared is not None:
            within, pending = self._prepared.count_sizes(topk_idx, layout.alignment, layout.masked_max_rows)
            return within, self._counts, pending
        within, row = kernels.exchange_count(topk_idx, layout.num_experts)
        width = row.numel()
        for q in range(self.num_ranks):
            self.buffer.peer_view("signals", q)[self.rank * width: (self.rank + 1) * width].copy_(row)
        self.barrier()
        return within, self._counts, None

    def dispatch(self, pairs: "_Pairs", counts: torch.Tensor, layout: "_LayoutArgs", pending=None):
        """The rows before the host reads the sizes: the sizes kernel (unless ``pending``, the count's
        launch, already holds them), the dispatch (its index over
        the whole receive capacity; rows a too-large layout would put past it are dropped) and the
        barrier are queued back to back, then one read returns (plan, peers, index), the index
        sliced to this rank's layout. On CUDA that read starts on a side stream before the dispatch
        is queued and waits for the count alone, so the host returns (and queues the experts) while
        the rows move. Every rank sees the same plan and raises on it together; an
        error of one rank's own before the barrier (its arguments, a failed compile) leaves the
        others waiting in the barrier, whose kernel traps after ``MOE_EP_TIMEOUT_S`` seconds on CUDA
        (the process group's timeout on the CPU) unless that rank goes on to enter a later barrier,
        which the waiting ones would take for this one: the group is then out of step."""
        if pending is None:
            pending = kernels.exchange_sizes(counts, self.rank, layout.num_local, layout.alignment,
                                             layout.masked_max_rows, wait=False)
        if self._copy_stream is not None:
            pending.start_copy(self._sizes_host, self._copy_stream)
        if self._prepared is not None and pairs.xs is None:
            index = self._prepared.dispatch(pairs.xq, pairs.topk_idx, pairs.topk_weights, pairs.within,
                                            layout.alignment, layout.masked_max_rows, layout.first_expert)
        else:
            index = kernels.exchange_dispatch(self._peers, *pairs, counts, layout.num_local, layout.alignment,
                                              layout.masked_max_rows, self.capacity, layout.first_expert,
                                              barrier=self._grid_barrier)
        if self._grid_barrier is None:
            self.barrier()
        plan = pending.wait()
        check_plan(plan, layout.num_experts, self.capacity)
        m = plan.num_layout_rows
        return plan, self._peers, ExchangeIndex(index.m_indices[:m], index.global_ids[:m], index.masked_m)

    def send_back(self, peers: ExchangePeers, expert_out: torch.Tensor, m_indices: torch.Tensor) -> None:
        """``kernels.exchange_combine`` of the layout's rows into their sources' combine views, then
        the barrier (raised by the combine kernel itself on CUDA)."""
        if self._prepared is not None:
            self._prepared.combine(expert_out, m_indices)
            return
        kernels.exchange_combine(peers, expert_out, m_indices, barrier=self._grid_barrier)
        if self._grid_barrier is None:
            self.barrier()

    def barrier(self) -> None:
        """Collective, stream-ordered: every rank's writes before it are visible after it."""
        if self._barrier_rows is not None:
            kernels.exchange_barrier(self._barrier_rows, self._barrier_flags, self.rank)
        else:
            self.buffer.barrier()


# ---- the backend pair --------------------------------------------------------------------------------


@dataclass
class StagedCombineHandle(CombineHandle):
    """What ``combine`` needs: the plan, every rank's buffers, this rank's layout index (int32
    [M], -1 on padding rows) and which of this rank's (token, slot) pairs are routed (bool
    [T, k]; ``None`` when all are). ``counts`` is left empty: ranks never learn each other's token
    counts."""

    plan: LayoutSizes | None = None
    peers: ExchangePeers | None = None
    m_indices: torch.Tensor | None = None
    routed: torch.Tensor | None = None
    pair_rows: torch.Tensor | None = None   # local decode: int64 [T * k], the layout row of each (t, j)
    num_rows: int = 0                       # rows of the dispatched layout (expert_out's M)


@dataclass
class StagedDispatchResult(DispatchResult):
    """Rows in the contiguous layout: ``x`` e4m3 [M, H], ``x_sf`` float32 [M, H/128], ``topk_idx``
    int64 [M, 1] (the row's global expert, -1 on padding rows), ``topk_weights`` float32 [M, 1],
    and ``m_indices`` int32 [M] (the row's local expert, -1 on padding rows). In the masked layout
    (``masked_max_m > 0``) M = E_l x masked_max_m and ``masked_m`` int32 [E_l] counts each
    expert's valid rows (the first of its segment)."""

    m_indices: torch.Tensor | None = None
    masked_m: torch.Tensor | None = None
    masked_max_m: int = 0
    expected_m: int = 0  # masked layout: the GEMMs' hint of rows per expert (0: masked_max_m)


class StagedDispatchCombine(DispatchCombine):
    """Dispatch into the owners' contiguous layouts and combine back, over ``group``."""

    def __init__(self, problem: MoEProblem, group, first_expert: int, masked_max_rows: int = kMaskedMaxRows):
        self.problem = problem
        self.first_expert = first_expert
        self.masked_max_rows = masked_max_rows  # 0: always the contiguous layout
        device = torch.device(problem.device)
        if group_size(group) != problem.ep_size:
            # The count rows are E + 1 wide for the group's experts: another ep_size would overrun them.
            raise ValueError(f"the group has {group_size(group)} ranks, the problem ep_size={problem.ep_size}")
        if group_size(group) == 1:
            self.exchange = _LocalExchange(problem.hidden, problem.top_k, device)
        else:
            self.exchange = _SymmExchange(problem, group, contiguous_alignment())

    @classmethod
    def is_supported(cls, problem: MoEProblem) -> tuple[bool, str]:
        return fp8_is_supported(problem)

    def _check(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        num_tokens, k = x.shape[0], self.problem.top_k
        if x.dim() != 2 or x.shape[1] != self.problem.hidden:
            raise ValueError(f"x must be [T, {self.problem.hidden}], got {tuple(x.shape)}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
        if tuple(topk_idx.shape) != (num_tokens, k) or topk_idx.dtype != torch.int64:
            raise ValueError(f"topk_idx must be int64 [{num_tokens}, {k}], got {topk_idx.dtype} "
                             f"{tuple(topk_idx.shape)}")
        if tuple(topk_weights.shape) != (num_tokens, k) or topk_weights.dtype != torch.float32:
            raise ValueError(f"topk_weights must be float32 [{num_tokens}, {k}], got {topk_weights.dtype} "
                             f"{tuple(topk_weights.shape)}")
        if num_tokens > self.problem.num_max_tokens_per_rank:
            raise ValueError(f"{num_tokens} tokens exceed num_max_tokens_per_rank="
                             f"{self.problem.num_max_tokens_per_rank}")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                 ids_checked: bool = False) -> DispatchResult:
        """``x`` [T, H] float, ``topk_idx`` int64 [T, k], ``topk_weights`` float32 [T, k] -> rows in
        this rank's contiguous or masked layout (:class:`StagedDispatchResult`).

        One rank, at most ``masked_max_rows`` tokens and ``ids_checked`` (ids known to be in
        [-1, E), as the layer's router makes them): the masked layout is built on the device with
        no host sync (:meth:`_dispatch_local_decode`), so the forward can sit in a CUDA graph."""
        self._check(x, topk_idx, topk_weights)
        num_tokens, k, num_experts = x.shape[0], self.problem.top_k, self.problem.num_experts
        ex = self.exchange
        if ids_checked and isinstance(ex, _LocalExchange) and 0 < num_tokens <= self.masked_max_rows:
            xq, xs = kernels.per_token_cast_to_fp8(x if x.stride(-1) == 1 else x.contiguous(), use_ue8m0=False,
                                                   gran_k=kActGroup)
            return self._dispatch_local_decode(xq, xs, topk_idx, topk_weights, x.dtype)
        # Each pair's position among its expert's pairs (unrouted pairs (-1) are never sent). The row
        # exchanged: this rank's pairs per global expert, then its invalid ids (checked after the
        # exchange, where every rank learns every rank's count: all raise together).
        # The alignment is read per forward: set_mk_alignment_for_contiguous_layout may change it.
        layout = _LayoutArgs(num_experts, self.problem.num_local_experts, contiguous_alignment(), self.masked_max_rows,
                             self.first_expert)
        within, counts, pending = ex.count(topk_idx, layout)
        # The exchange quantizes each token's row once on its way to the owners (1x128 scales, as
        # per_token_cast_to_fp8): no cast launch, and the row is read once, not once per pair.
        plan, peers, index = ex.dispatch(_Pairs(x, None, topk_idx, topk_weights, within), counts, layout, pending)
        m = plan.num_layout_rows

        me = peers.rank
        routed = None if plan.num_send_rows == num_tokens * k else (topk_idx >= 0)
        handle = StagedCombineHandle(num_tokens, [], x.dtype, plan, peers, index.m_indices, routed)
        return StagedDispatchResult(peers.acts[me][:m].view(torch.float8_e4m3fn), peers.acts_sf[me][:m],
                                    index.global_ids.unsqueeze(1), peers.weights[me][:m].unsqueeze(1), handle,
                                    index.m_indices, index.masked_m if plan.masked_max_m else None,
                                    plan.masked_max_m)

    def _dispatch_local_decode(self, xq: torch.Tensor, xs: torch.Tensor, topk_idx: torch.Tensor,
                               topk_weights: torch.Tensor, out_dtype: torch.dtype) -> StagedDispatchResult:
        """One rank, T <= masked_max_rows tokens: expert ``e``'s pairs go to rows ``e * T + i`` in
        (token, slot) order (the masked layout [E_l, T, H]; no expert gets more than T rows, a
        token's experts being distinct), unrouted pairs to spare rows after them
        (``kernels.moe_local_dispatch``: one launch, no host sync)."""
        num_tokens = xq.shape[0]
        out = kernels.moe_local_dispatch(xq, xs, topk_idx, topk_weights, self.problem.num_local_experts,
                                         self.first_expert)
        handle = StagedCombineHandle(num_tokens, [], out_dtype, routed=topk_idx >= 0, pair_rows=out.pair_rows,
                                     num_rows=out.acts.shape[0])
        return StagedDispatchResult(out.acts.view(torch.float8_e4m3fn), out.acts_sf, out.global_ids, out.weights, handle,
                                    None, out.masked_m, num_tokens)

    def combine(self, expert_out: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        """``expert_out`` bfloat16 [M, H] (rows of this rank's layout) -> [T, H] in ``handle.out_dtype``."""
        if not isinstance(handle, StagedCombineHandle) or (handle.plan is None and handle.pair_rows is None):
            raise TypeError(f"handle must come from StagedDispatchCombine.dispatch, got {type(handle).__name__}")
        plan, peers, hidden = handle.plan, handle.peers, self.problem.hidden
        rows = plan.num_layout_rows if plan is not None else handle.num_rows
        if tuple(expert_out.shape) != (rows, hidden) or expert_out.dtype != torch.bfloat16:
            raise ValueError(f"expert_out must be bfloat16 [{rows}, {hidden}], got "
                             f"{expert_out.dtype} {tuple(expert_out.shape)}")
        num_tokens, k = handle.num_local_tokens, self.problem.top_k
        if handle.pair_rows is not None:
            return kernels.moe_combine(expert_out, handle.pair_rows, handle.routed, num_tokens, k, handle.out_dtype)
        self.exchange.send_back(peers, expert_out, handle.m_indices)

        # Slot order and float32, as the reference sums; unrouted slots hold stale data and add 0.
        return kernels.moe_combine(peers.combine[peers.rank], None, handle.routed, num_tokens, k, handle.out_dtype)


class StagedExperts(Experts):
    """L1 grouped GEMM -> SwiGLU x top-k weight -> FP8 requantization -> L2 grouped GEMM, on the rows
    of a :class:`StagedDispatchResult`; ``expert_out`` is bfloat16 [M, H] (garbage on padding rows).

    ``decode_layout``: with FP4 weights on CUDA, also keep them in ``kernels.transform_fp4_for_decode``'s
    layout (about 1.06x the FP4 weight bytes more memory) for the masked decode GEMMs, which then
    run about 1.8x faster than on the packed weights.

    ``MOE_STAGED_FUSED_SWIGLU=1`` (read per forward; FP8 weights): the L1 GEMM writes the quantized
    SwiGLU x top-k weight itself (``kernels.m_grouped_fp8_gemm_nt_swiglu_*``, on a gate/up interleaved
    copy of the L1 weights made on first use), bit for bit the same act as the GEMM into bf16 followed by
    ``swiglu_quant_fp8``, without the bf16 rows between them."""

    def __init__(self, experts: LocalExperts, decode_layout: bool = True):
        fmt = experts.gate_up.format
        if fmt not in ("fp8", "fp4") or experts.down.format != fmt:
            raise ValueError(f"the staged backend needs FP8 or FP4 expert weights (both the same), got "
                             f"gate_up={experts.gate_up.format!r}, down={experts.down.format!r}")
        self.experts = experts
        self.intermediate = experts.down.shape[2]
        self.hidden = experts.down.shape[1]
        if fmt == "fp8":
            self.gemm = kernels.m_grouped_fp8_gemm_nt_contiguous
            self.masked_gemm = kernels.m_grouped_fp8_gemm_nt_masked
            self.w13 = (experts.gate_up.data, experts.gate_up.sf)
            self.w2 = (experts.down.data, experts.down.sf)
        else:
            # The FP4 GEMMs read UE8M0 exponent bytes; converted once here, not per call.
            self.gemm = kernels.m_grouped_fp8_fp4_gemm_nt_contiguous
            self.masked_gemm = kernels.m_grouped_fp8_fp4_gemm_nt_masked
            self.w13 = (experts.gate_up.data, kernels.transform_sf_for_fp4_gemm(experts.gate_up.sf))
            self.w2 = (experts.down.data, kernels.transform_sf_for_fp4_gemm(experts.down.sf))
        # The FP8 contiguous GEMMs load MN-major A scales by TMA where K is a multiple of 512 (whole
        # boxes of B's scales); elsewhere, and in the FP4 GEMMs, scales are gathered in either layout.
        self.mn_major_l1 = fmt == "fp8" and self.hidden % 512 == 0
        self.mn_major_l2 = fmt == "fp8" and self.intermediate % 512 == 0
        self.w13_masked, self.w2_masked = self.w13, self.w2
        self.fused_swiglu_ok = fmt == "fp8" and self.intermediate % 128 == 0
        self._w13_interleaved: tuple[torch.Tensor, torch.Tensor] | None = None
        if fmt == "fp4" and decode_layout and experts.gate_up.data.is_cuda:
            self.w13_masked = kernels.transform_fp4_for_decode(*self.w13)
            self.w2_masked = kernels.transform_fp4_for_decode(*self.w2)

    @classmethod
    def is_supported(cls, problem: MoEProblem) -> tuple[bool, str]:
        return fp8_is_supported(problem)

    def apply(self, dispatched: DispatchResult) -> torch.Tensor:
        if not isinstance(dispatched, StagedDispatchResult) or (dispatched.m_indices is None
                                                                and not dispatched.masked_max_m):
            raise TypeError(f"dispatched must come from StagedDispatchCombine.dispatch, got "
                            f"{type(dispatched).__name__}")
        m, inter, device = dispatched.x.shape[0], self.intermediate, dispatched.x.device
        out = torch.empty((m, self.hidden), dtype=torch.bfloat16, device=device)
        if m == 0:
            return out
        rows, groups = dispatched.masked_max_m, self.experts.gate_up.shape[0]
        if rows:
            def grouped(t: torch.Tensor) -> torch.Tensor:  # [E_l x rows (+ spare), ...] -> [E_l, rows, ...]
                return t[: groups * rows].view(groups, rows, *t.shape[1:])

            expected = dispatched.expected_m or rows

            def gemm(a, b, d):
                self.masked_gemm((grouped(a[0]), grouped(a[1])), b, grouped(d), dispatched.masked_m, expected)
            # The FP4 decode layout serves up to kMaxDecodeRows expected rows per expert; larger
            # batches (the low-latency layout's rows can reach ranks x tokens) take the packed weights.
            decode = min(expected, rows) <= kernels._fp4_fragment.kMaxDecodeRows
            w13, w2 = (self.w13_masked, self.w2_masked) if decode else (self.w13, self.w2)
        else:
            def gemm(a, b, d):
                self.gemm(a, b, d, dispatched.m_indices)
            w13, w2 = self.w13, self.w2
        # The contiguous GEMMs load MN-major TMA-aligned A scales with one TMA box per K block
        # (K-major ones: a 4-K-block box per stage). The received scales are transposed once (M x
        # H/128 floats, ~9 us at 16384 rows); SwiGLU writes its scales so at no cost. On an H200
        # (32 experts, profiler) the layer ran 0.5% (512 tokens) to 2.3% (8192) faster, both GEMMs
        # 3-4% at 8192 tokens (bench/RESULTS.md, 2026-12-01).
        mn_major = not rows and os.environ.get("MOE_STAGED_MN_MAJOR_SF", "1") != "0"
        x_sf = dispatched.x_sf
        if mn_major and self.mn_major_l1:
            x_sf = kernels.get_mn_major_tma_aligned_tensor(x_sf)
        mn_major_act = mn_major and self.mn_major_l2
        if self.fused_swiglu_ok and os.environ.get("MOE_STAGED_FUSED_SWIGLU", "0") == "1":
            act_fp8 = self._fused_l1(dispatched, x_sf, grouped if rows else None, expected if rows else 0, mn_major_act)
        else:
            h = torch.empty((m, 2 * inter), dtype=torch.bfloat16, device=device)
            gemm((dispatched.x, x_sf), w13, h)
            # SwiGLU x top-k weight, quantized per 1x128 in one launch (masked layout: the rows that
            # arrived only).
            if rows:  # the groups' rows only (the one-rank decode layout keeps spare rows after them)
                act_fp8 = kernels.swiglu_quant_fp8(h[: groups * rows], dispatched.topk_weights[: groups * rows],
                                                   dispatched.masked_m, rows)
            else:
                act_fp8 = kernels.swiglu_quant_fp8(h, dispatched.topk_weights, mn_major_sf=mn_major_act)
            del h
        gemm(act_fp8, w2, out)
        return out

    def _fused_l1(self, dispatched: "StagedDispatchResult", x_sf: torch.Tensor, grouped, expected: int,
                  mn_major_act: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(act, act_sf) of the L1 GEMM with the SwiGLU epilogue (FP8 weights, interleaved on first use);
        ``grouped`` and ``expected``: apply()'s view of the masked layout's groups and its expected rows,
        None for the contiguous layout."""
        if self._w13_interleaved is None:
            self._w13_interleaved = tuple(transform_weights_for_mega_moe(self.w13, self.w2).l1)
        m, groups, device = dispatched.x.shape[0], self.intermediate // 128, dispatched.x.device
        act = torch.empty((m, self.intermediate), dtype=torch.float8_e4m3fn, device=device)
        act_sf = kernels.layout.empty_activation_scales(m, groups, mn_major_act, device)
        topk = dispatched.topk_weights.reshape(-1).contiguous()
        if grouped is None:
            kernels.m_grouped_fp8_gemm_nt_swiglu_contiguous((dispatched.x, x_sf), self._w13_interleaved, (act, act_sf),
                                                            dispatched.m_indices, topk)
        else:
            kernels.m_grouped_fp8_gemm_nt_swiglu_masked(
                (grouped(dispatched.x), grouped(x_sf)), self._w13_interleaved, (grouped(act), grouped(act_sf)),
                dispatched.masked_m, expected, grouped(topk))
        return act, act_sf

def create(problem: MoEProblem, experts: LocalExperts, group) -> tuple[DispatchCombine, Experts]:
    """The staged pair for ``problem`` (collective over ``group`` when it has several ranks: the
    SymmBuffer is allocated here). Raises NotImplementedError when :func:`is_supported` says no."""
    ok, reason = is_supported(problem)
    if not ok:
        raise NotImplementedError(f"backend='staged' cannot run this layer: {reason}")
    if problem.weights == "bf16":
        return ReferenceDispatchCombine(group, False), GroupedBf16Experts(experts, problem.dtype)
    return StagedDispatchCombine(problem, group, experts.first_expert), StagedExperts(experts)
