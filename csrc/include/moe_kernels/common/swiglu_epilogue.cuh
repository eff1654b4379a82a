#pragma once
// The L1 GEMM's SwiGLU epilogue (the FP8 GEMM's kSwiGlu): act = silu(gate) * up * w straight from
// the promoted accumulators, quantized to E4M3 with one FP32 scale per 1 x 128, so the bf16
// [gate | up] tile never reaches global memory and no second kernel reads it back.
//
// The weights are gate/up interleaved (moe_runtime/weight_layout.py): in every 16-row slab of B,
// rows 0-7 are gate rows and 8-15 the up rows of the same 8 channels, so accumulator fragment 2s of
// a thread (scale_promotion.cuh's layout) holds gate columns and fragment 2s + 1 the matching up
// columns. A 128-column tile yields 64 act columns; the two tiles of a pair (n-blocks 2p and 2p + 1)
// run back to back on one CTA and yield act columns [128p, 128p + 128), one scale group: the first
// tile's act waits in registers (kActFloats per thread) for the second's amax. A 256-column tile
// (the pair in one K loop, two 128-column halves) yields the whole group at once.
//
// Numerics are swiglu_quant.cuh's after a bf16 GEMM: each accumulator is rounded to bf16 first, as
// the staged path's D is, so both paths give the same bytes.

#include <cuda_bf16.h>
#include <moe_kernels/common/fp8.cuh>
#include <moe_kernels/common/fp8_gemm_layout.h>
#include <moe_kernels/common/reduce.cuh>

namespace moe_kernels {

template <uint32_t kBlockN>
struct SwiGluTile {
  static_assert(kBlockN % 16 == 0, "whole 16-row slabs of gate and up rows");
  static constexpr uint32_t kSlabs = kBlockN / 16;
  // Act values per thread and tile: two per slab and row, two rows.
  static constexpr uint32_t kActFloats = kSlabs * 4;
};

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// One tile's act values of this thread: act[s * 4 + {0, 1}] row tile_row0, act[s * 4 + {2, 3}]
// row tile_row0 + 8, columns 8 s + 2 (lane % 4) + {0, 1} of the tile's 64 act columns.
template <uint32_t kBlockN>
__device__ __forceinline__ void swiglu_act(const float* final_acc, float w0, float w1, float* act) {
#pragma unroll
  for (uint32_t s = 0; s < SwiGluTile<kBlockN>::kSlabs; ++s) {
#pragma unroll
    for (uint32_t e = 0; e < 4; ++e) {
      const float g = bf16_round(final_acc[(2 * s) * 4 + e]);
      const float u = bf16_round(final_acc[(2 * s + 1) * 4 + e]);
      const float silu = __fdiv_rn(g, 1.0f + expf(-g));
      act[s * 4 + e] = __fmul_rn(__fmul_rn(silu, u), e < 2 ? w0 : w1);
    }
  }
}

// The pair's act (first: the held tile, second: this one) quantized and stored. row_ok0 / row_ok1:
// whether the thread's two rows are stored; act0 / act1 their rows of the pair's 128 columns, sf0 /
// sf1 their scales. All 32 lanes must call it (the amax shuffles).
template <uint32_t kBlockN>
__device__ __forceinline__ void swiglu_store_pair(const float* first, const float* second, uint32_t lane,
                                                  bool row_ok0, bool row_ok1, uint8_t* act0, uint8_t* act1,
                                                  float* sf0, float* sf1) {
  constexpr uint32_t kSlabs = SwiGluTile<kBlockN>::kSlabs;
  float amax[2] = {0.0f, 0.0f};
#pragma unroll
  for (uint32_t i = 0; i < kSlabs * 4; ++i) {
    amax[(i / 2) % 2] = fmax_nan(amax[(i / 2) % 2], fmax_nan(fabsf(first[i]), fabsf(second[i])));
  }
#pragma unroll
  for (uint32_t r = 0; r < 2; ++r) {
    // The lanes of a quad hold one row.
    const float scale = fp8_scale_from_amax<false>(warp_reduce_max<4>(amax[r]));
    const float inv = __frcp_rn(scale);
    if (!(r == 0 ? row_ok0 : row_ok1)) continue;
    uint8_t* row = r == 0 ? act0 : act1;
    if (lane % 4 == 0) *(r == 0 ? sf0 : sf1) = scale;
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
      const float* tile = h == 0 ? first : second;
#pragma unroll
      for (uint32_t s = 0; s < kSlabs; ++s) {
        const unsigned short packed = float2_to_e4m3x2(__fmul_rn(tile[s * 4 + 2 * r], inv),
                                                       __fmul_rn(tile[s * 4 + 2 * r + 1], inv));
        *reinterpret_cast<unsigned short*>(row + h * (kBlockN / 2) + s * 8 + (lane % 4) * 2) = packed;
      }
    }
  }
}

// The thread's two rows of a tile (tile rows tile_row0 and tile_row0 + 8, A rows row0 and row1) and
// their weights, loaded before the K loop so that the epilogue does not wait on global memory. Rows
// at or past the tile's `rows` (M, or a masked group's count) are neither read nor written.
struct SwiGluRows {
  uint32_t row0 = 0, row1 = 0;
  bool ok0 = false, ok1 = false;
  float w0 = 0.0f, w1 = 0.0f;

  __device__ __forceinline__ SwiGluRows(const float* weights, uint32_t a_row0, uint32_t tile_row0, uint32_t rows)
      : row0(a_row0 + tile_row0), row1(a_row0 + tile_row0 + 8), ok0(tile_row0 < rows), ok1(tile_row0 + 8 < rows) {
    if (ok0) w0 = __ldg(weights + row0);
    if (ok1) w1 = __ldg(weights + row1);
  }
};

// Act columns [128 group, 128 group + 128), one scale group, from its two 64-column halves' act
// (first, second) of the thread's rows: quantized and stored.
template <uint32_t kBlockN>
__device__ __forceinline__ void swiglu_store_group(const float* first, const float* second, uint32_t group,
                                                   const SwiGluRows& r, const SwiGluOut& out, uint32_t lane) {
  uint8_t* act_cols = out.act + group * 2 * (kBlockN / 2);
  float* sf = out.sf + uint64_t(group) * out.sf_stride_k;
  swiglu_store_pair<kBlockN>(first, second, lane, r.ok0, r.ok1, act_cols + uint64_t(r.row0) * out.ld_act,
                             act_cols + uint64_t(r.row1) * out.ld_act, sf + uint64_t(r.row0) * out.sf_stride_m,
                             sf + uint64_t(r.row1) * out.sf_stride_m);
}

// A 128-column tile's epilogue: n-block 2p's act waits in `held` for n-block 2p + 1's, whose epilogue
// quantizes and stores the pair's 128 act columns, [128p, 128p + 128), one scale group.
template <uint32_t kBlockN>
__device__ __forceinline__ void swiglu_epilogue(const float* final_acc, float* held, uint32_t n_block,
                                                const SwiGluRows& r, const SwiGluOut& out, uint32_t lane) {
  if (n_block % 2 == 0) {
    swiglu_act<kBlockN>(final_acc, r.w0, r.w1, held);
    return;
  }
  float act[SwiGluTile<kBlockN>::kActFloats];
  swiglu_act<kBlockN>(final_acc, r.w0, r.w1, act);
  swiglu_store_group<kBlockN>(held, act, n_block / 2, r, out, lane);
}

// A 256-column tile's epilogue (both n-blocks of a pair in one K loop, promoted into two halves of
// kHalfN columns each): the scale group n_block's act, with nothing held across tiles.
template <uint32_t kHalfN>
__device__ __forceinline__ void swiglu_epilogue_wide(const float* final_acc, uint32_t n_block, const SwiGluRows& r,
                                                     const SwiGluOut& out, uint32_t lane) {
  constexpr uint32_t kHalfAccum = kHalfN / 2;  // a 64 x kHalfN accumulator set's floats per thread
  float first[SwiGluTile<kHalfN>::kActFloats], second[SwiGluTile<kHalfN>::kActFloats];
  swiglu_act<kHalfN>(final_acc, r.w0, r.w1, first);
  swiglu_act<kHalfN>(final_acc + kHalfAccum, r.w0, r.w1, second);
  swiglu_store_group<kHalfN>(first, second, n_block, r, out, lane);
}

}  // namespace moe_kernels
