"""Expert weights quantized at load time from bf16 (or any float) checkpoints.

Formats (``ExpertWeight.format``):

* ``"bf16"``: ``data`` [E, N, K] in the layer's dtype, no scales;
* ``"fp8"``: ``data`` float8_e4m3fn [E, N, K], ``sf`` float32 [E, ceil(N/128), ceil(K/128)] (one
  scale per 128x128 block, ``kernels.reference.quant.per_block_cast_to_fp8``);
* ``"fp4"``: ``data`` uint8 [E, N, K/2] packed E2M1, ``sf`` float32 [E, N, ceil(K/32)] UE8M0
  (``kernels.reference.fp4.per_token_cast_to_fp4`` along K).

N is the output dimension and K the reduction dimension (``nn.Linear`` order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference.fp4 import cast_back_from_fp4, per_token_cast_to_fp4
from kernels.reference.quant import dequantize_per_block, per_block_cast_to_fp8

kWeightFormats = ("bf16", "fp8", "fp4")
kFp8Block = 128
kFp4Gran = 32
# Experts quantized per call: bounds the float32 staging copy (a DeepSeek-V3 expert's gate_up is
# 4096 x 7168, 117 MB in float32) without a Python loop per expert for small models.
kExpertsPerChunk = 8


@dataclass
class ExpertWeight:
    """One projection of a set of experts (gate_up or down) in one format."""

    format: str
    data: torch.Tensor
    sf: torch.Tensor | None
    shape: tuple[int, int, int]

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def dequantize(self, expert: int) -> torch.Tensor:
        """float32 [N, K] of local expert ``expert``."""
        if self.format == "bf16":
            return self.data[expert].float()
        if self.format == "fp8":
            return dequantize_per_block(self.data[expert], self.sf[expert], kFp8Block)
        return cast_back_from_fp4(self.data[expert], self.sf[expert], kFp4Gran)

    def to(self, device) -> "ExpertWeight":
        return ExpertWeight(self.format, self.data.to(device),
                            None if self.sf is None else self.sf.to(device), self.shape)


def quantize_expert_weight(w: torch.Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16,
                           use_ue8m0: bool = False) -> ExpertWeight:
    """Quantize ``w`` [E, N, K] (any float dtype) to ``fmt`` (see the module docstring).

    ``dtype`` is the storage dtype of ``"bf16"`` weights; ``use_ue8m0`` rounds FP8 block scales up
    to powers of two (Blackwell's layout wants them; FP4 scales are always UE8M0).
    """
    if fmt not in kWeightFormats:
        raise ValueError(f"weights must be one of {kWeightFormats}, got {fmt!r}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_floating_point():
        raise ValueError(f"expert weights must be a float tensor [E, N, K], got "
                         f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    shape = tuple(w.shape)
    if fmt == "bf16":
        return ExpertWeight(fmt, w.to(dtype).contiguous(), None, shape)
    if fmt == "fp4" and shape[2] % 2 != 0:
        raise ValueError(f"FP4 weights pack two values per byte along K: K must be even, got {shape[2]}")
    datas, sfs = [], []
    for start in range(0, shape[0], kExpertsPerChunk):
        chunk = w[start: start + kExpertsPerChunk]
        if fmt == "fp8":
            data, sf = per_block_cast_to_fp8(chunk, use_ue8m0=use_ue8m0, block=kFp8Block)
        else:
            data, sf = per_token_cast_to_fp4(chunk, use_ue8m0=True, gran_k=kFp4Gran)
        datas.append(data)
        sfs.append(sf)
    return ExpertWeight(fmt, torch.cat(datas), torch.cat(sfs), shape)
