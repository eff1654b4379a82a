#pragma once
// E2M1 (FP4) -> E4M3 (FP8) conversion for weights, exact, with a power-of-two factor folded in.
//
// Weight rows carry one UE8M0 scale 2^(e_j - 127) per 32 elements. Inside a 128-deep K block the
// four exponents e_0..e_3 of a row are split into the largest, e_max, applied to the row's output
// column in the FP32 promotion as 2^(e_max - 127 - kHeadroomLog2), and the relative factors
// 2^(kHeadroomLog2 - d_j), d_j = e_max - e_j, folded into the E4M3 values. Every E2M1 value
// {0, .5, 1, 1.5, 2, 3, 4, 6} times 2^(6 - d) is an E4M3 normal number for d <= 11 (the largest,
// 6 * 64 = 384, stays under E4M3's 448), so the conversion is exact there; a group more than 2^11
// below its block's largest scale is flushed to zero (its values are below 6 * 2^-12 of the largest
// group's scale).
//
// Packing: element 2i of a row in the low nibble of byte i; nibble bit 3 is the sign, bits 0-2
// index the magnitude. A little-endian 32-bit word holds 8 consecutive elements as nibbles 0-7.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels::fp4 {

constexpr uint32_t kHeadroomLog2 = 6;
constexpr uint32_t kMaxExactShift = 11;
// E4M3 bytes of the 8 E2M1 magnitudes times 2^6: 0, 32, 64, 96 | 128, 192, 256, 384.
constexpr uint32_t kLutLo = 0x6C686000u;
constexpr uint32_t kLutHi = 0x7C787470u;

struct Lut {
  uint32_t lo, hi;
};

// The table for a group d binades below the block's largest: subtracting d from every nonzero
// byte's exponent field never borrows across bytes (the smallest field is 12 > kMaxExactShift).
__device__ __forceinline__ Lut make_lut(uint32_t d) {
  if (d > kMaxExactShift) return {0u, 0u};
  return {kLutLo - d * 0x08080800u, kLutHi - d * 0x08080808u};
}

// The signs of four consecutive nibbles of `w` (the two bytes that `selector` picks, each
// replicated: b b b' b') moved to bit 7 of four output bytes. In y = (b, b, b', b') bytes 1 and 3
// already hold the odd elements' signs at bit 7; bytes 0 and 2 take the even ones' from bit 3.
__device__ __forceinline__ uint32_t spread_signs(uint32_t w, uint32_t selector) {
  const uint32_t y = __byte_perm(w, 0u, selector);
  return (y & 0x80008000u) | ((y << 4) & 0x00800080u);
}

// Eight E2M1 codes (one 32-bit word) -> eight E4M3 bytes (two words, element order kept).
__device__ __forceinline__ uint2 convert8(uint32_t w, const Lut& lut) {
  const uint32_t sel = w & 0x77777777u;
  uint2 out;
  out.x = __byte_perm(lut.lo, lut.hi, sel) | spread_signs(w, 0x1100u);
  out.y = __byte_perm(lut.lo, lut.hi, sel >> 16) | spread_signs(w, 0x3322u);
  return out;
}

// Largest of the four exponent bytes of `exps`.
__device__ __forceinline__ uint32_t max_exponent(uint32_t exps) {
  const uint32_t a = max(exps & 0xFFu, (exps >> 8) & 0xFFu);
  const uint32_t b = max((exps >> 16) & 0xFFu, exps >> 24);
  return max(a, b);
}

// 2^(e_max - 127 - kHeadroomLog2) as FP32; 0 below FP32's normal range (scales under 2^-120,
// which quantized weights never have).
__device__ __forceinline__ float column_scale(uint32_t e_max) {
  return e_max > kHeadroomLog2 ? __uint_as_float((e_max - kHeadroomLog2) << 23) : 0.0f;
}

}  // namespace moe_kernels::fp4
