#pragma once
// A token's row as E4M3 16-byte vectors for the transports that send it (impls/moe_ep_ll.cuh,
// impls/moe_exchange.cuh): read as E4M3 with its scales, or quantized on the fly from bf16 / fp16 /
// fp32, bit for bit as kernels.per_token_cast_to_fp8 (1 x 128 groups, IEEE scale, no UE8M0; see
// impls/quant.cuh), so a dispatch needs no cast launch before it.
#include <cuda/std/type_traits>

#include <moe_kernels/common/convert.cuh>
#include <moe_kernels/common/fp8.cuh>
#include <moe_kernels/common/reduce.cuh>
#include <moe_kernels/common/vec.cuh>

namespace moe_kernels {

// Vectors c = vec_begin + i * kThreads + index (i < kPerThread) of a row of kVecs (16 columns each)
// into q[i], and the scale of each one's 128-column group into scale[i] (meaningful in the group's
// first vector, c % 8 == 0). InT uint8_t: the row is E4M3 already, its scales in xs_row. Otherwise
// a group is 8 consecutive index values, which must be 8 consecutive lanes of a warp (kThreads and
// vec_begin multiples of 8), and every lane of the warp must call (past the row's end too: those
// lanes take part in the shuffles with zeros).
template <typename InT, uint32_t kVecs, uint32_t kThreads, uint32_t kPerThread>
__device__ __forceinline__ void load_row_e4m3(const InT* __restrict__ x_row, const float* __restrict__ xs_row,
                                              uint32_t vec_begin, uint32_t index, uint4 (&q)[kPerThread],
                                              float (&scale)[kPerThread]) {
  static_assert(kVecs % 8 == 0 && kThreads % 8 == 0, "whole 128-column groups, a group's lanes in one warp");
  constexpr uint32_t kLanesPerGroup = 8;
#pragma unroll
  for (uint32_t i = 0; i < kPerThread; ++i) {
    const uint32_t c = vec_begin + i * kThreads + index;
    const bool valid = c < kVecs;
    if constexpr (cuda::std::is_same_v<InT, uint8_t>) {
      q[i] = valid ? __ldg(reinterpret_cast<const uint4*>(x_row) + c) : make_uint4(0, 0, 0, 0);
      scale[i] = valid && c % kLanesPerGroup == 0 ? __ldg(xs_row + c / kLanesPerGroup) : 0.0f;
    } else {
      constexpr int kPerLoad = 16 / sizeof(InT);
      float values[16];
      float amax = 0.0f;
#pragma unroll
      for (int l = 0; l < 16 / kPerLoad; ++l) {
        const auto raw = valid ? load_stream<kPerLoad>(x_row + c * 16 + l * kPerLoad) : zero_vec<InT, kPerLoad>();
#pragma unroll
        for (int e = 0; e < kPerLoad; ++e) {
          values[l * kPerLoad + e] = to_float(raw.elems[e]);
          amax = fmax_nan(amax, fabsf(values[l * kPerLoad + e]));
        }
      }
      amax = warp_reduce_max<kLanesPerGroup>(amax);
      scale[i] = fp8_scale_from_amax<false>(amax);
      Vec<unsigned char, 16> packed;
      scale_to_e4m3<16>(values, __frcp_rn(scale[i]), packed.elems);
      q[i] = *reinterpret_cast<const uint4*>(&packed);
    }
  }
}

}  // namespace moe_kernels
