#pragma once
// The staged backend's row exchange (impls/moe_exchange.cuh): code generation, memo and launch.
#include <algorithm>
#include <array>
#include <cstdint>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"

namespace moe_launchers::moe_exchange {

constexpr int kWarps = 8;          // rows in flight per CTA (one per warp)
constexpr int kCtasPerSm = 8;      // enough warps per SM to keep NVLink stores in flight
constexpr int kMaxRanks = 1024;
constexpr const char* kFn = "moe_exchange";

enum class Kernel : int { kDispatch = 0, kCombine = 1 };

struct GeneratedKernel {
  std::string name;
  std::string code;
};

inline void check_shape(int top_k, int hidden) {
  MOE_HOST_ASSERT(top_k >= 1 && top_k <= 64, kFn << ": top_k must be in [1, 64], got " << top_k);
  MOE_HOST_ASSERT(hidden >= 128 && hidden % 128 == 0 && hidden <= 16384,
                  kFn << ": hidden must be a multiple of 128 in [128, 16384], got " << hidden);
}

inline GeneratedKernel generate(Kernel kernel, int top_k, int hidden) {
  check_shape(top_k, hidden);
  std::ostringstream os;
  os << "#include <moe_kernels/impls/moe_exchange.cuh>\n";
  if (kernel == Kernel::kDispatch) {
    os << "template __global__ void moe_kernels::moe_exchange_dispatch_kernel<" << top_k << ", " << hidden << ", "
       << kWarps << ">(const long long*, unsigned, unsigned, unsigned, unsigned, const long long*, const long long*, "
                    "unsigned, const long long*, const float*, const unsigned char*, const float*);\n";
    return {"moe_exchange_dispatch", os.str()};
  }
  os << "template __global__ void moe_kernels::moe_exchange_combine_kernel<" << hidden << ", " << kWarps
     << ">(const long long*, unsigned, unsigned, unsigned, const long long*, unsigned, const __nv_bfloat16*);\n";
  return {"moe_exchange_combine", os.str()};
}

struct Peers {
  std::uint64_t tables;  // int64 [5, num_ranks]
  int num_ranks, rank, pairs_per_rank;
};

inline moe_jit::LaunchConfig grid_for(long long num_rows, int device, std::uint64_t stream) {
  moe_jit::LaunchConfig cfg;
  const long long ctas = (num_rows + kWarps - 1) / kWarps;
  cfg.grid_x = static_cast<unsigned>(std::min<long long>(ctas, 1LL * kCtasPerSm * moe_jit::get_num_sms(device)));
  cfg.block_x = kWarps * 32;
  cfg.stream = stream;
  cfg.device = device;
  return cfg;
}

inline void check_peers(const Peers& p, long long num_rows) {
  MOE_HOST_ASSERT(p.num_ranks >= 1 && p.num_ranks <= kMaxRanks && p.rank >= 0 && p.rank < p.num_ranks,
                  kFn << ": rank " << p.rank << " of " << p.num_ranks << " ranks (at most " << kMaxRanks << ")");
  MOE_HOST_ASSERT(p.pairs_per_rank >= 1 && 1LL * p.pairs_per_rank * p.num_ranks <= (1LL << 31) - 1,
                  kFn << ": ranks x pairs_per_rank must fit an int32 slot word, got " << p.num_ranks << " x "
                      << p.pairs_per_rank);
  MOE_HOST_ASSERT(num_rows >= 1 && num_rows <= (1LL << 31) - 1, kFn << ": rows must be in [1, 2^31), got " << num_rows);
}

template <typename... Args>
inline void launch_kernel(Kernel kernel, int top_k, int hidden, long long num_rows, int device, std::uint64_t stream,
                          Args... args) {
  static moe_jit::KernelMemo<std::array<int, 4>, moe_jit::IntArrayHash> memo;
  const std::array<int, 4> key = {static_cast<int>(kernel), kernel == Kernel::kDispatch ? top_k : 0, hidden, device};
  const auto compiled = memo.get(key, [&] {
    const GeneratedKernel gen = generate(kernel, top_k, hidden);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(device));
  });
  moe_jit::launch(*compiled, grid_for(num_rows, device, stream), args...);
}

inline void dispatch(const Peers& p, int num_local, int top_k, int hidden, std::uint64_t order, std::uint64_t rows,
                     long long num_rows, std::uint64_t topk_idx, std::uint64_t topk_weights, std::uint64_t xq,
                     std::uint64_t xs, int device, std::uint64_t stream) {
  check_shape(top_k, hidden);
  check_peers(p, num_rows);
  MOE_HOST_ASSERT(num_local >= 1, kFn << ": num_local_experts must be positive, got " << num_local);
  MOE_HOST_ASSERT(xq % 16 == 0, kFn << ": xq must be 16-byte aligned");
  launch_kernel(Kernel::kDispatch, top_k, hidden, num_rows, device, stream,
                reinterpret_cast<const long long*>(p.tables), static_cast<unsigned>(p.num_ranks),
                static_cast<unsigned>(p.rank), static_cast<unsigned>(num_local),
                static_cast<unsigned>(p.pairs_per_rank), reinterpret_cast<const long long*>(order),
                reinterpret_cast<const long long*>(rows), static_cast<unsigned>(num_rows),
                reinterpret_cast<const long long*>(topk_idx), reinterpret_cast<const float*>(topk_weights),
                reinterpret_cast<const unsigned char*>(xq), reinterpret_cast<const float*>(xs));
}

inline void combine(const Peers& p, int hidden, std::uint64_t rows, long long num_rows, std::uint64_t expert_out,
                    int device, std::uint64_t stream) {
  check_shape(1, hidden);
  check_peers(p, num_rows);
  MOE_HOST_ASSERT(expert_out % 16 == 0, kFn << ": expert_out must be 16-byte aligned");
  launch_kernel(Kernel::kCombine, 1, hidden, num_rows, device, stream, reinterpret_cast<const long long*>(p.tables),
                static_cast<unsigned>(p.num_ranks), static_cast<unsigned>(p.rank),
                static_cast<unsigned>(p.pairs_per_rank), reinterpret_cast<const long long*>(rows),
                static_cast<unsigned>(num_rows), reinterpret_cast<const void*>(expert_out));
}

}  // namespace moe_launchers::moe_exchange
