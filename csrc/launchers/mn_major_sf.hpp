#pragma once
// MN-major TMA-aligned scale factors (impls/mn_major_sf.cuh): code generation and launch. Used by
// kernels.get_mn_major_tma_aligned_tensor and by the dense FP8 GEMM, which copies K-major A scales
// into its workspace in this layout before its wide-tile kernels (launchers/sm90_fp8_gemm.hpp).
#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"

namespace moe_launchers::mn_major_sf {

constexpr const char* kFn = "mn_major_sf";
constexpr unsigned kTile = 32;      // impls/mn_major_sf.cuh's kMnMajorSfTile
constexpr unsigned kThreads = 256;  // its kMnMajorSfThreads

// The kernel asserts at compile time that its tile and block are the grid's and block's here.
inline std::string code() {
  return "#include <moe_kernels/impls/mn_major_sf.cuh>\n"
         "static_assert(moe_kernels::kMnMajorSfTile == " + std::to_string(kTile) +
         " && moe_kernels::kMnMajorSfThreads == " + std::to_string(kThreads) +
         ", \"the launcher's tile or block differs from the kernel's\");\n";
}

// The destination's stride between K blocks: rows rounded up to 16 bytes of floats.
inline long long aligned_rows(long long rows) { return (rows + 3) / 4 * 4; }

struct Args {
  std::uint64_t src;
  long long groups, rows, k_blocks;
  long long src_stride_m, src_stride_k, src_group_stride;  // elements
  std::uint64_t dst;
  long long dst_stride, dst_group_stride;  // elements
  int device;
  std::uint64_t stream;
  bool pdl = true;
};

// The compiled kernel on a device: from the memo, compiled (or loaded from the disk cache) on the
// first call.
inline std::shared_ptr<const moe_jit::CompiledKernel> kernel_of(int device) {
  static moe_jit::KernelMemo<std::array<int, 1>, moe_jit::IntArrayHash> memo;
  return memo.get({device}, [&] { return moe_jit::build(kFn, code(), moe_jit::device_arch(device)); });
}

// `kernel`: kernel_of(a.device) where the caller holds it already (else looked up here).
inline void launch(const Args& a, std::shared_ptr<const moe_jit::CompiledKernel> kernel = nullptr) {
  MOE_HOST_ASSERT(a.groups >= 0 && a.rows >= 0 && a.k_blocks >= 0 && a.groups <= 65535,
                  kFn << ": groups (at most 65535), rows and k_blocks must be >= 0, got " << a.groups << ", "
                      << a.rows << ", " << a.k_blocks);
  MOE_HOST_ASSERT(a.rows < (1ll << 31) && a.k_blocks <= 65535ll * kTile,
                  kFn << ": rows must be below 2^31 and k_blocks at most " << 65535ll * kTile << ", got " << a.rows
                      << ", " << a.k_blocks);
  MOE_HOST_ASSERT(a.src_stride_m >= 0 && a.src_stride_k >= 0 && a.src_group_stride >= 0,
                  kFn << ": source strides must be >= 0");
  MOE_HOST_ASSERT(a.dst % 16 == 0 && a.dst_stride >= aligned_rows(a.rows) && a.dst_stride % 4 == 0 &&
                      a.dst_group_stride >= a.dst_stride * a.k_blocks,
                  kFn << ": the destination must be 16-byte aligned with a K-block stride of at least "
                      << aligned_rows(a.rows) << " floats (a multiple of 4) and non-overlapping groups");
  if (a.groups == 0 || a.rows == 0 || a.k_blocks == 0) return;
  if (!kernel) kernel = kernel_of(a.device);
  moe_jit::LaunchConfig cfg;
  cfg.grid_x = static_cast<unsigned>((a.rows + kTile - 1) / kTile);
  cfg.grid_y = static_cast<unsigned>((a.k_blocks + kTile - 1) / kTile);
  cfg.grid_z = static_cast<unsigned>(a.groups);
  cfg.block_x = kThreads;
  cfg.stream = a.stream;
  cfg.device = a.device;
  cfg.pdl = a.pdl;
  moe_jit::launch(*kernel, cfg, reinterpret_cast<const float*>(a.src), static_cast<std::uint32_t>(a.rows),
                  static_cast<std::uint32_t>(a.k_blocks), static_cast<std::uint64_t>(a.src_stride_m),
                  static_cast<std::uint64_t>(a.src_stride_k), static_cast<std::uint64_t>(a.src_group_stride),
                  reinterpret_cast<float*>(a.dst), static_cast<std::uint64_t>(a.dst_stride),
                  static_cast<std::uint64_t>(a.dst_group_stride));
}

}  // namespace moe_launchers::mn_major_sf
