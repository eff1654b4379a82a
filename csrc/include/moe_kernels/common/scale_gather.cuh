#pragma once
// The FP8 GEMM's scale warps (kScaleGather): one scale per A row and K block and the tile's one or two
// B scales per K block into each stage, completing on the stage's full barrier beside the TMA loads.
//
// kChunk 0: 4-byte cp.async copies, any strides. Each lane's copy lands in shared memory on its own,
//   so a K block of a 128-row tile costs 128 shared-memory wavefronts beside the wgmmas' operand reads
//   (common/fp8_gemm_layout.h has the ncu figures).
// kChunk 1, 2 or 4 (beyond 1: K-major A scales, rows and base on 4 x kChunk bytes, K blocks a
//   multiple of kChunk): a lane loads kChunk K blocks of each of its rows into registers with one
//   (vector) load per row, before it waits for the first of their stages, then stores a K block's 32
//   rows per warp with one coalesced 4-byte store (one wavefront) and arrives. B's scales come
//   likewise, one load per K block. 128-row tiles in chunks of 2 or 4 split the rows over a pair of
//   warps (scale_gather_row_warps), each arriving per lane: the full barrier counts 32 per warp.

#include <moe_kernels/common/fp8_gemm_layout.h>
#include <moe_kernels/common/pipeline.cuh>
#include <moe_kernels/common/scale_rows.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

// A stage's scales: kBlockM A rows from sf[0], kSfbRows B scales from sf[kSfb].
template <uint32_t kBlockM, uint32_t kChunk, uint32_t kNumStages, uint32_t kSfFloats, uint32_t kSfb,
          uint32_t kSfbRows, uint32_t kNumWarps>
struct ScaleGather {
  // Warps sharing a chunk's rows, and the rows each lane holds.
  static constexpr uint32_t kRowWarps = scale_gather_row_warps(kBlockM, kChunk);
  static constexpr uint32_t kRows = kBlockM / 32 / kRowWarps;
  static constexpr uint32_t kTurns = kNumWarps / kRowWarps;
  static_assert(kChunk <= 2 || kChunk == 4, "copies (0) or chunks of 1, 2 or 4 K blocks");
  // Per lane kRows x kChunk A scales and kChunk B scales in registers, inside the producers' budget
  // (4 rows spilled with chunks of 2 at 40 registers).
  static_assert(kRows * kChunk <= 8, "a chunk's A scales take at most 8 registers per lane");
  static_assert(kNumWarps % kRowWarps == 0, "whole groups of warps sharing the rows");
  static_assert(scale_gather_warps(kNumWarps, kChunk, kNumStages, kBlockM) == kNumWarps,
                "warps would run two phases ahead");

  StageRing<kNumStages> ring;
  float* smem_sf;
  uint32_t lane;
  uint32_t my_turn;
  uint32_t row_part;  // which kBlockM / kRowWarps rows this warp holds
  uint32_t turn = 0;

  __device__ __forceinline__ ScaleGather(StageRing<kNumStages> ring_, float* smem_sf_, uint32_t lane_, uint32_t warp)
      : ring(ring_), smem_sf(smem_sf_), lane(lane_), my_turn(warp / kRowWarps), row_part(warp % kRowWarps) {}

  // The tile row of this warp's first row: LaneScaleRows<kRows> starts there.
  __device__ __forceinline__ uint32_t first_row() const { return row_part * (kBlockM / kRowWarps); }

  // Whether this warp owns the next chunk (every warp walks every K block's stage).
  __device__ __forceinline__ bool take_turn() {
    const bool mine = turn == my_turn;
    turn = turn + 1 == kTurns ? 0 : turn + 1;
    return mine;
  }

  // K blocks [kb_begin, kb_end) of one tile. sfa: the scales' base; rows_a: this lane's rows as
  // offsets from it; sfb_lane: this lane's B scale row (valid_b: inside the problem, lane < kSfbRows).
  __device__ __forceinline__ void tile(PipelineState<kNumStages>& pipe, const float* sfa,
                                       const LaneScaleRows<kRows>& rows_a, uint32_t sfa_stride_k,
                                       const float* sfb_lane, bool valid_b, uint32_t sfb_stride_k, uint32_t kb_begin,
                                       uint32_t kb_end) {
    if constexpr (kChunk == 0) {
      for (uint32_t kb = kb_begin; kb < kb_end; ++kb, pipe.advance()) {
        if (!take_turn()) continue;
        ring.producer_acquire(pipe);
        float* sf = smem_sf + pipe.stage * kSfFloats;
        const float* sfa_k = sfa + kb * sfa_stride_k;
#pragma unroll
        for (uint32_t i = 0; i < kRows; ++i) {
          sm90::cp_async_4(sf + i * 32 + lane, sfa_k + rows_a.offset[i], rows_a.bytes(i));
        }
        if (lane < kSfbRows) sm90::cp_async_4(sf + kSfb + lane, sfb_lane + kb * sfb_stride_k, valid_b ? 4 : 0);
        sm90::cp_async_mbarrier_arrive_noinc(ring.full + pipe.stage);
      }
    } else {
      // Chunks start on multiples of kChunk (the vector loads' alignment); a split unit's range may
      // start or end inside one, whose other K blocks are loaded and not stored.
      for (uint32_t kb0 = kb_begin / kChunk * kChunk; kb0 < kb_end; kb0 += kChunk) {
        const uint32_t first = kb0 > kb_begin ? kb0 : kb_begin;
        const uint32_t last = kb0 + kChunk < kb_end ? kb0 + kChunk : kb_end;
        if (!take_turn()) {
          for (uint32_t kb = first; kb < last; ++kb) pipe.advance();
          continue;
        }
        float a[kRows][kChunk];
        float b[kChunk];
#pragma unroll
        for (uint32_t i = 0; i < kRows; ++i) {
          const float* src = sfa + rows_a.offset[i] + kb0 * sfa_stride_k;
          sm90::ld_nc_floats<kChunk>(a[i], src, (rows_a.valid >> i & 1) != 0);
        }
        // A pair's first warp stores B's scales.
        const bool store_b = lane < kSfbRows && row_part == 0;
#pragma unroll
        for (uint32_t j = 0; j < kChunk; ++j) {
          b[j] = sm90::ld_nc_float(sfb_lane + (kb0 + j) * sfb_stride_k, valid_b && row_part == 0);
        }
#pragma unroll
        for (uint32_t j = 0; j < kChunk; ++j) {
          if (kb0 + j < first || kb0 + j >= last) continue;
          ring.producer_acquire(pipe);
          float* sf = smem_sf + pipe.stage * kSfFloats;
#pragma unroll
          for (uint32_t i = 0; i < kRows; ++i) sf[first_row() + i * 32 + lane] = a[i][j];
          if (store_b) sf[kSfb + lane] = b[j];
          // Release: the stores above are visible to the math warps once the phase completes.
          sm90::mbarrier_arrive(ring.full + pipe.stage);
          pipe.advance();
        }
      }
    }
  }
};

}  // namespace moe_kernels
