"""A weight layout for the swapped FP4 decode kernel (v2, sm90_fp8_fp4_gemm_swap_ab.cuh with
kFragmentLayout): packed E2M1 weights and their UE8M0 scales re-ordered once at load so that each
math thread reads its wgmma A fragment with two 16-byte loads and turns it into E4M3 with five
integer operations per eight elements, and one TMA box per K block brings the fragments together
with their scales.

Fragment (per warpgroup, 64 weight rows x 32-deep K step, the m16n8k32 8-bit A layout): thread
``t`` (warp ``w = t // 32``, lane ``l``, quad ``q = l % 4``) holds rows ``r = 16 w + l // 4`` and
``r + 8``; per row, K elements ``4q..4q+3`` (register a0 / a1) and ``16 + 4q..`` (a2 / a3).

Layout: ``[G, K/128, ceil(N/64), 4352]`` bytes. Of each 64-row block's 4352 bytes, the first 4096
are the fragments ``[2 (row r / r + 8), 128 (thread), 4 (K step), 4 bytes]``, one 32-bit word per
(thread, row, step) holding that row's 8 fragment elements; the last 256 are the block's scales
``[64 rows, 4 (K step)]`` as UE8M0 bytes (rows past N: 0, read as a zero scale). Inside a word, byte
``i`` (i = 0..3) holds element ``i`` (a0 side) and element ``4 + i`` (a2 side) as

    bit 7: sign(e_i)   bit 6: e1(e_4+i)   bit 5: sign(e_4+i)   bit 4: e1(e_i)
    bit 3: e0(e_i)     bit 2: m(e_i)      bit 1: e0(e_4+i)     bit 0: m(e_4+i)

so that, with E4M3 byte = sign << 7 | (e1 e0 m) << 2 = the E2M1 value times 2^-6 (exact for all 16
codes, subnormal e = 0 included), the a0 word is ``w & 0x9C9C9C9C`` and the a2 word is
``((w << 2) & 0x8C8C8C8C) | ((w >> 2) & 0x10101010)``. Rows past N are zero.
"""

from __future__ import annotations

import torch

kRowsPerBlock = 64
kBlockK = 128
kWeightBytes = 4096  # per K block and 64 rows: 2 x 128 threads x 4 K steps x 4 bytes
kBlockBytes = kWeightBytes + kRowsPerBlock * 4  # then the rows' four UE8M0 bytes
kMaxDecodeRows = 32  # min(expected_m, max_m) the decode-layout kernel serves (its token block, wgmma N)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 packed [..., K/2] -> uint8 codes [..., K] (element 2j in the low nibble of byte j)."""
    p = packed.view(torch.uint8)
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def transform_fp4_for_decode(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 ``[G, N, K/2]`` (int8 or uint8, K a multiple of 128) and its scales ``sf``
    ``[G, N, K/32]`` (float32 powers of two, float8_e8m0fnu or UE8M0 bytes as uint8) -> uint8
    ``[G, K/128, ceil(N/64), 4352]`` in the layout described above."""
    from . import _checks, _fp4

    fn = "transform_fp4_for_decode"
    if not isinstance(packed, torch.Tensor) or packed.dim() != 3 or packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"{fn}: packed must be int8/uint8 [G, N, K/2], got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}")
    _checks.check_dense(fn, "packed", packed)
    g, n, half_k = packed.shape
    k = 2 * half_k
    if k % kBlockK or k == 0:
        raise ValueError(f"{fn}: K must be a positive multiple of {kBlockK}, got {k}")
    if n == 0:
        raise ValueError(f"{fn}: N (packed's rows per group) must be >= 1, got shape {tuple(packed.shape)}")
    sf = _fp4.check_sfb(fn, sf, g, n, k, name="sf")
    if packed.device.type not in ("cpu", "cuda") or sf.device != packed.device:
        raise ValueError(f"{fn}: packed and sf must be on one CPU or CUDA device, got {packed.device} and {sf.device}")
    exponents = _fp4.sfb_bytes(fn, sf, name="sf")
    _fp4.check_sfb_range(fn, exponents, name="sf")
    n_pad = (n + kRowsPerBlock - 1) // kRowsPerBlock * kRowsPerBlock
    nb, kb = n_pad // kRowsPerBlock, k // kBlockK
    out = torch.empty((g, kb, nb, kBlockBytes), dtype=torch.uint8, device=packed.device)
    for group in range(g):  # one expert at a time: the bit shuffling's temporaries stay small
        codes = torch.zeros((n_pad, k), dtype=torch.uint8, device=packed.device)
        codes[:n] = _codes(packed[group])
        # [NB, w, h, l4 (row in 8), KB, s, half (a0 / a2), q, i]: rows 16w + 8h + l4, K 128 kb + 32 s + 16 half + 4q + i.
        c = codes.view(nb, 4, 2, 8, kb, 4, 2, 4, 4)
        c = c.permute(4, 0, 2, 1, 3, 7, 5, 6, 8)  # kb, nb, h, w, l4, q, s, half, i
        lo, hi = c[..., 0, :], c[..., 1, :]  # codes of e_i and e_4+i
        byte = (((lo >> 3) & 1) << 7) | (((hi >> 2) & 1) << 6) | (((hi >> 3) & 1) << 5) | (((lo >> 2) & 1) << 4) | \
            (((lo >> 1) & 1) << 3) | ((lo & 1) << 2) | (((hi >> 1) & 1) << 1) | (hi & 1)
        out[group, :, :, :kWeightBytes] = byte.reshape(kb, nb, kWeightBytes)
        e = torch.zeros((n_pad, k // 32), dtype=torch.uint8, device=packed.device)
        e[:n] = exponents[group]
        out[group, :, :, kWeightBytes:] = e.view(nb, kRowsPerBlock, kb, 4).permute(2, 0, 1, 3).reshape(kb, nb, -1)
    return out


def from_fragment_layout(b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`transform_fp4_for_decode`: uint8 ``[G, K/128, ceil(N/64), 4352]`` -> (packed
    E2M1 uint8 [G, N, K/2], UE8M0 bytes uint8 [G, N, K/32]), bit for bit."""
    g, kb, nb, _ = b.shape
    byte = b[..., :kWeightBytes].reshape(g, kb, nb, 2, 4, 8, 4, 4, 4)  # g, kb, nb, h, w, l4, q, s, i
    lo = (((byte >> 7) & 1) << 3) | (((byte >> 4) & 1) << 2) | (((byte >> 3) & 1) << 1) | ((byte >> 2) & 1)
    hi = (((byte >> 5) & 1) << 3) | (((byte >> 6) & 1) << 2) | (((byte >> 1) & 1) << 1) | (byte & 1)
    codes = torch.stack([lo, hi], dim=-2)  # g, kb, nb, h, w, l4, q, s, half, i
    codes = codes.permute(0, 2, 4, 3, 5, 1, 7, 8, 6, 9).reshape(g, nb * kRowsPerBlock, kb * kBlockK)[:, :n]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    sf = b[..., kWeightBytes:].reshape(g, kb, nb, kRowsPerBlock, 4).permute(0, 2, 3, 1, 4)
    return packed, sf.reshape(g, nb * kRowsPerBlock, kb * 4)[:, :n].contiguous()


def decode_words(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a thread computes from its 32-bit words (int64 tensor of uint32 values): the a0 and a2
    E4M3 words, exactly the kernel's integer operations."""
    a0 = words & 0x9C9C9C9C
    a2 = ((words << 2) & 0x8C8C8C8C) | ((words >> 2) & 0x10101010)
    return a0, a2


def m_grouped_fp8_fp4_gemm_nt_masked_fragment(a: tuple[torch.Tensor, torch.Tensor], b: torch.Tensor,
                                              d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                                              fn: str = "m_grouped_fp8_fp4_gemm_nt_masked") -> None:
    """:func:`kernels.m_grouped_fp8_fp4_gemm_nt_masked` with the weights and their scales in the
    fragment layout: ``b = transform_fp4_for_decode(B, SFB)`` uint8 ``[G, K/128, ceil(N/64), 4352]``; N is
    taken from ``d`` [G, max_m, N]. On CUDA for decode sizes (min(expected_m, max_m) <= 32; any
    masked_m is computed); on the CPU the reference on the weights the layout holds."""
    from . import _checks, _descriptors, grouped, jit
    from .reference import gemm as reference

    if grouped._launch_fast("m_grouped_fp8_fp4_gemm_nt_masked_fragment", d, (a, b, d, masked_m, expected_m),
                            lambda: grouped._masked_launch_args(a, b, d, masked_m, expected_m, weights="fragment")):
        return
    grouped._check_expected_m(fn, expected_m)
    a_t, sfa, groups, max_m, k = grouped._masked_activations(fn, a)
    if not isinstance(d, torch.Tensor) or d.dim() != 3:
        _checks.fail(fn, ValueError, f"d must be [G, max_m, N], got {getattr(d, 'shape', type(d).__name__)}")
    n = d.shape[2]
    _checks.check_nk(fn, n, k)
    expected = (groups, k // kBlockK, (n + kRowsPerBlock - 1) // kRowsPerBlock, kBlockBytes)
    _checks.check_dense(fn, "b (decode layout)", b)
    if b.dtype != torch.uint8 or tuple(b.shape) != expected or not b.is_contiguous():
        _checks.fail(fn, ValueError, f"b (decode layout) must be contiguous uint8 {list(expected)} from "
                                     f"transform_fp4_for_decode, got {b.dtype} {list(b.shape)}")
    _checks.check_output(fn, d, (groups, max_m, n))
    masked_m = grouped._check_index(fn, "masked_m", masked_m, groups)
    device = _checks.check_same_device(fn, [a_t, sfa, b, d, masked_m])
    if device.type == "cpu":
        packed, sf = from_fragment_layout(b, n)
        reference.m_grouped_fp8_fp4_gemm_nt_masked((a_t, sfa), (packed, sf.view(torch.float8_e8m0fnu).float()),
                                                   masked_m, d)
        return
    if max_m == 0:
        return
    rows = min(expected_m, max_m)
    if rows > kMaxDecodeRows:
        _checks.fail(fn, ValueError, f"weights in the decode layout serve min(expected_m, max_m) <= 32 rows per "
                                     f"group, got {rows}; pass the packed (B, SFB) for larger batches")
    if b.data_ptr() % 16:
        _checks.fail(fn, ValueError, "b (decode layout) must start on a 16-byte boundary (TMA)")
    jit.native_module().m_grouped_fp8_fp4_gemm_nt_masked_fragment(
        a_t.data_ptr(), a_t.stride(1), sfa.data_ptr(), sfa.stride(1), sfa.stride(2), b.data_ptr(), d.data_ptr(),
        d.stride(1), masked_m.data_ptr(), max_m, expected_m, n, k, groups, device.index,
        _descriptors.current_stream(device))
