#pragma once
// One rank's decode dispatch into the masked layout, in one launch: the T x k (token, slot) pairs
// of a routing go to rows of [E_l, T] + spare rows, expert e's pairs to rows e * T + i in (token,
// slot) order, unrouted pairs (id < 0) to rows E_l * T + i. No expert receives more than T rows
// (a token's experts are distinct), so the layout needs no counts from the host.
//
// Grid: kPairs CTAs, one per pair, then the CTAs that write the rows' expert ids (and masked_m).
//   pair CTA p:  its rank among the pairs of its expert (a block-wide count over the pairs before
//                it), then the pair's FP8 row, its scales and its top-k weight copied to its row;
//   id CTAs:     the expert histogram in shared memory, then expert id or -1 for their rows.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

// The pair's expert among the kNumLocal local ones, kNumLocal for unrouted (and, defensively, for
// ids outside this rank's experts).
__device__ __forceinline__ uint32_t local_key(long long id, long long first_expert, uint32_t num_local) {
  const long long e = id - first_expert;
  return id >= 0 && e >= 0 && e < num_local ? static_cast<uint32_t>(e) : num_local;
}

template <uint32_t kTopK, uint32_t kNumLocal, uint32_t kRowBytes, uint32_t kNumScales, uint32_t kThreads>
__global__ void __launch_bounds__(kThreads)
    moe_local_dispatch_kernel(const long long* __restrict__ topk_idx, const float* __restrict__ topk_weights,
                              const uint8_t* __restrict__ xq, const float* __restrict__ xs, uint32_t num_tokens,
                              long long first_expert, uint8_t* __restrict__ acts, float* __restrict__ acts_sf,
                              float* __restrict__ weights, long long* __restrict__ global_ids,
                              long long* __restrict__ pair_rows, int* __restrict__ masked_m) {
  static_assert(kRowBytes % 16 == 0, "rows are copied 16 bytes at a time");
  __shared__ uint32_t counts[kNumLocal + 1];
  __shared__ uint32_t warp_sums[kThreads / 32];
  const uint32_t pairs = num_tokens * kTopK;
  const uint32_t tid = threadIdx.x;

  if (blockIdx.x < pairs) {
    const uint32_t p = blockIdx.x;
    const uint32_t key = local_key(topk_idx[p], first_expert, kNumLocal);
    uint32_t before = 0;
    for (uint32_t q = tid; q < p; q += kThreads) before += local_key(topk_idx[q], first_expert, kNumLocal) == key;
#pragma unroll
    for (uint32_t offset = 16; offset > 0; offset /= 2) before += __shfl_xor_sync(0xFFFFFFFFu, before, offset);
    if (tid % 32 == 0) warp_sums[tid / 32] = before;
    __syncthreads();
    uint32_t rank = 0;
#pragma unroll
    for (uint32_t w = 0; w < kThreads / 32; ++w) rank += warp_sums[w];
    const uint64_t row = uint64_t(key) * num_tokens + rank;
    const uint32_t token = p / kTopK;
    if (tid == 0) {
      pair_rows[p] = static_cast<long long>(row);
      weights[row] = topk_weights[p];
    }
    const auto* src = reinterpret_cast<const uint4*>(xq + uint64_t(token) * kRowBytes);
    auto* dst = reinterpret_cast<uint4*>(acts + row * kRowBytes);
    for (uint32_t i = tid; i < kRowBytes / 16; i += kThreads) dst[i] = __ldg(src + i);
    for (uint32_t i = tid; i < kNumScales; i += kThreads) acts_sf[row * kNumScales + i] = xs[uint64_t(token) * kNumScales + i];
    return;
  }

  for (uint32_t e = tid; e <= kNumLocal; e += kThreads) counts[e] = 0;
  __syncthreads();
  for (uint32_t q = tid; q < pairs; q += kThreads) atomicAdd(&counts[local_key(topk_idx[q], first_expert, kNumLocal)], 1u);
  __syncthreads();
  const uint32_t id_cta = blockIdx.x - pairs;
  if (id_cta == 0) {
    for (uint32_t e = tid; e < kNumLocal; e += kThreads) masked_m[e] = static_cast<int>(counts[e]);
  }
  const uint64_t num_rows = uint64_t(kNumLocal) * num_tokens + pairs;
  const uint64_t per_cta = (num_rows + gridDim.x - pairs - 1) / (gridDim.x - pairs);
  const uint64_t begin = id_cta * per_cta;
  const uint64_t end = min(begin + per_cta, num_rows);
  for (uint64_t r = begin + tid; r < end; r += kThreads) {
    const uint64_t e = r / num_tokens;
    const bool valid = e < kNumLocal && r - e * num_tokens < counts[e];
    global_ids[r] = valid ? static_cast<long long>(e) + first_expert : -1;
  }
}

}  // namespace moe_kernels
