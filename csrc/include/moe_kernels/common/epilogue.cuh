#pragma once
// Epilogue: FP32 accumulators (wgmma fragment layout, see scale_promotion.cuh) -> optional
// residual C added in FP32 -> BF16 tile in shared memory, which warp 0 then stores with TMA (the
// TMA unit clips rows and columns outside D).

#include <cuda_bf16.h>
#include <moe_kernels/common/masked_store.h>
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

enum class ResidualType : int { kNone = 0, kBFloat16 = 1, kFloat32 = 2 };

template <ResidualType kType>
__device__ __forceinline__ float load_residual(const void* c, uint64_t offset) {
  if constexpr (kType == ResidualType::kBFloat16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(c)[offset]);
  } else {
    return static_cast<const float*>(c)[offset];
  }
}

// The tile of D in shared memory is split into column atoms of kAtomN elements, each a
// [block_m][kAtomN] row-major box that one TMA store writes. With kSwizzleBytes = 2 * kAtomN in
// {32, 64, 128} the 16-byte chunks of each row are XOR-swizzled the way the TMA unit reads them
// back, so the 8 rows a warp writes at once land in different banks; kSwizzleBytes = 0 keeps
// plain rows (kAtomN = kBlockN).
template <uint32_t kBlockN, uint32_t kSwizzleBytes>
struct EpilogueLayout {
  static constexpr uint32_t kAtomN = kSwizzleBytes == 0 ? kBlockN : kSwizzleBytes / 2;
  static constexpr uint32_t kNumAtoms = kBlockN / kAtomN;
  static_assert(kBlockN % kAtomN == 0, "block N must be a whole number of swizzle atoms");

  // Byte offset of element (row, col) of a tile with block_m rows.
  __device__ __forceinline__ static uint32_t offset(uint32_t block_m, uint32_t row, uint32_t col) {
    const uint32_t atom = col / kAtomN;
    uint32_t in_atom = row * (kAtomN * 2) + (col % kAtomN) * 2;
    if constexpr (kSwizzleBytes != 0) {
      // Swizzle<log2(kSwizzleBytes / 16), 4, 3>: chunk bits [4, ...) ^= bits [7, ...).
      constexpr uint32_t kMask = kSwizzleBytes / 16 - 1;
      in_atom ^= ((in_atom >> 7) & kMask) << 4;
    }
    return atom * block_m * (kAtomN * 2) + in_atom;
  }
};

// Writes one warpgroup's 64 x kBlockN fragment; `tile_row0` is this thread's first row in the
// tile, (global_row0, global_col0) the tile's origin in D, for the residual's bounds and address.
// stmatrix writes each warp's 16 rows x 16 columns in one instruction (x4: two 8-column chunks, both
// halves of 8 rows), a quarter of the 32-bit stores the fragment took, and its 16-byte rows hit 8
// distinct bank groups under the 32-, 64- and 128-byte swizzles (plain rows, kSwizzleBytes = 0, may
// conflict); a tile with an odd number of 8-column chunks ends on x2.
template <uint32_t kBlockM, uint32_t kBlockN, uint32_t kSwizzleBytes, ResidualType kResidual>
__device__ __forceinline__ void store_fragment_to_smem(uint8_t* smem_d, const float* final_acc, uint32_t tile_row0,
                                                       uint32_t lane, const void* c, uint32_t ldc,
                                                       uint32_t global_row0, uint32_t global_col0, uint32_t m,
                                                       uint32_t n) {
  using Layout = EpilogueLayout<kBlockN, kSwizzleBytes>;
  constexpr uint32_t kChunks = kBlockN / 8;
  // Chunk j's bf16 pair of row tile_row0 + half * 8, the residual added in FP32.
  const auto pack = [&](uint32_t j, uint32_t half) {
    float v0 = final_acc[j * 4 + half * 2 + 0];
    float v1 = final_acc[j * 4 + half * 2 + 1];
    if constexpr (kResidual != ResidualType::kNone) {
      const uint32_t grow = global_row0 + tile_row0 + half * 8, gcol = global_col0 + j * 8 + (lane % 4) * 2;
      // n is a multiple of 8, so both columns of the pair are inside D or both outside.
      if (grow < m && gcol < n) {
        const uint64_t offset = uint64_t(grow) * ldc + gcol;
        v0 += load_residual<kResidual>(c, offset);
        v1 += load_residual<kResidual>(c, offset + 1);
      }
    }
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v0, v1);
    return *reinterpret_cast<const uint32_t*>(&pair);
  };
  // Lane l addresses row l % 8 of matrix l / 8: matrices 0 / 1 are the warp's rows 0-7 / 8-15 of the
  // first chunk, 2 / 3 those of the second.
  const uint32_t matrix = lane / 8;
  const uint32_t row = tile_row0 - lane / 4 + (matrix % 2) * 8 + lane % 8;
  const uint32_t base = sm90::smem_addr(smem_d);
#pragma unroll
  for (uint32_t j = 0; j + 1 < kChunks; j += 2) {
    sm90::stmatrix_x4(base + Layout::offset(kBlockM, row, (j + matrix / 2) * 8), pack(j, 0), pack(j, 1),
                      pack(j + 1, 0), pack(j + 1, 1));
  }
  if constexpr (kChunks % 2 == 1) {
    sm90::stmatrix_x2(base + Layout::offset(kBlockM, row, (kChunks - 1) * 8), pack(kChunks - 1, 0),
                      pack(kChunks - 1, 1));
  }
}

// The swapped GEMMs' fragment (wgmma rows = D's columns, wgmma N = D's rows): a warpgroup's 64
// columns x kBlockM rows of a [kBlockM][kBlockN] tile; `tile_col0` is this thread's first column.
// stmatrix .trans writes each 8 x 8 matrix as 8 rows of D holding 8 columns (16 bytes), so the
// tile takes the layout (and the swizzle) of store_fragment_to_smem's.
template <uint32_t kBlockM, uint32_t kBlockN, uint32_t kSwizzleBytes>
__device__ __forceinline__ void store_transposed_fragment_to_smem(uint8_t* smem_d, const float* final_acc,
                                                                  uint32_t tile_col0, uint32_t lane) {
  using Layout = EpilogueLayout<kBlockN, kSwizzleBytes>;
  constexpr uint32_t kChunks = kBlockM / 8;
  const auto pack = [&](uint32_t j, uint32_t half) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(final_acc[j * 4 + half * 2], final_acc[j * 4 + half * 2 + 1]);
    return *reinterpret_cast<const uint32_t*>(&pair);
  };
  // Lane l addresses row (chunk j + matrix / 2) * 8 + l % 8 at the warp's columns + (matrix % 2) * 8:
  // matrices 0 / 1 are columns 0-7 / 8-15 of rows chunk j, 2 / 3 those of chunk j + 1.
  const uint32_t matrix = lane / 8;
  const uint32_t col = tile_col0 - lane / 4 + (matrix % 2) * 8;
  const uint32_t base = sm90::smem_addr(smem_d);
#pragma unroll
  for (uint32_t j = 0; j + 1 < kChunks; j += 2) {
    sm90::stmatrix_x4_trans(base + Layout::offset(kBlockM, (j + matrix / 2) * 8 + lane % 8, col), pack(j, 0),
                            pack(j, 1), pack(j + 1, 0), pack(j + 1, 1));
  }
  if constexpr (kChunks % 2 == 1) {
    sm90::stmatrix_x2_trans(base + Layout::offset(kBlockM, (kChunks - 1) * 8 + lane % 8, col), pack(kChunks - 1, 0),
                            pack(kChunks - 1, 1));
  }
}

// A tile's whole epilogue on the math warpgroups (kNumMathThreads threads, named barrier 1): wait
// until the previous tile's TMA store has read shared memory, write every warpgroup's fragment,
// then warp 0 stores each column atom with TMA at (column, store_row) of a 2-D D (lane 0), or at
// (column, store_row, group) of a 3-D one (masked groups) in boxes of kMaskedStoreRows rows, those
// below store_rows (the tile's rows under its group's masked_m) only, one box per lane: a 128 x 160
// tile has 80 boxes, which one thread issued one after the other while its warpgroup's next wgmmas
// waited. Each lane commits and later waits for its own stores; the caller's warp 0 waits for the
// last ones (their shared-memory reads at least) before the CTA exits. A tile taller than its
// warpgroups' 64-row fragments comes in kNumWaves waves of kWaveRows rows, the fragments of wave w
// at final_acc + w * kBlockN / 2.
// kWgStore (2-D stores): each math warpgroup waits for, writes and stores its own 64-row stripes
// alone (named barrier kWgStoreBarrier + warpgroup, 128 threads; its warp 0 issues boxes of 64 rows,
// map_d's box then), so one warpgroup's epilogue may run under the other's wgmmas instead of both
// meeting at a barrier with the tensor cores idle.
// kTransposed: the swapped GEMMs' accumulators (store_transposed_fragment_to_smem; tile_row0 is the
// thread's first column), without residual, waves or per-warpgroup stores.
constexpr uint32_t kWgStoreBarrier = 4;  // ids 0-3: __syncthreads, the tile epilogue, MathTurns

// The threads that issue store_tile's TMA stores, and so must wait for their shared-memory reads
// before the CTA exits: warp 0 of each math warpgroup (kWgStore), else the CTA's warp 0.
template <bool kWgStore>
__device__ __forceinline__ bool store_tile_issuer() {
  return kWgStore ? threadIdx.x % 128 < 32 : threadIdx.x < 32;
}
template <uint32_t kBlockM, uint32_t kBlockN, uint32_t kSwizzleBytes, ResidualType kResidual, bool k3d,
          uint32_t kNumMathThreads, uint32_t kNumWaves = 1, uint32_t kWaveRows = kBlockM, bool kWgStore = false,
          bool kTransposed = false>
__device__ __forceinline__ void store_tile(const TmaDescriptor* map_d, uint8_t* smem_d, const float* final_acc,
                                           uint32_t tile_row0, uint32_t lane, const void* c, uint32_t ldc,
                                           uint32_t global_row0, uint32_t global_col0, uint32_t m, uint32_t n,
                                           uint32_t store_row, uint32_t group, uint32_t store_rows = kBlockM) {
  using Layout = EpilogueLayout<kBlockN, kSwizzleBytes>;
  static_assert(!kWgStore || (!k3d && kNumMathThreads == 256), "per-warpgroup stores: 2-D, two math warpgroups");
  static_assert(!kTransposed || (kResidual == ResidualType::kNone && kNumWaves == 1 && !kWgStore),
                "transposed tiles: no residual, one wave, one store for the tile");
  const uint32_t wg = threadIdx.x / 128;
  const bool issuer = store_tile_issuer<kWgStore>();
  const uint32_t barrier = kWgStore ? kWgStoreBarrier + wg : 1;
  constexpr uint32_t kBarrierThreads = kWgStore ? 128 : kNumMathThreads;
  if (issuer) sm90::tma_store_wait_read<0>();
  sm90::named_barrier_sync(barrier, kBarrierThreads);
  if constexpr (kTransposed) {
    store_transposed_fragment_to_smem<kBlockM, kBlockN, kSwizzleBytes>(smem_d, final_acc, tile_row0, lane);
  } else {
#pragma unroll
    for (uint32_t w = 0; w < kNumWaves; ++w) {
      store_fragment_to_smem<kBlockM, kBlockN, kSwizzleBytes, kResidual>(smem_d, final_acc + w * (kBlockN / 2),
                                                                         tile_row0 + w * kWaveRows, lane, c, ldc,
                                                                         global_row0, global_col0, m, n);
    }
  }
  sm90::fence_proxy_async_shared();
  sm90::named_barrier_sync(barrier, kBarrierThreads);
  if (issuer) {
#pragma unroll
    for (uint32_t atom = 0; atom < Layout::kNumAtoms; ++atom) {
      const uint8_t* src = smem_d + atom * kBlockM * Layout::kAtomN * 2;
      const uint32_t col = global_col0 + atom * Layout::kAtomN;
      if constexpr (kWgStore) {
#pragma unroll
        for (uint32_t w = 0; w < kNumWaves; ++w) {
          const uint32_t row = w * kWaveRows + wg * 64;
          if (lane == 0 && global_row0 + row < m) {
            sm90::tma_store_2d(map_d, src + row * Layout::kAtomN * 2, col, store_row + row);
          }
        }
      } else if constexpr (k3d) {
        static_assert(kBlockM % kMaskedStoreRows == 0, "masked tiles are stored in whole boxes");
        static_assert(kBlockM <= 32 * kMaskedStoreRows, "one box per lane");
        const uint32_t row = lane * kMaskedStoreRows;
        if (row < store_rows) sm90::tma_store_3d(map_d, src + row * Layout::kAtomN * 2, col, store_row + row, group);
      } else if (lane == 0) {
        sm90::tma_store_2d(map_d, src, col, store_row);
      }
    }
    sm90::tma_store_commit();
  }
}

}  // namespace moe_kernels
