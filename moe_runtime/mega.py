"""Sizing of the Mega MoE symmetric buffer, and the weight layouts the Mega MoE kernels read.

One rank's buffer (``T`` = ``num_max_tokens_per_rank`` rounded up to ``block_m``, ``k`` = top-k,
``P`` ranks, ``E_l`` local experts, ``R`` = :attr:`MegaMoEBufferConfig.num_max_recv_rows`):

| view | shape, dtype | role |
| --- | --- | --- |
| ``x`` | [T, H] e4m3 (bf16 without FP8 dispatch) | this rank's tokens, read by peers |
| ``x_sf`` | [T, H/128] float32 (FP8 dispatch only) | their 1x128 scales, token-major |
| ``topk_idx`` | [T, k] int64 | routing of this rank's tokens (global expert ids, -1 = none) |
| ``topk_weights`` | [T, k] float32 | their weights |
| ``l1_acts`` | [R, H] as ``x`` | rows received for the local experts, expert-contiguous (L1 input) |
| ``l1_acts_sf`` | [R, H/128] float32 (FP8 dispatch only) | their scales |
| ``l2_acts`` | [R, I] e4m3 (bf16 with bf16 weights) | SwiGLU x top-k weight, requantized (L2 input) |
| ``l2_acts_sf`` | [R, I/128] float32 (FP8/FP4 weights only) | their scales |
| ``combine`` | [T, k, H] bf16 | expert outputs written back by the ranks that ran them |
| ``signals`` | [P + P * E_l + E_l] int32 | barrier flags, per-source per-expert counts, expert row counters |

Per-token rows keep a token's data and scales contiguous, so a dispatch is one peer write per
token and view. ``combine`` keeps one slot per (token, top-k) so the source rank sums in a fixed
order, independent of which rank answered first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_runtime.dist import expert_placement, group_size
from moe_runtime.symm import SymmBuffer, ViewSpec, align_up, compute_layout
from moe_runtime.weight_layout import (MegaMoEWeights, WeightPair, dequantize_mega_moe_weights,
                                       inverse_transform_weights_for_mega_moe, transform_weights_for_mega_moe)

__all__ = [
    "MegaMoEBufferConfig", "SignalSlots", "get_block_m", "mega_moe_view_specs", "get_symm_buffer_for_mega_moe",
    "MegaMoEWeights", "WeightPair", "transform_weights_for_mega_moe", "inverse_transform_weights_for_mega_moe",
    "dequantize_mega_moe_weights",
]

# Block M of the grouped GEMMs: every expert's segment of received rows is padded to it, and the
# per-rank token capacity is rounded up to it. Owned here until the kernel layer exports its own.
kGroupedBlockM = 128
kQuantGroup = 128
kWeightFormats = ("bf16", "fp8", "fp4")
kActivations = ("swiglu",)


def get_block_m(num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                num_topk: int | None = None, hidden: int | None = None,
                intermediate_hidden: int | None = None) -> int:
    """Block M of the grouped GEMMs that consume the buffer (rows per expert are padded to it).

    The arguments are the shape the kernel layer's heuristic will choose from; today the answer is
    the fixed :data:`kGroupedBlockM`.
    """
    return kGroupedBlockM


@dataclass(frozen=True)
class SignalSlots:
    """Offsets (in int32 elements) inside the ``signals`` view."""

    num_ranks: int
    num_local_experts: int

    @property
    def barrier(self) -> slice:
        return slice(0, self.num_ranks)

    @property
    def recv_counts(self) -> slice:
        """[P, E_l] row-major: rows rank ``p`` sends to each local expert."""
        start = self.num_ranks
        return slice(start, start + self.num_ranks * self.num_local_experts)

    @property
    def expert_counters(self) -> slice:
        start = self.num_ranks + self.num_ranks * self.num_local_experts
        return slice(start, start + self.num_local_experts)

    @property
    def total(self) -> int:
        return self.expert_counters.stop


@dataclass(frozen=True)
class MegaMoEBufferConfig:
    """The sizes a Mega MoE buffer is computed from (``num_max_tokens_per_rank`` already rounded)."""

    num_ranks: int
    num_experts: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    block_m: int
    use_fp8_dispatch: bool
    weights: str
    activation: str

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def num_max_recv_rows(self) -> int:
        """Worst case of received L1 rows: each token of each rank sends at most
        ``min(top-k, E_l)`` rows here, and each local expert's segment is padded to ``block_m``."""
        rows = self.num_ranks * self.num_max_tokens_per_rank * min(self.num_topk, self.num_local_experts)
        return align_up(rows + self.num_local_experts * (self.block_m - 1), self.block_m)

    @property
    def signal_slots(self) -> SignalSlots:
        return SignalSlots(self.num_ranks, self.num_local_experts)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def make_mega_moe_config(num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                         hidden: int, intermediate_hidden: int, use_fp8_dispatch: bool = True,
                         weights: str = "fp8", activation: str = "swiglu") -> MegaMoEBufferConfig:
    """Validate the arguments of :func:`get_symm_buffer_for_mega_moe` and round the capacity."""
    for value, name in ((num_ranks, "num_ranks"), (num_experts, "num_experts"),
                        (num_max_tokens_per_rank, "num_max_tokens_per_rank"), (num_topk, "num_topk"),
                        (hidden, "hidden"), (intermediate_hidden, "intermediate_hidden")):
        _positive_int(value, name)
    expert_placement(num_experts, num_ranks, 0)
    if num_topk > num_experts:
        raise ValueError(f"num_topk={num_topk} exceeds num_experts={num_experts}")
    for value, name in ((hidden, "hidden"), (intermediate_hidden, "intermediate_hidden")):
        if value % kQuantGroup != 0:
            raise ValueError(f"{name} must be a multiple of {kQuantGroup} (the kernels' K block and 1x128 "
                             f"scale groups), got {value}")
    if weights not in kWeightFormats:
        raise ValueError(f"weights must be one of {kWeightFormats}, got {weights!r}")
    if not isinstance(use_fp8_dispatch, bool):
        raise TypeError(f"use_fp8_dispatch must be a bool, got {use_fp8_dispatch!r}")
    if activation not in kActivations:
        raise ValueError(f"activation must be one of {kActivations}, got {activation!r}")
    if use_fp8_dispatch and weights == "bf16":
        raise ValueError("use_fp8_dispatch=True sends FP8 activations, which bf16 expert GEMMs do not read: "
                         "pass use_fp8_dispatch=False with weights='bf16'")
    block_m = get_block_m(num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
    return MegaMoEBufferConfig(num_ranks, num_experts, align_up(num_max_tokens_per_rank, block_m), num_topk,
                               hidden, intermediate_hidden, block_m, bool(use_fp8_dispatch), weights, activation)


def mega_moe_view_specs(config: MegaMoEBufferConfig) -> list[ViewSpec]:
    """The views of the buffer, in placement order (see the module docstring)."""
    t, k, h, i = config.num_max_tokens_per_rank, config.num_topk, config.hidden, config.intermediate_hidden
    r = config.num_max_recv_rows
    dispatch_dtype = torch.float8_e4m3fn if config.use_fp8_dispatch else torch.bfloat16
    quantized_l2 = config.weights in ("fp8", "fp4")
    specs = [ViewSpec("x", (t, h), dispatch_dtype)]
    if config.use_fp8_dispatch:
        specs.append(ViewSpec("x_sf", (t, h // kQuantGroup), torch.float32))
    specs += [ViewSpec("topk_idx", (t, k), torch.int64), ViewSpec("topk_weights", (t, k), torch.float32),
              ViewSpec("l1_acts", (r, h), dispatch_dtype)]
    if config.use_fp8_dispatch:
        specs.append(ViewSpec("l1_acts_sf", (r, h // kQuantGroup), torch.float32))
    specs.append(ViewSpec("l2_acts", (r, i), torch.float8_e4m3fn if quantized_l2 else torch.bfloat16))
    if quantized_l2:
        specs.append(ViewSpec("l2_acts_sf", (r, i // kQuantGroup), torch.float32))
    specs += [ViewSpec("combine", (t, k, h), torch.bfloat16),
              ViewSpec("signals", (config.signal_slots.total,), torch.int32)]
    return specs


def get_symm_buffer_for_mega_moe(group: dist.ProcessGroup | None, num_experts: int, num_max_tokens_per_rank: int,
                                 num_topk: int, hidden: int, intermediate_hidden: int,
                                 use_fp8_dispatch: bool = True, weights: str = "fp8", activation: str = "swiglu",
                                 backend: str | None = None, device=None) -> SymmBuffer:
    """Allocate the Mega MoE :class:`SymmBuffer` on every rank of ``group`` (collective).

    ``num_max_tokens_per_rank`` is rounded up to :func:`get_block_m`; the rounded value and all
    sizes are in ``buffer.config`` (a :class:`MegaMoEBufferConfig`). ``backend``: ``"torch"``,
    ``"nvshmem"``, ``"host"`` or ``None`` (see :func:`moe_runtime.symm.default_backend`). The
    ``signals`` view is zeroed before the closing barrier.
    """
    config = make_mega_moe_config(group_size(group), num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                  intermediate_hidden, use_fp8_dispatch, weights, activation)
    layout = compute_layout(mega_moe_view_specs(config))
    buffer = SymmBuffer(layout, group=group, backend=backend, device=device, config=config)
    buffer.view("signals").zero_()
    buffer.barrier()
    return buffer
