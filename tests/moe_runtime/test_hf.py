"""replace_moe_blocks on tiny random transformers models built from configs (no downloads).

Each logits test also checks that dropping the MoE output moves the logits far more than the
tolerance, so a wrong conversion cannot hide behind the residual stream.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from kernels.testing.numeric import calc_diff  # noqa: E402
from moe_runtime.integrations import MegaMoEBlock, find_moe_blocks, replace_moe_blocks  # noqa: E402
from moe_runtime.integrations.hf import read_block_spec  # noqa: E402

from hf_models import (kCommon, kFamilies, build_model, model_output, randomize_moe, tiny_config,  # noqa: E402
                       tiny_model)

kRepo = Path(__file__).resolve().parents[2]
kTolerance = {"bf16": 1e-4, "fp8": 1e-2}
# FP8 (weights and activations) against the original model's float computation, where a family's
# output is more sensitive: DeepSeek-V3.2's moved by 0.7-1.4e-2 at four seeds with these weights,
# while its bf16 conversion in float32 matches to 8e-14 (the mapping is exact; the gap is FP8's).
kFp8Tolerance = {"deepseek_v32": 2e-2}


class _Zero(nn.Module):
    def forward(self, hidden_states):
        return torch.zeros_like(hidden_states)


def _logits_without_moe(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    stripped = copy.deepcopy(model)
    for name, _ in find_moe_blocks(stripped):
        parent, _, child = name.rpartition(".")
        setattr(stripped.get_submodule(parent), child, _Zero())
    return model_output(stripped, ids)


# bf16 weights in a float32 model: the only difference from the original is the bf16 rounding of
# the expert weights. A bf16 model would also round every intermediate product differently from
# transformers' loop (and the routing weight is applied before the down projection), which sits
# near the 1e-4 bound; the FP8 cases use bf16 models, as served.
@pytest.mark.parametrize("family", kFamilies)
@pytest.mark.parametrize("weights,dtype", [("bf16", torch.float32), ("fp8", torch.bfloat16)])
def test_replace_keeps_logits(seed, family, weights, dtype):
    model = tiny_model(family, dtype, seed)
    ids = torch.randint(0, kCommon["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(seed))
    num_blocks = len(find_moe_blocks(model))
    assert num_blocks >= 1
    with torch.no_grad():
        expected = model_output(model, ids)
        replaced = replace_moe_blocks(copy.deepcopy(model), backend="reference", weights=weights)
        got = model_output(replaced, ids)
        baseline = _logits_without_moe(model, ids)
    assert find_moe_blocks(replaced) == []
    assert sum(isinstance(m, MegaMoEBlock) for m in replaced.modules()) == num_blocks
    assert got.dtype == expected.dtype
    diff = calc_diff(got, expected)
    tolerance = kFp8Tolerance.get(family, kTolerance[weights]) if weights == "fp8" else kTolerance[weights]
    assert diff < tolerance, f"{family} weights={weights}: calc_diff {diff:.3e}"
    assert calc_diff(baseline, expected) > 10 * kTolerance[weights], "the MoE blocks barely move the logits"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", kFamilies)
def test_gpu_replaced_blocks_run_the_kernels(seed, family):
    """On CUDA, backend="auto" (the kernels: routing, exchange, FP8 GEMMs), experts 128 wide so the
    staged backend takes them: each replaced block against the reference backend's on the same
    input and FP8 weights (only the kernels differ; test_staged.py's layer tolerance) and against
    the transformers block (FP8's rounding: 2.0-2.4e-3 for every family with the staged backend's
    CPU references; a wrong expert costs far more), and the model end to end (up to 1.8e-2 there)."""
    model = tiny_model(family, torch.bfloat16, seed, kernel_sizes=True).cuda()
    ids = torch.randint(0, kCommon["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(seed)).cuda()
    x = torch.randn(3, 7, kCommon["hidden_size"], generator=torch.Generator().manual_seed(seed)).cuda().bfloat16()
    originals = dict(find_moe_blocks(model))
    with torch.no_grad():
        expected = model_output(model, ids)
        fast = replace_moe_blocks(copy.deepcopy(model), backend="auto", weights="fp8")
        slow = replace_moe_blocks(copy.deepcopy(model), backend="reference", weights="fp8")
        for name, original in originals.items():
            block, reference = fast.get_submodule(name), slow.get_submodule(name)
            assert block.moe.backend_name != "reference", name
            got = block(x)
            assert calc_diff(got, reference(x)) < 1e-3, f"{family} {name}: kernels against the reference backend"
            # Against the transformers block in bf16 or in float32, whichever is nearer: Mistral4's
            # and LFM2-MoE's gates round their scores or logits to the model dtype (ties in bf16
            # pick other experts: 1.4e-2 and 1.6e-2 away at the other precision).
            wants = [original(x), copy.deepcopy(original).float()(x.float())]
            diff = min(calc_diff(got, want[0] if isinstance(want, tuple) else want) for want in wants)
            assert diff < 5e-3, f"{family} {name}: {diff:.2e} from the transformers block"
        assert calc_diff(model_output(fast, ids), expected) < 3e-2, f"{family}: the model against transformers"


@pytest.mark.parametrize("family", kFamilies)
def test_block_outputs_match(seed, family):
    model = tiny_model(family, torch.float32, seed)
    name, block = find_moe_blocks(model)[0]
    x = torch.randn(3, 7, kCommon["hidden_size"], generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        expected = block(x)
        replaced = replace_moe_blocks(copy.deepcopy(model), backend="reference", weights="bf16")
        got = replaced.get_submodule(name)(x)
    assert got.shape == expected.shape
    assert calc_diff(got, expected) < 1e-4


_GROUPED = dict(scoring_func="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                use_score_bias=True, shared_intermediate_size=64, float32_logits=True)


@pytest.mark.parametrize("family,expected", [
    ("mixtral", dict(scoring_func="softmax", norm_topk_prob=True, shared_intermediate_size=0)),
    ("qwen2_moe", dict(scoring_func="softmax", norm_topk_prob=False, shared_intermediate_size=96,
                       shared_expert_gate=True)),
    ("qwen3_moe", dict(scoring_func="softmax", norm_topk_prob=True, shared_intermediate_size=0)),
    ("deepseek_v3", _GROUPED),
    ("glm4_moe", _GROUPED),
    ("dots1", _GROUPED),
    ("qwen3_next", dict(norm_topk_prob=True, shared_intermediate_size=64, shared_expert_gate=True)),
    # Qwen3.5-MoE and Qwen3-VL-MoE renormalise whatever the config says: no flag to read.
    ("qwen3_5_moe", dict(norm_topk_prob=True, shared_intermediate_size=64, shared_expert_gate=True)),
    ("qwen3_vl_moe", dict(norm_topk_prob=True, shared_intermediate_size=0, float32_logits=False)),
    ("olmoe", dict(scoring_func="softmax", norm_topk_prob=False, shared_intermediate_size=0)),
    ("deepseek_v2", dict(scoring_func="softmax", norm_topk_prob=False, n_group=None, routed_scaling_factor=1.5,
                         use_score_bias=False, shared_intermediate_size=128, float32_logits=True)),
    ("mistral_large4", dict(scoring_func="softmax", norm_topk_prob=True, n_group=4, topk_group=2,
                            routed_scaling_factor=1.5, use_score_bias=False, float32_logits=True)),
    ("minimax_m2", dict(scoring_func="sigmoid", norm_topk_prob=True, n_group=None, use_score_bias=True,
                        shared_intermediate_size=0, float32_logits=False)),
    ("ernie4_5_moe", dict(scoring_func="softmax", norm_topk_prob=True, use_score_bias=True,
                          shared_intermediate_size=64, float32_logits=True)),
    ("hunyuan_v1_moe", dict(scoring_func="softmax", norm_topk_prob=True, shared_intermediate_size=64)),
    ("afmoe", dict(scoring_func="sigmoid", norm_topk_prob=True, use_score_bias=True, routed_scaling_factor=1.5,
                   shared_intermediate_size=64)),
    # "average" halves the routed output (and the shared expert's down projection).
    ("cohere2_moe", dict(scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=0.5,
                         shared_intermediate_size=64)),
])
def test_block_spec(family, expected):
    model = build_model(tiny_config(family), family)
    spec = read_block_spec(find_moe_blocks(model)[0][1], model.config)
    experts, top_k = (16, 4) if spec.n_group or family == "deepseek_v2" else (8, 2)
    assert (spec.family, spec.hidden_size, spec.num_experts, spec.top_k) == (family, 128, experts, top_k)
    assert spec.intermediate_size == (192 if family == "mixtral" else 64)
    for key, value in expected.items():
        assert getattr(spec, key) == value, key


def test_deepseek_v2_group_limited_routing(seed):
    """DeepSeek-V2's topk_method="group_limited_greedy": the topk_group groups of the best single
    scores compete (RouterConfig group_score="max"), as transformers does."""
    config = tiny_config("deepseek_v2")
    config.topk_method, config.n_group, config.topk_group = "group_limited_greedy", 4, 2
    torch.manual_seed(seed)
    model = build_model(config, "deepseek_v2").eval()
    randomize_moe(model, torch.Generator().manual_seed(seed), "deepseek_v2")
    name, block = find_moe_blocks(model)[0]
    spec = read_block_spec(block, config)
    assert (spec.group_score, spec.n_group, spec.topk_group) == ("max", 4, 2)
    x = torch.randn(3, 7, kCommon["hidden_size"], generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        expected = block(x)
        got = replace_moe_blocks(copy.deepcopy(model), backend="reference", weights="bf16").get_submodule(name)(x)
        greedy = copy.deepcopy(model)
        greedy.get_submodule(name).gate.topk_method = "greedy"
        ungrouped = greedy.get_submodule(name)(x)
    assert calc_diff(got, expected) < 1e-4
    assert calc_diff(ungrouped, expected) > 1e-3, "the groups change nothing here: the test would not see them"


def test_cohere2_softmax_and_sum(seed):
    """Cohere2-MoE's other settings: softmax over the top-k logits (renormalised whatever
    norm_topk_prob says) and the shared expert summed."""
    config = tiny_config("cohere2_moe")
    config.expert_selection_fn, config.shared_expert_combination_strategy, config.norm_topk_prob = \
        "softmax", "sum", False
    torch.manual_seed(seed)
    model = build_model(config, "cohere2_moe").eval()
    randomize_moe(model, torch.Generator().manual_seed(seed), "cohere2_moe")
    name, block = find_moe_blocks(model)[0]
    spec = read_block_spec(block, config)
    assert (spec.scoring_func, spec.norm_topk_prob, spec.routed_scaling_factor) == ("softmax", True, 1.0)
    x = torch.randn(3, 7, kCommon["hidden_size"], generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        expected = block(x)
        got = replace_moe_blocks(copy.deepcopy(model), backend="reference", weights="bf16").get_submodule(name)(x)
    assert calc_diff(got, expected) < 1e-4


def test_every_family_is_covered():
    """Each family of the integration's table has a tiny model in these tests."""
    from moe_runtime.integrations.hf import kBlockFamilies
    from hf_models import kConfigs
    assert {f.family for f in kBlockFamilies.values()} == set(kConfigs)


class MixtralBlockSparseTop2MLP(nn.Module):
    """transformers 4's per-expert Mixtral MLP (w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    """transformers 4's Mixtral block: nn.Linear gate, ModuleList experts, (hidden, logits) output."""

    def __init__(self, hidden: int = 64, inter: int = 96, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(MixtralBlockSparseTop2MLP(hidden, inter) for _ in range(num_experts))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits = self.gate(x)
        weights, chosen = torch.softmax(logits, dim=1, dtype=torch.float).topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for slot in range(self.top_k):
            for e in range(self.num_experts):
                rows = chosen[:, slot] == e
                out[rows] += self.experts[e](x[rows]) * weights[rows, slot, None]
        return out.view(b, s, h), logits


def test_transformers4_layout_and_tuple_output(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(MixtralSparseMoeBlock())
    randomize_moe(model, torch.Generator().manual_seed(seed))
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        expected_out, expected_logits = model[0](x)
        replace_moe_blocks(model, backend="reference", weights="bf16")
        got = model[0](x)
    assert isinstance(model[0], MegaMoEBlock) and isinstance(got, tuple) and len(got) == 2
    assert calc_diff(got[0], expected_out) < 1e-4
    torch.testing.assert_close(got[1], expected_logits)


def test_errors():
    with pytest.raises(ValueError, match="no supported MoE block"):
        replace_moe_blocks(nn.Sequential(nn.Linear(4, 4)))
    for model in (None, [nn.Linear(4, 4)]):
        with pytest.raises(TypeError, match=f"model must be a torch.nn.Module, got {type(model).__name__}"):
            replace_moe_blocks(model)
    with pytest.raises(TypeError, match="process group must be None or a torch.distributed.ProcessGroup"):
        replace_moe_blocks(tiny_model("mixtral", torch.float32, 0), ep_group="world")
    block = MixtralSparseMoeBlock()
    for expert in block.experts:
        expert.act_fn = nn.GELU()
    with pytest.raises(NotImplementedError, match="silu"):
        replace_moe_blocks(nn.Sequential(block))
    with torch.device("meta"):
        meta = nn.Sequential(MixtralSparseMoeBlock())
    with pytest.raises(ValueError, match="meta"):
        replace_moe_blocks(meta)
    # DeepSeek-V3's released configs name its routing topk_method="noaux_tc": read as the family.
    config = tiny_config("deepseek_v3")
    config.topk_method = "noaux_tc"
    assert read_block_spec(find_moe_blocks(build_model(config, "deepseek_v3"))[0][1], config).use_score_bias
    config = tiny_config("deepseek_v3")
    config.topk_method = "group_limited_greedy"  # DeepSeek-V2's only
    with pytest.raises(NotImplementedError, match="group_limited_greedy"):
        replace_moe_blocks(build_model(config, "deepseek_v3"))
    # A soft-capped router (Laguna's moe_router_logit_softcapping) and a clamped SwiGLU (Step-3.7's
    # swiglu_limits) are not the layer's routing and experts.
    config = tiny_config("laguna")
    config.moe_router_logit_softcapping = 0.5
    with pytest.raises(NotImplementedError, match="soft-capped"):
        replace_moe_blocks(build_model(config, "laguna"))
    config = tiny_config("step3p7")
    config.swiglu_limits = [7.0, 7.0]
    with pytest.raises(NotImplementedError, match="clamped at"):
        replace_moe_blocks(build_model(config, "step3p7"))
    # Shared experts with biases (DeepSeek-V2's mlp_bias) have no place in the layer.
    config = tiny_config("deepseek_v2")
    config.mlp_bias = True
    with pytest.raises(NotImplementedError, match="biases"):
        replace_moe_blocks(build_model(config, "deepseek_v2"))


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_expert_parallel_matches_single_process(tmp_path, family):
    """Two gloo ranks, each keeping half the experts, reproduce the single-process logits."""
    env = dict(os.environ, PYTHONPATH=str(kRepo), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).with_name("hf_ep_worker.py")), family, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        result = (tmp_path / f"rank{rank}.txt").read_text().split()
        local_experts, num_experts, diff = int(result[0]), int(result[1]), float(result[2])
        assert local_experts * 2 == num_experts
        assert diff < 1e-4, f"rank {rank}: calc_diff {diff:.3e}"
