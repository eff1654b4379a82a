#pragma once
// One rank's decode dispatch (impls/moe_local_dispatch.cuh): code generation, memo and launch.
#include <algorithm>
#include <array>
#include <cstdint>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"

namespace moe_launchers::moe_local_dispatch {

constexpr int kThreads = 256;
constexpr int kRowsPerIdCta = 1024;  // expert-id rows each id CTA writes
constexpr int kMaxLocalExperts = 1024;
constexpr const char* kFn = "moe_local_dispatch";

struct Config {
  int top_k, num_local, hidden;
};

struct GeneratedKernel {
  std::string name;
  std::string code;
};

inline Config get_config(int top_k, int num_local, int hidden) {
  MOE_HOST_ASSERT(top_k >= 1 && top_k <= 64, kFn << ": top_k must be in [1, 64], got " << top_k);
  MOE_HOST_ASSERT(num_local >= 1 && num_local <= kMaxLocalExperts,
                  kFn << ": num_local_experts must be in [1, " << kMaxLocalExperts << "], got " << num_local);
  MOE_HOST_ASSERT(hidden >= 128 && hidden % 128 == 0, kFn << ": hidden must be a positive multiple of 128, got " << hidden);
  return {top_k, num_local, hidden};
}

inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/moe_local_dispatch.cuh>\n"
     << "template __global__ void moe_kernels::moe_local_dispatch_kernel<" << c.top_k << ", " << c.num_local << ", "
     << c.hidden << ", " << c.hidden / 128 << ", " << kThreads
     << ">(const long long*, const float*, const unsigned char*, const float*, unsigned, long long, unsigned char*, "
        "float*, float*, long long*, long long*, int*);\n";
  return {kFn, os.str()};
}

struct Args {
  std::uint64_t topk_idx, topk_weights, xq, xs;
  long long num_tokens, first_expert;
  std::uint64_t acts, acts_sf, weights, global_ids, pair_rows, masked_m;
  int device;
  std::uint64_t stream;
};

inline void launch(const Config& c, const Args& a) {
  MOE_HOST_ASSERT(a.num_tokens >= 1 && a.num_tokens * c.top_k <= 65536,
                  kFn << ": num_tokens * top_k must be in [1, 65536], got " << a.num_tokens * c.top_k);
  MOE_HOST_ASSERT(a.xq % 16 == 0 && a.acts % 16 == 0, kFn << ": xq and acts must be 16-byte aligned");
  static moe_jit::KernelMemo<std::array<int, 4>, moe_jit::IntArrayHash> memo;
  const std::array<int, 4> key = {c.top_k, c.num_local, c.hidden, a.device};
  const auto kernel = memo.get(key, [&] {
    const GeneratedKernel gen = generate(c);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(a.device));
  });
  const long long pairs = a.num_tokens * c.top_k;
  const long long rows = c.num_local * a.num_tokens + pairs;
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>(pairs + (rows + kRowsPerIdCta - 1) / kRowsPerIdCta);
  cfg.block_x = kThreads;
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, reinterpret_cast<const long long*>(a.topk_idx),
                  reinterpret_cast<const float*>(a.topk_weights), reinterpret_cast<const unsigned char*>(a.xq),
                  reinterpret_cast<const float*>(a.xs), static_cast<unsigned>(a.num_tokens), a.first_expert,
                  reinterpret_cast<unsigned char*>(a.acts), reinterpret_cast<float*>(a.acts_sf),
                  reinterpret_cast<float*>(a.weights), reinterpret_cast<long long*>(a.global_ids),
                  reinterpret_cast<long long*>(a.pair_rows), reinterpret_cast<int*>(a.masked_m));
}

}  // namespace moe_launchers::moe_local_dispatch
