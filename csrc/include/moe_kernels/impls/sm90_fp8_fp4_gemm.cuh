#pragma once
// FP8 x FP4 GEMM for SM90, m-grouped over experts: D[M, N] (bf16) = (A * SFA) @ (B[g] * SFB[g])^T.
// A: E4M3 K-major, one FP32 scale per 1x128 (as sm90_fp8_gemm). B: E2M1 packed two per byte
// [G * N, K / 2], K-major, one UE8M0 exponent byte per 1x32 (SFB [G, N, K / 32]). Hopper has no
// FP4 tensor cores: B is converted to E4M3 in shared memory (exactly, see common/fp4.cuh) and the
// FP8 wgmma runs on the converted tile; the halved weight bytes are what decode gains.
//
// Roles (one CTA per SM, persistent over tiles):
//   warpgroups [0, kNumMathWG): math — wait for a converted stage, 4 x wgmma 64xBNx32 per 128-deep
//                               K block, FP32 promotion with the row's A scale and the column's
//                               B scale, epilogue;
//   warpgroup kNumMathWG:       converter — packed B tile -> E4M3 tile in the 128-byte swizzled
//                               layout wgmma reads, plus one FP32 column scale per row of B;
//   last warpgroup, warp 0:     TMA producer for A and packed B;
//   last warpgroup, warps 1-3:  scale producers (common/scale_gather.cuh), taking the stages in
//                               turn — the A scales and one 32-bit word of four exponent bytes per
//                               B row, on the same mbarrier.
//
// kNumMulticast = 2 (2-CTA clusters of adjacent m-blocks, common/scheduler.cuh's kShareB): a pair on
// one weight tile converts it once. Each CTA's converters convert half of its rows and copy them
// into the peer's stage (a bulk shared::cluster copy completing on the peer's `converted` barrier);
// the column scales, a few instructions per row, each CTA works out for all rows. The math warps
// release a stage to both CTAs, since the peer's copy refills it.

#include <cuda_bf16.h>
#include <moe_kernels/common/epilogue.cuh>
#include <moe_kernels/common/fp4.cuh>
#include <moe_kernels/common/pipeline.cuh>
#include <moe_kernels/common/scale_gather.cuh>
#include <moe_kernels/common/scale_promotion.cuh>
#include <moe_kernels/common/scale_rows.cuh>
#include <moe_kernels/common/scheduler.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>
#include <moe_kernels/common/sm90_wgmma.cuh>

namespace moe_kernels {

template <uint32_t kBlockM, uint32_t kBlockN, uint32_t kNumStages>
struct Fp8Fp4GemmSmem {
  static constexpr uint32_t kBlockK = 128;
  static constexpr uint32_t kD = kBlockM * kBlockN * 2;
  static constexpr uint32_t kA = kBlockM * kBlockK;
  static constexpr uint32_t kB = kBlockN * kBlockK;            // converted E4M3, swizzled
  static constexpr uint32_t kPackedB = kBlockN * kBlockK / 2;  // E2M1 as loaded, 64-byte swizzle
  // Per stage: A scales (FP32), B exponent words (4 x UE8M0), B column scales (FP32, in
  // ColumnScaleLayout's order; launchers/sm90_fp8_fp4_gemm.hpp's stage_bytes mirrors the size).
  static constexpr uint32_t kScaleFloats = kBlockM + kBlockN + ColumnScaleLayout<kBlockN>::kFloats;
  static constexpr uint32_t kScaleBytes = kScaleFloats * 4;
  static constexpr uint32_t kOffsetA = kD;
  static constexpr uint32_t kOffsetB = kOffsetA + kNumStages * kA;
  static constexpr uint32_t kOffsetPackedB = kOffsetB + kNumStages * kB;
  static constexpr uint32_t kOffsetScales = kOffsetPackedB + kNumStages * kPackedB;
  static constexpr uint32_t kOffsetBarriers = kOffsetScales + kNumStages * kScaleBytes;
  static constexpr uint32_t kTotal = kOffsetBarriers + 3 * kNumStages * 8;
  static_assert(kD % 1024 == 0 && kA % 1024 == 0 && kB % 1024 == 0 && kPackedB % 1024 == 0,
                "stage buffers must stay 1024-byte aligned");
};

// Converter tasks per B row (1, 2 or 4; 4 / tasks of the row's 1x32 groups each) when `threads`
// convert `rows` rows: as few as keep every converter thread busy, since each task repeats the
// row's exponent work.
constexpr uint32_t fp4_converter_tasks_per_row(uint32_t threads, uint32_t rows) {
  return threads >= 4 * rows ? 4 : threads >= 2 * rows ? 2 : 1;
}

// shape_m and grouped_layout as in sm90_fp8_gemm_nt; sfb: exponent bytes, 4-byte aligned rows.
// kGatherChunk as the FP8 GEMM's (common/scale_gather.cuh): 0 cp.async copies; 1, 2 or 4 K blocks per
// load into registers (beyond 1: K-major A scales and exponent rows on 4 x kGatherChunk bytes).
template <int kGemmType, uint32_t kShapeM, uint32_t kShapeN, uint32_t kShapeK, uint32_t kBlockM, uint32_t kBlockN,
          uint32_t kNumStages, uint32_t kGroupN, uint32_t kSwizzleDBytes, uint32_t kScaleWarps = 3,
          uint32_t kNumMulticast = 1, uint32_t kGatherChunk = 0>
__global__ void __launch_bounds__((kBlockM / 64 + (kBlockM == 64 ? 2 : 1) + 1) * 128, 1)
    sm90_fp8_fp4_gemm_nt(uint32_t shape_m, const int* __restrict__ grouped_layout, uint32_t num_groups,
                         const float* __restrict__ sfa, uint32_t sfa_stride_m, uint32_t sfa_stride_k,
                         const uint8_t* __restrict__ sfb, uint32_t sfb_stride_g, uint32_t sfb_stride_n,
                         const __grid_constant__ TmaDescriptor map_a, const __grid_constant__ TmaDescriptor map_b,
                         const __grid_constant__ TmaDescriptor map_d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Smem = Fp8Fp4GemmSmem<kBlockM, kBlockN, kNumStages>;
  using Wgmma = sm90::Fp8Wgmma<kBlockN>;
  constexpr uint32_t kBlockK = Smem::kBlockK;
  constexpr uint32_t kNumMathWG = kBlockM / 64;
  constexpr uint32_t kNumMathThreads = kNumMathWG * 128;
  // The conversion is integer work at about 2 instructions per element: with one math warpgroup
  // two converter warpgroups keep up with the weight stream, with two the register file holds one.
  constexpr uint32_t kNumConverterWG = kNumMathWG == 1 ? 2 : 1;
  constexpr uint32_t kConverterThreads = kNumConverterWG * 128;
  constexpr uint32_t kNumKBlocks = kShapeK / kBlockK;
  // Scale producers: warps 1.. of the producer warpgroup (warp 0 issues the TMA loads), at most
  // one per stage.
  static_assert(kScaleWarps >= 1 && kScaleWarps <= 3, "1 to 3 scale warps");
  constexpr uint32_t kNumScaleWarps = scale_gather_warps(kScaleWarps, kGatherChunk, kNumStages, kBlockM);
  constexpr uint32_t kScaleRowWarps = scale_gather_row_warps(kBlockM, kGatherChunk);
  static_assert(kScaleWarps >= kScaleRowWarps, "a chunk's rows split over more warps than there are");
  static_assert(kNumKBlocks % (kGatherChunk > 0 ? kGatherChunk : 1) == 0, "chunked gathers: whole chunks of K blocks");
  // Register budgets (a CTA owns the SM's 64K registers): the scale warps keep per-tile 32-bit
  // row offsets, kBlockM / 32 for A and kBlockN / 32 for B (under 40 registers at 128 x 128; the
  // 64-bit row pointers they replaced spilled at 40), a converter task holds up to 16 packed words
  // in and 8 converted ones out, math two accumulator sets of kBlockN / 2 each.
  constexpr uint32_t kProducerRegisters = kNumMathWG == 1 ? 64 : 48;
  constexpr uint32_t kConverterRegisters = kNumMathWG == 1 ? 80 : 56;
  constexpr uint32_t kMathRegisters = kNumMathWG == 1 ? 232 : 200;
  // Scale warps with a second chunk of register-loaded scales in flight (common/scale_gather.cuh):
  // 64-row tiles (64 registers) in any chunk, 128-row tiles (48) of lone CTAs where a pair of warps
  // halves the rows. 128 rows per warp in chunks of 1, or clusters sharing B, spilled the second set
  // (NVRTC 13.0).
  constexpr bool kGatherPrefetch = kNumMathWG == 1 || (kScaleRowWarps == 2 && kNumMulticast == 1);
  static_assert(128 * (kProducerRegisters + kNumConverterWG * kConverterRegisters + kNumMathWG * kMathRegisters) <=
                    sm90::launch_registers<(1 + kNumConverterWG + kNumMathWG) * 128>(),
                "register budgets exceed the launch allocation: setmaxnreg.inc would hang");
  static_assert(kShapeK % kBlockK == 0, "K must be a multiple of 128");
  static_assert(kShapeN % 8 == 0, "N must be a multiple of 8");
  static_assert(kBlockM == 64 || kBlockM == 128, "block M is 64 or 128");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 128, "block N is a multiple of 16 up to 128");
  constexpr uint32_t kTasksPerRow = fp4_converter_tasks_per_row(kConverterThreads, kBlockN);
  static_assert(kNumConverterWG == (kBlockM == 64 ? 2 : 1), "the launch bounds assume this converter count");
  constexpr auto kType = static_cast<GemmType>(kGemmType);
  static_assert(kType != GemmType::kNormal, "the FP4-weight GEMM is m-grouped");
  constexpr bool kShareB = kNumMulticast == 2;
  static_assert(kNumMulticast == 1 || kShareB, "one CTA, or 2-CTA clusters sharing the converted B tile");
  // kShareB: each CTA converts half of B's rows; its converters then take more tasks per row.
  constexpr uint32_t kHalfRowsB = kBlockN / 2;
  // Masked pairs always lie in one group (common/scheduler.cuh): they always share.
  constexpr bool kAlwaysShared = kShareB && kType == GemmType::kGroupedMasked;
  constexpr uint32_t kHalfTasksPerRow = fp4_converter_tasks_per_row(kConverterThreads, kHalfRowsB);
  // Named barrier of the converter threads before a stage's half is copied (0: __syncthreads,
  // 1: the math warpgroups' epilogue).
  constexpr uint32_t kConverterBarrier = 2;

  const uint32_t m = kShapeM != 0 ? kShapeM : shape_m;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* smem_d = smem;
  auto* barriers = reinterpret_cast<uint64_t*>(smem + Smem::kOffsetBarriers);
  const StageRing<kNumStages> ring{barriers, barriers + kNumStages};
  uint64_t* converted = barriers + 2 * kNumStages;
  // Stage s's scales: A's kBlockM floats, then kBlockN exponent words, then the column scales.
  const auto stage_scales = [&](uint32_t stage) {
    return reinterpret_cast<float*>(smem + Smem::kOffsetScales + stage * Smem::kScaleBytes);
  };

  // Broadcast from lane 0, the warp index is provably warp-uniform: so are the roles' branches on
  // it (the scale warps' turns, the math warpgroup's wgmma descriptors), which then live in uniform
  // registers instead of being moved there (R2UR) before every use.
  const uint32_t warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const uint32_t lane = sm90::lane_id();
  if (threadIdx.x == kNumMathThreads + kConverterThreads) {
    sm90::tma_prefetch_descriptor(&map_a);
    sm90::tma_prefetch_descriptor(&map_b);
    sm90::tma_prefetch_descriptor(&map_d);
    // Full: one expect-tx arrival for the A/B tiles plus one arrival per scale lane (of each warp
    // sharing a chunk's rows). Empty: every math warp of each CTA of the cluster (kShareB: the peer's
    // copy refills the stage too).
    ring.init(1 + 32 * kScaleRowWarps, kNumMathWG * 4 * kNumMulticast);
#pragma unroll
    for (uint32_t s = 0; s < kNumStages; ++s) sm90::mbarrier_init(converted + s, kConverterThreads);
    sm90::fence_barrier_init();
  }
  if constexpr (kShareB) {
    sm90::cluster_sync();  // the peer's barriers exist before its first copy or remote arrival
  } else {
    __syncthreads();
  }

  TileScheduler<kType, kBlockM, kBlockN, kGroupN, kNumMulticast, kShareB> scheduler(m, kShapeN, grouped_layout,
                                                                                     num_groups);
  PipelineState<kNumStages> pipe;
  Tile t;
  const auto a_row0 = [&](const Tile& tile) {
    return (kType == GemmType::kGroupedMasked ? tile.group * m : 0) + tile.m_block * kBlockM;
  };
  // The tile loop of a whole warp. The scheduler reads group ids from global memory, values ptxas
  // cannot prove warp-uniform, so the loop would count as divergent and the K loop inside it could
  // not keep its stage, phase and addresses (the wgmma descriptors) in uniform registers: every
  // lane gets the same answer, broadcast from lane 0 the loop is provably uniform.
  const auto next_tile = [&](Tile& tile) { return __shfl_sync(0xffffffffu, scheduler.next(tile), 0); };

  if (threadIdx.x >= kNumMathThreads + kConverterThreads) {
    sm90::setmaxnreg_dec<kProducerRegisters>();
    const uint32_t producer_warp = warp - (kNumMathWG + kNumConverterWG) * 4;
    // The lane test nested inside the warp test: as part of one condition it would make the scale
    // warps' branch the else of a lane-divergent one, and ptxas would keep none of their loop state
    // in uniform registers.
    if (producer_warp == 0) {
      if (lane == 0) {
        while (scheduler.next(t)) {
          const uint32_t row_a = a_row0(t), row_b = t.group * kShapeN + t.n_block * kBlockN;
          for (uint32_t kb = 0; kb < kNumKBlocks; ++kb, pipe.advance()) {
            ring.producer_acquire(pipe);
            uint64_t* full = ring.full + pipe.stage;
            sm90::mbarrier_arrive_expect_tx(full, Smem::kA + Smem::kPackedB);
            sm90::tma_load_2d(smem + Smem::kOffsetA + pipe.stage * Smem::kA, &map_a, full, kb * kBlockK, row_a);
            sm90::tma_load_2d(smem + Smem::kOffsetPackedB + pipe.stage * Smem::kPackedB, &map_b, full,
                              kb * kBlockK / 2, row_b);
          }
        }
        if constexpr (kShareB) {
          // The peer's math arrives on this CTA's empty barriers, and its last releases come after its
          // wait for this CTA's copies (which read this CTA's stages): it may only exit once every
          // stage's last fill has been released by both CTAs.
          for (uint32_t s = 0; s < kNumStages; ++s, pipe.advance()) ring.producer_acquire(pipe);
        }
      }
    } else if (producer_warp >= 1 && producer_warp <= kNumScaleWarps) {
      // The scale warps take the stages in turn (turn counts K blocks across tiles). One warp issued
      // ~225 instructions per K block (64-bit addresses rebuilt per copy in a loop), as many as a
      // math warp, all on one SM sub-partition.
      using Gather =
          ScaleGather<kBlockM, kGatherChunk, kNumStages, Smem::kScaleFloats, kNumScaleWarps, kGatherPrefetch>;
      Gather gather(ring, reinterpret_cast<float*>(smem + Smem::kOffsetScales), lane, producer_warp - 1);
      while (next_tile(t)) {
        // Per tile: byte offsets of the lane's rows (common/scale_rows.cuh). Rows past the problem (or a
        // masked group's max_m) read no A scale; rows past N read no exponents: their words are zero,
        // their (zero-filled) B rows too.
        const uint32_t row_end = kType == GemmType::kGroupedMasked ? (t.group + 1) * m : m;
        const LaneScaleRows<Gather::kRows> rows_a(a_row0(t) + gather.first_row(), row_end, sfa_stride_m * 4, lane);
        SfbRows<kBlockM, kBlockN, kGatherChunk> sfb_rows{
            sm90::opaque(sfb + uint64_t(t.group) * sfb_stride_g + uint64_t(t.n_block * kBlockN) * sfb_stride_n),
            LaneScaleRows<(kBlockN + 31) / 32>(0, min(kBlockN, kShapeN - t.n_block * kBlockN), sfb_stride_n, lane)};
        gather.template tile<true>(pipe, sfa, rows_a, sfa_stride_k, sfb_rows, 0, kNumKBlocks);
      }
    }
    return;
  }

  if (threadIdx.x >= kNumMathThreads) {
    sm90::setmaxnreg_dec<kConverterRegisters>();
    const uint32_t tid = threadIdx.x - kNumMathThreads;
    // Rows [row_begin, row_begin + kRows) of a stage, kTasks tasks per row. A task: 4 / kTasks
    // consecutive 1x32 groups of one B row, 16 packed bytes in and two 16-byte E4M3 chunks out each.
    // A row's exponent word, largest exponent and column scale are worked out once per task, so a
    // task takes as many groups as leave no converter thread idle. Lanes hold consecutive rows, so
    // the swizzles spread each load and store over all banks: packed row r (64-byte swizzle) has
    // group c at chunk c ^ ((r / 2) % 4), converted row r (128-byte swizzle, as TMA would place it)
    // output chunk c at c ^ (r % 8).
    const auto convert_rows = [&](auto tasks, auto rows, uint32_t row_begin, const uint8_t* packed, uint8_t* tile_b,
                                  const uint32_t* exponents, float* column_scales) {
      constexpr uint32_t kTasks = decltype(tasks)::value;
      constexpr uint32_t kRows = decltype(rows)::value;
      constexpr uint32_t kGroupsPerTask = 4 / kTasks;
      constexpr uint32_t kRowsPerPass = kConverterThreads / kTasks;
      const uint32_t first_group = (tid % kTasks) * kGroupsPerTask;
#pragma unroll
      for (uint32_t i = 0; i < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++i) {
        const uint32_t local_row = i * kRowsPerPass + tid / kTasks;
        if (kRows % kRowsPerPass == 0 || local_row < kRows) {
          const uint32_t row = row_begin + local_row;
          const uint32_t exps = exponents[row];
          const uint32_t e_max = fp4::max_exponent(exps);
          if (first_group == 0) column_scales[ColumnScaleLayout<kBlockN>::slot(row)] = fp4::column_scale(e_max);
          // Byte g: e_max - e of the task's group g.
          const uint32_t shifts = fp4::group_shifts(exps >> (8 * first_group), e_max);
          // All loads first: the groups are independent, their latencies overlap.
          uint4 in[kGroupsPerTask];
#pragma unroll
          for (uint32_t g = 0; g < kGroupsPerTask; ++g) {
            const uint32_t chunk = (first_group + g) ^ ((row / 2) % 4);
            in[g] = *reinterpret_cast<const uint4*>(packed + row * (kBlockK / 2) + chunk * 16);
          }
#pragma unroll
          for (uint32_t g = 0; g < kGroupsPerTask; ++g) {
            const uint32_t group = first_group + g;
            const fp4::Lut lut = fp4::make_lut_of_byte(shifts, g);
            const uint2 c0 = fp4::convert8(in[g].x, lut), c1 = fp4::convert8(in[g].y, lut);
            const uint2 c2 = fp4::convert8(in[g].z, lut), c3 = fp4::convert8(in[g].w, lut);
            uint8_t* dst = tile_b + row * kBlockK;
            *reinterpret_cast<uint4*>(dst + (((group * 2) ^ (row % 8)) * 16)) = make_uint4(c0.x, c0.y, c1.x, c1.y);
            *reinterpret_cast<uint4*>(dst + (((group * 2 + 1) ^ (row % 8)) * 16)) =
                make_uint4(c2.x, c2.y, c3.x, c3.y);
          }
        }
      }
    };
    using cuda::std::integral_constant;
    [[maybe_unused]] const uint32_t rank = kShareB ? sm90::cluster_ctarank() : 0;
    while (next_tile(t)) {
      for (uint32_t kb = 0; kb < kNumKBlocks; ++kb, pipe.advance()) {
        ring.consumer_wait(pipe);
        const uint8_t* packed = smem + Smem::kOffsetPackedB + pipe.stage * Smem::kPackedB;
        uint8_t* tile_b = smem + Smem::kOffsetB + pipe.stage * Smem::kB;
        float* scales = stage_scales(pipe.stage);
        const auto* exponents = reinterpret_cast<const uint32_t*>(scales + kBlockM);
        float* column_scales = scales + kBlockM + kBlockN;
        if (kAlwaysShared || (kShareB && t.share_b)) {
          const uint32_t own_begin = rank * kHalfRowsB, peer_begin = (rank ^ 1) * kHalfRowsB;
          convert_rows(integral_constant<uint32_t, kHalfTasksPerRow>{}, integral_constant<uint32_t, kHalfRowsB>{},
                       own_begin, packed, tile_b, exponents, column_scales);
          for (uint32_t r = tid; r < kHalfRowsB; r += kConverterThreads) {
            const uint32_t row = peer_begin + r;
            column_scales[ColumnScaleLayout<kBlockN>::slot(row)] = fp4::own_column_scale(exponents[row]);
          }
          // The half must be written (and visible to the async proxy) before one thread copies it.
          sm90::fence_proxy_async_shared();
          sm90::named_barrier_sync(kConverterBarrier, kConverterThreads);
          if (tid == 0) {
            // This CTA's arrival, and the peer's half that completes on this barrier.
            sm90::mbarrier_arrive_expect_tx(converted + pipe.stage, kHalfRowsB * kBlockK);
            sm90::bulk_copy_to_cluster_cta(tile_b + own_begin * kBlockK, tile_b + own_begin * kBlockK,
                                           kHalfRowsB * kBlockK, converted + pipe.stage, rank ^ 1);
          } else {
            sm90::mbarrier_arrive(converted + pipe.stage);
          }
        } else if constexpr (!kAlwaysShared) {
          convert_rows(integral_constant<uint32_t, kTasksPerRow>{}, integral_constant<uint32_t, kBlockN>{}, 0u,
                       packed, tile_b, exponents, column_scales);
          // The generic-proxy writes must be visible to wgmma's async-proxy reads.
          sm90::fence_proxy_async_shared();
          sm90::mbarrier_arrive(converted + pipe.stage);
        }
      }
    }
    return;
  }

  sm90::setmaxnreg_inc<kMathRegisters>();
  const uint32_t math_wg = warp / 4;
  const uint32_t tile_row0 = math_wg * 64 + (warp % 4) * 16 + lane / 4;
  // Stage 0's descriptors; stage s's lie s x its tile's bytes / 16 further (the 14-bit address field
  // holds them all: shared memory ends below 2^18 bytes, so the sum never carries out of it).
  const uint64_t desc_a0 = sm90::make_sw128_kmajor_desc(smem + Smem::kOffsetA + math_wg * 64 * kBlockK);
  const uint64_t desc_b0 = sm90::make_sw128_kmajor_desc(smem + Smem::kOffsetB);
  float acc[Wgmma::kNumAccum];
  float final_acc[Wgmma::kNumAccum];

  while (next_tile(t)) {
#pragma unroll
    for (uint32_t i = 0; i < Wgmma::kNumAccum; ++i) final_acc[i] = 0.0f;

    for (uint32_t kb = 0; kb < kNumKBlocks; ++kb, pipe.advance()) {
      // A arrives on full; the converted B tile and its column scales on `converted`.
      ring.consumer_wait(pipe);
      sm90::mbarrier_wait(converted + pipe.stage, pipe.phase);
      const uint64_t desc_a = desc_a0 + pipe.stage * (Smem::kA / 16);
      const uint64_t desc_b = desc_b0 + pipe.stage * (Smem::kB / 16);
      Wgmma::issue_k_block(desc_a, desc_b, acc, false);
      Wgmma::template wait<0>(acc);

      const float* scales = stage_scales(pipe.stage);
      const float sa0 = scales[tile_row0], sa1 = scales[tile_row0 + 8];
      float sb[kBlockN / 4];
      load_column_scales<kBlockN>(sb, scales + kBlockM + kBlockN, lane);
      __syncwarp();
      if constexpr (kShareB) {
        if (lane < kNumMulticast) sm90::mbarrier_arrive_cluster(ring.empty + pipe.stage, lane);
      } else if (lane == 0) {
        ring.consumer_release(pipe);
      }
      promote_accum_column_scales<kBlockN>(final_acc, acc, sa0, sa1, sb);
    }

    // kShareB: a block past M (or masked_m), or of padding, ran only to keep its pair in step.
    if (kShareB && !t.valid) continue;
    constexpr bool kMasked = kType == GemmType::kGroupedMasked;
    store_tile<kBlockM, kBlockN, kSwizzleDBytes, ResidualType::kNone, kMasked, kNumMathThreads>(
        &map_d, smem_d, final_acc, tile_row0, lane, nullptr, 0, a_row0(t), t.n_block * kBlockN, m, kShapeN,
        kMasked ? t.m_block * kBlockM : a_row0(t), t.group, kMasked ? scheduler.masked_rows(t) : kBlockM);
  }
  if (threadIdx.x < 32) sm90::tma_store_wait_all<0>();  // warp 0 issued the stores (common/epilogue.cuh)
#endif
}

}  // namespace moe_kernels
