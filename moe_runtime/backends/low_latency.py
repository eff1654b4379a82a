"""The low-latency expert-parallel transport (decode sizes), paired with the staged experts.

:class:`LowLatencyDispatchCombine` moves tokens with ``kernels.ep_dispatch`` / ``kernels.ep_combine``
through one :class:`moe_runtime.symm.SymmBuffer` per rank (views from ``kernels.ep_buffer_views``):
every (token, slot) pair is written by its source straight into its expert's segment of the
owner's masked layout ``[E_l, R, H]`` (R = P x num_max_tokens_per_rank), and the outputs come back
the same way. Nothing waits on the host: no count exchange, no barrier, so a forward can be
captured in a CUDA graph on every rank. The price is memory (every rank holds R rows per local
expert) and masked GEMMs over R rows per expert (their work follows ``masked_m``, not R).

With one rank the buffer is an ordinary allocation (the same kernels, no peers).

The experts are :class:`moe_runtime.backends.staged.StagedExperts` on the masked layout. Every rank
of the group must run the same number of forwards (the transport counts them on the device); a
rank that stops, or raises on its own arguments before its dispatch (nothing is exchanged first
that would make every rank raise together, as the staged backend's count exchange does), makes
the others' kernels trap after ``MOE_EP_TIMEOUT_S`` seconds instead of hanging.

CUDA only (the transport is peer writes between GPUs, or between processes sharing one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernels
from moe_runtime.backends.base import CombineHandle, DispatchCombine, DispatchResult, Experts, LocalExperts, MoEProblem
from moe_runtime.backends.staged import StagedDispatchResult, StagedExperts, kActGroup
from moe_runtime.backends.staged import fp8_is_supported as staged_is_supported
from moe_runtime.dist import group_rank, group_size
from moe_runtime.symm import SymmBuffer, SymmLayout, ViewSpec, compute_layout


class _OneRankBuffer:
    """The views of a group of one: an ordinary allocation with a SymmBuffer's ``layout``, ``view``,
    ``peer_ptrs`` and ``barrier`` (nothing to rendezvous with)."""

    def __init__(self, layout: SymmLayout, device: torch.device):
        self.layout = layout
        self.buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)

    def view(self, name: str) -> torch.Tensor:
        v = self.layout[name]
        return self.buffer[v.offset: v.offset + v.nbytes].view(v.dtype).view(v.shape)

    @property
    def peer_ptrs(self) -> list[int]:
        return [self.buffer.data_ptr()]

    def barrier(self) -> None:
        """Nothing crosses processes."""


# Every rank holds ranks x num_max_tokens_per_rank rows per local expert: past this the transport is
# the wrong tool (prefill-sized batches), not a memory error waiting to happen.
kMaxBufferBytes = 4 << 30


def is_supported(problem: MoEProblem) -> tuple[bool, str]:
    """``(True, how)`` when the low-latency pair can run ``problem``, else ``(False, why)``."""
    ok, reason = staged_is_supported(problem)
    if not ok:
        return False, reason
    if torch.device(problem.device).type != "cuda":
        return False, "the low-latency transport writes peer GPU memory: CUDA only"
    if problem.top_k > 64:
        return False, f"the transport's kernels take top_k <= 64, got {problem.top_k}"
    if problem.ep_size * problem.num_max_tokens_per_rank * problem.top_k >= 2**31:
        return False, "ranks x num_max_tokens_per_rank x top_k must stay below 2^31 (int32 source words)"
    if problem.num_local_experts > kernels.ep.kEpMaxLocalExperts or problem.ep_size > kernels.ep.kEpMaxRanks:
        return False, (f"at most {kernels.ep.kEpMaxRanks} ranks of {kernels.ep.kEpMaxLocalExperts} local experts, "
                       f"got {problem.ep_size} x {problem.num_local_experts}")
    rows = problem.ep_size * problem.num_max_tokens_per_rank
    views = kernels.ep_buffer_views(problem.ep_size, problem.num_local_experts, problem.num_max_tokens_per_rank,
                                    problem.top_k, problem.hidden)
    nbytes = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in views)
    # Plus the experts' per-forward scratch over every row of the layout: L1 output, FP8 activations
    # and their scales, L2 output.
    inter = problem.intermediate
    nbytes += problem.num_local_experts * rows * (4 * inter + inter + inter // kActGroup * 4 + 2 * problem.hidden)
    if nbytes > kMaxBufferBytes:
        return False, (f"it would take {nbytes / 2**30:.1f} GiB per rank ({rows} rows per local expert: "
                       f"ranks x num_max_tokens_per_rank={problem.num_max_tokens_per_rank}); it is meant for "
                       f"decode batches, the staged backend serves larger ones")
    return True, f"peer writes into the masked layout ({rows} rows per local expert), no host sync"


@dataclass
class LowLatencyCombineHandle(CombineHandle):
    """``masked_m`` int32 [E_l] from the dispatch; ``routed`` bool [T, k]: the pairs that were written
    into their experts' rows (sent, and not past an expert's rows)."""

    masked_m: torch.Tensor | None = None
    routed: torch.Tensor | None = None


class LowLatencyDispatchCombine(DispatchCombine):
    """Dispatch into every owner's masked layout and combine back over ``group`` (collective to
    build: allocates the SymmBuffer)."""

    def __init__(self, problem: MoEProblem, group, first_expert: int):
        ok, reason = is_supported(problem)
        if not ok:
            raise NotImplementedError(f"the low-latency transport cannot run this layer: {reason}")
        device = torch.device(problem.device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.problem, self.first_expert = problem, first_expert
        self.rank, self.num_ranks = group_rank(group), group_size(group)
        if self.num_ranks != problem.ep_size:
            raise ValueError(f"the group has {self.num_ranks} ranks, the problem ep_size={problem.ep_size}")
        e_l, t_cap = problem.num_local_experts, problem.num_max_tokens_per_rank
        views = kernels.ep_buffer_views(self.num_ranks, e_l, t_cap, problem.top_k, problem.hidden)
        layout = compute_layout([ViewSpec(*v) for v in views])
        self.buffer = (SymmBuffer(layout, group=group, device=device) if self.num_ranks > 1
                       else _OneRankBuffer(layout, device))
        self.buffer.view("ep_signals").zero_()
        offsets = tuple(self.buffer.layout[name].offset for name in kernels.ep.kEpViews)
        self.layout = kernels.EpLayout(tuple(self.buffer.peer_ptrs), offsets, layout.total_bytes, self.rank,
                                       self.num_ranks, e_l, t_cap, problem.top_k, problem.hidden, device)
        self.rows = self.layout.rows_per_expert
        # The rows' global expert ids never change: expert e's segment is rows [e R, (e + 1) R).
        self.row_experts = (torch.arange(e_l, device=device, dtype=torch.int64) + first_expert).repeat_interleave(
            self.rows).unsqueeze(1)
        # The views a forward returns, made once (each view costs the host a few µs per call).
        m, buf = e_l * self.rows, self.buffer
        self._x = buf.view("ep_x").view(torch.float8_e4m3fn).view(m, problem.hidden)
        self._x_sf = buf.view("ep_sf").view(m, problem.hidden // kActGroup)
        self._weights = buf.view("ep_w").view(m, 1)
        self._combine = buf.view("ep_combine")
        self._masked_m = torch.empty(e_l, dtype=torch.int32, device=device)
        self._routed = torch.empty(t_cap * problem.top_k, dtype=torch.bool, device=device)
        self.buffer.barrier()  # every rank's signals are zero before any rank's first send

    @classmethod
    def is_supported(cls, problem: MoEProblem) -> tuple[bool, str]:
        return is_supported(problem)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                 ids_checked: bool = False) -> DispatchResult:
        """``x`` [T, H] float, ``topk_idx`` int64 [T, k] (ids outside [0, E) are not sent, whether or
        not ``ids_checked``: checking them would sync), ``topk_weights`` float32 [T, k] -> the
        masked layout ``[E_l x R, H]`` of this rank (:class:`StagedDispatchResult`). The result's
        views, ``masked_m`` and the handle's ``routed`` are buffers of this object, rewritten by the
        next dispatch: copy what must outlive it."""
        p = self.problem
        num_tokens = x.shape[0]
        if x.dim() != 2 or x.shape[1] != p.hidden:
            raise ValueError(f"x must be [T, {p.hidden}], got {tuple(x.shape)}")
        if num_tokens > p.num_max_tokens_per_rank:
            raise ValueError(f"{num_tokens} tokens exceed num_max_tokens_per_rank={p.num_max_tokens_per_rank}")
        # The dispatch quantizes the rows itself (one launch). masked_m and routed live in buffers
        # made once: a forward's are read by its experts and combine, in stream order before the
        # next dispatch rewrites them.
        routed = self._routed[: num_tokens * p.top_k].view(num_tokens, p.top_k)
        masked_m = kernels.ep_dispatch(self.layout, x, None, topk_idx, topk_weights, masked_m=self._masked_m,
                                       routed=routed)
        handle = LowLatencyCombineHandle(num_tokens, [], x.dtype, masked_m, routed)
        # Rows per expert if the group's tokens spread evenly: the masked GEMMs' tile hint.
        expected = max(1, -(-num_tokens * p.top_k * self.num_ranks // p.num_experts))
        return StagedDispatchResult(self._x, self._x_sf, self.row_experts, self._weights, handle, None, masked_m,
                                    self.rows, expected)

    def combine(self, expert_out: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        """``expert_out`` bfloat16 [E_l x R, H] -> [T, H] of this rank in ``handle.out_dtype``."""
        if not isinstance(handle, LowLatencyCombineHandle) or handle.masked_m is None:
            raise TypeError(f"handle must come from LowLatencyDispatchCombine.dispatch, got {type(handle).__name__}")
        p = self.problem
        shape = (p.num_local_experts * self.rows, p.hidden)
        if tuple(expert_out.shape) != shape or expert_out.dtype != torch.bfloat16:
            raise ValueError(f"expert_out must be bfloat16 {list(shape)}, got {expert_out.dtype} "
                             f"{list(expert_out.shape)}")
        kernels.ep_combine(self.layout, expert_out.view(p.num_local_experts, self.rows, p.hidden))
        t, k = handle.num_local_tokens, p.top_k
        return kernels.moe_combine(self._combine[: t * k], None, handle.routed, t, k, handle.out_dtype)


def create(problem: MoEProblem, experts: LocalExperts, group) -> tuple[DispatchCombine, Experts]:
    """The low-latency transport with the staged experts (collective over ``group``)."""
    return LowLatencyDispatchCombine(problem, group, experts.first_expert), StagedExperts(experts)
