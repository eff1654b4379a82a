"""Pure-torch references of the quantization kernels.

These are the CPU path of the public functions and the oracle of the GPU tests. They run on any
device. The GPU kernels reproduce them bit for bit, so every rounding step here is spelled out:

* amax is taken over the group in float32 and clamped to ``1e-4`` (an all-zero group gets a
  finite scale);
* ``sf = amax / 448`` in float32, optionally rounded up to a power of two (UE8M0);
* values are multiplied by the float32 reciprocal ``1 / sf`` and cast to E4M3 with
  round-to-nearest-even.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round positive float32 values up to the next power of two (exact, bit-level).

    ``x`` float32, any shape, values > 0 (NaN and +inf are returned unchanged, as the kernels
    do). Returns float32 of the same shape. A value that is already a power of two is returned
    unchanged. Computed with ``frexp`` rather than ``log2``
    so that a value one ulp above a power of two rounds up on every device.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"ceil_to_ue8m0: x must be float32, got {x.dtype}")
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    exact = mantissa == 0.5
    exponent = torch.where(exact, exponent - 1, exponent)
    # NaN and inf pass through, as in the kernels (frexp's exponent of them is 0: a false 1.0).
    return torch.where(torch.isfinite(x), torch.ldexp(torch.ones_like(x), exponent), x)


def _scale_from_amax(amax: torch.Tensor, use_ue8m0: bool) -> torch.Tensor:
    sf = amax.clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = 128):
    """Quantize rows of ``x`` to E4M3 with one float32 scale per ``1 x gran_k`` group.

    ``x``: [m, n] bfloat16 / float16 / float32. Returns ``(x_fp8 [m, n] float8_e4m3fn,
    sf [m, ceil(n / gran_k)] float32)``. A last partial group is padded with zeros for the amax.
    """
    m, n = x.shape
    num_groups = _ceil_div(n, gran_k)
    padded = torch.zeros((m, num_groups * gran_k), dtype=torch.float32, device=x.device)
    padded[:, :n] = x.float()
    view = padded.view(m, num_groups, gran_k)
    sf = _scale_from_amax(view.abs().amax(dim=2), use_ue8m0)
    x_fp8 = (view * (1.0 / sf).unsqueeze(2)).to(torch.float8_e4m3fn)
    return x_fp8.view(m, num_groups * gran_k)[:, :n].contiguous(), sf


def per_block_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False, block: int = 128):
    """Quantize ``x`` to E4M3 with one float32 scale per ``block x block`` tile (weights).

    ``x``: [n, k] or [g, n, k], bfloat16 / float16 / float32. Returns ``(x_fp8, sf)`` with
    ``x_fp8`` of the shape of ``x`` and ``sf`` [(g,) ceil(n / block), ceil(k / block)] float32.
    Partial tiles at the edges are padded with zeros for the amax.
    """
    batched = x.dim() == 3
    xb = x if batched else x.unsqueeze(0)
    g, n, k = xb.shape
    nb, kb = _ceil_div(n, block), _ceil_div(k, block)
    padded = torch.zeros((g, nb * block, kb * block), dtype=torch.float32, device=x.device)
    padded[:, :n, :k] = xb.float()
    view = padded.view(g, nb, block, kb, block)
    sf = _scale_from_amax(view.abs().amax(dim=(2, 4)), use_ue8m0)
    x_fp8 = (view * (1.0 / sf)[:, :, None, :, None]).to(torch.float8_e4m3fn)
    x_fp8 = x_fp8.view(g, nb * block, kb * block)[:, :n, :k].contiguous()
    if not batched:
        return x_fp8[0], sf[0]
    return x_fp8, sf


def dequantize_per_token(x_fp8: torch.Tensor, sf: torch.Tensor, gran_k: int = 128) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp8` in float32: [m, n]."""
    n = x_fp8.shape[-1]
    sf_full = sf.repeat_interleave(gran_k, dim=-1)[..., :n]
    return x_fp8.float() * sf_full


def dequantize_per_block(x_fp8: torch.Tensor, sf: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of :func:`per_block_cast_to_fp8` in float32, [(g,) n, k]."""
    n, k = x_fp8.shape[-2:]
    sf_full = sf.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return x_fp8.float() * sf_full[..., :n, :k]
