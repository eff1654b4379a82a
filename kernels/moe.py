"""The MoE steps around the grouped GEMMs, each in one launch on CUDA and as pure-torch code on
the CPU:

* :func:`moe_route`: top-k routing from router logits (moe_runtime/router.py states the semantics);
  the same ids as the torch code and weights within float32 rounding (sums in another order);
* :func:`moe_local_dispatch`: one rank's decode dispatch of a routing's (token, slot) pairs into the
  masked layout of the grouped GEMMs, without host syncs (bit for bit the torch code's layout);
* :func:`moe_combine`: each token's output as the float32 sum, in slot order, of the expert-output
  rows of its top-k slots, rounded once (bit for bit the torch code's);
* :func:`swiglu_quant_fp8`: SwiGLU x top-k weight and the 1x128 FP8 quantization between the two
  grouped GEMMs (masked layout: the rows that arrived only).
"""

from __future__ import annotations

import functools
import math

from dataclasses import dataclass

import torch

from . import _checks, _descriptors, jit
from .layout import empty_activation_scales
from .reference import swiglu as reference_swiglu

_OUT_DTYPES = (torch.bfloat16, torch.float32)
kCombineMaxTopK = 64  # the CUDA kernels' slot loops; more slots take the torch path
kDispatchMaxLocalExperts = 1024  # one shared-memory counter each
kDispatchMaxPairs = 65536


def _combine_reference(src: torch.Tensor, rows: torch.Tensor | None, routed: torch.Tensor | None, num_tokens: int,
                       top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    if rows is not None and routed is not None:  # unrouted slots' rows are never read: any value goes
        rows = torch.where(routed.reshape(-1), rows, 0)
    if rows is not None and src.shape[0] == 0:  # nothing to read: every slot is unrouted
        slots = src.new_zeros((num_tokens, top_k, src.shape[1]))
    else:
        slots = (src[: num_tokens * top_k] if rows is None else src.index_select(0, rows)).view(num_tokens, top_k, -1)
    if routed is not None:
        slots = torch.where(routed.unsqueeze(-1), slots, 0)
    acc = slots[:, 0].float()
    for j in range(1, top_k):
        acc.add_(slots[:, j])
    return acc.to(out_dtype)


def moe_combine(src: torch.Tensor, rows: torch.Tensor | None, routed: torch.Tensor | None, num_tokens: int,
                top_k: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out[t] = sum_j src[rows[t * k + j]]`` over the slots ``j = 0..k-1`` with ``routed[t, j]``,
    added in float32 in slot order and rounded once to ``out_dtype``.

    ``src`` bfloat16 [R, H]; ``rows`` int64 [T * k] (indices into ``src``) or None for ``src``'s
    first T * k rows in order; ``routed`` bool [T, k] or None when every slot counts; returns
    ``out_dtype`` (bfloat16 or float32) [T, H]. Rows of unrouted slots are not read, so they may
    hold anything (even NaN). On CUDA (H a multiple of 8, k <= 64) a row index outside ``src`` is
    not checked on the host (that would sync): the kernel writes NaN for that token instead of
    reading; other shapes take the torch path, which checks (and syncs)."""
    fn = "moe_combine"
    _checks.check_dense_args(fn, src=src, rows=rows, routed=routed)
    if not isinstance(src, torch.Tensor) or src.dtype != torch.bfloat16 or src.dim() != 2:
        _checks.fail(fn, ValueError, f"src must be a bfloat16 [R, H] tensor, got "
                                     f"{getattr(src, 'dtype', type(src).__name__)} {list(getattr(src, 'shape', ()))}")
    hidden = src.shape[1]
    for name, value in (("num_tokens", num_tokens), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_tokens" else 1):
            _checks.fail(fn, ValueError, f"{name} must be a {'non-negative' if name == 'num_tokens' else 'positive'} "
                                         f"int, got {value!r}")
    if out_dtype not in _OUT_DTYPES:
        _checks.fail(fn, ValueError, f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    pairs = num_tokens * top_k
    if rows is None:
        if src.shape[0] < pairs:
            _checks.fail(fn, ValueError, f"src has {src.shape[0]} rows, fewer than num_tokens * top_k = {pairs}")
    elif not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or tuple(rows.shape) != (pairs,):
        _checks.fail(fn, ValueError, f"rows must be None or an int64 tensor of shape [{pairs}], got "
                                     f"{getattr(rows, 'dtype', type(rows).__name__)} {list(getattr(rows, 'shape', ()))}")
    if routed is not None and (not isinstance(routed, torch.Tensor) or routed.dtype != torch.bool
                               or tuple(routed.shape) != (num_tokens, top_k)):
        _checks.fail(fn, ValueError, f"routed must be None or a bool tensor of shape [{num_tokens}, {top_k}], "
                                     f"got {getattr(routed, 'dtype', type(routed).__name__)} "
                                     f"{list(getattr(routed, 'shape', ()))}")
    device = _checks.check_same_device(fn, [t for t in (src, rows, routed) if t is not None])
    if num_tokens == 0:
        return torch.empty((0, hidden), dtype=out_dtype, device=device)
    if device.type == "cpu" or hidden == 0 or hidden % 8 or top_k == 0 or top_k > kCombineMaxTopK:
        read = rows if rows is None or routed is None else rows[routed.reshape(-1)]
        if read is not None and read.numel() and not 0 <= int(read.min()) <= int(read.max()) < src.shape[0]:
            _checks.fail(fn, ValueError, f"rows must index src's {src.shape[0]} rows (routed slots)")
        return _combine_reference(src, rows, routed, num_tokens, top_k, out_dtype)
    # The kernel reads 16-byte vectors from dense rows: other layouts are copied (the allocator aligns).
    if not src.is_contiguous() or src.data_ptr() % 16:
        src = src.contiguous() if not src.is_contiguous() else src.clone()
    rows = None if rows is None else rows.contiguous()
    routed = None if routed is None else routed.contiguous()
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=device)
    jit.native_module().moe_combine(src.data_ptr(), src.shape[0], 0 if rows is None else rows.data_ptr(),
                                    0 if routed is None else routed.data_ptr(), out.data_ptr(), num_tokens, top_k,
                                    hidden, out_dtype == torch.float32, device.index,
                                    _descriptors.current_stream(device))
    return out


@dataclass
class LocalDispatch:
    """The masked layout of :func:`moe_local_dispatch`, ``M = E_l * T + T * k`` rows (expert ``e``'s
    rows ``e * T ..`` first, then spare rows for unrouted pairs): ``acts`` uint8 [M, H] (E4M3 bits),
    ``acts_sf`` float32 [M, H/128], ``weights`` float32 [M, 1] (the pair's top-k weight),
    ``global_ids`` int64 [M, 1] (expert id, -1 on rows no routed pair holds), ``pair_rows`` int64
    [T * k] (the row of pair ``t * k + j``) and ``masked_m`` int32 [E_l] (valid rows per expert).
    Rows no pair holds are not written."""

    acts: torch.Tensor
    acts_sf: torch.Tensor
    weights: torch.Tensor
    global_ids: torch.Tensor
    pair_rows: torch.Tensor
    masked_m: torch.Tensor


def _local_dispatch_reference(xq: torch.Tensor, xs: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                              num_local: int, first_expert: int) -> LocalDispatch:
    num_tokens, k = topk_idx.shape
    device, pairs = xq.device, num_tokens * k
    flat = topk_idx.reshape(-1) - first_expert
    inside = (topk_idx.reshape(-1) >= 0) & (flat >= 0) & (flat < num_local)
    key = torch.where(inside, flat, num_local)  # unrouted pairs last
    order = torch.argsort(key, stable=True)
    sorted_key = key.index_select(0, order)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    first = counts.cumsum(0).sub_(counts)
    rows = torch.arange(pairs, device=device).sub_(first.index_select(0, sorted_key)).add_(sorted_key * num_tokens)
    m = num_local * num_tokens + pairs
    tokens = order // k
    acts = torch.empty((m, xq.shape[1]), dtype=torch.uint8, device=device)
    acts.index_copy_(0, rows, xq.index_select(0, tokens))
    acts_sf = torch.empty((m, xs.shape[1]), dtype=torch.float32, device=device)
    acts_sf.index_copy_(0, rows, xs.index_select(0, tokens))
    weights = torch.empty((m, 1), dtype=torch.float32, device=device)
    weights.view(-1).index_copy_(0, rows, topk_weights.reshape(-1).index_select(0, order))
    global_ids = torch.full((m, 1), -1, dtype=torch.int64, device=device)
    global_ids.view(-1).index_copy_(0, rows, torch.where(sorted_key < num_local, sorted_key + first_expert, -1))
    pair_rows = torch.empty_like(rows).index_copy_(0, order, rows)
    return LocalDispatch(acts, acts_sf, weights, global_ids, pair_rows, counts[:num_local].to(torch.int32))


def moe_local_dispatch(xq: torch.Tensor, xs: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       num_local_experts: int, first_expert: int = 0) -> LocalDispatch:
    """One rank's decode dispatch: the T x k (token, slot) pairs of ``topk_idx`` int64 [T, k]
    (global ids; -1 or an expert of another rank: unrouted) to the masked layout of this rank's
    ``num_local_experts`` experts ``[first_expert, first_expert + E_l)``, expert ``e``'s pairs in
    (token, slot) order in rows ``e * T + i`` (a token's experts must be distinct, so no expert gets
    more than T; with duplicates the rows run into the next expert's segment and masked_m exceeds T,
    which the masked GEMM clamps). ``xq`` E4M3 bits uint8 [T, H] (or float8_e4m3fn), ``xs`` float32
    [T, H/128] (1x128 scales), ``topk_weights`` float32 [T, k]. No host sync: usable inside a CUDA
    graph."""
    fn = "moe_local_dispatch"
    _checks.check_dense_args(fn, xq=xq, xs=xs, topk_idx=topk_idx, topk_weights=topk_weights)
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
        _checks.fail(fn, ValueError, f"topk_idx must be an int64 [T, k] tensor, got "
                                     f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)}")
    num_tokens, k = topk_idx.shape
    if isinstance(xq, torch.Tensor) and xq.dtype == torch.float8_e4m3fn:
        xq = xq.view(torch.uint8)
    if not isinstance(xq, torch.Tensor) or xq.dtype != torch.uint8 or xq.dim() != 2 or xq.shape[0] != num_tokens \
            or xq.shape[1] % 128:
        _checks.fail(fn, ValueError, f"xq must be an E4M3 [{num_tokens}, H] tensor with H a multiple of 128, "
                                     f"got {getattr(xq, 'dtype', type(xq).__name__)} {list(getattr(xq, 'shape', ()))}")
    hidden = xq.shape[1]
    expected = {"xs": ((num_tokens, hidden // 128), xs), "topk_weights": ((num_tokens, k), topk_weights)}
    for name, (shape, t) in expected.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            _checks.fail(fn, ValueError, f"{name} must be a float32 tensor of shape {list(shape)}, got "
                                         f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")
    _checks.check_ints(fn, (("num_local_experts", num_local_experts, 1), ("first_expert", first_expert, 0)))
    device = _checks.check_same_device(fn, [xq, xs, topk_idx, topk_weights])
    if device.type == "cpu" or num_tokens == 0 or num_local_experts > kDispatchMaxLocalExperts \
            or num_tokens * k > kDispatchMaxPairs or k == 0 or k > kCombineMaxTopK or hidden == 0:
        return _local_dispatch_reference(xq, xs, topk_idx, topk_weights, num_local_experts, first_expert)
    xq = _checks.contiguous_aligned(xq)
    xs, topk_idx, topk_weights = xs.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
    m = num_local_experts * num_tokens + num_tokens * k
    out = LocalDispatch(torch.empty((m, hidden), dtype=torch.uint8, device=device),
                        torch.empty((m, hidden // 128), dtype=torch.float32, device=device),
                        torch.empty((m, 1), dtype=torch.float32, device=device),
                        torch.empty((m, 1), dtype=torch.int64, device=device),
                        torch.empty((num_tokens * k,), dtype=torch.int64, device=device),
                        torch.empty((num_local_experts,), dtype=torch.int32, device=device))
    jit.native_module().moe_local_dispatch(
        topk_idx.data_ptr(), topk_weights.data_ptr(), xq.data_ptr(), xs.data_ptr(), num_tokens, k, num_local_experts,
        hidden, first_expert, out.acts.data_ptr(), out.acts_sf.data_ptr(), out.weights.data_ptr(),
        out.global_ids.data_ptr(), out.pair_rows.data_ptr(), out.masked_m.data_ptr(), device.index,
        _descriptors.current_stream(device))
    return out


kRouteNormEps = 1e-20
kRouteMaxExperts = 1024


def _route_reference(logits: torch.Tensor, top_k: int, sigmoid: bool, n_group: int | None, topk_group: int | None,
                     norm: bool, scaling: float, score_bias: torch.Tensor | None,
                     group_max: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores if score_bias is None else scores + score_bias
    if n_group is not None and num_tokens > 0:
        grouped = choice.view(num_tokens, n_group, -1)
        group_scores = grouped.amax(dim=-1) if group_max else grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    topk_idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + kRouteNormEps)
    if scaling != 1.0:
        weights = weights * scaling
    return topk_idx.to(torch.int64), weights.to(torch.float32).contiguous()


@functools.lru_cache(maxsize=64, typed=True)
def _route_scalars(num_experts: int, top_k: object, sigmoid: object, n_group: object, topk_group: object,
                   norm: object, scaling: object, group_score: object) -> bool:
    """Checks of moe_route's non-tensor arguments (raising as moe_route); True when the one-launch
    kernel takes them. Cached by value and type: a layer routes with the same ones every call."""
    fn = "moe_route"
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        _checks.fail(fn, ValueError, f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            _checks.fail(fn, TypeError, f"{name} must be None or an int, got {value!r}")
    _checks.check_bool(fn, "sigmoid", sigmoid)
    _checks.check_bool(fn, "norm", norm)
    if group_score not in ("top2_sum", "max"):
        _checks.fail(fn, ValueError, f"group_score must be 'top2_sum' or 'max', got {group_score!r}")
    group_max = group_score == "max"
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        _checks.fail(fn, TypeError, f"scaling must be a finite number, got {scaling!r}")
    if scaling <= 0:  # a weight of zero or below would drop or flip the expert's output
        _checks.fail(fn, ValueError, f"scaling must be > 0, got {scaling!r}")
    if (n_group is None) != (topk_group is None):
        _checks.fail(fn, ValueError, f"n_group and topk_group go together, got {n_group} and {topk_group}")
    if n_group is not None:
        per_group = num_experts // n_group if n_group > 0 else 0
        if per_group < (1 if group_max else 2) or num_experts % n_group or not 0 < topk_group <= n_group \
                or top_k > topk_group * per_group:
            _checks.fail(fn, ValueError, f"n_group must split the {num_experts} experts into groups of >= 2 and "
                                         f"topk_group in [1, n_group] must keep >= top_k experts, got n_group={n_group}, "
                                         f"topk_group={topk_group}, top_k={top_k}")
    return num_experts <= kRouteMaxExperts and top_k <= 32 and (n_group is None or n_group <= 32) \
        and not (group_max and n_group is not None)


def _route_on_gpu(logits: torch.Tensor, score_bias: torch.Tensor | None, top_k: int, n_group: int | None,
                  topk_group: int | None, sigmoid: bool, norm: bool,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    topk_idx = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    topk_weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    jit.native_module().moe_route(logits.data_ptr(), 0 if score_bias is None else score_bias.data_ptr(), num_tokens,
                                  num_experts, top_k, n_group or 0, topk_group or 0, sigmoid, norm, float(scaling),
                                  topk_idx.data_ptr(), topk_weights.data_ptr(), logits.device.index,
                                  _descriptors.current_stream(logits.device))
    return topk_idx, topk_weights


def _plain_cuda(t: object, dtype: torch.dtype) -> bool:
    """A contiguous CUDA tensor of ``dtype`` that the kernel can read as it is."""
    return type(t) is torch.Tensor and t.is_cuda and t.dtype is dtype and t.layout is torch.strided \
        and not t.is_nested and not t.is_neg() and t.is_contiguous()


def moe_route(logits: torch.Tensor, top_k: int, *, sigmoid: bool = False, n_group: int | None = None,
              topk_group: int | None = None, norm: bool = True, scaling: float = 1.0,
              score_bias: torch.Tensor | None = None, group_score: str = "top2_sum") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of float32 ``logits`` [T, E]: scores softmax (or ``sigmoid``); choice = scores
    (+ ``score_bias`` float32 [E]); with ``n_group``, only the ``topk_group`` groups whose two best
    choices sum highest compete (``group_score="max"``: whose best choice is highest, DeepSeek-V2's,
    by torch ops on CUDA too, not the one-launch kernel); the ``top_k`` best choices, largest first,
    give ``topk_idx`` int64
    [T, top_k] and their (unbiased) scores the ``topk_weights`` float32 [T, top_k], divided by their
    sum (+1e-20) with ``norm``, times ``scaling``. On CUDA, experts whose choices tie come out lowest
    id first (torch.topk leaves their order open) and NaN ranks above every number, as in torch."""
    # Fast path, every layer forward: contiguous float32 CUDA logits (and bias) and scalars of plain
    # types, whose checks are cached. Anything else takes the checks below, which raise or convert.
    if _plain_cuda(logits, torch.float32) and logits.dim() == 2 and type(top_k) is int \
            and type(sigmoid) is bool and type(norm) is bool and type(group_score) is str \
            and type(scaling) in (float, int) and (n_group is None or type(n_group) is int) \
            and (topk_group is None or type(topk_group) is int) and logits.numel() > 0 \
            and (score_bias is None or (_plain_cuda(score_bias, torch.float32)
                                        and score_bias.shape == (logits.shape[1],)
                                        and score_bias.get_device() == logits.get_device())):
        if _route_scalars(logits.shape[1], top_k, sigmoid, n_group, topk_group, norm, scaling, group_score):
            return _route_on_gpu(logits, score_bias, top_k, n_group, topk_group, sigmoid, norm, scaling)
    fn = "moe_route"
    _checks.check_dense_args(fn, negated_ok=True, logits=logits, score_bias=score_bias)  # resolved below
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 2:
        _checks.fail(fn, ValueError, f"logits must be a float32 [T, E] tensor, got "
                                     f"{getattr(logits, 'dtype', type(logits).__name__)}")
    num_tokens, num_experts = logits.shape
    if logits.device.type not in ("cpu", "cuda"):
        _checks.fail(fn, ValueError, f"logits must be on a CPU or CUDA device, got {logits.device}")
    if num_experts == 0:
        _checks.fail(fn, ValueError, f"logits must have one column per expert (at least one), got shape "
                                     f"{list(logits.shape)}")
    try:
        fits = _route_scalars(num_experts, top_k, sigmoid, n_group, topk_group, norm, scaling, group_score)
    except TypeError as error:  # an unhashable argument: check it uncached, which says what was expected
        if str(error).startswith(fn):
            raise
        fits = _route_scalars.__wrapped__(num_experts, top_k, sigmoid, n_group, topk_group, norm, scaling,
                                          group_score)
    if score_bias is not None:
        if not isinstance(score_bias, torch.Tensor) or tuple(score_bias.shape) != (num_experts,) \
                or not score_bias.is_floating_point():
            _checks.fail(fn, ValueError, f"score_bias must be a floating [{num_experts}] tensor, got "
                                         f"{getattr(score_bias, 'dtype', type(score_bias).__name__)} "
                                         f"{list(getattr(score_bias, 'shape', ()))}")
        if score_bias.device.type not in ("cpu", "cuda"):
            _checks.fail(fn, ValueError, f"score_bias must be on a CPU or CUDA device, got {score_bias.device}")
        # A lazily negated view would reach the kernel as its unnegated memory.
        score_bias = score_bias.to(device=logits.device, dtype=torch.float32).resolve_neg().contiguous()
    if logits.device.type != "cuda" or not fits or num_tokens == 0:
        return _route_reference(logits, top_k, sigmoid, n_group, topk_group, norm, scaling, score_bias,
                                group_score == "max")
    return _route_on_gpu(logits.resolve_neg().contiguous(), score_bias, top_k, n_group, topk_group, sigmoid, norm,
                         scaling)


def _swiglu_quant_reference(h: torch.Tensor, weights: torch.Tensor,
                            mn_major_sf: bool) -> tuple[torch.Tensor, torch.Tensor]:
    act, sf = reference_swiglu.swiglu_quant(h, weights)
    return act, (empty_activation_scales(h.shape[0], sf.shape[1], True, h.device).copy_(sf) if mn_major_sf else sf)


def swiglu_quant_fp8(h: torch.Tensor, weights: torch.Tensor, masked_m: torch.Tensor | None = None,
                     rows_per_group: int = 0, mn_major_sf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' step between the grouped GEMMs: ``act = silu(gate) * up * w`` in float32, then
    ``per_token_cast_to_fp8(act, gran_k=128)``, in one launch on CUDA.

    ``h`` bfloat16 [M, 2I] (columns [0, I) gate, [I, 2I) up; I a multiple of 128), ``weights``
    float32 [M] or [M, 1] (each row's top-k weight). Returns ``(act float8_e4m3fn [M, I], sf float32
    [M, I/128])``; ``sf`` contiguous, or with ``mn_major_sf`` MN-major TMA-aligned (stride 1 along M,
    M rounded up to 4 along the groups), the layout the contiguous GEMM loads with one TMA box per K
    block. Masked layout: with ``masked_m`` int32 [G] and ``rows_per_group`` (M = G x rows),
    only the first ``masked_m[g]`` rows of each group are computed on CUDA; the other rows of the
    outputs are left unwritten (the CPU computes every row)."""
    # Fast path, every call between the grouped GEMMs: plain CUDA tensors in the layouts the GEMMs and
    # the router give (h contiguous, weights and masked_m contiguous), flags of the right types: 27 ->
    # 21-22 us a call on the H200's host (bench/RESULTS.md, session 40). Anything unusual takes the
    # checks below, which raise, copy or run the reference.
    if _plain_cuda(h, torch.bfloat16) and _plain_cuda(weights, torch.float32) and type(mn_major_sf) is bool:
        shape, strides, index = h.shape, h.stride(), h.get_device()
        w_shape = weights.shape
        if len(shape) == 2 and shape[0] > 0 and shape[1] > 0 and shape[1] % 256 == 0 and strides[1] == 1 \
                and strides[0] == shape[1] and h.data_ptr() % 16 == 0 and weights.get_device() == index \
                and (w_shape == (shape[0],) or w_shape == (shape[0], 1)):
            if masked_m is None:
                return _swiglu_quant_on_gpu(h, weights, None, 0, mn_major_sf, shape[0], shape[1] // 2, index)
            if _plain_cuda(masked_m, torch.int32) and type(rows_per_group) is int and rows_per_group > 0 \
                    and shape[0] % rows_per_group == 0 and masked_m.shape == (shape[0] // rows_per_group,) \
                    and masked_m.get_device() == index:
                return _swiglu_quant_on_gpu(h, weights, masked_m, rows_per_group, mn_major_sf, shape[0],
                                            shape[1] // 2, index)
    fn = "swiglu_quant_fp8"
    _checks.check_dense_args(fn, negated_ok=True, h=h, weights=weights, masked_m=masked_m)  # resolved below
    _checks.check_bool(fn, "mn_major_sf", mn_major_sf)
    if not isinstance(h, torch.Tensor) or h.dtype != torch.bfloat16 or h.dim() != 2 or h.shape[1] % 256 \
            or h.shape[1] == 0:
        _checks.fail(fn, ValueError, f"h must be a bfloat16 [M, 2I] tensor with I a multiple of 128, got "
                                     f"{getattr(h, 'dtype', type(h).__name__)} {list(getattr(h, 'shape', ()))}")
    m, inter = h.shape[0], h.shape[1] // 2
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 or weights.numel() != m \
            or weights.dim() not in (1, 2) or (weights.dim() == 2 and weights.shape[1] != 1):
        _checks.fail(fn, ValueError, f"weights must be a float32 [{m}] or [{m}, 1] tensor, got "
                                     f"{getattr(weights, 'dtype', type(weights).__name__)} "
                                     f"{list(getattr(weights, 'shape', ()))}")
    if masked_m is not None:
        if isinstance(rows_per_group, bool) or not isinstance(rows_per_group, int) or rows_per_group < 1 \
                or m % rows_per_group:
            _checks.fail(fn, ValueError, f"rows_per_group must be a positive int dividing M={m}, got {rows_per_group!r}")
        if not isinstance(masked_m, torch.Tensor) or masked_m.dtype != torch.int32 \
                or tuple(masked_m.shape) != (m // rows_per_group,):
            _checks.fail(fn, ValueError, f"masked_m must be an int32 tensor of shape [{m // rows_per_group}]")
    device = _checks.check_same_device(fn, [h, weights] + ([masked_m] if masked_m is not None else []))
    if device.type == "cpu":
        return _swiglu_quant_reference(h, weights, mn_major_sf)
    if m == 0:
        return (torch.empty((0, inter), dtype=torch.float8_e4m3fn, device=device),
                empty_activation_scales(0, inter // 128, mn_major_sf, device))
    h, weights = h.resolve_neg(), weights.resolve_neg()
    if h.stride(1) != 1 or h.stride(0) != 2 * inter or h.data_ptr() % 16:
        h = h.contiguous() if not h.is_contiguous() else h.clone()
    weights = weights.reshape(-1).contiguous()
    masked_m = masked_m.resolve_neg().contiguous() if masked_m is not None else None
    return _swiglu_quant_on_gpu(h, weights, masked_m, rows_per_group if masked_m is not None else 0, mn_major_sf, m,
                                inter, device.index)


def _swiglu_quant_on_gpu(h: torch.Tensor, weights: torch.Tensor, masked_m: torch.Tensor | None, rows_per_group: int,
                         mn_major_sf: bool, m: int, inter: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on checked arguments (h [m >= 1, 2I] contiguous and 16-byte aligned, weights m
    contiguous floats, masked_m None or contiguous): new outputs, the launch on the current stream."""
    device = h.device
    out = torch.empty((m, inter), dtype=torch.float8_e4m3fn, device=device)
    sf = empty_activation_scales(m, inter // 128, mn_major_sf, device)
    stride_m, stride_k = sf.stride()
    masked_ptr = 0 if masked_m is None else masked_m.data_ptr()
    jit.native_module().swiglu_quant_fp8(h.data_ptr(), weights.data_ptr(), masked_ptr, rows_per_group, m, inter,
                                         out.data_ptr(), sf.data_ptr(), stride_m, stride_k, index,
                                         _descriptors.current_stream_of(index))
    return out, sf
