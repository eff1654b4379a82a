#pragma once
// Low-latency expert-parallel transport (impls/moe_ep_ll.cuh): code generation, memo and launch
// of its four kernels. One Layout describes a group's buffers; every call passes it.
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

namespace moe_launchers::moe_ep_ll {

constexpr const char* kFn = "moe_ep_ll";
constexpr int kCopyThreads = 128;  // a 7168-byte FP8 row is 448 16-byte vectors: 3.5 per thread
constexpr int kWaitThreads = 128;
constexpr int kMaxCopyCtas = 1024;  // grid-stride beyond this: enough CTAs in flight to cover NVLink latency
constexpr int kMaxRanks = 64;
constexpr int kMaxLocalExperts = 1024;

enum class Kernel : int { kDispatchSend = 0, kDispatchWait = 1, kCombineSend = 2, kCombineWait = 3 };

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

inline GeneratedKernel generate(Kernel kind, int top_k, int hidden) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/moe_ep_ll.cuh>\n";
  const char* common = "const moe_kernels::uint64_t*, ";
  switch (kind) {
    case Kernel::kDispatchSend:
      os << "template __global__ void moe_kernels::moe_ep_dispatch_send<" << top_k << ", " << hidden << ", "
         << kCopyThreads << ">(" << common
         << "moe_kernels::uint64_t, moe_kernels::uint64_t, moe_kernels::uint64_t, moe_kernels::uint64_t, "
            "moe_kernels::uint64_t, unsigned, unsigned, unsigned, unsigned, unsigned, const long long*, const float*, "
            "const unsigned char*, const float*, unsigned, bool*);\n";
      return {"moe_ep_dispatch_send", os.str()};
    case Kernel::kDispatchWait:
      os << "template __global__ void moe_kernels::moe_ep_dispatch_wait<" << kWaitThreads << ">(" << common
         << "moe_kernels::uint64_t, unsigned, unsigned, unsigned, unsigned, moe_kernels::uint64_t, int*);\n";
      return {"moe_ep_dispatch_wait", os.str()};
    case Kernel::kCombineSend:
      os << "template __global__ void moe_kernels::moe_ep_combine_send<" << hidden << ", " << kCopyThreads << ">("
         << common
         << "moe_kernels::uint64_t, moe_kernels::uint64_t, moe_kernels::uint64_t, unsigned, unsigned, unsigned, "
            "unsigned, unsigned, const __nv_bfloat16*);\n";
      return {"moe_ep_combine_send", os.str()};
    case Kernel::kCombineWait:
      os << "template __global__ void moe_kernels::moe_ep_combine_wait<" << kWaitThreads << ">(" << common
         << "moe_kernels::uint64_t, unsigned, unsigned, unsigned, moe_kernels::uint64_t);\n";
      return {"moe_ep_combine_wait", os.str()};
  }
  MOE_HOST_ASSERT(false, kFn << ": unknown kernel " << static_cast<int>(kind));
  return {};
}

inline auto kernel(Kernel kind, const Layout& l, int device) {
  static moe_jit::KernelMemo<std::array<int, 4>, moe_jit::IntArrayHash> memo;
  // The copy kernels are specialised on hidden, dispatch_send on top-k too.
  const std::array<int, 4> key = {static_cast<int>(kind), kind == Kernel::kDispatchSend ? l.top_k : 0,
                                  kind == Kernel::kDispatchSend || kind == Kernel::kCombineSend ? l.hidden : 0,
                                  device};
  return memo.get(key, [&] {
    const GeneratedKernel gen = generate(kind, l.top_k, l.hidden);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(device));
  });
}

// How long a wait kernel spins for a peer before it traps: MOE_EP_TIMEOUT_S seconds (read per
// call), default 120 — long enough for a peer that compiles its expert kernels on a cold cache
// between dispatch and combine.
inline unsigned long long timeout_ns() {
  const char* value = std::getenv("MOE_EP_TIMEOUT_S");
  double seconds = 120.0;
  if (value != nullptr) {
    char* end = nullptr;
    seconds = std::strtod(value, &end);
    MOE_HOST_ASSERT(end != value && *end == '\0' && seconds > 0 && seconds < 1e9,
                    kFn << ": MOE_EP_TIMEOUT_S must be a positive number of seconds, got '" << value << "'");
  }
  return static_cast<unsigned long long>(seconds * 1e9);
}

inline moe_jit::LaunchConfig config(unsigned grid, unsigned threads, int device, std::uint64_t stream) {
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = std::max(1u, grid);
  cfg.block_x = threads;
  cfg.stream = stream;
  cfg.device = device;
  return cfg;
}

// dispatch_send + dispatch_wait: this rank's pairs into the owners' buffers; masked_m int32 [E_l],
// routed bool [T, k] (which of this rank's pairs were written into their experts' rows).
inline void dispatch(const Layout& l, std::uint64_t topk_idx, std::uint64_t topk_weights, std::uint64_t xq,
                     std::uint64_t xs, long long num_tokens, std::uint64_t masked_m, std::uint64_t routed, int device,
                     std::uint64_t stream) {
  check(l);
  MOE_HOST_ASSERT(num_tokens >= 0 && num_tokens <= l.max_tokens,
                  kFn << ": " << num_tokens << " tokens, more than the " << l.max_tokens << " the buffers hold");
  MOE_HOST_ASSERT(xq % 16 == 0, kFn << ": xq must be 16-byte aligned");
  const auto* peers = reinterpret_cast<const unsigned long long*>(l.peers);
  const unsigned pairs = static_cast<unsigned>(num_tokens * l.top_k);
  moe_jit::launch(*kernel(Kernel::kDispatchSend, l, device),
                  config(std::min<unsigned>(pairs, kMaxCopyCtas), kCopyThreads, device, stream), peers,
                  static_cast<unsigned long long>(l.off_x), static_cast<unsigned long long>(l.off_sf),
                  static_cast<unsigned long long>(l.off_w), static_cast<unsigned long long>(l.off_src),
                  static_cast<unsigned long long>(l.off_signals), static_cast<unsigned>(l.rank),
                  static_cast<unsigned>(l.num_ranks), static_cast<unsigned>(l.num_local),
                  static_cast<unsigned>(l.rows_per_expert()), static_cast<unsigned>(l.pairs_per_rank()),
                  reinterpret_cast<const long long*>(topk_idx), reinterpret_cast<const float*>(topk_weights),
                  reinterpret_cast<const unsigned char*>(xq), reinterpret_cast<const float*>(xs),
                  static_cast<unsigned>(num_tokens), reinterpret_cast<bool*>(routed));
  moe_jit::launch(*kernel(Kernel::kDispatchWait, l, device), config(1, kWaitThreads, device, stream), peers,
                  static_cast<unsigned long long>(l.off_signals), static_cast<unsigned>(l.rank),
                  static_cast<unsigned>(l.num_ranks), static_cast<unsigned>(l.num_local),
                  static_cast<unsigned>(l.rows_per_expert()), timeout_ns(), reinterpret_cast<int*>(masked_m));
}

// combine_send + combine_wait: expert outputs bf16 [E_l, R, H] (the rows the last dispatch
// received) back into their sources' combine buffers; on return (in stream order) this rank's
// combine buffer holds its pairs' outputs.
inline void combine(const Layout& l, std::uint64_t expert_out, int device, std::uint64_t stream) {
  check(l);
  MOE_HOST_ASSERT(expert_out % 16 == 0, kFn << ": expert_out must be 16-byte aligned");
  const auto* peers = reinterpret_cast<const unsigned long long*>(l.peers);
  // Received rows are at most every rank's pairs; the grid strides over the actual count.
  const long long rows = static_cast<long long>(l.num_ranks) * l.pairs_per_rank();
  moe_jit::LaunchConfig cfg =
      config(static_cast<unsigned>(std::min<long long>(rows, kMaxCopyCtas)), kCopyThreads, device, stream);
  cfg.smem_bytes = static_cast<unsigned>((l.num_local + 1) * sizeof(unsigned));
  moe_jit::launch(*kernel(Kernel::kCombineSend, l, device), cfg, peers, static_cast<unsigned long long>(l.off_src),
                  static_cast<unsigned long long>(l.off_combine), static_cast<unsigned long long>(l.off_signals),
                  static_cast<unsigned>(l.rank), static_cast<unsigned>(l.num_ranks),
                  static_cast<unsigned>(l.num_local), static_cast<unsigned>(l.rows_per_expert()),
                  static_cast<unsigned>(l.pairs_per_rank()), reinterpret_cast<const void*>(expert_out));
  moe_jit::launch(*kernel(Kernel::kCombineWait, l, device), config(1, kWaitThreads, device, stream), peers,
                  static_cast<unsigned long long>(l.off_signals), static_cast<unsigned>(l.rank),
                  static_cast<unsigned>(l.num_ranks), static_cast<unsigned>(l.num_local), timeout_ns());
}

}  // namespace moe_launchers::moe_ep_ll
