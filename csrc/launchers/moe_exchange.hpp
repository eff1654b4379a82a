#pragma once
// The staged backend's row exchange (impls/moe_exchange.cuh): code generation, memo and launch.
#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"
#include "apis/dtypes.hpp"
#include "launchers/dispatch_rows.hpp"
#include "launchers/peer_wait.hpp"

namespace moe_launchers::moe_exchange {

constexpr int kWarps = 8;          // rows (combine) or tokens (dispatch) in flight per CTA, one per warp
constexpr int kCtasPerSm = 8;      // enough warps per SM to keep NVLink stores in flight
// The dispatch keeps a chunk of a token's row per lane (64-70 registers unbounded): 4 resident CTAs
// per SM cap it at 64, and its grid at 4 per SM (more would run as a second wave, each CTA laying
// the layouts out again).
constexpr int kDispatchCtasPerSm = 4;
constexpr int kMaxRanks = 1024;
constexpr int kMaxExperts = 2048;  // the layout's shared memory (4 ints per expert); kernels/exchange.py kExchangeMaxExperts
constexpr const char* kFn = "moe_exchange";

enum class Kernel : int { kDispatch = 0, kCombine = 1, kCount = 2, kSizes = 3, kBarrier = 4, kCountSizes = 5 };
constexpr int kBarrierThreads = 128;
constexpr int kCountThreads = 1024;  // a CTA of the count, sizes and count-sizes kernels
constexpr int kCountPairsPerThread = 4;  // count-sizes: a CTA numbers kCountThreads x this many pairs

struct GeneratedKernel {
  std::string name;
  std::string code;
};

inline void check_shape(int top_k, int hidden) {
  MOE_HOST_ASSERT(top_k >= 1 && top_k <= 64, kFn << ": top_k must be in [1, 64], got " << top_k);
  MOE_HOST_ASSERT(hidden >= 128 && hidden % 128 == 0 && hidden <= 16384,
                  kFn << ": hidden must be a multiple of 128 in [128, 16384], got " << hidden);
}

inline GeneratedKernel generate(Kernel kernel, int top_k, int hidden,
                                moe_apis::DType in_dtype = moe_apis::DType::kFloat8E4M3) {
  check_shape(top_k, hidden);
  std::ostringstream os;
  os << "#include <moe_kernels/impls/moe_exchange.cuh>\n";
  if (kernel == Kernel::kDispatch) {
    const char* in_type = dispatch_rows::input_type(kFn, in_dtype);
    os << "template __global__ void moe_kernels::moe_exchange_dispatch_kernel<" << in_type << ", " << top_k << ", "
       << hidden << ", " << kWarps << ", " << kDispatchCtasPerSm
       << ">(const long long*, unsigned, unsigned, unsigned, unsigned, const int*, unsigned, unsigned, unsigned, "
          "unsigned, const int*, unsigned, const long long*, const float*, const "
       << in_type
       << "*, moe_kernels::uint64_t, const float*, unsigned, long long, int*, long long*, int*, "
          "moe_kernels::ExchangeGridBarrier);\n";
    return {"moe_exchange_dispatch", os.str()};
  }
  if (kernel == Kernel::kCount) {
    os << "template __global__ void moe_kernels::moe_exchange_count_kernel<" << kCountThreads
       << ">(const long long*, unsigned, unsigned, int*, int*, const long long*, unsigned);\n";
    return {"moe_exchange_count", os.str()};
  }
  if (kernel == Kernel::kBarrier) {
    os << "template __global__ void moe_kernels::moe_exchange_barrier_kernel<" << kBarrierThreads
       << ">(const long long*, int*, unsigned, unsigned, moe_kernels::uint64_t);\n";
    return {"moe_exchange_barrier", os.str()};
  }
  if (kernel == Kernel::kCountSizes) {
    os << "template __global__ void moe_kernels::moe_exchange_count_sizes_kernel<" << kCountThreads << ", "
       << kCountPairsPerThread << ">(const long long*, unsigned, int*, int*, const long long*, const long long*, int*, const int*, "
          "unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, int*, moe_kernels::uint64_t);\n";
    return {"moe_exchange_count_sizes", os.str()};
  }
  if (kernel == Kernel::kSizes) {
    os << "template __global__ void moe_kernels::moe_exchange_sizes_kernel<" << kCountThreads
       << ">(const int*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, int*);\n";
    return {"moe_exchange_sizes", os.str()};
  }
  os << "template __global__ void moe_kernels::moe_exchange_combine_kernel<" << hidden << ", " << kWarps
     << ">(const long long*, unsigned, unsigned, unsigned, const int*, unsigned, const __nv_bfloat16*, "
        "moe_kernels::ExchangeGridBarrier);\n";
  return {"moe_exchange_combine", os.str()};
}

// The group's barrier that the dispatch and combine kernels raise themselves once their last CTA
// is done (impls/moe_exchange.cuh's ExchangeGridBarrier, the same layout): flag_rows int64 [P]
// (device) and flags int32 [P + 1] as `barrier`'s, done int32 [1] zero between launches; all 0:
// none (the caller launches `barrier` after the step).
struct GridBarrier {
  std::uint64_t flag_rows = 0, flags = 0, done = 0;
};

struct DeviceGridBarrier {
  const long long* flag_rows;
  int* flags;
  int* done;
  unsigned long long timeout_ns;
};

inline DeviceGridBarrier device_grid_barrier(const GridBarrier& b) {
  const bool any = b.flag_rows != 0 || b.flags != 0 || b.done != 0;
  MOE_HOST_ASSERT(!any || (b.flag_rows != 0 && b.flag_rows % 8 == 0 && b.flags != 0 && b.flags % 4 == 0 &&
                           b.done != 0 && b.done % 4 == 0),
                  kFn << ": the grid barrier's flag rows, flags and counter must all be aligned and non-null, or all 0");
  return {reinterpret_cast<const long long*>(b.flag_rows), reinterpret_cast<int*>(b.flags),
          reinterpret_cast<int*>(b.done), any ? peer_timeout_ns() : 0ull};
}

struct Peers {
  std::uint64_t tables;  // int64 [5, num_ranks]
  int num_ranks, rank, pairs_per_rank;
};

// `what` (pairs, rows) counts an int32 index: [0, 2^31).
inline void check_int32_count(const char* what, long long count) {
  MOE_HOST_ASSERT(count >= 0 && count <= (1LL << 31) - 1, kFn << ": " << what << " must be in [0, 2^31), got " << count);
}

inline void check_peers(const Peers& p, long long num_rows) {
  MOE_HOST_ASSERT(p.num_ranks >= 1 && p.num_ranks <= kMaxRanks && p.rank >= 0 && p.rank < p.num_ranks,
                  kFn << ": rank " << p.rank << " of " << p.num_ranks << " ranks (at most " << kMaxRanks << ")");
  MOE_HOST_ASSERT(p.pairs_per_rank >= 1 && 1LL * p.pairs_per_rank * p.num_ranks <= (1LL << 31) - 1,
                  kFn << ": ranks x pairs_per_rank must fit an int32 slot word, got " << p.num_ranks << " x "
                      << p.pairs_per_rank);
  check_int32_count("rows", num_rows);
}

// in_dtype: the dispatch's input rows (the other kernels ignore it).
template <typename... Args>
inline void launch_kernel(Kernel kernel, int top_k, int hidden, moe_apis::DType in_dtype, long long ctas,
                          unsigned smem_bytes, int device, std::uint64_t stream, Args... args) {
  static moe_jit::KernelMemo<std::array<int, 5>, moe_jit::IntArrayHash> memo;
  const bool dispatch = kernel == Kernel::kDispatch;
  const std::array<int, 5> key = {static_cast<int>(kernel), dispatch ? top_k : 0, hidden,
                                  dispatch ? dispatch_rows::memo_key(in_dtype) : 0, device};
  const auto compiled = memo.get(key, [&] {
    const GeneratedKernel gen = generate(kernel, top_k, hidden, in_dtype);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(device));
  });
  moe_jit::LaunchConfig cfg;
  const int per_sm = dispatch ? kDispatchCtasPerSm : kCtasPerSm;
  cfg.grid_x = static_cast<unsigned>(std::max(1LL, std::min(ctas, 1LL * per_sm * moe_jit::get_num_sms(device))));
  cfg.block_x = kWarps * 32;
  cfg.smem_bytes = smem_bytes;
  cfg.stream = stream;
  cfg.device = device;
  moe_jit::launch(*compiled, cfg, args...);
}

// A kernel of fixed template parameters (count, barrier, count-sizes, sizes: kCountThreads threads).
inline std::shared_ptr<const moe_jit::CompiledKernel> fixed_kernel(Kernel kernel, int device) {
  static moe_jit::KernelMemo<std::array<int, 2>, moe_jit::IntArrayHash> memo;
  return memo.get({static_cast<int>(kernel), device}, [&] {
    const GeneratedKernel gen = generate(kernel, 1, 128);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(device));
  });
}

// within int32 [num_pairs] from topk_idx int64 [num_pairs]; the count row int32 [E + 1] into `row`
// (0: none) and into the num_rows rows whose addresses the device array `rows` holds (0: none).
inline void count(std::uint64_t topk_idx, long long num_pairs, int num_experts, std::uint64_t within,
                  std::uint64_t row, std::uint64_t rows, int num_rows, int device, std::uint64_t stream) {
  MOE_HOST_ASSERT(num_experts >= 1 && num_experts <= kMaxExperts,
                  kFn << ": num_experts must be in [1, " << kMaxExperts << "], got " << num_experts);
  check_int32_count("pairs", num_pairs);
  MOE_HOST_ASSERT(num_rows >= 0 && num_rows <= kMaxRanks && (rows != 0 || num_rows == 0),
                  kFn << ": need 0 <= rows <= " << kMaxRanks << " row addresses, got " << num_rows);
  const auto compiled = fixed_kernel(Kernel::kCount, device);
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = 1;
  cfg.block_x = kCountThreads;
  cfg.smem_bytes = static_cast<unsigned>(sizeof(int) * (num_experts + 1));
  cfg.stream = stream;
  cfg.device = device;
  moe_jit::launch(*compiled, cfg, reinterpret_cast<const long long*>(topk_idx), static_cast<unsigned>(num_pairs),
                  static_cast<unsigned>(num_experts), reinterpret_cast<int*>(within), reinterpret_cast<int*>(row),
                  reinterpret_cast<const long long*>(rows), static_cast<unsigned>(num_rows));
}

// The group's barrier: flag_rows int64 [P] (device), the address of every rank's flags int32 [P + 1]
// (this rank's included, zero before the first barrier); flags this rank's own.
inline void barrier(std::uint64_t flag_rows, std::uint64_t flags, int rank, int num_ranks, int device,
                    std::uint64_t stream) {
  MOE_HOST_ASSERT(num_ranks >= 1 && num_ranks <= kMaxRanks && rank >= 0 && rank < num_ranks,
                  kFn << ": rank " << rank << " of " << num_ranks << " ranks (at most " << kMaxRanks << ")");
  MOE_HOST_ASSERT(flag_rows % 8 == 0 && flag_rows != 0 && flags % 4 == 0 && flags != 0,
                  kFn << ": the barrier's flag addresses must be aligned and non-null");
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = 1;
  cfg.block_x = kBarrierThreads;
  cfg.stream = stream;
  cfg.device = device;
  moe_jit::launch(*fixed_kernel(Kernel::kBarrier, device), cfg, reinterpret_cast<const long long*>(flag_rows),
                  reinterpret_cast<int*>(flags), static_cast<unsigned>(rank), static_cast<unsigned>(num_ranks),
                  peer_timeout_ns());
}

inline unsigned layout_smem_bytes(long long num_experts, int num_local, int num_ranks, int threads) {
  return static_cast<unsigned>(sizeof(int) * (4 * num_experts + num_local + 1 + num_ranks + threads / 32));
}

inline void check_layout_counts(int num_ranks, int num_local, int counts_stride, long long min_stride) {
  const long long num_experts = 1LL * num_local * num_ranks;
  MOE_HOST_ASSERT(num_local >= 1 && num_experts <= kMaxExperts && counts_stride >= min_stride,
                  kFn << ": need 1 <= ranks x local experts <= " << kMaxExperts << " and a counts row of at least "
                      << min_stride << " entries, got " << num_ranks << " x " << num_local << ", stride "
                      << counts_stride);
}

// sizes int32 [3 P + 1] (the sizes kernel's) from counts int32 [P, counts_stride > P E_l].
inline void sizes(std::uint64_t counts, int counts_stride, int num_ranks, int rank, int num_local, int alignment,
                  int masked_max_rows, std::uint64_t out, int device, std::uint64_t stream) {
  MOE_HOST_ASSERT(num_ranks >= 1 && num_ranks <= kMaxRanks && rank >= 0 && rank < num_ranks,
                  kFn << ": rank " << rank << " of " << num_ranks << " ranks (at most " << kMaxRanks << ")");
  check_layout_counts(num_ranks, num_local, counts_stride, 1LL * num_local * num_ranks + 1);
  MOE_HOST_ASSERT(alignment >= 1 && masked_max_rows >= 0,
                  kFn << ": alignment must be positive and masked_max_rows non-negative");
  const auto compiled = fixed_kernel(Kernel::kSizes, device);
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = 1;
  cfg.block_x = kCountThreads;
  cfg.smem_bytes = layout_smem_bytes(1LL * num_local * num_ranks, num_local, num_ranks, kCountThreads);
  cfg.stream = stream;
  cfg.device = device;
  moe_jit::launch(*compiled, cfg, reinterpret_cast<const int*>(counts), static_cast<unsigned>(counts_stride),
                  static_cast<unsigned>(num_ranks), static_cast<unsigned>(rank), static_cast<unsigned>(num_local),
                  static_cast<unsigned>(alignment), static_cast<unsigned>(masked_max_rows), reinterpret_cast<int*>(out));
}

// The pairs one CTA of the count-sizes kernel numbers (its template parameters, emitted above).
constexpr long long kCountChunk = 1LL * kCountPairsPerThread * kCountThreads;

// count, barrier and sizes in one launch (the staged dispatch's steps before its rows): within
// int32 [num_pairs] from topk_idx int64 [num_pairs], a CTA per kCountChunk pairs; scratch int32
// [E + 2] zero (left zero); the count row into the P rows whose addresses `rows` holds (this
// rank's row of every rank's matrix); the barrier on flag_rows / flags (as `barrier`'s); sizes
// int32 [3 P + 1] from this rank's matrix counts int32 [P, counts_stride].
inline void count_sizes(std::uint64_t topk_idx, long long num_pairs, std::uint64_t within, std::uint64_t scratch,
                        std::uint64_t rows, std::uint64_t flag_rows, std::uint64_t flags, std::uint64_t counts,
                        int counts_stride, int num_ranks, int rank, int num_local, int alignment, int masked_max_rows,
                        std::uint64_t out, int device, std::uint64_t stream) {
  MOE_HOST_ASSERT(num_ranks >= 1 && num_ranks <= kMaxRanks && rank >= 0 && rank < num_ranks,
                  kFn << ": rank " << rank << " of " << num_ranks << " ranks (at most " << kMaxRanks << ")");
  const long long num_experts = 1LL * num_local * num_ranks;
  check_layout_counts(num_ranks, num_local, counts_stride, num_experts + 1);
  check_int32_count("pairs", num_pairs);
  MOE_HOST_ASSERT(alignment >= 1 && masked_max_rows >= 0,
                  kFn << ": alignment must be positive and masked_max_rows non-negative");
  MOE_HOST_ASSERT(rows != 0 && rows % 8 == 0 && flag_rows % 8 == 0 && flag_rows != 0 && flags % 4 == 0 && flags != 0 &&
                      scratch != 0 && scratch % 4 == 0,
                  kFn << ": the count rows', scratch's and the barrier's addresses must be aligned and non-null");
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>(std::max(1LL, (num_pairs + kCountChunk - 1) / kCountChunk));
  cfg.block_x = kCountThreads;
  cfg.smem_bytes = std::max(static_cast<unsigned>(sizeof(int) * (num_experts + 1)),
                            layout_smem_bytes(num_experts, num_local, num_ranks, kCountThreads));
  cfg.stream = stream;
  cfg.device = device;
  moe_jit::launch(*fixed_kernel(Kernel::kCountSizes, device), cfg, reinterpret_cast<const long long*>(topk_idx),
                  static_cast<unsigned>(num_pairs), reinterpret_cast<int*>(within), reinterpret_cast<int*>(scratch),
                  reinterpret_cast<const long long*>(rows), reinterpret_cast<const long long*>(flag_rows),
                  reinterpret_cast<int*>(flags), reinterpret_cast<const int*>(counts),
                  static_cast<unsigned>(counts_stride), static_cast<unsigned>(num_ranks), static_cast<unsigned>(rank),
                  static_cast<unsigned>(num_local), static_cast<unsigned>(alignment),
                  static_cast<unsigned>(masked_max_rows), reinterpret_cast<int*>(out), peer_timeout_ns());
}

// The layout's inputs: counts int32 [P, counts_stride] (row src: its rows per global expert),
// the contiguous layout's alignment, the masked layout's limit; and this rank's layout index outputs.
struct Layout {
  std::uint64_t counts;
  int counts_stride, num_local, alignment, masked_max_rows;
  long long row_capacity;     // rows of every rank's receive views: rows at or past it are dropped
  long long num_layout_rows;  // rows of the index outputs (at least this rank's layout)
  long long first_expert;
  std::uint64_t m_indices, global_ids, masked_m;
};

// x: [T, H] rows, row stride x_row_stride elements: E4M3 bits with xs float32 [T, H / 128]
// contiguous, or bf16 / fp16 / fp32 (xs = 0), quantized in the kernel. num_pairs = T * top_k.
inline void dispatch(const Peers& p, const Layout& l, int top_k, int hidden, std::uint64_t within, long long num_pairs,
                     std::uint64_t topk_idx, std::uint64_t topk_weights, std::uint64_t x, moe_apis::DType x_dtype,
                     long long x_row_stride, std::uint64_t xs, int device, std::uint64_t stream,
                     const GridBarrier& barrier = {}) {
  check_shape(top_k, hidden);
  check_peers(p, std::max(num_pairs, l.num_layout_rows));
  const long long num_experts = 1LL * l.num_local * p.num_ranks;
  check_layout_counts(p.num_ranks, l.num_local, l.counts_stride, num_experts);
  MOE_HOST_ASSERT(l.alignment >= 1 && l.masked_max_rows >= 0,
                  kFn << ": alignment must be positive and masked_max_rows non-negative");
  MOE_HOST_ASSERT(num_pairs >= 0 && l.num_layout_rows >= 0 && l.row_capacity >= 0 &&
                      l.row_capacity <= (1LL << 31) - 1,
                  kFn << ": negative row counts, or a row capacity past 2^31");
  MOE_HOST_ASSERT(num_pairs % top_k == 0, kFn << ": " << num_pairs << " pairs are not whole tokens of " << top_k);
  dispatch_rows::check(kFn, x, x_dtype, x_row_stride, hidden, xs);
  const long long num_tokens = num_pairs / top_k;
  // A warp per token; the index rows (at most num_layout_rows, often the whole receive capacity of
  // which the layout uses a part) need no more than one CTA per SM.
  const long long index_ctas = std::min<long long>((l.num_layout_rows + kWarps * 32 - 1) / (kWarps * 32),
                                                   moe_jit::get_num_sms(device));
  launch_kernel(Kernel::kDispatch, top_k, hidden, x_dtype, std::max((num_tokens + kWarps - 1) / kWarps, index_ctas),
                layout_smem_bytes(num_experts, l.num_local, p.num_ranks, kWarps * 32), device, stream,
                reinterpret_cast<const long long*>(p.tables), static_cast<unsigned>(p.num_ranks),
                static_cast<unsigned>(p.rank), static_cast<unsigned>(l.num_local),
                static_cast<unsigned>(p.pairs_per_rank), reinterpret_cast<const int*>(l.counts),
                static_cast<unsigned>(l.counts_stride), static_cast<unsigned>(l.alignment),
                static_cast<unsigned>(l.masked_max_rows), static_cast<unsigned>(l.row_capacity),
                reinterpret_cast<const int*>(within),
                static_cast<unsigned>(num_tokens), reinterpret_cast<const long long*>(topk_idx),
                reinterpret_cast<const float*>(topk_weights), reinterpret_cast<const void*>(x),
                static_cast<unsigned long long>(x_row_stride), reinterpret_cast<const float*>(xs),
                static_cast<unsigned>(l.num_layout_rows), l.first_expert,
                reinterpret_cast<int*>(l.m_indices), reinterpret_cast<long long*>(l.global_ids),
                reinterpret_cast<int*>(l.masked_m), device_grid_barrier(barrier));
}

inline void combine(const Peers& p, int hidden, std::uint64_t m_indices, long long num_rows, std::uint64_t expert_out,
                    int device, std::uint64_t stream, const GridBarrier& barrier = {}) {
  check_shape(1, hidden);
  check_peers(p, num_rows);
  MOE_HOST_ASSERT(expert_out % 16 == 0, kFn << ": expert_out must be 16-byte aligned");
  launch_kernel(Kernel::kCombine, 1, hidden, moe_apis::DType::kBFloat16, (num_rows + kWarps - 1) / kWarps, 0, device,
                stream,
                reinterpret_cast<const long long*>(p.tables), static_cast<unsigned>(p.num_ranks),
                static_cast<unsigned>(p.rank), static_cast<unsigned>(p.pairs_per_rank),
                reinterpret_cast<const int*>(m_indices),
                static_cast<unsigned>(num_rows), reinterpret_cast<const void*>(expert_out),
                device_grid_barrier(barrier));
}

}  // namespace moe_launchers::moe_exchange
