#pragma once
// The masked GEMMs' D stores, shared by the epilogue (common/epilogue.cuh) and the launchers' D
// tensor maps (launchers/gemm_common.hpp): no includes, for NVRTC and the host compiler alike.

namespace moe_kernels {

// A masked group's tile is stored in boxes of this many rows, only those holding rows below its
// masked_m. A whole 64-row box for a decode tile of 4 tokens wrote 16x the bytes that matter:
// at 32 experts x 7168 x 2048, 29 MB of D beside 470 MB of weights read. 8 rows of any swizzled
// tile span one whole swizzle period (8 x 32, 64 or 128 bytes), so a box may start at any of them.
constexpr unsigned kMaskedStoreRows = 8;

}  // namespace moe_kernels
