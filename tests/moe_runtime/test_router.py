"""Routing: hand-written cases, a naive per-token loop, and argument checks."""

import math

import pytest
import torch

from moe_runtime.router import RouterConfig, route, router_logits


def _naive_route(logits, top_k, cfg, bias=None):
    """Per-token Python loop in float64 over lists, written from the semantics in router.py."""
    idx_out, w_out = [], []
    for row in logits.double().tolist():
        e = len(row)
        if cfg.scoring_func == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (float(bias[i]) if bias is not None else 0.0) for i, s in enumerate(scores)]
        if cfg.n_group is not None:
            per = e // cfg.n_group
            best = 1 if cfg.group_score == "max" else 2
            gs = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:best]) for g in range(cfg.n_group)]
            kept = sorted(range(cfg.n_group), key=lambda g: -gs[g])[:cfg.topk_group]
            choice = [c if i // per in kept else -math.inf for i, c in enumerate(choice)]
        chosen = sorted(range(e), key=lambda i: -choice[i])[:top_k]
        w = [scores[i] for i in chosen]
        if cfg.norm_topk_prob:
            total = sum(w)
            w = [v / total for v in w]
        idx_out.append(chosen)
        w_out.append([v * cfg.routed_scaling_factor for v in w])
    return torch.tensor(idx_out, dtype=torch.int64), torch.tensor(w_out, dtype=torch.float64)


def test_hand_written_softmax_top2():
    logits = torch.tensor([[0.0, math.log(3.0), math.log(2.0), -10.0]])
    r = route(logits, 2, RouterConfig(norm_topk_prob=False))
    total = 1 + 3 + 2 + math.exp(-10)
    assert r.topk_idx.tolist() == [[1, 2]]
    assert r.topk_weights.dtype == torch.float32 and r.topk_idx.dtype == torch.int64
    assert r.topk_weights[0].tolist() == pytest.approx([3 / total, 2 / total], rel=1e-6)
    rn = route(logits, 2, RouterConfig(norm_topk_prob=True))
    assert rn.topk_weights[0].tolist() == pytest.approx([0.6, 0.4], rel=1e-6)


def test_hand_written_sigmoid_grouped_with_bias():
    # 8 experts in 4 groups of 2; the bias lifts group 3 above group 0 for the choice only.
    logits = torch.tensor([[2.0, 1.0, -1.0, -2.0, 0.0, -3.0, 0.5, 0.4]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    cfg = RouterConfig(scoring_func="sigmoid", n_group=4, topk_group=2, use_score_bias=True,
                       routed_scaling_factor=2.5, norm_topk_prob=True)
    r = route(logits, 3, cfg, bias)
    s = torch.sigmoid(logits[0].double())
    # group sums with bias: g0 = s0+s1, g3 = s6+s7+1.0 -> kept groups {3, 0}; top-3 by s+bias: 6, 7, 0
    assert r.topk_idx.tolist() == [[6, 7, 0]]
    w = torch.stack([s[6], s[7], s[0]])
    assert r.topk_weights[0].double().tolist() == pytest.approx((w / w.sum() * 2.5).tolist(), rel=1e-6)


def test_mixtral_semantics_equal_softmax_over_chosen():
    torch.manual_seed(0)
    logits = torch.randn(32, 8)
    r = route(logits, 2, RouterConfig(scoring_func="softmax", norm_topk_prob=True))
    chosen = logits.gather(1, r.topk_idx)
    torch.testing.assert_close(r.topk_weights, chosen.softmax(dim=-1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cfg,top_k,use_bias", [
    (RouterConfig(), 2, False),
    (RouterConfig(norm_topk_prob=False), 4, False),
    (RouterConfig(scoring_func="sigmoid", norm_topk_prob=True), 3, False),
    (RouterConfig(scoring_func="sigmoid", n_group=4, topk_group=2, use_score_bias=True,
                  routed_scaling_factor=2.5), 4, True),
    (RouterConfig(scoring_func="softmax", n_group=8, topk_group=3, norm_topk_prob=False), 6, False),
    # DeepSeek-V2's group-limited routing: groups ranked by their best score (also groups of one).
    (RouterConfig(scoring_func="softmax", n_group=8, topk_group=3, norm_topk_prob=False, group_score="max",
                  routed_scaling_factor=16.0), 6, False),
    (RouterConfig(scoring_func="softmax", n_group=32, topk_group=8, group_score="max"), 6, False),
])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_matches_naive_loop(cfg, top_k, use_bias, num_tokens):
    torch.manual_seed(num_tokens + top_k)
    num_experts = 32
    logits = torch.randn(num_tokens, num_experts) * 2
    bias = torch.randn(num_experts) * 0.1 if use_bias else None
    r = route(logits, top_k, cfg, bias)
    idx, w = _naive_route(logits, top_k, cfg, bias)
    assert torch.equal(r.topk_idx, idx)
    torch.testing.assert_close(r.topk_weights.double(), w, rtol=2e-6, atol=1e-7)


def test_zero_tokens_and_logits_dtype():
    cfg = RouterConfig(scoring_func="sigmoid", n_group=2, topk_group=1)
    r = route(torch.empty(0, 8), 2, cfg)
    assert r.topk_idx.shape == (0, 2) and r.topk_weights.shape == (0, 2)
    torch.manual_seed(3)
    x, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    bf16 = router_logits(x, w, RouterConfig(logits_dtype=torch.bfloat16))
    assert bf16.dtype == torch.float32
    assert torch.equal(bf16, torch.nn.functional.linear(x, w).float())
    assert torch.equal(router_logits(x, w, RouterConfig()), x.float() @ w.float().t())


@pytest.mark.parametrize("kwargs,top_k,match", [
    (dict(scoring_func="relu"), 2, "scoring_func"),
    (dict(), 0, "top_k"),
    (dict(), 9, "top_k"),
    (dict(n_group=3, topk_group=1), 2, "n_group must divide"),
    (dict(n_group=4), 2, "go together"),
    (dict(n_group=8, topk_group=2), 2, "two best"),
    (dict(n_group=2, topk_group=3), 2, "topk_group"),
    (dict(n_group=4, topk_group=1), 3, "exceeds"),
    (dict(routed_scaling_factor=0.0), 2, "routed_scaling_factor"),
    (dict(group_score="top3_sum"), 2, "group_score"),
])
def test_config_errors(kwargs, top_k, match):
    with pytest.raises(ValueError, match=match):
        route(torch.randn(3, 8), top_k, RouterConfig(**kwargs))


@pytest.mark.parametrize("kwargs,top_k,error,match", [
    (dict(routed_scaling_factor=float("inf")), 2, ValueError, "routed_scaling_factor must be finite and > 0, got inf"),
    (dict(routed_scaling_factor="2"), 2, TypeError, "routed_scaling_factor must be a number, got '2'"),
    (dict(routed_scaling_factor=None), 2, TypeError, "routed_scaling_factor must be a number, got None"),
    (dict(norm_topk_prob="no"), 2, TypeError, "norm_topk_prob must be a bool, got 'no'"),
    (dict(norm_topk_prob=None), 2, TypeError, "norm_topk_prob must be a bool, got None"),
    (dict(use_score_bias=1), 2, TypeError, "use_score_bias must be a bool, got 1"),
    (dict(logits_dtype=torch.float8_e4m3fn), 2, TypeError, "logits_dtype must be None, float16, bfloat16"),
    (dict(), True, ValueError, "top_k must be an int in \\[1, num_experts=8\\], got True"),
])
def test_config_type_errors(kwargs, top_k, error, match):
    with pytest.raises(error, match=match):
        RouterConfig(**kwargs).validate(8, top_k)


@pytest.mark.parametrize("args,error,match", [
    (([[0.0] * 8], 2), TypeError, "logits must be a floating-point tensor \\[T, E\\], got list"),
    ((None, 2), TypeError, "logits must be a floating-point tensor"),
    ((torch.ones(3, 8, dtype=torch.int64), 2), TypeError, "logits must be a floating-point tensor .*torch.int64"),
    ((torch.ones(3, 8, dtype=torch.complex64), 2), TypeError, "torch.complex64"),
    ((torch.randn(3, 8), 2, {"scoring_func": "softmax"}), TypeError, "config must be None or a RouterConfig, got dict"),
    ((torch.randn(3, 8), 2, RouterConfig(use_score_bias=True), [0.0] * 8), TypeError,
     "score_bias must be a float tensor \\[8\\], got list"),
    ((torch.randn(3, 8, device="meta"), 2), ValueError, "logits must be on a CPU or CUDA device, got meta"),
])
def test_route_argument_errors(args, error, match):
    with pytest.raises(error, match=match):
        route(*args)


def test_bias_errors():
    with pytest.raises(ValueError, match="score_bias"):
        route(torch.randn(3, 8), 2, RouterConfig(use_score_bias=True))
    with pytest.raises(ValueError, match=r"score_bias must be \[8\]"):
        route(torch.randn(3, 8), 2, RouterConfig(use_score_bias=True), torch.zeros(4))
    with pytest.raises(ValueError, match=r"logits must be \[T, E\]"):
        route(torch.randn(8), 2)
