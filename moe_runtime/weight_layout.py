"""Expert weight layouts for the Mega MoE kernels: gate/up interleave and scale-factor layouts.

Inputs are quantized expert weights in the checkpoint order:

* ``l1 = (gate_up, sf)``: ``gate_up`` [E, 2I, H] with rows ``[0, I)`` gate and ``[I, 2I)`` up;
* ``l2 = (down, sf)``: ``down`` [E, H, I];

each either FP8 (``float8_e4m3fn`` weights, float32 ``sf`` [E, ceil(N/128), ceil(K/128)], one scale
per 128x128 block) or FP4 (``uint8`` packed E2M1 [E, N, K/2], float32 UE8M0 ``sf`` [E, N, ceil(K/32)]).

**Gate/up interleave** (both targets). L1 rows are regrouped in slabs of 16: new rows
``[16j, 16j + 8)`` are gate rows ``[8j, 8j + 8)`` and new rows ``[16j + 8, 16j + 16)`` are up rows
``[8j, 8j + 8)``. A warpgroup MMA hands each thread accumulator columns in groups of 8
(``8 i + 2 (lane % 4) + {0, 1}``), so gate column ``c`` and up column ``c`` land in the same thread
(fragments ``2 s`` and ``2 s + 1``) and SwiGLU runs in registers with no exchange. SwiGLU column
``8j + t`` comes from slab ``j``, so the L1 output is in natural order and L2 needs no permutation.

**SM90 scale layout** (what our Hopper kernels read).
* FP8 L1: a 128-row block of the interleaved weight holds 64 gate rows and 64 up rows that come from
  different 128-row blocks of the original (gate rows ``[64B, 64B + 64)``, up rows
  ``I + [64B, 64B + 64)``), so one scale per new block would be wrong. The scales are stored per new
  block *per half*: ``sf`` float32 [E, 2I/128, 2, ceil(H/128)], where ``[e, B, 0, kb]`` scales the
  gate rows of new block ``B`` and ``[e, B, 1, kb]`` its up rows; row ``r`` of the interleaved
  weight uses ``sf[e, r // 128, (r % 16) >= 8, kb]``, i.e. the parity of the thread's accumulator
  fragment picks the half. Needs ``I % 64 == 0`` (each half then lies in one original block).
* FP8 L2: unchanged (``[E, ceil(H/128), ceil(I/128)]``).
* FP4: the per-row scales follow their rows through the interleave (``[E, 2I, ceil(H/32)]``).

**SM100 scale layout** (Blackwell UTCCP). Scales must be UE8M0 (powers of two). They are expanded
to one scale per row (FP8: the 128x128 block scale repeated over its rows), following the row
interleave; four consecutive K-group exponents (biased, ``2^(b - 127)``) are packed into one int32,
byte ``j`` holding group ``4q + j`` (zero bytes pad the last word); the tensor is MN-major
(stride 1 along rows); and inside every 128-row block the row index ``32a + b`` (a 4x32 view) moves
to ``4b + a`` (32x4), the order UTCCP's 4x32 data-path copy puts scales into tensor memory.
Result: int32 [E, N, ceil(Kg/4)] with strides ``(N * ceil(Kg/4), 1, N)``. Needs ``N % 128 == 0``
(``I % 64 == 0`` for L1, ``H % 128 == 0`` for L2).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.reference.fp4 import cast_back_from_fp4, unpack_fp4
from kernels.reference.quant import dequantize_per_block

kTargets = ("sm90", "sm100")
kInterleaveRows = 8
kBlock = 128
kFp4Gran = 32
kUtccpRows = 128


class WeightPair(NamedTuple):
    """A quantized weight and its scale factors."""

    weight: torch.Tensor
    sf: torch.Tensor


class MegaMoEWeights(NamedTuple):
    """L1 (interleaved gate/up) and L2 (down) weights in a kernel layout."""

    l1: WeightPair
    l2: WeightPair


def _format_of(weight: torch.Tensor, name: str) -> str:
    if weight.dtype == torch.float8_e4m3fn:
        return "fp8"
    if weight.dtype == torch.uint8:
        return "fp4"
    raise TypeError(f"{name} weight must be float8_e4m3fn (FP8) or uint8 (packed FP4), got {weight.dtype}")


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_pair(pair, name: str) -> WeightPair:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name} must be a (weight, sf) pair, got {type(pair).__name__}")
    weight, sf = pair
    if not isinstance(weight, torch.Tensor) or not isinstance(sf, torch.Tensor):
        raise TypeError(f"{name} must hold two tensors")
    if weight.dim() != 3:
        raise ValueError(f"{name} weight must be [E, N, K], got shape {tuple(weight.shape)}")
    return WeightPair(weight, sf)


def _logical_k(weight: torch.Tensor, fmt: str) -> int:
    return weight.shape[2] * 2 if fmt == "fp4" else weight.shape[2]


def _expect_checkpoint_sf(pair: WeightPair, fmt: str, name: str) -> None:
    e, n, _ = pair.weight.shape
    k = _logical_k(pair.weight, fmt)
    if fmt == "fp8":
        expected = (e, _ceil_div(n, kBlock), _ceil_div(k, kBlock))
    else:
        expected = (e, n, _ceil_div(k, kFp4Gran))
    if tuple(pair.sf.shape) != expected or pair.sf.dtype != torch.float32:
        raise ValueError(f"{name} sf must be float32 {expected} for {fmt} weight {tuple(pair.weight.shape)}, "
                         f"got {pair.sf.dtype} {tuple(pair.sf.shape)}")


def interleave_permutation(intermediate: int, device=None) -> torch.Tensor:
    """``perm`` int64 [2I]: row ``r`` of the interleaved L1 weight is row ``perm[r]`` of ``[gate; up]``."""
    if intermediate % kInterleaveRows != 0:
        raise ValueError(f"the gate/up interleave needs intermediate_size % {kInterleaveRows} == 0, "
                         f"got {intermediate}")
    r = torch.arange(2 * intermediate, device=device)
    slab, within = r // (2 * kInterleaveRows), r % (2 * kInterleaveRows)
    gate_row = slab * kInterleaveRows + within
    up_row = intermediate + slab * kInterleaveRows + within - kInterleaveRows
    return torch.where(within < kInterleaveRows, gate_row, up_row)


def _sm90_half_block_index(intermediate: int, device) -> torch.Tensor:
    """int64 [2I/128 * 2]: the original 128-row block of each (new block, half)."""
    num_new_blocks = 2 * intermediate // kBlock
    b = torch.arange(num_new_blocks, device=device)
    gate = (b * (kBlock // 2)) // kBlock
    up = (intermediate + b * (kBlock // 2)) // kBlock
    return torch.stack([gate, up], dim=1).reshape(-1)


def _require_ue8m0(sf: torch.Tensor, name: str) -> None:
    mantissa, _ = torch.frexp(sf)
    if not bool((mantissa == 0.5).all()):
        raise ValueError(f"target='sm100' needs UE8M0 (power-of-two) scale factors in {name}: quantize with "
                         "use_ue8m0=True")


def _pack_ue8m0_utccp(row_sf: torch.Tensor) -> torch.Tensor:
    """Per-row power-of-two float32 [E, N, Kg] -> int32 [E, N, ceil(Kg/4)], MN-major, UTCCP order."""
    e, n, kg = row_sf.shape
    if n % kUtccpRows != 0:
        raise ValueError(f"target='sm100' needs the weight's row count to be a multiple of {kUtccpRows}, got {n}")
    kp = _ceil_div(kg, 4)
    exponents = torch.zeros((e, n, kp * 4), dtype=torch.uint8, device=row_sf.device)
    exponents[..., :kg] = ((row_sf.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    packed = exponents.view(torch.int32)  # little-endian: byte j of word q is group 4q + j
    blocks = packed.view(e, n // kUtccpRows, 4, kUtccpRows // 4, kp).transpose(2, 3).reshape(e, n, kp)
    return blocks.transpose(1, 2).contiguous().transpose(1, 2)


def _unpack_ue8m0_utccp(sf: torch.Tensor, kg: int) -> torch.Tensor:
    """Inverse of :func:`_pack_ue8m0_utccp`: float32 [E, N, Kg]."""
    if sf.dtype != torch.int32 or sf.dim() != 3:
        raise ValueError(f"sm100 sf must be int32 [E, N, ceil(Kg/4)], got {sf.dtype} {tuple(sf.shape)}")
    e, n, kp = sf.shape
    if n % kUtccpRows != 0 or kp != _ceil_div(kg, 4):
        raise ValueError(f"sm100 sf shape {tuple(sf.shape)} does not fit {kg} scale groups per row")
    rows = sf.contiguous().view(e, n // kUtccpRows, kUtccpRows // 4, 4, kp).transpose(2, 3).reshape(e, n, kp)
    exponents = rows.contiguous().view(torch.uint8).view(e, n, kp * 4)[..., :kg].to(torch.int32)
    return torch.ldexp(torch.ones(exponents.shape, dtype=torch.float32, device=sf.device), exponents - 127)


def _row_scales(pair: WeightPair, fmt: str) -> torch.Tensor:
    """Checkpoint scales -> one scale per row and K group: float32 [E, N, Kg]."""
    if fmt == "fp4":
        return pair.sf
    n = pair.weight.shape[1]
    return pair.sf.repeat_interleave(kBlock, dim=1)[:, :n]


def _collapse_row_scales(row_sf: torch.Tensor, fmt: str) -> torch.Tensor:
    """Inverse of :func:`_row_scales` (rows of one block carry one scale)."""
    if fmt == "fp4":
        return row_sf.contiguous()
    return row_sf[:, ::kBlock].contiguous()


def _check_target(target: str) -> None:
    if target not in kTargets:
        raise ValueError(f"target must be one of {kTargets}, got {target!r}")


def _check_shapes(l1: WeightPair, l2: WeightPair):
    fmt1, fmt2 = _format_of(l1.weight, "l1"), _format_of(l2.weight, "l2")
    if fmt1 != fmt2:
        raise ValueError(f"l1 and l2 must share a format, got {fmt1} and {fmt2}")
    e, two_i, _ = l1.weight.shape
    h = _logical_k(l1.weight, fmt1)
    if two_i % 2 != 0:
        raise ValueError(f"l1 weight rows must be 2 * intermediate_size, got {two_i}")
    i = two_i // 2
    if i == 0 or h == 0:
        raise ValueError(f"l1 weight must be [E, 2I, H] with I and H >= 1, got {tuple(l1.weight.shape)}")
    if l2.weight.shape[0] != e or l2.weight.shape[1] != h or _logical_k(l2.weight, fmt2) != i:
        raise ValueError(f"l2 weight must be [E={e}, H={h}, I={i}] for l1 {tuple(l1.weight.shape)}, "
                         f"got {tuple(l2.weight.shape)}")
    devices = sorted({str(t.device) for t in (l1.weight, l1.sf, l2.weight, l2.sf)})
    if len(devices) != 1:
        raise ValueError(f"l1 and l2 weights and scale factors must be on one device, got {devices}")
    return fmt1, i


def transform_weights_for_mega_moe(l1, l2, target: str = "sm90") -> MegaMoEWeights:
    """Checkpoint-order quantized weights -> the layout of the Mega MoE kernels (module docstring).

    ``l1 = (gate_up, sf)``, ``l2 = (down, sf)`` as (weight, sf) pairs; ``target`` ``"sm90"`` or
    ``"sm100"``. Returns :class:`MegaMoEWeights` (unpacks as ``(l1, l2)``, each ``(weight, sf)``).
    """
    _check_target(target)
    l1, l2 = _check_pair(l1, "l1"), _check_pair(l2, "l2")
    fmt, i = _check_shapes(l1, l2)
    _expect_checkpoint_sf(l1, fmt, "l1")
    _expect_checkpoint_sf(l2, fmt, "l2")
    perm = interleave_permutation(i, device=l1.weight.device)
    w1 = l1.weight.index_select(1, perm)
    if target == "sm90":
        if fmt == "fp4":
            return MegaMoEWeights(WeightPair(w1, l1.sf.index_select(1, perm)), WeightPair(l2.weight, l2.sf))
        if i % (kBlock // 2) != 0:
            raise ValueError(f"target='sm90' with FP8 weights needs intermediate_size % {kBlock // 2} == 0, got {i}")
        halves = l1.sf.index_select(1, _sm90_half_block_index(i, l1.sf.device))
        sf1 = halves.view(l1.sf.shape[0], 2 * i // kBlock, 2, l1.sf.shape[2])
        return MegaMoEWeights(WeightPair(w1, sf1), WeightPair(l2.weight, l2.sf.contiguous()))
    _require_ue8m0(l1.sf, "l1")
    _require_ue8m0(l2.sf, "l2")
    sf1 = _pack_ue8m0_utccp(_row_scales(l1, fmt).index_select(1, perm))
    sf2 = _pack_ue8m0_utccp(_row_scales(l2, fmt))
    return MegaMoEWeights(WeightPair(w1, sf1), WeightPair(l2.weight, sf2))


def _scale_groups(weight: torch.Tensor, fmt: str) -> int:
    return _ceil_div(_logical_k(weight, fmt), kBlock if fmt == "fp8" else kFp4Gran)


def inverse_transform_weights_for_mega_moe(l1, l2, target: str = "sm90") -> MegaMoEWeights:
    """Undo :func:`transform_weights_for_mega_moe`: back to checkpoint order and scale layouts."""
    _check_target(target)
    l1, l2 = _check_pair(l1, "l1"), _check_pair(l2, "l2")
    fmt, i = _check_shapes(l1, l2)
    inverse = torch.argsort(interleave_permutation(i, device=l1.weight.device))
    w1 = l1.weight.index_select(1, inverse)
    if target == "sm90":
        if fmt == "fp4":
            return MegaMoEWeights(WeightPair(w1, l1.sf.index_select(1, inverse)), WeightPair(l2.weight, l2.sf))
        e, kb = l1.sf.shape[0], l1.sf.shape[-1]
        if tuple(l1.sf.shape) != (e, 2 * i // kBlock, 2, kb):
            raise ValueError(f"sm90 l1 sf must be [E, 2I/128, 2, Kb] = [{e}, {2 * i // kBlock}, 2, {kb}], "
                             f"got {tuple(l1.sf.shape)}")
        sf1 = torch.empty((e, _ceil_div(2 * i, kBlock), kb), dtype=l1.sf.dtype, device=l1.sf.device)
        # Two halves may name the same original block; they carry the same value.
        sf1[:, _sm90_half_block_index(i, l1.sf.device)] = l1.sf.reshape(e, -1, kb)
        return MegaMoEWeights(WeightPair(w1, sf1), WeightPair(l2.weight, l2.sf.contiguous()))
    row1 = _unpack_ue8m0_utccp(l1.sf, _scale_groups(l1.weight, fmt)).index_select(1, inverse)
    row2 = _unpack_ue8m0_utccp(l2.sf, _scale_groups(l2.weight, fmt))
    return MegaMoEWeights(WeightPair(w1, _collapse_row_scales(row1, fmt)),
                          WeightPair(l2.weight, _collapse_row_scales(row2, fmt)))


def _apply_row_scales(weight: torch.Tensor, row_sf: torch.Tensor, fmt: str) -> torch.Tensor:
    values = unpack_fp4(weight) if fmt == "fp4" else weight.float()
    gran = kFp4Gran if fmt == "fp4" else kBlock
    return values * row_sf.repeat_interleave(gran, dim=-1)[..., : values.shape[-1]]


def dequantize_mega_moe_weights(l1, l2, target: str = "sm90") -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(l1 [E, 2I, H] interleaved, l2 [E, H, I])`` from weights in a kernel layout.

    Reads the scales the way a kernel of ``target`` does; used to check the layouts and as the
    staged backends' oracle.
    """
    _check_target(target)
    l1, l2 = _check_pair(l1, "l1"), _check_pair(l2, "l2")
    fmt, _ = _check_shapes(l1, l2)
    if target == "sm100":
        return (_apply_row_scales(l1.weight, _unpack_ue8m0_utccp(l1.sf, _scale_groups(l1.weight, fmt)), fmt),
                _apply_row_scales(l2.weight, _unpack_ue8m0_utccp(l2.sf, _scale_groups(l2.weight, fmt)), fmt))
    if fmt == "fp4":
        return cast_back_from_fp4(l1.weight, l1.sf, kFp4Gran), cast_back_from_fp4(l2.weight, l2.sf, kFp4Gran)
    e, two_i, h = l1.weight.shape
    for name, sf, expected in (("l1", l1.sf, (e, two_i // kBlock, 2, _ceil_div(h, kBlock))),
                               ("l2", l2.sf, (e, _ceil_div(h, kBlock), _ceil_div(two_i // 2, kBlock)))):
        if sf.dtype != torch.float32 or tuple(sf.shape) != expected:
            raise ValueError(f"sm90 {name} sf must be float32 {list(expected)} (transform_weights_for_mega_moe's "
                             f"layout), got {sf.dtype} {tuple(sf.shape)}")
    rows = torch.arange(l1.weight.shape[1], device=l1.sf.device)
    row_sf = l1.sf[:, rows // kBlock, ((rows % (2 * kInterleaveRows)) >= kInterleaveRows).long()]
    return _apply_row_scales(l1.weight, row_sf, fmt), dequantize_per_block(l2.weight, l2.sf, kBlock)
