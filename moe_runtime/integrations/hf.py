"""Replace the sparse MoE blocks of Hugging Face transformers models with ``MegaMoELayer``.

Supported block classes and how they are read (transformers 5 keeps the routed experts fused as
``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]; transformers 4 kept one
MLP per expert in an ``nn.ModuleList``; both are understood):

===================== ========== ====================================================================
class                 family     routing / extras
===================== ========== ====================================================================
MixtralSparseMoeBlock mixtral    softmax, top-k renormalised; v4 experts ``w1`` (gate) ``w3`` (up) ``w2``
Qwen2MoeSparseMoeBlock qwen2_moe softmax, ``norm_topk_prob``; ``shared_expert`` MLP scaled by
                                 ``sigmoid(shared_expert_gate(x))``
Qwen3MoeSparseMoeBlock qwen3_moe softmax, ``norm_topk_prob``
DeepseekV3MoE         deepseek_v3 sigmoid + ``e_score_correction_bias``, grouped top-k (``n_group``,
                                 ``topk_group``), ``norm_topk_prob``, ``routed_scaling_factor``;
                                 ``shared_experts`` MLP
===================== ========== ====================================================================

The replacement returns what the original block returned: a tensor in transformers 5, the
``(hidden_states, router_logits)`` tuple of the transformers 4 Mixtral / Qwen blocks (found by
running the original block once on one token before replacing it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_runtime.layer import MoEBlockWeights

kBlockFamilies = {
    "MixtralSparseMoeBlock": "mixtral",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "DeepseekV3MoE": "deepseek_v3",
}
# Per-expert MLP projections of transformers 4: (gate, up, down).
kPerExpertNames = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class MoEBlockSpec:
    """Shape and routing read from one transformers MoE block."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    scoring_func: str
    norm_topk_prob: bool
    n_group: int | None
    topk_group: int | None
    routed_scaling_factor: float
    use_score_bias: bool
    shared_intermediate_size: int
    shared_expert_gate: bool


def _attr(name: str, *sources, default=None):
    for source in sources:
        value = getattr(source, name, None)
        if value is not None:
            return value
    return default


def _check_silu(act, where: str) -> None:
    probe = torch.tensor([-2.0, -0.5, 0.25, 3.0])
    if act is None or not torch.allclose(act(probe), F.silu(probe), atol=1e-6):
        raise NotImplementedError(f"{where}: MegaMoELayer computes SwiGLU (silu(gate) * up); this block's "
                                  f"activation {act!r} is not silu")


def _per_expert_names(expert: nn.Module, where: str) -> tuple[str, str, str]:
    for names in kPerExpertNames:
        if all(isinstance(getattr(expert, n, None), nn.Linear) for n in names):
            return names
    raise NotImplementedError(f"{where}: expert MLP {type(expert).__name__} has none of the known projection "
                              f"layouts {kPerExpertNames}")


def _expert_shapes(experts: nn.Module, where: str) -> tuple[int, int, int]:
    """(num_experts, hidden, intermediate) of fused (transformers 5) or per-expert (4) experts."""
    if isinstance(experts, nn.ModuleList):
        gate_name, _, _ = _per_expert_names(experts[0], where)
        inter, hidden = getattr(experts[0], gate_name).weight.shape
        return len(experts), hidden, inter
    gate_up = getattr(experts, "gate_up_proj", None)
    if gate_up is None or gate_up.dim() != 3:
        raise NotImplementedError(f"{where}: experts module {type(experts).__name__} has no fused gate_up_proj "
                                  "[E, 2I, H] and is not an nn.ModuleList of per-expert MLPs")
    if getattr(experts, "has_bias", False):
        raise NotImplementedError(f"{where}: experts with projection biases are not supported by MegaMoELayer")
    if getattr(experts, "is_concatenated", True) is False:
        raise NotImplementedError(f"{where}: interleaved gate/up experts (is_concatenated=False) are not supported")
    num, rows, cols = gate_up.shape
    if getattr(experts, "is_transposed", False):
        rows, cols = cols, rows
    return num, cols, rows // 2


def read_block_spec(block: nn.Module, config=None) -> MoEBlockSpec:
    """Shape and routing of a supported transformers MoE block.

    ``config``: the model's (text) config, consulted for fields a block does not carry itself.
    """
    cls = type(block).__name__
    family = kBlockFamilies.get(cls)
    if family is None:
        raise NotImplementedError(f"block: {cls} is not a supported MoE block; supported: {sorted(kBlockFamilies)}")
    gate, experts = block.gate, block.experts
    num_experts, hidden, inter = _expert_shapes(experts, cls)
    act = getattr(experts, "act_fn", None) if not isinstance(experts, nn.ModuleList) else experts[0].act_fn
    _check_silu(act, cls)
    top_k = _attr("top_k", gate, block, _ConfigView(config), default=None)
    if top_k is None:
        raise ValueError(f"{cls}: cannot find top_k on the router, the block or the config")
    shared = _shared_module(block)
    shared_inter = 0 if shared is None else shared.gate_proj.weight.shape[0]
    routing = dict(scoring_func="softmax", norm_topk_prob=True, n_group=None, topk_group=None,
                   routed_scaling_factor=1.0, use_score_bias=False)
    if family in ("qwen2_moe", "qwen3_moe"):
        routing["norm_topk_prob"] = bool(_attr("norm_topk_prob", gate, block, config, default=False))
    elif family == "deepseek_v3":
        routing.update(
            scoring_func="sigmoid",
            norm_topk_prob=bool(_attr("norm_topk_prob", gate, config, default=True)),
            n_group=_attr("num_group", gate, default=None) or _attr("n_group", gate, config),
            topk_group=_attr("topk_group", gate, config),
            routed_scaling_factor=float(_attr("routed_scaling_factor", gate, config, default=1.0)),
            use_score_bias=getattr(gate, "e_score_correction_bias", None) is not None,
        )
    return MoEBlockSpec(family=family, hidden_size=hidden, intermediate_size=inter, num_experts=num_experts,
                        top_k=int(top_k), shared_intermediate_size=shared_inter,
                        shared_expert_gate=getattr(block, "shared_expert_gate", None) is not None, **routing)


class _ConfigView:
    """Exposes ``config.num_experts_per_tok`` as ``top_k`` for ``_attr``."""

    def __init__(self, config):
        self.top_k = getattr(config, "num_experts_per_tok", None) if config is not None else None


def _shared_module(block: nn.Module) -> nn.Module | None:
    """The shared expert MLP (DeepSeek-V3 ``shared_experts``, Qwen2-MoE ``shared_expert``), or None."""
    return _attr("shared_experts", block) or _attr("shared_expert", block)


def _shared_mlp(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Shared expert(s) as (gate_up [2Is, H], down [H, Is]), or None."""
    mlp = _shared_module(block)
    if mlp is None:
        return None
    gate, up, down = (getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj"))
    return torch.cat([gate, up], dim=0), down


def _detach(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().contiguous()


def read_block_weights(block: nn.Module, experts: range) -> MoEBlockWeights:
    """The tensors of a supported block, routed experts restricted to ``experts``."""
    cls = type(block).__name__
    gate, module = block.gate, block.experts
    if isinstance(module, nn.ModuleList):
        gate_name, up_name, down_name = _per_expert_names(module[0], cls)
        gate_up = torch.stack([torch.cat([getattr(module[e], gate_name).weight, getattr(module[e], up_name).weight])
                               for e in experts])
        down = torch.stack([getattr(module[e], down_name).weight for e in experts])
    else:
        gate_up = module.gate_up_proj[experts.start:experts.stop]
        down = module.down_proj[experts.start:experts.stop]
        if getattr(module, "is_transposed", False):
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    shared = _shared_mlp(block)
    shared_gate = getattr(block, "shared_expert_gate", None)
    bias = getattr(gate, "e_score_correction_bias", None)
    return MoEBlockWeights(
        router_weight=_detach(gate.weight), gate_up=_detach(gate_up), down=_detach(down), score_bias=_detach(bias),
        shared_gate_up=None if shared is None else _detach(shared[0]),
        shared_down=None if shared is None else _detach(shared[1]),
        shared_gate=None if shared_gate is None else _detach(shared_gate.weight))


class MegaMoEBlock(nn.Module):
    """A transformers MoE block re-implemented by ``MegaMoELayer``.

    ``forward(hidden_states [B, S, H]) -> [B, S, H]`` in the input dtype, or the
    ``(hidden_states, router_logits [B*S, E])`` tuple when the replaced block returned one.
    Without an expert-parallel group, more tokens than the layer's capacity are run in chunks;
    with one, chunk counts would differ between ranks, so the layer's capacity error stands.
    """

    def __init__(self, layer: nn.Module, spec: MoEBlockSpec, *, router_weight: torch.Tensor | None,
                 capacity: int, chunked: bool):
        super().__init__()
        self.moe = layer
        self.spec = spec
        self.capacity = capacity
        self.chunked = chunked
        self.returns_router_logits = router_weight is not None
        if router_weight is not None:
            self.register_buffer("router_weight", router_weight.detach().clone(), persistent=False)

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        if self.chunked and flat.shape[0] > self.capacity:
            out = torch.cat([self.moe(chunk) for chunk in flat.split(self.capacity)])
        else:
            out = self.moe(flat)
        out = out.reshape(shape)
        if self.returns_router_logits:
            return out, F.linear(flat, self.router_weight.to(flat.dtype))
        return out

    def extra_repr(self) -> str:
        return f"family={self.spec.family}, returns_router_logits={self.returns_router_logits}"


def _returns_tuple(block: nn.Module, hidden: int, device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "meta":
        return isinstance(block.experts, nn.ModuleList) and kBlockFamilies[type(block).__name__] != "deepseek_v3"
    probe = torch.randn(1, 1, hidden, device=device, dtype=dtype)
    with torch.no_grad():
        return isinstance(block(probe), tuple)


def convert_block(block: nn.Module, *, config=None, backend: str = "auto", weights: str = "fp8",
                  ep_group=None, num_max_tokens_per_rank: int = 4096) -> MegaMoEBlock:
    """One supported transformers MoE block -> ``MegaMoEBlock`` with converted weights."""
    from moe_runtime import MegaMoELayer, RouterConfig
    from moe_runtime.dist import expert_placement, group_rank, group_size

    spec = read_block_spec(block, config)
    reference = block.experts.gate_up_proj if not isinstance(block.experts, nn.ModuleList) else \
        next(block.experts.parameters())
    device, dtype = reference.device, reference.dtype
    if device.type == "meta":
        raise ValueError(f"{type(block).__name__}: weights are on the meta device; load the model's weights "
                         "before replace_moe_blocks")
    placement = expert_placement(spec.num_experts, group_size(ep_group), group_rank(ep_group))
    tensors = read_block_weights(block, placement.local_experts)
    returns_tuple = _returns_tuple(block, spec.hidden_size, device, dtype)
    # Mixtral's and Qwen's gates run in the model dtype, DeepSeek-V3's in float32: the logits must
    # round the same way or near-ties pick different experts.
    router = RouterConfig(scoring_func=spec.scoring_func, norm_topk_prob=spec.norm_topk_prob, n_group=spec.n_group,
                          topk_group=spec.topk_group, routed_scaling_factor=spec.routed_scaling_factor,
                          use_score_bias=spec.use_score_bias,
                          logits_dtype=None if spec.family == "deepseek_v3" else block.gate.weight.dtype)
    layer = MegaMoELayer(spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k, router=router,
                         shared_intermediate_size=spec.shared_intermediate_size,
                         shared_expert_gate=spec.shared_expert_gate, weights=weights, backend=backend,
                         ep_group=ep_group, num_max_tokens_per_rank=num_max_tokens_per_rank, dtype=dtype,
                         device=device)
    layer.load_weights(**tensors.load_kwargs())
    return MegaMoEBlock(layer, spec, router_weight=tensors.router_weight if returns_tuple else None,
                        capacity=num_max_tokens_per_rank, chunked=ep_group is None)


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every supported MoE block in ``model``, outermost first."""
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ in kBlockFamilies]


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def replace_moe_blocks(model: nn.Module, backend: str = "auto", weights: str = "fp8", ep_group=None, *,
                       num_max_tokens_per_rank: int = 4096) -> nn.Module:
    """Replace every supported sparse MoE block of ``model`` (in place) and return ``model``.

    ``backend`` and ``weights`` are ``MegaMoELayer``'s. With ``ep_group`` each rank keeps only its
    experts (contiguous placement, ``moe_runtime.dist.expert_placement``) and every forward of the
    model becomes a collective over the group. Raises ValueError when the model has no supported
    block, naming the MoE-looking classes it did find.
    """
    blocks = find_moe_blocks(model)
    if not blocks:
        lookalikes = sorted({type(m).__name__ for _, m in model.named_modules()
                             if hasattr(m, "experts") and hasattr(m, "gate")})
        raise ValueError(f"model: {type(model).__name__} has no supported MoE block (supported: "
                         f"{sorted(kBlockFamilies)}; MoE-like classes found: {lookalikes or 'none'})")
    config = _text_config(model)
    for name, block in blocks:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replacement = convert_block(block, config=config, backend=backend, weights=weights, ep_group=ep_group,
                                    num_max_tokens_per_rank=num_max_tokens_per_rank)
        setattr(parent, child, replacement)
    return model
