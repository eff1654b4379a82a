#pragma once
// Flags between the GPUs of an expert-parallel group: system-scope release stores and acquire
// loads on 32-bit words in (peer) symmetric memory, a bounded spin, and the "last CTA of the grid"
// election that turns a whole kernel's writes into one flag per peer.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels::signals {

// A flag store that is a release only after a fence.sc.sys of the same thread (last_cta_done's):
// st.release.sys would repeat that fence (a MEMBAR.ALL.SYS) for every peer's flag.
__device__ __forceinline__ void store_relaxed_sys(int* ptr, int value) {
  asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ int load_acquire_sys(const int* ptr) {
  int value;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until *flag == expected (kAtLeast: until it has reached expected, for flags that only grow
// and that a peer may raise past `expected` before this thread looks). A peer that never arrives (a rank that died, or one that runs a
// different number of steps) must not hang the GPU forever: after timeout_ns the kernel traps,
// which surfaces as a CUDA error on the host's next synchronisation (and ends the context).
template <bool kAtLeast = false>
__device__ __forceinline__ void wait_flag(const int* flag, int expected, uint64_t timeout_ns, const char* what,
                                          int peer) {
  const uint64_t start = global_timer_ns();
  // Wrapping compare: epochs are unsigned counters.
  const auto reached = [&](int value) {
    return kAtLeast ? static_cast<int>(static_cast<unsigned>(value) - static_cast<unsigned>(expected)) >= 0
                    : value == expected;
  };
  while (!reached(load_acquire_sys(flag))) {
    if (global_timer_ns() - start > timeout_ns) {
      printf("moe_ep: timed out waiting for %s of rank %d (step %d, flag %d)\n", what, peer, expected,
             load_acquire_sys(flag));
      __trap();
    }
    __nanosleep(64);
  }
}

// Called by every thread of every CTA once the CTA's writes are issued; returns true in thread 0
// of the last CTA to get here, after which every write of the grid is visible system-wide (each
// thread's fence, then the counter's chain of atomics). `counter` (this rank's memory, zero
// before the launch) is reset for the next launch.
__device__ __forceinline__ bool last_cta_done(int* counter) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return false;
  const bool last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
  if (last) {
    __threadfence_system();
    *counter = 0;
  }
  return last;
}

// last_cta_done for the whole CTA: every thread of the last CTA gets true (a CTA-uniform branch
// may then hold __syncthreads).
__device__ __forceinline__ bool last_cta_done_all(int* counter) {
  __shared__ bool last;
  const bool mine = last_cta_done(counter);
  if (threadIdx.x == 0) last = mine;
  __syncthreads();
  return last;
}

}  // namespace moe_kernels::signals
