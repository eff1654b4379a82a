#pragma once
// The FP8 GEMM's thread and stage layout, shared by the kernel (impls/sm90_fp8_gemm.cuh) and its
// host launcher (launchers/sm90_fp8_gemm.hpp), so the launch and the kernel cannot disagree: no
// includes and nothing CUDA-only, for NVRTC and the host compiler alike.

namespace moe_kernels {

// Block M 64 runs one math warpgroup; 128 two; 256 the same two, in two waves of 128 rows.
constexpr unsigned fp8_gemm_math_warpgroups(unsigned block_m) { return block_m == 64 ? 1u : 2u; }

// The math warpgroups and one producer warpgroup.
constexpr unsigned fp8_gemm_threads(unsigned block_m) { return (fp8_gemm_math_warpgroups(block_m) + 1) * 128; }

// How a stage's scales arrive.
//   kScaleGather: scale warps gather them with 4-byte cp.async copies, any strides. A K-major A
//     scale costs a 32-byte sector and a shared-memory wavefront per row and K block: at 256-row
//     tiles 256 wavefronts per K block beside the wgmmas' 768 operand reads (ncu, 4096 x 4096 x
//     7168: 81% of the shared-memory pipe against DeepGEMM's 68%, and 9% less tensor-pipe use).
//   kScaleTmaMnMajor / kScaleTmaKMajor: the TMA warp loads them with the tiles. A scales MN-major
//     (a K block's rows contiguous): one box of block_m floats; K-major: a box of 4 K blocks by
//     block_m rows (16 bytes, TMA's narrowest, starting on a multiple of 4 K blocks: the unit
//     faults on innermost coordinates off 16 bytes), of which the stage uses the K block's
//     column. B scales (K-major): a box of 4 K blocks by the tile's two 128-column blocks, alike.
//     The launcher picks these for dense and contiguous GEMMs (launchers/sm90_fp8_gemm.hpp).
enum : unsigned { kScaleGather = 0, kScaleTmaMnMajor = 1, kScaleTmaKMajor = 2 };

// Floats between consecutive rows' A scales in a stage.
constexpr unsigned fp8_gemm_sfa_row_floats(unsigned scale_load) { return scale_load == kScaleTmaKMajor ? 4u : 1u; }

// The stage's B scales: the first 128-column block's at fp8_gemm_sfb_offset, the second's
// fp8_gemm_sfb_step floats after it.
constexpr unsigned fp8_gemm_sfb_offset(unsigned block_m, unsigned scale_load) {
  return block_m * fp8_gemm_sfa_row_floats(scale_load);
}
constexpr unsigned fp8_gemm_sfb_step(unsigned scale_load) { return scale_load == kScaleGather ? 1u : 4u; }

// Floats of a stage's scales: gathered, block_m + 2 padded to 16 bytes; by TMA, whose boxes land
// on 128-byte boundaries, the A box then a 128-byte slot for B's 2 x 4.
constexpr unsigned fp8_gemm_sf_floats(unsigned block_m, unsigned scale_load) {
  return scale_load == kScaleGather ? block_m + 4 : fp8_gemm_sfb_offset(block_m, scale_load) + 32;
}

// Bytes the TMA scale boxes add to a stage's transaction count.
constexpr unsigned fp8_gemm_sf_tma_bytes(unsigned block_m, unsigned scale_load) {
  return scale_load == kScaleGather ? 0u : fp8_gemm_sfb_offset(block_m, scale_load) * 4 + 2 * 4 * 4;
}

// One pipeline stage: the A and B tiles of a 128-deep K block, then the scales.
constexpr unsigned fp8_gemm_stage_bytes(unsigned block_m, unsigned block_n, unsigned scale_load = kScaleGather) {
  return (block_m + block_n) * 128 + fp8_gemm_sf_floats(block_m, scale_load) * 4;
}

}  // namespace moe_kernels
