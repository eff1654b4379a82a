#pragma once
// The stage ring between producers (TMA, scale loads) and consumers (math warpgroups): one
// "full" and one "empty" mbarrier per stage. Producers wait on empty with the flipped parity, so
// a fresh ring counts as drained without an initial round of arrivals.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

template <uint32_t kNumStages>
struct PipelineState {
  uint32_t stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kNumStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

template <uint32_t kNumStages>
struct StageRing {
  uint64_t* full;   // [kNumStages]
  uint64_t* empty;  // [kNumStages]

  __device__ __forceinline__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) const {
#pragma unroll
    for (uint32_t s = 0; s < kNumStages; ++s) {
      sm90::mbarrier_init(full + s, full_arrivals);
      sm90::mbarrier_init(empty + s, empty_arrivals);
    }
    sm90::fence_barrier_init();
  }

  __device__ __forceinline__ void producer_acquire(const PipelineState<kNumStages>& st) const {
    sm90::mbarrier_wait(empty + st.stage, st.phase ^ 1);
  }
  __device__ __forceinline__ void consumer_wait(const PipelineState<kNumStages>& st) const {
    sm90::mbarrier_wait(full + st.stage, st.phase);
  }
  __device__ __forceinline__ void consumer_release(const PipelineState<kNumStages>& st) const {
    sm90::mbarrier_arrive(empty + st.stage);
  }
};

}  // namespace moe_kernels
