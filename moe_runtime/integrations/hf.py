"""Replace the sparse MoE blocks of Hugging Face transformers models with ``MegaMoELayer``.

Transformers 5 keeps the routed experts fused as ``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I]; transformers 4 kept one MLP per expert in an ``nn.ModuleList``;
both are understood. Each supported block class maps to a :class:`BlockFamily` that says where its
router's tensors are and which of ``RouterConfig``'s choices its routing makes (``kBlockFamilies``):

========================== ============================================================================
family (block classes)     routing / extras
========================== ============================================================================
mixtral                    softmax, top-k renormalised; v4 experts ``w1`` (gate) ``w3`` (up) ``w2``
qwen2_moe, qwen3_next      softmax, ``norm_topk_prob``; ``shared_expert`` scaled by
                           ``sigmoid(shared_expert_gate(x))``
qwen3_5_moe                as qwen3_next, always renormalised
qwen3_moe, olmoe,          softmax, ``norm_topk_prob``
flex_olmo
qwen3_vl_moe               softmax, always renormalised
deepseek_v3, glm4_moe,     sigmoid + ``gate.e_score_correction_bias``, grouped top-k (``n_group``,
glm4_moe_lite, dots1,      ``topk_group``), ``norm_topk_prob``, ``routed_scaling_factor``, float32 logits;
deepseek_v32, kimi_linear, ``shared_experts``
exaone_moe, solar_open
deepseek_v2                softmax, never renormalised, ``routed_scaling_factor``, float32 logits;
                           ``shared_experts``; ``topk_method`` "greedy" or "group_limited_greedy"
                           (groups ranked by their best score)
mistral_large4             softmax, grouped top-k, always renormalised, ``routed_scaling_factor``, float32
                           logits; ``shared_experts``
minimax_m2                 sigmoid + the block's ``e_score_correction_bias``, always renormalised
ernie4_5_moe               softmax + ``gate.moe_statics.e_score_correction_bias``, always renormalised,
                           float32 logits; ``shared_experts``
hunyuan_v1_moe             softmax of ``gate.wg``, always renormalised; ``shared_mlp``
afmoe                      sigmoid of ``router.gate`` + the block's ``expert_bias``, always renormalised,
                           ``router.route_scale``; ``shared_experts``
mistral4                   softmax, grouped top-k, ``norm_topk_prob``, ``routed_scaling_factor``;
                           ``shared_experts``
lfm2_moe                   sigmoid + the block's ``expert_bias`` (if any), ``norm_topk_prob`` (+1e-6 in
                           transformers, 1e-20 here), ``routed_scaling_factor``
glm_moe_dsa, glm4v_moe,    as deepseek_v3 (the same router, experts and block; mimo_v2_flash and beam
mimo_v2_flash,             without shared experts, beam's scaling on the block)
bailing_hybrid, dots3_note,
beam
qwen3_omni_moe (thinker),  as qwen3_moe (norm_topk_prob defaulting to True); qwen4_exp as qwen3_next
mellum, qwen4_exp
lara_mini                  softmax, ``norm_topk_prob`` (default True), float32 logits; ``shared_expert``
hy_v3                      sigmoid + the block's ``e_score_correction_bias``, always renormalised,
                           ``router_scaling_factor``, float32 logits; ``shared_experts``
laguna, step3p7            sigmoid + ``gate.e_score_correction_bias``, always renormalised, the block's
                           ``routed_scaling_factor``; ``shared_experts`` (a router logit softcap or a
                           clamped SwiGLU, which Step-3.7 sets on some layers, raises)
cohere2_moe                ``expert_selection_fn``: softmax of the top-k logits (renormalised) or sigmoid
                           with ``norm_topk_prob``; ``shared_experts``, their output and the routed one
                           halved under ``shared_expert_combination_strategy="average"``
========================== ============================================================================

Mistral4's and LFM2-MoE's gates also round their scores (softmax, sigmoid) to the model dtype;
here the scores stay float32, so in a bfloat16 model a near-tie may pick another expert than
transformers does (as any float32 recomputation would).

Logits run in float32 where the family's gate casts to it, else in the router weight's dtype, so
that near-ties pick the same experts. Experts must be SwiGLU without biases; anything else raises
``NotImplementedError``. The replacement returns what the original block returned: a tensor in
transformers 5, the ``(hidden_states, router_logits)`` tuple of the transformers 4 Mixtral / Qwen
blocks (found by running the original block once on one token before replacing it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from moe_runtime.layer import MoEBlockWeights


@dataclass(frozen=True)
class BlockFamily:
    """Where one transformers block class keeps its router and what its routing does.

    Paths are dotted attribute names from the block. ``norm_topk_prob``: fixed, or None to read the
    ``norm_topk_prob`` flag (router, block, config; ``norm_default`` without one)."""

    family: str
    scoring_func: str = "softmax"
    router: str = "gate"                    # the router module (top_k, n_group, ... live there)
    router_weight: str = "gate.weight"      # [E, H]
    score_bias: str | None = None           # the choice bias [E] (or [1, E])
    norm_topk_prob: bool | None = None
    norm_default: bool = False
    grouped: bool = False                   # DeepSeek-V3's grouped top-k (n_group, topk_group)
    scaling: str | None = None              # name of the routed scaling factor (router, block, config)
    float32_logits: bool = False            # else the router weight's dtype
    shared: str | None = None               # the shared-expert MLP (gate_proj, up_proj, down_proj)
    shared_gate: str | None = None          # its sigmoid gate, Linear(H, 1)
    expert_size: str = "moe_intermediate_size"  # config.json's key of a routed expert's I
    # Cohere2-MoE: the scoring named by the router's expert_selection_fn (its softmax runs over the
    # top-k logits: renormalised), and shared_expert_combination_strategy="average", which halves
    # the routed and the shared output.
    scoring_attr: str | None = None
    average_attr: str | None = None
    # DeepSeek-V2: topk_method="group_limited_greedy" keeps the topk_group groups of the best single
    # scores (RouterConfig group_score="max"); "greedy" is plain top-k.
    group_limited: bool = False
    scaling_key: str | None = None          # config.json's name of the scaling factor, where not ``scaling``

    def is_group_limited(self, topk_method: str, where: str) -> bool:
        """Whether ``topk_method`` asks for group-limited routing; raises NotImplementedError for a
        method this family does not have (DeepSeek-V3's configs name theirs "noaux_tc": the bias,
        which the family reads)."""
        group_limited = self.group_limited and topk_method == "group_limited_greedy"
        if topk_method not in ("greedy", "noaux_tc") and not group_limited:
            raise NotImplementedError(f"{where}: topk_method={topk_method!r} is not supported for {self.family}")
        return group_limited


_QWEN2 = BlockFamily("qwen2_moe", shared="shared_expert", shared_gate="shared_expert_gate")
_QWEN3 = BlockFamily("qwen3_moe")
_OLMOE = BlockFamily("olmoe", expert_size="intermediate_size")
_DEEPSEEK_V3 = BlockFamily("deepseek_v3", "sigmoid", score_bias="gate.e_score_correction_bias", norm_default=True,
                           grouped=True, scaling="routed_scaling_factor", float32_logits=True, shared="shared_experts")

kBlockFamilies: dict[str, BlockFamily] = {
    "MixtralSparseMoeBlock": BlockFamily("mixtral", norm_topk_prob=True, expert_size="intermediate_size"),
    "Qwen2MoeSparseMoeBlock": _QWEN2,
    "Qwen3NextSparseMoeBlock": replace(_QWEN2, family="qwen3_next", norm_default=True),
    "Qwen3_5MoeSparseMoeBlock": replace(_QWEN2, family="qwen3_5_moe", norm_topk_prob=True),
    "Qwen3MoeSparseMoeBlock": _QWEN3,
    "Qwen3VLMoeTextSparseMoeBlock": replace(_QWEN3, family="qwen3_vl_moe", norm_topk_prob=True),
    "OlmoeSparseMoeBlock": _OLMOE,
    "FlexOlmoSparseMoeBlock": replace(_OLMOE, family="flex_olmo"),
    "DeepseekV3MoE": _DEEPSEEK_V3,
    "Glm4MoeMoE": replace(_DEEPSEEK_V3, family="glm4_moe"),
    "Glm4MoeLiteMoE": replace(_DEEPSEEK_V3, family="glm4_moe_lite"),
    "Dots1MoE": replace(_DEEPSEEK_V3, family="dots1", norm_default=False),
    "DeepseekV32MoE": replace(_DEEPSEEK_V3, family="deepseek_v32"),
    "KimiLinearMoE": replace(_DEEPSEEK_V3, family="kimi_linear"),
    "ExaoneMoeSparseMoEBlock": replace(_DEEPSEEK_V3, family="exaone_moe"),
    "SolarOpenMoE": replace(_DEEPSEEK_V3, family="solar_open"),
    "GlmMoeDsaMoE": replace(_DEEPSEEK_V3, family="glm_moe_dsa"),
    "Glm4vMoeTextMoE": replace(_DEEPSEEK_V3, family="glm4v_moe"),
    "MiMoV2FlashMoE": replace(_DEEPSEEK_V3, family="mimo_v2_flash"),
    "BailingHybridMoE": replace(_DEEPSEEK_V3, family="bailing_hybrid"),
    "Dots3NoteTextMoE": replace(_DEEPSEEK_V3, family="dots3_note"),
    "BeamMoE": replace(_DEEPSEEK_V3, family="beam"),  # its scaling sits on the block: same routing
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": replace(_QWEN3, family="qwen3_omni_moe", norm_default=True),
    "Qwen4ExpTextSparseMoeBlock": replace(_QWEN2, family="qwen4_exp", norm_default=True),
    "MellumSparseMoeBlock": replace(_QWEN3, family="mellum", norm_default=True),
    "LaraMiniSparseMoeBlock": BlockFamily("lara_mini", norm_default=True, float32_logits=True, shared="shared_expert"),
    "HYV3MoE": BlockFamily("hy_v3", "sigmoid", score_bias="e_score_correction_bias", norm_topk_prob=True,
                           scaling="router_scaling_factor", float32_logits=True, shared="shared_experts"),
    "LagunaSparseMoeBlock": BlockFamily("laguna", "sigmoid", score_bias="gate.e_score_correction_bias",
                                        norm_topk_prob=True, scaling="routed_scaling_factor", shared="shared_experts",
                                        scaling_key="moe_routed_scaling_factor"),
    "Step3p7SparseMoeBlock": BlockFamily("step3p7", "sigmoid", score_bias="gate.e_score_correction_bias",
                                         norm_topk_prob=True, scaling="routed_scaling_factor", shared="shared_experts",
                                         scaling_key="moe_router_scaling_factor"),
    "DeepseekV2Moe": BlockFamily("deepseek_v2", norm_topk_prob=False, scaling="routed_scaling_factor",
                                 float32_logits=True, shared="shared_experts", group_limited=True),
    "MistralLarge4TextMoE": BlockFamily("mistral_large4", norm_topk_prob=True, grouped=True,
                                        scaling="routed_scaling_factor", float32_logits=True, shared="shared_experts"),
    "MiniMaxM2SparseMoeBlock": BlockFamily("minimax_m2", "sigmoid", score_bias="e_score_correction_bias",
                                           norm_topk_prob=True, expert_size="intermediate_size"),
    "Ernie4_5_MoeSparseMoeBlock": BlockFamily("ernie4_5_moe", score_bias="gate.moe_statics.e_score_correction_bias",
                                              norm_topk_prob=True, float32_logits=True, shared="shared_experts"),
    "HunYuanMoEV1Moe": BlockFamily("hunyuan_v1_moe", router_weight="gate.wg.weight", norm_topk_prob=True,
                                   shared="shared_mlp", expert_size="intermediate_size"),
    "Mistral4MoE": BlockFamily("mistral4", grouped=True, scaling="routed_scaling_factor", shared="shared_experts"),
    "Lfm2MoeSparseMoeBlock": BlockFamily("lfm2_moe", "sigmoid", score_bias="expert_bias",
                                         scaling="routed_scaling_factor"),
    "Cohere2MoeSparseMoeBlock": BlockFamily("cohere2_moe", shared="shared_experts", expert_size="intermediate_size",
                                            norm_default=True, scoring_attr="expert_selection_fn",
                                            average_attr="shared_expert_combination_strategy"),
    "AfmoeSparseMoeBlock": BlockFamily("afmoe", "sigmoid", router="router", router_weight="router.gate.weight",
                                       score_bias="expert_bias", norm_topk_prob=True, scaling="route_scale",
                                       shared="shared_experts"),
}
# config.json's model_type -> the family of its MoE blocks (the serving path reads checkpoints by it).
kModelTypes: dict[str, BlockFamily] = {
    **{fam.family: fam for fam in kBlockFamilies.values()},
    "qwen3_5_moe_text": kBlockFamilies["Qwen3_5MoeSparseMoeBlock"],
    "qwen3_vl_moe_text": kBlockFamilies["Qwen3VLMoeTextSparseMoeBlock"],
    "mistral_large4_text": kBlockFamilies["MistralLarge4TextMoE"],
    "glm4v_moe_text": kBlockFamilies["Glm4vMoeTextMoE"],
    "dots3_note_text": kBlockFamilies["Dots3NoteTextMoE"],
    "qwen4_exp_text": kBlockFamilies["Qwen4ExpTextSparseMoeBlock"],
    "qwen3_omni_moe_text": kBlockFamilies["Qwen3OmniMoeThinkerTextSparseMoeBlock"],
    "step3p5": kBlockFamilies["Step3p7SparseMoeBlock"],
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
    float32_logits: bool = False
    group_score: str = "top2_sum"


def _attr(name: str, *sources, default=None):
    for source in sources:
        value = getattr(source, name, None)
        if value is not None:
            return value
    return default


def _path(module: nn.Module, dotted: str | None):
    """The attribute at ``dotted`` (a.b.c) below ``module``, or None where a step is missing."""
    if dotted is None:
        return None
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _family(block: nn.Module) -> BlockFamily:
    cls = type(block).__name__
    family = kBlockFamilies.get(cls)
    if family is None:
        raise NotImplementedError(f"block: {cls} is not a supported MoE block; supported: {sorted(kBlockFamilies)}")
    return family


def _check_silu(act, where: str) -> None:
    probe = torch.tensor([-2.0, -0.5, 0.25, 3.0])
    if act is None or not torch.allclose(act(probe), F.silu(probe), atol=1e-6):
        raise NotImplementedError(f"{where}: MegaMoELayer computes SwiGLU (silu(gate) * up); this block's "
                                  f"activation {act!r} is not silu")


def _check_unclamped(mlp: nn.Module, where: str) -> None:
    """SwiGLU clamped to a finite limit (Step-3.7's swiglu_limits, on some layers) is not the layer's."""
    limit = getattr(mlp, "limit", None)
    if limit is not None and torch.isfinite(torch.as_tensor(limit, dtype=torch.float64)).any():
        raise NotImplementedError(f"{where}: a SwiGLU clamped at {limit} is not supported by MegaMoELayer")


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
    fam = _family(block)
    router, experts = _path(block, fam.router), block.experts
    num_experts, hidden, inter = _expert_shapes(experts, cls)
    act = getattr(experts, "act_fn", None) if not isinstance(experts, nn.ModuleList) else experts[0].act_fn
    _check_silu(act, cls)
    _check_unclamped(experts, cls)
    top_k = _attr("top_k", router, block, _ConfigView(config), default=None)
    if top_k is None:
        raise ValueError(f"{cls}: cannot find top_k on the router, the block or the config")
    group_limited = fam.is_group_limited(_attr("topk_method", router, config, default="greedy"), cls)
    softcap = getattr(router, "router_logit_softcapping", None)
    if softcap is not None and softcap > 0:
        raise NotImplementedError(f"{cls}: router logits soft-capped at {softcap} (tanh) are not supported")
    shared = _path(block, fam.shared)
    shared_inter = 0
    if shared is not None:
        _check_shared(shared, cls)
        _check_unclamped(shared, f"{cls} shared expert")
        shared_inter = shared.gate_proj.weight.shape[0]
    scoring = fam.scoring_func
    if fam.scoring_attr is not None:
        scoring = _attr(fam.scoring_attr, router, block, config, default=fam.scoring_func)
        if scoring not in ("softmax", "sigmoid"):
            raise NotImplementedError(f"{cls}: {fam.scoring_attr}={scoring!r} is not supported")
    norm = fam.norm_topk_prob
    if norm is None:
        norm = bool(_attr("norm_topk_prob", router, block, config, default=fam.norm_default))
    if fam.scoring_attr is not None and scoring == "softmax":
        norm = True  # the softmax runs over the top-k logits
    n_group = topk_group = None
    if fam.grouped or group_limited:
        n_group = _attr("num_group", router) or _attr("n_group", router, config)
        topk_group = _attr("topk_group", router, config)
    scaling = 1.0 if fam.scaling is None else float(_attr(fam.scaling, router, block, config, default=1.0))
    if _averaged(block, fam, config):
        scaling *= 0.5
    return MoEBlockSpec(family=fam.family, hidden_size=hidden, intermediate_size=inter, num_experts=num_experts,
                        top_k=int(top_k), scoring_func=scoring, norm_topk_prob=norm, n_group=n_group,
                        topk_group=topk_group, routed_scaling_factor=scaling,
                        use_score_bias=_path(block, fam.score_bias) is not None,
                        shared_intermediate_size=shared_inter,
                        shared_expert_gate=_path(block, fam.shared_gate) is not None,
                        float32_logits=fam.float32_logits, group_score="max" if group_limited else "top2_sum")


def _averaged(block: nn.Module, fam: BlockFamily, config=None) -> bool:
    """Whether the block averages its routed and shared outputs (Cohere2-MoE's "average")."""
    if fam.average_attr is None or _path(block, fam.shared) is None:
        return False
    strategy = _attr(fam.average_attr, block, config, default="sum")
    if strategy not in ("sum", "average"):
        raise NotImplementedError(f"{type(block).__name__}: {fam.average_attr}={strategy!r} is not supported")
    return strategy == "average"


class _ConfigView:
    """Exposes ``config.num_experts_per_tok`` as ``top_k`` for ``_attr``."""

    def __init__(self, config):
        self.top_k = getattr(config, "num_experts_per_tok", None) if config is not None else None


def _check_shared(mlp: nn.Module, where: str) -> None:
    projections = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) for p in projections):
        raise NotImplementedError(f"{where}: shared expert {type(mlp).__name__} has no gate_proj / up_proj / "
                                  "down_proj Linear layers")
    if any(p.bias is not None for p in projections):
        raise NotImplementedError(f"{where}: shared expert projections with biases are not supported by "
                                  "MegaMoELayer")
    _check_silu(getattr(mlp, "act_fn", None), f"{where} shared expert")


def _shared_mlp(block: nn.Module, fam: BlockFamily) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Shared expert(s) as (gate_up [2Is, H], down [H, Is]), or None."""
    mlp = _path(block, fam.shared)
    if mlp is None:
        return None
    gate, up, down = (getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj"))
    return torch.cat([gate, up], dim=0), down


def _detach(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().contiguous()


def read_block_weights(block: nn.Module, experts: range) -> MoEBlockWeights:
    """The tensors of a supported block, routed experts restricted to ``experts``."""
    cls = type(block).__name__
    fam = _family(block)
    module = block.experts
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
    shared = _shared_mlp(block, fam)
    if shared is not None and _averaged(block, fam):
        shared = (shared[0], shared[1] * 0.5)  # a power of two: exact in every dtype
    shared_gate = _path(block, fam.shared_gate)
    bias = _path(block, fam.score_bias)
    return MoEBlockWeights(
        router_weight=_detach(_path(block, fam.router_weight)), gate_up=_detach(gate_up), down=_detach(down),
        score_bias=None if bias is None else _detach(bias.reshape(-1)),
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
        return isinstance(block.experts, nn.ModuleList) and _family(block).family in ("mixtral", "qwen2_moe", "qwen3_moe")
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
                          use_score_bias=spec.use_score_bias, group_score=spec.group_score,
                          logits_dtype=None if spec.float32_logits else tensors.router_weight.dtype)
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
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
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
