#pragma once
// SwiGLU x weight + FP8 quantization (impls/swiglu_quant.cuh): code generation, memo and launch.
#include <algorithm>
#include <array>
#include <cstdint>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"
#include "moe_kernels/common/scale_items.h"

namespace moe_launchers::swiglu_quant {

constexpr int kThreads = 256;
// Memory-bound: enough resident CTAs per SM to keep loads in flight, as the quantizers do.
constexpr int kCtasPerSm = 8;
constexpr const char* kFn = "swiglu_quant_fp8";

struct GeneratedKernel {
  std::string name;
  std::string code;
};

inline void check_inter(int inter) {
  MOE_HOST_ASSERT(inter >= 128 && inter % 128 == 0, kFn << ": the intermediate size (half of h's columns) must be a "
                                                         "positive multiple of 128, got " << inter);
}

inline GeneratedKernel generate(int inter) {
  check_inter(inter);
  std::ostringstream os;
  os << "#include <moe_kernels/impls/swiglu_quant.cuh>\n"
     << "template __global__ void moe_kernels::swiglu_quant_kernel<" << inter << ", " << kThreads
     << ">(const __nv_bfloat16*, const float*, const int*, unsigned, unsigned, unsigned char*, float*, unsigned, unsigned);\n";
  return {"swiglu_quant_kernel", os.str()};
}

// h bf16 [M, 2I] (contiguous, 16-byte aligned), weights float32 [M], masked_m int32 [M / rows] or 0,
// out [M, I] E4M3 bytes, sf float32 [M, I / 128] with strides (sf_stride_m, sf_stride_k) in elements.
inline void launch(std::uint64_t h, std::uint64_t weights, std::uint64_t masked_m, long long rows_per_group,
                   long long num_rows, int inter, std::uint64_t out, std::uint64_t sf, long long sf_stride_m,
                   long long sf_stride_k, int device, std::uint64_t stream) {
  check_inter(inter);
  MOE_HOST_ASSERT(num_rows >= 0 && num_rows < (1ll << 31), kFn << ": rows must be in [0, 2^31), got " << num_rows);
  MOE_HOST_ASSERT(masked_m == 0 || (rows_per_group >= 1 && num_rows % rows_per_group == 0),
                  kFn << ": the masked layout needs rows per group >= 1 dividing the rows, got " << rows_per_group
                      << " and " << num_rows);
  MOE_HOST_ASSERT(h % 16 == 0 && out % 8 == 0, kFn << ": h must be 16-byte and out 8-byte aligned");
  const long long groups = inter / 128;
  MOE_HOST_ASSERT(moe_kernels::scale_strides_disjoint(num_rows, groups, sf_stride_m, sf_stride_k),
                  kFn << ": sf strides (" << sf_stride_m << ", " << sf_stride_k << ") overlap for " << num_rows
                      << " x " << groups << " scales");
  if (num_rows == 0) return;
  static moe_jit::KernelMemo<std::array<int, 2>, moe_jit::IntArrayHash> memo;
  const auto kernel = memo.get({inter, device}, [&] {
    const GeneratedKernel gen = generate(inter);
    return moe_jit::build(gen.name, gen.code, moe_jit::device_arch(device));
  });
  // The kernel's items (MN-major scales round the rows up to a band): one grid step covers them.
  const unsigned num_groups = static_cast<unsigned>(groups);
  const long long items =
      moe_kernels::scale_items(num_rows, num_groups, moe_kernels::scale_items_mn_major(sf_stride_m, num_groups));
  const long long items_per_cta = kThreads / 16;
  const long long resident = static_cast<long long>(moe_jit::get_num_sms(device)) * kCtasPerSm;
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>(std::max(1ll, std::min((items + items_per_cta - 1) / items_per_cta, resident)));
  cfg.block_x = kThreads;
  cfg.stream = stream;
  cfg.device = device;
  moe_jit::launch(*kernel, cfg, reinterpret_cast<const void*>(h), reinterpret_cast<const float*>(weights),
                  reinterpret_cast<const int*>(masked_m), static_cast<unsigned>(masked_m ? rows_per_group : 1),
                  static_cast<unsigned>(num_rows), reinterpret_cast<unsigned char*>(out),
                  reinterpret_cast<float*>(sf), static_cast<unsigned>(sf_stride_m), static_cast<unsigned>(sf_stride_k));
}

}  // namespace moe_launchers::swiglu_quant
