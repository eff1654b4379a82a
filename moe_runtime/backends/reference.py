"""The reference backend: pure torch, any device, and the numerics contract of every backend.

For each (token, top-k slot) routed to expert ``e`` with weight ``w``:

* ``"bf16"`` weights: ``h = x @ W1^T`` in float32 on the bf16 operands; ``a = silu(gate) * up * w``
  in float32, rounded to the layer dtype (the L2 input of a bf16 GEMM); ``y = a @ W2^T`` in float32.
* ``"fp8"`` weights: ``x`` quantized per token with 1x128 scales (``per_token_cast_to_fp8``, at the
  source rank when dispatching FP8); ``h`` in float32 on the dequantized operands (weights with
  128x128 block scales); ``a`` in float32, requantized to FP8 with 1x128 scales; ``y`` in float32 on
  the dequantized operands.
* ``"fp4"`` weights: as ``"fp8"`` with E2M1 weights and UE8M0 1x32 scales, dequantized.

``y`` is rounded to the layer dtype (the expert output); a token's output is the float32 sum of
its ``k`` expert outputs in slot order, rounded once to the output dtype.

Expert parallel: ``dispatch`` all-gathers every rank's tokens and routing (rank order);
each rank computes the slots of its own experts, writing zeros elsewhere; ``combine`` sums those
partial slot tensors over ranks onto each token's source rank (exact: each slot has one non-zero
contributor), then sums the slots. A token's slot values are computed from the same rows, in the
same order, as in a single process, so the result does not depend on the number of ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference.quant import dequantize_per_token, per_token_cast_to_fp8
from moe_runtime.backends.base import (CombineHandle, DispatchCombine, DispatchResult, Experts, LocalExperts,
                                       MoEProblem)
from moe_runtime.dist import group_size, reduce_rows_to_owners, uneven_all_gather

kActGroup = 128


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 with 1x128 scales: ``(e4m3 [T, H], float32 [T, ceil(H/128)])``; T may be 0."""
    if x.shape[0] == 0:
        num_groups = (x.shape[1] + kActGroup - 1) // kActGroup
        return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty((0, num_groups), dtype=torch.float32, device=x.device))
    return per_token_cast_to_fp8(x, use_ue8m0=False, gran_k=kActGroup)


def expert_mlp(x: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, fmt: str,
               act_dtype: torch.dtype) -> torch.Tensor:
    """One expert on its rows, float32 in and out.

    ``x`` float32 [n, H] (already dequantized for FP8/FP4), ``weight`` float32 [n] (top-k weights),
    ``w13`` float32 [2I, H], ``w2`` float32 [H, I] (dequantized). ``fmt`` selects the rounding of the
    L2 input: FP8 requantization for ``"fp8"``/``"fp4"``, ``act_dtype`` for ``"bf16"``.
    """
    h = x @ w13.t()
    inter = w13.shape[0] // 2
    act = F.silu(h[:, :inter]) * h[:, inter:] * weight.unsqueeze(1)
    if fmt == "bf16":
        act = act.to(act_dtype).float()
    else:
        act = dequantize_per_token(*quantize_activations(act), gran_k=kActGroup)
    return act @ w2.t()


class ReferenceDispatchCombine(DispatchCombine):
    """All-gather dispatch and reduce-to-owner combine over ``group`` (any torch backend)."""

    def __init__(self, group, use_fp8_dispatch: bool):
        self.group = group
        self.use_fp8_dispatch = use_fp8_dispatch

    @classmethod
    def is_supported(cls, problem: MoEProblem) -> tuple[bool, str]:
        return True, "pure torch"

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                 ids_checked: bool = False) -> DispatchResult:
        x_sf = None
        payload = x
        if self.use_fp8_dispatch:
            payload, x_sf = quantize_activations(x)
        rows, counts = uneven_all_gather(payload, self.group)
        if x_sf is not None:
            x_sf, _ = uneven_all_gather(x_sf, self.group)
        idx, _ = uneven_all_gather(topk_idx, self.group)
        weights, _ = uneven_all_gather(topk_weights, self.group)
        return DispatchResult(rows, x_sf, idx, weights, CombineHandle(x.shape[0], counts, x.dtype))

    def combine(self, expert_out: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        """``expert_out`` [R, k, H] (zeros where another rank's expert answers) -> [T, H]."""
        partial = expert_out.float()
        if group_size(self.group) > 1:
            partial = reduce_rows_to_owners(partial, handle.counts, self.group)
        if partial.shape[1] == 0:
            return torch.zeros((partial.shape[0], partial.shape[2]), dtype=handle.out_dtype, device=partial.device)
        acc = partial[:, 0].clone()
        for slot in range(1, partial.shape[1]):
            acc += partial[:, slot]
        return acc.to(handle.out_dtype)


class ReferenceExperts(Experts):
    """Runs each local expert on the rows routed to it; ``expert_out`` is [R, k, H] in ``out_dtype``
    with the output of slot ``(r, j)`` where ``topk_idx[r, j]`` is local, zeros elsewhere."""

    def __init__(self, experts: LocalExperts, out_dtype: torch.dtype):
        self.experts = experts
        self.out_dtype = out_dtype

    @classmethod
    def is_supported(cls, problem: MoEProblem) -> tuple[bool, str]:
        if problem.weights not in ("bf16", "fp8", "fp4"):
            return False, f"unknown weights format {problem.weights!r}"
        return True, "pure torch"

    def _rows_float32(self, dispatched: DispatchResult) -> torch.Tensor:
        x = dispatched.x
        if dispatched.x_sf is not None:
            return dequantize_per_token(x, dispatched.x_sf, gran_k=kActGroup)
        if self.experts.gate_up.format != "bf16":
            # Row-local quantization: the same values as quantizing on the source rank.
            return dequantize_per_token(*quantize_activations(x), gran_k=kActGroup)
        return x.float()

    def apply(self, dispatched: DispatchResult) -> torch.Tensor:
        num_rows, top_k = dispatched.topk_idx.shape
        hidden = self.experts.down.shape[1]
        out = torch.zeros((num_rows, top_k, hidden), dtype=self.out_dtype, device=dispatched.x.device)
        if num_rows == 0:
            return out
        x = self._rows_float32(dispatched)
        fmt = self.experts.gate_up.format
        for e in range(self.experts.num_local_experts):
            rows, slots = torch.nonzero(dispatched.topk_idx == self.experts.first_expert + e, as_tuple=True)
            if rows.numel() == 0:
                continue
            y = expert_mlp(x[rows], dispatched.topk_weights[rows, slots].float(),
                           self.experts.gate_up.dequantize(e), self.experts.down.dequantize(e), fmt, self.out_dtype)
            out[rows, slots] = y.to(self.out_dtype)
        return out


def is_supported(problem: MoEProblem) -> tuple[bool, str]:
    """The reference backend runs every problem its experts class accepts."""
    return ReferenceExperts.is_supported(problem)


def create(problem: MoEProblem, experts: LocalExperts, group) -> tuple[DispatchCombine, Experts]:
    """The reference pair for ``problem``."""
    return ReferenceDispatchCombine(group, problem.use_fp8_dispatch), ReferenceExperts(experts, problem.dtype)
