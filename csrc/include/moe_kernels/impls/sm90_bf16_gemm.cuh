#pragma once
// BF16 GEMMs for SM90, FP32 accumulation: dense D[M, N] (bf16) = A[M, K] @ B[N, K]^T (+ C), and the
// m-grouped forms of the MoE experts (common/scheduler.cuh's GEMM types) on B [G, N, K] stacked as
// [G x N, K]: contiguous (A [M, K], each row block's group from grouped_layout = m_indices, padding
// blocks skipped) and masked (A [G x max_m, K], grouped_layout = masked_m; D stored through a 3-D map
// so rows from a group's count, rounded up to kMaskedStoreRows, stay untouched).
//
// Roles (one CTA per SM, persistent over tiles):
//   warpgroups [0, kNumMathWG): math — 4 x wgmma 64xBNx16 per 64-deep K block, accumulating in
//                               registers across the whole K (no promotion: BF16 products are
//                               exact in the FP32 accumulator), one K block kept in flight;
//   last warpgroup, warp 0:     TMA producer for the A and B tiles.
// The pipeline ring, scheduler and epilogue are the FP8 GEMM's.

#include <cuda_bf16.h>
#include <moe_kernels/common/epilogue.cuh>
#include <moe_kernels/common/pipeline.cuh>
#include <moe_kernels/common/scheduler.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>
#include <moe_kernels/common/sm90_wgmma.cuh>

namespace moe_kernels {

template <uint32_t kBlockM, uint32_t kBlockN, uint32_t kNumStages>
struct Bf16GemmSmem {
  static constexpr uint32_t kBlockK = 64;  // 128-byte rows of bf16
  static constexpr uint32_t kD = kBlockM * kBlockN * 2;
  static constexpr uint32_t kA = kBlockM * kBlockK * 2;
  static constexpr uint32_t kB = kBlockN * kBlockK * 2;
  static constexpr uint32_t kOffsetA = kD;
  static constexpr uint32_t kOffsetB = kOffsetA + kNumStages * kA;
  static constexpr uint32_t kOffsetBarriers = kOffsetB + kNumStages * kB;
  static constexpr uint32_t kTotal = kOffsetBarriers + 2 * kNumStages * 8;
  static_assert(kD % 1024 == 0 && kA % 1024 == 0 && kB % 1024 == 0, "stage buffers must stay 1024-byte aligned");
};

// shape_m: M (kNormal, kGroupedContiguous) or max_m (kGroupedMasked); grouped_layout and num_groups as
// TileScheduler takes them (unused by kNormal).
template <uint32_t kShapeM, uint32_t kShapeN, uint32_t kShapeK, uint32_t kBlockM, uint32_t kBlockN,
          uint32_t kNumStages, uint32_t kGroupN, int kResidual, uint32_t kSwizzleDBytes, int kGemmType = 0>
__global__ void __launch_bounds__((kBlockM / 64 + 1) * 128, 1)
    sm90_bf16_gemm_nt(uint32_t shape_m, const void* c, uint32_t ldc, const int* grouped_layout, uint32_t num_groups,
                      const __grid_constant__ TmaDescriptor map_a, const __grid_constant__ TmaDescriptor map_b,
                      const __grid_constant__ TmaDescriptor map_d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Smem = Bf16GemmSmem<kBlockM, kBlockN, kNumStages>;
  using Wgmma = sm90::Bf16Wgmma<kBlockN>;
  constexpr uint32_t kBlockK = Smem::kBlockK;
  constexpr uint32_t kNumMathWG = kBlockM / 64;
  constexpr uint32_t kNumMathThreads = kNumMathWG * 128;
  constexpr uint32_t kNumKBlocks = kShapeK / kBlockK;
  // Register budgets: the producer needs few; the math warpgroups hold one accumulator set.
  constexpr uint32_t kProducerRegisters = 40;
  constexpr uint32_t kMathRegisters = kNumMathWG == 1 ? 240 : 232;
  static_assert(128 * (kProducerRegisters + kNumMathWG * kMathRegisters) <=
                    sm90::launch_registers<(kNumMathWG + 1) * 128>(),
                "register budgets exceed the launch allocation: setmaxnreg.inc would hang");
  static_assert(kShapeK % kBlockK == 0, "K must be a multiple of 64");
  static_assert(kShapeN % 8 == 0, "N must be a multiple of 8");
  static_assert(kBlockM == 64 || kBlockM == 128, "block M is 64 or 128");
  static_assert(kBlockN % 8 == 0 && kBlockN <= 256, "block N is a multiple of 8 up to 256");
  constexpr auto kResidualType = static_cast<ResidualType>(kResidual);
  constexpr auto kType = static_cast<GemmType>(kGemmType);
  constexpr bool kMasked = kType == GemmType::kGroupedMasked;
  static_assert(kType == GemmType::kNormal || kResidualType == ResidualType::kNone, "grouped GEMMs add no C");
  static_assert(!kMasked || kBlockM % kMaskedStoreRows == 0, "masked tiles are stored in whole boxes");

  const uint32_t m = kShapeM != 0 ? kShapeM : shape_m;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* smem_d = smem;
  auto* barriers = reinterpret_cast<uint64_t*>(smem + Smem::kOffsetBarriers);
  const StageRing<kNumStages> ring{barriers, barriers + kNumStages};

  const uint32_t warp = threadIdx.x / 32;
  const uint32_t lane = sm90::lane_id();
  if (threadIdx.x == kNumMathThreads) {
    sm90::tma_prefetch_descriptor(&map_a);
    sm90::tma_prefetch_descriptor(&map_b);
    sm90::tma_prefetch_descriptor(&map_d);
    ring.init(1, kNumMathWG * 4);
  }
  __syncthreads();

  TileScheduler<kType, kBlockM, kBlockN, kGroupN> scheduler(m, kShapeN, grouped_layout, num_groups);
  PipelineState<kNumStages> pipe;
  Tile t;
  // A's first row of a tile (masked: groups of max_m rows stacked), B's (groups of N rows stacked).
  const auto a_row0 = [&](const Tile& tile) { return (kMasked ? tile.group * m : 0) + tile.m_block * kBlockM; };
  const auto b_row0 = [&](const Tile& tile) { return tile.group * kShapeN + tile.n_block * kBlockN; };

  if (threadIdx.x >= kNumMathThreads) {
    sm90::setmaxnreg_dec<kProducerRegisters>();
    if (warp == kNumMathWG * 4 && lane == 0) {
      while (scheduler.next(t)) {
        for (uint32_t kb = 0; kb < kNumKBlocks; ++kb, pipe.advance()) {
          ring.producer_acquire(pipe);
          uint64_t* full = ring.full + pipe.stage;
          sm90::mbarrier_arrive_expect_tx(full, Smem::kA + Smem::kB);
          sm90::tma_load_2d(smem + Smem::kOffsetA + pipe.stage * Smem::kA, &map_a, full, kb * kBlockK, a_row0(t));
          sm90::tma_load_2d(smem + Smem::kOffsetB + pipe.stage * Smem::kB, &map_b, full, kb * kBlockK, b_row0(t));
        }
      }
    }
    return;
  }

  sm90::setmaxnreg_inc<kMathRegisters>();
  const uint32_t math_wg = threadIdx.x / 128;
  const uint32_t tile_row0 = math_wg * 64 + (warp % 4) * 16 + lane / 4;
  float acc[Wgmma::kNumAccum];

  while (scheduler.next(t)) {
    PipelineState<kNumStages> previous = pipe;
    for (uint32_t kb = 0; kb < kNumKBlocks; ++kb, pipe.advance()) {
      ring.consumer_wait(pipe);
      const uint8_t* tile_a = smem + Smem::kOffsetA + pipe.stage * Smem::kA + math_wg * 64 * kBlockK * 2;
      const uint8_t* tile_b = smem + Smem::kOffsetB + pipe.stage * Smem::kB;
      const uint64_t desc_a = sm90::make_sw128_kmajor_desc(tile_a);
      const uint64_t desc_b = sm90::make_sw128_kmajor_desc(tile_b);
      Wgmma::issue_k_block(desc_a, desc_b, acc, kb > 0);
      // One K block stays in flight: the previous one has finished reading its stage.
      Wgmma::template wait<1>(acc);
      if (kb > 0) {
        if (lane == 0) ring.consumer_release(previous);
        previous.advance();
      }
    }
    Wgmma::template wait<0>(acc);
    if (lane == 0) ring.consumer_release(previous);

    store_tile<kBlockM, kBlockN, kSwizzleDBytes, kResidualType, kMasked, kNumMathThreads>(
        &map_d, smem_d, acc, tile_row0, lane, c, ldc, a_row0(t), t.n_block * kBlockN, m, kShapeN,
        t.m_block * kBlockM, t.group, kMasked ? scheduler.masked_rows(t) : kBlockM);
  }
  if (threadIdx.x < 32) sm90::tma_store_wait_all<0>();  // warp 0 issued the stores (common/epilogue.cuh)
#endif
}

}  // namespace moe_kernels
