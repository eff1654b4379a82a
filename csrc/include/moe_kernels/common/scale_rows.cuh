#pragma once
// A scale warp's rows of a tile (the FP8 GEMMs' scale producers, which gather one scale per row per
// K block with cp.async): lane l holds rows first + i * 32 + l, i < kNum, as 32-bit offsets into the
// scales (row x stride; the launchers check that every offset fits 32 bits) computed once per tile,
// so a K block costs one add per copy, and a bit per row that is inside the problem (rows past it
// read nothing: their copies are zero-filled).

namespace moe_kernels {

template <uint32_t kNum>
struct LaneScaleRows {
  static_assert(kNum <= 32, "one validity bit per row");
  uint32_t offset[kNum];
  uint32_t valid = 0;

  __device__ __forceinline__ LaneScaleRows(uint32_t first, uint32_t end, uint32_t stride, uint32_t lane) {
#pragma unroll
    for (uint32_t i = 0; i < kNum; ++i) {
      const uint32_t row = first + i * 32 + lane;
      const bool inside = row < end;
      offset[i] = inside ? row * stride : 0;
      valid |= inside ? 1u << i : 0u;
    }
  }

  // Bytes the i-th row's 4-byte copy reads: 4, or 0 past the problem.
  __device__ __forceinline__ uint32_t bytes(uint32_t i) const { return (valid >> i) & 1 ? 4 : 0; }
};

}  // namespace moe_kernels
