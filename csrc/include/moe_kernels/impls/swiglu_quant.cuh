#pragma once
// The staged experts' step between the two grouped GEMMs in one pass: act = silu(gate) * up * w
// in float32 (h = [gate | up] bfloat16 [M, 2I], w the row's top-k weight), then act quantized to
// E4M3 with one float32 scale per 1 x 128, with per_token_cast_to_fp8's numerics (quant.cuh).
// silu(x) = x / (1 + exp(-x)) with an IEEE division, as torch computes it.
//
// Masked layout (masked_m != nullptr): row r belongs to group r / rows_per_group and only its
// first masked_m[g] rows are computed; the others are neither read nor written (the masked GEMM
// that reads act skips them), which is what makes the step cheap when the layout holds far more
// rows than arrive (the low-latency transport's P x T_cap rows per expert).
//
// Work items are (row, 128-column group), 16 lanes per group, 8 columns (one 16-byte load of
// gate and one of up) per lane; the grid walks items grid-stride, numbered by scale_item
// (common/scale_items.h). The scale of (row, group) goes to
// sf[row * sf_stride_m + group * sf_stride_k]: K-major, or MN-major for the contiguous GEMM's TMA.

#include <cuda_bf16.h>
#include <moe_kernels/common/fp8.cuh>
#include <moe_kernels/common/scale_items.h>
#include <moe_kernels/common/reduce.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>
#include <moe_kernels/common/vec.cuh>

namespace moe_kernels {

template <uint32_t kInter, uint32_t kThreads>
__global__ void __launch_bounds__(kThreads)
    swiglu_quant_kernel(const __nv_bfloat16* __restrict__ h, const float* __restrict__ weights,
                        const int* __restrict__ masked_m, uint32_t rows_per_group, uint32_t num_rows,
                        unsigned char* __restrict__ out, float* __restrict__ sf, uint32_t sf_stride_m,
                        uint32_t sf_stride_k) {
  static_assert(kInter % 128 == 0, "one scale per 128 columns of act");
  constexpr uint32_t kVec = 8;
  constexpr uint32_t kLanesPerGroup = 128 / kVec;
  constexpr uint32_t kGroupsPerRow = kInter / 128;
  constexpr uint32_t kItemsPerCta = kThreads / kLanesPerGroup;
  static_assert(kThreads % 32 == 0, "whole warps: the amax shuffles need every lane");

  const uint32_t lane = threadIdx.x % kLanesPerGroup;
  const bool mn_major = scale_items_mn_major(sf_stride_m, kGroupsPerRow);
  const uint64_t num_items = scale_items(uint64_t(num_rows), kGroupsPerRow, mn_major);
  const uint64_t step = uint64_t(gridDim.x) * kItemsPerCta;
  // Rounded up so that whole warps take every step.
  const uint64_t num_steps = (num_items + step - 1) / step;
  for (uint64_t s = 0; s < num_steps; ++s) {
    const uint64_t item = s * step + uint64_t(blockIdx.x) * kItemsPerCta + threadIdx.x / kLanesPerGroup;
    const auto [row, group] = scale_item(item, kGroupsPerRow, mn_major);
    bool valid = item < num_items && row < num_rows;
    if (valid && masked_m != nullptr) {
      const uint32_t masked_group = row / rows_per_group;
      valid = static_cast<int>(row - masked_group * rows_per_group) < __ldg(masked_m + masked_group);
    }
    const uint32_t col = group * 128 + lane * kVec;
    float act[kVec];
    float amax = 0.0f;
    if (valid) {
      const __nv_bfloat16* src = h + uint64_t(row) * (2 * kInter);
      const auto gate = load_stream<kVec>(src + col);
      const auto up = load_stream<kVec>(src + kInter + col);
      const float w = __ldg(weights + row);
#pragma unroll
      for (uint32_t i = 0; i < kVec; ++i) {
        const float g = __bfloat162float(gate.elems[i]);
        const float silu = __fdiv_rn(g, 1.0f + expf(-g));
        act[i] = __fmul_rn(__fmul_rn(silu, __bfloat162float(up.elems[i])), w);
        amax = fmax_nan(amax, fabsf(act[i]));
      }
    }
    amax = warp_reduce_max<kLanesPerGroup>(amax);
    if (!valid) continue;
    const float scale = fp8_scale_from_amax<false>(amax);
    if (lane == 0) sf[uint64_t(row) * sf_stride_m + uint64_t(group) * sf_stride_k] = scale;
    Vec<unsigned char, kVec> packed;
    scale_to_e4m3<kVec>(act, __frcp_rn(scale), packed.elems);
    store_global(out + uint64_t(row) * kInter + col, packed);
  }
}

}  // namespace moe_kernels
