#pragma once
// The tail split's reduction (see common/scheduler.cuh): every unit of a split tile writes its FP32
// partial sums to a workspace and counts itself on the tile's counter; the unit that counts last
// adds all of them, in split order (the same sum whichever unit is last), and runs the epilogue.
// No unit waits for another, so the units need not be resident together.
//
// Workspace: float [slots * splits][kNumAccum][kNumThreads], a partial stored accumulator-major so
// that the threads of a warp touch consecutive words; counters: int [slots], zero before the launch
// and left zero by the last unit. slot = the tile's index in the tail (times the cluster size, plus
// the CTA's rank): every CTA tile of the tail has its own.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

// Called by the kNumThreads math threads (named barrier kBarrier, thread 0 of them counts) with
// their accumulators; returns true in every thread of the last unit, its final_acc then holding the
// whole tile's sums.
template <uint32_t kNumAccum, uint32_t kNumThreads, uint32_t kBarrier>
__device__ __forceinline__ bool split_reduce(float* final_acc, float* __restrict__ workspace, int* counters,
                                             uint32_t slot, uint32_t split, uint32_t num_splits, uint32_t thread) {
  constexpr uint64_t kPartial = uint64_t(kNumAccum) * kNumThreads;
  float* mine = workspace + (uint64_t(slot) * num_splits + split) * kPartial + thread;
#pragma unroll
  for (uint32_t i = 0; i < kNumAccum; ++i) __stcg(mine + i * kNumThreads, final_acc[i]);
  // Each thread's partial is visible GPU-wide before its unit is counted: its own fence, the barrier,
  // then the counting thread's fence (the release, by the thread that does the atomic).
  __threadfence();
  sm90::named_barrier_sync(kBarrier, kNumThreads);
  if (thread == 0) __threadfence();
  const bool last = thread == 0 && atomicAdd(counters + slot, 1) == static_cast<int>(num_splits) - 1;
  if (!sm90::named_barrier_or(kBarrier, kNumThreads, last)) return false;
  __threadfence();
  const float* partials = workspace + uint64_t(slot) * num_splits * kPartial + thread;
#pragma unroll
  for (uint32_t i = 0; i < kNumAccum; ++i) final_acc[i] = __ldcg(partials + i * kNumThreads);
  for (uint32_t s = 1; s < num_splits; ++s) {
#pragma unroll
    for (uint32_t i = 0; i < kNumAccum; ++i) final_acc[i] += __ldcg(partials + s * kPartial + i * kNumThreads);
  }
  if (thread == 0) counters[slot] = 0;
  return true;
}

}  // namespace moe_kernels
