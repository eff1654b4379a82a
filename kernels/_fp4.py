"""FP4 weights of the FP8 x FP4 grouped GEMMs: argument checks and the UE8M0 scale bytes.

``b = (B [G, N, K/2] int8 or uint8, SFB [G, N, K/32])``; see :mod:`kernels.grouped` for the
format. The kernel takes SFB as UE8M0 exponent bytes (value ``2^(byte - 127)``): ``uint8`` and
``float8_e8m0fnu`` are those bytes already, float32 powers of two are converted here.
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

from . import _checks

GRAN_K = 32  # K elements per weight scale
PACKED_DTYPES = (torch.int8, torch.uint8)
_E8M0 = torch.float8_e8m0fnu
_SF_DTYPES = (_E8M0, torch.uint8, torch.float32)
_SIGN_AND_MANTISSA = -0x7F800001  # ~0x7F800000 as an int32: every float32 bit but the exponent's


def sf_to_ue8m0_bytes(fn: str, name: str, sf: torch.Tensor) -> torch.Tensor:
    """float32 powers of two (any shape, any strides) -> contiguous uint8 exponent bytes of the
    same shape, ``byte = (bits >> 23) & 0xFF``. Raises ValueError unless every value is a positive
    normal float32 power of two (sign 0, mantissa 0, exponent field 1..254); the check is one host
    sync on CUDA."""
    # A lazily negated view (the negative bit) shows negative values, which the check below names.
    bits = sf.resolve_neg().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    valid = ((bits & _SIGN_AND_MANTISSA) == 0) & (exponent >= 1) & (exponent <= 254)
    if sf.numel() and not bool(valid.all()):
        bad = sf[~valid]
        _checks.fail(fn, ValueError, f"{name} must hold positive normal powers of two (UE8M0 scales) when float32; "
                                     f"{bad.numel()} of {sf.numel()} values are not, e.g. {bad[0].item()!r}")
    return exponent.to(torch.uint8).contiguous()


def check_weights(fn: str, b: object, k: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Checks ``b`` against A's K; returns ``(B, SFB as given, G, N)``."""
    b_t, sfb = _checks.unpack(fn, "b", b)
    if not isinstance(b_t, torch.Tensor):
        _checks.fail(fn, TypeError, f"b[0] (B) must be a torch.Tensor, got {type(b_t).__name__}")
    if b_t.dtype not in PACKED_DTYPES:
        _checks.fail(fn, TypeError, f"b[0] (B) must be int8 or uint8 (two E2M1 codes per byte), got {b_t.dtype}")
    _checks.check_dense(fn, "b[0] (B)", b_t)
    if b_t.dim() != 3:
        _checks.fail(fn, ValueError, f"b[0] (B) must have shape [G, N, K/2], got {list(b_t.shape)}")
    g, n, half_k = b_t.shape
    _checks.check_nk(fn, n, k)
    if half_k != k // 2:
        _checks.fail(fn, ValueError, f"b[0] (B) must have shape [*, *, K/2] = [*, *, {k // 2}] (K = {k} from A), "
                                     f"got {list(b_t.shape)}")
    stride = b_t.stride()
    if stride[2] != 1 or stride[1] % 16 or stride[1] < half_k:
        _checks.fail(fn, ValueError, f"b[0] (B) must be K-major (stride 1 along K, a row stride that is a multiple "
                                     f"of 16 bytes), got strides {stride}")
    if g > 1 and stride[0] != n * stride[1]:
        _checks.fail(fn, ValueError, f"b[0] (B) must stack its groups without gaps (stride[0] == shape[1] * "
                                     f"stride[1]), got strides {stride}")
    if g == 0:
        _checks.fail(fn, ValueError, "b must hold at least one group, got G = 0")
    return b_t, check_sfb(fn, sfb, g, n, k), g, n


def check_sfb(fn: str, sfb: object, g: int, n: int, k: int, name: str = "b[1] (SFB)") -> torch.Tensor:
    """SFB [G, N, K/32] in one of the accepted forms; returned as given. ``name`` names it in messages."""
    if not isinstance(sfb, torch.Tensor):
        _checks.fail(fn, TypeError, f"{name} must be a torch.Tensor, got {type(sfb).__name__}")
    if sfb.dtype not in _SF_DTYPES:
        _checks.fail(fn, TypeError, f"{name} must be float8_e8m0fnu or uint8 (UE8M0 exponent bytes) or float32 "
                                    f"(powers of two), got {sfb.dtype}")
    # float32: its value check resolves it; bytes go to the kernels as they are (read as their memory).
    _checks.check_dense(fn, name, sfb, negated_ok=sfb.dtype == torch.float32)
    shape = (g, n, k // GRAN_K)
    if tuple(sfb.shape) != shape:
        _checks.fail(fn, ValueError, f"{name} must have shape {list(shape)} (one scale per 1x{GRAN_K}), "
                                     f"got {list(sfb.shape)}")
    if sfb.dtype != torch.float32:  # bytes go to the kernel as they are: 4-byte loads per row and 128-K block
        stride = sfb.stride()
        if stride[2] != 1 or stride[1] % 4 or (g > 1 and stride[0] % 4):
            _checks.fail(fn, ValueError, f"{name} must be contiguous in its last dim with row and group strides "
                                         f"that are multiples of 4 bytes, got strides {stride}")
    return sfb


def sfb_bytes(fn: str, sfb: torch.Tensor, name: str = "b[1] (SFB)") -> torch.Tensor:
    """SFB as uint8 exponent bytes: a view of the byte forms, a conversion of float32."""
    if sfb.dtype == torch.float32:
        return sf_to_ue8m0_bytes(fn, name, sfb)
    return sfb.view(torch.uint8)


def check_sfb_range(fn: str, sfb_bytes: torch.Tensor, name: str = "b[1] (SFB)") -> None:
    """Exponent bytes must lie in [1, 254]: the kernels read 0 and 255 differently from UE8M0
    (0 as a zero scale, 255 as a finite or infinite one; UE8M0 says 2^-127 and NaN). The quantizers
    never write them. Checked where a pass over the scales is cheap: the CPU path and the one-time
    decode-layout transform (the CUDA GEMMs take the bytes as they are)."""
    if sfb_bytes.numel() and bool(((sfb_bytes == 0) | (sfb_bytes == 255)).any()):
        _checks.fail(fn, ValueError, f"{name} holds exponent bytes 0 or 255; scales must be 2^-126 .. 2^127 "
                                     "(bytes 1 .. 254)")


def sfb_float32(fn: str, sfb_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 exponent bytes in [1, 254] -> float32 ``2^(byte - 127)``."""
    check_sfb_range(fn, sfb_bytes)
    return sfb_bytes.view(_E8M0).float()


def check_pointers(fn: str, b_t: torch.Tensor, sfb_bytes: torch.Tensor) -> None:
    """CUDA: B is read by TMA (16-byte aligned), SFB by 4-byte loads."""
    if b_t.data_ptr() % 16:
        _checks.fail(fn, ValueError, f"b[0] (B) must start at a 16-byte aligned address, got {b_t.data_ptr():#x}")
    if sfb_bytes.data_ptr() % 4:
        _checks.fail(fn, ValueError, f"b[1] (SFB) must start at a 4-byte aligned address, "
                                     f"got {sfb_bytes.data_ptr():#x}")


# The staged path (FP4 -> FP8 cast of every weight, then the FP8 GEMM) from this many rows per group
# on: the in-kernel conversions redo a weight tile's conversion for every M tile, and with many
# rows that costs more than one pass over the weights (bench/RESULTS.md, session 33).
STAGED_MIN_ROWS = 512
# Largest FP8 weight copy a staged call holds at once; more groups run in chunks of groups.
STAGED_MAX_BYTES = 1 << 30


def staged_policy(fn: str) -> bool | None:
    """``MOE_FP4_STAGED``: unset or empty picks by rows per group, ``0`` never stages, ``1`` always."""
    setting = os.environ.get("MOE_FP4_STAGED", "")
    if setting in ("", "0", "1"):
        return None if setting == "" else setting == "1"
    _checks.fail(fn, ValueError, f"MOE_FP4_STAGED must be 0 or 1 (or unset), got {setting!r}")


def staged_chunk(n: int, k: int) -> int:
    """Groups per staged chunk: as many FP8 weight matrices [N, K] as STAGED_MAX_BYTES holds, at
    least 1 and at most the cast's grid limit of 65535."""
    return min(65535, max(1, STAGED_MAX_BYTES // (n * k)))


def staged_chunks(g: int, n: int, k: int) -> Iterator[tuple[int, int]]:
    """The group ranges [g0, g1) a staged call of ``g`` groups of [N, K] weights runs in turn."""
    chunk = staged_chunk(n, k)
    for g0 in range(0, g, chunk):
        yield g0, min(g, g0 + chunk)
