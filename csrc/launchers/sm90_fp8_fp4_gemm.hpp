#pragma once
// FP8 x FP4 m-grouped GEMM family (impls/sm90_fp8_fp4_gemm.cuh), contiguous and masked: heuristic,
// code generation, TMA descriptors and launch.
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

namespace moe_launchers::sm90_fp8_fp4_gemm {

using namespace moe_launchers::sm90_gemm;

constexpr int kBlockK = 128;
// The converter warpgroup writes 16 rows per pass; math holds two accumulator sets of block N / 2
// registers in its 208-232 budget.
constexpr int kMaxBlockN = 128;

struct Config {
  const char* fn;
  GemmType type;
  int n, k;
  int block_m, block_n, num_stages, group_n;
  int num_sms;
  int smem_bytes;
  int swizzle_d;

  int num_tiles(int m) const { return ((m + block_m - 1) / block_m) * ((n + block_n - 1) / block_n); }
};

// One stage: A, the converted and the packed B tiles, the scales (A rows, B exponent words, B
// column scales), and the stage's third mbarrier (converted).
inline int stage_bytes(int block_m, int block_n) {
  return block_m * kBlockK + block_n * kBlockK + block_n * kBlockK / 2 + (block_m + 2 * block_n) * 4 + 8;
}

// Math warpgroups (block_m / 64), converter warpgroups (two beside one math warpgroup, else one)
// and the producer warpgroup; mirrors the kernel's launch bounds.
inline int block_threads(int block_m) { return (block_m / 64 + (block_m == 64 ? 2 : 1) + 1) * 128; }

inline const char* function_name(GemmType type) {
  return type == GemmType::kGroupedMasked ? "m_grouped_fp8_fp4_gemm_nt_masked" : "m_grouped_fp8_fp4_gemm_nt_contiguous";
}

// `m`: rows of A (contiguous) or the expected rows per group (masked, `num_groups` problems).
inline Config get_config(int m, int n, int k, int num_sms, GemmType type, int num_groups) {
  const char* fn = function_name(type);
  MOE_HOST_ASSERT(type != GemmType::kNormal, fn << ": the FP4-weight GEMM is m-grouped");
  MOE_HOST_ASSERT(m >= 1, fn << ": M must be >= 1, got " << m);
  MOE_HOST_ASSERT(n >= 8 && n % 8 == 0, fn << ": N must be a positive multiple of 8, got " << n);
  MOE_HOST_ASSERT(k >= kBlockK && k % kBlockK == 0, fn << ": K must be a positive multiple of 128, got " << k);
  MOE_HOST_ASSERT(num_sms >= 1, fn << ": num_sms must be >= 1, got " << num_sms);
  MOE_HOST_ASSERT(num_groups >= 1, fn << ": num_groups must be >= 1, got " << num_groups);
  Config cfg{};
  cfg.fn = fn;
  cfg.type = type;
  cfg.n = n;
  cfg.k = k;
  cfg.group_n = kGroupN;
  cfg.num_sms = num_sms;
  const Tiles t = choose_tiles(fn, type == GemmType::kGroupedMasked ? num_groups : 1, m, n, num_sms, kMaxBlockN,
                               stage_bytes, [](int bn) { return bn % 16 == 0; });
  cfg.block_m = t.block_m;
  cfg.block_n = t.block_n;
  cfg.num_stages = t.num_stages;
  cfg.smem_bytes = pipeline_smem(t.block_m, t.block_n, t.num_stages, stage_bytes(t.block_m, t.block_n));
  cfg.swizzle_d = t.swizzle_d;
  return cfg;
}

inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/sm90_fp8_fp4_gemm.cuh>\n"
     << "static __device__ void* moe_instantiate() {\n"
     << "  return reinterpret_cast<void*>(&moe_kernels::sm90_fp8_fp4_gemm_nt<" << static_cast<int>(c.type)
     << ", 0, " << c.n << ", " << c.k << ", " << c.block_m << ", " << c.block_n << ", " << c.num_stages << ", "
     << c.group_n << ", " << c.swizzle_d << ">);\n"
     << "}\n";
  return {"sm90_fp8_fp4_gemm_nt", os.str()};
}

struct Args {
  std::uint64_t a, sfa, b, sfb, d;
  long long lda, ldb, ldd;      // A and D in elements; B (packed) in bytes
  long long sfa_stride_m, sfa_stride_k;
  long long sfb_stride_g, sfb_stride_n;  // bytes
  int m;                        // rows of A (masked: rows per group, max_m)
  int num_groups;
  std::uint64_t grouped_layout;  // m_indices or masked_m (int32, device)
  int device;
  std::uint64_t stream;
};

inline void launch(const Config& c, const Args& a) {
  using namespace moe_jit::driver;
  MOE_HOST_ASSERT(a.sfb % 4 == 0 && a.sfb_stride_n % 4 == 0 && a.sfb_stride_g % 4 == 0,
                  c.fn << ": SFB must be 4-byte aligned with strides that are multiples of 4 bytes");
  static moe_jit::KernelMemo<std::array<int, 9>, moe_jit::IntArrayHash> memo;
  const std::array<int, 9> key = {static_cast<int>(c.type), c.n, c.k, c.block_m, c.block_n, c.num_stages,
                                  c.group_n, c.swizzle_d, a.device};
  const auto kernel = memo.get(key, [&] {
    const std::string arch = moe_jit::device_arch(a.device);
    MOE_HOST_ASSERT(arch == "sm_90a", c.fn << ": this kernel needs an SM90 GPU (H100/H200), the device is " << arch);
    const GeneratedKernel gen = generate(c);
    return moe_jit::build(gen.name, gen.code, arch);
  });

  const bool masked = c.type == GemmType::kGroupedMasked;
  const std::uint64_t rows_a = masked ? static_cast<std::uint64_t>(a.m) * a.num_groups : a.m;
  const CUtensorMap map_a = make_tma(c.fn, a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k, rows_a, a.lda, kBlockK,
                                     c.block_m, CU_TENSOR_MAP_SWIZZLE_128B, "A");
  // Packed B: plain 64-byte rows, which the converter reads and re-lays out swizzled.
  const CUtensorMap map_b = make_tma(c.fn, a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k / 2,
                                     static_cast<std::uint64_t>(c.n) * a.num_groups, a.ldb, kBlockK / 2, c.block_n,
                                     CU_TENSOR_MAP_SWIZZLE_NONE, "B");
  const std::uint32_t box_n = c.swizzle_d == 0 ? c.block_n : c.swizzle_d / 2;
  const CUtensorMapSwizzle swizzle_d = tma_swizzle(c.swizzle_d);
  const CUtensorMap map_d =
      masked ? make_tma(c.fn, a.d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.n, a.m, a.ldd, box_n, c.block_m, swizzle_d,
                        "D", a.num_groups, a.ldd * a.m)
             : make_tma(c.fn, a.d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.n, a.m, a.ldd, box_n, c.block_m, swizzle_d,
                        "D");

  moe_jit::LaunchConfig cfg;
  const int tiles = masked ? c.num_tiles(a.m) * a.num_groups : c.num_tiles(a.m);
  cfg.grid_x = static_cast<unsigned>(std::max(1, std::min(tiles, c.num_sms)));
  cfg.block_x = static_cast<unsigned>(block_threads(c.block_m));
  cfg.smem_bytes = static_cast<unsigned>(c.smem_bytes);
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, static_cast<std::uint32_t>(a.m), reinterpret_cast<const int*>(a.grouped_layout),
                  static_cast<std::uint32_t>(a.num_groups), reinterpret_cast<const float*>(a.sfa),
                  static_cast<std::uint32_t>(a.sfa_stride_m), static_cast<std::uint32_t>(a.sfa_stride_k),
                  reinterpret_cast<const std::uint8_t*>(a.sfb), static_cast<std::uint32_t>(a.sfb_stride_g),
                  static_cast<std::uint32_t>(a.sfb_stride_n), map_a, map_b, map_d);
}

}  // namespace moe_launchers::sm90_fp8_fp4_gemm
