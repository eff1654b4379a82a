"""The two interfaces a MoE backend implements (the modular split of vLLM's fused MoE).

* :class:`DispatchCombine` moves tokens: ``dispatch`` sends each token (and its routing) to the
  ranks holding its experts; ``combine`` brings the experts' outputs back to the token's rank and
  sums them.
* :class:`Experts` computes: ``apply`` runs the local experts on the dispatched rows.

A backend pairs one of each; the pair agrees on the ``expert_out`` format. Every class answers
``is_supported(problem) -> (bool, reason)`` so that ``backend="auto"`` can pick without trying.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from moe_runtime.quant_weights import ExpertWeight


@dataclass(frozen=True)
class MoEProblem:
    """What a backend must handle: sizes, formats, placement and device."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    weights: str
    dtype: torch.dtype
    device: torch.device
    ep_size: int
    num_max_tokens_per_rank: int
    use_fp8_dispatch: bool

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size


@dataclass
class LocalExperts:
    """This rank's experts: ``gate_up`` [E_l, 2I, H] (rows [0, I) gate, [I, 2I) up) and ``down``
    [E_l, H, I]; local expert ``e`` is global expert ``first_expert + e``."""

    gate_up: ExpertWeight
    down: ExpertWeight
    first_expert: int

    @property
    def num_local_experts(self) -> int:
        return self.gate_up.num_experts


@dataclass
class CombineHandle:
    """What ``combine`` needs from ``dispatch``: this rank's token count, every rank's token count
    (in rank order, the order of the dispatched rows) and the output dtype."""

    num_local_tokens: int
    counts: list[int] = field(default_factory=list)
    out_dtype: torch.dtype = torch.bfloat16


@dataclass
class DispatchResult:
    """Rows this rank's experts must see.

    ``x`` [R, H]: the layer dtype, or float8_e4m3fn with ``x_sf`` float32 [R, ceil(H/128)] (1x128
    scales) after an FP8 dispatch. ``topk_idx`` int64 [R, k] global expert ids (-1: none) and
    ``topk_weights`` float32 [R, k] of each row.
    """

    x: torch.Tensor
    x_sf: torch.Tensor | None
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: CombineHandle


class DispatchCombine(ABC):
    """Token movement between the ranks of the expert-parallel group."""

    @classmethod
    @abstractmethod
    def is_supported(cls, problem: MoEProblem) -> tuple[bool, str]:
        ...

    @abstractmethod
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                 ids_checked: bool = False) -> DispatchResult:
        """``x`` [T, H], ``topk_idx`` int64 [T, k], ``topk_weights`` float32 [T, k] of this rank.
        ``ids_checked``: the caller guarantees every id is in [-1, E) (the layer's router does), so a
        backend may skip its own check of them (which can cost a host sync)."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        """Expert outputs of the dispatched rows -> [T, H] of this rank, in ``handle.out_dtype``."""


class Experts(ABC):
    """The local experts' computation on dispatched rows."""

    @classmethod
    @abstractmethod
    def is_supported(cls, problem: MoEProblem) -> tuple[bool, str]:
        ...

    @abstractmethod
    def apply(self, dispatched: DispatchResult) -> torch.Tensor:
        """Dispatched rows -> ``expert_out`` in the format the paired :class:`DispatchCombine` reads."""
