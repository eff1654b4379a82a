#pragma once
// BF16 GEMM family (impls/sm90_bf16_gemm.cuh), dense and m-grouped (contiguous, masked): heuristic,
// code generation, TMA descriptors and launch. Tiling and descriptors come from gemm_common.hpp, as
// for the FP8 GEMM.
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
  GemmType type = GemmType::kNormal;
  int num_groups = 1;

  // Tiles of `m` rows (masked: max_m per group, an upper bound on what masked_m leaves).
  long long num_tiles(int m) const {
    const long long m_blocks = (m + tiles.block_m - 1) / tiles.block_m;
    return (type == GemmType::kGroupedMasked ? num_groups : 1) * m_blocks * ((n + tiles.block_n - 1) / tiles.block_n);
  }
};

inline const char* fn_name(GemmType type) {
  return type == GemmType::kGroupedContiguous ? "m_grouped_bf16_gemm_nt_contiguous"
         : type == GemmType::kGroupedMasked   ? "m_grouped_bf16_gemm_nt_masked"
                                              : "bf16_gemm_nt";
}

inline int stage_bytes(int block_m, int block_n) { return (block_m + block_n) * kBlockK * 2; }

// `m`: the rows (kGroupedMasked: the expected rows per group, of num_groups problems, as the FP8
// heuristic plans them). Grouped kernels take M at run time and add no C. Block M (64 or 128)
// divides every contiguous alignment (a multiple of 128), so a tile never spans two groups.
inline Config plan_config(int m, int n, int k, int num_sms, bool compile_m, Residual residual,
                          GemmType type = GemmType::kNormal, int num_groups = 1) {
  const char* fn = fn_name(type);
  MOE_HOST_ASSERT(m >= 1, fn << ": M must be >= 1, got " << m);
  MOE_HOST_ASSERT(n >= 8 && n % 8 == 0, fn << ": N must be a positive multiple of 8, got " << n);
  MOE_HOST_ASSERT(k >= kBlockK && k % kBlockK == 0, fn << ": K must be a positive multiple of 64, got " << k);
  MOE_HOST_ASSERT(num_sms >= 1, fn << ": num_sms must be >= 1, got " << num_sms);
  MOE_HOST_ASSERT(num_groups >= 1 && (type != GemmType::kNormal || num_groups == 1),
                  fn << ": num_groups must be >= 1 (1 for a dense GEMM), got " << num_groups);
  MOE_HOST_ASSERT(type == GemmType::kNormal || (!compile_m && residual == Residual::kNone),
                  fn << ": grouped GEMMs take M at run time and no C");
  const long long problems = type == GemmType::kGroupedMasked ? num_groups : 1;
  Config c{compile_m ? m : 0, n, k,
           choose_tiles(fn, problems, m, n, num_sms, kMaxBlockN, stage_bytes, [](int) { return true; }), residual,
           num_sms};
  c.type = type;
  c.num_groups = num_groups;
  return c;
}

// plan_config once per shape and environment (moe_jit::EnvMemo), as the FP8 family does.
inline Config get_config(int m, int n, int k, int num_sms, bool compile_m, Residual residual,
                         GemmType type = GemmType::kNormal, int num_groups = 1) {
  static moe_jit::EnvMemo<std::array<int, 8>, Config, moe_jit::IntArrayHash> memo;
  const std::array<int, 8> key = {m, n, k, num_sms, compile_m, static_cast<int>(residual), static_cast<int>(type),
                                  num_groups};
  return memo.get(key, [&] { return plan_config(m, n, k, num_sms, compile_m, residual, type, num_groups); });
}

inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/sm90_bf16_gemm.cuh>\n"
     << "static __device__ void* moe_instantiate() {\n"
     << "  return reinterpret_cast<void*>(&moe_kernels::sm90_bf16_gemm_nt<" << c.m_compiled << ", " << c.n << ", "
     << c.k << ", " << c.tiles.block_m << ", " << c.tiles.block_n << ", " << c.tiles.num_stages << ", " << kGroupN
     << ", " << static_cast<int>(c.residual) << ", " << c.tiles.swizzle_d << ", " << static_cast<int>(c.type)
     << ">);\n"
     << "}\n";
  return {"sm90_bf16_gemm_nt", os.str()};
}

// m: M (kGroupedMasked: max_m); grouped: m_indices (contiguous) or masked_m (masked), int32 on the
// device, with A (masked), B and D holding their groups stacked without gaps.
struct Args {
  std::uint64_t a, b, d, c;
  long long lda, ldb, ldd, ldc;
  int m;
  int device;
  std::uint64_t stream;
  std::uint64_t grouped = 0;
  int num_groups = 1;
};

inline void launch(const Config& c, const Args& a) {
  using namespace moe_jit::driver;
  static moe_jit::KernelMemo<std::array<int, 11>, moe_jit::IntArrayHash> memo;
  const Tiles& t = c.tiles;
  const std::array<int, 11> key = {c.m_compiled, c.n, c.k, t.block_m, t.block_n, t.num_stages, t.swizzle_d,
                                   static_cast<int>(c.residual), kGroupN, static_cast<int>(c.type), a.device};
  const char* fn = fn_name(c.type);
  const bool masked = c.type == GemmType::kGroupedMasked;
  MOE_HOST_ASSERT(a.num_groups == c.num_groups && (c.type == GemmType::kNormal || a.grouped != 0),
                  fn << ": the plan's " << c.num_groups << " groups launched with " << a.num_groups
                     << (a.grouped == 0 ? " and no group layout" : ""));
  const auto kernel = sm90_kernel(memo, key, fn, a.device, [&] { return generate(c); });
  const std::uint64_t rows_a = static_cast<std::uint64_t>(a.m) * (masked ? a.num_groups : 1);
  const CUtensorMap map_a = make_tma(fn, a.a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.k, rows_a, a.lda, kBlockK,
                                     t.block_m, CU_TENSOR_MAP_SWIZZLE_128B, "A");
  const CUtensorMap map_b = make_tma(fn, a.b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.k,
                                     static_cast<std::uint64_t>(c.n) * a.num_groups, a.ldb, kBlockK, t.block_n,
                                     CU_TENSOR_MAP_SWIZZLE_128B, "B");
  const CUtensorMap map_d = make_tma_d(fn, a.d, c.n, a.m, a.ldd, t.block_n, t.block_m, t.swizzle_d, masked,
                                       a.num_groups);
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>(std::max<long long>(1, std::min<long long>(c.num_tiles(a.m), c.num_sms)));
  cfg.block_x = static_cast<unsigned>((t.block_m / 64 + 1) * 128);
  cfg.smem_bytes = static_cast<unsigned>(t.smem_bytes);
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, static_cast<std::uint32_t>(a.m), reinterpret_cast<const void*>(a.c),
                  static_cast<std::uint32_t>(a.ldc), reinterpret_cast<const int*>(a.grouped),
                  static_cast<std::uint32_t>(a.num_groups), map_a, map_b, map_d);
}

}  // namespace moe_launchers::sm90_bf16_gemm
