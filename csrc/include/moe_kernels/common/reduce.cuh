#pragma once
// Warp-level reductions.
#include <moe_kernels/common/math.cuh>

namespace moe_kernels {

// max that returns NaN when either operand is NaN, so that a NaN input cannot hide behind a
// larger finite value (fmaxf would drop it).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Max over each aligned group of kLanes consecutive lanes; every lane of the group gets the
// result. All 32 lanes of the warp must call it.
template <int kLanes>
__device__ __forceinline__ float warp_reduce_max(float value) {
  static_assert(is_power_of_two(kLanes) && kLanes <= 32, "kLanes must be a power of two <= 32");
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    value = fmax_nan(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

}  // namespace moe_kernels
