#pragma once
// The GEMMs' scale warps (the FP8 GEMM's kScaleGather, the FP8 x FP4 GEMM's): one scale per A row and
// K block and the tile's B scales per K block into each stage, completing on the stage's full barrier
// beside the TMA loads. B's part is a policy: the FP8 GEMM's one or two B scales (SfbLanes), or the
// FP8 x FP4 GEMM's exponent word per B row (SfbRows).
//
// kChunk 0: 4-byte cp.async copies, any strides. Each lane's copy lands in shared memory on its own,
//   so a K block of a 128-row tile costs 128 shared-memory wavefronts beside the wgmmas' operand reads
//   (common/fp8_gemm_layout.h has the ncu figures).
// kChunk 1, 2 or 4 (beyond 1: K-major scales, rows and base on 4 x kChunk bytes, K blocks a multiple
//   of kChunk): a lane loads kChunk K blocks of each of its rows into registers with one (vector)
//   load per row, then stores a K block's 32 rows per warp with one coalesced 4-byte store (one
//   wavefront) and arrives. With kPrefetch two chunks are in flight: the next one's loads go out
//   before the warp stores the current one. 128-row tiles in chunks of 2 or 4 split the rows over a
//   pair of warps (scale_gather_row_warps), each arriving per lane: the full barrier counts 32 per warp.

#include <moe_kernels/common/fp8_gemm_layout.h>
#include <moe_kernels/common/pipeline.cuh>
#include <moe_kernels/common/scale_rows.cuh>
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

// The FP8 GEMM's B scales: kSfbRows (1 or 2) per K block at sf[kSfb], lane l < kSfbRows the l-th
// from its own row (`ptr`, K blocks stride_k apart; `valid`: inside the problem).
template <uint32_t kSfb, uint32_t kSfbRows, uint32_t kChunk>
struct SfbLanes {
  static_assert(kSfbRows <= 32, "one B scale per lane");
  // One chunk's B scales in registers (a lane's).
  struct Regs {
    float v[kChunk > 0 ? kChunk : 1];
  };
  const float* ptr;
  bool valid;
  uint32_t stride_k;

  // sf_lane: the stage's scales plus the lane.
  __device__ __forceinline__ void copy(float* sf_lane, uint32_t kb, uint32_t lane) const {
    if (lane < kSfbRows) sm90::cp_async_4(sf_lane + kSfb, ptr + kb * stride_k, valid ? 4 : 0);
  }
  // `mine`: the warp stores B (a pair's first warp).
  __device__ __forceinline__ void load(Regs& r, uint32_t kb0, bool mine) const {
#pragma unroll
    for (uint32_t j = 0; j < kChunk; ++j) r.v[j] = sm90::ld_nc_float(ptr + (kb0 + j) * stride_k, valid && mine);
  }
  __device__ __forceinline__ void store(float* sf, const Regs& r, uint32_t j, uint32_t lane, bool mine) const {
    if (lane < kSfbRows && mine) sf[kSfb + lane] = r.v[j];
  }
};

// The FP8 x FP4 GEMM's B exponents: one 4-byte word (4 x UE8M0, one per 1x32) per B row and K block,
// kSfbRows rows at sf[kSfb]; lane l holds rows i x 32 + l as byte offsets from `base` (the tile's
// first row), K blocks 4 bytes apart (K-major).
template <uint32_t kSfb, uint32_t kSfbRows, uint32_t kChunk>
struct SfbRows {
  static constexpr uint32_t kRows = (kSfbRows + 31) / 32;
  static_assert(kRows * (kChunk > 0 ? kChunk : 1) <= 8, "a chunk's B words take at most 8 registers per lane");
  struct Regs {
    float v[kRows][kChunk > 0 ? kChunk : 1];
  };
  const uint8_t* base;
  LaneScaleRows<kRows> rows;

  __device__ __forceinline__ bool inside_tile(uint32_t i, uint32_t lane) const {
    return kSfbRows % 32 == 0 || i * 32 + lane < kSfbRows;
  }
  __device__ __forceinline__ void copy(float* sf_lane, uint32_t kb, uint32_t lane) const {
    const uint8_t* base_k = base + kb * 4;
#pragma unroll
    for (uint32_t i = 0; i < kRows; ++i) {
      if (inside_tile(i, lane)) sm90::cp_async_4(sf_lane + kSfb + i * 32, base_k + rows.offset[i], rows.bytes(i));
    }
  }
  __device__ __forceinline__ void load(Regs& r, uint32_t kb0, bool mine) const {
    const uint8_t* base_k = base + kb0 * 4;
#pragma unroll
    for (uint32_t i = 0; i < kRows; ++i) {
      const auto* src = reinterpret_cast<const float*>(base_k + rows.offset[i]);
      sm90::ld_nc_floats<kChunk>(r.v[i], src, (rows.valid >> i & 1) != 0 && mine);
    }
  }
  __device__ __forceinline__ void store(float* sf, const Regs& r, uint32_t j, uint32_t lane, bool mine) const {
#pragma unroll
    for (uint32_t i = 0; i < kRows; ++i) {
      if (inside_tile(i, lane) && mine) sf[kSfb + i * 32 + lane] = r.v[i][j];
    }
  }
};

// A stage's scales: kBlockM A rows from sf[0], B's from the policy's place (kSfFloats per stage).
// kPrefetch: two chunks in flight (the kernel's producer budget holds a second register set).
template <uint32_t kBlockM, uint32_t kChunk, uint32_t kNumStages, uint32_t kSfFloats, uint32_t kNumWarps,
          bool kPrefetch = false>
struct ScaleGather {
  // Warps sharing a chunk's rows, and the rows each lane holds.
  static constexpr uint32_t kRowWarps = scale_gather_row_warps(kBlockM, kChunk);
  static constexpr uint32_t kRows = kBlockM / 32 / kRowWarps;
  static constexpr uint32_t kTurns = kNumWarps / kRowWarps;
  static_assert(kChunk <= 2 || kChunk == 4, "copies (0) or chunks of 1, 2 or 4 K blocks");
  // Per lane kRows x kChunk A scales and the policy's B scales in registers, inside the producers'
  // budget (4 rows spilled with chunks of 2 at 40 registers).
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

  // Whether this warp owns the next K block's copies (every warp walks every K block's stage).
  __device__ __forceinline__ bool take_turn() {
    const bool mine = turn == my_turn;
    turn = turn + 1 == kTurns ? 0 : turn + 1;
    return mine;
  }

  // K blocks [kb_begin, kb_end) of one tile. sfa: the scales' base, K blocks sfa_stride_k elements
  // apart; rows_a: this lane's rows as offsets from it, in elements or (kByteRows) bytes, which spares
  // the FP8 x FP4 GEMM's producers a shift per row beside a 64-bit K block base; sfb: B's policy
  // (SfbLanes or SfbRows), set up for the tile.
  template <bool kByteRows = false, class Sfb>
  __device__ __forceinline__ void tile(PipelineState<kNumStages>& pipe, const float* sfa,
                                       const LaneScaleRows<kRows>& rows_a, uint32_t sfa_stride_k, Sfb& sfb,
                                       uint32_t kb_begin, uint32_t kb_end) {
    const auto row_src = [&](uint32_t i, uint32_t kb) -> const float* {
      if constexpr (kByteRows) {
        return reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(sfa + uint64_t(kb) * sfa_stride_k) +
                                              rows_a.offset[i]);
      } else {
        return sfa + kb * sfa_stride_k + rows_a.offset[i];
      }
    };
    if constexpr (kChunk == 0) {
      for (uint32_t kb = kb_begin; kb < kb_end; ++kb, pipe.advance()) {
        if (!take_turn()) continue;
        ring.producer_acquire(pipe);
        float* sf_lane = smem_sf + pipe.stage * kSfFloats + lane;
#pragma unroll
        for (uint32_t i = 0; i < kRows; ++i) sm90::cp_async_4(sf_lane + i * 32, row_src(i, kb), rows_a.bytes(i));
        sfb.copy(sf_lane, kb, lane);
        sm90::cp_async_mbarrier_arrive_noinc(ring.full + pipe.stage);
      }
    } else {
      // Chunks start on multiples of kChunk (the vector loads' alignment); a split unit's range may
      // start or end inside one, whose other K blocks are loaded and not stored. The warp owns every
      // kTurns-th chunk, turns running on across tiles.
      const uint32_t c_begin = kb_begin / kChunk, c_end = (kb_end + kChunk - 1) / kChunk;
      uint32_t c = c_begin + (my_turn + kTurns - turn) % kTurns;
      turn = (turn + (c_end - c_begin)) % kTurns;
      uint32_t kb_pipe = kb_begin;  // the K block `pipe` stands at
      const auto walk_to = [&](uint32_t kb) {
        for (; kb_pipe < kb; ++kb_pipe) pipe.advance();
      };
      // A pair's first warp loads and stores B's scales.
      const bool b_mine = row_part == 0;
      struct Regs {
        float a[kRows][kChunk];
        typename Sfb::Regs b;
      };
      const auto load = [&](Regs& r, uint32_t chunk) {
#pragma unroll
        for (uint32_t i = 0; i < kRows; ++i) {
          sm90::ld_nc_floats<kChunk>(r.a[i], row_src(i, chunk * kChunk), (rows_a.valid >> i & 1) != 0);
        }
        sfb.load(r.b, chunk * kChunk, b_mine);
      };
      const auto store = [&](const Regs& r, uint32_t chunk) {
        const uint32_t kb0 = chunk * kChunk;
        walk_to(kb0 > kb_begin ? kb0 : kb_begin);
#pragma unroll
        for (uint32_t j = 0; j < kChunk; ++j) {
          if (kb0 + j < kb_begin || kb0 + j >= kb_end) continue;
          ring.producer_acquire(pipe);
          float* sf = smem_sf + pipe.stage * kSfFloats;
#pragma unroll
          for (uint32_t i = 0; i < kRows; ++i) sf[first_row() + i * 32 + lane] = r.a[i][j];
          sfb.store(sf, r.b, j, lane, b_mine);
          // Release: the stores above are visible to the math warps once the phase completes.
          sm90::mbarrier_arrive(ring.full + pipe.stage);
          pipe.advance();
          ++kb_pipe;
        }
      };
      if constexpr (kPrefetch) {
        // A warp that waits for one chunk's loads before it stores them takes a load latency per
        // chunk, which bounded 64-row tiles' pipelines (1.15-1.36x the copies' time). The loop is
        // unrolled by hand over two register sets: a copy between them would wait for the prefetch.
        Regs x, y;
        if (c < c_end) load(x, c);
        while (c < c_end) {
          const uint32_t c1 = c + kTurns;
          if (c1 < c_end) load(y, c1);
          store(x, c);
          if (c1 >= c_end) break;
          const uint32_t c2 = c1 + kTurns;
          if (c2 < c_end) load(x, c2);
          store(y, c1);
          c = c2;
        }
      } else {
        for (; c < c_end; c += kTurns) {
          Regs x;
          load(x, c);
          store(x, c);
        }
      }
      walk_to(kb_end);
    }
  }
};

}  // namespace moe_kernels
