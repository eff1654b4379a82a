"""MegaMoELayer inside a Hugging Face transformers model.

Builds a tiny random Qwen3-MoE (or Mixtral / Qwen2-MoE / DeepSeek-V3) from a config, so nothing
is downloaded, swaps its sparse MoE blocks for MegaMoELayer with ``replace_moe_blocks``, and
compares logits and a short greedy generation with the original. Pass ``--model DIR_OR_HUB_ID`` to
load real weights instead.

    python examples/hf_model_moe.py [--family qwen3_moe] [--weights fp8] [--backend auto]
"""

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.testing.numeric import calc_diff  # noqa: E402
from moe_runtime.integrations import replace_moe_blocks  # noqa: E402


def tiny_model(family: str):
    import transformers
    common = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, intermediate_size=256)
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**common, moe_intermediate_size=64, num_experts=8,
                                                         num_experts_per_tok=2, shared_expert_intermediate_size=128),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, moe_intermediate_size=64, num_experts=8,
                                                         num_experts_per_tok=2, head_dim=32, norm_topk_prob=True),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **common, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32),
    }
    return transformers.AutoModelForCausalLM.from_config(configs[family](), dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe", choices=["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
    parser.add_argument("--model", help="a transformers checkpoint (directory or hub id) instead of a tiny model")
    parser.add_argument("--weights", default="fp8", choices=["bf16", "fp8", "fp4"])
    parser.add_argument("--backend", default="auto", choices=["auto", "reference", "staged", "low_latency", "fused"])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    if args.model:
        from transformers import AutoModelForCausalLM
        original = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    else:
        original = tiny_model(args.family)
    original = original.to(device).eval()
    replaced = replace_moe_blocks(copy.deepcopy(original), backend=args.backend, weights=args.weights)
    print(f"replaced {sum(type(m).__name__ == 'MegaMoEBlock' for m in replaced.modules())} MoE blocks")

    ids = torch.randint(0, original.config.vocab_size, (2, 16), device=device)
    generate = dict(attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        diff = calc_diff(original(ids).logits, replaced(ids).logits)
        reference = original.generate(ids, **generate)
        ours = replaced.generate(ids, **generate)
    agree = (reference[:, ids.shape[1]:] == ours[:, ids.shape[1]:]).float().mean().item()
    # A random model's logits are close to ties, so a few greedy choices may flip; a trained one agrees.
    print(f"logits calc_diff {diff:.2e} (weights={args.weights}); greedy tokens agreeing: {agree:.0%}")


if __name__ == "__main__":
    main()
