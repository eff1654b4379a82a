"""Pure-torch references of the FP4 (E2M1) quantizers.

FP4 weights are E2M1 codes packed two per byte with one scale per ``1 x gran_k`` group (MXFP4
style). The GPU quantizer and the in-kernel FP4 -> FP8 conversion reproduce this bit for bit, so
every step is spelled out:

* amax is taken over the group in float32 and clamped to ``1e-4``;
* ``sf = amax / 6`` in float32 (6 is the largest E2M1 magnitude), rounded up to a power of two
  when ``use_ue8m0`` (exactly, through ``frexp``: see ``kernels.reference.quant.ceil_to_ue8m0``);
* values are multiplied by the float32 reciprocal ``1 / sf`` and rounded to the nearest E2M1
  magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}; a tie goes to the even code (the one whose mantissa
  bit is 0), as the hardware's round-to-nearest-even conversion does; magnitudes above 6 (only
  possible through the reciprocal's rounding without UE8M0) saturate to 6;
* the sign bit is taken from the input's sign bit, so small negative values become -0.

Code layout: bit 3 is the sign, bits 0-2 index the magnitude table. Packing: element ``2 j`` of
a row goes to the low nibble of byte ``j``, element ``2 j + 1`` to the high nibble.
"""

from __future__ import annotations

import functools

import torch

from kernels.reference.quant import AMAX_FLOOR, ceil_to_ue8m0

FP4_E2M1_MAX = 6.0
kE2M1Magnitudes = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes; the boundary after an odd code rounds up on a tie
# (to the even code above it), the boundary after an even code rounds down.
_kMidpoints = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check_gran(gran_k: int) -> None:
    if not isinstance(gran_k, int) or gran_k <= 0 or gran_k % 2 != 0:
        raise ValueError(f"gran_k must be a positive even int, got {gran_k!r}")


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale -> uint8 E2M1 codes (0..15)."""
    a = v.abs()
    mag = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, mid in enumerate(_kMidpoints):
        above = (a >= mid) if i % 2 == 1 else (a > mid)
        mag += above.to(torch.uint8)
    sign = torch.signbit(v).to(torch.uint8) << 3
    return mag | sign


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """Made once per device: a host-to-device copy per call would also break CUDA graph capture."""
    with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
        mags = torch.tensor(kE2M1Magnitudes, dtype=torch.float32, device=device)
        return torch.cat([mags, -mags])


def per_token_cast_to_fp4(x: torch.Tensor, use_ue8m0: bool = True, gran_k: int = 32):
    """Quantize the last dimension of ``x`` to packed E2M1 with one scale per ``1 x gran_k``.

    ``x``: [m, n] or [g, m, n] (any number of leading dims), bfloat16 / float16 / float32, ``n``
    even. Returns ``(packed uint8 [..., m, n / 2], sf float32 [..., m, ceil(n / gran_k)])``. A last
    partial group is padded with zeros for the amax.
    """
    _check_gran(gran_k)
    if not x.is_floating_point() or x.dtype.itemsize < 2:
        raise TypeError(f"per_token_cast_to_fp4: x must be float32/bfloat16/float16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"per_token_cast_to_fp4: x must have >= 2 dims, got shape {tuple(x.shape)}")
    n = x.shape[-1]
    if n % 2 != 0:
        raise ValueError(f"per_token_cast_to_fp4: the last dim of x must be even (two codes per byte), got {n}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, n)
    m = rows.shape[0]
    num_groups = (n + gran_k - 1) // gran_k
    padded = torch.zeros((m, num_groups * gran_k), dtype=torch.float32, device=x.device)
    padded[:, :n] = rows.float()
    view = padded.view(m, num_groups, gran_k)
    amax = view.abs().amax(dim=2).clamp(min=AMAX_FLOOR)
    # Divide by a tensor on x's device: torch on CUDA turns ``tensor / python_scalar`` into a
    # multiply by the float32 reciprocal, which differs from the IEEE quotient by an ulp for about
    # a third of the inputs (the UE8M0 ceiling hides it, the plain scales do not).
    sf = amax / torch.full_like(amax, FP4_E2M1_MAX)
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    scaled = view * (1.0 / sf).unsqueeze(2)
    codes = _e2m1_codes(scaled).view(m, num_groups * gran_k)[:, :n]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.reshape(*lead, n // 2).contiguous(), sf.reshape(*lead, num_groups)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [..., n / 2] -> float32 E2M1 values [..., n] (unscaled)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8 (two E2M1 codes per byte), got {packed.dtype}")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return _e2m1_table(packed.device)[codes.long()]


def cast_back_from_fp4(packed: torch.Tensor, sf: torch.Tensor, gran_k: int = 32) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp4` in float32.

    ``packed`` uint8 [..., m, n / 2], ``sf`` float32 [..., m, ceil(n / gran_k)]. Returns float32
    [..., m, n].
    """
    _check_gran(gran_k)
    values = unpack_fp4(packed)
    n = values.shape[-1]
    expected = (*packed.shape[:-1], (n + gran_k - 1) // gran_k)
    if tuple(sf.shape) != expected:
        raise ValueError(f"sf must have shape {expected} for packed {tuple(packed.shape)} and gran_k={gran_k}, "
                         f"got {tuple(sf.shape)}")
    sf_full = sf.float().repeat_interleave(gran_k, dim=-1)[..., :n]
    return values * sf_full


HEADROOM_LOG2 = 6  # E2M1's largest magnitude 6 times 2^6 = 384 stays under E4M3's 448
MAX_EXACT_STAGED_SHIFT = 14  # groups up to 2^14 below their block's largest scale convert exactly


def cast_fp4_to_fp8_blocks(packed: torch.Tensor, sf_bytes: torch.Tensor,
                           block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 weights -> E4M3 weights with one float32 scale per ``block x block``.

    ``packed`` uint8 [g, n, k / 2] (two E2M1 codes per byte), ``sf_bytes`` uint8 [g, n, k / 32]
    (UE8M0 exponents, value ``2^(byte - 127)``), ``k`` a multiple of ``block``. Returns ``(E4M3
    [g, n, k], sf float32 [g, ceil(n / block), k / block])``. Block ``(nb, kb)`` takes the largest
    exponent ``e_ref`` of its groups, its scale is ``2^(e_ref - 127 - 6)``, and an element ``v`` of a
    group with exponent ``e`` becomes ``E4M3(v * 2^(6 - (e_ref - e)))`` rounded to nearest even: exact
    while ``e_ref - e <= 14``, rounded to E4M3's subnormal step (``2^-9`` of ``2^(e_ref - 133)``)
    below that.
    """
    g, n, half_k = packed.shape
    k = half_k * 2
    if k % block or tuple(sf_bytes.shape) != (g, n, k // 32):
        raise ValueError(f"cast_fp4_to_fp8_blocks: k = {k} must be a multiple of {block} and sf_bytes of shape "
                         f"{[g, n, k // 32]}, got {list(sf_bytes.shape)}")
    nb, kb = (n + block - 1) // block, k // block
    e = sf_bytes.to(torch.int32)
    padded = torch.zeros((g, nb * block, k // 32), dtype=torch.int32, device=e.device)
    padded[:, :n] = e
    e_ref = padded.view(g, nb, block, kb, block // 32).amax(dim=(2, 4))  # [g, nb, kb]
    e_ref_groups = e_ref.repeat_interleave(block, dim=1)[:, :n].repeat_interleave(block // 32, dim=2)
    shift = (HEADROOM_LOG2 - (e_ref_groups - e).clamp(max=24)).repeat_interleave(32, dim=2)
    # Powers of two times values with at most two significant bits: the products are exact.
    values = torch.ldexp(unpack_fp4(packed), shift.float())
    sf = torch.ldexp(torch.ones_like(e_ref, dtype=torch.float32), (e_ref - 127 - HEADROOM_LOG2).float())
    return values.to(torch.float8_e4m3fn), sf
