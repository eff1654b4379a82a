"""CPU tests of the serving pieces: request streams, batching, metrics, checkpoint reading, stack."""

from __future__ import annotations

import contextlib

import json
import random

import pytest
import torch

from moe_runtime.serving.checkpoint import SafetensorsCheckpoint, read_moe_layer
from moe_runtime.serving.config import PRESETS, MoEModelConfig, config_from_hf
from moe_runtime.serving.control import ControlPlane, ShutdownSignal
from moe_runtime.serving.metrics import RankMetrics, percentile, summarize, write_metrics
from moe_runtime.serving.requests import LengthRange, PoissonRequestSource, Request, load_jsonl_requests
from moe_runtime.serving.scheduler import ContinuousBatcher


# ---------------------------------------------------------------- request streams

@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_requests", [1, 10, 37])
def test_poisson_splits_requests_over_ranks(seed, world_size, num_requests):
    streams = [list(PoissonRequestSource(rate=50.0, num_requests=num_requests, prompt_tokens=LengthRange(3, 9),
                                         output_tokens=LengthRange(0, 4), rank=r, world_size=world_size, seed=seed))
               for r in range(world_size)]
    assert sum(len(s) for s in streams) == num_requests
    assert max(len(s) for s in streams) - min(len(s) for s in streams) <= 1
    ids = [r.request_id for s in streams for r in s]
    assert len(set(ids)) == num_requests
    for stream in streams:
        arrivals = [r.arrival_s for r in stream]
        assert arrivals == sorted(arrivals) and all(a > 0 for a in arrivals)
        assert all(3 <= r.prompt_tokens <= 9 and 0 <= r.output_tokens <= 4 for r in stream)


@pytest.mark.parametrize("rate", [20.0, 400.0])
def test_poisson_rate_is_respected(seed, rate):
    stream = list(PoissonRequestSource(rate=rate, num_requests=4000, prompt_tokens=LengthRange(1, 1),
                                       output_tokens=LengthRange(0, 0), rank=0, world_size=1, seed=seed))
    measured = len(stream) / stream[-1].arrival_s
    assert abs(measured - rate) / rate < 0.1


@pytest.mark.parametrize("bad", [dict(rate=0.0), dict(rate=float("inf")), dict(num_requests=-1)])
def test_poisson_rejects_bad_arguments(bad):
    kwargs = dict(rate=1.0, num_requests=3, prompt_tokens=LengthRange(1, 2), output_tokens=LengthRange(0, 1),
                  rank=0, world_size=1)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        PoissonRequestSource(**kwargs)


@pytest.mark.parametrize("text,expected", [("7", (7, 7)), ("2-9", (2, 9))])
def test_length_range_parse(text, expected):
    parsed = LengthRange.parse(text, "--x")
    assert (parsed.low, parsed.high) == expected


@pytest.mark.parametrize("text", ["a", "9-2", "1-2-3", "-3"])
def test_length_range_parse_errors_name_the_option(text):
    with pytest.raises(ValueError, match="--prompt-tokens"):
        LengthRange.parse(text, "--prompt-tokens")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_jsonl_partition_and_order(tmp_path, seed, world_size):
    rng = random.Random(seed)
    lines = [dict(id=f"q{i}", prompt_tokens=rng.randint(1, 50), output_tokens=rng.randint(0, 5),
                  arrival_s=rng.random()) for i in range(23)]
    path = tmp_path / "req.jsonl"
    path.write_text("\n".join(json.dumps(l) for l in lines[:10]) + "\n\n" +
                    "\n".join(json.dumps(l) for l in lines[10:]) + "\n")
    per_rank = [load_jsonl_requests(path, rank=r, world_size=world_size) for r in range(world_size)]
    assert sorted(r.request_id for rs in per_rank for r in rs) == sorted(l["id"] for l in lines)
    for rank, requests in enumerate(per_rank):
        assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
        assert {r.request_id for r in requests} == {l["id"] for i, l in enumerate(lines) if i % world_size == rank}
    limited = load_jsonl_requests(path, rank=0, world_size=1, num_requests=5)
    assert sorted(r.request_id for r in limited) == sorted(l["id"] for l in lines[:5])


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"output_tokens": 3}', "prompt_tokens"),
    ('{"prompt_tokens": 0}', "prompt_tokens must be an integer >= 1"),
    ('{"prompt_tokens": 4, "output_tokens": -1}', "output_tokens"),
    ('{"prompt_tokens": 4, "arrival_s": -2}', "arrival_s"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_tokens": 3}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_jsonl_requests(path, rank=0, world_size=1)
    assert f"{path}:2" in str(info.value)


@pytest.mark.parametrize("first,second", [('"a"', '"a"'), ('1', '"1"')])
def test_jsonl_repeated_ids_are_refused(tmp_path, first, second):
    """The scheduler tracks requests by id: a repeat would lose a request and never finish."""
    path = tmp_path / "dup.jsonl"
    path.write_text(f'{{"prompt_tokens": 3, "id": {first}}}\n{{"prompt_tokens": 2}}\n'
                    f'{{"prompt_tokens": 4, "id": {second}}}\n')
    with pytest.raises(ValueError, match=f"{path}:3: request id '.*' repeats line 1"):
        load_jsonl_requests(path, rank=0, world_size=2)


def test_jsonl_num_tokens_synonym_and_missing_file(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"num_tokens": 5}\n')
    (request,) = load_jsonl_requests(path, rank=0, world_size=1)
    assert request.prompt_tokens == 5 and request.output_tokens == 0
    with pytest.raises(FileNotFoundError, match="requests_jsonl"):
        load_jsonl_requests(tmp_path / "missing.jsonl", rank=0, world_size=1)


# ---------------------------------------------------------------- batching

def _drain(batcher: ContinuousBatcher, step_s: float = 0.01, limit: int = 10_000):
    now, batches, finished = 0.0, [], []
    while batcher.has_pending_work and len(batches) < limit:
        batch = batcher.next_batch(now)
        now += step_s
        batches.append(batch)
        finished += batcher.complete(batch, now)
    return batches, finished


@pytest.mark.parametrize("max_batch_tokens", [1, 7, 64])
def test_batcher_serves_every_token_within_budget(seed, max_batch_tokens):
    rng = random.Random(seed)
    requests = sorted((Request(f"q{i}", rng.randint(1, 40), rng.randint(0, 6), rng.random() * 0.2)
                       for i in range(30)), key=lambda r: r.arrival_s)
    batches, finished = _drain(ContinuousBatcher(requests, max_batch_tokens=max_batch_tokens))
    assert all(b.num_tokens <= max_batch_tokens for b in batches)
    assert sorted(f.request_id for f in finished) == sorted(r.request_id for r in requests)
    assert sum(b.num_tokens for b in batches) == sum(r.total_tokens for r in requests)
    assert sum(b.num_prefill_tokens for b in batches) == sum(r.prompt_tokens for r in requests)
    by_id = {r.request_id: r for r in requests}
    for done in finished:
        assert done.arrival_s == by_id[done.request_id].arrival_s
        assert done.arrival_s <= done.first_token_s <= done.finish_s
        assert done.latency_s >= done.ttft_s > 0


def test_batcher_decode_goes_first_and_prefill_is_chunked():
    requests = [Request("a", 3, 4, 0.0), Request("b", 50, 1, 0.0)]
    batcher = ContinuousBatcher(requests, max_batch_tokens=8)
    first = batcher.next_batch(0.0)
    assert [(s.request_id, s.num_tokens, s.is_prefill) for s in first.slices] == [("a", 3, True), ("b", 5, True)]
    batcher.complete(first, 0.1)
    second = batcher.next_batch(0.1)
    assert second.slices[0].request_id == "a" and not second.slices[0].is_prefill
    assert second.slices[1].request_id == "b" and second.slices[1].num_tokens == 7


def test_batcher_waits_for_arrivals_and_cuts_admission():
    requests = [Request("early", 2, 0, 0.05), Request("late", 2, 0, 5.0)]
    batcher = ContinuousBatcher(requests, max_batch_tokens=8, admit_until_s=1.0)
    assert batcher.next_batch(0.0).num_tokens == 0 and batcher.next_arrival_s == 0.05
    batch = batcher.next_batch(0.06)
    assert batch.num_tokens == 2
    assert [f.request_id for f in batcher.complete(batch, 0.07)] == ["early"]
    assert not batcher.has_pending_work


# ---------------------------------------------------------------- metrics

@pytest.mark.parametrize("q", [0, 25, 50, 99, 100])
def test_percentile_matches_torch_quantile(seed, q):
    values = torch.rand(101, dtype=torch.float64).tolist()
    expected = torch.quantile(torch.tensor(values), q / 100).item()
    assert percentile(values, q) == pytest.approx(expected)
    assert percentile([], q) is None


def test_summarize_merges_ranks_and_writes_json(tmp_path):
    a = RankMetrics(rank=0, latencies_s=[0.1, 0.3], ttfts_s=[0.05, 0.1], prefill_tokens=80, decode_tokens=20,
                    requests_finished=2)
    b = RankMetrics(rank=1, latencies_s=[0.2], ttfts_s=[0.02], prefill_tokens=30, decode_tokens=10,
                    requests_finished=1)
    result = summarize([a, b], wall_s=2.0, run_info={"world_size": 2}, spot_checks=[], periodic=[],
                       stopped_by="completed")
    assert result["tokens"] == 140 and result["tokens_per_s"] == 70.0
    assert result["latency_ms"]["p50"] == pytest.approx(200.0) and result["latency_ms"]["max"] == pytest.approx(300.0)
    assert result["requests_finished"] == 3 and len(result["per_rank"]) == 2
    path = tmp_path / "sub" / "m.json"
    write_metrics(path, result)
    assert json.loads(path.read_text()) == result


# ---------------------------------------------------------------- control plane (single process)

def test_control_plane_single_process_and_signal_flag():
    control = ControlPlane(timeout_s=5.0)
    decision = control.sync(stop_signal=0, pending=True, batch_tokens=3, log=True)
    assert decision.any_pending and decision.any_tokens and decision.log and not decision.stop_signal
    assert control.gather({"x": 1}, "test") == [{"x": 1}] and control.max(2.5, "test") == 2.5
    import os
    import signal
    with ShutdownSignal() as shutdown:
        os.kill(os.getpid(), signal.SIGTERM)
        assert shutdown.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is not shutdown._handle
    with pytest.raises(ValueError, match="timeout_s"):
        ControlPlane(timeout_s=0)


# ---------------------------------------------------------------- configs and checkpoints

def test_deepseek_v3_preset_matches_the_model():
    cfg = PRESETS["deepseek-v3"]
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (256, 8, 7168, 2048)
    assert (cfg.scoring_func, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == ("sigmoid", 8, 4, 2.5)
    assert cfg.shared_intermediate_size == 2048 and cfg.use_score_bias


@pytest.mark.parametrize("hf,expected", [
    (dict(model_type="deepseek_v3", hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
          num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2,
          norm_topk_prob=True),
     dict(scoring_func="sigmoid", use_score_bias=True, n_group=4, shared_intermediate_size=64, num_experts=8,
          router_logits_dtype=None)),
    (dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
     dict(scoring_func="softmax", norm_topk_prob=True, intermediate_size=96, shared_intermediate_size=0,
          router_logits_dtype="bfloat16")),
    (dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
          num_experts_per_tok=2, shared_expert_intermediate_size=48, norm_topk_prob=False, torch_dtype="float16"),
     dict(intermediate_size=32, shared_intermediate_size=48, shared_expert_gate=True, norm_topk_prob=False,
          router_logits_dtype="float16")),
])
def test_config_from_hf(hf, expected):
    cfg = config_from_hf(hf)
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
    expected_dtype = getattr(torch, expected["router_logits_dtype"]) if expected["router_logits_dtype"] else None
    assert cfg.router_config().logits_dtype == expected_dtype


def _write_checkpoint(directory, layout: str, num_experts=4, hidden=32, inter=16, fp8=False):
    from safetensors.torch import save_file
    tensors, gate_up, down = {}, torch.randn(num_experts, 2 * inter, hidden), torch.randn(num_experts, hidden, inter)
    prefix = "model.layers.1.mlp"
    tensors[f"{prefix}.gate.weight"] = torch.randn(num_experts, hidden)
    tensors[f"{prefix}.gate.e_score_correction_bias"] = torch.randn(num_experts)
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.randn(inter, hidden)
    if layout == "fused":
        tensors[f"{prefix}.experts.gate_up_proj"] = gate_up.bfloat16()
        tensors[f"{prefix}.experts.down_proj"] = down.bfloat16()
    else:
        names = ("gate_proj", "up_proj", "down_proj") if layout == "per_expert" else ("w1", "w3", "w2")
        for e in range(num_experts):
            parts = (gate_up[e, :inter], gate_up[e, inter:], down[e])
            for name, w in zip(names, parts):
                key = f"{prefix}.experts.{e}.{name}.weight"
                if fp8:
                    from kernels.reference.quant import per_block_cast_to_fp8
                    q, s = per_block_cast_to_fp8(w)
                    tensors[key], tensors[f"{key}_scale_inv"] = q, s
                else:
                    tensors[key] = w.bfloat16()
    tensors[f"{prefix}.shared_experts.gate_proj.weight"] = torch.randn(inter, hidden)
    tensors[f"{prefix}.shared_experts.up_proj.weight"] = torch.randn(inter, hidden)
    tensors[f"{prefix}.shared_experts.down_proj.weight"] = torch.randn(hidden, inter)
    half = len(tensors) // 2
    items = sorted(tensors.items())
    save_file(dict(items[:half]), str(directory / "a.safetensors"))
    save_file(dict(items[half:]), str(directory / "b.safetensors"))
    return tensors, gate_up, down


@pytest.mark.parametrize("layout,fp8", [("fused", False), ("per_expert", False), ("mixtral", False),
                                        ("per_expert", True)])
@pytest.mark.parametrize("experts", [range(0, 4), range(2, 4)])
def test_checkpoint_reads_only_the_ranks_experts(tmp_path, seed, layout, fp8, experts):
    tensors, gate_up, down = _write_checkpoint(tmp_path, layout, fp8=fp8)
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.moe_layers() == [(1, "model.layers.1.mlp")]
    got = read_moe_layer(ckpt, 1, "model.layers.1.mlp", experts, dtype=torch.float32)
    tol = 0.07 if fp8 else 0.01  # FP8 E4M3 keeps 3 mantissa bits; bf16 keeps 8
    assert got.gate_up.shape == (len(experts), 32, 32) and got.down.shape == (len(experts), 32, 16)
    torch.testing.assert_close(got.gate_up, gate_up[experts.start:experts.stop], rtol=tol, atol=tol * 3)
    torch.testing.assert_close(got.down, down[experts.start:experts.stop], rtol=tol, atol=tol * 3)
    torch.testing.assert_close(got.router_weight, tensors["model.layers.1.mlp.gate.weight"])
    assert got.score_bias is not None and got.shared_gate_up.shape == (32, 32) and got.shared_gate is None


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    _write_checkpoint(tmp_path, "fused")
    ckpt = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(ValueError, match="experts"):
        read_moe_layer(ckpt, 1, "model.layers.1.mlp", range(3, 6))
    with pytest.raises(KeyError, match="no tensor named"):
        ckpt.read("model.layers.9.mlp.gate.weight")


def test_model_config_validation():
    with pytest.raises(ValueError, match="top_k"):
        MoEModelConfig(hidden_size=8, intermediate_size=8, num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="scoring_func"):
        MoEModelConfig(hidden_size=8, intermediate_size=8, num_experts=2, top_k=1, scoring_func="relu")


# ---------------------------------------------------------------- served stack, spot-checks, the loop

kSmall = MoEModelConfig(hidden_size=128, intermediate_size=128, num_experts=8, top_k=2, scoring_func="sigmoid",
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, use_score_bias=True,
                        shared_intermediate_size=128)


@pytest.mark.parametrize("experts", [range(0, 4), range(4, 8), range(2, 6)])
def test_random_weights_do_not_depend_on_the_expert_split(seed, experts):
    from moe_runtime.serving.model import random_layer_weights
    kwargs = dict(seed=seed, dtype=torch.bfloat16, device=torch.device("cpu"))
    whole = random_layer_weights(kSmall, 3, range(8), **kwargs)
    part = random_layer_weights(kSmall, 3, experts, **kwargs)
    assert torch.equal(part.gate_up, whole.gate_up[experts.start:experts.stop])
    assert torch.equal(part.down, whole.down[experts.start:experts.stop])
    assert torch.equal(part.router_weight, whole.router_weight) and torch.equal(part.score_bias, whole.score_bias)
    other = random_layer_weights(kSmall, 4, range(8), **kwargs)
    assert not torch.equal(other.gate_up, whole.gate_up)


class _FakeBackendLayer(torch.nn.Module):
    """Stands in for a non-reference backend: its output depends on the backend it runs."""

    def __init__(self):
        super().__init__()
        self.backend_name, self._backend_cache = "staged", ("key", "pair")

    def forward(self, x):
        return x * (1.0 if self.backend_name == "reference" else 1.05)

    @contextlib.contextmanager
    def use_backend(self, backend):
        saved = (self.backend_name, self._backend_cache)
        self.backend_name, self._backend_cache = backend, None
        try:
            yield self
        finally:
            self.backend_name, self._backend_cache = saved


@pytest.mark.parametrize("num_tokens", [0, 5])
def test_spot_check_detects_a_backend_mismatch_and_restores_the_backend(num_tokens):
    from moe_runtime.serving.model import MoEStack, StackSpec
    from moe_runtime.serving.spot_check import SpotChecker
    layer = _FakeBackendLayer()
    stack = MoEStack([layer], StackSpec(kSmall, 1, "staged", "fp8", (0,), "test"))
    x = torch.randn(num_tokens, kSmall.hidden_size)
    checker = SpotChecker(stack, every=4, tol=1e-3)
    layer_io = []
    stack(x, layer_io)
    diff = checker.check(x, layer_io)
    assert (diff > 1e-4) if num_tokens else diff == 0.0
    assert (layer.backend_name, layer._backend_cache) == ("staged", ("key", "pair"))
    assert [checker.due(i) for i in range(6)] == [True, False, False, False, True, False]


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_stack_runs_and_matches_its_reference(seed, weights):
    from moe_runtime.serving.model import build_stack
    from moe_runtime.serving.spot_check import SpotChecker
    stack = build_stack(kSmall, num_layers=2, backend="reference", weights=weights, ep_group=None,
                        experts=range(8), capacity=64, dtype=torch.bfloat16, device=torch.device("cpu"), seed=seed)
    x = torch.randn(20, kSmall.hidden_size).bfloat16()
    layer_io = []
    with torch.no_grad():
        out = stack(x, layer_io)
    assert out.shape == x.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.equal(out, stack(x)) and len(layer_io) == 2
    assert SpotChecker(stack, every=1, tol=1e-3).check(x, layer_io) == 0.0
    from kernels.testing.numeric import calc_diff
    assert calc_diff(out, x) > 1e-3, "the layers left the residual stream unchanged"


def _options(**kwargs):
    from moe_runtime.serving.loop import ServeOptions
    defaults = dict(model=kSmall, preset="test", num_layers=1, backend="reference", weights="fp8",
                    num_requests=12, request_rate=1000.0, prompt_tokens=LengthRange(4, 20),
                    output_tokens=LengthRange(1, 3), max_batch_tokens=48, spot_check_every=2, progress=False)
    defaults.update(kwargs)
    return ServeOptions(**defaults)


def test_serve_single_process(tmp_path):
    from moe_runtime import init_distributed
    from moe_runtime.serving.loop import format_summary, serve
    ctx = init_distributed()
    assert not ctx.is_distributed
    metrics = serve(_options(metrics_out=str(tmp_path / "m.json")), ctx)
    assert metrics["requests_finished"] == 12 and metrics["stopped_by"] == "completed"
    assert metrics["spot_checks"]["count"] >= 1 and metrics["spot_checks"]["failures"] == 0
    assert json.loads((tmp_path / "m.json").read_text())["tokens"] == metrics["tokens"] > 0
    assert "tokens/s" in format_summary(metrics)


def test_serve_options_validation():
    with pytest.raises(ValueError, match="num_requests"):
        _options(num_requests=None)
    with pytest.raises(ValueError, match="duration"):
        _options(duration_s=0.0)


def _checkpoint_families() -> list[str]:
    """The tiny models' families but the base-model-only ones (their tensors have no model. prefix,
    unlike a real checkpoint's) and those the reader refuses (test_checkpoint_refuses_...)."""
    try:
        from hf_models import kBaseModelOnly, kFamilies
    except ImportError:  # no transformers
        return []
    from moe_runtime.serving.config import kCheckpointUnsupported
    return [f for f in kFamilies if f not in kBaseModelOnly and f not in kCheckpointUnsupported]


@pytest.mark.parametrize("family", _checkpoint_families())
def test_checkpoint_from_save_pretrained_matches_the_transformers_block(tmp_path, seed, family):
    """A checkpoint written by transformers' save_pretrained, read back one layer at a time: the
    routing from config.json and the tensors by the family's names reproduce the block."""
    pytest.importorskip("transformers")
    from hf_models import tiny_model
    from kernels.testing.numeric import calc_diff
    from moe_runtime import MegaMoELayer
    from moe_runtime.integrations import find_moe_blocks
    from moe_runtime.serving.config import load_hf_config
    model = tiny_model(family, torch.float32, seed)
    model.save_pretrained(tmp_path)
    config = config_from_hf(load_hf_config(tmp_path))
    assert config.family == family
    ckpt = SafetensorsCheckpoint(tmp_path)
    (index, prefix), *_ = ckpt.moe_layers()
    tensors = read_moe_layer(ckpt, index, prefix, range(config.num_experts), dtype=torch.float32,
                             family=config.family)
    layer = MegaMoELayer(config.hidden_size, config.intermediate_size, config.num_experts, config.top_k,
                         router=config.router_config(), shared_intermediate_size=config.shared_intermediate_size,
                         shared_expert_gate=config.shared_expert_gate, weights="bf16", backend="reference",
                         dtype=torch.float32)
    layer.load_weights(**tensors.load_kwargs())
    # The checkpoint's names may differ from the modules' (Mixtral's block_sparse_moe on disk).
    block = next(module for name, module in find_moe_blocks(model) if f"layers.{index}." in name + ".")
    x = torch.randn(2, 9, config.hidden_size)
    with torch.no_grad():
        assert calc_diff(layer(x), block(x)) < 1e-4


def test_checkpoint_config_refuses_what_it_cannot_read():
    """config.json of an unknown model type, of a family the reader does not know the tensors of,
    or of a routing method the family does not have: NotImplementedError naming it, not a guess."""
    base = dict(hidden_size=64, intermediate_size=96, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(NotImplementedError, match="model_type='llama4_text' is not a supported MoE family"):
        config_from_hf(dict(base, model_type="llama4_text"))
    with pytest.raises(NotImplementedError, match="hunyuan_v1_moe checkpoints"):
        config_from_hf(dict(base, model_type="hunyuan_v1_moe"))
    with pytest.raises(NotImplementedError, match="group_limited_greedy"):
        config_from_hf(dict(base, model_type="glm4_moe", topk_method="group_limited_greedy"))
    v2 = config_from_hf(dict(base, model_type="deepseek_v2", topk_method="group_limited_greedy", n_group=2,
                             topk_group=1, routed_scaling_factor=16.0, n_shared_experts=2))
    assert (v2.group_score, v2.n_group, v2.norm_topk_prob, v2.router_config().group_score) == ("max", 2, False, "max")
    with pytest.raises(NotImplementedError, match="mistral_large4 checkpoints"):
        config_from_hf(dict(base, model_type="mistral_large4"))
    # A DeepSeek-V3 architecture under another name (Kimi-K2's kimi_k2) is read as DeepSeek-V3.
    grouped = dict(base, topk_method="noaux_tc", n_group=2, topk_group=1, routed_scaling_factor=2.5)
    cfg = config_from_hf(dict(grouped, model_type="kimi_k2"))
    assert (cfg.family, cfg.scoring_func, cfg.use_score_bias, cfg.n_group) == ("deepseek_v3", "sigmoid", True, 2)
    # What changes the routing is never defaulted.
    for key in ("n_group", "topk_group", "routed_scaling_factor"):
        with pytest.raises(ValueError, match=f"{key}( or num_expert_group)? is missing"):
            config_from_hf({k: v for k, v in dict(grouped, model_type="glm4_moe").items() if k != key})
    # Defaults of the norm flag follow the families' config classes: Qwen3-Next True, dots1 False.
    assert config_from_hf(dict(base, model_type="qwen3_next")).norm_topk_prob is True
    assert config_from_hf(dict(grouped, model_type="dots1")).norm_topk_prob is False
    # Experts sized by intermediate_size even where the config also has a moe_intermediate_size.
    assert config_from_hf(dict(base, model_type="olmoe", moe_intermediate_size=32)).intermediate_size == 96


def test_checkpoint_skips_prediction_layers_and_reads_transposed_experts(tmp_path):
    """Multi-token-prediction layers (under mtp., or past num_hidden_layers) are not served; fused
    experts stored [E, H, 2I] / [E, I, H] (Qwen3-VL-MoE's release) are turned to [E, 2I, H] /
    [E, H, I]; two prefixes of one layer raise."""
    from safetensors.torch import save_file
    experts, hidden, inter = 4, 32, 24
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    tensors = {}
    for prefix in ("model.layers.0.mlp", "mtp.layers.0.mlp", "model.layers.2.mlp"):
        tensors[f"{prefix}.gate.weight"] = torch.randn(experts, hidden)
        tensors[f"{prefix}.experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
        tensors[f"{prefix}.experts.down_proj"] = down.transpose(1, 2).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.moe_layers() == [(0, "model.layers.0.mlp"), (2, "model.layers.2.mlp")]
    assert ckpt.moe_layers(num_hidden_layers=2) == [(0, "model.layers.0.mlp")]
    got = read_moe_layer(ckpt, 0, "model.layers.0.mlp", range(1, 3), dtype=torch.float32)
    torch.testing.assert_close(got.gate_up, gate_up[1:3])
    torch.testing.assert_close(got.down, down[1:3])
    save_file({"language_model.layers.0.mlp.experts.down_proj": down}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="layer 0 has experts under two prefixes"):
        SafetensorsCheckpoint(tmp_path).moe_layers()


@pytest.mark.parametrize("world_size,max_batch_tokens", [(1, 48), (2, 4096), (8, 256)])
def test_precompile_plans_the_served_expert_gemms(world_size, max_batch_tokens):
    from kernels import precompile as aot
    import kernels
    from moe_runtime.serving.precompile import stack_shapes
    model = PRESETS["deepseek-v3"]
    shapes = stack_shapes(model, world_size, max_batch_tokens)
    local = model.num_experts // world_size
    assert shapes.local_experts == (local,)
    padding = kernels.get_mk_alignment_for_contiguous_layout() - 1
    assert shapes.max_m == world_size * max_batch_tokens * min(model.top_k, local) + local * padding
    sources = aot.collect_sources(["m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked"], shapes)
    assert {s.family for s in sources} == {"m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked"}
    # Large contiguous layouts copy K-major A scales MN-major first: that kernel is per family, not per shape.
    copies = [s for s in sources if s.name == "mn_major_sf"]
    assert len(copies) == int(shapes.max_m >= 4096)
    sources = [s for s in sources if s.name != "mn_major_sf"]
    assert all(f"G={local} " in s.label for s in sources), "only this world size's local expert count"
    assert {f"n={n} k={k}" for n, k in shapes.expert_nk} == {" ".join(s.label.split()[:2]) for s in sources}
    with pytest.raises(ValueError, match="world_size"):
        stack_shapes(model, 3, 64)


def test_precompile_compiles_then_finds_the_cache(tmp_path):
    from moe_runtime.serving.precompile import precompile_stack
    kwargs = dict(arch="sm_90a", num_sms=132, cache_dir=str(tmp_path))
    count, compiled, _ = precompile_stack(kSmall, "fp8", 2, 16, **kwargs)
    assert count >= 2 and compiled == count
    assert precompile_stack(kSmall, "fp8", 2, 16, **kwargs)[:2] == (count, 0)
    with pytest.raises(ValueError, match="weights"):
        precompile_stack(kSmall, "bf16", 2, 16, **kwargs)


def test_cli_precompile_switch():
    from moe_runtime.serving.cli import build_parser, options_from_args
    parser = build_parser()
    assert options_from_args(parser.parse_args(["--preset", "small"])).precompile
    assert not options_from_args(parser.parse_args(["--preset", "small", "--no-precompile"])).precompile
