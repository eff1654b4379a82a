"""Top-k routing: softmax or sigmoid scores, optional DeepSeek-V3 grouped top-k and score bias.

Semantics, per token, from router logits ``z`` [E] (float32):

1. ``s = softmax(z)`` or ``s = sigmoid(z)`` (``scoring_func``), in float32.
2. Choice scores ``c = s + bias`` when ``use_score_bias`` (DeepSeek-V3's
   ``e_score_correction_bias``), else ``c = s``. The bias only steers the choice.
3. Grouped top-k (``n_group`` set): the experts form ``n_group`` contiguous groups; a group's score
   is the sum of its two largest ``c`` (``group_score="top2_sum"``, DeepSeek-V3) or its largest
   (``"max"``, DeepSeek-V2's group-limited routing); the ``topk_group`` best groups are kept and the
   other experts' ``c`` become ``-inf``.
4. ``topk_idx`` = the ``top_k`` largest ``c`` (``torch.topk``, largest first).
5. ``topk_weights = s[topk_idx]`` (unbiased), divided by their sum (+1e-20) when
   ``norm_topk_prob``, times ``routed_scaling_factor``.

Mixtral is softmax + ``norm_topk_prob=True``; Qwen2-MoE softmax + ``norm_topk_prob=False``;
Qwen3-MoE softmax with its config's flag; DeepSeek-V3 sigmoid + bias + grouped top-k + scaling.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

import kernels

kScoringFuncs = ("softmax", "sigmoid")
kGroupScores = ("top2_sum", "max")


@dataclass
class RouterConfig:
    """How router logits become top-k expert ids and weights (module docstring).

    ``logits_dtype``: the dtype the router GEMM runs in. ``None`` means float32; set the model's
    dtype to reproduce models whose gate is an ``nn.Linear`` in that dtype (Mixtral, Qwen-MoE),
    since a different rounding of the logits can change which experts win.
    """

    scoring_func: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    use_score_bias: bool = False
    logits_dtype: torch.dtype | None = None
    group_score: str = "top2_sum"

    def validate(self, num_experts: int, top_k: int) -> None:
        """Raise ValueError (TypeError for a wrong type) when this config cannot route ``top_k`` of
        ``num_experts``."""
        if self.logits_dtype is not None and (not isinstance(self.logits_dtype, torch.dtype)
                                              or not self.logits_dtype.is_floating_point):
            raise TypeError(f"logits_dtype must be None or a floating torch.dtype, got {self.logits_dtype!r}")
        if self.logits_dtype is not None and self.logits_dtype.itemsize < 2:
            raise TypeError(f"logits_dtype must be None, float16, bfloat16, float32 or float64 (a router GEMM "
                            f"without scales), got {self.logits_dtype}")
        for name in ("norm_topk_prob", "use_score_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        scaling = self.routed_scaling_factor
        if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
            raise TypeError(f"routed_scaling_factor must be a number, got {scaling!r}")
        for name in ("n_group", "topk_group"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be None or an int, got {value!r}")
        if self.scoring_func not in kScoringFuncs:
            raise ValueError(f"scoring_func must be one of {kScoringFuncs}, got {self.scoring_func!r}")
        if self.group_score not in kGroupScores:
            raise ValueError(f"group_score must be one of {kGroupScores}, got {self.group_score!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError(f"n_group and topk_group go together, got n_group={self.n_group}, "
                             f"topk_group={self.topk_group}")
        if self.n_group is not None:
            if self.n_group <= 0 or num_experts % self.n_group != 0:
                raise ValueError(f"n_group must divide num_experts={num_experts}, got {self.n_group}")
            per_group = num_experts // self.n_group
            if per_group < 2 and self.group_score == "top2_sum":
                raise ValueError(f"grouped top-k scores a group by its two best experts: n_group={self.n_group} "
                                 f"leaves {per_group} expert per group")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
            if top_k > self.topk_group * per_group:
                raise ValueError(f"top_k={top_k} exceeds the {self.topk_group * per_group} experts of the "
                                 f"topk_group={self.topk_group} kept groups")
        if not 0 < self.routed_scaling_factor < math.inf:
            raise ValueError(f"routed_scaling_factor must be finite and > 0, got {self.routed_scaling_factor}")


@dataclass
class RoutingResult:
    """``topk_idx`` int64 [T, k] (global expert ids) and ``topk_weights`` float32 [T, k]."""

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """``x`` [T, H] @ ``weight`` [E, H]^T in ``config.logits_dtype`` (default float32) -> float32 [T, E]."""
    dtype = config.logits_dtype or torch.float32
    return torch.nn.functional.linear(x.to(dtype), weight.to(dtype)).float()


def route(logits: torch.Tensor, top_k: int, config: RouterConfig | None = None,
          score_bias: torch.Tensor | None = None) -> RoutingResult:
    """Route tokens from router logits [T, E] (any float dtype; computed in float32).

    ``score_bias`` float [E] (DeepSeek-V3's correction bias; needed iff ``config.use_score_bias``)
    only steers the choice. Returns ``RoutingResult(topk_idx int64 [T, top_k], topk_weights float32
    [T, top_k])``."""
    config = RouterConfig() if config is None else config
    if not isinstance(config, RouterConfig):
        raise TypeError(f"config must be None or a RouterConfig, got {type(config).__name__}")
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor [T, E], got "
                        f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    config.validate(num_experts, top_k)
    bias = None
    if config.use_score_bias:
        if score_bias is None:
            raise ValueError("RouterConfig.use_score_bias=True needs score_bias [E]")
        if not isinstance(score_bias, torch.Tensor):
            raise TypeError(f"score_bias must be a float tensor [{num_experts}], got {type(score_bias).__name__}")
        if tuple(score_bias.shape) != (num_experts,):
            raise ValueError(f"score_bias must be [{num_experts}], got {tuple(score_bias.shape)}")
        bias = score_bias
    # One launch on CUDA (kernels.moe_route), the torch code on the CPU.
    topk_idx, weights = kernels.moe_route(logits.float(), top_k, sigmoid=config.scoring_func == "sigmoid",
                                          n_group=config.n_group, topk_group=config.topk_group,
                                          group_score=config.group_score,
                                          norm=bool(config.norm_topk_prob), scaling=float(config.routed_scaling_factor),
                                          score_bias=bias)
    return RoutingResult(topk_idx, weights)
