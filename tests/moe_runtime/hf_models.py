"""Tiny random transformers MoE models built from configs (no downloads), shared by the tests.

The MoE weights are re-drawn so that the MoE blocks matter: HF's 0.02 init would make their output
negligible next to the residual stream, and a wrong conversion could hide behind it.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from moe_runtime.integrations import find_moe_blocks

kCommon = dict(vocab_size=96, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, intermediate_size=192)
kFamilies = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# Expert weights at this fraction of unit scale make the MoE output a large part of the residual
# stream (dropping it moves the logits by calc_diff > 0.1) without letting it swamp everything, as
# in a trained model. DeepSeek-V3 multiplies its routed output by routed_scaling_factor.
kExpertScale = {"deepseek_v3": 0.25}
kDefaultExpertScale = 0.35


def tiny_config(family: str):
    if family == "mixtral":
        return transformers.MixtralConfig(**kCommon, num_local_experts=8, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**kCommon, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                           shared_expert_intermediate_size=96, norm_topk_prob=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**kCommon, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                           head_dim=32, norm_topk_prob=True)
    return transformers.DeepseekV3Config(**kCommon, moe_intermediate_size=64, n_routed_experts=16,
                                         num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
                                         routed_scaling_factor=2.5, first_k_dense_replace=0, kv_lora_rank=32,
                                         q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)


def randomize_moe(model: nn.Module, generator: torch.Generator, family: str = "") -> None:
    """Fresh random MoE weights (HF's 0.02 init would make the MoE output negligible)."""
    expert_scale = kExpertScale.get(family, kDefaultExpertScale)
    with torch.no_grad():
        for _, block in find_moe_blocks(model):
            for name, param in block.named_parameters():
                fan_in = param.shape[-1]
                scale = 2.0 if name == "gate.weight" else expert_scale
                param.copy_(torch.randn(param.shape, generator=generator) * scale / fan_in**0.5)
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=generator) * 0.1)


def tiny_model(family: str, dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family), dtype=dtype).eval()
    randomize_moe(model, torch.Generator().manual_seed(seed), family)
    return model
