"""The staged backend's one-rank decode forward in raw launches (moe_runtime/backends/staged_decode.py).

CPU: the workspace layout, and which pairs get a decode forward. GPU: the layer's output through it
equals the general staged path's bit for bit (FP8 and FP4 weights, shared experts, bf16 and float32
activations, strided rows, batch sizes that grow and shrink over one workspace, a second stream),
and the general path's Python functions are not called on the way. Graph captures take the general
path: test_staged.py's graph tests compare a replay (general) with the eager forward (this one).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from moe_runtime.backends import LocalExperts, MoEProblem, create_backend
from moe_runtime.backends.staged_decode import StagedDecode, decode_layout, kAlign
from moe_runtime.quant_weights import quantize_expert_weight

from staged_cases import expert_weights, layer_pair

_kNeedsCuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("tokens,num_local,top_k,hidden,inter", [(1, 32, 8, 7168, 2048), (17, 5, 3, 384, 256),
                                                                 (32, 256, 8, 7168, 2048)])
def test_layout_tensors_are_aligned_disjoint_and_sized(tokens, num_local, top_k, hidden, inter):
    layout = decode_layout(tokens, num_local, top_k, hidden, inter)
    rows, grouped = num_local * tokens + tokens * top_k, num_local * tokens
    assert (layout.rows, layout.grouped) == (rows, grouped)
    sizes = {"xq": tokens * hidden, "xs": tokens * hidden // 32, "acts": rows * hidden, "acts_sf": rows * hidden // 32,
             "weights": rows * 4, "global_ids": rows * 8, "pair_rows": tokens * top_k * 8, "masked_m": num_local * 4,
             "h": grouped * inter * 4, "act": grouped * inter, "act_sf": grouped * inter // 32,
             "expert_out": grouped * hidden * 2}
    spans = sorted((getattr(layout, name), getattr(layout, name) + size) for name, size in sizes.items())
    assert all(start % kAlign == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), spans
    assert spans[-1][1] <= layout.nbytes < spans[-1][1] + kAlign


def test_no_decode_forward_off_the_gpu_or_for_other_backends():
    """CPU weights: the staged pair runs its general path (no raw launches there); the reference
    pair has no decode forward at all."""
    problem = MoEProblem(256, 128, 4, 2, "fp8", torch.bfloat16, torch.device("cpu"), 1, 16, True)
    gate_up, down = expert_weights(4, 256, 128, 0, "cpu")
    experts = LocalExperts(quantize_expert_weight(gate_up, "fp8"), quantize_expert_weight(down, "fp8"), 0)
    ok, reason = StagedDecode.is_supported(*create_backend("staged", problem, experts, None))
    assert not ok and "CPU" in reason
    ok, reason = StagedDecode.is_supported(*create_backend("reference", problem, experts, None))
    assert not ok and "staged" in reason


def _outputs(layer, xs, monkeypatch, decode: str | None) -> list[torch.Tensor]:
    """The layer's outputs for ``xs`` with MOE_STAGED_DECODE set to ``decode`` (None: unset, the default)."""
    if decode is None:
        monkeypatch.delenv("MOE_STAGED_DECODE", raising=False)
    else:
        monkeypatch.setenv("MOE_STAGED_DECODE", decode)
    with torch.inference_mode():
        return [layer(x) for x in xs]


@pytest.mark.gpu
@_kNeedsCuda
@pytest.mark.parametrize("router,weights", [("mixtral", "fp8"), ("deepseek", "fp8"), ("mixtral", "fp4"),
                                            ("deepseek", "fp4"), ("deepseek-v3", "fp8")])
def test_gpu_decode_forward_matches_the_general_path(seed, router, weights, monkeypatch):
    """The same outputs bit for bit as the general path (the dispatch / apply / combine calls),
    for batches of 1 to 32 tokens in an order that reuses a workspace sized for more tokens (its
    stale bytes must not leak in), float32 and strided activations, and (deepseek) shared experts."""
    hidden, inter, num_experts = 1024, 512, 16 if router != "deepseek-v3" else 64
    layer, _ = layer_pair(router, seed, "cuda", hidden, inter, num_experts, capacity=64, weights=weights)
    pair = layer._backend(layer.device)
    decode = layer._decode()
    assert decode is not None, StagedDecode.is_supported(*pair)
    calls = []
    forward = decode.forward
    monkeypatch.setattr(decode, "forward", lambda *args: calls.append(args[0].shape) or forward(*args))
    g = torch.Generator(device="cuda").manual_seed(seed)
    # 1 token first, then more: the workspace grows; then fewer again over the grown one.
    xs = [torch.randn(t, hidden, device="cuda", generator=g).to(torch.bfloat16) for t in (1, 3, 32, 17, 2)]
    xs.append(torch.randn(5, hidden, device="cuda", generator=g))  # float32 activations
    xs.append(torch.randn(7, 2 * hidden, device="cuda", generator=g).to(torch.bfloat16)[:, :hidden])  # strided rows
    general = _outputs(layer, xs, monkeypatch, "0")
    assert not calls
    fast = _outputs(layer, xs, monkeypatch, None)
    assert calls == [x.shape for x in xs]  # every batch took the decode forward, on by default
    for x, a, b in zip(xs, general, fast):
        assert a.shape == b.shape == x.shape and a.dtype == b.dtype == x.dtype
        assert torch.equal(a, b), (router, weights, x.shape)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        other = _outputs(layer, xs[:2], monkeypatch, "1")
    stream.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(general[:2], other))
    assert len(decode._workspaces) == 2  # one per stream
    if weights == "fp8":  # the fused SwiGLU L1 is the general path's alone
        monkeypatch.setenv("MOE_STAGED_FUSED_SWIGLU", "1")
        with torch.inference_mode():
            layer(xs[0])
        assert len(calls) == len(xs) + 2


@pytest.mark.gpu
@_kNeedsCuda
def test_gpu_decode_forward_skips_the_general_path(seed, monkeypatch):
    """At decode sizes the layer does not call the kernels' Python functions of the general path
    (each would validate and allocate): it launches through the raw entry points, unless
    MOE_STAGED_DECODE=0."""
    layer, _ = layer_pair("mixtral", seed, "cuda", 1024, 512, 16, capacity=64)
    x = torch.randn(4, 1024, device="cuda").to(torch.bfloat16)
    expected = _outputs(layer, [x], monkeypatch, "0")[0]

    def refuse(*args, **kwargs):
        raise AssertionError("the general decode path ran")

    for name in ("moe_local_dispatch", "per_token_cast_to_fp8", "swiglu_quant_fp8", "moe_combine"):
        monkeypatch.setattr(kernels, name, refuse)
    assert torch.equal(_outputs(layer, [x], monkeypatch, "1")[0], expected)
    with pytest.raises(AssertionError, match="general decode path"):
        _outputs(layer, [x], monkeypatch, "0")
