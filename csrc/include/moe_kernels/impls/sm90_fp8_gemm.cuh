#pragma once
// FP8 GEMM for SM90, D[M, N] (bf16) = (A[M, K] * SFA) @ (B[N, K] * SFB)^T (+ C), dense or
// grouped over experts (B[G, N, K]; see GemmType in common/scheduler.cuh for the row layouts).
// A: E4M3 K-major with one FP32 scale per 1x128 (token x K block); B: E4M3 K-major with one FP32
// scale per 128x128 block. Scales are read with any strides, so neither layout needs a transpose.
//
// Roles (one CTA per SM, persistent over tiles):
//   warpgroups [0, kNumMathWG): math — 4 x wgmma 64xBNx32 per 128-deep K block and wave, then
//                               FP32 promotion with the block's scales, then the epilogue; two
//                               warpgroups may take turns on the tensor cores (common/math_turns.cuh). A
//                               256-row tile runs as two waves of 128 rows on the same two
//                               warpgroups, each wave its own wgmmas and promotion (half the
//                               B fills and L2 reads per FLOP of a 128-row tile);
//   last warpgroup, warp 0:     TMA producer for the A and B tiles;
//   last warpgroup, warps 1-3:  scale producers (kScaleGather only), taking the stages in turn —
//                               cp.async copies (or loads into registers, then stores) of the tile's
//                               1x128 A scales and two B scales into the stage, completing on the
//                               same mbarrier (common/scale_gather.cuh). Scales whose layout TMA
//                               can read come with the tiles instead, or a dense tile's K-major A
//                               scales once per tile into a table (common/fp8_gemm_layout.h).

#include <cuda_bf16.h>
#include <moe_kernels/common/epilogue.cuh>
#include <moe_kernels/common/fp8_gemm_layout.h>
#include <moe_kernels/common/math_turns.cuh>
#include <moe_kernels/common/pipeline.cuh>
#include <moe_kernels/common/scale_gather.cuh>
#include <moe_kernels/common/scale_promotion.cuh>
#include <moe_kernels/common/scale_rows.cuh>
#include <moe_kernels/common/scheduler.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>
#include <moe_kernels/common/sm90_wgmma.cuh>
#include <moe_kernels/common/split_reduce.cuh>
#include <moe_kernels/common/swiglu_epilogue.cuh>

namespace moe_kernels {

// shape_m: rows of A (kNormal, kGroupedContiguous) or rows per group (kGroupedMasked, whose
// group g starts at row g * shape_m of A and D); grouped_layout: m_indices or masked_m.
// kScaleLoad (common/fp8_gemm_layout.h): kScaleGather reads the scales at sfa / sfb with their
// strides (kScaleWarps warps); the TMA loads read them through map_sfa ([K blocks, rows of A] if
// MN-major, [rows of A, K blocks] if K-major) and map_sfb ([groups x ceil(N / 128), K blocks]).
// kTightBoxes (dense): the last m-block, where M cuts it, loads A through map_a_tail (a box of
// the rows M leaves it, or in a cluster of those M leaves the CTA's share) and MN-major or table
// scales through map_sfa_tail, the last n-block, where N cuts it, B through map_b_tail (N % kBlockN
// rows; not in pairs sharing B, kShareB, whose halves of B stay whole); other kernels ignore these maps
// (the last parameters, so the others' offsets stay).
// kNormal's tail split (common/scheduler.cuh): num_splits > 1 splits the last tail_tiles tiles (per
// cluster) over K, split s taking split_k_quot + (s < split_k_rem) K blocks, their partial sums
// added through split_workspace / split_counters (common/split_reduce.cuh); 1 runs every tile whole.
// kSwiGlu: B is an L1 weight with gate/up interleaved and one scale per 128-row block and half
// (map_sfb / sfb rows: groups x N / 64), D is not written; the epilogue writes act = SwiGLU x the
// row's weight, quantized 1 x 128, to `swiglu` (common/swiglu_epilogue.cuh). The scheduler walks
// 256-column tiles (one act scale group): pairs of 128-column n-blocks, which every role runs back
// to back, or (block N 256) single n-blocks of two 128-column halves.
template <int kGemmType, uint32_t kShapeM, uint32_t kShapeN, uint32_t kShapeK, uint32_t kBlockM, uint32_t kBlockN,
          uint32_t kNumStages, uint32_t kGroupN, int kResidual, uint32_t kSwizzleDBytes, uint32_t kNumMulticast = 1,
          uint32_t kScaleWarps = 3, bool kPingPong = false, bool kPdl = false, uint32_t kKUnroll = 1,
          uint32_t kScaleLoad = kScaleGather, bool kOverlap = false, bool kShareB = false, bool kWgStore = false,
          uint32_t kTableSlots = 0, bool kSwiGlu = false, bool kTightBoxes = false, uint32_t kGatherChunk = 0>
__global__ void __launch_bounds__(fp8_gemm_threads(kBlockM), 1)
    sm90_fp8_gemm_nt(uint32_t shape_m, const int* __restrict__ grouped_layout, uint32_t num_groups,
                     const float* __restrict__ sfa, uint32_t sfa_stride_m, uint32_t sfa_stride_k,
                     const float* __restrict__ sfb, uint32_t sfb_stride_g, uint32_t sfb_stride_n,
                     uint32_t sfb_stride_k, const void* c, uint32_t ldc, uint32_t num_splits,
                     uint32_t tail_tiles, uint32_t split_k_quot, uint32_t split_k_rem,
                     float* __restrict__ split_workspace, int* __restrict__ split_counters,
                     const __grid_constant__ TmaDescriptor map_a, const __grid_constant__ TmaDescriptor map_b,
                     const __grid_constant__ TmaDescriptor map_d, const __grid_constant__ TmaDescriptor map_sfa,
                     const __grid_constant__ TmaDescriptor map_sfb, const SwiGluOut swiglu,
                     const __grid_constant__ TmaDescriptor map_a_tail,
                     const __grid_constant__ TmaDescriptor map_sfa_tail,
                     const __grid_constant__ TmaDescriptor map_b_tail) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Smem = Fp8GemmSmem<kBlockM, kBlockN, kNumStages, kScaleLoad, (kTableSlots > 0 ? kShapeK / 128 : 0), kTableSlots,
                           !kSwiGlu>;
  // kSwiGlu with block N 256 (a pair's both n-blocks in one tile, kSwiGluWide): each warpgroup issues
  // the tile's two 128-column halves one after the other, one wgmma accumulator set for both.
  constexpr bool kSwiGluWide = kSwiGlu && kBlockN == 256;
  constexpr uint32_t kNumHalves = kSwiGluWide ? 2 : 1;
  using Wgmma = sm90::Fp8Wgmma<kBlockN / kNumHalves>;
  constexpr uint32_t kBlockK = Smem::kBlockK;
  constexpr uint32_t kNumMathWG = fp8_gemm_math_warpgroups(kBlockM);
  constexpr uint32_t kNumMathThreads = kNumMathWG * 128;
  constexpr uint32_t kWaveRows = kNumMathWG * 64;
  constexpr uint32_t kNumWaves = kBlockM / kWaveRows;
  constexpr uint32_t kNumKBlocks = kShapeK / kBlockK;
  // Rows of B's scales per group: one per 128-row block, or (kSwiGlu) two, its gate and up halves'.
  constexpr uint32_t kNumSfbRows = kSwiGlu ? kShapeN / 64 : (kShapeN + 127) / 128;
  // The scheduler's tiles: 256 columns under kSwiGlu (one scale group of act: a pair of 128-column
  // n-blocks, or one wide one), else n-blocks.
  constexpr uint32_t kTileN = kSwiGlu ? 256 : kBlockN;
  // Scale producers: warps 1.. of the producer warpgroup (warp 0 issues the TMA loads), at most
  // one per stage; none where the TMA warp loads the scales.
  constexpr bool kScaleTma = kScaleLoad != kScaleGather;
  static_assert(kScaleLoad <= kScaleTmaKMajorTable, "a scale load of common/fp8_gemm_layout.h");
  // The table holds one tile's rows for one wave of the math warpgroups, dense tiles only:
  // contiguous 128 x 192 tiles would keep under 4 stages beside it at K >= 2048, and masked tiles
  // gather their scales (launchers/sm90_fp8_gemm.hpp).
  constexpr bool kScaleTable = kScaleLoad == kScaleTmaKMajorTable;
  static_assert(!kScaleTable || (kBlockM <= 128 && kGemmType == static_cast<int>(GemmType::kNormal) &&
                                 Smem::kSfaCols <= 256),
                "the scale table: dense tiles of block M 64 or 128, at most 256 columns (a TMA box's rows)");
  static_assert(kScaleTma ? kScaleWarps == 0 : kScaleWarps >= 1 && kScaleWarps <= 3,
                "1 to 3 scale warps gather the scales, none with TMA scale loads");
  // kGatherChunk (common/scale_gather.cuh): 0, 4-byte cp.async copies; 1, 2 or 4 K blocks per load
  // into registers (2 and 4: K-major A scales whose rows and base the launcher checked to fall on
  // 4 x kGatherChunk bytes, K blocks in whole chunks).
  static_assert(kGatherChunk == 0 || (!kScaleTma && kNumKBlocks % kGatherChunk == 0),
                "chunked gathers: gathered scales, whole chunks of K blocks");
  constexpr uint32_t kNumScaleWarps = scale_gather_warps(kScaleWarps, kGatherChunk, kNumStages, kBlockM);
  constexpr uint32_t kScaleRowWarps = scale_gather_row_warps(kBlockM, kGatherChunk);
  static_assert(kScaleTma || kScaleWarps >= kScaleRowWarps, "a chunk's rows split over more warps than there are");
  // Register budgets: the math warpgroups hold a promoted accumulator set per wave and one for the
  // wgmmas; the producers get what is left of the launch allocation (2 x 128 x 232 + 128 x 40 =
  // 384 x 168). The scale warps keep per-tile 32-bit row offsets, which fit 40 without spilling
  // (at block M 256 only with block N 128: ptxas spilled them at 72 and 120).
  // kSwiGlu: the producers walk each pair's two n-blocks in a loop of their own, and the TMA warp then
  // spilled its unrolled stages' barrier addresses at 40 and 48 (gathered scales); the math warpgroups
  // hold one accumulator set less than 256-row or overlapped tiles, so 224 leaves them room.
  // kWideProducers: 128-row tiles up to block N 160 with register-loaded scales (chunks of 1 or 2)
  // hold at most 80 accumulators a set, so the math warpgroups give 8 registers to the scale warps'
  // second chunk in flight (common/scale_gather.cuh), which spilled at 40.
  constexpr bool kWideProducers = !kSwiGlu && kBlockM == 128 && kGatherChunk > 0 && kGatherChunk <= 2 && kBlockN <= 160;
  constexpr uint32_t kProducerRegisters =
      kSwiGlu ? (kNumMathWG == 1 ? 72 : 56) : kNumMathWG == 1 ? 48 : kWideProducers ? 56 : 40;
  constexpr uint32_t kMathRegisters = kNumMathWG == 1 ? 240 : kSwiGlu || kWideProducers ? 224 : 232;
  // Scale warps with a second chunk of register-loaded scales in flight: 64-row tiles (48 registers)
  // and kWideProducers in chunks of 1 or 2 K blocks. In chunks of 4, and at 40 registers, the second
  // set spilled (NVRTC 13.0).
  constexpr bool kGatherPrefetch = (kNumMathWG == 1 || kWideProducers) && kGatherChunk <= 2;
  static_assert(128 * (kProducerRegisters + kNumMathWG * kMathRegisters) <=
                    sm90::launch_registers<(kNumMathWG + 1) * 128>(),
                "register budgets exceed the launch allocation: setmaxnreg.inc would hang");
  static_assert(kShapeK % kBlockK == 0, "K must be a multiple of 128");
  static_assert(kShapeN % 8 == 0, "N must be a multiple of 8");
  static_assert(kBlockM == 64 || kBlockM == 128 || kBlockM == 256, "block M is 64, 128 or 256");
  // (waves + 1) accumulator sets of kBlockN / 2 registers within the 232.
  static_assert(kNumWaves == 1 || kBlockN == 128, "block M 256 takes block N 128");
  // The tail split's workspace holds a tile's partial sums per slot (launchers' kMaxTileFloats).
  static_assert(kBlockM * kBlockN <= 128 * 256, "a tile's partial sums would overrun the split workspace");
  // A contiguous m-block must lie inside one group: the launcher takes 256 rows only where the
  // caller's layout is aligned to 256. Masked groups are small.
  static_assert(kNumWaves == 1 || kGemmType != static_cast<int>(GemmType::kGroupedMasked),
                "block M 256 is for dense and contiguous GEMMs");
  static_assert(!kPingPong || (kNumMathWG == 2 && kNumWaves == 1), "ping-pong takes two math warpgroups, one wave");
  static_assert(!kWgStore || (kNumMathWG == 2 && !kPingPong && kGemmType != static_cast<int>(GemmType::kGroupedMasked)),
                "per-warpgroup epilogues (common/epilogue.cuh): two math warpgroups without turns, 2-D stores");
  // kOverlap: a lone math warpgroup (block M 64) issues K block kb + 1's wgmmas into a second
  // accumulator set before it promotes K block kb, so the tensor cores work while it promotes;
  // without, it waited for its wgmmas and promoted with the tensor cores idle, one K block after
  // the other (DeepGEMM's order too). Three accumulator sets must fit the 240 registers.
  // Each round of K blocks ends with no wgmma in flight (see overlapped_k_loop): a k_unroll of 8 (or
  // more) makes the rounds that long, the drains fewer.
  constexpr uint32_t kOverlapRound = kKUnroll >= 4 ? kKUnroll : 4;
  static_assert(!kOverlap || (kNumMathWG == 1 && kBlockN <= 128 && kOverlapRound % 2 == 0 &&
                              kNumKBlocks % kOverlapRound == 0),
                "overlap: one math warpgroup, block N <= 128, whole rounds of an even count of K blocks");
  // A tile may straddle at most two 128-column scale blocks of B: tiles start at multiples of
  // gcd(kBlockN, 128) inside a scale block, so the last start plus kBlockN must stay within 256.
  static_assert(kBlockN % 8 == 0 && kBlockN <= 256, "block N is a multiple of 8 up to 256");
  static_assert(kBlockN <= 128 || 128 - sm90::gcd_u32(kBlockN, 128) + kBlockN <= 256,
                "block N would straddle three scale blocks of B");
  constexpr auto kResidualType = static_cast<ResidualType>(kResidual);
  constexpr auto kType = static_cast<GemmType>(kGemmType);
  constexpr bool kGrouped = kType != GemmType::kNormal;
  static_assert(!kGrouped || kResidual == 0, "grouped GEMMs take no residual");
  // Clusters of kNumMulticast CTAs on adjacent n-blocks of one m-block: each loads 1/kNumMulticast
  // of the A tile and multicasts it to all, so A crosses L2 once per cluster. A stage is then
  // refilled by the peers too, so its empty barrier counts every CTA's consumers.
  static_assert(kNumMulticast == 1 || kNumMulticast == 2, "A is shared by 1 or 2 CTAs");
  // kShareB: the cluster's CTAs hold adjacent m-blocks of one n-block instead (common/scheduler.cuh)
  // and share B: each loads its own A and, where the pair shares B, kHalfRowsB rows of B for both.
  static_assert(!kShareB || (kNumMulticast == 2 && kNumWaves == 1 && kBlockN % 16 == 0),
                "B is shared by 2-CTA clusters of 128-row tiles, in whole 8-row atoms");
  constexpr uint32_t kMulticastRowsA = kShareB ? kBlockM : kBlockM / kNumMulticast;
  // The first tile of a pair holds its act (kActFloats registers) through the second's K loop, or a
  // 256-column tile holds both halves' sums: one wave, no third accumulator set, clusters only sharing
  // B (both CTAs walk the same tiles), the tail split off (the launcher plans none).
  static_assert(!kSwiGlu || ((kBlockN == 128 || kBlockN == 256) && kNumWaves == 1 && !kOverlap &&
                             (kNumMulticast == 1 || kShareB) &&
                             !kWgStore && kShapeN % 256 == 0 && kResidual == 0 &&
                             kScaleLoad != kScaleTmaKMajorTable),
                "SwiGLU epilogue: tiles of block N 128 or 256, one wave, without overlap, residual or clusters "
                "sharing A, N a multiple of 256");
  constexpr uint32_t kHalfRowsB = kBlockN / 2;
  static_assert(!kTightBoxes || (kType == GemmType::kNormal && !kSwiGlu && kScaleLoad != kScaleTmaKMajor),
                "tight boxes: dense, gathered, MN-major or table A scales");
  // Pairs sharing B load B in whole halves: only A's tail is tight there.
  constexpr bool kTightB = kTightBoxes && !kShareB && kShapeN % kBlockN != 0;

  const uint32_t m = kShapeM != 0 ? kShapeM : shape_m;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* smem_d = smem;
  auto* smem_sf = reinterpret_cast<float*>(smem + Smem::kOffsetSf);
  auto* barriers = reinterpret_cast<uint64_t*>(smem + Smem::kOffsetBarriers);
  const StageRing<kNumStages> ring{barriers, barriers + kNumStages};
  // The A scales' slots: full (the box landed) and empty (every math warp has read it).
  [[maybe_unused]] const StageRing<Smem::kSfaRing> sfa_ring{barriers + 2 * kNumStages,
                                                            barriers + 2 * kNumStages + Smem::kSfaRing};
  [[maybe_unused]] auto* smem_sfa = reinterpret_cast<float*>(smem + Smem::kOffsetSfaSlots);

  const uint32_t warp = threadIdx.x / 32;
  const uint32_t lane = sm90::lane_id();
  if (threadIdx.x == kNumMathThreads) {
    sm90::tma_prefetch_descriptor(&map_a);
    sm90::tma_prefetch_descriptor(&map_b);
    if constexpr (!kSwiGlu) sm90::tma_prefetch_descriptor(&map_d);  // kSwiGlu's is empty
    if constexpr (kScaleTma) {
      sm90::tma_prefetch_descriptor(&map_sfa);
      sm90::tma_prefetch_descriptor(&map_sfb);
    }
    if constexpr (kTightBoxes) {
      if constexpr (kTightB) sm90::tma_prefetch_descriptor(&map_b_tail);
      sm90::tma_prefetch_descriptor(&map_a_tail);
      if constexpr (kScaleTma) sm90::tma_prefetch_descriptor(&map_sfa_tail);
    }
    // Full: one expect-tx arrival for the TMA loads, plus one arrival per scale lane (of each warp
    // sharing a chunk's rows).
    ring.init(kScaleTma ? 1 : 1 + 32 * kScaleRowWarps, kNumMathWG * 4 * kNumMulticast);
    // The slots are this CTA's own (never multicast): one is free once the local math warps are done.
    if constexpr (Smem::kSfaSlots > 0) sfa_ring.init(1, kNumMathWG * 4);
  }
  if constexpr (kNumMulticast > 1) {
    sm90::cluster_sync();  // the peers' barriers exist before any multicast or remote arrival
  } else {
    __syncthreads();
  }

  // kPdl (a launch with programmatic stream serialization): the barriers are set up while the
  // previous kernel may still run; nothing global is read or written before it has finished (the
  // scheduler reads masked_m). The next kernel may launch at once: it waits likewise for this one.
  if constexpr (kPdl) {
    sm90::launch_dependents();
    sm90::wait_prerequisites();
  }
  TileScheduler<kType, kBlockM, kTileN, kGroupN, kNumMulticast, kShareB> scheduler(m, kShapeN, grouped_layout,
                                                                                  num_groups);
  if constexpr (kType == GemmType::kNormal) scheduler.set_tail_split(num_splits, tail_tiles, split_k_quot, split_k_rem);
  PipelineState<kNumStages> pipe;
  Tile t;
  // Every role runs its whole tiles in a loop with the compile-time K range, then its cluster's unit of
  // the split tail (if any) with its own range: a run-time range inside the loop left the pipeline's
  // stage index in vector registers, and ptxas rebuilt the wgmma descriptors from it in every K block
  // (16 R2UR: 192-198 instructions per K block at block N 192 against 173-175).
  // First row of the tile in A (and D) viewed as 2-D, first row of its B slice.
  const auto a_row0 = [&](const Tile& tile) {
    return (kType == GemmType::kGroupedMasked ? tile.group * m : 0) + tile.m_block * kBlockM;
  };
  const auto b_row0 = [&](const Tile& tile) { return (kGrouped ? tile.group * kShapeN : 0) + tile.n_block * kBlockN; };
  // The tile's first scale row of B in its group: its first 128-column block, or its gate half's.
  const auto sfb_block = [&](const Tile& tile) {
    return kSwiGlu ? tile.n_block * (kBlockN / 64) : tile.n_block * kBlockN / 128;
  };
  // ... a row of map_sfb.
  const auto sfb_row0 = [&](const Tile& tile) { return (kGrouped ? tile.group * kNumSfbRows : 0) + sfb_block(tile); };
  // f(tile) for the scheduler's tile, or (kSwiGlu, block N 128) for each n-block of its pair in turn.
  const auto for_each_block = [&](const Tile& tile, auto&& f) {
    if constexpr (kSwiGlu && !kSwiGluWide) {
      Tile block = tile;
#pragma unroll 1
      for (uint32_t i = 0; i < 2; ++i) {
        block.n_block = tile.n_block * 2 + i;
        f(block);
      }
    } else {
      f(tile);
    }
  };

  if (threadIdx.x >= kNumMathThreads) {
    sm90::setmaxnreg_dec<kProducerRegisters>();
    const uint32_t producer_warp = warp - kNumMathWG * 4;
    if (producer_warp == 0 && lane == 0) {
      const uint32_t rank = kNumMulticast > 1 ? sm90::cluster_ctarank() : 0;
      [[maybe_unused]] PipelineState<Smem::kSfaRing> sfa_pipe;
      // kTightBoxes: where M cuts the last m-block its boxes (map_a_tail, map_sfa_tail) end at row
      // m, so the transactions are that much shorter: A's and the table's exactly, an MN-major scale
      // box at m rounded up to 4 floats (16 bytes). Rows past them keep stale bytes, which reach only
      // accumulator rows past M, never stored. In a cluster the CTA whose share M cuts loads the rest
      // of it, one whose share lies past M none. Likewise B's rows past N in the last n-block
      // (map_b_tail; its stale rows reach only columns past N).
      const auto tma_bytes = [&](uint32_t rows) {
        return Smem::kTmaBytes - (kBlockM - rows) * kBlockK -
               (kScaleLoad == kScaleTmaMnMajor ? (kBlockM - fp8_gemm_sfa_box_rows(rows, kBlockM, kScaleLoad)) * 4 : 0u);
      };
      [[maybe_unused]] const auto sfa_slot_bytes = [&](uint32_t rows) {
        return Smem::kSfaSlot - (kBlockM - rows) * Smem::kSfaCols * 4;
      };
      // The table's box: every K block of the tile's rows.
      [[maybe_unused]] const auto load_sfa = [&](uint32_t row, uint32_t rows) {
        sfa_ring.producer_acquire(sfa_pipe);
        uint64_t* full = sfa_ring.full + sfa_pipe.stage;
        sm90::mbarrier_arrive_expect_tx(full, sfa_slot_bytes(rows));
        sm90::tma_load_2d(smem_sfa + sfa_pipe.stage * (Smem::kSfaSlot / 4),
                          rows < kBlockM ? &map_sfa_tail : &map_sfa, full, 0, row);
        sfa_pipe.advance();
      };
      const auto load_tile = [&](const Tile& t, uint32_t kb_begin, uint32_t kb_end) {
        const uint32_t row_a = a_row0(t) + (kShareB ? 0 : rank * kMulticastRowsA), row_b = b_row0(t);
        const uint32_t row_sfa = a_row0(t), row_sfb = sfb_row0(t);
        // Without kTightBoxes every box is whole (rows, rows_b: kBlockM, kBlockN). So is a pair's
        // m-block past M (kShareB, !t.valid).
        const uint32_t rows = kTightBoxes && a_row0(t) < m ? min(m - a_row0(t), kBlockM) : kBlockM;
        // A padding n-block of a cluster (past N) keeps its whole box.
        const uint32_t rows_b = kTightB ? min(kShapeN - row_b, kBlockN) : kBlockN;
        const uint32_t bytes = tma_bytes(rows) - (kBlockN - rows_b) * kBlockK;
        // A cluster's CTA loads its share of A's rows: kMulticastRowsA, or with kTightBoxes fewer
        // where M cuts it, none past M.
        const uint32_t rank_rows =
            rows > rank * kMulticastRowsA ? min(rows - rank * kMulticastRowsA, kMulticastRowsA) : 0u;
        const bool loads_a = !kTightBoxes || rank_rows > 0;
        // The table: every K block of the tile's rows, its split unit's too (it reads its own columns).
        if constexpr (kScaleTable) load_sfa(row_sfa, rows);
        for (uint32_t kb = kb_begin; kb < kb_end; ++kb, pipe.advance()) {
          ring.producer_acquire(pipe);
          uint64_t* full = ring.full + pipe.stage;
          sm90::mbarrier_arrive_expect_tx(full, bytes);
          if constexpr (kScaleTma) {
            // Each CTA of a cluster loads the whole A scale box (1-4 KB against the tiles' 48 KB):
            // multicasting half from each took as long (bench/RESULTS.md, session 46). A box's
            // innermost coordinate must fall on 16 bytes (else the TMA unit faults with an illegal
            // instruction): K-major boxes start at the K block's group of 4, read at its column.
            float* sf = smem_sf + pipe.stage * Smem::kSfFloats;
            if constexpr (kScaleLoad == kScaleTmaMnMajor) {
              sm90::tma_load_2d(sf, rows < kBlockM ? &map_sfa_tail : &map_sfa, full, row_sfa, kb);
            } else if constexpr (kScaleLoad == kScaleTmaKMajor) {
              sm90::tma_load_2d(sf, &map_sfa, full, kb & ~3u, row_sfa);
            }
            sm90::tma_load_2d(sf + Smem::kSfb, &map_sfb, full, kb & ~3u, row_sfb);
          }
          if constexpr (kShareB) {
            // map_b's box is kHalfRowsB rows. The full barrier expects a whole B tile either way.
            uint8_t* smem_b = smem + Smem::kOffsetB + pipe.stage * Smem::kB;
            sm90::tma_load_2d(smem + Smem::kOffsetA + pipe.stage * Smem::kA, rows < kBlockM ? &map_a_tail : &map_a,
                              full, kb * kBlockK, row_a);
            if (t.share_b) {
              sm90::tma_load_2d_multicast(smem_b + rank * kHalfRowsB * kBlockK, &map_b, full, kb * kBlockK,
                                          row_b + rank * kHalfRowsB, (1u << kNumMulticast) - 1);
            } else {
              sm90::tma_load_2d(smem_b, &map_b, full, kb * kBlockK, row_b);
              sm90::tma_load_2d(smem_b + kHalfRowsB * kBlockK, &map_b, full, kb * kBlockK, row_b + kHalfRowsB);
            }
          } else {
            uint8_t* smem_a = smem + Smem::kOffsetA + pipe.stage * Smem::kA + rank * kMulticastRowsA * kBlockK;
            if constexpr (kNumMulticast > 1) {
              if (loads_a) {
                const TmaDescriptor* map = kTightBoxes && rank_rows < kMulticastRowsA ? &map_a_tail : &map_a;
                sm90::tma_load_2d_multicast(smem_a, map, full, kb * kBlockK, row_a, (1u << kNumMulticast) - 1);
              }
            } else {
              sm90::tma_load_2d(smem_a, rows < kBlockM ? &map_a_tail : &map_a, full, kb * kBlockK, row_a);
            }
            sm90::tma_load_2d(smem + Smem::kOffsetB + pipe.stage * Smem::kB, rows_b < kBlockN ? &map_b_tail : &map_b,
                              full, kb * kBlockK, row_b);
          }
        }
      };
      while (scheduler.next(t)) for_each_block(t, [&](const Tile& b) { load_tile(b, 0, kNumKBlocks); });
      if (scheduler.tail_unit(t)) for_each_block(t, [&](const Tile& b) { load_tile(b, b.k_begin, b.k_end); });
      if constexpr (kNumMulticast > 1) {
        // The peers arrive on this CTA's empty barriers and multicast into its stages: it may only
        // exit once every stage's last fill has been released by the consumers of every CTA.
        for (uint32_t s = 0; s < kNumStages; ++s, pipe.advance()) ring.producer_acquire(pipe);
      }
    } else if (!kScaleTma && producer_warp >= 1 && producer_warp <= kNumScaleWarps) {
      // The scale warps take the stages in turn, so each issues 1/kNumScaleWarps of the copies. One
      // warp alone was the pipeline's bound with 4-byte copies: ~140 instructions per K block at ~7
      // cycles each, never waiting for a free stage while the math warps waited on the full barrier
      // (ncu, 4096 x 4096 x 7168).
      using Gather = ScaleGather<kBlockM, kGatherChunk, kNumStages, Smem::kSfFloats, kNumScaleWarps, kGatherPrefetch>;
      Gather gather(ring, smem_sf, lane, producer_warp - 1);
      const auto load_scales = [&](const Tile& t, uint32_t kb_begin, uint32_t kb_end) {
        const uint32_t row_a = a_row0(t) + gather.first_row();
        // Rows past the problem (or past a masked group's max_m) read no scale.
        const uint32_t row_end = kType == GemmType::kGroupedMasked ? (t.group + 1) * m : m;
        const LaneScaleRows<Gather::kRows> rows_a(row_a, row_end, sfa_stride_m, lane);
        const uint32_t sfb_row = sfb_block(t) + lane;
        const bool valid_b = lane < Smem::kSfbRows && sfb_row < kNumSfbRows;
        SfbLanes<Smem::kSfb, Smem::kSfbRows, kGatherChunk> sfb_lanes{
            sfb + (valid_b ? uint64_t(t.group) * sfb_stride_g + uint64_t(sfb_row) * sfb_stride_n : 0), valid_b,
            sfb_stride_k};
        gather.tile(pipe, sfa, rows_a, sfa_stride_k, sfb_lanes, kb_begin, kb_end);
      };
      while (scheduler.next(t)) for_each_block(t, [&](const Tile& b) { load_scales(b, 0, kNumKBlocks); });
      if (scheduler.tail_unit(t)) for_each_block(t, [&](const Tile& b) { load_scales(b, b.k_begin, b.k_end); });
    }
    return;
  }

  sm90::setmaxnreg_inc<kMathRegisters>();
  // Broadcast from lane 0: ptxas then keeps the warpgroup index, and the A descriptor built from
  // it, in uniform registers (no R2UR moves before each wgmma).
  const uint32_t math_wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const uint32_t tile_row0 = math_wg * 64 + (warp % 4) * 16 + lane / 4;
  [[maybe_unused]] const MathTurns turns{math_wg};
  // Stage 0's descriptors of this warpgroup's A rows and of B: a stage's are these plus its offset
  // (>> 4, the descriptors' address unit), without rebuilding them from addresses per K block.
  const uint64_t desc_a0 = sm90::make_sw128_kmajor_desc(smem + Smem::kOffsetA + math_wg * 64 * kBlockK);
  const uint64_t desc_b0 = sm90::make_sw128_kmajor_desc(smem + Smem::kOffsetB);
  if constexpr (kPingPong) turns.start();
  float acc[Wgmma::kNumAccum];
  float final_acc[kNumWaves * kNumHalves * Wgmma::kNumAccum];
  // kSwiGlu: the act of the pair's first n-block, until the second's epilogue.
  [[maybe_unused]] float swiglu_held[SwiGluTile<kSwiGlu && !kSwiGluWide ? kBlockN : 16>::kActFloats];
  // Masked groups: the scheduler's loop runs on masked_m loaded per thread, which ptxas cannot prove
  // warp-uniform, so it kept the stage index out of uniform registers: 16 R2UR per K block rebuilt
  // the wgmma descriptors. Lane 0's stage, broadcast, is uniform (1-3 left). Contiguous 256-row
  // tiles (group ids loaded per thread too) had 32 R2UR in their two waves' K block, 1 broadcast.
  constexpr bool kBroadcastStage = kType == GemmType::kGroupedMasked || (kNumWaves > 1 && kGrouped);

  // The thread's first A scale, as pointers: in stage 0, and (kScaleTable) in the slot being read,
  // set once its box has landed. Stage, wave and K-block offsets then add to them, without the
  // 32-bit index sums (tile_row0 + stage * kSfFloats) that ptxas recomputed and scaled (IADD3 +
  // LEA) per row and K block, unable to fold them into the loads' addresses.
  [[maybe_unused]] const float* sfa_thread = smem_sf + tile_row0 * Smem::kSfaRow;
  [[maybe_unused]] const float* sfa_row = smem_sfa;
  // The K block's scales from its stage (A's from the tile's table): A's two rows of the thread
  // per wave, B's two blocks (kSwiGluWide: the gate and up halves of both).
  const auto read_scales = [&](uint32_t stage, uint32_t kb, float (&sa)[kNumWaves][2], float (&sb)[2 * kNumHalves]) {
    const float* sf = smem_sf + stage * Smem::kSfFloats;
    // The K block's column in a box of 4 K blocks (TMA scale loads), else 0.
    const uint32_t column = kScaleTma ? kb % 4 : 0;
    if constexpr (kScaleTable) {
      sa[0][0] = sfa_row[kb];
      sa[0][1] = sfa_row[8 * Smem::kSfaCols + kb];
    } else {
      const float* sf_a = sfa_thread + stage * Smem::kSfFloats + (kScaleLoad == kScaleTmaKMajor ? column : 0);
#pragma unroll
      for (uint32_t w = 0; w < kNumWaves; ++w) {
        sa[w][0] = sf_a[w * kWaveRows * Smem::kSfaRow];
        sa[w][1] = sf_a[(w * kWaveRows + 8) * Smem::kSfaRow];
      }
    }
#pragma unroll
    for (uint32_t i = 0; i < 2 * kNumHalves; ++i) sb[i] = sf[Smem::kSfb + i * Smem::kSfbStep + column];
  };
  // kOverlap: the stage is free once its wgmmas are done (its scales are in registers). One arrival
  // per warp (per warp and CTA of a cluster), predicated: a branch while the next K block's wgmmas
  // are in flight would serialize them (C7518).
  const auto release = [&](const PipelineState<kNumStages>& at) {
    const uint32_t stage = kBroadcastStage ? __shfl_sync(0xffffffffu, at.stage, 0) : at.stage;
    __syncwarp();
    if constexpr (kNumMulticast > 1) {
      sm90::mbarrier_arrive_cluster_if(ring.empty + stage, lane, lane < kNumMulticast);
    } else {
      sm90::mbarrier_arrive_if(ring.empty + stage, lane == 0);
    }
  };

  // kOverlap's K loop: K block i's wgmmas go into set (i % 2) as soon as its stage is full, then
  // the warpgroup waits only for K block i - 1's (wait<1>), releases that stage and promotes it.
  [[maybe_unused]] const auto overlapped_k_loop = [&](auto split, uint32_t split_col, uint32_t kb_begin,
                                                      uint32_t kb_end) {
    float acc2[Wgmma::kNumAccum];
    // kOverlap runs no column halves (kNumHalves is 1): the arrays take read_scales' shape only.
    float sa[2][kNumWaves][2], sb[2][2 * kNumHalves];
    PipelineState<kNumStages> next = pipe;  // the stage whose wgmmas go next; pipe: the next to release
    const auto issue = [&](float* set, float (&set_sa)[kNumWaves][2], float (&set_sb)[2 * kNumHalves], uint32_t kb) {
      ring.consumer_wait(next);
      const uint32_t stage = kBroadcastStage ? __shfl_sync(0xffffffffu, next.stage, 0) : next.stage;
      read_scales(stage, kb, set_sa, set_sb);
      const uint64_t desc_a = desc_a0 + stage * (Smem::kA / 16);
      const uint64_t desc_b = desc_b0 + stage * (Smem::kB / 16);
      Wgmma::issue_k_block(desc_a, desc_b, set, false);
      next.advance();
    };
    const auto retire = [&](float* set, const float (&set_sa)[kNumWaves][2], const float (&set_sb)[2 * kNumHalves]) {
      release(pipe);
      pipe.advance();
      promote_fp8_accum<kBlockN / kNumHalves, decltype(split)::value>(final_acc, set, set_sa[0][0], set_sa[0][1],
                                                                        set_sb[0], set_sb[1], split_col);
    };
    // Rounds of kOverlapRound K blocks, unrolled, so that each set's registers are named at compile
    // time and every round ends with no wgmma in flight: ptxas serialized the wgmmas of a loop that
    // carried one across its back edge (C7514, reads of the other set "inside the pipeline stage").
    for (uint32_t kb = kb_begin; kb < kb_end; kb += kOverlapRound) {
      issue(acc, sa[0], sb[0], kb);
#pragma unroll
      for (uint32_t i = 0; i < kOverlapRound; i += 2) {
        issue(acc2, sa[1], sb[1], kb + i + 1);
        Wgmma::template wait<1>(acc);
        retire(acc, sa[0], sb[0]);
        if (i + 2 < kOverlapRound) {
          issue(acc, sa[0], sb[0], kb + i + 2);
          Wgmma::template wait<1>(acc2);
        } else {
          Wgmma::template wait<0>(acc2);
        }
        retire(acc2, sa[1], sb[1]);
      }
    }
  };

  [[maybe_unused]] PipelineState<Smem::kSfaRing> sfa_pipe;
  // The slot of sfa_pipe once its box has landed; its release once every math warp has read it.
  [[maybe_unused]] const auto acquire_sfa = [&] {
    sfa_ring.consumer_wait(sfa_pipe);
    sfa_row = smem_sfa + sfa_pipe.stage * (Smem::kSfaSlot / 4) + tile_row0 * Smem::kSfaCols;
  };
  [[maybe_unused]] const auto release_sfa = [&] {
    __syncwarp();
    if (lane == 0) sfa_ring.consumer_release(sfa_pipe);
    sfa_pipe.advance();
  };
  const auto math_tile = [&](const Tile& t, uint32_t kb_begin, uint32_t kb_end) {
#pragma unroll
    for (uint32_t i = 0; i < kNumWaves * kNumHalves * Wgmma::kNumAccum; ++i) final_acc[i] = 0.0f;
    if constexpr (kScaleTable) acquire_sfa();
    constexpr bool kMasked = kType == GemmType::kGroupedMasked;
    // kSwiGlu: the thread's rows and their weights (every lane's, for the amax shuffles). A pair's
    // m-block past M or a masked group's count (kShareB, !t.valid) has none: the row counts below
    // would wrap around and read weights past the end.
    [[maybe_unused]] const auto swiglu_rows = [&] {
      if constexpr (kSwiGlu) {
        const uint32_t rows = kShareB && !t.valid ? 0u
                              : kMasked          ? scheduler.masked_rows(t)
                                                 : min(m - t.m_block * kBlockM, kBlockM);
        return SwiGluRows(swiglu.weights, a_row0(t), tile_row0, rows);
      } else {
        return 0;
      }
    }();

    const auto k_loop = [&](auto split) {
      const uint32_t split_col = 128 - (t.n_block * kBlockN) % 128;
      if constexpr (kOverlap) {
        // Whole tiles only; the tail split's units (dense GEMMs) take the plain loop.
        if (kType != GemmType::kNormal || (kb_begin == 0 && kb_end == kNumKBlocks)) {
          overlapped_k_loop(split, split_col, kb_begin, kb_end);
          return;
        }
      }
      // Unrolled, ptxas may issue the next K block's full-barrier wait among this one's promotion.
#pragma unroll kKUnroll
      for (uint32_t kb = kb_begin; kb < kb_end; ++kb, pipe.advance()) {
        // The turn before the full barrier: the same order, and ptxas schedules the K block in fewer
        // instructions (block N 192: 175 per K block against 198 with the turn next to the wgmmas).
        if constexpr (kPingPong) turns.take();
        ring.consumer_wait(pipe);
        // Scales first: their shared-memory latency hides behind the wgmmas.
        const uint32_t stage = kBroadcastStage ? __shfl_sync(0xffffffffu, pipe.stage, 0) : pipe.stage;
        float sa[kNumWaves][2], sb[2 * kNumHalves];
        read_scales(stage, kb, sa, sb);
        const uint64_t desc_b = desc_b0 + stage * (Smem::kB / 16);
        // Parts of the K block, each one wgmma accumulator set: waves of rows, or halves of columns.
#pragma unroll
        for (uint32_t p = 0; p < kNumWaves * kNumHalves; ++p) {
          const uint32_t w = p / kNumHalves, h = p % kNumHalves;
          const uint64_t desc_a = desc_a0 + (stage * Smem::kA + w * kWaveRows * kBlockK) / 16;
          // Turns for every part (the first's was taken above): the other warpgroup's half runs on
          // the tensor cores while this one promotes.
          if constexpr (kPingPong) {
            if (p > 0) turns.take();
          }
          Wgmma::issue_k_block(desc_a, desc_b + h * ((kBlockN / kNumHalves) * kBlockK / 16), acc, false);
          if constexpr (kPingPong) turns.pass();
          Wgmma::template wait<0>(acc);

          // The stage is free once the last part's wgmmas have read it (its scales are in registers).
          if (p + 1 == kNumWaves * kNumHalves) {
            // Branches, not `release`: its broadcast stage and predicated arrivals cost masked
            // 128-row tiles 16 R2UR per K block here (SASS), and no wgmma is in flight to serialize.
            __syncwarp();
            if constexpr (kNumMulticast > 1) {
              if (lane < kNumMulticast) sm90::mbarrier_arrive_cluster(ring.empty + pipe.stage, lane);
            } else if (lane == 0) {
              ring.consumer_release(pipe);
            }
          }
          promote_fp8_accum<kBlockN / kNumHalves, decltype(split)::value>(
              final_acc + p * Wgmma::kNumAccum, acc, sa[w][0], sa[w][1], sb[2 * h], sb[2 * h + 1], split_col);
        }
      }
    };
    if constexpr (kSwiGlu) {
      k_loop(cuda::std::integral_constant<uint32_t, kParitySplit>{});
    } else {
      with_static_split<kBlockN>(t.n_block * kBlockN, k_loop);
    }

    // The K loops have read every scale of the table's slot into registers: the producer may refill it.
    if constexpr (kScaleTable) release_sfa();

    // A cluster's n-block past N, or (kShareB) its m-block past M or of padding, was computed only to
    // keep the peers in step: nothing to store.
    if constexpr (kShareB) {
      if (!t.valid) return;
    } else if (kNumMulticast > 1 && t.n_block * kBlockN >= kShapeN) {
      return;
    }
    if constexpr (kType == GemmType::kNormal) {
      // A split tile's units but the last to finish leave their partial sums to it.
      const uint32_t slot = t.tail_tile * kNumMulticast + (kNumMulticast > 1 ? sm90::cluster_ctarank() : 0);
      if (t.num_splits > 1 &&
          !split_reduce<kNumWaves * Wgmma::kNumAccum, kNumMathThreads, 1>(
              final_acc, split_workspace, split_counters, slot, t.split, t.num_splits, threadIdx.x)) {
        return;
      }
    }
    if constexpr (kSwiGluWide) {
      swiglu_epilogue_wide<kBlockN / 2>(final_acc, t.n_block, swiglu_rows, swiglu, lane);
      return;
    } else if constexpr (kSwiGlu) {
      swiglu_epilogue<kBlockN>(final_acc, swiglu_held, t.n_block, swiglu_rows, swiglu, lane);
      return;
    }
    store_tile<kBlockM, kBlockN, kSwizzleDBytes, kResidualType, kMasked, kNumMathThreads, kNumWaves, kWaveRows,
               kWgStore>(
        &map_d, smem_d, final_acc, tile_row0, lane, c, ldc, a_row0(t), t.n_block * kBlockN, m, kShapeN,
        kMasked ? t.m_block * kBlockM : a_row0(t), t.group, kMasked ? scheduler.masked_rows(t) : kBlockM);
  };
  while (scheduler.next(t)) for_each_block(t, [&](const Tile& b) { math_tile(b, 0, kNumKBlocks); });
  if constexpr (kType == GemmType::kNormal) {
    if (scheduler.tail_unit(t)) for_each_block(t, [&](const Tile& b) { math_tile(b, b.k_begin, b.k_end); });
  }
  if constexpr (kPingPong) turns.finish();
  // The issuing warps' last stores must have read shared memory before the CTA exits; the kernel's
  // completion covers their writes to global memory.
  if (store_tile_issuer<kWgStore>()) sm90::tma_store_wait_read<0>();
#endif
}

}  // namespace moe_kernels
