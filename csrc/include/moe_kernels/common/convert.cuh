#pragma once
// Exact widening of the supported input element types to float32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moe_kernels {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace moe_kernels
