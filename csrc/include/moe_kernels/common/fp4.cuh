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

// Byte j: e_max - e_j, the binades group j of a row lies below the largest of its four (no
// borrows: e_max is the largest byte).
__device__ __forceinline__ uint32_t group_shifts(uint32_t exps, uint32_t e_max) { return e_max * 0x01010101u - exps; }

// Whether every byte of `shifts` is at most kMaxExactShift: with the high nibbles clear no byte
// carries when 15 - kMaxExactShift is added, and bit 4 then marks the bytes past it.
__device__ __forceinline__ bool shifts_in_table_range(uint32_t shifts) {
  static_assert(kMaxExactShift < 16, "the test works on nibbles");
  constexpr uint32_t kBias = (15u - kMaxExactShift) * 0x01010101u;
  return ((shifts & 0xF0F0F0F0u) | ((shifts + kBias) & 0x10101010u)) == 0;
}

// make_lut(d) for d = byte `byte` of `shifts` known to pass shifts_in_table_range: a byte extract and
// two multiply-adds, where make_lut's range check and zero table took ten instructions (the
// swapped kernel builds a table per 8 elements).
__device__ __forceinline__ Lut make_lut_in_range(uint32_t shifts, uint32_t byte) {
  const uint32_t d = __byte_perm(shifts, 0u, 0x4440u | byte);
  return {kLutLo - d * 0x08080800u, kLutHi - d * 0x08080808u};
}

// make_lut(d) for d = byte `byte` (a constant once unrolled) of `shifts`, from d replicated by byte
// permutes: d * 0x08080808 is then one multiply-add away and the range check one compare (7
// instructions per table where make_lut of an extracted byte took 9).
__device__ __forceinline__ Lut make_lut_of_byte(uint32_t shifts, uint32_t byte) {
  const uint32_t d4 = __byte_perm(shifts, 0u, byte * 0x1111u);       // d in every byte
  const uint32_t d3 = __byte_perm(shifts, 0u, byte * 0x1110u + 4u);  // d in bytes 1-3
  if (d4 > kMaxExactShift * 0x01010101u) return {0u, 0u};
  return {kLutLo - d3 * 8u, kLutHi - d4 * 8u};
}

// prmt.b32 with a variable selector whose nibbles' bit 3 is known clear. __byte_perm defines 3-bit
// selectors, so the compiler masks every variable selector again (0x7777 apiece), which split
// convert8's one mask in two: 10 instructions per word instead of 9.
__device__ __forceinline__ uint32_t permute(uint32_t lo, uint32_t hi, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(lo), "r"(hi), "r"(selector));
  return out;
}

// Eight E2M1 codes (one 32-bit word) -> eight E4M3 bytes (two words, element order kept): 9
// instructions. The magnitudes index the table (with the sign, selector bit 3, masked off: prmt
// would replicate the byte's sign instead). Element j's sign, bit 4j + 3 of w, must become bit 7
// of output byte j: for odd j it already is bit 7 of byte j / 2 of w, for even j of byte j / 2 of
// w << 4, so one byte permute per output word gathers all four signs.
__device__ __forceinline__ uint2 convert8(uint32_t w, const Lut& lut) {
  const uint32_t sel = w & 0x77777777u;
  const uint32_t w4 = w << 4;
  uint2 out;
  out.x = permute(lut.lo, lut.hi, sel) | (__byte_perm(w, w4, 0x1504u) & 0x80808080u);
  out.y = permute(lut.lo, lut.hi, sel >> 16) | (__byte_perm(w, w4, 0x3726u) & 0x80808080u);
  return out;
}

// Largest of the four exponent bytes of `exps`.
__device__ __forceinline__ uint32_t max_exponent(uint32_t exps) {
  const uint32_t a = max(exps & 0xFFu, (exps >> 8) & 0xFFu);
  const uint32_t b = max((exps >> 16) & 0xFFu, exps >> 24);
  return max(a, b);
}

// Smallest of the four exponent bytes of `exps`.
__device__ __forceinline__ uint32_t min_exponent(uint32_t exps) {
  const uint32_t a = min(exps & 0xFFu, (exps >> 8) & 0xFFu);
  const uint32_t b = min((exps >> 16) & 0xFFu, exps >> 24);
  return min(a, b);
}

// A tile's reference exponent per K block: where every 1x32 group of the tile's weight rows lies
// within kMaxExactShift binades of the largest, e_max, the rows' groups are folded in relative to
// e_max instead of to each row's own largest (the same E4M3 values up to one power of two per row,
// so the same products and sums while the multiplied A scales stay normal), and
// 2^(e_max - 127 - kHeadroomLog2) is one factor for the whole tile: the scale warp multiplies it into
// the token scales once, and the promotion of a K block is one FFMA per accumulator instead of a
// multiply and an FFMA. kNoBlockRef otherwise (a row's group would flush where its own row's
// reference keeps it), and for e_max past 2^64, where the multiplied token scales could overflow.
constexpr uint32_t kNoBlockRef = 0xFFFFFFFFu;
constexpr uint32_t kMaxBlockRef = 127 + 64;
__device__ __forceinline__ uint32_t block_reference(uint32_t e_max, uint32_t e_min) {
  return e_max - e_min <= kMaxExactShift && e_max <= kMaxBlockRef ? e_max : kNoBlockRef;
}

// 2^(e_max - 127 - kHeadroomLog2) as FP32; 0 below FP32's normal range (scales under 2^-120,
// which quantized weights never have).
__device__ __forceinline__ float column_scale(uint32_t e_max) {
  return e_max > kHeadroomLog2 ? __uint_as_float((e_max - kHeadroomLog2) << 23) : 0.0f;
}

// The column scale of a row on its own reference: its largest of the four groups' exponents.
__device__ __forceinline__ float own_column_scale(uint32_t exps) { return column_scale(max_exponent(exps)); }

}  // namespace moe_kernels::fp4
