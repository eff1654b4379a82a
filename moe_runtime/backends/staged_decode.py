"""One rank's eager decode forward of the staged backend in raw launches.

The staged pair's one-rank decode path (``StagedDispatchCombine._dispatch_local_decode``, the masked
``StagedExperts.apply``, ``combine``) runs six kernels: the 1x128 activation cast, the local dispatch,
the L1 grouped GEMM, SwiGLU x top-k weight with its FP8 cast, the L2 grouped GEMM and the combine.
Called one by one through the kernels' Python functions, each validates its arguments and allocates
its outputs: the one-token forward of 32 local experts took 254 us of host time on the H200's host
(bench/RESULTS.md, session 40). :class:`StagedDecode` (on unless ``MOE_STAGED_DECODE=0``) launches
the same kernels on the same arguments (the same outputs bit for bit) through ``kernels._C``'s raw
entry points, into a workspace kept per device and stream, so a forward allocates only its output:
that one-token forward took 250 us of host time instead of 495, 367 us on an idle stream instead of
592 (an H100, bench/RESULTS.md, session 44).

The workspace is reused by the next forward on the same stream, after this forward's kernels in
stream order; a lock keeps two threads' forwards on one stream from interleaving their launches in
it. Inside a CUDA graph capture the general path runs (its buffers belong to the graph).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from kernels import _descriptors, jit
from kernels._fp4_fragment import kMaxDecodeRows
from kernels.gemm import _device_capturing
from kernels.moe import kCombineMaxTopK, kDispatchMaxLocalExperts, kDispatchMaxPairs
from moe_runtime.backends.staged import StagedDispatchCombine, StagedExperts, _LocalExchange, kActGroup
from moe_runtime.symm import align_up

kAlign = 256  # every workspace tensor starts on a 256-byte boundary (TMA wants 16)


@dataclass(frozen=True)
class DecodeLayout:
    """Byte offsets into the workspace for ``tokens`` tokens; ``rows`` = E_l x T + T x k dispatch
    rows (expert ``e``'s T rows first, then spare rows for unrouted pairs), ``grouped`` = E_l x T."""

    tokens: int
    rows: int
    grouped: int
    xq: int  # E4M3 [T, H]
    xs: int  # float32 [T, H/128]
    acts: int  # E4M3 [rows, H]
    acts_sf: int  # float32 [rows, H/128]
    weights: int  # float32 [rows]
    global_ids: int  # int64 [rows]
    pair_rows: int  # int64 [T * k]
    masked_m: int  # int32 [E_l]
    h: int  # bfloat16 [grouped, 2I]
    act: int  # E4M3 [grouped, I]
    act_sf: int  # float32 [grouped, I/128]
    expert_out: int  # bfloat16 [grouped, H]
    nbytes: int


def decode_layout(tokens: int, num_local: int, top_k: int, hidden: int, intermediate: int) -> DecodeLayout:
    rows, grouped = num_local * tokens + tokens * top_k, num_local * tokens
    sizes = {"xq": tokens * hidden, "xs": tokens * (hidden // kActGroup) * 4, "acts": rows * hidden,
             "acts_sf": rows * (hidden // kActGroup) * 4, "weights": rows * 4, "global_ids": rows * 8,
             "pair_rows": tokens * top_k * 8, "masked_m": num_local * 4, "h": grouped * 2 * intermediate * 2,
             "act": grouped * intermediate, "act_sf": grouped * (intermediate // kActGroup) * 4,
             "expert_out": grouped * hidden * 2}
    offsets, at = {}, 0
    for name, size in sizes.items():
        offsets[name] = at
        at += align_up(size, kAlign)
    return DecodeLayout(tokens, rows, grouped, nbytes=at, **offsets)


class StagedDecode:
    """The staged pair's one-rank decode forward for ``0 < T <= masked_max_rows`` tokens in raw
    launches (module docstring). ``dispatch_combine`` and ``experts`` are the pair of
    ``moe_runtime.backends.staged.create``; build it with :meth:`maybe`, which returns None where the
    general path must run (several ranks, FP4 weights without the decode layout, the fused SwiGLU L1,
    sizes past the kernels' limits)."""

    def __init__(self, dispatch_combine, experts):
        problem = dispatch_combine.problem
        self.num_local = problem.num_local_experts
        self.top_k = problem.top_k
        self.hidden = experts.hidden
        self.intermediate = experts.intermediate
        self.first_expert = dispatch_combine.first_expert
        self.max_tokens = min(dispatch_combine.masked_max_rows, problem.num_max_tokens_per_rank)
        self.fp4 = experts.experts.gate_up.format == "fp4"
        if self.fp4:
            self.max_tokens = min(self.max_tokens, kMaxDecodeRows)
            self.w13, self.w2 = experts.w13_masked, experts.w2_masked
        else:
            self.w13, self.w2 = experts.w13, experts.w2
        self._native = jit.native_module()
        self._workspaces: dict[tuple[int, int], torch.Tensor] = {}
        self._layouts: dict[int, DecodeLayout] = {}
        self._lock = threading.Lock()

    @staticmethod
    def is_supported(dispatch_combine, experts) -> tuple[bool, str]:
        if not isinstance(dispatch_combine, StagedDispatchCombine) or not isinstance(experts, StagedExperts):
            return False, "not the staged backend's pair"
        if not isinstance(dispatch_combine.exchange, _LocalExchange):
            return False, "several ranks: the decode layout is built by the exchange"
        problem = dispatch_combine.problem
        if dispatch_combine.masked_max_rows < 1:
            return False, "the masked layout is off (masked_max_rows = 0)"
        if problem.num_local_experts > kDispatchMaxLocalExperts or problem.top_k > kCombineMaxTopK \
                or min(dispatch_combine.masked_max_rows, problem.num_max_tokens_per_rank) * problem.top_k \
                > kDispatchMaxPairs:
            return False, "past the dispatch or combine kernels' limits"
        gate_up = experts.experts.gate_up
        if not gate_up.data.is_cuda:
            return False, "weights on the CPU"
        if gate_up.format == "fp4":
            if experts.w13_masked is experts.w13:
                return False, "FP4 weights without the decode layout"
        elif gate_up.format != "fp8":
            return False, f"{gate_up.format} weights"
        if experts.hidden % kActGroup or experts.intermediate % kActGroup:
            return False, "hidden and intermediate sizes must be multiples of 128"
        # FP4: the decode layout (one tensor each); FP8: (data, scales).
        weights = (experts.w13_masked, experts.w2_masked) if gate_up.format == "fp4" else (*experts.w13, *experts.w2)
        for t in weights:
            if not isinstance(t, torch.Tensor) or t.data_ptr() % 16 or t.stride(-1) != 1:
                return False, "weights not 16-byte aligned with a contiguous last dim"
        return True, ""

    @classmethod
    def maybe(cls, dispatch_combine, experts) -> "StagedDecode | None":
        ok, _ = cls.is_supported(dispatch_combine, experts)
        return cls(dispatch_combine, experts) if ok else None

    def applies(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` takes ``x`` [T, H] (else the general path runs): CUDA, bfloat16 or
        float32, a contiguous last dim, not a lazily negated view, 0 < T <= the decode rows, not
        under a graph capture, not switched off (``MOE_STAGED_DECODE=0``), and not the fused
        SwiGLU L1 asked for."""
        tokens = x.shape[0]
        return (0 < tokens <= self.max_tokens and x.is_cuda and x.stride(1) == 1 and not x.is_neg()
                and (x.dtype is torch.bfloat16 or x.dtype is torch.float32)
                and os.environ.get("MOE_STAGED_DECODE", "1") != "0"
                and (self.fp4 or os.environ.get("MOE_STAGED_FUSED_SWIGLU", "0") != "1")
                and not _device_capturing(x.get_device()))

    def _workspace(self, layout: DecodeLayout, device: int, stream: int) -> int:
        key = (device, stream)
        buf = self._workspaces.get(key)
        if buf is None or buf.numel() < layout.nbytes:
            buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
            self._workspaces[key] = buf
        return buf.data_ptr()

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
        """Routed experts of ``x`` [T, H] (bfloat16 or float32, ``applies``) for the router's
        ``topk_idx`` int64 [T, k] (ids in [0, E): every slot counts) and ``topk_weights`` float32
        [T, k], both contiguous -> ``out_dtype`` (bfloat16 or float32) [T, H]: the staged pair's
        decode path bit for bit."""
        tokens = x.shape[0]
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        layout = self._layouts.get(tokens)
        if layout is None:
            layout = self._layouts[tokens] = decode_layout(tokens, self.num_local, self.top_k, self.hidden,
                                                           self.intermediate)
        device = x.get_device()
        stream = _descriptors.current_stream_of(device)
        out = torch.empty((tokens, self.hidden), dtype=out_dtype, device=x.device)
        with self._lock:
            self._launch(x, topk_idx, topk_weights, out, layout, device, stream)
        return out

    def _launch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
                layout: DecodeLayout, device: int, stream: int) -> None:
        tokens, hidden, inter, groups, k = x.shape[0], self.hidden, self.intermediate, self.num_local, self.top_k
        base = self._workspace(layout, device, stream)
        out_dtype = out.dtype
        c = self._native
        at = lambda offset: base + offset  # noqa: E731
        masked_m = at(layout.masked_m)
        sf_h, sf_i = hidden // kActGroup, inter // kActGroup
        c.per_token_cast_to_fp8(x.data_ptr(), _descriptors.DTYPE_CODES[x.dtype], tokens, hidden, x.stride(0),
                                at(layout.xq), at(layout.xs), sf_h, 1, kActGroup, False, device, stream)
        c.moe_local_dispatch(topk_idx.data_ptr(), topk_weights.data_ptr(), at(layout.xq), at(layout.xs), tokens, k,
                             groups, hidden, self.first_expert, at(layout.acts), at(layout.acts_sf),
                             at(layout.weights), at(layout.global_ids), at(layout.pair_rows), masked_m, device, stream)
        self._gemm(self.w13, at(layout.acts), hidden, at(layout.acts_sf), sf_h, at(layout.h), 2 * inter, masked_m,
                   tokens, 2 * inter, hidden, device, stream)
        c.swiglu_quant_fp8(at(layout.h), at(layout.weights), masked_m, tokens, layout.grouped, inter, at(layout.act),
                           at(layout.act_sf), sf_i, 1, device, stream)
        self._gemm(self.w2, at(layout.act), inter, at(layout.act_sf), sf_i, at(layout.expert_out), hidden, masked_m,
                   tokens, hidden, inter, device, stream)
        # Every slot counts (routed: none): one rank holds every expert, and the router's ids are in [0, E),
        # so each pair's row lies in the groups' rows, as the general path's all-true `topk_idx >= 0` says.
        c.moe_combine(at(layout.expert_out), layout.grouped, at(layout.pair_rows), 0, out.data_ptr(), tokens, k,
                      hidden, out_dtype is torch.float32, device, stream)

    def _gemm(self, w, a: int, lda: int, sfa: int, sfa_stride_m: int, d: int, ldd: int, masked_m: int, rows: int,
              n: int, k: int, device: int, stream: int) -> None:
        """One masked grouped GEMM over the E_l groups of ``rows`` rows (expected ``rows``), A's
        scales K-major: the FP4 decode layout's kernel, or the FP8 one."""
        if self.fp4:
            self._native.m_grouped_fp8_fp4_gemm_nt_masked_fragment(a, lda, sfa, sfa_stride_m, 1, w.data_ptr(), d, ldd,
                                                                   masked_m, rows, rows, n, k, self.num_local, device,
                                                                   stream)
        else:
            b, sfb = w
            self._native.m_grouped_fp8_gemm_nt_masked(a, lda, sfa, sfa_stride_m, 1, b.data_ptr(), b.stride(1),
                                                      sfb.data_ptr(), sfb.stride(0), sfb.stride(1), sfb.stride(2), d,
                                                      ldd, masked_m, rows, rows, n, k, self.num_local, device, stream)
