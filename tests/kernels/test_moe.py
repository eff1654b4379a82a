"""kernels.moe_local_dispatch and kernels.moe_combine (kernels/moe.py): the decode layout and the
slot-ordered float32 combine against their definitions (CPU), the CUDA kernels bit for bit against
the torch paths (GPU), argument checks."""

from __future__ import annotations

import pytest
import torch

import kernels


def _problem(num_tokens: int, top_k: int, hidden: int, spare: int, device="cpu"):
    src = torch.randn(num_tokens * top_k + spare, hidden, device=device).to(torch.bfloat16)
    rows = torch.randperm(src.shape[0], device=device)[: num_tokens * top_k]
    routed = torch.rand(num_tokens, top_k, device=device) < 0.8
    return src, rows, routed


def _explicit(src, rows, routed, num_tokens, top_k, out_dtype):
    out = torch.empty(num_tokens, src.shape[1], dtype=out_dtype)
    for t in range(num_tokens):
        acc = torch.zeros(src.shape[1], dtype=torch.float32)
        for j in range(top_k):
            if routed is None or routed[t, j]:
                acc = acc + src[t * top_k + j if rows is None else rows[t * top_k + j]].float()
        out[t] = acc.to(out_dtype)
    return out


@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 256), (7, 3, 64), (20, 1, 1024), (5, 8, 40)])
@pytest.mark.parametrize("with_rows,with_routed", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_combine_sums_routed_slots_in_order(seed, num_tokens, top_k, hidden, with_rows, with_routed, out_dtype):
    src, rows, routed = _problem(num_tokens, top_k, hidden, spare=5)
    rows, routed = (rows if with_rows else None), (routed if with_routed else None)
    got = kernels.moe_combine(src, rows, routed, num_tokens, top_k, out_dtype)
    assert got.dtype == out_dtype and got.shape == (num_tokens, hidden)
    assert torch.equal(got, _explicit(src, rows, routed, num_tokens, top_k, out_dtype))


def test_unrouted_rows_are_not_read(seed):
    src, rows, routed = _problem(4, 2, 64, spare=0)
    routed[1, 0] = False
    src[rows[2]] = float("nan")  # token 1, slot 0
    out = kernels.moe_combine(src, rows, routed, 4, 2)
    assert torch.isfinite(out).all()


def test_unrouted_rows_may_be_anything(seed):
    """As on CUDA, an unrouted slot's row index is never used, even out of range (-1, past src)."""
    src, rows, routed = _problem(4, 2, 64, spare=0)
    routed[1, 0] = routed[3, 1] = False
    bad = rows.clone()
    bad[2], bad[7] = -1, 10**6
    assert torch.equal(kernels.moe_combine(src, bad, routed, 4, 2), kernels.moe_combine(src, rows, routed, 4, 2))


def test_zero_tokens():
    out = kernels.moe_combine(torch.zeros(3, 16, dtype=torch.bfloat16), None, None, 0, 4, torch.float32)
    assert out.shape == (0, 16) and out.dtype == torch.float32


@pytest.mark.parametrize("kwargs,match", [
    (dict(src=torch.zeros(4, 16)), "src must be a bfloat16"),
    (dict(rows=torch.zeros(3, dtype=torch.int64)), r"rows must be None or an int64 tensor of shape \[4\]"),
    (dict(rows=torch.tensor([0, 1, 2, 9])), "rows must index src's 4 rows"),
    (dict(routed=torch.ones(2, 3, dtype=torch.bool)), r"routed must be None or a bool tensor of shape \[2, 2\]"),
    (dict(out_dtype=torch.float16), "out_dtype must be bfloat16 or float32"),
    (dict(top_k=0), "top_k must be a positive int"),
    (dict(src=torch.zeros(3, 16, dtype=torch.bfloat16)), "fewer than num_tokens \\* top_k = 4"),
])
def test_bad_input(kwargs, match):
    args = dict(src=torch.zeros(4, 16, dtype=torch.bfloat16), rows=None, routed=None, num_tokens=2, top_k=2,
                out_dtype=torch.bfloat16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kernels.moe_combine(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 7168), (33, 8, 7168), (5, 3, 1024), (300, 2, 256)])
@pytest.mark.parametrize("with_rows,with_routed", [(True, True), (False, False)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_combine_equals_the_torch_path(seed, num_tokens, top_k, hidden, with_rows, with_routed, out_dtype):
    """Bit for bit, signed zeros included (some columns are -0 in every slot)."""
    src, rows, routed = _problem(num_tokens, top_k, hidden, spare=7, device="cuda")
    src[:, :16] = -0.0
    if with_routed:
        src[rows[~routed.flatten()]] = float("nan")  # unrouted rows must not be read
    rows, routed = (rows if with_rows else None), (routed if with_routed else None)
    got = kernels.moe_combine(src, rows, routed, num_tokens, top_k, out_dtype)
    from kernels.moe import _combine_reference
    want = _combine_reference(src, rows, routed, num_tokens, top_k, out_dtype)
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_combine_many_tokens_and_odd_layouts(seed):
    """More tokens than a grid dimension of 65535, a strided src and a misaligned one."""
    from kernels.moe import _combine_reference
    src, rows, routed = _problem(70000, 2, 128, spare=0, device="cuda")
    assert torch.equal(kernels.moe_combine(src, rows, routed, 70000, 2), _combine_reference(src, rows, routed, 70000, 2,
                                                                                             torch.bfloat16))
    wide = torch.randn(40, 264, device="cuda").to(torch.bfloat16)
    for view in (wide[:, :256], wide.view(-1)[8:8 + 39 * 256].view(39, 256)):
        assert torch.equal(kernels.moe_combine(view, None, None, 13, 3),
                           _combine_reference(view, None, None, 13, 3, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_combine_row_out_of_range_gives_nan():
    src = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    rows = torch.tensor([0, 1, 2, 100], device="cuda")
    out = kernels.moe_combine(src, rows, None, 2, 2)
    torch.cuda.synchronize()
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


# ---- moe_local_dispatch ----------------------------------------------------------------------------------

def _routing(num_tokens: int, top_k: int, num_experts: int, unrouted: float, device="cpu"):
    idx = torch.rand(num_tokens, num_experts, device=device).topk(top_k, dim=-1).indices
    idx[torch.rand(num_tokens, top_k, device=device) < unrouted] = -1
    return idx, torch.rand(num_tokens, top_k, device=device) + 0.1


def _dispatch_inputs(num_tokens: int, hidden: int, device="cpu"):
    xq, xs = kernels.per_token_cast_to_fp8(torch.randn(num_tokens, hidden, device=device), use_ue8m0=False,
                                           gran_k=128)
    return xq.view(torch.uint8), xs


@pytest.mark.parametrize("num_tokens,top_k,num_local,first,unrouted", [
    (1, 8, 16, 0, 0.0), (7, 3, 8, 0, 0.3), (32, 8, 64, 0, 0.1), (5, 2, 4, 4, 0.0),
])
def test_local_dispatch_layout(seed, num_tokens, top_k, num_local, first, unrouted):
    idx, weights = _routing(num_tokens, top_k, num_local + first, unrouted)  # ids below first: another rank's
    xq, xs = _dispatch_inputs(num_tokens, 256)
    out = kernels.moe_local_dispatch(xq, xs, idx, weights, num_local, first)
    m = num_local * num_tokens + num_tokens * top_k
    assert out.acts.shape == (m, 256) and out.global_ids.shape == (m, 1) and out.masked_m.dtype == torch.int32
    local = (idx >= first) & (idx < first + num_local)
    assert torch.equal(out.masked_m.long(), torch.bincount((idx[local] - first).flatten(), minlength=num_local))
    for e in range(num_local):  # expert e's pairs in (token, slot) order at the start of its segment
        pairs = ((idx == e + first) & local).flatten().nonzero().flatten()
        rows = out.pair_rows[pairs]
        assert torch.equal(rows, e * num_tokens + torch.arange(pairs.numel())), e
        assert torch.equal(out.acts[rows], xq[pairs // top_k]) and torch.equal(out.acts_sf[rows], xs[pairs // top_k])
        assert torch.equal(out.weights[rows, 0], weights.flatten()[pairs])
        ids = out.global_ids[e * num_tokens:(e + 1) * num_tokens, 0]
        assert bool((ids[:pairs.numel()] == e + first).all()) and bool((ids[pairs.numel():] == -1).all())
    spare = out.pair_rows[~local.flatten()]
    assert bool((spare >= num_local * num_tokens).all()) and spare.unique().numel() == spare.numel()
    assert bool((out.global_ids[num_local * num_tokens:] == -1).all())


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk_idx=torch.zeros(2, 2, dtype=torch.int32)), "topk_idx must be an int64"),
    (dict(xq=torch.zeros(2, 100, dtype=torch.uint8)), "H a multiple of 128"),
    (dict(xs=torch.zeros(2, 2)), r"xs must be a float32 tensor of shape \[2, 1\]"),
    (dict(topk_weights=torch.zeros(2, 3)), r"topk_weights must be a float32 tensor of shape \[2, 2\]"),
    (dict(num_local_experts=0), "num_local_experts must be an int >= 1"),
])
def test_local_dispatch_bad_input(kwargs, match):
    args = dict(xq=torch.zeros(2, 128, dtype=torch.uint8), xs=torch.ones(2, 1), topk_idx=torch.zeros(2, 2, dtype=torch.int64),
                topk_weights=torch.ones(2, 2), num_local_experts=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kernels.moe_local_dispatch(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens,top_k,num_local,first,unrouted,hidden", [
    (1, 8, 256, 0, 0.0, 7168), (32, 8, 256, 0, 0.05, 7168), (17, 3, 16, 8, 0.2, 1024), (4, 6, 1000, 0, 0.0, 128),
])
def test_gpu_local_dispatch_equals_the_torch_path(seed, num_tokens, top_k, num_local, first, unrouted, hidden):
    from kernels.moe import _local_dispatch_reference
    idx, weights = _routing(num_tokens, top_k, num_local + first, unrouted, "cuda")
    xq, xs = _dispatch_inputs(num_tokens, hidden, "cuda")
    got = kernels.moe_local_dispatch(xq, xs, idx, weights, num_local, first)
    want = _local_dispatch_reference(xq, xs, idx, weights, num_local, first)
    for name in ("global_ids", "pair_rows", "masked_m"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    rows = want.pair_rows  # rows no pair holds are not written by either
    for name in ("acts", "acts_sf", "weights"):
        assert torch.equal(getattr(got, name)[rows], getattr(want, name)[rows]), name


# ---- moe_route --------------------------------------------------------------------------------------------

_ROUTE_CONFIGS = {  # (num_experts, top_k, kwargs); the sigmoid ones and "biased" ones get a score bias
    "mixtral": (8, 2, dict()),
    "qwen2-moe": (60, 4, dict(norm=False)),
    "deepseek-v3": (256, 8, dict(sigmoid=True, n_group=8, topk_group=4, scaling=2.5)),
    "wide": (1024, 32, dict(sigmoid=True, n_group=32, topk_group=16, norm=False)),
    # The other transformers families (moe_runtime/integrations/hf.py): softmax with a bias (Ernie
    # 4.5), softmax over groups (Mistral-Large-4), sigmoid with a bias and no groups (MiniMax-M2,
    # AFMoE), softmax scaled without renormalising (DeepSeek-V2).
    "ernie-4.5": (64, 6, dict(biased=True)),
    "mistral-large-4": (128, 4, dict(n_group=8, topk_group=4, scaling=1.5)),
    "minimax-m2": (256, 8, dict(sigmoid=True)),
    "deepseek-v2": (160, 6, dict(norm=False, scaling=16.0)),
    # group-limited (groups by their best score): torch ops on CUDA, through moe_route's dispatch.
    "deepseek-v2-grouped": (160, 6, dict(norm=False, scaling=16.0, n_group=8, topk_group=3, group_score="max")),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(_ROUTE_CONFIGS))
@pytest.mark.parametrize("num_tokens", [1, 5, 1000])
def test_gpu_route_matches_the_torch_path(seed, name, num_tokens):
    """Same experts in the same order; weights within float32 rounding (the sums run in another order)."""
    from kernels.moe import _route_reference
    num_experts, top_k, kwargs = _ROUTE_CONFIGS[name]
    kwargs = dict(kwargs)
    logits = torch.randn(num_tokens, num_experts, device="cuda")
    biased = kwargs.pop("biased", False) or kwargs.get("sigmoid", False)
    bias = torch.randn(num_experts, device="cuda") * 0.05 if biased else None
    idx, weights = kernels.moe_route(logits, top_k, score_bias=bias, **kwargs)
    want_idx, want_weights = _route_reference(logits, top_k, kwargs.get("sigmoid", False), kwargs.get("n_group"),
                                              kwargs.get("topk_group"), kwargs.get("norm", True),
                                              kwargs.get("scaling", 1.0), bias, kwargs.get("group_score") == "max")
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    # Tied choices may come out in another order than torch.topk's (which leaves it open): compare
    # those tokens as sets, the others slot by slot.
    same = (idx == want_idx).all(dim=1)
    ties = ~same
    if ties.any():
        assert torch.equal(idx[ties].sort(dim=1).values, want_idx[ties].sort(dim=1).values)
        assert int(ties.sum()) <= max(1, num_tokens // 50), "more ties than random logits make"
    torch.testing.assert_close(weights[same], want_weights[same], rtol=2e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("view", ["negated", "strided"])
def test_gpu_route_views_equal_their_copies(seed, view):
    """The fast path takes only plain contiguous tensors: a lazily negated or strided logits and bias
    route as their materialised copies."""
    num_experts, top_k, kwargs = _ROUTE_CONFIGS["deepseek-v3"]
    logits = torch.randn(7, num_experts, device="cuda")
    bias = torch.randn(num_experts, device="cuda") * 0.05
    if view == "negated":
        logits_view, bias_view = torch._neg_view(-logits), torch._neg_view(-bias)
    else:
        logits_view = torch.randn(num_experts, 7, device="cuda").t()
        logits = logits_view.contiguous()
        bias_view = torch.stack([bias, bias], dim=1)[:, 0]
    got = kernels.moe_route(logits_view, top_k, score_bias=bias_view, **kwargs)
    want = kernels.moe_route(logits.clone(), top_k, score_bias=bias.clone(), **kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["mixtral", "deepseek-v3"])
def test_gpu_route_nan_logits_still_give_distinct_valid_ids(seed, name):
    num_experts, top_k, kwargs = _ROUTE_CONFIGS[name]
    logits = torch.randn(9, num_experts, device="cuda")
    logits[0, 3] = float("nan")
    logits[1] = float("nan")
    logits[2] = float("-inf")
    idx, _ = kernels.moe_route(logits, top_k, **kwargs)
    torch.cuda.synchronize()
    assert bool(((idx >= 0) & (idx < num_experts)).all())
    assert all(len(set(row)) == top_k for row in idx.tolist())


@pytest.mark.parametrize("kwargs,match", [
    (dict(score_bias=torch.zeros(3)), r"score_bias must be a floating \[8\] tensor"),
    (dict(score_bias=torch.zeros(8, dtype=torch.int64)), r"score_bias must be a floating \[8\] tensor"),
    (dict(n_group=8, topk_group=4), "groups of >= 2"),
    (dict(n_group=4), "go together"),
    (dict(n_group=4, topk_group=0), "topk_group in \\[1, n_group\\]"),
    (dict(group_score="sum"), "group_score must be"),
    (dict(top_k=9), r"top_k must be an int in \[1, 8\]"),
    (dict(logits=torch.randn(3, 8, device="meta")), "moe_route: logits must be on a CPU or CUDA device, got meta"),
    (dict(score_bias=torch.zeros(8, device="meta")), "moe_route: score_bias must be on a CPU or CUDA device, got meta"),
])
def test_route_bad_input(kwargs, match):
    args = dict(logits=torch.randn(3, 8), top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kernels.moe_route(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_group=True, topk_group=1), "n_group must be None or an int"),
    (dict(n_group=4, topk_group=2.0), "topk_group must be None or an int"),
    (dict(norm=1), "norm must be a bool"),
    (dict(sigmoid="yes"), "sigmoid must be a bool"),
    (dict(scaling="x"), "scaling must be a finite number"),
    (dict(scaling=float("nan")), "scaling must be a finite number"),
    # Unhashable ones miss the checks' cache and are checked uncached, with the same message.
    (dict(n_group=[4], topk_group=2), "n_group must be None or an int"),
    (dict(scaling=[2.0]), "scaling must be a finite number"),
])
def test_route_argument_types(kwargs, match):
    for _ in range(2):  # the second call meets the cached checks, which must raise again
        with pytest.raises(TypeError, match=match):
            kernels.moe_route(torch.randn(3, 8), 2, **kwargs)


@pytest.mark.parametrize("logits,kwargs,match", [
    (torch.randn(3, 8), dict(scaling=0.0), "scaling must be > 0, got 0.0"),
    (torch.randn(3, 8), dict(scaling=-1), "scaling must be > 0, got -1"),
    (torch.randn(4, 0), {}, "logits must have one column per expert"),
])
def test_route_argument_values(logits, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kernels.moe_route(logits, 1, **kwargs)
