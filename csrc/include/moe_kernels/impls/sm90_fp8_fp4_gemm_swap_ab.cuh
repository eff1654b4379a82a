#pragma once
// FP8 x FP4 m-grouped GEMM, operands swapped: D^T = B[g] @ A^T with the weights B as wgmma's A
// operand, converted from E2M1 to E4M3 in the math warps' registers (common/fp4.cuh) and fed to
// wgmma from registers, and the tokens of A as wgmma's N dimension read from shared memory.
// Against sm90_fp8_fp4_gemm_nt this drops the converted tile's shared-memory round trip (16 KB
// written and read back per 128x128 block), the converter warps and their hand-off barrier; at
// decode sizes also the 64-row wgmma whose rows were mostly padding.
//   decode tiles:  8-32 tokens of a masked group, 1, 2 or 4 math warpgroups;
//   prefill tiles: 64 or 128 tokens of a masked group, or 128 of one group's contiguous rows (the
//                  layout's alignment is a multiple of 128), two math warpgroups.
//
// Roles (one CTA per SM, persistent over tiles of kBlockT tokens x 64 * kNumMathWG weight rows):
//   warpgroups [0, kNumMathWG): math — each owns 64 weight rows: per 128-deep K block it loads
//                               its fragment bytes, converts them, runs 4 x wgmma 64xkBlockTx32,
//                               and promotes with the row's B scale and the token's A scale;
//   last warpgroup, warp 0:     TMA producer (activations 128B-swizzled, packed weights 64B-swizzled);
//   last warpgroup, warps 1-3:  scale producers (packed weights): a warp gathers one stage's A scales
//                               and B exponent words, finds the tile's reference exponent of each K
//                               block (common/fp4.cuh, block_reference) and writes the A scales
//                               multiplied by its factor; the warps take the stages in turn;
//   last warpgroup, warp 1:     (fragment layout) cp.async of the A scales.
//
// kFragmentLayout (v2, weights and scales laid out once by kernels/_fp4_fragment.py; one TMA box
// per K block brings both, so the scale warp only copies the A scales): each thread reads its
// fragment with two 16-byte loads, decodes E4M3 = E2M1 x 2^-6 with bit masks (no tables), and
// every 32-deep K step accumulates separately so that its exact 1x32 scale 2^(e - 127) is
// applied in the promotion (2^6 once per tile in the epilogue).
//
// A stage carries kKBlocks (1 or 2) K blocks of 128: the barrier wait, release and stage
// addressing are paid once for all of them (they were half the math warps' instructions).

#include <cuda_bf16.h>
#include <moe_kernels/common/epilogue.cuh>
#include <moe_kernels/common/fp4.cuh>
#include <moe_kernels/common/fp4_fragments.cuh>
#include <moe_kernels/common/pipeline.cuh>
#include <moe_kernels/common/scheduler.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>
#include <moe_kernels/common/sm90_wgmma.cuh>

namespace moe_kernels {

// Fragment layout (kernels/_fp4_fragment.py): per K block of 128 and 64 weight rows, 4096 bytes of
// fragments followed by the rows' 64 exponent words, so one TMA box brings weights and scales.
constexpr uint32_t kFragmentWeightBytes = 4096;
constexpr uint32_t kFragmentBlockBytes = kFragmentWeightBytes + 64 * 4;

// A stage holds kKBlocks K blocks of 128; block j of every operand sits at j x its block size.
template <uint32_t kBlockT, uint32_t kBlockW, uint32_t kKBlocks, uint32_t kNumStages, bool kFragmentLayout>
struct Fp8Fp4SwapAbSmem {
  static constexpr uint32_t kBlockK = 128;
  static constexpr uint32_t kD = (kBlockT * kBlockW * 2 + 1023) / 1024 * 1024;  // bf16 [tokens][rows], swizzled
  static constexpr uint32_t kBlockA = kBlockT * kBlockK;  // activations, 128-byte swizzle
  // Packed weights (64-byte swizzle), or fragments with their exponent words.
  static constexpr uint32_t kBlockWBytes = kFragmentLayout ? kBlockW / 64 * kFragmentBlockBytes : kBlockW * kBlockK / 2;
  // A scales; for packed weights also the B exponent words and the reference word (16 bytes).
  static constexpr uint32_t kBlockScales = (kBlockT + (kFragmentLayout ? 0 : kBlockW + 4)) * 4;
  static constexpr uint32_t kA = kKBlocks * kBlockA;
  static constexpr uint32_t kW = kKBlocks * kBlockWBytes;
  static constexpr uint32_t kScaleBytes = kKBlocks * kBlockScales;
  static constexpr uint32_t kOffsetA = kD;
  static constexpr uint32_t kOffsetW = kOffsetA + kNumStages * kA;
  static constexpr uint32_t kOffsetScales = kOffsetW + kNumStages * kW;
  static constexpr uint32_t kOffsetBarriers = kOffsetScales + kNumStages * kScaleBytes;
  static constexpr uint32_t kTotal = kOffsetBarriers + 2 * kNumStages * 8;
  static_assert(kBlockA % 1024 == 0, "128-byte swizzled K blocks must stay 1024-byte aligned");
  static_assert(kBlockWBytes % (kFragmentLayout ? 128 : 512) == 0, "TMA destinations must stay aligned");
};

// shape_m: max_m (masked) or the rows of A (contiguous); grouped_layout: masked_m or m_indices.
// kBlockRef: packed weights' K blocks take the tile's reference exponent where it fits (false: each
// row's own, as for every K block where it does not; for A/B runs, MOE_FP4_BLOCK_REF=0).
template <int kGemmType, uint32_t kShapeN, uint32_t kShapeK, uint32_t kBlockT, uint32_t kNumMathWG, uint32_t kKBlocks,
          uint32_t kNumStages, uint32_t kGroupN, bool kFragmentLayout = false, bool kBlockRef = true>
__global__ void __launch_bounds__((kNumMathWG + 1) * 128, 1)
    sm90_fp8_fp4_gemm_nt_swap_ab(uint32_t shape_m, const int* __restrict__ grouped_layout, uint32_t num_groups,
                                 const float* __restrict__ sfa, uint32_t sfa_stride_m, uint32_t sfa_stride_k,
                                 const uint8_t* __restrict__ sfb, uint32_t sfb_stride_g, uint32_t sfb_stride_n,
                                 const __grid_constant__ TmaDescriptor map_a,
                                 const __grid_constant__ TmaDescriptor map_w,
                                 const __grid_constant__ TmaDescriptor map_d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uint32_t kBlockW = 64 * kNumMathWG;
  using Smem = Fp8Fp4SwapAbSmem<kBlockT, kBlockW, kKBlocks, kNumStages, kFragmentLayout>;
  using Wgmma = sm90::Fp8WgmmaRS<kBlockT>;
  constexpr uint32_t kBlockK = Smem::kBlockK;
  constexpr uint32_t kNumMathThreads = kNumMathWG * 128;
  constexpr uint32_t kNumKBlocks = kShapeK / kBlockK;
  constexpr uint32_t kNumKStages = kNumKBlocks / kKBlocks;
  static_assert(kShapeK % kBlockK == 0, "K must be a multiple of 128");
  static_assert(kNumKBlocks % kKBlocks == 0, "whole K blocks per stage");
  // Scale producers: for packed weights three warps take the stages in turn, so that three stages'
  // loads are in flight (a warp waits for its loads before it can reduce them). With the fragment
  // layout the exponents come by TMA and one warp copies the A scales.
  constexpr uint32_t kNumScaleWarps = kFragmentLayout ? 1 : 3;
  // A scale warp's previous turn was kNumScaleWarps stages back; with fewer stages than scale warps
  // its wait for the stage to drain could pass on the phase before (the same parity).
  static_assert(kFragmentLayout || kNumStages >= kNumScaleWarps, "packed weights need a stage per scale warp");
  static_assert(kShapeN % 8 == 0, "N must be a multiple of 8");
  constexpr auto kType = static_cast<GemmType>(kGemmType);
  constexpr bool kMasked = kType == GemmType::kGroupedMasked;
  static_assert(kType != GemmType::kNormal, "the FP4-weight GEMM is m-grouped");
  static_assert(kBlockT % 8 == 0 && kBlockT <= 128, "the token block is a multiple of 8 up to 128");
  static_assert(kNumMathWG == 1 || kNumMathWG == 2 || kNumMathWG == 4, "64, 128 or 256 weight rows per tile");
  static_assert(!kFragmentLayout || (kMasked && kBlockT <= 32), "the decode layout serves masked decode tiles");
  static_assert(kBlockT <= 32 || kKBlocks == 1, "prefill tiles take one K block per stage");
  // Fragment layout: [G, K/128, ceil(N/64), kFragmentBlockBytes], viewed by TMA as rows of 256 bytes.
  constexpr uint32_t kRowBlocks = (kShapeN + 63) / 64;
  constexpr uint32_t kFragmentRows = kFragmentBlockBytes / 256;
  static_assert(!kFragmentLayout || kBlockT <= 16 || kNumMathWG <= 2,
                "four accumulator sets of kBlockT / 2 fit the 96 registers of five warpgroups up to 16 tokens");
  // Decode tiles need no setmaxnreg: at up to 640 threads every role fits the launch budget (math
  // holds 16 fragment registers and two accumulator sets of kBlockT / 2). Prefill tiles' math holds
  // two sets of 64 and two fragment sets (prefill_k_loop): the producer warpgroup gives up its
  // registers (at 56 its scale warps' stage loop keeps its loads in registers and math keeps 224).
  constexpr bool kSetMaxNReg = kBlockT > 32;
  constexpr uint32_t kProducerRegisters = 56;
  constexpr uint32_t kLaunchRegisters = sm90::launch_registers<(kNumMathWG + 1) * 128>() / 128;
  constexpr uint32_t kMathShare = (kLaunchRegisters - kProducerRegisters) / kNumMathWG / 8 * 8;
  constexpr uint32_t kMathRegisters = kMathShare < 240 ? kMathShare : 240;
  static_assert(!kSetMaxNReg || (kNumMathWG <= 2 && kMathRegisters >= 224),
                "past 32 tokens math needs two accumulator sets of kBlockT / 2 and two fragment sets");

  extern __shared__ __align__(1024) uint8_t smem[];
  auto* barriers = reinterpret_cast<uint64_t*>(smem + Smem::kOffsetBarriers);
  const StageRing<kNumStages> ring{barriers, barriers + kNumStages};
  // K block j of a stage: its A scales (kBlockT), then for packed weights the tile's exponent words
  // (kBlockW) and the reference word.
  const auto block_scales = [&](uint32_t stage, uint32_t j) {
    return reinterpret_cast<float*>(smem + Smem::kOffsetScales + stage * Smem::kScaleBytes + j * Smem::kBlockScales);
  };
  const auto block_words = [&](uint32_t stage, uint32_t j) {
    return reinterpret_cast<uint32_t*>(block_scales(stage, j) + kBlockT);
  };

  const uint32_t warp = threadIdx.x / 32;
  const uint32_t lane = sm90::lane_id();
  if (threadIdx.x == kNumMathThreads) {
    sm90::tma_prefetch_descriptor(&map_a);
    sm90::tma_prefetch_descriptor(&map_w);
    sm90::tma_prefetch_descriptor(&map_d);
    ring.init(1 + 32, kNumMathWG * 4);  // the TMA producer and one scale warp's lanes per stage
  }
  __syncthreads();

  // Tiles: m blocks of kBlockT tokens (of a group's masked_m, or of one group's aligned rows), n
  // blocks of kBlockW weight rows.
  TileScheduler<kType, kBlockT, kBlockW, kGroupN> scheduler(shape_m, kShapeN, grouped_layout, num_groups);
  PipelineState<kNumStages> pipe;
  Tile t;
  // The tile's first row of A (and of D): a masked group's rows start at group x max_m.
  const auto row_a0 = [&](const Tile& tile) { return (kMasked ? tile.group * shape_m : 0) + tile.m_block * kBlockT; };

  if (threadIdx.x >= kNumMathThreads) {
    if constexpr (kSetMaxNReg) sm90::setmaxnreg_dec<kProducerRegisters>();
    const uint32_t producer_warp = warp - kNumMathWG * 4;
    if (producer_warp == 0 && lane == 0) {
      while (scheduler.next(t)) {
        const uint32_t row_a = row_a0(t);
        const uint32_t row_w = t.group * kShapeN + t.n_block * kBlockW;
        for (uint32_t ks = 0; ks < kNumKStages; ++ks, pipe.advance()) {
          ring.producer_acquire(pipe);
          uint64_t* full = ring.full + pipe.stage;
          sm90::mbarrier_arrive_expect_tx(full, Smem::kA + Smem::kW);
#pragma unroll
          for (uint32_t j = 0; j < kKBlocks; ++j) {
            const uint32_t kb = ks * kKBlocks + j;
            uint8_t* smem_a = smem + Smem::kOffsetA + pipe.stage * Smem::kA + j * Smem::kBlockA;
            uint8_t* smem_w = smem + Smem::kOffsetW + pipe.stage * Smem::kW + j * Smem::kBlockWBytes;
            sm90::tma_load_2d(smem_a, &map_a, full, kb * kBlockK, row_a);
            if constexpr (kFragmentLayout) {
              const uint32_t first =
                  ((t.group * kNumKBlocks + kb) * kRowBlocks + t.n_block * kNumMathWG) * kFragmentRows;
              sm90::tma_load_2d(smem_w, &map_w, full, 0, first);
            } else {
              sm90::tma_load_2d(smem_w, &map_w, full, kb * kBlockK / 2, row_w);
            }
          }
        }
      }
    } else if (producer_warp >= 1 && producer_warp <= kNumScaleWarps) {
      uint32_t turn = 0;  // the CTA's stages so far: stage `turn` is scale warp turn % kNumScaleWarps's
      while (scheduler.next(t)) {
        // Tokens past the problem (or a masked group's max_m) and rows past N read nothing: their
        // scales are zero, and so are the outputs nobody stores.
        const uint32_t tokens = min(kBlockT, shape_m - t.m_block * kBlockT);
        const float* sfa_tile = sfa + uint64_t(row_a0(t)) * sfa_stride_m;
        if constexpr (kFragmentLayout) {
          for (uint32_t ks = 0; ks < kNumKStages; ++ks, pipe.advance()) {
            ring.producer_acquire(pipe);
#pragma unroll
            for (uint32_t j = 0; j < kKBlocks; ++j) {
              float* scales = block_scales(pipe.stage, j);
              const uint64_t kb = ks * kKBlocks + j;
#pragma unroll
              for (uint32_t item = lane; item < kBlockT; item += 32) {
                const bool valid = item < tokens;
                const float* src = valid ? sfa_tile + uint64_t(item) * sfa_stride_m + kb * sfa_stride_k : sfa;
                sm90::cp_async_4(scales + item, src, valid ? 4 : 0);
              }
            }
            sm90::cp_async_mbarrier_arrive_noinc(ring.full + pipe.stage);
          }
        } else {
          const uint8_t* sfb_tile =
              sfb + uint64_t(t.group) * sfb_stride_g + uint64_t(t.n_block * kBlockW) * sfb_stride_n;
          const uint32_t rows_w = min(kBlockW, kShapeN - t.n_block * kBlockW);
          constexpr uint32_t kTokenItems = (kBlockT + 31) / 32, kRowItems = kBlockW / 32;
          for (uint32_t ks = 0; ks < kNumKStages; ++ks, pipe.advance()) {
            if (turn++ % kNumScaleWarps != producer_warp - 1) continue;
            // Loaded before the stage drains; lane l takes tokens and rows l, l + 32, ...
            float sa[kKBlocks][kTokenItems];
            uint32_t exps[kKBlocks][kRowItems];
#pragma unroll
            for (uint32_t j = 0; j < kKBlocks; ++j) {
              const uint64_t kb = ks * kKBlocks + j;
#pragma unroll
              for (uint32_t i = 0; i < kTokenItems; ++i) {
                const uint32_t token = lane + 32 * i;
                sa[j][i] = token < tokens ? __ldg(sfa_tile + uint64_t(token) * sfa_stride_m + kb * sfa_stride_k) : 0.0f;
              }
#pragma unroll
              for (uint32_t i = 0; i < kRowItems; ++i) {
                const uint32_t row = lane + 32 * i;
                exps[j][i] = row < rows_w
                                 ? __ldg(reinterpret_cast<const uint32_t*>(sfb_tile + row * sfb_stride_n + kb * 4))
                                 : 0u;
              }
            }
            ring.producer_acquire(pipe);
#pragma unroll
            for (uint32_t j = 0; j < kKBlocks; ++j) {
              float* scales = block_scales(pipe.stage, j);
              uint32_t* words = block_words(pipe.stage, j);
              uint32_t ref = fp4::kNoBlockRef;
              if constexpr (kBlockRef) {
                // Rows past N (zero words) take no part.
                uint32_t hi = 0, lo = 0xFFFFFFFFu;
#pragma unroll
                for (uint32_t i = 0; i < kRowItems; ++i) {
                  hi = __vmaxu4(hi, exps[j][i]);
                  lo = lane + 32 * i < rows_w ? __vminu4(lo, exps[j][i]) : lo;
                }
                ref = fp4::block_reference(__reduce_max_sync(0xffffffffu, fp4::max_exponent(hi)),
                                           __reduce_min_sync(0xffffffffu, fp4::min_exponent(lo)));
              }
              const float factor = ref == fp4::kNoBlockRef ? 1.0f : fp4::column_scale(ref);
#pragma unroll
              for (uint32_t i = 0; i < kTokenItems; ++i) {
                if (lane + 32 * i < kBlockT) scales[lane + 32 * i] = sa[j][i] * factor;
              }
#pragma unroll
              for (uint32_t i = 0; i < kRowItems; ++i) words[lane + 32 * i] = exps[j][i];
              if (lane == 0) words[kBlockW] = ref;
            }
            sm90::mbarrier_arrive(ring.full + pipe.stage);
          }
        }
      }
    }
    return;
  }

  if constexpr (kSetMaxNReg) sm90::setmaxnreg_inc<kMathRegisters>();
  const uint32_t math_wg = threadIdx.x / 128;
  const uint32_t quad = lane % 4;
  // Fragment rows of this thread inside the warpgroup's 64 weight rows (r and r + 8).
  const uint32_t row0 = (warp % 4) * 16 + lane / 4;
  float final_acc[Wgmma::kNumAccum];
  uint8_t* smem_d = smem;

  // Prefill tiles (packed weights, one K block per stage): the tile's K loop with K block kb + 1's
  // fragments converted while the wgmmas of kb run. Converted in turn, the math warps of both
  // warpgroups (which leave the full barrier together) and the tensor cores took turns: 3061 µs at
  // 4 x 8192 rows x 4096 x 7168 against 2786 overlapped (H100, bench/RESULTS.md session 32).
  const auto prefill_k_loop = [&] {
    uint32_t frag0[4][4], frag1[4][4];
    // Per fragment set: whether its K block takes the tile's reference (its factor then is in the A
    // scales), else the rows' scales (row0, row0 + 8).
    RowScales sb0, sb1;
    const auto convert = [&](auto refs, uint32_t stage, uint32_t (&frag)[4][4], RowScales& sb) {
      constexpr Refs kRefs = decltype(refs)::value;
      const uint32_t* words = block_words(stage, 0);
      const uint32_t exps0 = words[math_wg * 64 + row0], exps1 = words[math_wg * 64 + row0 + 8];
      const uint32_t ref = words[kBlockW];
      convert_packed_k_block<kRefs>(smem + Smem::kOffsetW + stage * Smem::kW + math_wg * 64 * (kBlockK / 2), row0,
                                    quad, exps0, exps1, ref, frag);
      sb = RowScales::of<kRefs>(exps0, exps1, ref);
    };
    // K blocks [kb0, kNumKBlocks) on `refs`; with Refs::kTile up to the first K block without the
    // tile's reference, which it leaves waited for (its fragments unused). Returns where it stopped.
    const auto k_loop = [&](auto refs, uint32_t kb0) -> uint32_t {
      constexpr bool kTile = decltype(refs)::value == Refs::kTile;
      ring.consumer_wait(pipe);
      if (kTile && block_words(pipe.stage, 0)[kBlockW] == fp4::kNoBlockRef) return kb0;
      convert(refs, pipe.stage, frag0, sb0);
      // K block kb (the stage of pipe) on cur; the next one's converted into nxt meanwhile. False
      // where the loop ends after it.
      const auto step = [&](uint32_t kb, uint32_t (&cur)[4][4], const RowScales& sb, uint32_t (&nxt)[4][4],
                            RowScales& sb_nxt) {
        float acc[Wgmma::kNumAccum];
        const auto fence_operands = [&] {
#pragma unroll
          for (uint32_t i = 0; i < Wgmma::kNumAccum; ++i) sm90::fence_operand(acc[i]);
#pragma unroll
          for (uint32_t s = 0; s < 4; ++s) {
#pragma unroll
            for (uint32_t i = 0; i < 4; ++i) sm90::fence_operand(cur[s][i]);
          }
        };
        const uint64_t desc_a = sm90::make_sw128_kmajor_desc(smem + Smem::kOffsetA + pipe.stage * Smem::kA);
        fence_operands();
        sm90::wgmma_fence();
#pragma unroll
        for (uint32_t s = 0; s < 4; ++s) Wgmma::mma(cur[s], desc_a + s * 2, acc, s > 0);
        sm90::wgmma_commit();
        bool go_on = kb + 1 < kNumKBlocks;
        if (go_on) {
          PipelineState<kNumStages> next = pipe;
          next.advance();
          ring.consumer_wait(next);
          // Converted before its reference word is checked, so that the conversion's loads wait for
          // nothing else: a K block without the tile's reference is converted again by the next loop.
          convert(refs, next.stage, nxt, sb_nxt);
          if (kTile) go_on = block_words(next.stage, 0)[kBlockW] != fp4::kNoBlockRef;
        }
        sm90::wgmma_wait<0>();
        fence_operands();
        float sa[kBlockT / 4];
        load_token_scales<kBlockT>(block_scales(pipe.stage, 0), quad, sa);
        promote<kBlockT>(acc, sa, sb, final_acc);
        __syncwarp();
        if (lane == 0) ring.consumer_release(pipe);
        pipe.advance();
        return go_on;
      };
      // Two K blocks per trip, so that each fragment set stays in registers (indexed statically).
      for (uint32_t kb = kb0; kb < kNumKBlocks; kb += 2) {
        if (!step(kb, frag0, sb0, frag1, sb1)) return kb + 1;
        if (!step(kb + 1, frag1, sb1, frag0, sb0)) return kb + 2;
      }
      return kNumKBlocks;
    };
    // The tile's K blocks on its reference as long as they have it, the rest (rarely any) on either.
    const uint32_t kb = kBlockRef ? k_loop(RefsTag<Refs::kTile>{}, 0) : 0;
    if (kb < kNumKBlocks) k_loop(RefsTag<kBlockRef ? Refs::kEither : Refs::kRows>{}, kb);
  };

  while (scheduler.next(t)) {
#pragma unroll
    for (uint32_t i = 0; i < Wgmma::kNumAccum; ++i) final_acc[i] = 0.0f;

    if constexpr (kSetMaxNReg) {
      prefill_k_loop();
    } else {
      // A stage's K blocks (kKBlocks of them) on the references `refs` takes.
      const auto stage_body = [&](auto refs) {
#pragma unroll
        for (uint32_t j = 0; j < kKBlocks; ++j) {
          const uint8_t* tile_w = smem + Smem::kOffsetW + pipe.stage * Smem::kW + j * Smem::kBlockWBytes +
                                  math_wg * (kFragmentLayout ? kFragmentBlockBytes : 64 * (kBlockK / 2));
          const float* scales = block_scales(pipe.stage, j);
          const auto* words = kFragmentLayout ? reinterpret_cast<const uint32_t*>(tile_w + kFragmentWeightBytes)
                                              : block_words(pipe.stage, j) + math_wg * 64;
          const uint32_t exps0 = words[row0], exps1 = words[row0 + 8];
          // Packed weights: the K block's reference word follows the tile's exponent words.
          const uint32_t ref = kFragmentLayout ? fp4::kNoBlockRef : words[kBlockW - math_wg * 64];
          const uint64_t desc_a =
              sm90::make_sw128_kmajor_desc(smem + Smem::kOffsetA + pipe.stage * Smem::kA + j * Smem::kBlockA);
          uint32_t frag[4][4];
          if constexpr (kFragmentLayout) {
            const uint32_t slot = (threadIdx.x % 128) * 16;
            const uint4 lo = *reinterpret_cast<const uint4*>(tile_w + slot);         // row r, steps 0-3
            const uint4 hi = *reinterpret_cast<const uint4*>(tile_w + 2048 + slot);  // row r + 8
            const uint32_t words_lo[4] = {lo.x, lo.y, lo.z, lo.w}, words_hi[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (uint32_t s = 0; s < 4; ++s) {
              const uint2 c0 = decode_fragment_word(words_lo[s]), c1 = decode_fragment_word(words_hi[s]);
              frag[s][0] = c0.x;
              frag[s][1] = c1.x;
              frag[s][2] = c0.y;
              frag[s][3] = c1.y;
            }
          } else {
            convert_packed_k_block<decltype(refs)::value>(tile_w, row0, quad, exps0, exps1, ref, frag);
          }

          // Table path: one accumulator over the K block. Fragment path: one per K step (exact scales).
          constexpr uint32_t kNumSets = kFragmentLayout ? 4 : 1;
          float acc[kNumSets][Wgmma::kNumAccum];
          // The wgmmas' register operands, accumulators and fragments, pinned on both sides of them:
          // decode instructions moved past the fence would make ptxas serialise the wgmmas
          // (non-wgmma instructions defining their input registers), and the registers must not be
          // reused while the wgmmas read them.
          const auto fence_wgmma_registers = [&] {
#pragma unroll
            for (uint32_t a = 0; a < kNumSets; ++a) {
#pragma unroll
              for (uint32_t i = 0; i < Wgmma::kNumAccum; ++i) sm90::fence_operand(acc[a][i]);
            }
#pragma unroll
            for (uint32_t s = 0; s < 4; ++s) {
#pragma unroll
              for (uint32_t i = 0; i < 4; ++i) sm90::fence_operand(frag[s][i]);
            }
          };
          fence_wgmma_registers();
          sm90::wgmma_fence();
#pragma unroll
          for (uint32_t s = 0; s < 4; ++s) {
            Wgmma::mma(frag[s], desc_a + s * 2, acc[kFragmentLayout ? s : 0], !kFragmentLayout && s > 0);
          }
          sm90::wgmma_commit();
          sm90::wgmma_wait<0>();
          fence_wgmma_registers();

          float sa[kBlockT / 4];
          load_token_scales<kBlockT>(scales, quad, sa);
          if (j + 1 == kKBlocks) {
            __syncwarp();
            if (lane == 0) ring.consumer_release(pipe);
          }
          if constexpr (kFragmentLayout) {
            // Each step's own row scales.
            const float sb0[4] = {step_scale<0>(exps0), step_scale<1>(exps0), step_scale<2>(exps0),
                                  step_scale<3>(exps0)};
            const float sb1[4] = {step_scale<0>(exps1), step_scale<1>(exps1), step_scale<2>(exps1),
                                  step_scale<3>(exps1)};
#pragma unroll
            for (uint32_t c = 0; c < kBlockT / 8; ++c) {
              float r00 = 0.0f, r01 = 0.0f, r10 = 0.0f, r11 = 0.0f;
#pragma unroll
              for (uint32_t a = 0; a < kNumSets; ++a) {
                r00 = fmaf(acc[a][c * 4 + 0], sb0[a], r00);
                r01 = fmaf(acc[a][c * 4 + 1], sb0[a], r01);
                r10 = fmaf(acc[a][c * 4 + 2], sb1[a], r10);
                r11 = fmaf(acc[a][c * 4 + 3], sb1[a], r11);
              }
              final_acc[c * 4 + 0] = fmaf(r00, sa[c * 2], final_acc[c * 4 + 0]);
              final_acc[c * 4 + 1] = fmaf(r01, sa[c * 2 + 1], final_acc[c * 4 + 1]);
              final_acc[c * 4 + 2] = fmaf(r10, sa[c * 2], final_acc[c * 4 + 2]);
              final_acc[c * 4 + 3] = fmaf(r11, sa[c * 2 + 1], final_acc[c * 4 + 3]);
            }
          } else {
            promote<kBlockT>(acc[0], sa, RowScales::of<decltype(refs)::value>(exps0, exps1, ref), final_acc);
          }
        }
      };
      // Stages [ks0, kNumKStages) on `refs`; with Refs::kTile up to the first stage with a K block
      // without the tile's reference, left waited for. Returns where it stopped.
      const auto stage_loop = [&](auto refs, uint32_t ks0) -> uint32_t {
        for (uint32_t ks = ks0; ks < kNumKStages; ++ks, pipe.advance()) {
          ring.consumer_wait(pipe);
          if constexpr (decltype(refs)::value == Refs::kTile) {
            bool tile_refs = true;
#pragma unroll
            for (uint32_t j = 0; j < kKBlocks; ++j) {
              tile_refs = tile_refs && block_words(pipe.stage, j)[kBlockW] != fp4::kNoBlockRef;
            }
            if (!tile_refs) return ks;
          }
          stage_body(refs);
        }
        return kNumKStages;
      };
      constexpr bool kTileRefs = kBlockRef && !kFragmentLayout;
      const uint32_t ks = kTileRefs ? stage_loop(RefsTag<Refs::kTile>{}, 0) : 0;
      if (ks < kNumKStages) stage_loop(RefsTag<kTileRefs ? Refs::kEither : Refs::kRows>{}, ks);
    }

    // Epilogue: the D tile [kBlockT tokens][kBlockW columns] in bf16, 128-byte swizzled atoms of 64
    // columns (common/epilogue.cuh): a masked group's stored in boxes of kMaskedStoreRows tokens,
    // those below masked_m only.
    if constexpr (kFragmentLayout) {
      // The fragment decode's E2M1 x 2^-6, undone once per tile.
#pragma unroll
      for (uint32_t i = 0; i < Wgmma::kNumAccum; ++i) final_acc[i] *= float(1u << fp4::kHeadroomLog2);
    }
    store_tile<kBlockT, kBlockW, 128, ResidualType::kNone, kMasked, kNumMathThreads, 1, kBlockT, false, true>(
        &map_d, smem_d, final_acc, math_wg * 64 + row0, lane, nullptr, 0, row_a0(t), t.n_block * kBlockW, 0, kShapeN,
        kMasked ? t.m_block * kBlockT : row_a0(t), t.group, kMasked ? scheduler.masked_rows(t) : kBlockT);
  }
  if (threadIdx.x < 32) sm90::tma_store_wait_all<0>();  // warp 0 issued the stores
#endif
}

}  // namespace moe_kernels
