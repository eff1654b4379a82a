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

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEModelConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEModelConfig.top_k: {self.top_k} exceeds num_experts={self.num_experts}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEModelConfig.scoring_func: expected 'softmax' or 'sigmoid', got {self.scoring_func!r}")
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
                            logits_dtype=logits_dtype)

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
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def config_from_hf(cfg: dict) -> MoEModelConfig:
    """MoE shape and routing from a transformers ``config.json`` dict.

    Understands Mixtral (``num_local_experts``, softmax, normalised top-k), Qwen2-MoE
    (``shared_expert_intermediate_size`` with a sigmoid shared-expert gate), Qwen3-MoE and
    DeepSeek-V3 (``n_routed_experts``, sigmoid scores with a correction bias, grouped top-k,
    ``routed_scaling_factor``, ``n_shared_experts`` x ``moe_intermediate_size``).
    """
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
    model_type = cfg.get("model_type", "")
    num_experts = _first(cfg, "n_routed_experts", "num_local_experts", "num_experts")
    if num_experts is None:
        raise ValueError(f"config.json (model_type={model_type!r}) names no experts: expected one of "
                         "n_routed_experts, num_local_experts, num_experts")
    intermediate = _first(cfg, "moe_intermediate_size", "intermediate_size")
    common = dict(hidden_size=cfg["hidden_size"], intermediate_size=intermediate, num_experts=num_experts,
                  top_k=_first(cfg, "num_experts_per_tok", default=2))
    if model_type.startswith("deepseek_v3") or cfg.get("topk_method") == "noaux_tc":
        return MoEModelConfig(**common, scoring_func=cfg.get("scoring_func", "sigmoid"),
                              norm_topk_prob=cfg.get("norm_topk_prob", True),
                              n_group=cfg.get("n_group"), topk_group=cfg.get("topk_group"),
                              routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                              use_score_bias=True,
                              shared_intermediate_size=intermediate * (cfg.get("n_shared_experts") or 0))
    # Mixtral and Qwen gates are nn.Linear layers in the model dtype.
    dtype = _first(cfg, "torch_dtype", "dtype", default="bfloat16")
    gate_dtype = dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    if model_type == "mixtral":
        return MoEModelConfig(**common, norm_topk_prob=True, router_logits_dtype=gate_dtype)
    shared = cfg.get("shared_expert_intermediate_size") or 0
    return MoEModelConfig(**common, norm_topk_prob=cfg.get("norm_topk_prob", False),
                          shared_intermediate_size=shared, shared_expert_gate=shared > 0,
                          router_logits_dtype=gate_dtype)


def load_hf_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: {directory} has no config.json")
    return json.loads(path.read_text())
