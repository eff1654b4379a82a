"""``MegaMoELayer``: router + routed experts (+ optional shared experts) as one ``nn.Module``.

Under expert parallelism every rank of ``ep_group`` holds ``num_experts / ep_size`` experts and
its own tokens; ``forward`` is collective over the group, so every rank must call it for every
step, with zero tokens when it has none.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from kernels.reference.quant import dequantize_per_token
from moe_runtime.backends import LocalExperts, MoEProblem, create_backend, resolve_backend
from moe_runtime.backends.reference import expert_mlp, quantize_activations
from moe_runtime.backends.staged_decode import StagedDecode
from moe_runtime.dist import as_device, expert_placement, group_rank, group_size
from moe_runtime.quant_weights import ExpertWeight, kWeightFormats, quantize_expert_weight
from moe_runtime.router import RouterConfig, route, router_logits

# Quantized tensors are kept as integer bit views so that ``module.to(dtype)`` / ``.half()`` (which
# cast every floating buffer) cannot turn FP8 codes or float32 scales into another dtype.
_kStorageViews = {torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass
class MoEBlockWeights:
    """Tensors in ``MegaMoELayer.load_weights`` layout; ``gate_up``/``down`` hold ``experts`` only.

    ``gate_up`` [E_local, 2I, H], ``down`` [E_local, H, I], ``router_weight`` [E, H],
    ``score_bias`` [E], ``shared_gate_up`` [2Is, H], ``shared_down`` [H, Is], ``shared_gate`` [1, H].
    """

    router_weight: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    score_bias: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None

    def load_kwargs(self) -> dict:
        return dict(router_weight=self.router_weight, gate_up=self.gate_up, down=self.down,
                    score_bias=self.score_bias, shared_gate_up=self.shared_gate_up,
                    shared_down=self.shared_down, shared_gate=self.shared_gate)


def _check_dense(name: str, tensor: torch.Tensor) -> None:
    """A dense (strided, not nested) tensor, or a ValueError naming ``name``: sparse and nested
    tensors have no shape and strides of their own to read."""
    if tensor.layout is not torch.strided or tensor.is_nested:
        raise ValueError(f"{name} must be a dense (strided) tensor, got "
                         + ("a nested tensor" if tensor.is_nested else f"layout {tensor.layout}"))


class MegaMoELayer(nn.Module):
    """A MoE block: ``[..., H] -> [..., H]``, the input dtype preserved.

    ``weights``: ``"bf16"``, ``"fp8"`` or ``"fp4"`` (quantized in :meth:`load_weights`).
    ``backend``: ``"reference"``, ``"staged"``, ``"fused"`` or ``"auto"``. ``ep_group``: the
    expert-parallel process group (``None``: the world when initialised, else one process).
    ``num_max_tokens_per_rank``: the most tokens one rank may pass to one ``forward``.
    ``dtype``: the dtype of bf16 weights, of the router weight, and of each expert's output.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 router: RouterConfig | None = None, shared_intermediate_size: int = 0,
                 shared_expert_gate: bool = False, weights: str = "fp8", backend: str = "auto",
                 ep_group=None, num_max_tokens_per_rank: int = 4096, dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__()
        self.hidden_size = _check_int(hidden_size, "hidden_size", 1)
        self.intermediate_size = _check_int(intermediate_size, "intermediate_size", 1)
        self.num_experts = _check_int(num_experts, "num_experts", 1)
        self.top_k = _check_int(top_k, "top_k", 1)
        self.shared_intermediate_size = _check_int(shared_intermediate_size, "shared_intermediate_size", 0)
        self.num_max_tokens_per_rank = _check_int(num_max_tokens_per_rank, "num_max_tokens_per_rank", 1)
        if weights not in kWeightFormats:
            raise ValueError(f"weights must be one of {kWeightFormats}, got {weights!r}")
        if not isinstance(shared_expert_gate, bool):
            raise TypeError(f"shared_expert_gate must be a bool, got {shared_expert_gate!r}")
        if shared_expert_gate and not shared_intermediate_size:
            raise ValueError("shared_expert_gate=True needs shared experts (shared_intermediate_size > 0)")
        if weights == "fp4" and (hidden_size % 2 or intermediate_size % 2 or shared_intermediate_size % 2):
            raise ValueError(f"weights='fp4' packs two values per byte: hidden_size={hidden_size}, "
                             f"intermediate_size={intermediate_size} and shared_intermediate_size="
                             f"{shared_intermediate_size} must be even")
        if router is not None and not isinstance(router, RouterConfig):
            raise TypeError(f"router must be None or a RouterConfig, got {type(router).__name__}")
        self.router_config = router if router is not None else RouterConfig()
        self.router_config.validate(num_experts, top_k)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if dtype.itemsize < 2:  # bf16 weights and expert outputs in FP8, without scales
            raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype}")
        self.weights = weights
        self.dtype = dtype
        self.shared_expert_gate = bool(shared_expert_gate)
        self.ep_group = ep_group
        self.placement = expert_placement(num_experts, group_size(ep_group), group_rank(ep_group))
        self._default_device = as_device(device, "device") if device is not None else torch.get_default_device()
        self._backend_request = backend
        self.backend_name = resolve_backend(backend, self._problem(self._default_device))
        self._backend_cache: tuple | None = None
        self.loaded = False

    @property
    def num_local_experts(self) -> int:
        return self.placement.num_local_experts

    @property
    def device(self) -> torch.device:
        return self.router_weight.device if self.loaded else self._default_device

    def _problem(self, device: torch.device) -> MoEProblem:
        return MoEProblem(self.hidden_size, self.intermediate_size, self.num_experts, self.top_k, self.weights,
                          self.dtype, device, self.placement.ep_size, self.num_max_tokens_per_rank,
                          use_fp8_dispatch=self.weights != "bf16")

    def _store(self, prefix: str, weight: ExpertWeight) -> None:
        data = weight.data
        self.register_buffer(f"{prefix}_data", data.view(_kStorageViews.get(data.dtype, data.dtype)))
        self.register_buffer(f"{prefix}_sf", None if weight.sf is None else weight.sf.view(torch.int32))
        setattr(self, f"_{prefix}_meta", (weight.format, weight.shape, data.dtype))

    def _restore(self, prefix: str) -> ExpertWeight:
        fmt, shape, dtype = getattr(self, f"_{prefix}_meta")
        data = getattr(self, f"{prefix}_data")
        sf = getattr(self, f"{prefix}_sf")
        data = data.view(dtype) if data.dtype in _kStorageViews.values() else data
        return ExpertWeight(fmt, data, None if sf is None else sf.view(torch.float32), shape)

    def _expect(self, tensor, name: str, shape: tuple[int, ...], device: torch.device,
                stored: torch.dtype) -> torch.Tensor:
        """``tensor`` checked for ``load_weights`` onto ``device``: a dense float tensor of ``shape``
        (float16 or wider) holding finite values within the range of ``stored``, the dtype it is cast
        to; meta tensors only for a meta ``device``."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor of shape {shape}, got {type(tensor).__name__}")
        _check_dense(name, tensor)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if not tensor.is_floating_point() or tensor.dtype.itemsize < 2:
            raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 tensor, got {tensor.dtype}")
        if tensor.device.type == "meta":
            if device.type != "meta":
                raise ValueError(f"{name} is on the meta device (no values) but the weights load onto {device}: "
                                 "pass the checkpoint's tensors")
            return tensor
        # NaN or inf cannot be quantized (the scale of its FP8 block or FP4 group becomes NaN) and
        # would reach every token routed there, as would a value that the cast to ``stored`` turns
        # into inf: one pass at load, over views of about 2^26 values along the first dim (no copy
        # of a strided checkpoint tensor, no temporary the size of a step).
        limit = torch.finfo(stored).max
        if not tensor.numel():
            return tensor
        parts = tensor.split(max(1, (1 << 26) // tensor[0].numel())) if tensor.dim() else (tensor,)
        for part in parts:
            lowest, highest = torch.aminmax(part)  # both NaN where any value is
            largest = max(-float(lowest), float(highest))
            if not math.isfinite(largest):
                raise ValueError(f"{name} must hold finite values, got NaN or inf")
            if largest > limit:
                raise ValueError(f"{name} holds a value of magnitude {largest:.4g}, beyond the range of "
                                 f"{stored} ({limit:.4g}) that it is cast to")
        return tensor

    def _stored_dtype(self) -> torch.dtype:
        """The dtype expert weights are cast to: the layer dtype for "bf16" weights; float32 for FP8
        and FP4 ones (their quantizers compute in float32, the scales absorbing the magnitude)."""
        return self.dtype if self.weights == "bf16" else torch.float32

    def _local_slice(self, tensor, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """Full-E tensors are cut to this rank's experts; E_local tensors are taken as they are."""
        e, e_local = self.num_experts, self.num_local_experts
        if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided and tensor.dim() == 3 and tensor.shape[0] == e:
            tensor = tensor[self.placement.first_expert: self.placement.first_expert + e_local]
        return self._expect(tensor, name, (e_local, rows, cols), device, self._stored_dtype())

    def load_weights(self, *, router_weight, gate_up, down, score_bias=None, shared_gate_up=None,
                     shared_down=None, shared_gate=None, device=None) -> "MegaMoELayer":
        """Load (and quantize per ``weights``) the block's weights; returns ``self``.

        ``router_weight`` [E, H]; ``gate_up`` [E or E_local, 2I, H] (rows [0, I) gate, [I, 2I) up);
        ``down`` [E or E_local, H, I]; ``score_bias`` [E] (needed iff ``router.use_score_bias``);
        ``shared_gate_up`` [2Is, H] and ``shared_down`` [H, Is] (needed iff
        ``shared_intermediate_size``); ``shared_gate`` [1, H] (needed iff ``shared_expert_gate``).
        ``device``: where the weights live (default: the construction device).
        """
        h, i, e, s = self.hidden_size, self.intermediate_size, self.num_experts, self.shared_intermediate_size
        device = as_device(device, "device") if device is not None else self._default_device
        if device != self._default_device:
            # "auto" picks by device: weights loaded elsewhere than the layer was built may change the pick.
            self.backend_name = resolve_backend(self._backend_request, self._problem(device))
        # The gate keeps the precision its logits are computed in (DeepSeek-V3's is float32 even in
        # bf16 models): rounding it to the layer dtype can flip near-tied routing decisions.
        gate_dtype = self.router_config.logits_dtype or torch.float32
        # Everything is checked and quantized before any buffer changes: a bad argument leaves the
        # layer as it was (a half-replaced layer would keep serving mixed weights).
        router = self._expect(router_weight, "router_weight", (e, h), device, gate_dtype).to(device=device, dtype=gate_dtype)
        if self.router_config.use_score_bias:
            if score_bias is None:
                raise ValueError("router.use_score_bias=True needs score_bias [E]")
            bias = self._expect(score_bias, "score_bias", (e,), device, torch.float32).to(device=device, dtype=torch.float32)
        elif score_bias is not None:
            raise ValueError("score_bias was given but router.use_score_bias is False")
        else:
            bias = None
        w13 = self._local_slice(gate_up, "gate_up", 2 * i, h, device).to(device)
        w2 = self._local_slice(down, "down", h, i, device).to(device)
        if (shared_gate_up is None) != (s == 0) or (shared_down is None) != (s == 0):
            raise ValueError(f"shared_gate_up and shared_down are needed iff shared_intermediate_size > 0 "
                             f"(it is {s})")
        if s:
            sw13 = self._expect(shared_gate_up, "shared_gate_up", (2 * s, h), device, self._stored_dtype()).to(device)
            sw2 = self._expect(shared_down, "shared_down", (h, s), device, self._stored_dtype()).to(device)
        if (shared_gate is None) == self.shared_expert_gate:
            raise ValueError(f"shared_gate [1, H] is needed iff shared_expert_gate=True (it is {self.shared_expert_gate})")
        gate = None if shared_gate is None else \
            self._expect(shared_gate, "shared_gate", (1, h), device, self.dtype).to(device=device, dtype=self.dtype)
        stored = {"w13": quantize_expert_weight(w13, self.weights, self.dtype),
                  "w2": quantize_expert_weight(w2, self.weights, self.dtype)}
        if s:
            stored["shared_w13"] = quantize_expert_weight(sw13.unsqueeze(0), self.weights, self.dtype)
            stored["shared_w2"] = quantize_expert_weight(sw2.unsqueeze(0), self.weights, self.dtype)
        self.register_buffer("router_weight", router)
        self.register_buffer("score_bias", bias)
        for prefix, weight in stored.items():
            self._store(prefix, weight)
        self.register_buffer("shared_gate_weight", gate)
        self._backend_cache = None
        self.loaded = True
        return self

    # Buffers whose dtype module.to(dtype) / .half() must not change (the gate's logits are computed
    # in their dtype; rounding them flips near-tied routing decisions). Devices still move.
    _kKeepDtype = ("router_weight", "score_bias")

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers[name] for name in self._kKeepDtype if self._buffers.get(name) is not None}
        result = super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(device=after.device)
        return result

    @contextlib.contextmanager
    def use_backend(self, backend: str):
        """Run forwards on ``backend`` inside the block (e.g. ``"reference"`` for a spot check of
        the served backend), then go back to the previous one with its cached state."""
        saved = (self.backend_name, self._backend_cache)
        self.backend_name = resolve_backend(backend, self._problem(self.device))
        self._backend_cache = None
        try:
            yield self
        finally:
            self.backend_name, self._backend_cache = saved

    def _backend(self, device: torch.device):
        # Rebuilt when the weight tensors change (load_weights, module.to(...), load_state_dict).
        # In-place updates (load_state_dict) bump the tensors' versions: the backends' converted
        # copies (FP4 scales, decode layouts) are rebuilt from the new values.
        tensors = [t for t in (self.w13_data, self.w2_data, self.w13_sf, self.w2_sf) if t is not None]
        key = (device, *((t.data_ptr(), t._version) for t in tensors))
        if self._backend_cache is None or self._backend_cache[0] != key:
            experts = LocalExperts(self._restore("w13"), self._restore("w2"), self.placement.first_expert)
            pair = create_backend(self.backend_name, self._problem(device), experts, self.ep_group)
            decode = StagedDecode.maybe(*pair) if self.backend_name == "staged" else None
            self._backend_cache = (key, pair, decode)
        return self._backend_cache[1]

    def _decode(self) -> StagedDecode | None:
        """The staged backend's raw-launch decode forward for this layer, if it has one (after
        _backend, which builds it)."""
        return self._backend_cache[2] if self._backend_cache is not None else None

    def _shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [T, H]: the shared experts (same numerics as a routed expert with weight 1)."""
        w13, w2 = self._restore("shared_w13"), self._restore("shared_w2")
        if self.weights == "bf16":
            rows = x.float()
        else:
            rows = dequantize_per_token(*quantize_activations(x), gran_k=128)
        ones = torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
        y = expert_mlp(rows, ones, w13.dequantize(0), w2.dequantize(0), self.weights, self.dtype)
        y = y.to(self.dtype).float()
        if self.shared_gate_weight is not None:
            gate = torch.nn.functional.linear(x.float(), self.shared_gate_weight.float()).sigmoid()
            y = y * gate
        return y

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` [..., H] floating point -> [..., H] of the same dtype: routed experts
        (plus shared experts) of every token. Under expert parallelism every rank of ``ep_group``
        must call it, with zero tokens if it has none; more than ``num_max_tokens_per_rank``
        tokens is an error. That error and the other input checks here are local: a rank that
        raises leaves its peers waiting in the backend's collectives until the process group's
        timeout, so split batches to the capacity before calling under expert parallelism (the
        staged backend's own checks, on expert ids and buffer sizes, raise on every rank together).
        fp16 and fp64 activations run as float32 and come back in their dtype."""
        if not self.loaded:
            raise RuntimeError("MegaMoELayer.forward before load_weights()")
        if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
            raise TypeError(f"hidden_states must be a float tensor, got {getattr(hidden_states, 'dtype', None)}")
        _check_dense("hidden_states", hidden_states)
        if hidden_states.dtype.itemsize < 2:  # FP8 activations would come back as FP8 expert outputs
            raise TypeError(f"hidden_states must be float16, bfloat16, float32 or float64, got {hidden_states.dtype}")
        if hidden_states.dim() == 0 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [..., hidden_size={self.hidden_size}], "
                             f"got shape {tuple(hidden_states.shape)}")
        device = self.router_weight.device
        if hidden_states.device != device:
            raise ValueError(f"hidden_states is on {hidden_states.device} but the layer's weights are on {device}")
        if device.type == "meta":
            raise ValueError("hidden_states and the layer's weights are on the meta device: the forward computes "
                             "values (move the layer to a CPU or CUDA device)")
        shape, out_dtype = hidden_states.shape, hidden_states.dtype
        # A lazily negated view (the negative bit, as conj().imag gives) would reach the kernels as its
        # unnegated memory: its values are materialised once here.
        x = hidden_states.reshape(-1, self.hidden_size).resolve_neg()
        if x.dtype not in (torch.bfloat16, torch.float32):  # the kernels take bf16 or fp32 activations
            x = x.float()
        if x.shape[0] > self.num_max_tokens_per_rank:
            raise ValueError(f"{x.shape[0]} tokens on this rank exceed num_max_tokens_per_rank="
                             f"{self.num_max_tokens_per_rank}: split the batch or build the layer with a "
                             "larger capacity")
        routing = route(router_logits(x, self.router_weight, self.router_config), self.top_k, self.router_config,
                        self.score_bias)
        dispatch_combine, experts = self._backend(device)
        shared = self.shared_intermediate_size > 0
        decode = self._decode()
        if decode is not None and decode.applies(x):
            # One rank's decode in raw launches, the router's ids (in range) as they are.
            y = decode.forward(x, routing.topk_idx, routing.topk_weights, torch.float32 if shared else x.dtype)
        else:
            # The router's ids are in range by construction: backends may skip checking them.
            dispatched = dispatch_combine.dispatch(x, routing.topk_idx, routing.topk_weights, ids_checked=True)
            if shared:
                dispatched.handle.out_dtype = torch.float32
            y = dispatch_combine.combine(experts.apply(dispatched), dispatched.handle)
        if shared:
            y = y + self._shared_forward(x)
        return y.to(out_dtype).reshape(shape)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts} "
                f"({self.num_local_experts} local), top_k={self.top_k}, shared={self.shared_intermediate_size}, "
                f"weights={self.weights}, backend={self.backend_name}")
