#pragma once
// Block-wide prefix sums over shared memory.
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

// data[0, n) <- its exclusive prefix sum, in place; returns the total to every thread. All kThreads
// threads call it (it synchronises the block before and after); `warp_sums` holds kThreads / 32 ints. Each thread scans a contiguous chunk, the
// chunk totals are scanned across lanes and warps, then each chunk is rewritten with its offset.
template <uint32_t kThreads>
__device__ __forceinline__ int block_exclusive_scan(int* data, uint32_t n, int* warp_sums) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, one block");
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  __syncthreads();  // data written by other threads
  const uint32_t chunk = (n + kThreads - 1) / kThreads;
  const uint32_t begin = min(tid * chunk, n), end = min(begin + chunk, n);
  int sum = 0;
  for (uint32_t i = begin; i < end; ++i) sum += data[i];
  int inclusive = sum;
#pragma unroll
  for (uint32_t offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = inclusive - sum, total = 0;
  for (uint32_t w = 0; w < kThreads / 32; ++w) {
    before += w < warp ? warp_sums[w] : 0;
    total += warp_sums[w];
  }
  for (uint32_t i = begin; i < end; ++i) {
    const int value = data[i];
    data[i] = before;
    before += value;
  }
  __syncthreads();  // the scanned data, and warp_sums free for the next call
  return total;
}

}  // namespace moe_kernels
