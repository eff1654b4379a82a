#pragma once
// The swapped FP8 x FP4 kernel's register operands (impls/sm90_fp8_fp4_gemm_swap_ab.cuh): a math
// thread's wgmma A fragments of 64 weight rows (rows row0 and row0 + 8 of its warp's 16), converted
// from packed E2M1 or decoded from the fragment layout, and the FP32 promotion of a K block's
// accumulator (64 rows x kBlockT tokens) with the rows' and tokens' scales.

#include <moe_kernels/common/fp4.cuh>

namespace moe_kernels {

// The word of packed row `row` (64 bytes, 64-byte swizzle: 16-byte chunk c at c ^ ((row / 2) % 4))
// that holds bytes [offset, offset + 4) of the row's K block; offset is a multiple of 4.
__device__ __forceinline__ uint32_t load_packed_word(const uint8_t* tile, uint32_t row, uint32_t offset) {
  const uint32_t chunk = (offset / 16) ^ ((row / 2) % 4);
  return *reinterpret_cast<const uint32_t*>(tile + row * 64 + chunk * 16 + offset % 16);
}

// Which references a K block's conversion and promotion take: the rows' own (kernels without
// kBlockRef), the tile's (a K block whose reference word the caller checked), or either, as the
// word says. The K loops run kTile K blocks on straight code of their own: with the other paths
// beside them in one body, the loop took as long as before the tile's reference saved a third of
// its instructions (bench/RESULTS.md, session 35).
enum class Refs { kRows, kTile, kEither };
template <Refs kRefs>
struct RefsTag {
  static constexpr Refs value = kRefs;
};

// Whether a K block with reference word `ref` takes the tile's reference under kRefs.
template <Refs kRefs>
__device__ __forceinline__ bool takes_tile_ref(uint32_t ref) {
  return kRefs == Refs::kTile || (kRefs == Refs::kEither && ref != fp4::kNoBlockRef);
}

// The wgmma A fragments of one K block of packed weights (64 rows, 64-byte swizzled), converted
// with the rows' relative 1x32 exponents folded in (common/fp4.cuh): frag[s] for K step s (32
// elements, one 1x32 scale group), rows row0 and row0 + 8 of the thread; exps: their exponent words;
// ref: the tile's reference exponent of the K block, or fp4::kNoBlockRef for each row's own.
template <Refs kRefs>
__device__ __forceinline__ void convert_packed_k_block(const uint8_t* tile_w, uint32_t row0, uint32_t quad,
                                                       uint32_t exps0, uint32_t exps1, uint32_t ref,
                                                       uint32_t (&frag)[4][4]) {
  // Bytes [2 quad, 2 quad + 2) of a 4-byte word pair: the low halves for even quads, else high.
  const uint32_t half_selector = quad % 2 == 0 ? 0x5410u : 0x7632u;
  const auto convert_steps = [&](uint32_t shifts0, uint32_t shifts1, auto lut_of) {
    // Elements 4 quad..+3 of step s sit in bytes 16 s + 2 quad..+1, elements 16 + 4 quad..+3 in
    // bytes 16 s + 8 + 2 quad..+1.
#pragma unroll
    for (uint32_t s = 0; s < 4; ++s) {
      const uint32_t offset = 16 * s + 4 * (quad / 2);
      const uint32_t w0 = __byte_perm(load_packed_word(tile_w, row0, offset),
                                      load_packed_word(tile_w, row0, offset + 8), half_selector);
      const uint32_t w1 = __byte_perm(load_packed_word(tile_w, row0 + 8, offset),
                                      load_packed_word(tile_w, row0 + 8, offset + 8), half_selector);
      const uint2 c0 = fp4::convert8(w0, lut_of(shifts0, s));
      const uint2 c1 = fp4::convert8(w1, lut_of(shifts1, s));
      frag[s][0] = c0.x;  // row r,     K 4 quad..+3
      frag[s][1] = c1.x;  // row r + 8
      frag[s][2] = c0.y;  // row r,     K 16 + 4 quad..+3
      frag[s][3] = c1.y;  // row r + 8
    }
  };
  const auto in_range = [](uint32_t shifts, uint32_t s) { return fp4::make_lut_in_range(shifts, s); };
  // The tile's reference (uniform over the CTA): the scale warp found every group of the tile's rows
  // below N within range of it. Rows past N (zero words) get tables out of range, even NaN bytes:
  // their output columns are never stored.
  if (takes_tile_ref<kRefs>(ref)) {
    convert_steps(fp4::group_shifts(exps0, ref), fp4::group_shifts(exps1, ref), in_range);
    return;
  }
  // Each row's own largest. A table per 8 elements: unchecked ones where every group of the warp's
  // rows lies within kMaxExactShift binades of its row's largest, the checked ones (zero past the
  // range) otherwise. The vote keeps the branch warp-uniform.
  const uint32_t shifts0 = fp4::group_shifts(exps0, fp4::max_exponent(exps0));
  const uint32_t shifts1 = fp4::group_shifts(exps1, fp4::max_exponent(exps1));
  if (__all_sync(0xffffffffu, fp4::shifts_in_table_range(shifts0) && fp4::shifts_in_table_range(shifts1))) {
    convert_steps(shifts0, shifts1, in_range);
  } else {
    const auto checked = [](uint32_t shifts, uint32_t s) { return fp4::make_lut((shifts >> (8 * s)) & 0xFFu); };
    convert_steps(shifts0, shifts1, checked);
  }
}

// The a0/a1 (K 4q..+3) and a2/a3 (K 16+4q..+3) E4M3 words of one fragment-layout word.
__device__ __forceinline__ uint2 decode_fragment_word(uint32_t w) {
  return make_uint2(w & 0x9C9C9C9Cu, ((w << 2) & 0x8C8C8C8Cu) | ((w >> 2) & 0x10101010u));
}

// 2^(e - 127) for byte kStep of a word of UE8M0 exponents, in two integer operations: the byte
// moved into FP32's exponent field. e = 0 gives 0 (it also marks rows past N, whose words are
// zero-filled) and e = 255 gives inf, not NaN. The decode's 2^-6 is undone once per tile, in the
// epilogue (exact: a power of two).
template <uint32_t kStep>
__device__ __forceinline__ float step_scale(uint32_t exponents) {
  const uint32_t bits = kStep == 3 ? exponents >> 1 : exponents << (23 - 8 * kStep);
  return __uint_as_float(bits & 0x7F800000u);
}

// A K block's row scales for the promotion of packed weights: `block` where it takes the tile's
// reference (its factor is in the A scales), else the thread's rows' own (row0, row0 + 8).
struct RowScales {
  bool block;
  float r0, r1;
  template <Refs kRefs>
  __device__ __forceinline__ static RowScales of(uint32_t exps0, uint32_t exps1, uint32_t ref) {
    if (takes_tile_ref<kRefs>(ref)) return {true, 1.0f, 1.0f};
    return {false, fp4::own_column_scale(exps0), fp4::own_column_scale(exps1)};
  }
};

// A K block's A scales of the thread's accumulator columns: tokens c * 8 + 2 quad + {0, 1} in
// sa[2 c], sa[2 c + 1].
template <uint32_t kBlockT>
__device__ __forceinline__ void load_token_scales(const float* scales, uint32_t quad, float (&sa)[kBlockT / 4]) {
#pragma unroll
  for (uint32_t c = 0; c < kBlockT / 8; ++c) {
    const float2 pair = *reinterpret_cast<const float2*>(scales + c * 8 + quad * 2);
    sa[c * 2] = pair.x;
    sa[c * 2 + 1] = pair.y;
  }
}

// final_acc += one K block's accumulator (64 rows x kBlockT tokens: rows row0 and row0 + 8, tokens
// c * 8 + 2 quad + {0, 1}) times its row and token scales: one FFMA each on the tile's reference.
template <uint32_t kBlockT>
__device__ __forceinline__ void promote(const float (&acc)[kBlockT / 2], const float (&sa)[kBlockT / 4],
                                        const RowScales& sb, float (&final_acc)[kBlockT / 2]) {
  if (sb.block) {
#pragma unroll
    for (uint32_t c = 0; c < kBlockT / 8; ++c) {
      final_acc[c * 4 + 0] = fmaf(acc[c * 4 + 0], sa[c * 2], final_acc[c * 4 + 0]);
      final_acc[c * 4 + 1] = fmaf(acc[c * 4 + 1], sa[c * 2 + 1], final_acc[c * 4 + 1]);
      final_acc[c * 4 + 2] = fmaf(acc[c * 4 + 2], sa[c * 2], final_acc[c * 4 + 2]);
      final_acc[c * 4 + 3] = fmaf(acc[c * 4 + 3], sa[c * 2 + 1], final_acc[c * 4 + 3]);
    }
  } else {
#pragma unroll
    for (uint32_t c = 0; c < kBlockT / 8; ++c) {
      final_acc[c * 4 + 0] = fmaf(acc[c * 4 + 0] * sb.r0, sa[c * 2], final_acc[c * 4 + 0]);
      final_acc[c * 4 + 1] = fmaf(acc[c * 4 + 1] * sb.r0, sa[c * 2 + 1], final_acc[c * 4 + 1]);
      final_acc[c * 4 + 2] = fmaf(acc[c * 4 + 2] * sb.r1, sa[c * 2], final_acc[c * 4 + 2]);
      final_acc[c * 4 + 3] = fmaf(acc[c * 4 + 3] * sb.r1, sa[c * 2 + 1], final_acc[c * 4 + 3]);
    }
  }
}

}  // namespace moe_kernels
