#pragma once
// FP32 scale factors [groups][rows][k_blocks] with any strides, written MN-major and TMA-aligned:
// dst[g][kb][r] at g * dst_group_stride + kb * dst_stride + r (dst_stride a multiple of 4 floats, so
// every K block's column starts on 16 bytes). The layout the FP8 GEMMs load A's scales from with
// one box of block_m floats per K block (kScaleTmaMnMajor), the fastest of their scale loads.
//
// A CTA moves a 32 x 32 tile through shared memory: reads along K (the quantizers' K-major rows,
// 128 bytes per warp), writes along rows (128 bytes per warp). The row padding of the shared tile
// keeps the column reads free of bank conflicts.
//
// Programmatic dependent launch: the source may come from the kernel just before (a quantizer) and
// the destination may still be read by the one before that (an FP8 GEMM reading the last call's
// copy), so nothing is read or written before those grids have finished. Once every CTA has
// started, the next kernel (the GEMM) may launch and run its prologue beside this one.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

constexpr uint32_t kMnMajorSfTile = 32;
constexpr uint32_t kMnMajorSfThreads = 256;

__global__ void __launch_bounds__(kMnMajorSfThreads)
    mn_major_sf_kernel(const float* __restrict__ src, uint32_t rows, uint32_t k_blocks, uint64_t src_stride_m,
                       uint64_t src_stride_k, uint64_t src_group_stride, float* __restrict__ dst,
                       uint64_t dst_stride, uint64_t dst_group_stride) {
  __shared__ float tile[kMnMajorSfTile][kMnMajorSfTile + 1];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  sm90::wait_prerequisites();
  sm90::launch_dependents();
#endif
  constexpr uint32_t kRowsPerPass = kMnMajorSfThreads / kMnMajorSfTile;
  const uint32_t lane = threadIdx.x % kMnMajorSfTile, warp = threadIdx.x / kMnMajorSfTile;
  const uint32_t row0 = blockIdx.x * kMnMajorSfTile, kb0 = blockIdx.y * kMnMajorSfTile;
  const float* src_g = src + blockIdx.z * src_group_stride;
  float* dst_g = dst + blockIdx.z * dst_group_stride;
  // Every load issued before the first store: one memory latency per CTA, not one per pass.
  constexpr uint32_t kPasses = kMnMajorSfTile / kRowsPerPass;
  float v[kPasses];
#pragma unroll
  for (uint32_t p = 0; p < kPasses; ++p) {
    const uint32_t row = row0 + warp + p * kRowsPerPass, kb = kb0 + lane;
    v[p] = row < rows && kb < k_blocks ? __ldg(src_g + row * src_stride_m + kb * src_stride_k) : 0.0f;
  }
#pragma unroll
  for (uint32_t p = 0; p < kPasses; ++p) tile[warp + p * kRowsPerPass][lane] = v[p];
  __syncthreads();
#pragma unroll
  for (uint32_t i = warp; i < kMnMajorSfTile; i += kRowsPerPass) {
    const uint32_t kb = kb0 + i, row = row0 + lane;
    if (row < rows && kb < k_blocks) dst_g[kb * dst_stride + row] = tile[lane][i];
  }
}

}  // namespace moe_kernels
