"""bf16 expert weights on the staged path: the reference backend's all-gather dispatch and
reduce-to-owner combine (:class:`ReferenceDispatchCombine`) around two m-grouped BF16 GEMMs.

One forward of :class:`GroupedBf16Experts`, on the rows every rank dispatched (the layer dtype,
bfloat16):

1. the (row, top-k slot) pairs routed to this rank's experts, sorted by local expert (stable: row
   order inside an expert), placed in the contiguous layout of the grouped GEMM: one segment per
   local expert padded to ``kernels.get_mk_alignment_for_contiguous_layout()`` rows, ``m_indices``
   -1 on padding (one host sync reads the layout's size);
2. L1 ``m_grouped_bf16_gemm_nt_contiguous`` on gate/up [E_l, 2I, H] -> bf16 [M, 2I]; SwiGLU in
   float32 x top-k weight, rounded to bf16; L2 on down [E_l, H, I] -> bf16 [M, H];
3. each pair's output into its slot of ``expert_out`` [R, k, H] (zeros where another rank's
   expert answers), which the reference combine sums per token in slot order.

Numerics: the reference contract for ``"bf16"`` weights, except that the L1 output ``h`` is the
GEMM's bf16 output rather than float32 (as in the staged FP8 path). CPU tensors run the GEMMs'
references, so the class runs (and is tested) without a GPU. The token exchange is the reference
one (an all-gather of every rank's rows): there are no bf16 exchange kernels yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from moe_runtime.backends.base import DispatchResult, Experts, LocalExperts, MoEProblem


class GroupedBf16Experts(Experts):
    """This rank's bf16 experts as two grouped GEMMs; ``expert_out`` as :class:`ReferenceExperts`'s."""

    def __init__(self, experts: LocalExperts, out_dtype: torch.dtype):
        self.experts = experts
        self.out_dtype = out_dtype
        self.w13 = experts.gate_up.data  # [E_l, 2I, H]
        self.w2 = experts.down.data      # [E_l, H, I]
        self.intermediate = self.w2.shape[2]

    @classmethod
    def is_supported(cls, problem: MoEProblem) -> tuple[bool, str]:
        if problem.weights != "bf16":
            return False, f"the bf16 grouped GEMMs run bf16 expert weights, got weights={problem.weights!r}"
        if problem.use_fp8_dispatch:
            return False, "bf16 experts read the layer's rows: use_fp8_dispatch must be False"
        if problem.dtype != torch.bfloat16:
            return False, f"the bf16 grouped GEMMs read and write bfloat16, got dtype={problem.dtype}"
        if problem.hidden % 64 or problem.intermediate % 64:
            return False, (f"hidden={problem.hidden} and intermediate={problem.intermediate} must be multiples of "
                           "64 (the BF16 GEMMs' K block)")
        return True, "bf16 grouped GEMMs (contiguous layout) between the reference all-gather and combine"

    def apply(self, dispatched: DispatchResult) -> torch.Tensor:
        idx = dispatched.topk_idx
        num_rows, top_k = idx.shape
        hidden = self.w2.shape[1]
        x = dispatched.x
        out = torch.zeros((num_rows, top_k, hidden), dtype=self.out_dtype, device=x.device)
        num_local = self.experts.num_local_experts
        local = idx - self.experts.first_expert
        rows, slots = torch.nonzero((local >= 0) & (local < num_local), as_tuple=True)
        if rows.numel() == 0:
            return out
        expert = local[rows, slots]
        order = torch.argsort(expert, stable=True)
        rows, slots, expert = rows[order], slots[order], expert[order]
        align = kernels.get_mk_alignment_for_contiguous_layout()
        counts = torch.bincount(expert, minlength=num_local)
        padded = (counts + align - 1) // align * align
        seg_start = torch.cumsum(padded, 0) - padded
        first_pair = torch.cumsum(counts, 0) - counts
        pos = seg_start[expert] + torch.arange(expert.numel(), device=x.device) - first_pair[expert]
        total = int(padded.sum())  # the forward's host sync
        a = torch.zeros((total, x.shape[1]), dtype=torch.bfloat16, device=x.device)
        a[pos] = x[rows].to(torch.bfloat16)
        m_indices = torch.full((total,), -1, dtype=torch.int32, device=x.device)
        m_indices[pos] = expert.to(torch.int32)
        inter = self.intermediate
        h = torch.empty((total, 2 * inter), dtype=torch.bfloat16, device=x.device)
        kernels.m_grouped_bf16_gemm_nt_contiguous(a, self.w13, h, m_indices)
        hv = h[pos].float()
        weight = dispatched.topk_weights[rows, slots].float().unsqueeze(1)
        act = torch.zeros((total, inter), dtype=torch.bfloat16, device=x.device)
        act[pos] = (F.silu(hv[:, :inter]) * hv[:, inter:] * weight).to(torch.bfloat16)
        y = torch.empty((total, hidden), dtype=torch.bfloat16, device=x.device)
        kernels.m_grouped_bf16_gemm_nt_contiguous(act, self.w2, y, m_indices)
        out[rows, slots] = y[pos].to(self.out_dtype)
        return out
