#pragma once
// Persistent tile scheduler: CTA b takes tiles b, b + grid, b + 2 grid, ... Tiles are ordered in
// bands of kGroupN n-blocks with the m-block varying slowest inside a band, so the tiles that run
// at the same time share a few m-blocks of A and a few n-blocks of B in L2.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

template <uint32_t kBlockM, uint32_t kBlockN, uint32_t kGroupN>
struct TileScheduler {
  uint32_t num_m_blocks;
  uint32_t num_n_blocks;
  uint32_t num_tiles;
  uint32_t next_tile;

  __device__ __forceinline__ TileScheduler(uint32_t m, uint32_t n)
      : num_m_blocks((m + kBlockM - 1) / kBlockM),
        num_n_blocks((n + kBlockN - 1) / kBlockN),
        num_tiles(num_m_blocks * num_n_blocks),
        next_tile(blockIdx.x) {}

  __device__ __forceinline__ bool next(uint32_t& m_block, uint32_t& n_block) {
    if (next_tile >= num_tiles) return false;
    const uint32_t tile = next_tile;
    next_tile += gridDim.x;
    const uint32_t band_size = kGroupN * num_m_blocks;
    const uint32_t band = tile / band_size;
    const uint32_t first_n = band * kGroupN;
    const uint32_t width = min(kGroupN, num_n_blocks - first_n);
    const uint32_t in_band = tile - band * band_size;
    m_block = in_band / width;
    n_block = first_n + in_band % width;
    return true;
  }
};

}  // namespace moe_kernels
