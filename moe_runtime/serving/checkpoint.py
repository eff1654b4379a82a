"""Read the MoE layers of a safetensors checkpoint in the transformers layout, one rank's experts only.

Tensor names understood, for a layer prefix ``P`` = ``model.layers.{i}.mlp`` (or
``...block_sparse_moe``, Mixtral's older name, or ``...feed_forward``, LFM2-MoE's):

* router ``P.gate.weight`` [E, H]; DeepSeek-V3 bias ``P.gate.e_score_correction_bias`` [E] (other
  families' router, bias and shared-expert names from ``moe_runtime.integrations.hf``'s table, by
  ``read_moe_layer(family=...)``);
* experts fused as transformers 5 keeps them in memory: ``P.experts.gate_up_proj`` [E, 2I, H] and
  ``P.experts.down_proj`` [E, H, I] (read with a slice, so only this rank's rows leave the disk);
* or per expert: ``P.experts.{e}.{gate,up,down}_proj.weight`` (Qwen, DeepSeek) or
  ``P.experts.{e}.{w1,w3,w2}.weight`` (Mixtral);
* shared experts ``P.shared_experts.*`` (DeepSeek-V3) or ``P.shared_expert.*`` plus
  ``P.shared_expert_gate.weight`` [1, H] (Qwen2-MoE).

FP8 checkpoints (DeepSeek-V3's release: E4M3 weights plus ``<name>_scale_inv`` float32 per 128x128
block) are dequantized here; ``MegaMoELayer.load_weights`` then quantizes per ``weights``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_runtime.layer import MoEBlockWeights

kScaleBlock = 128
_LAYER_RE = re.compile(r"^(.*\.layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward))\.experts\.")
_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass
class MoELayerWeights(MoEBlockWeights):
    """One layer's tensors in ``MegaMoELayer.load_weights`` order; experts are this rank's only.

    ``gate_up`` [E_local, 2I, H] (rows [0, I) gate, [I, 2I) up), ``down`` [E_local, H, I], in
    ``dtype``; router and bias stay float32 so that routing is not perturbed by rounding.
    """

    layer_index: int = -1


class SafetensorsCheckpoint:
    """Index of a checkpoint directory's ``*.safetensors`` files; opens a file only when read."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open
        self._safe_open = safe_open
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint: {directory} is not a directory")
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.directory / file for name, file in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"checkpoint: {directory} holds no *.safetensors files")
            self._file_of = {}
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    self._file_of.update((name, file) for name in handle.keys())
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"checkpoint {self.directory}: no tensor named {name!r}")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = self._safe_open(str(file), framework="pt")
        return self._handles[file]

    def moe_layers(self, num_hidden_layers: int | None = None) -> list[tuple[int, str]]:
        """``(layer index, prefix)`` of every decoder layer with routed experts, by layer index.

        Not served: multi-token-prediction layers, under ``mtp.`` (Qwen3-Next, Qwen3.5) or numbered
        from ``num_hidden_layers`` on (DeepSeek-V3, GLM-4.5). Two prefixes of one index raise."""
        found: dict[int, str] = {}
        for name in self._file_of:
            match = _LAYER_RE.match(name)
            if not match or match.group(1).startswith("mtp.") or ".mtp." in match.group(1):
                continue
            index, prefix = int(match.group(2)), match.group(1)
            if num_hidden_layers is not None and index >= num_hidden_layers:
                continue
            if found.setdefault(index, prefix) != prefix:
                raise ValueError(f"checkpoint {self.directory}: layer {index} has experts under two prefixes, "
                                 f"{found[index]} and {prefix}")
        return sorted(found.items())

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name`` (only ``rows`` of its first dimension when given), FP8 dequantized."""
        handle = self._handle(name)
        tensor = handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = f"{name}_scale_inv"
            if scale_name not in self:
                raise ValueError(f"checkpoint {self.directory}: {name} is {tensor.dtype} but has no {scale_name}")
            if rows is not None:
                raise NotImplementedError(f"checkpoint: row slices of the FP8 tensor {name} (fused experts stored "
                                          "in FP8) are not supported; store experts per expert or in bf16")
            tensor = _dequantize_blocks(tensor, self.read(scale_name), name)
        return tensor

    def close(self) -> None:
        self._handles.clear()


def _dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
    """E4M3 [N, K] with float32 [ceil(N/128), ceil(K/128)] block scales -> float32 [N, K]."""
    n, k = weight.shape[-2:]
    expected = ((n + kScaleBlock - 1) // kScaleBlock, (k + kScaleBlock - 1) // kScaleBlock)
    if tuple(scale_inv.shape[-2:]) != expected:
        raise ValueError(f"checkpoint: {name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} "
                         f"for a {tuple(weight.shape)} weight with {kScaleBlock}x{kScaleBlock} blocks")
    scale = scale_inv.float().repeat_interleave(kScaleBlock, -2).repeat_interleave(kScaleBlock, -1)
    return weight.float() * scale[..., :n, :k]


def _per_expert_names(ckpt: SafetensorsCheckpoint, prefix: str) -> tuple[str, str, str]:
    for names in _PROJ_NAMES:
        if f"{prefix}.experts.0.{names[0]}.weight" in ckpt:
            return names
    raise ValueError(f"checkpoint {ckpt.directory}: layer {prefix} has experts in no known layout: expected "
                     f"{prefix}.experts.gate_up_proj or {prefix}.experts.0.gate_proj.weight (or .w1.weight)")


def _read_mlp(ckpt: SafetensorsCheckpoint, prefix: str, dtype: torch.dtype):
    names = [f"{prefix}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    if not all(n in ckpt for n in names):
        return None, None
    gate, up, down = (ckpt.read(n).to(dtype) for n in names)
    return torch.cat([gate, up], dim=0), down


def _layer_names(family: str | None) -> tuple[str, str | None, tuple[str, ...], str | None]:
    """(router weight, choice bias, shared MLPs to try, shared gate) below a layer prefix: the
    family's (``moe_runtime.integrations.hf.kModelTypes``), or DeepSeek's and Qwen's for None."""
    if family is None:
        return "gate.weight", "gate.e_score_correction_bias", ("shared_experts", "shared_expert"), "shared_expert_gate"
    from moe_runtime.integrations.hf import kModelTypes
    fam = kModelTypes.get(family)
    if fam is None:
        raise ValueError(f"family: expected None or one of {sorted(kModelTypes)}, got {family!r}")
    return fam.router_weight, fam.score_bias, (fam.shared,) if fam.shared else (), fam.shared_gate


def read_moe_layer(ckpt: SafetensorsCheckpoint, layer_index: int, prefix: str, experts: range, *,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                   family: str | None = None) -> MoELayerWeights:
    """This rank's part of one MoE layer: the router in full, experts ``experts`` only. ``family``
    (``MoEModelConfig.family``) names where its router, bias and shared expert are."""
    router_name, bias_path, shared_paths, shared_gate_path = _layer_names(family)
    router = ckpt.read(f"{prefix}.{router_name}").float()
    num_experts = router.shape[0]
    if experts.start < 0 or experts.stop > num_experts or experts.step != 1 or len(experts) == 0:
        raise ValueError(f"experts: expected a non-empty contiguous range inside [0, {num_experts}), got {experts}")
    if f"{prefix}.experts.gate_up_proj" in ckpt:
        rows = slice(experts.start, experts.stop)
        gate_up = ckpt.read(f"{prefix}.experts.gate_up_proj", rows).to(dtype)
        down = ckpt.read(f"{prefix}.experts.down_proj", rows).to(dtype)
        # Some releases (Qwen3-VL-MoE) store them transposed, [E, H, 2I] and [E, I, H]; as transformers
        # does on loading, they are turned where the last dimension is not H (where H = 2I, or H = I,
        # the two layouts cannot be told apart by shape and are read as stored).
        hidden = router.shape[1]
        if gate_up.shape[2] != hidden and gate_up.shape[1] == hidden:
            gate_up = gate_up.transpose(1, 2).contiguous()
        if down.shape[1] != hidden and down.shape[2] == hidden:
            down = down.transpose(1, 2).contiguous()
    else:
        gate_name, up_name, down_name = _per_expert_names(ckpt, prefix)
        gate_up = torch.stack([
            torch.cat([ckpt.read(f"{prefix}.experts.{e}.{gate_name}.weight"),
                       ckpt.read(f"{prefix}.experts.{e}.{up_name}.weight")], dim=0).to(dtype)
            for e in experts])
        down = torch.stack([ckpt.read(f"{prefix}.experts.{e}.{down_name}.weight").to(dtype) for e in experts])
    # Checkpoints may keep the bias on the block where the module keeps it on the gate (EXAONE-MoE's
    # e_score_correction_bias, ERNIE's moe_statics): transformers renames them on loading.
    bias_names = [] if bias_path is None else [f"{prefix}.{bias_path}"] + (
        [f"{prefix}.{bias_path.removeprefix('gate.')}"] if bias_path.startswith("gate.") else [])
    bias_name = next((name for name in bias_names if name in ckpt), None)
    bias = ckpt.read(bias_name).float().reshape(-1) if bias_name is not None else None
    shared_gate_up = shared_down = None
    for path in shared_paths:
        shared_gate_up, shared_down = _read_mlp(ckpt, f"{prefix}.{path}", dtype)
        if shared_gate_up is not None:
            break
    gate_name = f"{prefix}.{shared_gate_path}.weight" if shared_gate_path else None
    shared_gate = ckpt.read(gate_name).to(dtype) if gate_name in ckpt else None
    def to(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(device)
    return MoELayerWeights(to(router), to(gate_up), to(down), to(bias), to(shared_gate_up), to(shared_down),
                           to(shared_gate), layer_index=layer_index)
