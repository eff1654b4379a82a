#pragma once
// FP8 GEMM family (impls/sm90_fp8_gemm.cuh), dense and m-grouped (contiguous, masked): heuristic,
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

namespace moe_launchers::sm90_fp8_gemm {

constexpr int kBlockK = 128;
constexpr int kMaxBlockN = 192;       // two FP32 accumulator sets of kBlockN/2 registers fit 232
constexpr int kMaxStages = 32;
constexpr int kGroupN = 8;            // n-blocks per scheduler band (L2 reuse)
constexpr int kSmemLimit = 232448;    // SM90 opt-in shared memory per block
// A wgmma's fixed cost, in columns of N: the A operand is re-read for every instruction, so a
// tile costs about (block_n + kTileOverheadN) units of time.
constexpr int kTileOverheadN = 32;

enum class Residual : int { kNone = 0, kBFloat16 = 1, kFloat32 = 2 };
// Mirrors moe_kernels::GemmType.
enum class GemmType : int { kNormal = 0, kGroupedContiguous = 1, kGroupedMasked = 2 };

struct Config {
  GemmType type;
  int m_compiled;  // 0: M is a runtime argument
  int n, k;
  int block_m, block_n, num_stages, group_n;
  Residual residual;
  int num_sms;     // persistent grid size upper bound
  int smem_bytes;
  int swizzle_d;   // bytes of the epilogue's swizzle atom (128, 64, 32) or 0 for plain rows

  // Tiles of an m-row problem (per group for kGroupedMasked; an upper bound for the grid).
  int num_tiles(int m) const { return ((m + block_m - 1) / block_m) * ((n + block_n - 1) / block_n); }
};

inline int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// A tile's columns may cover at most two 128-wide scale blocks of B.
inline bool block_n_fits_scales(int block_n) {
  return block_n <= 128 || 128 - gcd(block_n, 128) + block_n <= 256;
}

inline int smem_bytes(int block_m, int block_n, int stages) {
  const int d = block_m * block_n * 2;
  const int stage = block_m * kBlockK + block_n * kBlockK + (block_m + 4) * 4;
  return d + stages * stage + 2 * stages * 8;
}

inline void check_shape(int m, int n, int k) {
  MOE_HOST_ASSERT(m >= 1, "fp8_gemm_nt: M must be >= 1, got " << m);
  MOE_HOST_ASSERT(n >= 8 && n % 8 == 0, "fp8_gemm_nt: N must be a positive multiple of 8, got " << n);
  MOE_HOST_ASSERT(k >= kBlockK && k % kBlockK == 0, "fp8_gemm_nt: K must be a positive multiple of 128, got " << k);
}

// Analytic choice: fewest waves of tiles weighted by a tile's cost, then the larger block N. `m` is
// the rows of the problem; for kGroupedMasked the expected rows per group, times `num_groups`
// problems.
inline Config get_config(int m, int n, int k, int num_sms, bool compile_m, Residual residual,
                         GemmType type = GemmType::kNormal, int num_groups = 1) {
  check_shape(m, n, k);
  MOE_HOST_ASSERT(num_sms >= 1, "fp8_gemm_nt: num_sms must be >= 1, got " << num_sms);
  MOE_HOST_ASSERT(num_groups >= 1, "fp8_gemm_nt: num_groups must be >= 1, got " << num_groups);
  Config cfg{};
  cfg.type = type;
  cfg.m_compiled = compile_m ? m : 0;
  cfg.n = n;
  cfg.k = k;
  // Up to 128 rows the weights dominate the bytes: one math warpgroup per CTA leaves shared memory
  // to deep B stages (two 64-row CTAs share each B tile through L2).
  cfg.block_m = m <= 128 ? 64 : 128;
  cfg.group_n = kGroupN;
  cfg.residual = residual;
  cfg.num_sms = num_sms;

  long long best_score = -1;
  for (int bn = 8; bn <= kMaxBlockN; bn += 8) {
    if (!block_n_fits_scales(bn)) continue;
    const long long problems = type == GemmType::kGroupedMasked ? num_groups : 1;
    const long long tiles = problems * ((m + cfg.block_m - 1) / cfg.block_m) * ((n + bn - 1) / bn);
    const long long waves = (tiles + num_sms - 1) / num_sms;
    const long long score = waves * (bn + kTileOverheadN);
    if (best_score < 0 || score < best_score || (score == best_score && bn > cfg.block_n)) {
      best_score = score;
      cfg.block_n = bn;
    }
  }
  const int fixed = smem_bytes(cfg.block_m, cfg.block_n, 0);
  const int per_stage = smem_bytes(cfg.block_m, cfg.block_n, 1) - fixed;
  cfg.num_stages = std::min(kMaxStages, (kSmemLimit - fixed) / per_stage);
  MOE_HOST_ASSERT(cfg.num_stages >= 2, "fp8_gemm_nt: no pipeline fits shared memory for block "
                                           << cfg.block_m << "x" << cfg.block_n);
  cfg.smem_bytes = smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages);
  // The widest swizzle whose atom (swizzle / 2 bf16 columns) divides block N.
  cfg.swizzle_d = cfg.block_n % 64 == 0 ? 128 : cfg.block_n % 32 == 0 ? 64 : cfg.block_n % 16 == 0 ? 32 : 0;
  return cfg;
}

struct GeneratedKernel {
  std::string name;
  std::string code;
};

inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  // Taking the address instantiates the kernel; an explicit instantiation directive would have
  // to repeat the __grid_constant__ parameter list.
  os << "#include <moe_kernels/impls/sm90_fp8_gemm.cuh>\n"
     << "static __device__ void* moe_instantiate() {\n"
     << "  return reinterpret_cast<void*>(&moe_kernels::sm90_fp8_gemm_nt<" << static_cast<int>(c.type) << ", "
     << c.m_compiled << ", " << c.n << ", "
     << c.k << ", " << c.block_m << ", " << c.block_n << ", " << c.num_stages << ", " << c.group_n << ", "
     << static_cast<int>(c.residual) << ", " << c.swizzle_d << ">);\n"
     << "}\n";
  return {"sm90_fp8_gemm_nt", os.str()};
}

// Row-major tensor [outer2, outer, inner] (outer2 = 1: 2-D) with strides in elements.
inline moe_jit::driver::CUtensorMap make_tma(std::uint64_t ptr, moe_jit::driver::CUtensorMapDataType dtype,
                                            int elem_bytes, std::uint64_t inner, std::uint64_t outer,
                                            std::uint64_t row_stride, std::uint32_t box_inner, std::uint32_t box_outer,
                                            moe_jit::driver::CUtensorMapSwizzle swizzle, const char* what,
                                            std::uint64_t outer2 = 1, std::uint64_t outer2_stride = 0) {
  using namespace moe_jit::driver;
  MOE_HOST_ASSERT(ptr % 16 == 0, "fp8_gemm_nt: " << what << " must be 16-byte aligned");
  MOE_HOST_ASSERT((row_stride * elem_bytes) % 16 == 0 && (outer2_stride * elem_bytes) % 16 == 0,
                  "fp8_gemm_nt: the strides of " << what << " must be multiples of 16 bytes, got "
                                                 << row_stride * elem_bytes << " and " << outer2_stride * elem_bytes);
  CUtensorMap map{};
  const cuuint32_t rank = outer2 > 1 ? 3 : 2;
  const cuuint64_t dims[3] = {inner, outer, outer2};
  const cuuint64_t strides[2] = {row_stride * elem_bytes, outer2_stride * elem_bytes};
  const cuuint32_t box[3] = {box_inner, box_outer, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  MOE_CU_CHECK(api().cuTensorMapEncodeTiled(&map, dtype, rank, reinterpret_cast<void*>(ptr), dims, strides, box,
                                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return map;
}

struct Args {
  std::uint64_t a, sfa, b, sfb, d, c;
  long long lda, ldb, ldd, ldc;
  long long sfa_stride_m, sfa_stride_k, sfb_stride_g, sfb_stride_n, sfb_stride_k;
  int m;                       // rows of A (kGroupedMasked: rows per group, max_m)
  int num_groups;              // groups of B (1 for kNormal)
  std::uint64_t grouped_layout;  // m_indices or masked_m (int32, device)
  int device;
  std::uint64_t stream;
};

inline void launch(const Config& c, const Args& a) {
  using namespace moe_jit::driver;
  static moe_jit::KernelMemo<std::array<int, 11>, moe_jit::IntArrayHash> memo;
  const std::array<int, 11> key = {static_cast<int>(c.type), c.m_compiled, c.n, c.k, c.block_m, c.block_n,
                                   c.num_stages, c.group_n, static_cast<int>(c.residual), c.swizzle_d, a.device};
  const auto kernel = memo.get(key, [&] {
    const std::string arch = moe_jit::device_arch(a.device);
    MOE_HOST_ASSERT(arch == "sm_90a",
                    "fp8_gemm_nt: this kernel needs an SM90 GPU (H100/H200), the device is " << arch);
    const GeneratedKernel gen = generate(c);
    return moe_jit::build(gen.name, gen.code, arch);
  });

  const bool masked = c.type == GemmType::kGroupedMasked;
  const std::uint64_t rows_a = masked ? static_cast<std::uint64_t>(a.m) * a.num_groups : a.m;
  const CUtensorMap map_a = make_tma(a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k, rows_a, a.lda, kBlockK, c.block_m,
                                     CU_TENSOR_MAP_SWIZZLE_128B, "A");
  const CUtensorMap map_b = make_tma(a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k,
                                     static_cast<std::uint64_t>(c.n) * a.num_groups, a.ldb, kBlockK, c.block_n,
                                     CU_TENSOR_MAP_SWIZZLE_128B, "B");
  // One TMA box per epilogue atom. A masked group's tile must not spill into the next group's
  // rows: D is 3-D there.
  const std::uint32_t box_n = c.swizzle_d == 0 ? c.block_n : c.swizzle_d / 2;
  const CUtensorMapSwizzle swizzle_d = c.swizzle_d == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                       : c.swizzle_d == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                       : c.swizzle_d == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                           : CU_TENSOR_MAP_SWIZZLE_NONE;
  const CUtensorMap map_d =
      masked ? make_tma(a.d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.n, a.m, a.ldd, box_n, c.block_m, swizzle_d, "D",
                        a.num_groups, a.ldd * a.m)
             : make_tma(a.d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.n, a.m, a.ldd, box_n, c.block_m, swizzle_d, "D");

  moe_jit::LaunchConfig cfg;
  const int tiles = masked ? c.num_tiles(a.m) * a.num_groups : c.num_tiles(a.m);
  cfg.grid_x = static_cast<unsigned>(std::max(1, std::min(tiles, c.num_sms)));
  cfg.block_x = static_cast<unsigned>((c.block_m / 64 + 1) * 128);
  cfg.smem_bytes = static_cast<unsigned>(c.smem_bytes);
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, static_cast<std::uint32_t>(a.m), reinterpret_cast<const int*>(a.grouped_layout),
                  static_cast<std::uint32_t>(a.num_groups), reinterpret_cast<const float*>(a.sfa),
                  static_cast<std::uint32_t>(a.sfa_stride_m), static_cast<std::uint32_t>(a.sfa_stride_k),
                  reinterpret_cast<const float*>(a.sfb), static_cast<std::uint32_t>(a.sfb_stride_g),
                  static_cast<std::uint32_t>(a.sfb_stride_n), static_cast<std::uint32_t>(a.sfb_stride_k),
                  reinterpret_cast<const void*>(a.c), static_cast<std::uint32_t>(a.ldc), map_a, map_b, map_d);
}

}  // namespace moe_launchers::sm90_fp8_gemm
