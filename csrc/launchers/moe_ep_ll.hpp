#pragma once
// Low-latency expert-parallel transport (impls/moe_ep_ll.cuh): code generation, memo and launch
// of its two kernels. One Layout describes a group's buffers; every call passes it.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"
#include "apis/dtypes.hpp"
#include "launchers/dispatch_rows.hpp"
#include "launchers/peer_wait.hpp"

namespace moe_launchers::moe_ep_ll {

constexpr const char* kFn = "moe_ep_ll";
constexpr int kThreads = 128;  // a 7168-byte FP8 row is 448 16-byte vectors: 3.5 per thread
constexpr int kMaxCtas = 1024;  // grid-stride beyond this: enough CTAs in flight to cover NVLink latency
constexpr int kMaxRanks = 64;
constexpr int kMaxLocalExperts = 1024;

enum class Kernel : int { kDispatch = 0, kCombine = 1 };

// A group's transport buffers as this process sees them: `peers` the device address of an int64
// [P] array of every rank's symmetric-buffer base (in this process's address space), the views'
// byte offsets (the same on every rank), and the sizes.
struct Layout {
  std::uint64_t peers;
  std::uint64_t off_x, off_sf, off_w, off_src, off_combine, off_signals;
  int rank, num_ranks, num_local, max_tokens, top_k, hidden;

  int rows_per_expert() const { return num_ranks * max_tokens; }
  int pairs_per_rank() const { return max_tokens * top_k; }
};

inline void check(const Layout& l) {
  MOE_HOST_ASSERT(l.num_ranks >= 1 && l.num_ranks <= kMaxRanks,
                  kFn << ": num_ranks must be in [1, " << kMaxRanks << "], got " << l.num_ranks);
  MOE_HOST_ASSERT(l.rank >= 0 && l.rank < l.num_ranks, kFn << ": rank " << l.rank << " outside [0, " << l.num_ranks << ")");
  MOE_HOST_ASSERT(l.num_local >= 1 && l.num_local <= kMaxLocalExperts,
                  kFn << ": num_local_experts must be in [1, " << kMaxLocalExperts << "], got " << l.num_local);
  MOE_HOST_ASSERT(l.top_k >= 1 && l.top_k <= 64, kFn << ": top_k must be in [1, 64], got " << l.top_k);
  MOE_HOST_ASSERT(l.hidden >= 128 && l.hidden % 128 == 0,
                  kFn << ": hidden must be a positive multiple of 128, got " << l.hidden);
  MOE_HOST_ASSERT(l.max_tokens >= 1 && static_cast<long long>(l.num_ranks) * l.max_tokens * l.top_k < (1ll << 31),
                  kFn << ": num_ranks * max_tokens * top_k must stay below 2^31");
  MOE_HOST_ASSERT(l.peers % 8 == 0 && l.off_x % 16 == 0 && l.off_combine % 16 == 0 && l.off_sf % 4 == 0 &&
                      l.off_w % 4 == 0 && l.off_src % 4 == 0 && l.off_signals % 4 == 0,
                  kFn << ": views must be aligned (rows of x and combine to 16 bytes)");
}

struct GeneratedKernel {
  std::string name;
  std::string code;
};

// in_dtype: the dispatch's input rows (E4M3 bits: read with their scales; bf16 / fp16 / fp32:
// quantized in the kernel). The combine ignores it.
inline GeneratedKernel generate(Kernel kind, int top_k, int hidden, moe_apis::DType in_dtype) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/moe_ep_ll.cuh>\n";
  const char* u64 = "moe_kernels::uint64_t";
  switch (kind) {
    case Kernel::kDispatch: {
      const char* in_type = dispatch_rows::input_type(kFn, in_dtype);
      os << "template __global__ void moe_kernels::moe_ep_dispatch<" << in_type << ", " << top_k << ", " << hidden
         << ", " << kThreads << ">(const " << u64 << "*, " << u64 << ", " << u64 << ", " << u64 << ", " << u64 << ", "
         << u64 << ", unsigned, unsigned, unsigned, unsigned, unsigned, const long long*, const float*, const "
         << in_type << "*, " << u64 << ", const float*, unsigned, bool*, " << u64 << ", int*);\n";
      return {"moe_ep_dispatch", os.str()};
    }
    case Kernel::kCombine:
      os << "template __global__ void moe_kernels::moe_ep_combine<" << hidden << ", " << kThreads << ">(const " << u64
         << "*, " << u64 << ", " << u64 << ", " << u64 << ", unsigned, unsigned, unsigned, unsigned, unsigned, "
         << "const __nv_bfloat16*, " << u64 << ");\n";
      return {"moe_ep_combine", os.str()};
  }
  MOE_HOST_ASSERT(false, kFn << ": unknown kernel " << static_cast<int>(kind));
  return {};
}

inline auto kernel(Kernel kind, const Layout& l, moe_apis::DType in_dtype, int device) {
  static moe_jit::KernelMemo<std::array<int, 5>, moe_jit::IntArrayHash> memo;
  // Both are specialised on hidden, the dispatch on top-k and its input rows too.
  const bool dispatch = kind == Kernel::kDispatch;
  const std::array<int, 5> key = {static_cast<int>(kind), dispatch ? l.top_k : 0, l.hidden,
                                  dispatch ? dispatch_rows::memo_key(in_dtype) : 0, device};
  return memo.get(key, [&] {
    const GeneratedKernel gen = generate(kind, l.top_k, l.hidden, in_dtype);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(device));
  });
}

inline moe_jit::LaunchConfig config(unsigned grid, unsigned threads, int device, std::uint64_t stream) {
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = std::max(1u, grid);
  cfg.block_x = threads;
  cfg.stream = stream;
  cfg.device = device;
  return cfg;
}

// One launch: this rank's tokens into the owners' buffers, then (the last CTA) every rank's waited
// for; masked_m int32 [E_l], routed bool [T, k] (which of this rank's pairs were written into their
// experts' rows). x: [T, H] rows with row stride x_row_stride (elements), E4M3 with xs float32
// [T, H / 128] contiguous, or bf16 / fp16 / fp32 (xs = 0) quantized in the kernel.
inline void dispatch(const Layout& l, std::uint64_t topk_idx, std::uint64_t topk_weights, std::uint64_t x,
                     moe_apis::DType x_dtype, long long x_row_stride, std::uint64_t xs, long long num_tokens,
                     std::uint64_t masked_m, std::uint64_t routed, int device, std::uint64_t stream) {
  check(l);
  MOE_HOST_ASSERT(num_tokens >= 0 && num_tokens <= l.max_tokens,
                  kFn << ": " << num_tokens << " tokens, more than the " << l.max_tokens << " the buffers hold");
  dispatch_rows::check(kFn, x, x_dtype, x_row_stride, l.hidden, xs);
  const auto* peers = reinterpret_cast<const unsigned long long*>(l.peers);
  moe_jit::launch(*kernel(Kernel::kDispatch, l, x_dtype, device),
                  config(static_cast<unsigned>(std::min<long long>(num_tokens, kMaxCtas)), kThreads, device, stream),
                  peers, static_cast<unsigned long long>(l.off_x), static_cast<unsigned long long>(l.off_sf),
                  static_cast<unsigned long long>(l.off_w), static_cast<unsigned long long>(l.off_src),
                  static_cast<unsigned long long>(l.off_signals), static_cast<unsigned>(l.rank),
                  static_cast<unsigned>(l.num_ranks), static_cast<unsigned>(l.num_local),
                  static_cast<unsigned>(l.rows_per_expert()), static_cast<unsigned>(l.pairs_per_rank()),
                  reinterpret_cast<const long long*>(topk_idx), reinterpret_cast<const float*>(topk_weights),
                  reinterpret_cast<const void*>(x), static_cast<unsigned long long>(x_row_stride),
                  reinterpret_cast<const float*>(xs), static_cast<unsigned>(num_tokens), reinterpret_cast<bool*>(routed),
                  peer_timeout_ns(), reinterpret_cast<int*>(masked_m));
}

// One launch: expert outputs bf16 [E_l, R, H] (the rows the last dispatch received) back into their
// sources' combine buffers, then (the last CTA) every rank's waited for; on return (in stream order)
// this rank's combine buffer holds its pairs' outputs.
inline void combine(const Layout& l, std::uint64_t expert_out, int device, std::uint64_t stream) {
  check(l);
  MOE_HOST_ASSERT(expert_out % 16 == 0, kFn << ": expert_out must be 16-byte aligned");
  const auto* peers = reinterpret_cast<const unsigned long long*>(l.peers);
  // Received rows are at most every rank's pairs; the grid strides over the actual count.
  const long long rows = static_cast<long long>(l.num_ranks) * l.pairs_per_rank();
  moe_jit::LaunchConfig cfg = config(static_cast<unsigned>(std::min<long long>(rows, kMaxCtas)), kThreads, device, stream);
  cfg.smem_bytes = static_cast<unsigned>((l.num_local + 1) * sizeof(unsigned));
  moe_jit::launch(*kernel(Kernel::kCombine, l, moe_apis::DType::kBFloat16, device), cfg, peers,
                  static_cast<unsigned long long>(l.off_src), static_cast<unsigned long long>(l.off_combine),
                  static_cast<unsigned long long>(l.off_signals), static_cast<unsigned>(l.rank),
                  static_cast<unsigned>(l.num_ranks), static_cast<unsigned>(l.num_local),
                  static_cast<unsigned>(l.rows_per_expert()), static_cast<unsigned>(l.pairs_per_rank()),
                  reinterpret_cast<const void*>(expert_out), peer_timeout_ns());
}

}  // namespace moe_launchers::moe_ep_ll
