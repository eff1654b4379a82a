#pragma once
// MoE combine: token t's output is the sum over its top-k slots j = 0..k-1, in slot order and in
// float32, of the bfloat16 expert-output row src[rows[t * k + j]] (slots with routed[t, j] false
// add nothing), rounded once to the output dtype. The numerics of moe_runtime's reference combine
// (float32 adds in slot order, one rounding), in one launch instead of 2k + 1 elementwise ones.
//
// Grid T x ceil(kHidden / 8 / kThreads) CTAs along x (no 65535 limit on T); each thread owns 8
// consecutive columns of one token and reads them with one 16-byte load per slot. The sum starts at
// -0 and an unrouted slot adds +0 without being read, so even signed zeros come out as the
// reference's (which starts from slot 0 and adds the unrouted slots as +0). A row index outside
// src makes the token's output NaN.

#include <cuda_bf16.h>
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

template <uint32_t kTopK, uint32_t kHidden, uint32_t kThreads, bool kFloatOut>
__global__ void __launch_bounds__(kThreads)
    moe_combine_kernel(const __nv_bfloat16* __restrict__ src, long long num_src_rows, const long long* __restrict__ rows,
                       const bool* __restrict__ routed, void* __restrict__ out) {
  static_assert(kHidden % 8 == 0, "rows are read 8 bf16 columns (16 bytes) at a time");
  constexpr uint32_t kColumnBlocks = (kHidden / 8 + kThreads - 1) / kThreads;
  const uint32_t token = blockIdx.x / kColumnBlocks;
  const uint32_t col = ((blockIdx.x % kColumnBlocks) * kThreads + threadIdx.x) * 8;
  if (col >= kHidden) return;
  float acc[8];
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) acc[i] = -0.0f;
#pragma unroll
  for (uint32_t j = 0; j < kTopK; ++j) {
    const uint64_t pair = uint64_t(token) * kTopK + j;
    if (routed != nullptr && !routed[pair]) {
#pragma unroll
      for (uint32_t i = 0; i < 8; ++i) acc[i] += 0.0f;
      continue;
    }
    const long long row = rows != nullptr ? rows[pair] : static_cast<long long>(pair);
    if (row < 0 || row >= num_src_rows) {  // no host check (it would sync): a loud NaN, no stray read
#pragma unroll
      for (uint32_t i = 0; i < 8; ++i) acc[i] = __int_as_float(0x7FC00000);
      break;
    }
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + row * kHidden + col));
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  const uint64_t offset = uint64_t(token) * kHidden + col;
  if constexpr (kFloatOut) {
    auto* dst = reinterpret_cast<float4*>(static_cast<float*>(out) + offset);
    dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  } else {
    uint4 packed;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(out) + offset) = packed;
  }
}

}  // namespace moe_kernels
