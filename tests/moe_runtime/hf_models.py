"""Tiny random transformers MoE models built from configs (no downloads), shared by the tests.

The MoE weights are re-drawn so that the MoE blocks matter: HF's 0.02 init would make their output
negligible next to the residual stream, and a wrong conversion could hide behind it.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moe_runtime.integrations import find_moe_blocks
from moe_runtime.integrations.hf import kBlockFamilies

kCommon = dict(vocab_size=96, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, intermediate_size=192)
# Multi-head latent attention of the DeepSeek-V2/V3 descendants.
kLatent = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
               v_head_dim=32)
# Grouped sigmoid routing with a correction bias, as DeepSeek-V3 (16 experts, top 4 of 2 of 4 groups).
kGrouped = dict(num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5)
# Linear-attention layers of the hybrid models, kept small.
kLinear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               layer_types=["linear_attention", "full_attention"])


def _config(model_type: str, **kwargs):
    # The GPU machine's transformers is older than CI's: a family it lacks is skipped there.
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def _without(name: str) -> dict:
    return {k: v for k, v in kCommon.items() if k != name}


kConfigs = {
    "mixtral": lambda: transformers.MixtralConfig(**kCommon, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**kCommon, moe_intermediate_size=64, num_experts=8,
                                                     num_experts_per_tok=2, shared_expert_intermediate_size=96,
                                                     norm_topk_prob=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**kCommon, moe_intermediate_size=64, num_experts=8,
                                                     num_experts_per_tok=2, head_dim=32, norm_topk_prob=True),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**kCommon, moe_intermediate_size=64, n_routed_experts=16,
                                                         n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=32,
                                                         q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                                         v_head_dim=32, **kGrouped),
    "qwen3_next": lambda: _config("qwen3_next", **kCommon, **kLinear, head_dim=32, moe_intermediate_size=64,
                                  num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=64,
                                  decoder_sparse_step=1, norm_topk_prob=True),
    "qwen3_5_moe": lambda: _config("qwen3_5_moe_text", **_without("intermediate_size"), **kLinear, head_dim=32,
                                   moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                   shared_expert_intermediate_size=64),
    "qwen3_vl_moe": lambda: _config("qwen3_vl_moe_text", **kCommon, head_dim=32, moe_intermediate_size=64,
                                    num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": [4, 6, 6]}),
    "olmoe": lambda: _config("olmoe", **{**kCommon, "intermediate_size": 64}, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=False),
    "flex_olmo": lambda: _config("flex_olmo", **{**kCommon, "intermediate_size": 64}, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=0),
    "glm4_moe": lambda: _config("glm4_moe", **kCommon, head_dim=32, moe_intermediate_size=64, n_routed_experts=16,
                                n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=True, **kGrouped),
    "dots1": lambda: _config("dots1", **kCommon, moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
                             first_k_dense_replace=0, norm_topk_prob=True, **kGrouped),
    "glm4_moe_lite": lambda: _config("glm4_moe_lite", **{**kCommon, **kLatent}, moe_intermediate_size=64,
                                     n_routed_experts=16, n_shared_experts=1, mlp_layer_types=["sparse", "sparse"],
                                     norm_topk_prob=True, **kGrouped),
    "deepseek_v32": lambda: _config("deepseek_v32", **{**kCommon, **kLatent}, moe_intermediate_size=64,
                                    n_routed_experts=16, n_shared_experts=1, first_k_dense_replace=0, index_topk=4,
                                    index_head_dim=32, index_n_heads=2, **kGrouped),
    "kimi_linear": lambda: _config("kimi_linear", **{**kCommon, **kLatent}, moe_intermediate_size=64, num_experts=16,
                                   num_experts_per_token=4, num_shared_experts=1, num_expert_group=4, topk_group=2,
                                   moe_renormalize=True, routed_scaling_factor=2.5,
                                   mlp_layer_types=["sparse", "sparse"],
                                   layer_types=["linear_attention", "full_attention"], linear_head_dim=16,
                                   linear_num_heads=4, pad_token_id=0),
    "exaone_moe": lambda: _config("exaone_moe", **kCommon, head_dim=32, moe_intermediate_size=64, num_experts=16,
                                  num_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=True,
                                  sliding_window=4, sliding_window_pattern=2, **kGrouped),
    "solar_open": lambda: _config("solar_open", **_without("intermediate_size"), head_dim=32, moe_intermediate_size=64,
                                  n_routed_experts=16, n_shared_experts=1, norm_topk_prob=True, **kGrouped),
    "deepseek_v2": lambda: _config("deepseek_v2", **{**kCommon, **kLatent}, moe_intermediate_size=64,
                                   n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2,
                                   first_k_dense_replace=0, topk_method="greedy", routed_scaling_factor=1.5),
    "mistral_large4": lambda: _config("mistral_large4_text", **{**kCommon, **kLatent}, moe_intermediate_size=64,
                                      n_routed_experts=16, n_shared_experts=1, first_k_dense_replace=0, index_topk=4,
                                      index_head_dim=32, index_n_heads=2, **{**kGrouped, "routed_scaling_factor": 1.5}),
    "minimax_m2": lambda: _config("minimax_m2", **{**kCommon, "intermediate_size": 64}, head_dim=32,
                                  num_local_experts=8, num_experts_per_tok=2),
    "ernie4_5_moe": lambda: _config("ernie4_5_moe", **kCommon, moe_intermediate_size=64, moe_num_experts=8, moe_k=2,
                                    moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_interval=1),
    "hunyuan_v1_moe": lambda: _config("hunyuan_v1_moe", **{**kCommon, "intermediate_size": 64}, head_dim=32,
                                      num_experts=8, moe_topk=2),
    "mistral4": lambda: _config("mistral4", **{**kCommon, **kLatent}, moe_intermediate_size=64, n_routed_experts=16,
                                n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=True,
                                **{**kGrouped, "routed_scaling_factor": 1.5}),
    "lfm2_moe": lambda: _config("lfm2_moe", **kCommon, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                num_dense_layers=0, use_expert_bias=True, norm_topk_prob=True,
                                routed_scaling_factor=1.5, layer_types=["conv", "full_attention"]),
    "cohere2_moe": lambda: _config("cohere2_moe", **{**kCommon, "intermediate_size": 64}, head_dim=32, num_experts=8,
                                   num_experts_per_tok=2, num_shared_experts=1,
                                   shared_expert_combination_strategy="average", expert_selection_fn="sigmoid",
                                   norm_topk_prob=True, sliding_window=4, sliding_window_pattern=2),
    "glm_moe_dsa": lambda: _config("glm_moe_dsa", **{**kCommon, **kLatent}, moe_intermediate_size=64,
                                   n_routed_experts=16, n_shared_experts=1, mlp_layer_types=["sparse", "sparse"],
                                   norm_topk_prob=True, index_topk=4, index_head_dim=32, index_n_heads=2, **kGrouped),
    "glm4v_moe": lambda: _config("glm4v_moe_text", **kCommon, head_dim=32, moe_intermediate_size=64,
                                 n_routed_experts=16, n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 3, 3]}, **kGrouped),
    "mimo_v2_flash": lambda: _config("mimo_v2_flash", **kCommon, head_dim=32, v_head_dim=32, moe_intermediate_size=64,
                                     n_routed_experts=16, norm_topk_prob=True, mlp_layer_types=["sparse", "sparse"],
                                     **kGrouped),
    "bailing_hybrid": lambda: _config("bailing_hybrid", **{**kCommon, **kLatent}, head_dim=32, moe_intermediate_size=64,
                                      num_experts=16, n_shared_experts=1, mlp_layer_types=["sparse", "sparse"],
                                      layer_types=["linear_attention", "full_attention"], moe_renormalize=True,
                                      num_expert_group=4, topk_group=2, num_experts_per_tok=4,
                                      routed_scaling_factor=2.5, pad_token_id=0, eos_token_id=1),
    "dots3_note": lambda: _config("dots3_note_text", **{**kCommon, **kLatent}, head_dim=32, moe_intermediate_size=64,
                                  shared_experts_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
                                  mlp_layer_types=["sparse", "sparse"], norm_topk_prob=True, index_topk=4,
                                  index_head_dim=32, index_n_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  **kGrouped),
    "beam": lambda: _config("beam", **kCommon, head_dim=32, moe_intermediate_size=64, num_experts=16,
                            norm_topk_prob=True, mlp_layer_types=["sparse", "sparse"], **kGrouped),
    "qwen3_omni_moe": lambda: _config("qwen3_omni_moe_text", **kCommon, head_dim=32, moe_intermediate_size=64,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1),
    "qwen4_exp": lambda: _config("qwen4_exp_text", **_without("intermediate_size"), **kLinear, head_dim=32,
                                 moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                 shared_expert_intermediate_size=64, norm_topk_prob=True, hc_lowrank=16,
                                 indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
                                 indexer_compress_ratio=2),
    "mellum": lambda: _config("mellum", **kCommon, head_dim=32, moe_intermediate_size=64, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True, mlp_layer_types=["sparse", "sparse"]),
    "lara_mini": lambda: _config("lara_mini", **kCommon, **kLinear, head_dim=32, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                 norm_topk_prob=True, eos_token_id=None),
    "hy_v3": lambda: _config("hy_v3", **kCommon, head_dim=32, moe_intermediate_size=64, num_experts=8,
                             num_experts_per_tok=2, num_shared_experts=1, router_scaling_factor=2.826,
                             mlp_layer_types=["sparse", "sparse"]),
    "laguna": lambda: _config("laguna", **kCommon, head_dim=32, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                              moe_routed_scaling_factor=1.5, mlp_layer_types=["sparse", "sparse"]),
    "step3p7": lambda: _config("step3p5", **kCommon, head_dim=32, moe_intermediate_size=64, n_routed_experts=8,
                               num_experts_per_tok=2, share_expert_dim=64, moe_router_scaling_factor=1.5,
                               mlp_layer_types=["sparse", "sparse"], pad_token_id=0, sliding_window=4),
    "afmoe": lambda: _config("afmoe", **kCommon, head_dim=32, moe_intermediate_size=64, num_experts=8,
                             num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=0, route_scale=1.5,
                             global_attn_every_n_layers=2, sliding_window=4),
}
kFamilies = tuple(kConfigs)
# Text models that transformers builds only as a base model (their causal LM is multimodal): the
# tests compare their last hidden states.
kBaseModelOnly = ("qwen3_vl_moe", "mistral_large4", "glm4v_moe", "qwen3_omni_moe", "step3p7")
# Expert weights at this fraction of unit scale make the MoE output a large part of the residual
# stream (dropping it moves the logits by calc_diff > 0.1) without letting it swamp everything, as
# in a trained model. The grouped families multiply their routed output by their scaling factor.
kExpertScale = {family: 0.25 for family in ("deepseek_v3", "glm4_moe", "deepseek_v32", "kimi_linear", "mistral_large4",
                                           "glm_moe_dsa", "dots3_note", "bailing_hybrid")}
kExpertScale.update(cohere2_moe=0.5,  # its "average" halves the MoE output
                    qwen4_exp=0.5, mimo_v2_flash=0.3,
                    hy_v3=0.15)  # its scaling factor 2.826 makes the MoE output dominate
kDefaultExpertScale = 0.35


def tiny_config(family: str, kernel_sizes: bool = False):
    """``kernel_sizes``: every expert and shared-expert MLP 128 wide (the FP8 GEMMs' K block, so that
    the staged backend takes the layer; the default sizes run on the reference backend only)."""
    config = kConfigs[family]()
    if kernel_sizes:
        for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "shared_experts_intermediate_size", "share_expert_dim"):
            if getattr(config, name, None) is not None:
                setattr(config, name, 128)
    return config


def build_model(config, family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of ``config`` (the base model for ``kBaseModelOnly``), random init, in ``dtype``
    but for the modules the model keeps in float32 (the grouped families' router)."""
    if family == "mistral4":  # not in AutoModelForCausalLM's table
        return transformers.Mistral4ForCausalLM._from_config(config, dtype=dtype)
    if family == "qwen3_omni_moe":  # the thinker's text model: no Auto mapping
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe
        return modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextModel._from_config(config, dtype=dtype)
    if family == "step3p7":
        from transformers.models.step3p7 import modeling_step3p7
        return modeling_step3p7.Step3p7TextModel._from_config(config, dtype=dtype)
    auto = transformers.AutoModel if family in kBaseModelOnly else transformers.AutoModelForCausalLM
    return auto.from_config(config, dtype=dtype)


def model_output(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a causal LM, the last hidden states of a base model."""
    out = model(ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _path(module, dotted: str):
    for name in dotted.split("."):
        module = getattr(module, name)
    return module


def randomize_moe(model: nn.Module, generator: torch.Generator, family: str = "") -> None:
    """Fresh random MoE weights (HF's 0.02 init would make the MoE output negligible)."""
    expert_scale = kExpertScale.get(family, kDefaultExpertScale)
    with torch.no_grad():
        for _, block in find_moe_blocks(model):
            fam = kBlockFamilies[type(block).__name__]
            for name, param in block.named_parameters():
                fan_in = param.shape[-1]
                scale = 2.0 if name == fam.router_weight else expert_scale
                param.copy_(torch.randn(param.shape, generator=generator) * scale / fan_in**0.5)
            if fam.score_bias is not None:
                bias = _path(block, fam.score_bias)
                bias.copy_(torch.randn(bias.shape, generator=generator) * 0.1)


def tiny_model(family: str, dtype: torch.dtype, seed: int, kernel_sizes: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model(tiny_config(family, kernel_sizes), family, dtype).eval()
    randomize_moe(model, torch.Generator().manual_seed(seed), family)
    return model
