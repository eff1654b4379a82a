"""MegaMoELayer with the reference backend: against a float64 per-token loop, capacity, shapes, errors."""

import pytest
import torch
import torch.nn.functional as F

from kernels.reference.fp4 import cast_back_from_fp4, per_token_cast_to_fp4
from kernels.reference.quant import dequantize_per_block, dequantize_per_token, per_block_cast_to_fp8, \
    per_token_cast_to_fp8
from moe_runtime import MegaMoELayer, RouterConfig
from moe_runtime.dist import ExpertPlacement
from moe_runtime.router import route, router_logits

H, I, E, S = 256, 128, 8, 64

_kRouters = {
    "mixtral": (RouterConfig(), 2),
    "qwen2": (RouterConfig(norm_topk_prob=False), 3),
    "deepseek": (RouterConfig(scoring_func="sigmoid", n_group=4, topk_group=2, use_score_bias=True,
                              routed_scaling_factor=2.5), 3),
}


def _weights(seed, shared=False, gate=False):
    g = torch.Generator().manual_seed(seed)
    w = dict(router_weight=torch.randn(E, H, generator=g),
             gate_up=(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16),
             down=(torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16),
             score_bias=torch.randn(E, generator=g) * 0.05)
    if shared:
        w["shared_gate_up"] = (torch.randn(2 * S, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        w["shared_down"] = (torch.randn(H, S, generator=g) / S ** 0.5).to(torch.bfloat16)
    if gate:
        w["shared_gate"] = torch.randn(1, H, generator=g).to(torch.bfloat16)
    return w


def _layer(fmt, router="mixtral", shared=False, gate=False, seed=0, **kwargs):
    cfg, top_k = _kRouters[router]
    layer = MegaMoELayer(H, I, E, top_k, router=cfg, weights=fmt, backend="reference",
                         shared_intermediate_size=S if shared else 0, shared_expert_gate=gate, **kwargs)
    w = _weights(seed, shared, gate)
    if not cfg.use_score_bias:
        w.pop("score_bias")
    return layer.load_weights(**w), w


def _dequant64(w, fmt):
    if fmt == "bf16":
        return w.double()
    if fmt == "fp8":
        return dequantize_per_block(*per_block_cast_to_fp8(w.unsqueeze(0) if w.dim() == 2 else w)).double()
    return cast_back_from_fp4(*per_token_cast_to_fp4(w)).double()


def _round_act(v64, fmt, dtype):
    """The L2 input rounding of the contract, applied to a float64 row."""
    if fmt == "bf16":
        return v64.to(dtype).double()
    return dequantize_per_token(*per_token_cast_to_fp8(v64.float().unsqueeze(0)))[0].double()


def _expert64(xq, w, w13, w2, fmt, dtype):
    h = w13 @ xq
    act = F.silu(h[: w13.shape[0] // 2]) * h[w13.shape[0] // 2:] * w
    return (w2 @ _round_act(act, fmt, dtype)).to(dtype).double()


def _naive(layer, w, x, fmt):
    """Per-token, per-slot float64 loop from the numerics contract."""
    cfg = layer.router_config
    routing = route(router_logits(x, w["router_weight"].to(cfg.logits_dtype or torch.float32), cfg), layer.top_k, cfg,
                    w.get("score_bias"))
    w13, w2 = _dequant64(w["gate_up"], fmt), _dequant64(w["down"], fmt)
    if "shared_gate_up" in w:
        sw13, sw2 = _dequant64(w["shared_gate_up"], fmt), _dequant64(w["shared_down"], fmt)
        sw13, sw2 = sw13.reshape(2 * S, H), sw2.reshape(H, S)
    out = torch.empty(x.shape, dtype=x.dtype)
    for t in range(x.shape[0]):
        xq = x[t].double() if fmt == "bf16" else _round_act(x[t].double(), "fp8", layer.dtype)
        acc = torch.zeros(H, dtype=torch.float64)
        for j in range(layer.top_k):
            e = int(routing.topk_idx[t, j])
            acc += _expert64(xq, float(routing.topk_weights[t, j]), w13[e], w2[e], fmt, layer.dtype)
        if "shared_gate_up" in w:
            y = _expert64(xq, 1.0, sw13, sw2, fmt, layer.dtype)
            if "shared_gate" in w:
                y = y * torch.sigmoid(w["shared_gate"][0].double() @ x[t].double())
            acc += y
        out[t] = acc.to(x.dtype)
    return out


@pytest.mark.parametrize("fmt,limit", [("bf16", 1e-6), ("fp8", 2e-6), ("fp4", 2e-6)])
@pytest.mark.parametrize("router,shared,gate", [("mixtral", False, False), ("qwen2", True, True),
                                                ("deepseek", True, False)])
def test_matches_float64_loop(fmt, limit, router, shared, gate, calc_diff):
    layer, w = _layer(fmt, router, shared, gate, seed=len(router))
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = _naive(layer, w, x, fmt)
    assert calc_diff(y, ref) < limit
    # The check can fail: a wrong top-k weight is far outside the limit.
    assert calc_diff(y, ref * 1.05) > limit


def test_quantized_formats_differ_from_bf16(calc_diff):
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    ybf16 = _layer("bf16")[0](x)
    for fmt, (low, high) in {"fp8": (1e-6, 1e-2), "fp4": (1e-4, 5e-2)}.items():
        assert low < calc_diff(_layer(fmt)[0](x), ybf16) < high


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_variable_batch_sizes_and_shapes(fmt, calc_diff):
    layer, _ = _layer(fmt, "deepseek", shared=True)
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    whole = layer(x)
    assert whole.shape == (2, 9, H)
    flat = x.reshape(18, H)
    parts = torch.cat([layer(flat[:1]), layer(flat[1:6]), layer(flat[6:])])
    assert calc_diff(parts, whole.reshape(18, H)) < 1e-6
    assert layer(torch.empty(0, H, dtype=torch.bfloat16)).shape == (0, H)
    assert layer(torch.empty(3, 0, H, dtype=torch.bfloat16)).shape == (3, 0, H)
    y32 = layer(flat.float())
    assert y32.dtype == torch.float32 and calc_diff(y32, whole.reshape(18, H)) < 1e-4


def test_capacity_error_names_both_numbers():
    layer, _ = _layer("bf16", num_max_tokens_per_rank=16)
    layer(torch.randn(16, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"17 tokens .* num_max_tokens_per_rank=16"):
        layer(torch.randn(17, H, dtype=torch.bfloat16))


def test_cast_of_the_module_keeps_quantized_codes(calc_diff):
    layer, _ = _layer("fp8")
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    before = layer(x)
    layer.half()
    assert layer.w13_data.dtype == torch.uint8 and layer.w13_sf.dtype == torch.int32
    assert calc_diff(layer(x.half()), before) < 1e-4


def test_full_and_local_expert_tensors_load_the_same():
    full, w = _layer("fp8")
    local = MegaMoELayer(H, I, E, 2, weights="fp8", backend="reference")
    full.placement = local.placement = ExpertPlacement(E, 2, 1)
    full.load_weights(router_weight=w["router_weight"], gate_up=w["gate_up"], down=w["down"])
    local.load_weights(router_weight=w["router_weight"], gate_up=w["gate_up"][4:], down=w["down"][4:])
    assert full.w13_data.shape[0] == 4
    assert torch.equal(full.w13_data, local.w13_data) and torch.equal(full.w2_sf, local.w2_sf)
    with pytest.raises(ValueError, match=r"gate_up must have shape \(4, 256, 256\)"):
        local.load_weights(router_weight=w["router_weight"], gate_up=w["gate_up"][:3], down=w["down"][4:])


def test_backend_selection():
    assert MegaMoELayer(H, I, E, 2, backend="auto").backend_name == "reference"
    with pytest.raises(NotImplementedError, match="fused Mega MoE kernel is not implemented yet"):
        MegaMoELayer(H, I, E, 2, backend="fused")
    assert MegaMoELayer(H, I, E, 2, backend="staged", weights="bf16").backend_name == "staged"
    with pytest.raises(NotImplementedError, match="bf16 grouped GEMMs read and write bfloat16"):
        MegaMoELayer(H, I, E, 2, backend="staged", weights="bf16", dtype=torch.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        MegaMoELayer(H, I, E, 2, backend="triton")


@pytest.mark.parametrize("kwargs,match", [
    (dict(weights="int4"), "weights must be one of"),
    (dict(top_k=9), "top_k"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank"),
    (dict(shared_expert_gate=True), "shared_expert_gate"),
    (dict(weights="fp4", hidden_size=255), "even"),
])
def test_construction_errors(kwargs, match):
    args = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MegaMoELayer(args.pop("hidden_size"), args.pop("intermediate_size"), args.pop("num_experts"),
                     args.pop("top_k"), **args)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(router={"scoring_func": "softmax"}), TypeError, "router must be None or a RouterConfig, got dict"),
    (dict(dtype=torch.float8_e4m3fn), TypeError, "dtype must be float16, bfloat16, float32 or float64, got "
                                                 "torch.float8_e4m3fn"),
    (dict(shared_intermediate_size=S, shared_expert_gate="yes"), TypeError, "shared_expert_gate must be a bool"),
    (dict(device="gpu0"), ValueError, "device must be a torch.device or a device string .* got 'gpu0'"),
    (dict(ep_group="world"), TypeError, "process group must be None or a torch.distributed.ProcessGroup, got str"),
])
def test_construction_type_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        MegaMoELayer(H, I, E, 2, **kwargs)


def _nonfinite(name, value):
    w = _weights(0)
    del w["score_bias"]
    w[name] = w[name].clone()
    w[name].view(-1)[7] = value
    return w


def _nonfinite_strided_last(name):
    """An inf in the last element of a non-contiguous (column-major per expert) copy."""
    w = _nonfinite(name, 0.0)
    strided = w[name].transpose(1, 2).contiguous().transpose(1, 2)
    strided[-1, -1, -1] = float("inf")
    assert not strided.is_contiguous()
    w[name] = strided
    return w


@pytest.mark.parametrize("weights", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("kwargs,error,match", [
    (_nonfinite("gate_up", float("nan")), ValueError, "gate_up must hold finite values, got NaN or inf"),
    (_nonfinite("down", float("-inf")), ValueError, "down must hold finite values"),
    (_nonfinite("router_weight", float("nan")), ValueError, "router_weight must hold finite values"),
    (_nonfinite_strided_last("gate_up"), ValueError, "gate_up must hold finite values"),
    ({**_nonfinite("gate_up", 0.0), "gate_up": torch.zeros(E, 2 * I, H, device="meta")}, ValueError,
     "gate_up is on the meta device \\(no values\\) but the weights load onto cpu"),
    ({**_nonfinite("gate_up", 0.0), "device": "nowhere"}, ValueError, "device must be a torch.device .*'nowhere'"),
])
def test_load_weights_value_errors(weights, kwargs, error, match):
    layer = MegaMoELayer(H, I, E, 2, weights=weights)
    with pytest.raises(error, match=match):
        layer.load_weights(**kwargs)
    assert not layer.loaded


def _weights_with(name, tensor):
    w = _weights(0)
    del w["score_bias"]
    w[name] = tensor(w[name])
    return w


@pytest.mark.parametrize("kwargs,error,match", [
    (_weights_with("gate_up", lambda t: t.to_sparse()), ValueError, "gate_up must be a dense \\(strided\\) tensor"),
    (_weights_with("router_weight", lambda t: t.to_sparse()), ValueError, "router_weight must be a dense"),
    (_weights_with("down", lambda t: t.to(torch.float8_e4m3fn)), TypeError,
     "down must be a float16, bfloat16, float32 or float64 tensor, got torch.float8_e4m3fn"),
])
def test_load_weights_refuses_sparse_and_fp8_checkpoints(kwargs, error, match):
    layer = MegaMoELayer(H, I, E, 2)
    with pytest.raises(error, match=match):
        layer.load_weights(**kwargs)
    assert not layer.loaded


def _huge(name, value, dtype=torch.float32):
    """The weights with ``name`` in ``dtype`` holding ``value`` (finite there)."""
    w = _weights(0)
    del w["score_bias"]
    w[name] = w[name].to(dtype)
    w[name].view(-1)[7] = value
    return w


@pytest.mark.parametrize("layer_args,kwargs,match", [
    # bf16 weights stored in float16: 1e5 is finite in float32 but inf in float16.
    (dict(weights="bf16", dtype=torch.float16), _huge("gate_up", 1e5), "gate_up holds a value of magnitude 1e\\+05, "
                                                                       "beyond the range of torch.float16"),
    (dict(weights="bf16", dtype=torch.bfloat16), _huge("down", 3.4e38), "down holds a value .* torch.bfloat16"),
    (dict(router=RouterConfig(logits_dtype=torch.float16)), _huge("router_weight", 1e6),
     "router_weight holds a value .* torch.float16"),
    # FP4 and FP8 weights are quantized in float32.
    (dict(weights="fp4"), _huge("gate_up", 1e39, torch.float64), "gate_up holds a value .* torch.float32"),
    (dict(weights="fp8"), _huge("down", -1e39, torch.float64), "down holds a value .* torch.float32"),
])
def test_load_weights_refuses_values_the_cast_overflows(layer_args, kwargs, match):
    """A value finite in the checkpoint's dtype but beyond the dtype it is stored in would load as
    inf (NaN outputs, or routing silently wrong)."""
    layer = MegaMoELayer(H, I, E, 2, **layer_args)
    with pytest.raises(ValueError, match=match):
        layer.load_weights(**kwargs)
    assert not layer.loaded


def test_fp8_weights_quantize_values_beyond_the_layer_dtype():
    """FP8 weights are quantized from the checkpoint's dtype (scales absorb the magnitude): a value
    beyond float16 loads in a float16 layer."""
    layer = MegaMoELayer(H, I, E, 2, dtype=torch.float16).load_weights(**_huge("gate_up", 1e5))
    assert layer.loaded and torch.isfinite(layer(torch.randn(3, H, dtype=torch.float16))).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_device_without_cuda_is_named():
    with pytest.raises(ValueError, match="device is cuda but this machine has 0 CUDA device"):
        MegaMoELayer(H, I, E, 2, device="cuda")
    w = _weights(0)
    del w["score_bias"]
    with pytest.raises(ValueError, match="device is cuda:1 but this machine has 0 CUDA device"):
        MegaMoELayer(H, I, E, 2).load_weights(**w, device="cuda:1")


def test_forward_refuses_sparse_and_nested_inputs():
    w = _weights(0)
    del w["score_bias"]
    layer = MegaMoELayer(H, I, E, 2).load_weights(**w)
    with pytest.raises(ValueError, match="hidden_states must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        layer(torch.randn(2, H).to_sparse())
    nested = torch.nested.nested_tensor([torch.randn(2, H), torch.randn(3, H)], layout=torch.jagged)
    with pytest.raises(ValueError, match="hidden_states must be a dense \\(strided\\) tensor, got a nested tensor"):
        layer(nested)


@pytest.mark.parametrize("backend", ["staged", "reference"])
@pytest.mark.parametrize("tokens", [4, 40])  # the staged backend's masked (decode) and contiguous layouts
def test_forward_takes_a_negated_view_as_its_values(backend, tokens):
    """A lazily negated input (the negative bit, as conj().imag gives) is the values it shows: the
    kernels, which read memory, never see it unresolved."""
    layer, _ = _layer("fp8", "deepseek", shared=True, num_max_tokens_per_rank=64)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    negated = torch._neg_view(-x)
    assert negated.is_neg() and torch.equal(negated, x)
    with layer.use_backend(backend):
        assert torch.equal(layer(negated), layer(x))


def test_forward_refuses_fp8_activations_and_meta_layers():
    w = _weights(0)
    del w["score_bias"]
    layer = MegaMoELayer(H, I, E, 2).load_weights(**w)
    with pytest.raises(TypeError, match="hidden_states must be float16, bfloat16, float32 or float64, got "
                                        "torch.float8_e4m3fn"):
        layer(torch.randn(2, H).to(torch.float8_e4m3fn))
    meta = MegaMoELayer(H, I, E, 2, device="meta").load_weights(**{k: v.to("meta") for k, v in w.items()})
    with pytest.raises(ValueError, match="on the meta device: the forward computes values"):
        meta(torch.randn(2, H, device="meta"))


def test_load_and_forward_errors():
    w = _weights(0, shared=True, gate=True)
    layer = MegaMoELayer(H, I, E, 2, weights="bf16")
    with pytest.raises(RuntimeError, match="before load_weights"):
        layer(torch.randn(2, H))
    with pytest.raises(ValueError, match=r"router_weight must have shape \(8, 256\)"):
        layer.load_weights(router_weight=w["router_weight"][:4], gate_up=w["gate_up"], down=w["down"])
    with pytest.raises(ValueError, match="score_bias was given"):
        layer.load_weights(router_weight=w["router_weight"], gate_up=w["gate_up"], down=w["down"],
                           score_bias=w["score_bias"])
    with pytest.raises(ValueError, match="shared_gate_up and shared_down"):
        layer.load_weights(router_weight=w["router_weight"], gate_up=w["gate_up"], down=w["down"],
                           shared_gate_up=w["shared_gate_up"], shared_down=w["shared_down"])
    with pytest.raises(TypeError, match="gate_up must be a float16, bfloat16, float32 or float64 tensor"):
        layer.load_weights(router_weight=w["router_weight"], gate_up=w["gate_up"].to(torch.int32), down=w["down"])
    biased = MegaMoELayer(H, I, E, 2, router=RouterConfig(use_score_bias=True))
    with pytest.raises(ValueError, match="needs score_bias"):
        biased.load_weights(router_weight=w["router_weight"], gate_up=w["gate_up"], down=w["down"])
    layer.load_weights(router_weight=w["router_weight"], gate_up=w["gate_up"], down=w["down"])
    with pytest.raises(ValueError, match=r"hidden_size=256"):
        layer(torch.randn(2, H + 1))
    with pytest.raises(TypeError, match="float tensor"):
        layer(torch.ones(2, H, dtype=torch.int64))
    with pytest.raises(ValueError, match="is on meta"):
        layer(torch.randn(2, H, device="meta"))


def test_use_backend_switches_and_restores():
    w = _weights(0)
    w.pop("score_bias")
    layer = MegaMoELayer(H, I, E, 2, weights="fp8", backend="staged").load_weights(**w)
    x = torch.randn(16, H).to(torch.bfloat16)
    staged = layer(x)
    cache = layer._backend_cache
    with layer.use_backend("reference") as same:
        assert same is layer and layer.backend_name == "reference"
        reference = layer(x)
    assert layer.backend_name == "staged" and layer._backend_cache is cache
    assert torch.isfinite(staged).all() and torch.isfinite(reference).all()


def test_a_failed_reload_leaves_the_layer_as_it_was():
    """A bad argument anywhere in load_weights changes no buffer (else the router and gate_up would
    be new and down old)."""
    layer, w = _layer("fp8")
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    before = layer(x)
    other = _weights(1)
    other.pop("score_bias")
    with pytest.raises(ValueError, match="down must have shape"):
        layer.load_weights(router_weight=other["router_weight"], gate_up=other["gate_up"], down=other["down"][:, :8])
    assert torch.equal(layer.router_weight, w["router_weight"].float())
    assert torch.equal(layer(x), before)


def test_module_casts_keep_the_gate_in_its_dtype():
    """module.to(bf16) / .half() move the router weight and score bias but keep them float32 (the
    logits' precision): rounding them flips near-tied routing decisions."""
    layer, w = _layer("fp8", router="deepseek")
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    before = layer(x)
    layer.to(torch.bfloat16)
    assert layer.router_weight.dtype == torch.float32 and layer.score_bias.dtype == torch.float32
    assert torch.equal(layer.router_weight, w["router_weight"].float())
    assert torch.equal(layer(x), before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_staged_takes_fp16_and_fp64_inputs(dtype):
    """Activations the kernels do not take (fp16, fp64) run as float32 and come back in their dtype."""
    w = _weights(0)
    w.pop("score_bias")
    staged = MegaMoELayer(H, I, E, 2, weights="fp8", backend="staged").load_weights(**w)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = staged(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, staged(x.float()).to(dtype))


@pytest.mark.parametrize("weights", ["fp8", "fp4"])
def test_in_place_weight_update_reaches_the_staged_backend(weights, calc_diff):
    """load_state_dict copies into the existing buffers: the backend's converted copies (FP4
    scales) must follow, not keep the first weights'."""
    w_a, w_b = _weights(0), _weights(1)
    for w in (w_a, w_b):
        w.pop("score_bias")
    a = MegaMoELayer(H, I, E, 2, weights=weights, backend="staged").load_weights(**w_a)
    b = MegaMoELayer(H, I, E, 2, weights=weights, backend="staged").load_weights(**w_b)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    a(x)
    a.load_state_dict(b.state_dict())
    assert torch.equal(a(x), b(x))


def test_dtype_arguments_must_be_floating():
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        MegaMoELayer(H, I, E, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        MegaMoELayer(H, I, E, 2, dtype="bfloat16")
    with pytest.raises(TypeError, match="logits_dtype must be None or a floating"):
        MegaMoELayer(H, I, E, 2, router=RouterConfig(logits_dtype=torch.int32))
    with pytest.raises(TypeError, match="topk_group must be None or an int"):
        MegaMoELayer(H, I, E, 2, router=RouterConfig(n_group=4, topk_group=True))
