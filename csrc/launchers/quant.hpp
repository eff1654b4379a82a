#pragma once
// FP8 quantizer family: heuristic (vector width from alignment, threads, grid from the SM count),
// code generation (one explicit instantiation of a template in impls/quant.cuh) and launch.
#include <algorithm>
#include <array>
#include <cctype>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>

#include "apis/dtypes.hpp"
#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "moe_kernels/common/scale_items.h"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"

namespace moe_launchers::quant {

using moe_apis::DType;

constexpr int kBlock = 128;              // per-block tile edge
constexpr int kMaxVecBytes = 16;         // widest global load per thread
// Per-token: 8 resident CTAs of 256 threads fill an SM (<= 32 registers, which every variant
// meets without spills); measured on an H200 against more work per thread, see impls/quant.cuh.
constexpr int kPerTokenThreads = 256;
constexpr int kPerTokenMinCtasPerSm = 8;
// Per-block: a 128 x 128 tile over 512 threads is 64 B (2-byte inputs) or 128 B (float32) of
// registers per thread, and two CTAs fit an SM; 256 threads were 7% slower, 1024 (one CTA per
// SM, nothing to overlap the reduction with) far slower.
constexpr int kPerBlockThreads = 512;
constexpr long long kMaxItems = (1ll << 31) - 1;

inline int dtype_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    default: break;
  }
  MOE_JIT_THROW("quant: input dtype must be float32, bfloat16 or float16, got "
                << moe_apis::dtype_name(dtype));
}

// Widest vector (elements) whose loads stay aligned: it must divide the row length, every stride
// that is walked, and the base address.
inline int pick_vec(DType dtype, long long row_len, std::uint64_t ptr,
                    std::initializer_list<long long> strides) {
  const int elem = dtype_bytes(dtype);
  for (int vec = kMaxVecBytes / elem; vec > 1; vec /= 2) {
    bool ok = row_len % vec == 0 && ptr % static_cast<std::uint64_t>(vec * elem) == 0;
    for (long long s : strides) ok = ok && s % vec == 0;
    if (ok) return vec;
  }
  return 1;
}

inline std::string arch_checked(const std::string& arch) {
  int major_minor = 0;
  const bool parsed = arch.rfind("sm_", 0) == 0 && arch.size() >= 5 &&
                      std::isdigit(static_cast<unsigned char>(arch[3])) &&
                      std::isdigit(static_cast<unsigned char>(arch[4]));
  if (parsed) major_minor = std::stoi(arch.substr(3));
  // The E4M3 conversion instruction exists from sm_89 (Ada) on.
  MOE_HOST_ASSERT(parsed && major_minor >= 89,
                  "quant: arch must be sm_89 or newer (e.g. sm_90a), got '" << arch << "'");
  return arch;
}

struct GeneratedKernel {
  std::string name;  // family name, the cache folder
  std::string code;  // the whole translation unit
};

// ---------------------------------------------------------------------------------------------
// Per-token (1 x gran_k groups)

struct PerTokenConfig {
  DType in_dtype;
  int n;
  int gran_k;
  bool use_ue8m0;
  int vec;
};

inline PerTokenConfig per_token_config(DType in_dtype, int n, int gran_k, bool use_ue8m0,
                                       std::uint64_t x_ptr, long long x_row_stride) {
  MOE_HOST_ASSERT(gran_k == 32 || gran_k == 64 || gran_k == 128,
                  "per_token_cast_to_fp8: gran_k must be 32, 64 or 128, got " << gran_k);
  MOE_HOST_ASSERT(n >= 1, "per_token_cast_to_fp8: n must be >= 1, got " << n);
  return {in_dtype, n, gran_k, use_ue8m0, pick_vec(in_dtype, n, x_ptr, {x_row_stride})};
}

inline GeneratedKernel per_token_code(const PerTokenConfig& c) {
  const char* t = moe_apis::dtype_cuda_name(c.in_dtype);
  std::ostringstream os;
  os << "#include <moe_kernels/impls/quant.cuh>\n"
     << "template __global__ void moe_kernels::per_token_cast_to_fp8_kernel<" << t << ", " << c.n
     << ", " << c.gran_k << ", " << (c.use_ue8m0 ? "true" : "false") << ", " << c.vec << ", "
     << kPerTokenThreads << ", " << kPerTokenMinCtasPerSm << ">(const " << t
     << "*, long long, unsigned char*, float*, unsigned, unsigned, unsigned);\n";
  return {"per_token_cast_to_fp8", os.str()};
}

struct PerTokenArgs {
  std::uint64_t x;
  long long x_row_stride;
  std::uint64_t out;
  std::uint64_t sf;
  long long sf_stride_m;  // elements
  long long sf_stride_k;
  long long m;
  int device;
  std::uint64_t stream;
};

inline void per_token_launch(const PerTokenConfig& c, const PerTokenArgs& a) {
  const long long num_groups = (c.n + c.gran_k - 1) / c.gran_k;
  MOE_HOST_ASSERT(a.m <= kMaxItems / num_groups, "per_token_cast_to_fp8: m * ceil(n / gran_k) = "
                                                     << a.m << " * " << num_groups << " exceeds 2^31 - 1");
  MOE_HOST_ASSERT(moe_kernels::scale_strides_disjoint(a.m, num_groups, a.sf_stride_m, a.sf_stride_k),
                  "per_token_cast_to_fp8: sf strides (" << a.sf_stride_m << ", " << a.sf_stride_k << ") overlap for "
                                                        << a.m << " x " << num_groups << " scales");
  // The kernel's items (MN-major scales round the rows up to a band): one grid step covers them.
  const long long num_items = moe_kernels::scale_items(
      a.m, static_cast<unsigned>(num_groups),
      moe_kernels::scale_items_mn_major(a.sf_stride_m, static_cast<unsigned>(num_groups)));
  if (num_items == 0) return;
  static moe_jit::KernelMemo<std::array<int, 6>, moe_jit::IntArrayHash> memo;
  const std::array<int, 6> key = {static_cast<int>(c.in_dtype), c.n, c.gran_k, c.use_ue8m0, c.vec, a.device};
  const auto kernel = memo.get(key, [&] {
    const GeneratedKernel gen = per_token_code(c);
    return moe_jit::build(gen.name, gen.code, arch_checked(moe_jit::device_arch(a.device)));
  });

  const int threads_per_group = std::min(32, c.gran_k / c.vec);
  const long long groups_per_cta = kPerTokenThreads / threads_per_group;
  const long long ctas_needed = (num_items + groups_per_cta - 1) / groups_per_cta;
  const long long resident =
      static_cast<long long>(moe_jit::get_num_sms(a.device)) * kPerTokenMinCtasPerSm;

  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>(std::min(ctas_needed, resident));
  cfg.block_x = kPerTokenThreads;
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, reinterpret_cast<const void*>(a.x), a.x_row_stride,
                  reinterpret_cast<void*>(a.out), reinterpret_cast<void*>(a.sf),
                  static_cast<unsigned>(a.sf_stride_m), static_cast<unsigned>(a.sf_stride_k),
                  static_cast<unsigned>(a.m));
}

// ---------------------------------------------------------------------------------------------
// Per-block (128 x 128 tiles)

struct PerBlockConfig {
  DType in_dtype;
  int k;
  bool use_ue8m0;
  int vec;
};

inline PerBlockConfig per_block_config(DType in_dtype, int k, bool use_ue8m0, std::uint64_t x_ptr,
                                       long long x_batch_stride, long long x_row_stride) {
  MOE_HOST_ASSERT(k >= 1, "per_block_cast_to_fp8: k must be >= 1, got " << k);
  return {in_dtype, k, use_ue8m0, pick_vec(in_dtype, k, x_ptr, {x_batch_stride, x_row_stride})};
}

inline GeneratedKernel per_block_code(const PerBlockConfig& c) {
  const char* t = moe_apis::dtype_cuda_name(c.in_dtype);
  std::ostringstream os;
  os << "#include <moe_kernels/impls/quant.cuh>\n"
     << "template __global__ void moe_kernels::per_block_cast_to_fp8_kernel<" << t << ", " << c.k
     << ", " << (c.use_ue8m0 ? "true" : "false") << ", " << c.vec << ", " << kPerBlockThreads
     << ">(const " << t << "*, long long, long long, unsigned char*, float*, unsigned);\n";
  return {"per_block_cast_to_fp8", os.str()};
}

struct PerBlockArgs {
  std::uint64_t x;
  long long x_batch_stride;
  long long x_row_stride;
  std::uint64_t out;
  std::uint64_t sf;
  long long batch;
  long long n;
  int device;
  std::uint64_t stream;
};

inline void per_block_launch(const PerBlockConfig& c, const PerBlockArgs& a) {
  const long long tiles_n = (a.n + kBlock - 1) / kBlock;
  MOE_HOST_ASSERT(tiles_n <= 65535, "per_block_cast_to_fp8: n = " << a.n
                                        << " gives more than 65535 row tiles of 128");
  MOE_HOST_ASSERT(a.batch <= 65535, "per_block_cast_to_fp8: batch = " << a.batch
                                        << " exceeds 65535");
  if (tiles_n == 0 || a.batch == 0) return;
  static moe_jit::KernelMemo<std::array<int, 5>, moe_jit::IntArrayHash> memo;
  const std::array<int, 5> key = {static_cast<int>(c.in_dtype), c.k, c.use_ue8m0, c.vec, a.device};
  const auto kernel = memo.get(key, [&] {
    const GeneratedKernel gen = per_block_code(c);
    return moe_jit::build(gen.name, gen.code, arch_checked(moe_jit::device_arch(a.device)));
  });

  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>((c.k + kBlock - 1) / kBlock);
  cfg.grid_y = static_cast<unsigned>(tiles_n);
  cfg.grid_z = static_cast<unsigned>(a.batch);
  cfg.block_x = kPerBlockThreads;
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, reinterpret_cast<const void*>(a.x), a.x_batch_stride,
                  a.x_row_stride, reinterpret_cast<void*>(a.out), reinterpret_cast<void*>(a.sf),
                  static_cast<unsigned>(a.n));
}

// ---------------------------------------------------------------------------------------------
// FP4 weights -> E4M3 weights with 128 x 128 block scales (impls/cast_fp4_to_fp8.cuh)

constexpr int kCastFp4Threads = kBlock * kBlock / 32;  // one per (row, 1x32 group) of a block

inline GeneratedKernel cast_fp4_to_fp8_blocks_code() {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/cast_fp4_to_fp8.cuh>\n"
     << "template __global__ void moe_kernels::cast_fp4_to_fp8_blocks_kernel<" << kBlock
     << ">(const uint8_t*, unsigned long long, unsigned long long, const uint8_t*, unsigned long long, "
        "unsigned long long, uint8_t*, float*, uint32_t, uint32_t);\n";
  return {"cast_fp4_to_fp8_blocks", os.str()};
}

struct CastFp4Args {
  std::uint64_t packed;
  long long packed_stride_g;  // bytes
  long long packed_stride_n;
  std::uint64_t sfb;
  long long sfb_stride_g;  // bytes
  long long sfb_stride_n;
  std::uint64_t out;
  std::uint64_t sf;
  long long groups;
  long long n;
  long long k;
  int device;
  std::uint64_t stream;
};

inline void cast_fp4_to_fp8_blocks_launch(const CastFp4Args& a) {
  const long long tiles_n = (a.n + kBlock - 1) / kBlock;
  MOE_HOST_ASSERT(a.k % kBlock == 0 && a.k / kBlock <= INT_MAX && tiles_n <= 65535 && a.groups <= 65535,
                  "cast_fp4_to_fp8_blocks: k must be a multiple of " << kBlock
                      << ", ceil(n / 128) and groups at most 65535, got groups = " << a.groups << ", n = " << a.n
                      << ", k = " << a.k);
  if (a.groups == 0 || a.n == 0 || a.k == 0) return;
  static moe_jit::KernelMemo<std::array<int, 1>, moe_jit::IntArrayHash> memo;
  const auto kernel = memo.get({a.device}, [&] {
    const GeneratedKernel gen = cast_fp4_to_fp8_blocks_code();
    return moe_jit::build(gen.name, gen.code, arch_checked(moe_jit::device_arch(a.device)));
  });
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>(a.k / kBlock);
  cfg.grid_y = static_cast<unsigned>(tiles_n);
  cfg.grid_z = static_cast<unsigned>(a.groups);
  cfg.block_x = kCastFp4Threads;
  cfg.stream = a.stream;
  cfg.device = a.device;
  moe_jit::launch(*kernel, cfg, reinterpret_cast<const void*>(a.packed),
                  static_cast<unsigned long long>(a.packed_stride_g), static_cast<unsigned long long>(a.packed_stride_n),
                  reinterpret_cast<const void*>(a.sfb), static_cast<unsigned long long>(a.sfb_stride_g),
                  static_cast<unsigned long long>(a.sfb_stride_n), reinterpret_cast<void*>(a.out),
                  reinterpret_cast<void*>(a.sf), static_cast<std::uint32_t>(a.n), static_cast<std::uint32_t>(a.k));
}

}  // namespace moe_launchers::quant
