#pragma once
// Low-latency expert-parallel transport (decode sizes): dispatch into and combine out of the
// masked layout of every rank's local experts, by peer writes into each rank's symmetric buffer,
// with no host synchronisation (a forward can sit in a CUDA graph). P ranks, E_l local experts
// each, T_cap tokens per rank at most, top-k, hidden H.
//
// A rank's symmetric buffer (the same byte offsets on every rank; `peers` holds every rank's base
// address as mapped in this process):
//   recv_x   uint8  [E_l, R, H]       FP8 rows for this rank's experts, R = P * T_cap rows each (a
//                                     token's top-k experts are distinct, so a source sends an
//                                     expert at most T_cap rows)
//   recv_sf  float  [E_l, R, H / 128]
//   recv_w   float  [E_l, R]          the pair's top-k weight
//   recv_src int32  [E_l, R]          source rank * T_cap * k + t * k + j
//   combine  bf16   [T_cap * k, H]    expert outputs of this rank's pairs, written by their owners
//   signals  int32  (EpSignals)
// A row's place inside its expert comes from an atomic counter on the owner, so the rows of an
// expert are in no particular order; every step is row-local and the combine sums each token's
// slots in slot order, so results do not depend on it.
//
// Epochs: each rank counts its finished dispatches and combines in its own memory (the last CTA
// of each step's kernel increments them); a step's flags carry its count, so they never need
// resetting, and a dispatch not followed by its combine (or the reverse) waits for flags no peer
// raises and times out instead of reading half-written rows. The slot counters alternate between
// two sets by the dispatch's parity, and the next dispatch's set is zeroed by its owner at the end
// of this dispatch. That zeroing is seen by any sender of the next dispatch: a sender starts it
// only after its combine saw this owner's combine flag, released after. No flag runs ahead of a
// waiter: a rank raises its next flag only after every rank's flag of the step before.
//
// Kernels, in stream order on every rank (one launch per step, so a decode round is three
// launches with kernels.moe_combine):
//   dispatch   one CTA per token (grid-stride): the token's slots on its owners (system-scope
//              atomics, one thread per top-k slot), its row quantized to E4M3 in registers (or
//              read as E4M3 with its scales), then the row, scales, weight and source written
//              into every owner's buffer, and routed[pair] (written or not: unrouted, or past its
//              expert's R rows) for this rank's combine. The last CTA raises this rank's dispatch
//              flag on every rank, waits for every rank's, writes masked_m [E_l], zeroes the next
//              dispatch's counters and counts the dispatch;
//   (the experts: masked grouped GEMMs on [E_l, R, H] with masked_m)
//   combine    each received row's expert output to its source's combine buffer (the rows as
//              counted on this rank, not as the caller says); the last CTA raises this rank's
//              combine flag on every rank, waits for every rank's and counts the combine;
//   (kernels.moe_combine sums each token's slots out of the combine buffer).
// Only the last CTA waits, after every other CTA of its grid finished: the waits need no CTA to
// be co-resident with another.

#include <cuda/std/type_traits>
#include <cuda_bf16.h>
#include <moe_kernels/common/copy.cuh>
#include <moe_kernels/common/fp8_row.cuh>
#include <moe_kernels/common/signals.cuh>

namespace moe_kernels {

// Word offsets in a rank's signal area (kernels/ep.py's ep_signal_ints counts them).
struct EpSignals {
  uint32_t num_ranks, num_local;
  __device__ __forceinline__ uint32_t counts(uint32_t parity) const { return parity * num_local; }
  __device__ __forceinline__ uint32_t dispatch_done() const { return 2 * num_local; }
  __device__ __forceinline__ uint32_t combine_done() const { return 2 * num_local + num_ranks; }
  __device__ __forceinline__ uint32_t dispatches() const { return 2 * num_local + 2 * num_ranks; }
  __device__ __forceinline__ uint32_t combines() const { return dispatches() + 1; }
  __device__ __forceinline__ uint32_t finished(uint32_t kernel) const { return dispatches() + 2 + kernel; }
};

template <typename T>
__device__ __forceinline__ T* view(uint64_t base, uint64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// The step a kernel runs under: one more than the steps (dispatches or combines) this rank
// finished. Unsigned: it wraps after 2^32 steps, harmlessly (flags compare for equality, parity
// keeps alternating).
__device__ __forceinline__ uint32_t next_step(const int* signals, uint32_t word) {
  return static_cast<uint32_t>(*reinterpret_cast<const volatile int*>(signals + word)) + 1u;
}

template <typename InT, uint32_t kTopK, uint32_t kHidden, uint32_t kThreads>
__global__ void __launch_bounds__(kThreads, 1)
    moe_ep_dispatch(const uint64_t* __restrict__ peers, uint64_t off_x, uint64_t off_sf, uint64_t off_w,
                    uint64_t off_src, uint64_t off_signals, uint32_t rank, uint32_t num_ranks, uint32_t num_local,
                    uint32_t rows_per_expert, uint32_t pairs_per_rank, const long long* __restrict__ topk_idx,
                    const float* __restrict__ topk_weights, const InT* __restrict__ x, uint64_t x_row_stride,
                    const float* __restrict__ xs, uint32_t num_tokens, bool* __restrict__ routed,
                    uint64_t timeout_ns, int* __restrict__ masked_m) {
  static_assert(kHidden % 128 == 0, "rows move 16 bytes at a time, one scale per 128 columns");
  static_assert(kThreads % 32 == 0 && kTopK <= kThreads, "whole warps, a thread per top-k slot");
  constexpr uint32_t kScales = kHidden / 128;
  constexpr uint32_t kVecs = kHidden / 16;
  constexpr uint32_t kPerThread = (kVecs + kThreads - 1) / kThreads;
  constexpr uint32_t kNotWritten = ~0u;
  const EpSignals sig{num_ranks, num_local};
  int* signals = view<int>(peers[rank], off_signals);
  const uint32_t epoch = next_step(signals, sig.dispatches());
  const uint32_t parity = epoch & 1;
  const long long num_experts = static_cast<long long>(num_local) * num_ranks;
  __shared__ uint32_t slot_owner[kTopK];
  __shared__ uint64_t slot_row[kTopK];

  for (uint32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    if (threadIdx.x < kTopK) {
      const uint32_t p = t * kTopK + threadIdx.x;
      const long long id = topk_idx[p];
      uint32_t owner = kNotWritten;
      uint64_t row = 0;
      if (id >= 0 && id < num_experts) {
        const uint32_t o = static_cast<uint32_t>(id / num_local), expert = static_cast<uint32_t>(id % num_local);
        const uint32_t slot = static_cast<uint32_t>(
            atomicAdd_system(view<int>(peers[o], off_signals) + sig.counts(parity) + expert, 1));
        // Only repeated ids within a token overflow an expert's R rows (any rank's: the atomic order
        // decides whose pair is dropped), and a dropped pair must not be summed by the combine: its
        // combine slot holds stale data (or nothing yet).
        if (slot < rows_per_expert) {
          owner = o;
          row = uint64_t(expert) * rows_per_expert + slot;
          view<float>(peers[o], off_w)[row] = __ldg(topk_weights + p);
          view<int>(peers[o], off_src)[row] = static_cast<int>(rank * pairs_per_rank + p);
        }
      }
      routed[p] = owner != kNotWritten;
      slot_owner[threadIdx.x] = owner;
      slot_row[threadIdx.x] = row;
    }
    // The row's loads (and its quantization) overlap the slots' atomics.
    uint4 q[kPerThread];
    float scale[kPerThread];
    const float* xs_row = cuda::std::is_same_v<InT, uint8_t> ? xs + uint64_t(t) * kScales : nullptr;
    load_row_e4m3<InT, kVecs, kThreads>(x + t * x_row_stride, xs_row, 0, threadIdx.x, q, scale);
    __syncthreads();
    for (uint32_t j = 0; j < kTopK; ++j) {
      const uint32_t owner = slot_owner[j];
      if (owner == kNotWritten) continue;
      const uint64_t base = peers[owner], row = slot_row[j];
      uint4* dst = view<uint4>(base, off_x + row * kHidden);
      float* dst_sf = view<float>(base, off_sf) + row * kScales;
#pragma unroll
      for (uint32_t i = 0; i < kPerThread; ++i) {
        const uint32_t c = i * kThreads + threadIdx.x;
        if (c >= kVecs) continue;
        __stcg(dst + c, q[i]);
        if (c % 8 == 0) dst_sf[c / 8] = scale[i];
      }
    }
    __syncthreads();  // the slots are rewritten for the CTA's next token
  }

  if (!signals::last_cta_done_all(signals + sig.finished(0))) return;
  if (threadIdx.x == 0) {
    for (uint32_t r = 0; r < num_ranks; ++r) {
      signals::store_relaxed_sys(view<int>(peers[r], off_signals) + sig.dispatch_done() + rank, static_cast<int>(epoch));
    }
  }
  for (uint32_t s = threadIdx.x; s < num_ranks; s += kThreads) {
    signals::wait_flag(signals + sig.dispatch_done() + s, static_cast<int>(epoch), timeout_ns, "the dispatch",
                       static_cast<int>(s));
  }
  // The acquires of the waiting threads, then the barrier: every thread reads final counters.
  __syncthreads();
  for (uint32_t e = threadIdx.x; e < num_local; e += kThreads) {
    const int count = *reinterpret_cast<volatile int*>(signals + sig.counts(parity) + e);
    masked_m[e] = min(count, static_cast<int>(rows_per_expert));
    signals[sig.counts(parity ^ 1) + e] = 0;
  }
  if (threadIdx.x == 0) signals[sig.dispatches()] = static_cast<int>(epoch);
}

// A grid-stride loop over the received rows of all local experts, flattened: expert e's valid rows
// are [prefix[e], prefix[e + 1]).
template <uint32_t kHidden, uint32_t kThreads>
__global__ void __launch_bounds__(kThreads)
    moe_ep_combine(const uint64_t* __restrict__ peers, uint64_t off_src, uint64_t off_combine, uint64_t off_signals,
                   uint32_t rank, uint32_t num_ranks, uint32_t num_local, uint32_t rows_per_expert,
                   uint32_t pairs_per_rank, const __nv_bfloat16* __restrict__ expert_out, uint64_t timeout_ns) {
  static_assert(kHidden % 8 == 0, "rows are copied 16 bytes at a time");
  extern __shared__ uint32_t prefix[];  // [num_local + 1]
  const EpSignals sig{num_ranks, num_local};
  int* signals = view<int>(peers[rank], off_signals);
  const uint32_t epoch = next_step(signals, sig.combines());
  // The rows the last dispatch counted (its counter set stays intact until the next dispatch).
  const uint32_t parity = static_cast<uint32_t>(signals[sig.dispatches()]) & 1;
  if (threadIdx.x == 0) {
    uint32_t sum = 0;
    for (uint32_t e = 0; e < num_local; ++e) {
      prefix[e] = sum;
      sum += static_cast<uint32_t>(min(max(signals[sig.counts(parity) + e], 0), static_cast<int>(rows_per_expert)));
    }
    prefix[num_local] = sum;
  }
  __syncthreads();
  const int* src_ids = view<int>(peers[rank], off_src);
  for (uint32_t f = blockIdx.x; f < prefix[num_local]; f += gridDim.x) {
    uint32_t lo = 0, hi = num_local;  // the expert e with prefix[e] <= f < prefix[e + 1]
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      (prefix[mid] <= f ? lo : hi) = mid;
    }
    const uint64_t row = uint64_t(lo) * rows_per_expert + (f - prefix[lo]);
    const uint32_t src = static_cast<uint32_t>(src_ids[row]);
    const uint32_t source = src / pairs_per_rank, pair = src % pairs_per_rank;
    if (source >= num_ranks) continue;  // cannot come from the dispatch; never write outside the group
    copy_row<kHidden / 8, kThreads>(reinterpret_cast<const uint4*>(expert_out + row * kHidden),
                                    view<uint4>(peers[source], off_combine + uint64_t(pair) * kHidden * 2), threadIdx.x);
  }

  if (!signals::last_cta_done_all(signals + sig.finished(1))) return;
  if (threadIdx.x == 0) {
    for (uint32_t r = 0; r < num_ranks; ++r) {
      signals::store_relaxed_sys(view<int>(peers[r], off_signals) + sig.combine_done() + rank, static_cast<int>(epoch));
    }
  }
  for (uint32_t s = threadIdx.x; s < num_ranks; s += kThreads) {
    signals::wait_flag(signals + sig.combine_done() + s, static_cast<int>(epoch), timeout_ns, "the combine",
                       static_cast<int>(s));
  }
  __syncthreads();
  if (threadIdx.x == 0) signals[sig.combines()] = static_cast<int>(epoch);
}

}  // namespace moe_kernels
