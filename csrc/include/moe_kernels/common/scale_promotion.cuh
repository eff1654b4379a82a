#pragma once
// FP32 promotion of FP8 wgmma partial sums (DeepSeek-V3's fix for the tensor cores' limited
// accumulation precision): every 128-deep K block is accumulated by wgmma into `acc`, then
// added to `final_acc` on CUDA cores with its scales, row scale (1x128 activations) times
// column scale (128x128 weight blocks).
//
// Accumulator fragment of a 64 x kN wgmma: thread (warp w, lane l) of the warpgroup holds rows
// w*16 + l/4 and w*16 + l/4 + 8, columns j*8 + (l%4)*2 + {0, 1} for j in [0, kN/8), at indices
// j*4 + {0, 1} (first row) and j*4 + {2, 3} (second row).

#include <cuda/std/type_traits>

#include <moe_kernels/common/math.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

// Columns [0, split_col) of the tile take the first weight scale, the rest the second: a tile
// whose N range crosses a 128-column scale block needs two (the heuristic never allows three).
// kSplitCol: split_col as a compile-time constant (see with_static_split), so no column selects a
// scale at run time (the selects and their products had doubled the math warps' instructions per
// K block); kRuntimeSplit reads `split_col`.
constexpr uint32_t kRuntimeSplit = ~0u;
// kParitySplit: even 8-column fragments take the first scale, odd ones the second (gate/up
// interleaved weights, common/swiglu_epilogue.cuh: a tile's gate and up rows come from different
// scale blocks).
constexpr uint32_t kParitySplit = ~1u;

template <uint32_t kN, uint32_t kSplitCol = kRuntimeSplit>
__device__ __forceinline__ void promote_fp8_accum(float* final_acc, const float* acc, float sa0, float sa1,
                                                  float sb0, float sb1, uint32_t split_col) {
  const float s00 = sa0 * sb0, s01 = sa0 * sb1, s10 = sa1 * sb0, s11 = sa1 * sb1;
#pragma unroll
  for (uint32_t j = 0; j < kN / 8; ++j) {
    const bool first = kSplitCol == kParitySplit ? j % 2 == 0
                                                 : j * 8 < (kSplitCol == kRuntimeSplit ? split_col : kSplitCol);
    const float scale0 = first ? s00 : s01;
    const float scale1 = first ? s10 : s11;
    final_acc[j * 4 + 0] = fmaf(acc[j * 4 + 0], scale0, final_acc[j * 4 + 0]);
    final_acc[j * 4 + 1] = fmaf(acc[j * 4 + 1], scale0, final_acc[j * 4 + 1]);
    final_acc[j * 4 + 2] = fmaf(acc[j * 4 + 2], scale1, final_acc[j * 4 + 2]);
    final_acc[j * 4 + 3] = fmaf(acc[j * 4 + 3], scale1, final_acc[j * 4 + 3]);
  }
}

// Calls f(integral_constant<split>) with the tile's split column as a compile-time constant where a
// kN-wide tile has at most kMaxSplits of them (tiles start at multiples of gcd(kN, 128) inside a
// scale block; a split at or past kN means one scale), else f(kRuntimeSplit). Each value compiles
// the caller's K loop once more, hence the bound.
template <uint32_t kN, uint32_t kMaxSplits = 4, uint32_t kRemainder = 0, typename F>
__device__ __forceinline__ void with_static_split(uint32_t tile_col0, F&& f) {
  constexpr uint32_t kStep = constexpr_gcd(kN, 128u);
  if constexpr (128 / kStep > kMaxSplits) {
    f(cuda::std::integral_constant<uint32_t, kRuntimeSplit>{});
  } else if constexpr (kRemainder + kStep >= 128) {
    f(cuda::std::integral_constant<uint32_t, (128 - kRemainder < kN ? 128 - kRemainder : kN)>{});
  } else {
    if (tile_col0 % 128 == kRemainder) {
      f(cuda::std::integral_constant<uint32_t, (128 - kRemainder < kN ? 128 - kRemainder : kN)>{});
    } else {
      with_static_split<kN, kMaxSplits, kRemainder + kStep>(tile_col0, f);
    }
  }
}

// One weight scale per output column (FP4 weights: a row of B's largest 1x32 scale in the K
// block, see common/fp4.cuh), stored in the order the accumulator fragment uses them: the kN / 4
// columns of quad q (those with (col / 2) % 4 == q, held by the lanes with lane % 4 == q) are
// contiguous, so a thread reads its scales with kN / 16 16-byte loads at fixed offsets from one
// address instead of kN / 8 8-byte ones. The quads' runs start an odd number of 16-byte chunks
// apart, so the four addresses of each load fall in distinct banks.
template <uint32_t kN>
struct ColumnScaleLayout {
  static_assert(kN % 16 == 0, "whole 16-byte chunks per quad");
  static constexpr uint32_t kQuadStride = kN / 4 + ((kN / 16) % 2 == 0 ? 4 : 0);  // floats
  static constexpr uint32_t kFloats = 3 * kQuadStride + kN / 4;
  __device__ __forceinline__ static uint32_t slot(uint32_t col) {
    return (col / 2) % 4 * kQuadStride + col / 8 * 2 + col % 2;  // the thread's index j * 2 + col % 2
  }
};

// The thread's scales, copied out of the stage first so that it can be released before the FMAs.
template <uint32_t kN>
__device__ __forceinline__ void load_column_scales(float* sb, const float* column_scale, uint32_t lane) {
  const float* quad_scales = column_scale + lane % 4 * ColumnScaleLayout<kN>::kQuadStride;
#pragma unroll
  for (uint32_t c = 0; c < kN / 16; ++c) {
    const float4 v = *reinterpret_cast<const float4*>(quad_scales + c * 4);
    sb[c * 4 + 0] = v.x;
    sb[c * 4 + 1] = v.y;
    sb[c * 4 + 2] = v.z;
    sb[c * 4 + 3] = v.w;
  }
}

template <uint32_t kN>
__device__ __forceinline__ void promote_accum_column_scales(float* final_acc, const float* acc, float sa0, float sa1,
                                                            const float* sb) {
#pragma unroll
  for (uint32_t j = 0; j < kN / 8; ++j) {
    final_acc[j * 4 + 0] = fmaf(acc[j * 4 + 0], sa0 * sb[j * 2], final_acc[j * 4 + 0]);
    final_acc[j * 4 + 1] = fmaf(acc[j * 4 + 1], sa0 * sb[j * 2 + 1], final_acc[j * 4 + 1]);
    final_acc[j * 4 + 2] = fmaf(acc[j * 4 + 2], sa1 * sb[j * 2], final_acc[j * 4 + 2]);
    final_acc[j * 4 + 3] = fmaf(acc[j * 4 + 3], sa1 * sb[j * 2 + 1], final_acc[j * 4 + 3]);
  }
}

}  // namespace moe_kernels
