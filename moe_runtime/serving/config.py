"""Shapes and routing of the MoE layers that the server runs: presets and Hugging Face configs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class MoEModelConfig:
    """One MoE layer's shape and routing (every served layer has the same).

    ``intermediate_size``: per routed expert. ``shared_intermediate_size``: the shared expert(s)
    fused into one MLP (0: none). Routing fields mirror ``moe_runtime.RouterConfig``.
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    use_score_bias: bool = False
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # The gate's matmul precision ("bfloat16", "float16", "float32"); None: float32. Mixtral and
    # Qwen gates run in the model dtype, and near-tied top-k picks depend on it.
    router_logits_dtype: str | None = None
    # The transformers family whose checkpoint tensor names to read (moe_runtime.integrations.hf
    # kModelTypes); None: the DeepSeek / Qwen / Mixtral names.
    family: str | None = None
    # The model's decoder layers: checkpoint layers past them (DeepSeek-V3's multi-token-prediction
    # layer) are not served. None: all.
    num_hidden_layers: int | None = None
    group_score: str = "top2_sum"  # "max": DeepSeek-V2's group-limited routing (RouterConfig's)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEModelConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEModelConfig.top_k: {self.top_k} exceeds num_experts={self.num_experts}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEModelConfig.scoring_func: expected 'softmax' or 'sigmoid', got {self.scoring_func!r}")
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"MoEModelConfig.group_score: expected 'top2_sum' or 'max', got {self.group_score!r}")
        if self.router_logits_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"MoEModelConfig.router_logits_dtype: expected None, 'bfloat16', 'float16' or "
                             f"'float32', got {self.router_logits_dtype!r}")

    def router_config(self):
        """The ``moe_runtime.RouterConfig`` for these routing fields."""
        import torch

        from moe_runtime import RouterConfig
        logits_dtype = getattr(torch, self.router_logits_dtype) if self.router_logits_dtype else None
        return RouterConfig(scoring_func=self.scoring_func, norm_topk_prob=self.norm_topk_prob,
                            n_group=self.n_group, topk_group=self.topk_group,
                            routed_scaling_factor=self.routed_scaling_factor, use_score_bias=self.use_score_bias,
                            logits_dtype=logits_dtype, group_score=self.group_score)

    def with_overrides(self, **kwargs) -> "MoEModelConfig":
        return replace(self, **kwargs)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, MoEModelConfig] = {
    # Small enough that two CPU ranks finish the default run in seconds, but with every routing
    # feature of DeepSeek-V3 switched on so the default run exercises the whole layer.
    "small": MoEModelConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4,
                            scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            use_score_bias=True, shared_intermediate_size=128),
    "deepseek-v3": MoEModelConfig(hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8,
                                  scoring_func="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                  use_score_bias=True, shared_intermediate_size=2048),
}


def _first(cfg: dict, *keys, default=None):
    for key in keys:
        if key is not None and cfg.get(key) is not None:
            return cfg[key]
    return default


# Families whose MoE tensors the checkpoint reader does not know the names of yet (the in-memory
# models work through moe_runtime.integrations.replace_moe_blocks).
kCheckpointUnsupported = {
    "hunyuan_v1_moe": "its shared MLP and experts both follow intermediate_size, and its top-k may differ per layer",
    "mistral_large4": "its checkpoints keep Mistral's own tensor names (layers.N.experts.E.w1, no model. or mlp.)",
    "cohere2_moe": "its scoring and its shared expert's combination come from the config, which the serving "
                   "layer stack does not take yet",
    "hy_v3": "its checkpoints name the router router.gate and the bias and shared MLP otherwise than the modules",
    "bailing_hybrid": "its checkpoints keep the choice bias as gate.expert_bias",
    "laguna": "its checkpoints name the shared MLP shared_expert and hold no choice bias",
    "qwen3_omni_moe": "its checkpoints hold the talker's MoE layers beside the thinker's",
}


def config_from_hf(cfg: dict) -> MoEModelConfig:
    """MoE shape and routing from a transformers ``config.json`` dict.

    The family comes from ``model_type`` (``moe_runtime.integrations.hf.kModelTypes``: the same
    table that ``replace_moe_blocks`` reads blocks by; a DeepSeek-V3 architecture under another
    name is recognised by ``topk_method="noaux_tc"``); an unknown one raises NotImplementedError
    rather than guess the routing. Keys: experts from ``n_routed_experts`` / ``num_local_experts``
    / ``num_experts`` / ``moe_num_experts``; top-k from ``num_experts_per_tok`` /
    ``num_experts_per_token`` / ``moe_k``; shared experts as ``shared_expert_intermediate_size``
    (Qwen, with its sigmoid gate) or ``n_shared_experts`` / ``num_shared_experts`` /
    ``moe_num_shared_experts`` times the expert size.
    """
    from moe_runtime.integrations.hf import kModelTypes

    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
    model_type = cfg.get("model_type", "")
    fam = kModelTypes.get(model_type)
    if fam is None and cfg.get("topk_method") == "noaux_tc":
        fam = kModelTypes["deepseek_v3"]
    if fam is None:
        raise NotImplementedError(f"config.json: model_type={model_type!r} is not a supported MoE family; supported: "
                                  f"{sorted(kModelTypes)} (or any with topk_method='noaux_tc')")
    if fam.family in kCheckpointUnsupported:
        raise NotImplementedError(f"config.json: {model_type} checkpoints are not supported by the serving reader: "
                                  f"{kCheckpointUnsupported[fam.family]}")
    group_limited = fam.is_group_limited(_first(cfg, "topk_method", default="greedy"), "config.json")
    num_experts = _first(cfg, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
    if num_experts is None:
        raise ValueError(f"config.json (model_type={model_type!r}) names no experts: expected one of "
                         "n_routed_experts, num_local_experts, num_experts, moe_num_experts")
    intermediate = _first(cfg, fam.expert_size, "moe_intermediate_size", "intermediate_size")
    norm = fam.norm_topk_prob
    if norm is None:
        norm = bool(_first(cfg, "norm_topk_prob", "moe_renormalize", default=fam.norm_default))
    # No defaults guessed for what changes the routing (the config classes' defaults differ by family).
    grouped = fam.grouped or group_limited
    scaling_key = fam.scaling_key or fam.scaling
    required = ([("n_group", "num_expert_group"), ("topk_group",)] if grouped else []) + \
        ([(scaling_key,)] if scaling_key else [])
    for keys in required:
        if _first(cfg, *keys) is None:
            raise ValueError(f"config.json ({model_type}): {' or '.join(keys)} is missing; the routing needs it")
    n_group = _first(cfg, "n_group", "num_expert_group") if grouped else None
    topk_group = cfg.get("topk_group") if grouped else None
    scaling = float(cfg[scaling_key]) if scaling_key else 1.0
    # The shared MLP: one of its own width (Qwen, Laguna, Step-3.7), or n shared experts fused.
    shared = 0
    if fam.shared is not None:
        shared = _first(cfg, "shared_expert_intermediate_size", "share_expert_dim", default=0)
        if not shared and fam.shared_gate is None:
            per_expert = _first(cfg, "shared_experts_intermediate_size", default=intermediate)
            shared = per_expert * _first(cfg, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                                         default=0)
    # Gates that run in the model dtype round their logits in it; near-tied picks depend on that.
    dtype = _first(cfg, "torch_dtype", "dtype", default="bfloat16")
    gate_dtype = dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    return MoEModelConfig(hidden_size=cfg["hidden_size"], intermediate_size=intermediate, num_experts=num_experts,
                          top_k=_first(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_k", default=2),
                          scoring_func=fam.scoring_func, norm_topk_prob=norm, n_group=n_group, topk_group=topk_group,
                          routed_scaling_factor=scaling, use_score_bias=fam.score_bias is not None,
                          shared_intermediate_size=shared, shared_expert_gate=fam.shared_gate is not None and shared > 0,
                          router_logits_dtype=None if fam.float32_logits else gate_dtype, family=fam.family,
                          num_hidden_layers=cfg.get("num_hidden_layers"),
                          group_score="max" if group_limited else "top2_sum")


def load_hf_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: {directory} has no config.json")
    return json.loads(path.read_text())
