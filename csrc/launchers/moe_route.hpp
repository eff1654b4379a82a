#pragma once
// Top-k routing (impls/moe_route.cuh): code generation, memo and launch.
#include <array>
#include <cstdint>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"

namespace moe_launchers::moe_route {

constexpr int kWarps = 4;  // tokens per CTA
constexpr int kMaxExperts = 1024;
constexpr const char* kFn = "moe_route";

struct Config {
  int num_experts, top_k, num_groups, topk_groups;  // num_groups 0: no grouped top-k
  bool sigmoid, norm, has_bias;
};

struct GeneratedKernel {
  std::string name;
  std::string code;
};

inline Config get_config(int num_experts, int top_k, int num_groups, int topk_groups, bool sigmoid, bool norm,
                         bool has_bias) {
  MOE_HOST_ASSERT(num_experts >= 1 && num_experts <= kMaxExperts,
                  kFn << ": num_experts must be in [1, " << kMaxExperts << "], got " << num_experts);
  MOE_HOST_ASSERT(top_k >= 1 && top_k <= 32 && top_k <= num_experts,
                  kFn << ": top_k must be in [1, min(32, num_experts)], got " << top_k);
  MOE_HOST_ASSERT(num_groups == 0 || (num_groups <= 32 && num_experts % num_groups == 0 &&
                                      num_experts / num_groups >= 2 && topk_groups >= 1 && topk_groups <= num_groups &&
                                      top_k <= topk_groups * (num_experts / num_groups)),
                  kFn << ": groups of >= 2 experts must divide the experts (at most 32 groups), keep 1..n_group of "
                         "them and hold top_k experts, got n_group=" << num_groups << ", topk_group=" << topk_groups);
  return {num_experts, top_k, num_groups, num_groups ? topk_groups : 0, sigmoid, norm, has_bias};
}

inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/moe_route.cuh>\n"
     << "template __global__ void moe_kernels::moe_route_kernel<" << c.num_experts << ", " << c.top_k << ", "
     << c.num_groups << ", " << c.topk_groups << ", " << (c.sigmoid ? "true" : "false") << ", "
     << (c.norm ? "true" : "false") << ", " << (c.has_bias ? "true" : "false") << ", " << kWarps
     << ">(const float*, const float*, unsigned, float, long long*, float*);\n";
  return {kFn, os.str()};
}

struct Args {
  std::uint64_t logits, bias;  // bias: 0 for none
  long long num_tokens;
  float scaling;
  std::uint64_t topk_idx, topk_weights;
  int device;
  std::uint64_t stream;
};

inline void launch(const Config& c, const Args& a) {
  MOE_HOST_ASSERT(a.num_tokens >= 0 && a.num_tokens < (1ll << 31),
                  kFn << ": num_tokens must be in [0, 2^31), got " << a.num_tokens);
  MOE_HOST_ASSERT(c.has_bias == (a.bias != 0), kFn << ": the bias pointer must match the config");
  if (a.num_tokens == 0) return;
  static moe_jit::KernelMemo<std::array<int, 8>, moe_jit::IntArrayHash> memo;
  const std::array<int, 8> key = {c.num_experts, c.top_k, c.num_groups, c.topk_groups,
                                  static_cast<int>(c.sigmoid), static_cast<int>(c.norm), static_cast<int>(c.has_bias),
                                  a.device};
  const auto kernel = memo.get(key, [&] {
    const GeneratedKernel gen = generate(c);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(a.device));
  });
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>((a.num_tokens + kWarps - 1) / kWarps);
  cfg.block_x = kWarps * 32;
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, reinterpret_cast<const float*>(a.logits), reinterpret_cast<const float*>(a.bias),
                  static_cast<unsigned>(a.num_tokens), a.scaling, reinterpret_cast<long long*>(a.topk_idx),
                  reinterpret_cast<float*>(a.topk_weights));
}

}  // namespace moe_launchers::moe_route
