#pragma once
// The staged backend's row exchange. Count: this rank's pairs per expert and each pair's position
// among its expert's pairs, the row written into every rank's count matrix. Sizes (after the count exchange):
// every rank's layout size, masked rows and invalid ids, the few ints the host reads. Dispatch:
// each sent (token, slot) pair's FP8 row (quantized on the way when the caller passes bf16 / fp16 /
// fp32 rows), scales, top-k weight and slot word into the row its owner's layout gives it, a warp
// per token, and this rank's layout index (expert of each row). Combine: each received row's expert
// output back into its source's combine buffer, a warp per row (common/copy.cuh).
//
// Peer tables (int64 [kNumTables, P], the addresses of rank q's views in this process, the
// caller's own rank included): 0 acts uint8 [R, H], 1 acts_sf float32 [R, H/128], 2 weights
// float32 [R], 3 slots int32 [R], 4 combine bfloat16 [C, H].
// A row's slot word is source * pairs_per_rank + t * k + j: the combine finds the source rank and
// the pair in it from the row alone.
//
// Layouts (kernels/reference/exchange.py's plan_exchange, the CPU path's and the tests' oracle):
// counts[src * counts_stride + g] are the rows rank src sends to global expert g = q * E_l + e.
// Expert e of rank q owns a segment of align_up(its rows from all sources, alignment) rows, or of
// the largest expert count of q when every expert of q receives at most min(masked_max_rows,
// alignment - 1) rows and some receive rows (the masked layout); segments in expert order, sources
// in rank order inside a segment, a source's rows in the order of their positions (`within`, from
// the count kernel's atomics: any order, which moves rows inside a segment and changes no result).
// Every CTA computes the layouts in shared memory from the P x E counts.

#include <cuda/std/type_traits>
#include <cuda_bf16.h>
#include <moe_kernels/common/copy.cuh>
#include <moe_kernels/common/fp8_row.cuh>
#include <moe_kernels/common/scan.cuh>
#include <moe_kernels/common/signals.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

enum ExchangeTable : uint32_t { kExActs = 0, kExScales, kExWeights, kExSlots, kExCombine, kNumTables };

// Shared memory of exchange_layout, 4 E + E_l + 1 + P + kThreads / 32 ints (the launcher sizes it).
struct ExchangeLayout {
  int* total;      // [E]: rows expert g receives from all sources
  int* base;       // [E]: row, on its owner, of this rank's first pair for expert g
  int* sent;       // [E]: this rank's pairs for expert g
  int* segment;    // [E]: padded segment lengths, then their exclusive prefix sums over all ranks
  int* own_start;  // [E_l + 1]: this rank's segment starts, then the rows of its layout
  int* masked;     // [P]: rows per segment of rank q's masked layout, 0 when contiguous
  int* warp_sums;  // [kThreads / 32]

  __device__ ExchangeLayout(int* smem, uint32_t num_experts, uint32_t num_local, uint32_t num_ranks)
      : total(smem),
        base(smem + num_experts),
        sent(smem + 2 * num_experts),
        segment(smem + 3 * num_experts),
        own_start(smem + 4 * num_experts),
        masked(smem + 4 * num_experts + num_local + 1),
        warp_sums(smem + 4 * num_experts + num_local + 1 + num_ranks) {}
};

// Returns the rows of all ranks' layouts together (the end of the last segment). The counts are
// read through L2 (ld.global.cg), never the read-only path: the count and sizes kernel reads rows
// that peers wrote while it ran.
template <uint32_t kThreads>
__device__ __forceinline__ int exchange_layout(const ExchangeLayout& l, const int* __restrict__ counts,
                                                uint32_t counts_stride, uint32_t num_ranks, uint32_t rank,
                                                uint32_t num_local, uint32_t alignment, uint32_t masked_max_rows) {
  const uint32_t num_experts = num_ranks * num_local, tid = threadIdx.x;
  for (uint32_t g = tid; g < num_experts; g += kThreads) {
    int total = 0, before = 0;
    for (uint32_t src = 0; src < num_ranks; ++src) {
      const int c = __ldcg(counts + uint64_t(src) * counts_stride + g);
      total += c;
      before += src < rank ? c : 0;
    }
    l.total[g] = total;
    l.base[g] = before;
    l.sent[g] = __ldcg(counts + uint64_t(rank) * counts_stride + g);
  }
  __syncthreads();
  const int masked_limit = static_cast<int>(min(masked_max_rows, alignment - 1));
  for (uint32_t q = tid; q < num_ranks; q += kThreads) {
    int most = 0;
    for (uint32_t e = 0; e < num_local; ++e) most = max(most, l.total[q * num_local + e]);
    l.masked[q] = most > 0 && most <= masked_limit ? most : 0;
  }
  __syncthreads();
  const int align = static_cast<int>(alignment);
  for (uint32_t g = tid; g < num_experts; g += kThreads) {
    const int masked = l.masked[g / num_local];
    l.segment[g] = masked > 0 ? masked : (l.total[g] + align - 1) / align * align;
  }
  const int all_rows = block_exclusive_scan<kThreads>(l.segment, num_experts, l.warp_sums);
  for (uint32_t g = tid; g < num_experts; g += kThreads) {
    const uint32_t q = g / num_local;
    const int start = l.segment[g] - l.segment[q * num_local];  // inside rank q's layout
    l.base[g] += start;
    if (q == rank) l.own_start[g - q * num_local] = start;
  }
  if (tid == 0) {
    const int end = rank + 1 < num_ranks ? l.segment[(rank + 1) * num_local] : all_rows;
    l.own_start[num_local] = end - l.segment[rank * num_local];
  }
  __syncthreads();
  return all_rows;
}

// The group's barrier between the exchange's steps, on the device (one CTA): flags[q] (int32
// [P + 1] in rank q's symmetric memory, its address flag_rows[q]) holds in word src the last
// barrier rank src reached, and in word P rank q's own count of barriers. Each thread r < P
// fences (a release of everything this rank's stream wrote before, peers' memory included) and
// raises this rank's word on rank r to the new count; then this rank's words are waited for. A
// peer that passed may raise its next barrier's count before this rank looks, so the wait is for
// "at least" (the counts only grow, wrapping harmlessly). A rank that never arrives makes the
// kernel trap after timeout_ns instead of hanging. Writes of this CTA before it must be fenced by
// their own threads and joined with __syncthreads first (the count and sizes kernel does).
template <uint32_t kThreads>
__device__ __forceinline__ void exchange_group_barrier(const long long* __restrict__ flag_rows, int* __restrict__ flags,
                                                       uint32_t rank, uint32_t num_ranks, uint64_t timeout_ns) {
  const int epoch = static_cast<int>(static_cast<uint32_t>(*reinterpret_cast<volatile int*>(flags + num_ranks)) + 1u);
  for (uint32_t r = threadIdx.x; r < num_ranks; r += kThreads) {
    __threadfence_system();
    signals::store_relaxed_sys(reinterpret_cast<int*>(flag_rows[r]) + rank, epoch);
  }
  for (uint32_t s = threadIdx.x; s < num_ranks; s += kThreads) {
    signals::wait_flag<true>(flags + s, epoch, timeout_ns, "the exchange barrier", static_cast<int>(s));
  }
  __syncthreads();
  if (threadIdx.x == 0) flags[num_ranks] = epoch;
}

// The group's barrier after a multi-CTA step (dispatch, combine), raised by the step's last CTA to
// finish (signals::last_cta_done_all: every thread fenced its own writes first). flag_rows null:
// none, the caller launches the barrier kernel after the step.
struct ExchangeGridBarrier {
  const long long* flag_rows;  // int64 [P]: every rank's flags (exchange_group_barrier's)
  int* flags;                  // int32 [P + 1]: this rank's
  int* done;                   // int32: the grid's finished CTAs, zero between launches
  uint64_t timeout_ns;
};

template <uint32_t kThreads>
__device__ __forceinline__ void exchange_grid_barrier(const ExchangeGridBarrier& b, uint32_t rank,
                                                      uint32_t num_ranks) {
  if (b.flag_rows == nullptr) return;  // the same for every CTA
  if (signals::last_cta_done_all(b.done)) exchange_group_barrier<kThreads>(b.flag_rows, b.flags, rank, num_ranks,
                                                                          b.timeout_ns);
}

// Pair p = t * k + j < num_tokens * k with global expert g = topk_idx[p] in [0, E) and position
// w = within[p] in [0, sent[g]) goes to row base[g] + w of rank g / E_l; other pairs (unrouted, a
// position the counts do not cover, or a row at or past row_capacity, the rows every rank's views
// hold) are dropped, never written outside the owner's segment or views. A warp per token: its row
// is read once (E4M3 with its scales, or bf16 / fp16 / fp32 quantized here as
// kernels.per_token_cast_to_fp8 would, common/fp8_row.cuh), kChunkVecs vectors at a time, and each
// chunk written into every pair's row. Then this rank's layout index over its first
// min(num_layout_rows, layout rows) rows (the caller may learn the layout's size only after this
// launch and pass its capacity): m_indices (local expert, or -1 on padding rows), global_ids (global
// expert or -1), masked_m (rows per local expert).
template <typename InT, uint32_t kTopK, uint32_t kHidden, uint32_t kWarps, uint32_t kMinCtasPerSm>
__global__ void __launch_bounds__(kWarps * 32, kMinCtasPerSm)
    moe_exchange_dispatch_kernel(const long long* __restrict__ tables, uint32_t num_ranks, uint32_t rank,
                                 uint32_t num_local, uint32_t pairs_per_rank, const int* __restrict__ counts,
                                 uint32_t counts_stride, uint32_t alignment, uint32_t masked_max_rows,
                                 uint32_t row_capacity, const int* __restrict__ within, uint32_t num_tokens,
                                 const long long* __restrict__ topk_idx, const float* __restrict__ topk_weights,
                                 const InT* __restrict__ x, uint64_t x_row_stride, const float* __restrict__ xs,
                                 uint32_t num_layout_rows, long long first_expert, int* __restrict__ m_indices,
                                 long long* __restrict__ global_ids, int* __restrict__ masked_m,
                                 ExchangeGridBarrier barrier) {
  static_assert(kHidden % 128 == 0, "one scale per 128 columns, rows moved 16 bytes at a time");
  constexpr uint32_t kThreads = kWarps * 32;
  constexpr uint32_t kScales = kHidden / 128;
  constexpr uint32_t kVecs = kHidden / 16;
  // Vectors per lane in flight per chunk: the row's loads (and quantization) of a chunk, then its
  // stores to every pair's row; registers stay bounded at any hidden size (float32 rows: 2, which
  // fit kMinCtasPerSm = 4's 64 registers but for a scalar spilled; 4 spilled 44 bytes).
  constexpr uint32_t kChunk = sizeof(InT) == 4 ? 2 : 4;
  constexpr uint32_t kChunkVecs = 32 * kChunk;
  constexpr uint32_t kPairRounds = (kTopK + 31) / 32;  // a lane per pair
  constexpr uint64_t kDropped = ~0ull;
  extern __shared__ int smem[];
  const uint32_t num_experts = num_ranks * num_local;
  const ExchangeLayout l(smem, num_experts, num_local, num_ranks);
  exchange_layout<kThreads>(l, counts, counts_stride, num_ranks, rank, num_local, alignment, masked_max_rows);

  const uint32_t lane = threadIdx.x % 32;
  // Tokens spread over the CTAs first, then over their warps: the grid is sized for the index rows
  // too, so a few tokens (decode) would otherwise crowd onto the first CTAs' SMs.
  for (uint32_t token = blockIdx.x + threadIdx.x / 32 * gridDim.x; token < num_tokens; token += gridDim.x * kWarps) {
    // Lane j % 32 of round j / 32: the owner's row of pair j (kDropped when it is not sent), its
    // weight and slot word written.
    uint64_t dst[kPairRounds];
    uint32_t dst_owner[kPairRounds];
#pragma unroll
    for (uint32_t round = 0; round < kPairRounds; ++round) {
      const uint32_t j = round * 32 + lane;
      dst[round] = kDropped;
      dst_owner[round] = 0;
      if (j >= kTopK) continue;
      const uint32_t pair = token * kTopK + j;
      const long long id = topk_idx[pair];
      if (id < 0 || id >= num_experts) continue;
      const auto g = static_cast<uint32_t>(id);
      const int w = within[pair];
      if (w < 0 || w >= l.sent[g]) continue;
      const uint32_t owner = g / num_local;
      const auto row = static_cast<uint64_t>(l.base[g] + w);
      if (row >= row_capacity) continue;
      dst[round] = row;
      dst_owner[round] = owner;
      reinterpret_cast<float*>(tables[kExWeights * num_ranks + owner])[row] = __ldg(topk_weights + pair);
      reinterpret_cast<int*>(tables[kExSlots * num_ranks + owner])[row] = static_cast<int>(rank * pairs_per_rank + pair);
    }
    const InT* x_row = x + token * x_row_stride;
    const float* xs_row = cuda::std::is_same_v<InT, uint8_t> ? xs + uint64_t(token) * kScales : nullptr;
    for (uint32_t c0 = 0; c0 < kVecs; c0 += kChunkVecs) {
      uint4 q[kChunk];
      float scale[kChunk];
      load_row_e4m3<InT, kVecs, 32>(x_row, xs_row, c0, lane, q, scale);
#pragma unroll
      for (uint32_t j = 0; j < kTopK; ++j) {
        const uint64_t row = __shfl_sync(0xffffffffu, dst[j / 32], j % 32);
        const uint32_t owner = __shfl_sync(0xffffffffu, dst_owner[j / 32], j % 32);
        if (row == kDropped) continue;
        auto* acts = reinterpret_cast<uint4*>(tables[kExActs * num_ranks + owner] + row * kHidden);
        auto* scales = reinterpret_cast<float*>(tables[kExScales * num_ranks + owner]) + row * kScales;
#pragma unroll
        for (uint32_t i = 0; i < kChunk; ++i) {
          const uint32_t c = c0 + i * 32 + lane;
          if (c >= kVecs) continue;
          __stcg(acts + c, q[i]);
          if (c % 8 == 0) scales[c / 8] = scale[i];
        }
      }
    }
  }

  const int* own_total = l.total + rank * num_local;
  // Rows past this rank's layout are left alone: a caller that passed its receive capacity slices
  // them away (writing them would cost every forward the whole capacity).
  const uint32_t indexed = min(num_layout_rows, static_cast<uint32_t>(l.own_start[num_local]));
  for (uint32_t r = blockIdx.x * kThreads + threadIdx.x; r < indexed; r += gridDim.x * kThreads) {
    uint32_t lo = 0, hi = num_local;  // the segment e with own_start[e] <= r < own_start[e + 1]
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      (static_cast<uint32_t>(l.own_start[mid]) <= r ? lo : hi) = mid;
    }
    const bool valid = static_cast<int>(r) - l.own_start[lo] < own_total[lo];
    m_indices[r] = valid ? static_cast<int>(lo) : -1;
    global_ids[r] = valid ? first_expert + lo : -1;
  }
  if (blockIdx.x == 0) {
    for (uint32_t e = threadIdx.x; e < num_local; e += kThreads) masked_m[e] = own_total[e];
  }
  exchange_grid_barrier<kThreads>(barrier, rank, num_ranks);
}

// Numbers kUnroll pairs per thread, pairs first + u x kThreads + threadIdx.x (u < kUnroll), their ids
// loaded together before the shared-memory atomics on counts [E + 1] (ids outside [-1, E) counted in
// counts[E]). position[u]: the pair's number among the pairs counted for its expert (the atomic's
// return), -1 when it is not sent (id -1 or outside [0, E), or past num_pairs); expert[u] its id.
template <uint32_t kThreads, uint32_t kUnroll>
__device__ __forceinline__ void exchange_number_pairs(int* counts, const long long* __restrict__ topk_idx,
                                                      uint32_t first, uint32_t num_pairs, uint32_t num_experts,
                                                      uint32_t (&expert)[kUnroll], int (&position)[kUnroll]) {
  long long ids[kUnroll];
#pragma unroll
  for (uint32_t u = 0; u < kUnroll; ++u) {
    const uint32_t p = first + u * kThreads + threadIdx.x;
    ids[u] = p < num_pairs ? __ldg(topk_idx + p) : -1;
  }
#pragma unroll
  for (uint32_t u = 0; u < kUnroll; ++u) {
    const bool sent = ids[u] >= 0 && ids[u] < num_experts;
    expert[u] = sent ? static_cast<uint32_t>(ids[u]) : num_experts;
    const int n = sent || ids[u] != -1 ? atomicAdd(&counts[expert[u]], 1) : -1;
    position[u] = sent ? n : -1;
  }
}

// This rank's side of the count exchange, one CTA (the row is final when its histogram is), for
// P E_l = E experts: within[p] = the pair's position among this rank's pairs of its expert (-1 when
// not sent: -1 or an id outside [0, E)); the row, pairs per expert then the count of ids outside
// [-1, E) (the caller raises on them after the exchange), written to `row` when not null and to each
// of the num_rows int32 [E + 1] rows at the addresses rows[i] (this rank's row of every rank's count
// matrix, peers' included). counts: E + 1 ints of shared memory.
template <uint32_t kThreads>
__device__ __forceinline__ void exchange_count_row(int* counts, const long long* __restrict__ topk_idx,
                                                   uint32_t num_pairs, uint32_t num_experts, int* __restrict__ within,
                                                   int* __restrict__ row, const long long* __restrict__ rows,
                                                   uint32_t num_rows) {
  // A few pairs' loads in flight per thread before their atomics: one CTA walks every pair.
  constexpr uint32_t kUnroll = 4;
  for (uint32_t g = threadIdx.x; g <= num_experts; g += kThreads) counts[g] = 0;
  __syncthreads();
  for (uint32_t base = 0; base < num_pairs; base += kThreads * kUnroll) {
    uint32_t expert[kUnroll];
    int position[kUnroll];
    exchange_number_pairs<kThreads, kUnroll>(counts, topk_idx, base, num_pairs, num_experts, expert, position);
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint32_t p = base + u * kThreads + threadIdx.x;
      if (p < num_pairs) within[p] = position[u];
    }
  }
  __syncthreads();
  for (uint32_t g = threadIdx.x; g <= num_experts; g += kThreads) {
    const int c = counts[g];
    if (row != nullptr) row[g] = c;
    for (uint32_t i = 0; i < num_rows; ++i) reinterpret_cast<int*>(rows[i])[g] = c;
  }
}

template <uint32_t kThreads>
__global__ void __launch_bounds__(kThreads)
    moe_exchange_count_kernel(const long long* __restrict__ topk_idx, uint32_t num_pairs, uint32_t num_experts,
                              int* __restrict__ within, int* __restrict__ row, const long long* __restrict__ rows,
                              uint32_t num_rows) {
  extern __shared__ int counts[];  // [E + 1]
  exchange_count_row<kThreads>(counts, topk_idx, num_pairs, num_experts, within, row, rows, num_rows);
}

// After the count exchange, one CTA: sizes [3 P + 1] <- every rank's layout rows (padding
// included) [P], its masked layout's rows per segment (0: contiguous) [P], every source's invalid
// ids (counts[src][E]) [P], then the pairs this rank sends. counts_stride > E. smem: the
// ExchangeLayout's ints.
template <uint32_t kThreads>
__device__ __forceinline__ void exchange_sizes_block(int* smem, const int* __restrict__ counts, uint32_t counts_stride,
                                                     uint32_t num_ranks, uint32_t rank, uint32_t num_local,
                                                     uint32_t alignment, uint32_t masked_max_rows,
                                                     int* __restrict__ sizes) {
  const uint32_t num_experts = num_ranks * num_local;
  const ExchangeLayout l(smem, num_experts, num_local, num_ranks);
  const int all_rows =
      exchange_layout<kThreads>(l, counts, counts_stride, num_ranks, rank, num_local, alignment, masked_max_rows);
  for (uint32_t q = threadIdx.x; q < num_ranks; q += kThreads) {
    const int end = q + 1 < num_ranks ? l.segment[(q + 1) * num_local] : all_rows;
    sizes[q] = end - l.segment[q * num_local];
    sizes[num_ranks + q] = l.masked[q];
    sizes[2 * num_ranks + q] = __ldcg(counts + uint64_t(q) * counts_stride + num_experts);
  }
  const int num_send = block_exclusive_scan<kThreads>(l.sent, num_experts, l.warp_sums);
  if (threadIdx.x == 0) sizes[3 * num_ranks] = num_send;
}

template <uint32_t kThreads>
__global__ void __launch_bounds__(kThreads)
    moe_exchange_sizes_kernel(const int* __restrict__ counts, uint32_t counts_stride, uint32_t num_ranks,
                              uint32_t rank, uint32_t num_local, uint32_t alignment, uint32_t masked_max_rows,
                              int* __restrict__ sizes) {
  extern __shared__ int smem[];
  exchange_sizes_block<kThreads>(smem, counts, counts_stride, num_ranks, rank, num_local, alignment, masked_max_rows,
                                 sizes);
}

// Row r < num_rows of this rank's layout with m_indices[r] >= 0 (a received row): its slot word
// names the source rank and the pair in it.
template <uint32_t kHidden, uint32_t kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    moe_exchange_combine_kernel(const long long* __restrict__ tables, uint32_t num_ranks, uint32_t rank,
                                uint32_t pairs_per_rank, const int* __restrict__ m_indices, uint32_t num_rows,
                                const __nv_bfloat16* __restrict__ expert_out, ExchangeGridBarrier barrier) {
  static_assert(kHidden % 8 == 0, "rows are copied 16 bytes at a time");
  const uint32_t lane = threadIdx.x % 32;
  const int* slots = reinterpret_cast<const int*>(tables[kExSlots * num_ranks + rank]);
  for (uint32_t r = blockIdx.x * kWarps + threadIdx.x / 32; r < num_rows; r += gridDim.x * kWarps) {
    if (m_indices[r] < 0) continue;
    const auto slot = static_cast<uint32_t>(slots[r]);
    const uint32_t source = slot / pairs_per_rank;
    if (source >= num_ranks) continue;  // never written by the dispatch kernel; never write outside the group
    auto* dst = reinterpret_cast<uint4*>(tables[kExCombine * num_ranks + source]) +
                uint64_t(slot % pairs_per_rank) * (kHidden / 8);
    copy_row<kHidden / 8, 32>(reinterpret_cast<const uint4*>(expert_out + uint64_t(r) * kHidden), dst, lane);
  }
  exchange_grid_barrier<kWarps * 32>(barrier, rank, num_ranks);
}

template <uint32_t kThreads>
__global__ void __launch_bounds__(kThreads)
    moe_exchange_barrier_kernel(const long long* __restrict__ flag_rows, int* __restrict__ flags, uint32_t rank,
                                uint32_t num_ranks, uint64_t timeout_ns) {
  exchange_group_barrier<kThreads>(flag_rows, flags, rank, num_ranks, timeout_ns);
}

// Count, the group's barrier and the sizes in one launch, the staged dispatch's steps before its
// rows move (the host launched three kernels for them). The pairs are counted by chunks of
// kThreads x kPairsPerThread pairs, a CTA each (the launcher sizes the grid by the same product),
// since one SM's shared-memory atomics took 34 us for 4096 tokens x top-8: a CTA numbers its
// chunk's pairs per expert in shared memory, takes each expert's base with one global atomic on
// scratch[g] (any order: positions stay distinct in [0, count) per expert), and
// adds it. The last CTA to finish (scratch[E + 1] counts them) reads the row from scratch, resets
// scratch to zero for the next launch, writes the row into every rank's matrix (rows[i]: this
// rank's row of rank i's), passes the group's barrier and reduces this rank's matrix counts
// (int32 [P, counts_stride]) to the sizes. Shared memory: the chunk's E + 1 counters or the
// layout's ints, whichever is larger (one after the other).
template <uint32_t kThreads, uint32_t kPairsPerThread>
__global__ void __launch_bounds__(kThreads)
    moe_exchange_count_sizes_kernel(const long long* __restrict__ topk_idx, uint32_t num_pairs, int* __restrict__ within,
                                    int* __restrict__ scratch, const long long* __restrict__ rows,
                                    const long long* __restrict__ flag_rows, int* __restrict__ flags,
                                    const int* __restrict__ counts, uint32_t counts_stride, uint32_t num_ranks,
                                    uint32_t rank, uint32_t num_local, uint32_t alignment, uint32_t masked_max_rows,
                                    int* __restrict__ sizes, uint64_t timeout_ns) {
  constexpr uint32_t kChunk = kThreads * kPairsPerThread;
  extern __shared__ int smem[];
  const uint32_t num_experts = num_ranks * num_local;
  for (uint32_t g = threadIdx.x; g <= num_experts; g += kThreads) smem[g] = 0;
  __syncthreads();
  // The chunk's pairs numbered per expert within the chunk.
  uint32_t expert[kPairsPerThread];
  int positions[kPairsPerThread];
  exchange_number_pairs<kThreads, kPairsPerThread>(smem, topk_idx, blockIdx.x * kChunk, num_pairs, num_experts,
                                                   expert, positions);
  __syncthreads();
  // The chunk's base per expert among all chunks; the counters become the bases.
  for (uint32_t g = threadIdx.x; g <= num_experts; g += kThreads) {
    const int c = smem[g];
    smem[g] = c > 0 ? atomicAdd(&scratch[g], c) : 0;
  }
  __syncthreads();
#pragma unroll
  for (uint32_t u = 0; u < kPairsPerThread; ++u) {
    const uint32_t p = blockIdx.x * kChunk + u * kThreads + threadIdx.x;
    if (p < num_pairs) within[p] = positions[u] >= 0 ? smem[expert[u]] + positions[u] : -1;
  }
  if (!signals::last_cta_done_all(scratch + num_experts + 1)) return;
  // Every chunk's atomics are in scratch (each CTA's fence, then the counter's chain).
  for (uint32_t g = threadIdx.x; g <= num_experts; g += kThreads) {
    const int c = __ldcg(scratch + g);
    scratch[g] = 0;
    for (uint32_t i = 0; i < num_ranks; ++i) reinterpret_cast<int*>(rows[i])[g] = c;
  }
  // Each thread releases its own row writes (peers' memory) before the barrier's signals.
  __threadfence_system();
  __syncthreads();
  exchange_group_barrier<kThreads>(flag_rows, flags, rank, num_ranks, timeout_ns);
  exchange_sizes_block<kThreads>(smem, counts, counts_stride, num_ranks, rank, num_local, alignment, masked_max_rows,
                                 sizes);
}

}  // namespace moe_kernels
