#pragma once
// FP8 E4M3 quantizers: per-token groups (1 x kGranK, activations) and 128 x 128 blocks (weights).
// Numerics match kernels/reference/quant.py bit for bit; see common/fp8.cuh for the rounding.
#include <moe_kernels/common/convert.cuh>
#include <moe_kernels/common/fp8.cuh>
#include <moe_kernels/common/scale_items.h>
#include <moe_kernels/common/math.cuh>
#include <moe_kernels/common/reduce.cuh>
#include <moe_kernels/common/vec.cuh>

namespace moe_kernels {

// Every (row, group) pair is one work item, numbered by scale_item (common/scale_items.h); its
// scale goes to sf[row * sf_stride_m + group * sf_stride_k]: (kNumGroups, 1) for K-major scales,
// (1, rows rounded up to 4) for the MN-major TMA-aligned layout the GEMMs load without a gather.
// A group is owned by kThreadsPerGroup consecutive lanes (up to a warp), each holding
// kVecsPerThread vectors of kVec elements, and the grid walks the items grid-stride, one item per
// thread per step. On an H200
// neither more items per thread (loads of several items in flight) nor fewer lanes per group
// (the shuffles and the IEEE division spread over more elements) was faster: the kernel is
// limited by DRAM, and many small resident CTAs keep enough loads in flight. kMinCtasPerSm caps
// registers so that the launcher's grid of kMinCtasPerSm CTAs per SM is resident at once.
//
// x: [num_rows, kN] with row stride x_row_stride (elements); out: [num_rows, kN] E4M3 bytes,
// contiguous; sf: [num_rows, ceil(kN / kGranK)] float32 with strides (sf_stride_m, sf_stride_k).
// Requires num_rows * ceil(kN / kGranK) < 2^31, kN % kVec == 0, x and x_row_stride aligned to
// the vector width.
template <typename InT, int kN, int kGranK, bool kUseUE8M0, int kVec, int kThreads,
          int kMinCtasPerSm>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    per_token_cast_to_fp8_kernel(const InT* __restrict__ x, long long x_row_stride,
                                 unsigned char* __restrict__ out, float* __restrict__ sf,
                                 unsigned sf_stride_m, unsigned sf_stride_k, unsigned num_rows) {
  static_assert(is_power_of_two(kGranK) && is_power_of_two(kVec) && kGranK % kVec == 0,
                "group and vector sizes must be powers of two, the vector dividing the group");
  static_assert(kN % kVec == 0, "a vector never straddles the end of a row");
  static_assert(kThreads % 32 == 0, "whole warps");
  constexpr int kThreadsPerGroup = constexpr_min(32, kGranK / kVec);
  constexpr int kVecsPerThread = kGranK / (kVec * kThreadsPerGroup);
  constexpr unsigned kGroupsPerCta = kThreads / kThreadsPerGroup;
  constexpr unsigned kNumGroups = ceil_div(kN, kGranK);
  constexpr bool kHasPartialGroup = kN % kGranK != 0;

  const bool mn_major = scale_items_mn_major(sf_stride_m, kNumGroups);
  const unsigned num_items = scale_items(num_rows, kNumGroups, mn_major);
  const int lane = threadIdx.x % kThreadsPerGroup;
  const unsigned items_per_step = gridDim.x * kGroupsPerCta;
  // Rounded up so that whole warps run every step: the shuffles need all 32 lanes.
  const unsigned num_steps = ceil_div(num_items, items_per_step);

  for (unsigned step = 0; step < num_steps; ++step) {
    const unsigned item = step * items_per_step + blockIdx.x * kGroupsPerCta +
                          threadIdx.x / kThreadsPerGroup;
    const auto [row, group] = scale_item(item, kNumGroups, mn_major);
    const bool item_valid = item < num_items && row < num_rows;
    const int col0 = static_cast<int>(group) * kGranK;

    Vec<InT, kVec> raw[kVecsPerThread];
    const InT* src = x + static_cast<long long>(row) * x_row_stride;
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int col = col0 + (j * kThreadsPerGroup + lane) * kVec;
      const bool valid = item_valid && (!kHasPartialGroup || col < kN);
      raw[j] = valid ? load_stream<kVec>(src + col) : zero_vec<InT, kVec>();
    }

    float values[kVecsPerThread][kVec];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        values[j][i] = to_float(raw[j].elems[i]);
        amax = fmax_nan(amax, fabsf(values[j][i]));
      }
    }
    amax = warp_reduce_max<kThreadsPerGroup>(amax);
    if (!item_valid) continue;
    const float scale = fp8_scale_from_amax<kUseUE8M0>(amax);
    const float inv_scale = __frcp_rn(scale);
    if (lane == 0) sf[static_cast<long long>(row) * sf_stride_m + static_cast<long long>(group) * sf_stride_k] = scale;

    unsigned char* dst = out + static_cast<long long>(row) * kN;
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int col = col0 + (j * kThreadsPerGroup + lane) * kVec;
      if (kHasPartialGroup && col >= kN) continue;
      Vec<unsigned char, kVec> packed;
      scale_to_e4m3<kVec>(values[j], inv_scale, packed.elems);
      store_global(dst + col, packed);
    }
  }
}

// One CTA per 128 x 128 tile, held in registers between the amax and the cast. Grid: (tiles
// along k, tiles along rows, batch). Each row of the tile is read by kBlock / kVec consecutive
// threads; the CTA covers kRowsPerPass rows per pass.
//
// x: [batch, num_rows, kK] with strides (x_batch_stride, x_row_stride, 1) in elements; out:
// [batch, num_rows, kK] E4M3 bytes, contiguous; sf: [batch, ceil(num_rows / 128), ceil(kK /
// 128)] float32, contiguous. Requires kK % kVec == 0, x and both strides aligned to the vector.
template <typename InT, int kK, bool kUseUE8M0, int kVec, int kThreads>
__global__ void __launch_bounds__(kThreads)
    per_block_cast_to_fp8_kernel(const InT* __restrict__ x, long long x_batch_stride,
                                 long long x_row_stride, unsigned char* __restrict__ out,
                                 float* __restrict__ sf, unsigned num_rows) {
  constexpr int kBlock = 128;
  static_assert(is_power_of_two(kVec) && kBlock % kVec == 0, "vector divides the tile width");
  static_assert(kK % kVec == 0, "a vector never straddles the end of a row");
  constexpr int kThreadsPerRow = kBlock / kVec;
  static_assert(kThreads % 32 == 0 && kThreads % kThreadsPerRow == 0, "whole rows per pass");
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  static_assert(kBlock % kRowsPerPass == 0, "whole passes per tile");
  constexpr int kPasses = kBlock / kRowsPerPass;
  constexpr int kNumWarps = kThreads / 32;
  constexpr int kTilesK = ceil_div(kK, kBlock);
  constexpr bool kHasPartialTileK = kK % kBlock != 0;

  __shared__ float warp_amax[kNumWarps];

  const unsigned batch = blockIdx.z;
  const int col = blockIdx.x * kBlock + (threadIdx.x % kThreadsPerRow) * kVec;
  const unsigned row0 = blockIdx.y * kBlock + threadIdx.x / kThreadsPerRow;
  const bool col_valid = !kHasPartialTileK || col < kK;
  const InT* src = x + static_cast<long long>(batch) * x_batch_stride + col;

  Vec<InT, kVec> raw[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const unsigned row = row0 + p * kRowsPerPass;
    raw[p] = col_valid && row < num_rows
                 ? load_stream<kVec>(src + static_cast<long long>(row) * x_row_stride)
                 : zero_vec<InT, kVec>();
  }

  float values[kPasses][kVec];
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      values[p][i] = to_float(raw[p].elems[i]);
      amax = fmax_nan(amax, fabsf(values[p][i]));
    }
  }
  amax = warp_reduce_max<32>(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) amax = fmax_nan(amax, warp_amax[w]);

  const float scale = fp8_scale_from_amax<kUseUE8M0>(amax);
  const float inv_scale = __frcp_rn(scale);
  if (threadIdx.x == 0)
    sf[(static_cast<long long>(batch) * gridDim.y + blockIdx.y) * kTilesK + blockIdx.x] = scale;
  if (!col_valid) return;

  unsigned char* dst = out + static_cast<long long>(batch) * num_rows * kK + col;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const unsigned row = row0 + p * kRowsPerPass;
    if (row >= num_rows) continue;
    Vec<unsigned char, kVec> packed;
    scale_to_e4m3<kVec>(values[p], inv_scale, packed.elems);
    store_global(dst + static_cast<long long>(row) * kK, packed);
  }
}

}  // namespace moe_kernels
