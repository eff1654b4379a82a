#pragma once
// Dense BF16 GEMM family (impls/sm90_bf16_gemm.cuh): heuristic, code generation, TMA descriptors
// and launch. Tiling and descriptors come from gemm_common.hpp, as for the FP8 GEMM.
#include <algorithm>
#include <array>
#include <cstdint>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/driver.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"
#include "launchers/gemm_common.hpp"

namespace moe_launchers::sm90_bf16_gemm {

using namespace moe_launchers::sm90_gemm;

constexpr int kBlockK = 64;       // 128-byte rows of bf16
constexpr int kMaxBlockN = 256;   // one FP32 accumulator set: kBlockN/2 registers

struct Config {
  int m_compiled;  // 0: M is a runtime argument
  int n, k;
  Tiles tiles;
  Residual residual;
  int num_sms;

  int num_tiles(int m) const {
    return ((m + tiles.block_m - 1) / tiles.block_m) * ((n + tiles.block_n - 1) / tiles.block_n);
  }
};

inline int stage_bytes(int block_m, int block_n) { return (block_m + block_n) * kBlockK * 2; }

inline Config plan_config(int m, int n, int k, int num_sms, bool compile_m, Residual residual) {
  MOE_HOST_ASSERT(m >= 1, "bf16_gemm_nt: M must be >= 1, got " << m);
  MOE_HOST_ASSERT(n >= 8 && n % 8 == 0, "bf16_gemm_nt: N must be a positive multiple of 8, got " << n);
  MOE_HOST_ASSERT(k >= kBlockK && k % kBlockK == 0, "bf16_gemm_nt: K must be a positive multiple of 64, got " << k);
  MOE_HOST_ASSERT(num_sms >= 1, "bf16_gemm_nt: num_sms must be >= 1, got " << num_sms);
  return {compile_m ? m : 0, n, k,
          choose_tiles("bf16_gemm_nt", 1, m, n, num_sms, kMaxBlockN, stage_bytes, [](int) { return true; }),
          residual, num_sms};
}

// plan_config once per shape and environment (moe_jit::EnvMemo), as the FP8 family does.
inline Config get_config(int m, int n, int k, int num_sms, bool compile_m, Residual residual) {
  static moe_jit::EnvMemo<std::array<int, 6>, Config, moe_jit::IntArrayHash> memo;
  const std::array<int, 6> key = {m, n, k, num_sms, compile_m, static_cast<int>(residual)};
  return memo.get(key, [&] { return plan_config(m, n, k, num_sms, compile_m, residual); });
}

inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/sm90_bf16_gemm.cuh>\n"
     << "static __device__ void* moe_instantiate() {\n"
     << "  return reinterpret_cast<void*>(&moe_kernels::sm90_bf16_gemm_nt<" << c.m_compiled << ", " << c.n << ", "
     << c.k << ", " << c.tiles.block_m << ", " << c.tiles.block_n << ", " << c.tiles.num_stages << ", " << kGroupN
     << ", " << static_cast<int>(c.residual) << ", " << c.tiles.swizzle_d << ">);\n"
     << "}\n";
  return {"sm90_bf16_gemm_nt", os.str()};
}

struct Args {
  std::uint64_t a, b, d, c;
  long long lda, ldb, ldd, ldc;
  int m;
  int device;
  std::uint64_t stream;
};

inline void launch(const Config& c, const Args& a) {
  using namespace moe_jit::driver;
  static moe_jit::KernelMemo<std::array<int, 10>, moe_jit::IntArrayHash> memo;
  const Tiles& t = c.tiles;
  const std::array<int, 10> key = {c.m_compiled, c.n, c.k, t.block_m, t.block_n, t.num_stages, t.swizzle_d,
                                   static_cast<int>(c.residual), kGroupN, a.device};
  const char* fn = "bf16_gemm_nt";
  const auto kernel = sm90_kernel(memo, key, fn, a.device, [&] { return generate(c); });
  const CUtensorMap map_a = make_tma(fn, a.a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.k, a.m, a.lda, kBlockK,
                                     t.block_m, CU_TENSOR_MAP_SWIZZLE_128B, "A");
  const CUtensorMap map_b = make_tma(fn, a.b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.k, c.n, a.ldb, kBlockK,
                                     t.block_n, CU_TENSOR_MAP_SWIZZLE_128B, "B");
  const CUtensorMap map_d = make_tma_d(fn, a.d, c.n, a.m, a.ldd, t.block_n, t.block_m, t.swizzle_d, false, 1);
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>(std::max(1, std::min(c.num_tiles(a.m), c.num_sms)));
  cfg.block_x = static_cast<unsigned>((t.block_m / 64 + 1) * 128);
  cfg.smem_bytes = static_cast<unsigned>(t.smem_bytes);
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, static_cast<std::uint32_t>(a.m), reinterpret_cast<const void*>(a.c),
                  static_cast<std::uint32_t>(a.ldc), map_a, map_b, map_d);
}

}  // namespace moe_launchers::sm90_bf16_gemm
