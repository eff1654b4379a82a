"""The staged MoE backend against the reference backend.

CPU (the exchange plan itself: tests/kernels/test_reference_exchange.py): the dispatched contiguous and masked layouts,
the device-built decode layout of one rank; the staged
pair and ``MegaMoELayer(backend="staged")`` (FP8 and FP4 weights) against the reference for
random, skewed, empty and partly unrouted batches; the reasons ``is_supported`` gives; two ranks
under torchrun through the host SymmBuffer. GPU: the same at EP=1, two ranks sharing one GPU
through torch symmetric memory, and the DeepSeek-V3 layer with one rank per GPU where the
machine has several.

On CPU tensors the kernels run their pure-torch references, so the whole staged pipeline runs here.
The multi-rank worker: staged_worker.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import kernels
from kernels.testing.numeric import calc_diff
from moe_runtime import MegaMoELayer
from moe_runtime.backends import LocalExperts, MoEProblem, create_backend, resolve_backend
from moe_runtime.backends.staged import StagedDispatchCombine
from moe_runtime.backends import low_latency, staged
from moe_runtime.quant_weights import quantize_expert_weight
from torchrun_helper import run_torchrun

from staged_cases import E, H, I, expert_weights, kTolerance, layer_pair


def _problem(device, hidden=H, inter=I, num_experts=E, top_k=3, weights="fp8", dtype=torch.bfloat16, ep_size=1,
             capacity=4096):
    return MoEProblem(hidden, inter, num_experts, top_k, weights, dtype, torch.device(device), ep_size, capacity,
                      use_fp8_dispatch=weights != "bf16")


# ---- the staged pair against the reference pair -------------------------------------------------------


def _routing(kind: str, num_tokens: int, top_k: int, num_experts: int, device):
    """``(topk_idx int64 [T, k], topk_weights float32 [T, k])`` with distinct experts per token."""
    scores = torch.rand(num_tokens, num_experts)
    if kind == "skewed":
        scores[:, 0] += 2.0  # every token picks expert 0; the others get what is left
        scores[: num_tokens // 10, 1:] += 1.0
    elif kind == "one_expert_silent":
        scores[:, 3] = -1.0  # never picked
    idx = scores.topk(top_k, dim=-1).indices
    if kind == "unrouted":
        idx[torch.rand(num_tokens, top_k) < 0.3] = -1
    weights = torch.rand(num_tokens, top_k) + 0.1
    return idx.to(device), weights.to(device)


def _pairs(problem, gate_up, down, device):
    experts = LocalExperts(quantize_expert_weight(gate_up.to(device), "fp8"),
                           quantize_expert_weight(down.to(device), "fp8"), 0)
    return create_backend("staged", problem, experts, None), create_backend("reference", problem, experts, None)


def _run_pair(pair, x, idx, weights, out_dtype=torch.bfloat16):
    dispatch_combine, experts = pair
    dispatched = dispatch_combine.dispatch(x, idx, weights)
    dispatched.handle.out_dtype = out_dtype
    return dispatch_combine.combine(experts.apply(dispatched), dispatched.handle)


@pytest.mark.parametrize("kind,num_tokens", [("random", 300), ("random", 1), ("random", 0), ("skewed", 257),
                                             ("one_expert_silent", 45), ("unrouted", 130)])
def test_staged_pair_matches_reference(seed, kind, num_tokens):
    top_k = 3
    problem = _problem("cpu", top_k=top_k)
    gate_up, down = expert_weights(E, H, I, seed)
    staged_pair, reference_pair = _pairs(problem, gate_up, down, "cpu")
    x = torch.randn(num_tokens, H).to(torch.bfloat16)
    idx, weights = _routing(kind, num_tokens, top_k, E, "cpu")
    got = _run_pair(staged_pair, x, idx, weights)
    expected = _run_pair(reference_pair, x, idx, weights)
    assert got.shape == (num_tokens, H) and got.dtype == torch.bfloat16
    if num_tokens:
        assert got.abs().amax() > 0
        assert calc_diff(got, expected) < kTolerance
    # The float32 combine output of the layer's shared-expert path.
    got32 = _run_pair(staged_pair, x, idx, weights, torch.float32)
    assert got32.dtype == torch.float32 and torch.equal(got32.to(torch.bfloat16), got)


def _expert_mlp_with_bf16_l1_output(x, weight, w13, w2, fmt, act_dtype):
    """The reference expert with its one documented difference from the staged backend removed:
    the L1 output rounded to bf16, as the grouped GEMM writes it."""
    from kernels.reference.quant import dequantize_per_token
    from moe_runtime.backends.reference import quantize_activations
    h = (x @ w13.t()).to(torch.bfloat16).float()
    inter = w13.shape[0] // 2
    act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:] * weight.unsqueeze(1)
    return dequantize_per_token(*quantize_activations(act), gran_k=128) @ w2.t()


@pytest.mark.parametrize("kind,num_tokens", [("random", 300), ("skewed", 257), ("unrouted", 130)])
def test_staged_pair_equals_reference_up_to_the_l1_rounding(seed, monkeypatch, kind, num_tokens):
    """On CPU the only difference is the bf16 L1 output; with it in the reference too, the outputs
    agree to float32 noise, so a single misplaced row or weight would show."""
    from moe_runtime.backends import reference
    monkeypatch.setattr(reference, "expert_mlp", _expert_mlp_with_bf16_l1_output)
    problem = _problem("cpu")
    gate_up, down = expert_weights(E, H, I, seed)
    staged_pair, reference_pair = _pairs(problem, gate_up, down, "cpu")
    x = torch.randn(num_tokens, H).to(torch.bfloat16)
    idx, weights = _routing(kind, num_tokens, 3, E, "cpu")
    assert calc_diff(_run_pair(staged_pair, x, idx, weights), _run_pair(reference_pair, x, idx, weights)) < 1e-7


def _decode_batch(seed: int, kind: str, num_tokens: int, weights_format: str):
    """A decode-sized batch for the staged pair: (problem, experts, staged pair, x, topk_idx, topk_weights)."""
    problem = _problem("cpu", weights=weights_format)
    gate_up, down = expert_weights(E, H, I, seed)
    experts = LocalExperts(quantize_expert_weight(gate_up, weights_format), quantize_expert_weight(down, weights_format), 0)
    x = torch.randn(num_tokens, H).to(torch.bfloat16)
    idx, weights = _routing(kind, num_tokens, 3, E, "cpu")
    return problem, experts, create_backend("staged", problem, experts, None), x, idx, weights


@pytest.mark.parametrize("kind,num_tokens", [("random", 40), ("skewed", 20), ("unrouted", 30), ("random", 1)])
@pytest.mark.parametrize("weights_format", ["fp8", "fp4"])
def test_masked_decode_layout_equals_the_contiguous_one(seed, kind, num_tokens, weights_format):
    """Decode-sized batches take the masked layout and GEMMs; the same batch forced through the
    contiguous layout gives the same output (CPU: both run the references on the same rows)."""
    problem, experts, (dispatch_combine, expert_compute), x, idx, weights = _decode_batch(seed, kind, num_tokens,
                                                                                          weights_format)
    dispatched = dispatch_combine.dispatch(x, idx, weights)
    assert 0 < dispatched.masked_max_m <= staged.kMaskedMaxRows
    assert dispatched.x.shape[0] == E * dispatched.masked_max_m
    assert torch.equal(dispatched.masked_m.long(), torch.bincount(idx[idx >= 0], minlength=E))
    masked = dispatch_combine.combine(expert_compute.apply(dispatched), dispatched.handle)
    dispatch_combine.masked_max_rows = 0
    contiguous = _run_pair((dispatch_combine, expert_compute), x, idx, weights)
    assert torch.equal(masked, contiguous)
    expected = _run_pair(create_backend("reference", problem, experts, None), x, idx, weights)
    assert calc_diff(masked, expected) < kTolerance


@pytest.mark.parametrize("kind,num_tokens", [("random", 1), ("random", 32), ("skewed", 20), ("unrouted", 30),
                                             ("one_expert_silent", 7)])
@pytest.mark.parametrize("weights_format", ["fp8", "fp4"])
def test_local_decode_dispatch_equals_the_planned_one(seed, kind, num_tokens, weights_format):
    """One rank, <= 32 tokens, router ids: the masked layout built on the device (no host sync) gives
    the output of the planned masked layout bit for bit, and the reference's."""
    problem, experts, (dispatch_combine, expert_compute), x, idx, weights = _decode_batch(seed, kind, num_tokens,
                                                                                          weights_format)
    local = dispatch_combine.dispatch(x, idx, weights, ids_checked=True)
    assert local.handle.pair_rows is not None and local.masked_max_m == num_tokens
    assert local.x.shape[0] == (E + 3) * num_tokens
    assert torch.equal(local.masked_m.long(), torch.bincount(idx[idx >= 0], minlength=E))
    for e in range(E):  # expert e's rows start its segment, in (token, slot) order, with their ids
        ids = local.topk_idx[e * num_tokens:(e + 1) * num_tokens, 0]
        count = int(local.masked_m[e])
        assert bool((ids[:count] == e).all()) and bool((ids[count:] == -1).all())
        tokens = (idx == e).nonzero()[:, 0]
        assert torch.equal(local.x[e * num_tokens:e * num_tokens + count].view(torch.uint8),
                           kernels.per_token_cast_to_fp8(x.float(), use_ue8m0=False, gran_k=128)[0][tokens]
                           .view(torch.uint8))
    got = dispatch_combine.combine(expert_compute.apply(local), local.handle)
    planned = _run_pair((dispatch_combine, expert_compute), x, idx, weights)
    assert dispatch_combine.dispatch(x, idx, weights).handle.pair_rows is None  # ids not vouched for
    assert torch.equal(got, planned)
    expected = _run_pair(create_backend("reference", problem, experts, None), x, idx, weights)
    assert calc_diff(got, expected) < kTolerance


def test_local_decode_dispatch_only_at_decode_sizes(seed):
    problem = _problem("cpu")
    gate_up, down = expert_weights(E, H, I, seed)
    (dispatch_combine, _), _ = _pairs(problem, gate_up, down, "cpu")
    for num_tokens, local in ((33, False), (0, False), (32, True)):
        x = torch.randn(num_tokens, H).to(torch.bfloat16)
        idx, weights = _routing("random", num_tokens, 3, E, "cpu")
        out = dispatch_combine.dispatch(x, idx, weights, ids_checked=True)
        assert (out.handle.pair_rows is not None) == local, num_tokens
    dispatch_combine.masked_max_rows = 0
    out = dispatch_combine.dispatch(x, idx, weights, ids_checked=True)
    assert out.handle.pair_rows is None and out.masked_max_m == 0


def test_staged_pair_detects_a_wrong_expert(seed):
    """The comparison can fail: swap two experts' weights on the staged side only."""
    problem = _problem("cpu")
    gate_up, down = expert_weights(E, H, I, seed)
    staged_pair, reference_pair = _pairs(problem, gate_up, down, "cpu")
    swapped, _ = _pairs(problem, gate_up[[1, 0, *range(2, E)]], down[[1, 0, *range(2, E)]], "cpu")
    x = torch.randn(200, H).to(torch.bfloat16)
    idx, weights = _routing("random", 200, 3, E, "cpu")
    expected = _run_pair(reference_pair, x, idx, weights)
    assert calc_diff(_run_pair(staged_pair, x, idx, weights), expected) < kTolerance
    assert calc_diff(_run_pair(swapped, x, idx, weights), expected) > 1e-2


def test_dispatch_builds_the_contiguous_layout(seed):
    top_k = 2
    problem = _problem("cpu", top_k=top_k)
    gate_up, down = expert_weights(E, H, I, seed)
    (dispatch_combine, _), _ = _pairs(problem, gate_up, down, "cpu")
    x = torch.randn(150, H).to(torch.bfloat16)
    idx, weights = _routing("skewed", 150, top_k, E, "cpu")
    out = dispatch_combine.dispatch(x, idx, weights)
    m_indices = out.m_indices
    assert m_indices.dtype == torch.int32 and m_indices.shape[0] % staged.contiguous_alignment() == 0
    blocks = m_indices.view(-1, staged.contiguous_alignment())
    for block in blocks:
        experts = block[block >= 0].unique()
        assert experts.numel() == 1 and block[0] >= 0  # one expert per block, starting at a valid row
        first_pad = (block < 0).nonzero()
        if first_pad.numel():
            assert bool((block[first_pad[0, 0]:] == -1).all())  # padding only at a segment's end
    counts = torch.bincount(idx.flatten(), minlength=E)
    assert torch.equal(torch.bincount(m_indices[m_indices >= 0].long(), minlength=E), counts)
    xq, xs = kernels.per_token_cast_to_fp8(x)
    valid = (m_indices >= 0).nonzero().flatten()
    # Rows of one expert, in token order; each row is its token's FP8 row and the slot's weight.
    tokens, slots = [], []
    for e in range(E):
        t, j = (idx == e).nonzero(as_tuple=True)
        tokens.append(t)
        slots.append(j)
    tokens, slots = torch.cat(tokens), torch.cat(slots)
    assert torch.equal(out.x[valid].view(torch.uint8), xq[tokens].view(torch.uint8))
    assert torch.equal(out.x_sf[valid], xs[tokens])
    assert torch.equal(out.topk_weights[valid, 0], weights[tokens, slots])
    assert torch.equal(out.topk_idx[:, 0], torch.where(m_indices >= 0, m_indices.long(), -1))


def test_group_must_match_ep_size():
    """The count exchange's rows are sized for the group's experts: an ep_size the group does not
    have is refused at construction instead of overrunning them."""
    with pytest.raises(ValueError, match="the group has 1 ranks, the problem ep_size=2"):
        StagedDispatchCombine(_problem("cpu", ep_size=2), None, 0)


def test_dispatch_rejects_bad_input(seed):
    problem = _problem("cpu", top_k=2, capacity=16)
    gate_up, down = expert_weights(E, H, I, seed)
    (dispatch_combine, _), _ = _pairs(problem, gate_up, down, "cpu")
    x = torch.randn(4, H).to(torch.bfloat16)
    idx, weights = _routing("random", 4, 2, E, "cpu")
    with pytest.raises(ValueError, match=r"topk_idx must be int64 \[4, 2\]"):
        dispatch_combine.dispatch(x, idx.int(), weights)
    with pytest.raises(ValueError, match=r"topk_weights must be float32 \[4, 2\]"):
        dispatch_combine.dispatch(x, idx, weights.double())
    with pytest.raises(ValueError, match=r"x must be \[T, 256\]"):
        dispatch_combine.dispatch(x[:, :128], idx, weights)
    with pytest.raises(ValueError, match="x must be bfloat16, float16 or float32, got torch.float64"):
        dispatch_combine.dispatch(x.double(), idx, weights)
    with pytest.raises(ValueError, match="exceed num_max_tokens_per_rank=16"):
        dispatch_combine.dispatch(torch.randn(17, H), *_routing("random", 17, 2, E, "cpu"))
    idx[1, 1] = E
    with pytest.raises(ValueError, match=r"expert ids in \[0, 8\) or -1; ids outside that per rank: \[1\]"):
        dispatch_combine.dispatch(x, idx, weights)


# ---- MegaMoELayer(backend="staged") -------------------------------------------------------------------

@pytest.mark.parametrize("router,skew,weights", [("mixtral", False, "fp8"), ("deepseek", False, "fp8"),
                                                  ("deepseek", True, "fp8"), ("mixtral", False, "fp4"),
                                                  ("deepseek", True, "fp4"), ("mixtral", False, "bf16"),
                                                  ("deepseek", True, "bf16")])
def test_layer_staged_matches_reference(seed, router, skew, weights):
    staged_layer, reference_layer = layer_pair(router, seed, "cpu", skew=skew, weights=weights)
    assert staged_layer.backend_name == "staged" and reference_layer.backend_name == "reference"
    for num_tokens in (0, 1, 129, 300):
        x = torch.randn(num_tokens, H).to(torch.bfloat16)
        got, expected = staged_layer(x), reference_layer(x)
        assert got.shape == x.shape and got.dtype == x.dtype
        if num_tokens:
            assert calc_diff(got, expected) < kTolerance, (router, skew, num_tokens)
    x = torch.randn(2, 5, H).to(torch.bfloat16)  # [..., H] inputs keep their shape
    assert calc_diff(staged_layer(x), reference_layer(x)) < kTolerance


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_contiguous_layout_mn_major_scales_equal_k_major(seed, monkeypatch, device):
    """The prefill's FP8 GEMMs on MN-major A scales (K multiples of 512: transposed received scales,
    SwiGLU writing MN-major) give the K-major forward's output bit for bit (MOE_STAGED_MN_MAJOR_SF=0);
    FP8 only, where the GEMMs load such scales by TMA."""
    hidden, inter = 512, 512
    staged_layer, reference_layer = layer_pair("deepseek", seed, device, hidden, inter, capacity=1024)
    experts = staged_layer._backend(torch.device(device))[1]
    assert experts.mn_major_l1 and experts.mn_major_l2
    x = torch.randn(300, hidden, device=device).to(torch.bfloat16)
    got = staged_layer(x)
    monkeypatch.setenv("MOE_STAGED_MN_MAJOR_SF", "0")
    assert torch.equal(staged_layer(x), got)
    assert calc_diff(got, reference_layer(x)) < kTolerance


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("num_tokens", [3, 300])
def test_fused_swiglu_equals_the_staged_pair(seed, monkeypatch, device, num_tokens):
    """MOE_STAGED_FUSED_SWIGLU=1: the L1 GEMM's SwiGLU epilogue (interleaved weights) gives the staged
    forward's output bit for bit, in the masked decode layout (3 tokens on CUDA) and the contiguous one."""
    hidden, inter = 512, 256
    staged_layer, reference_layer = layer_pair("deepseek", seed, device, hidden, inter, capacity=1024)
    x = torch.randn(num_tokens, hidden, device=device).to(torch.bfloat16)
    want = staged_layer(x)
    monkeypatch.setenv("MOE_STAGED_FUSED_SWIGLU", "1")
    got = staged_layer(x)
    assert staged_layer._backend(x.device)[1]._w13_interleaved is not None, "the fused path did not run"
    assert torch.equal(got, want)
    assert calc_diff(got, reference_layer(x)) < kTolerance


@pytest.mark.parametrize("overrides,match", [
    (dict(weights="int4"), "FP8 or FP4 expert weights, got weights='int4'"),
    (dict(weights="bf16", dtype=torch.float32), "read and write bfloat16, got dtype=torch.float32"),
    (dict(weights="bf16", hidden=160), "must be multiples of 64"),
    (dict(dtype=torch.float16), "dtype=torch.float16"),
    (dict(hidden=192), "hidden=192 must be a multiple of 128"),
    (dict(inter=64), "intermediate=64 must be a multiple of 128"),
])
def test_is_supported_says_why_not(overrides, match):
    supported, reason = staged.is_supported(_problem("cpu", **overrides))
    assert not supported and match in reason
    with pytest.raises(NotImplementedError, match=match.replace("(", r"\(").replace(")", r"\)")):
        staged.create(_problem("cpu", **overrides), None, None)


def test_backend_selection(monkeypatch):
    assert staged.is_supported(_problem("cpu"))[0]
    assert MegaMoELayer(H, I, E, 2, backend="auto").backend_name == "reference"  # "auto" picks staged on CUDA only
    assert MegaMoELayer(H, I, E, 2, backend="staged").backend_name == "staged"
    assert MegaMoELayer(H, I, E, 2, backend="staged", weights="fp4").backend_name == "staged"
    assert MegaMoELayer(H, I, E, 2, backend="staged", weights="bf16").backend_name == "staged"
    with pytest.raises(NotImplementedError, match="backend='staged' cannot run this layer: .*bfloat16"):
        MegaMoELayer(H, I, E, 2, backend="staged", weights="bf16", dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="backend='low_latency' cannot run this layer: .*FP8 or FP4"):
        MegaMoELayer(H, I, E, 2, backend="low_latency", weights="bf16")
    # Until the bf16 pair has run on a GPU, "auto" keeps the reference for bf16 weights (no device query).
    bf16_on_cuda = MoEProblem(H, I, E, 2, "bf16", torch.bfloat16, torch.device("cuda"), 1, 512, False)
    assert resolve_backend("auto", bf16_on_cuda) == "reference"
    with pytest.raises(NotImplementedError, match="backend='low_latency' cannot run this layer: .*CUDA only"):
        MegaMoELayer(H, I, E, 2, backend="low_latency")
    assert not low_latency.is_supported(_problem("cpu"))[0]
    big = MoEProblem(7168, 2048, 256, 8, "fp8", torch.bfloat16, torch.device("cuda"), 8, 4096, True)
    with monkeypatch.context() as m:  # past the CUDA checks, as on a Hopper machine
        m.setattr(low_latency, "staged_is_supported", lambda problem: (True, ""))
        ok, reason = low_latency.is_supported(big)
    assert not ok and "GiB per rank" in reason and "staged backend serves larger ones" in reason
    decode = MoEProblem(7168, 2048, 256, 8, "fp8", torch.bfloat16, torch.device("cuda"), 8, 128, True)
    with monkeypatch.context() as m:
        m.setattr(low_latency, "staged_is_supported", lambda problem: (True, ""))
        assert low_latency.is_supported(decode)[0]
    wide = MoEProblem(7168, 2048, 256, 72, "fp8", torch.bfloat16, torch.device("cuda"), 8, 128, True)
    with monkeypatch.context() as m:
        m.setattr(low_latency, "staged_is_supported", lambda problem: (True, ""))
        ok, reason = low_latency.is_supported(wide)
    assert not ok and "top_k <= 64" in reason


# ---- several ranks under torchrun -------------------------------------------------------------------


def _torchrun(nproc: int, device: str, *extra: str, timeout: int = 300) -> str:
    return run_torchrun(Path(__file__).resolve().with_name("staged_worker.py"), nproc, ["--device", device, *extra],
                        f"[rank 0/{nproc}] staged worker ok: {nproc} ranks", timeout=timeout)


@pytest.mark.multirank
@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_staged_expert_parallel_on_cpu_under_torchrun(weights):
    _torchrun(2, "cpu", "--weights", weights)


# ---- GPU -----------------------------------------------------------------------------------------------

_kNeedsCuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@_kNeedsCuda
@pytest.mark.parametrize("router,skew,weights", [("mixtral", False, "fp8"), ("deepseek", False, "fp8"),
                                                  ("deepseek", True, "fp8"), ("mixtral", False, "fp4"),
                                                  ("deepseek", True, "fp4"), ("mixtral", False, "bf16"),
                                                  ("deepseek", True, "bf16")])
def test_gpu_layer_staged_matches_reference(seed, router, skew, weights):
    hidden, inter, num_experts = 1024, 512, 16
    staged_layer, reference_layer = layer_pair(router, seed, "cuda", hidden, inter, num_experts, skew=skew,
                                                capacity=4096, weights=weights)
    assert staged_layer.backend_name == "staged"
    auto = MegaMoELayer(hidden, inter, num_experts, 2, backend="auto", device="cuda")
    assert auto.backend_name == "staged", staged.is_supported(auto._problem(torch.device("cuda")))
    for num_tokens in (0, 1, 127, 1000, 4096):
        x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
        got, expected = staged_layer(x), reference_layer(x)
        assert got.shape == x.shape
        if num_tokens:
            assert calc_diff(got, expected) < kTolerance, (router, skew, num_tokens)


def _check_graph_replays(layer, reference_layer, num_tokens: int, hidden: int) -> None:
    """``layer`` captured once in a CUDA graph (after an eager call compiles its kernels), then
    replayed twice on new tokens: equal to the eager forward and close to the reference."""
    static_x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        layer(static_x)  # compiles and loads the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        for _ in range(2):
            x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, layer(x))
            assert calc_diff(static_y, reference_layer(x)) < kTolerance


@pytest.mark.gpu
@_kNeedsCuda
@pytest.mark.parametrize("router,weights", [("mixtral", "fp8"), ("deepseek", "fp4"), ("deepseek", "fp8")])
def test_gpu_decode_forward_in_a_cuda_graph(seed, router, weights):
    """At decode sizes on one rank nothing in the staged forward syncs with the host: the layer is
    captured once and replayed on new tokens, equal to the eager forward and close to the reference."""
    hidden, num_tokens = 1024, 24
    staged_layer, reference_layer = layer_pair(router, seed, "cuda", hidden, 512, 16, capacity=64, weights=weights)
    _check_graph_replays(staged_layer, reference_layer, num_tokens, hidden)


@pytest.mark.gpu
@pytest.mark.multirank
@_kNeedsCuda
@pytest.mark.parametrize("nproc,weights", [(2, "fp8"), (4, "fp8"), (2, "bf16")])
def test_gpu_staged_expert_parallel_ranks_sharing_a_gpu(nproc, weights):
    _torchrun(nproc, "cuda", "--weights", weights)


@pytest.mark.gpu
@pytest.mark.multirank
@_kNeedsCuda
@pytest.mark.parametrize("nproc", [2, 4])
def test_gpu_low_latency_expert_parallel_ranks_sharing_a_gpu(nproc):
    """The low-latency transport between processes that share the GPU (torch symmetric memory):
    decode steps and a rank without tokens, against the single-process reference."""
    _torchrun(nproc, "cuda", "--backend", "low_latency")


@pytest.mark.gpu
@_kNeedsCuda
@pytest.mark.parametrize("router,weights", [("deepseek", "fp8"), ("mixtral", "fp4"), ("deepseek", "fp4")])
def test_gpu_layer_low_latency_matches_reference(seed, router, weights):
    """One rank: the transport's kernels on an ordinary allocation, several forwards in a row; FP4 at
    512 tokens expects more rows per expert than the decode layout serves (the packed weights run)."""
    hidden, inter, num_experts = 1024, 512, 16
    ll_layer, reference_layer = layer_pair(router, seed, "cuda", hidden, inter, num_experts, capacity=512,
                                            weights=weights, backend="low_latency")
    assert ll_layer.backend_name == "low_latency"
    for num_tokens in (1, 0, 512, 17):
        x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
        got, expected = ll_layer(x), reference_layer(x)
        assert got.shape == expected.shape
        if num_tokens:
            assert calc_diff(got, expected) < kTolerance


@pytest.mark.gpu
@_kNeedsCuda
def test_gpu_low_latency_forward_in_a_cuda_graph(seed):
    """Nothing in the low-latency forward syncs with the host at any token count: captured once,
    replayed on new tokens (each replay one dispatch and one combine, as the transport requires)."""
    hidden, num_tokens = 1024, 48
    ll_layer, reference_layer = layer_pair("deepseek", seed, "cuda", hidden, 512, 16, capacity=64,
                                            backend="low_latency")
    _check_graph_replays(ll_layer, reference_layer, num_tokens, hidden)


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.exclusive
@_kNeedsCuda
@pytest.mark.parametrize("backend", ["torch", "nvshmem"])
def test_gpu_staged_deepseek_v3_one_rank_per_gpu(backend):
    """The DeepSeek-V3 layer over every GPU of the machine (NCCL + gloo), random and skewed routing."""
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        pytest.skip(f"needs 2 or more GPUs (one rank each), found {num_gpus}")
    if backend == "nvshmem" and importlib.util.find_spec("nvshmem") is None:
        pytest.skip("nvshmem4py-cu13 is not installed")
    out = _torchrun(num_gpus, "cuda", "--preset", "deepseek-v3", "--symm-backend", backend, timeout=600)
    assert f"deepseek-v3, fp8 weights, {backend} SymmBuffer" in out
