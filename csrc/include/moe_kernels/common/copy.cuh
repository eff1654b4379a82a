#pragma once
// Row copies of the exchange and transport kernels: every load of a row is issued before its
// stores, so a row costs one load round trip whatever its length, and the stores (often to a
// peer GPU over NVLink) are not waited for.
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

// kVecs 16-byte vectors spread over the kThreads threads of a group (a warp or a CTA); `index` is
// the thread's place in the group. Destination addresses may be generic (from a table of peer
// addresses): st.global says where they point.
template <uint32_t kVecs, uint32_t kThreads>
__device__ __forceinline__ void copy_row(const uint4* __restrict__ src, uint4* dst, uint32_t index) {
  constexpr uint32_t kPerThread = (kVecs + kThreads - 1) / kThreads;
  uint4 v[kPerThread];
#pragma unroll
  for (uint32_t i = 0; i < kPerThread; ++i) {
    if (i * kThreads + index < kVecs) v[i] = __ldg(src + i * kThreads + index);
  }
#pragma unroll
  for (uint32_t i = 0; i < kPerThread; ++i) {
    if (i * kThreads + index < kVecs) __stcg(dst + i * kThreads + index, v[i]);
  }
}

}  // namespace moe_kernels
