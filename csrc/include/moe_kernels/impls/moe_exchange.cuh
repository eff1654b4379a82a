#pragma once
// The staged backend's row exchange (the contiguous layout of every rank, sized by a count
// exchange the host has already read): dispatch writes each sent (token, slot) pair's FP8 row,
// scales, top-k weight and source into the row its owner's layout gives it; combine writes each
// received row's expert output back into its source's combine buffer. One warp per row, 16-byte
// vectors, every load of a row issued before its stores: a remote row costs one NVLink round of
// stores instead of the per-byte index kernels of torch's index_copy_.
//
// Peer tables (int64 [kNumTables, P], the addresses of rank q's views in this process, the
// caller's own rank included): 0 acts uint8 [R, H], 1 acts_sf float32 [R, H/128], 2 weights
// float32 [R], 3 slots int32 [R], 4 combine bfloat16 [C, H].
// A row's slot word is source * pairs_per_rank + t * k + j: the combine finds the source rank and
// the pair in it without a per-source row list.

#include <cuda_bf16.h>
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

enum ExchangeTable : uint32_t { kExActs = 0, kExScales, kExWeights, kExSlots, kExCombine, kNumTables };

// kVecs 16-byte vectors spread over a warp's lanes, all loaded before any is stored.
template <uint32_t kVecs>
__device__ __forceinline__ void copy_row_warp(const uint4* __restrict__ src, uint4* dst, uint32_t lane) {
  constexpr uint32_t kPerLane = (kVecs + 31) / 32;
  uint4 v[kPerLane];
#pragma unroll
  for (uint32_t i = 0; i < kPerLane; ++i) {
    if (i * 32 + lane < kVecs) v[i] = __ldg(src + i * 32 + lane);
  }
#pragma unroll
  for (uint32_t i = 0; i < kPerLane; ++i) {
    // Addresses from a table are generic: st.global says where they point (peer memory included).
    if (i * 32 + lane < kVecs) __stcg(dst + i * 32 + lane, v[i]);
  }
}

// Sorted pair i (pair id order[i] = t * k + j, routed to global expert topk_idx[order[i]]) goes to
// row rows[i] of rank topk_idx[order[i]] / num_local. Ids are in [0, num_local * P): the host
// counted every pair it sends.
template <uint32_t kTopK, uint32_t kHidden, uint32_t kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    moe_exchange_dispatch_kernel(const long long* __restrict__ tables, uint32_t num_ranks, uint32_t rank,
                                 uint32_t num_local, uint32_t pairs_per_rank, const long long* __restrict__ order,
                                 const long long* __restrict__ rows, uint32_t num_rows,
                                 const long long* __restrict__ topk_idx, const float* __restrict__ topk_weights,
                                 const uint8_t* __restrict__ xq, const float* __restrict__ xs) {
  static_assert(kHidden % 128 == 0, "one scale per 128 columns, rows copied 16 bytes at a time");
  constexpr uint32_t kScales = kHidden / 128;
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t i = blockIdx.x * kWarps + threadIdx.x / 32; i < num_rows; i += gridDim.x * kWarps) {
    const auto pair = static_cast<uint32_t>(order[i]);
    const auto owner = static_cast<uint32_t>(topk_idx[pair] / num_local);
    const auto row = static_cast<uint64_t>(rows[i]);
    const uint32_t token = pair / kTopK;
    auto* acts = reinterpret_cast<uint4*>(tables[kExActs * num_ranks + owner] + row * kHidden);
    copy_row_warp<kHidden / 16>(reinterpret_cast<const uint4*>(xq + uint64_t(token) * kHidden), acts, lane);
    auto* scales = reinterpret_cast<float*>(tables[kExScales * num_ranks + owner]) + row * kScales;
    for (uint32_t s = lane; s < kScales; s += 32) scales[s] = __ldg(xs + uint64_t(token) * kScales + s);
    if (lane == 0) {
      reinterpret_cast<float*>(tables[kExWeights * num_ranks + owner])[row] = __ldg(topk_weights + pair);
      reinterpret_cast<int*>(tables[kExSlots * num_ranks + owner])[row] = static_cast<int>(rank * pairs_per_rank + pair);
    }
  }
}

// Received row rows[i] of this rank's layout: its slot word names the source rank and the pair.
template <uint32_t kHidden, uint32_t kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    moe_exchange_combine_kernel(const long long* __restrict__ tables, uint32_t num_ranks, uint32_t rank,
                                uint32_t pairs_per_rank, const long long* __restrict__ rows, uint32_t num_rows,
                                const __nv_bfloat16* __restrict__ expert_out) {
  static_assert(kHidden % 8 == 0, "rows are copied 16 bytes at a time");
  const uint32_t lane = threadIdx.x % 32;
  const int* slots = reinterpret_cast<const int*>(tables[kExSlots * num_ranks + rank]);
  for (uint32_t i = blockIdx.x * kWarps + threadIdx.x / 32; i < num_rows; i += gridDim.x * kWarps) {
    const auto row = static_cast<uint64_t>(rows[i]);
    const auto slot = static_cast<uint32_t>(slots[row]);
    const uint32_t source = slot / pairs_per_rank;
    if (source >= num_ranks) continue;  // never written by the dispatch kernel; never write outside the group
    auto* dst = reinterpret_cast<uint4*>(tables[kExCombine * num_ranks + source]) +
                uint64_t(slot % pairs_per_rank) * (kHidden / 8);
    copy_row_warp<kHidden / 8>(reinterpret_cast<const uint4*>(expert_out + row * kHidden), dst, lane);
  }
}

}  // namespace moe_kernels
