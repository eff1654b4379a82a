#pragma once
// The FP8 GEMM's thread and stage layout, shared by the kernel (impls/sm90_fp8_gemm.cuh) and its
// host launcher (launchers/sm90_fp8_gemm.hpp), so the launch and the kernel cannot disagree: no
// includes and nothing CUDA-only, for NVRTC and the host compiler alike.

namespace moe_kernels {

// Block M 64 runs one math warpgroup; 128 two; 256 the same two, in two waves of 128 rows.
constexpr unsigned fp8_gemm_math_warpgroups(unsigned block_m) { return block_m == 64 ? 1u : 2u; }

// The math warpgroups and one producer warpgroup.
constexpr unsigned fp8_gemm_threads(unsigned block_m) { return (fp8_gemm_math_warpgroups(block_m) + 1) * 128; }

// One pipeline stage: the A and B tiles of a 128-deep K block, then block_m + 4 floats of scales (A's
// rows, B's two 128-column blocks, padded to 16 bytes).
constexpr unsigned fp8_gemm_stage_bytes(unsigned block_m, unsigned block_n) {
  return (block_m + block_n) * 128 + (block_m + 4) * 4;
}

}  // namespace moe_kernels
