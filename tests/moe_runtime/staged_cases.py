"""Shared cases of the staged backend's tests (test_staged.py) and its multi-rank worker
(staged_worker.py): the small layer's sizes, expert weights, the routers, and a layer of a backend
beside the reference layer on the same weights."""

from __future__ import annotations

import torch

from moe_runtime import MegaMoELayer, RouterConfig

H, I, E, S = 256, 128, 8, 128
kTolerance = 1e-3


def expert_weights(num_experts: int, hidden: int, inter: int, seed: int, device="cpu"):
    """bf16 gate_up [E, 2I, H] and down [E, H, I]; drawn in bf16 on ``device`` (a DeepSeek-V3 layer's
    float32 draw would need 45 GB)."""
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device, dtype=torch.bfloat16)
    down = torch.randn(num_experts, hidden, inter, generator=g, device=device, dtype=torch.bfloat16)
    return gate_up.mul_(hidden ** -0.5), down.mul_(inter ** -0.5)


ROUTERS = {
    "mixtral": (RouterConfig(), 2, False),
    "deepseek": (RouterConfig(scoring_func="sigmoid", n_group=4, topk_group=2, use_score_bias=True,
                              routed_scaling_factor=2.5), 3, True),
    # DeepSeek-V3's own routing: 256 experts in 8 groups, 4 groups per token, top-8.
    "deepseek-v3": (RouterConfig(scoring_func="sigmoid", n_group=8, topk_group=4, use_score_bias=True,
                                 routed_scaling_factor=2.5), 8, True),
}


def layer_pair(router: str, seed: int, device, hidden=H, inter=I, num_experts=E, skew=False, ep_group=None,
                reference_group=None, capacity=512, shared_inter=S, weights="fp8", backend="staged"):
    cfg, top_k, shared = ROUTERS[router]
    g = torch.Generator().manual_seed(seed)
    gate_up, down = expert_weights(num_experts, hidden, inter, seed, device)
    w = dict(router_weight=torch.randn(num_experts, hidden, generator=g), gate_up=gate_up, down=down)
    if cfg.use_score_bias:
        w["score_bias"] = torch.randn(num_experts, generator=g) * 0.05
        if skew:
            w["score_bias"][1] = 10.0  # expert 1 is in every token's top-k
    if shared:
        w["shared_gate_up"] = (torch.randn(2 * shared_inter, hidden, generator=g) / hidden ** 0.5).to(torch.bfloat16)
        w["shared_down"] = (torch.randn(hidden, shared_inter, generator=g) / shared_inter ** 0.5).to(torch.bfloat16)
    layers = []
    for name, group in ((backend, ep_group), ("reference", reference_group)):
        layer = MegaMoELayer(hidden, inter, num_experts, top_k, router=cfg, weights=weights, backend=name,
                             shared_intermediate_size=shared_inter if shared else 0, ep_group=group,
                             num_max_tokens_per_rank=capacity, device=device)
        layers.append(layer.load_weights(**w))
    return layers
