#pragma once
// MoE combine family (impls/moe_combine.cuh): code generation, memo and launch.
#include <array>
#include <cstdint>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"

namespace moe_launchers::moe_combine {

// 128 threads of 8 columns cover 1024 columns: a 7168-wide row is 7 CTAs per token, enough CTAs
// at decode sizes to spread the k rows' reads over SMs.
constexpr int kThreads = 128;
constexpr const char* kFn = "moe_combine";

struct Config {
  int top_k, hidden;
  bool float_out;
};

struct GeneratedKernel {
  std::string name;
  std::string code;
};

inline Config get_config(int top_k, int hidden, bool float_out) {
  MOE_HOST_ASSERT(top_k >= 1 && top_k <= 64, kFn << ": top_k must be in [1, 64], got " << top_k);
  MOE_HOST_ASSERT(hidden >= 8 && hidden % 8 == 0, kFn << ": hidden must be a positive multiple of 8, got " << hidden);
  return {top_k, hidden, float_out};
}

inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/moe_combine.cuh>\n"
     << "template __global__ void moe_kernels::moe_combine_kernel<" << c.top_k << ", " << c.hidden << ", " << kThreads
     << ", " << (c.float_out ? "true" : "false")
     << ">(const __nv_bfloat16*, long long, const long long*, const bool*, void*);\n";
  return {kFn, os.str()};
}

struct Args {
  std::uint64_t src;
  long long num_src_rows;
  std::uint64_t rows, routed, out;  // rows, routed: 0 for none
  long long num_tokens;
  int device;
  std::uint64_t stream;
};

inline void launch(const Config& c, const Args& a) {
  const long long column_blocks = (c.hidden / 8 + kThreads - 1) / kThreads;
  MOE_HOST_ASSERT(a.num_tokens >= 0 && a.num_tokens * column_blocks < (1ll << 31),
                  kFn << ": num_tokens * " << column_blocks << " column blocks must stay below 2^31, got "
                      << a.num_tokens);
  MOE_HOST_ASSERT(a.src % 16 == 0 && a.out % 16 == 0, kFn << ": src and out must be 16-byte aligned");
  if (a.num_tokens == 0) return;
  static moe_jit::KernelMemo<std::array<int, 4>, moe_jit::IntArrayHash> memo;
  const std::array<int, 4> key = {c.top_k, c.hidden, static_cast<int>(c.float_out), a.device};
  const auto kernel = memo.get(key, [&] {
    const GeneratedKernel gen = generate(c);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(a.device));
  });
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>(a.num_tokens * column_blocks);
  cfg.block_x = kThreads;
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, reinterpret_cast<const void*>(a.src), static_cast<long long>(a.num_src_rows),
                  reinterpret_cast<const long long*>(a.rows),
                  reinterpret_cast<const bool*>(a.routed), reinterpret_cast<void*>(a.out));
}

}  // namespace moe_launchers::moe_combine
