"""The stack of MoE layers that the server runs, with random or checkpoint weights.

Each served layer is the MLP half of a transformer block, ``h = h + moe(rms_norm(h))``, so that
activations keep a sane scale through many layers. Random weights are drawn per expert from a
generator seeded by ``(seed, layer, expert)``: a rank draws only its own experts, and the model is
the same whatever the expert-parallel size, so runs at different EP sizes are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import MoELayerWeights, SafetensorsCheckpoint, read_moe_layer
from .config import MoEModelConfig


def _generator(device: torch.device, *key: int) -> torch.Generator:
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + part) % (2**63 - 1)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _randn(shape, std: float, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std).to(dtype)


def random_layer_weights(config: MoEModelConfig, layer_index: int, experts: range, *, seed: int,
                         dtype: torch.dtype, device: torch.device) -> MoELayerWeights:
    """Random weights of one layer (``experts`` only for the routed experts).

    Standard deviations ``1/sqrt(fan_in)`` keep every projection's output at unit scale; the router
    is twice that so that routing is decisive rather than a near tie between experts.
    """
    h, i = config.hidden_size, config.intermediate_size
    shared = _generator(device, seed, layer_index, 1 << 20)
    router = _randn((config.num_experts, h), 2 / h**0.5, torch.float32, device, shared)
    bias = _randn((config.num_experts,), 0.1, torch.float32, device, shared) if config.use_score_bias else None
    gate_up = torch.empty((len(experts), 2 * i, h), dtype=dtype, device=device)
    down = torch.empty((len(experts), h, i), dtype=dtype, device=device)
    for slot, expert in enumerate(experts):
        generator = _generator(device, seed, layer_index, expert)
        gate_up[slot] = _randn((2 * i, h), 1 / h**0.5, dtype, device, generator)
        down[slot] = _randn((h, i), 1 / i**0.5, dtype, device, generator)
    weights = MoELayerWeights(router, gate_up, down, bias, layer_index=layer_index)
    si = config.shared_intermediate_size
    if si:
        weights.shared_gate_up = _randn((2 * si, h), 1 / h**0.5, dtype, device, shared)
        weights.shared_down = _randn((h, si), 1 / si**0.5, dtype, device, shared)
    if config.shared_expert_gate:
        weights.shared_gate = _randn((1, h), 1 / h**0.5, dtype, device, shared)
    return weights


@dataclass(frozen=True)
class StackSpec:
    """What the served stack is made of (recorded in the metrics)."""

    config: MoEModelConfig
    num_layers: int
    backend: str
    weights: str
    layer_indices: tuple[int, ...]
    source: str


class MoEStack(nn.Module):
    """``num_layers`` MoE layers applied as residual MLP blocks.

    ``forward(x [T, H]) -> [T, H]`` in ``dtype``; a collective over ``ep_group`` (every rank must
    call it, with 0 tokens when it has none).
    """

    def __init__(self, layers: list[nn.Module], spec: StackSpec):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.spec = spec

    @staticmethod
    def block_input(hidden: torch.Tensor) -> torch.Tensor:
        """What a layer sees of the residual stream: RMS-normalised (no learned gain)."""
        return F.rms_norm(hidden, (hidden.shape[-1],))

    def forward(self, x: torch.Tensor, layer_io: list | None = None) -> torch.Tensor:
        """``layer_io``: when a list, each layer's ``(input, output)`` is appended to it (what a
        reference spot-check compares, without running the served layers a second time)."""
        hidden = x
        for layer in self.layers:
            block_input = self.block_input(hidden)
            out = layer(block_input)
            if layer_io is not None:
                layer_io.append((block_input, out))
            hidden = hidden + out
        return hidden


def _make_layer(config: MoEModelConfig, *, backend: str, weights: str, ep_group, capacity: int,
                dtype: torch.dtype, device: torch.device) -> nn.Module:
    from moe_runtime import MegaMoELayer
    return MegaMoELayer(config.hidden_size, config.intermediate_size, config.num_experts, config.top_k,
                        router=config.router_config(), shared_intermediate_size=config.shared_intermediate_size,
                        shared_expert_gate=config.shared_expert_gate, weights=weights, backend=backend,
                        ep_group=ep_group, num_max_tokens_per_rank=capacity, dtype=dtype, device=device)


def build_stack(config: MoEModelConfig, *, num_layers: int | None, backend: str, weights: str, ep_group,
                experts: range, capacity: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
                checkpoint: SafetensorsCheckpoint | None = None) -> MoEStack:
    """Build the served layers, loading only ``experts`` on this rank.

    With ``checkpoint``, its first ``num_layers`` MoE layers (all when None); otherwise
    ``num_layers`` layers of random weights.
    """
    if checkpoint is not None:
        available = checkpoint.moe_layers(config.num_hidden_layers)
        if not available:
            raise ValueError(f"checkpoint {checkpoint.directory}: found no MoE layers (no '.experts.' tensors)")
        if num_layers is not None and num_layers > len(available):
            raise ValueError(f"layers: {num_layers} requested but checkpoint {checkpoint.directory} has "
                             f"{len(available)} MoE layers")
        chosen = available[:num_layers] if num_layers is not None else available
        source = f"checkpoint:{checkpoint.directory}"
    else:
        if num_layers is None or num_layers < 1:
            raise ValueError(f"layers: expected >= 1, got {num_layers}")
        chosen = [(index, None) for index in range(num_layers)]
        source = f"random:seed={seed}"
    layers = []
    for index, prefix in chosen:
        if checkpoint is not None:
            tensors = read_moe_layer(checkpoint, index, prefix, experts, dtype=dtype, device=device,
                                     family=config.family)
        else:
            tensors = random_layer_weights(config, index, experts, seed=seed, dtype=dtype, device=device)
        layer = _make_layer(config, backend=backend, weights=weights, ep_group=ep_group, capacity=capacity,
                            dtype=dtype, device=device)
        layer.load_weights(**tensors.load_kwargs())
        layers.append(layer)
        del tensors
    spec = StackSpec(config, len(layers), backend, weights, tuple(i for i, _ in chosen), source)
    return MoEStack(layers, spec)
