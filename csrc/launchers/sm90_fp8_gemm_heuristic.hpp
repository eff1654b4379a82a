#pragma once
// The FP8 GEMM family's plan (launchers/sm90_fp8_gemm.hpp generates and launches it): the kernel's
// configuration, the analytic heuristic that picks it from (M, N, K, SMs) and the memo of its
// choices, for the plain epilogue and the SwiGLU one. The measured rules it applies live in
// sm90_fp8_gemm_rules.hpp.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "jit/exception.hpp"
#include "launchers/gemm_common.hpp"
#include "launchers/sm90_fp8_gemm_rules.hpp"
#include "launchers/sm90_fp8_gemm_workspace.hpp"
#include "moe_kernels/common/fp8_gemm_layout.h"

namespace moe_launchers::sm90_fp8_gemm {

using namespace moe_launchers::sm90_gemm;

constexpr int kBlockK = 128;
constexpr int kMaxBlockN = 192;  // two FP32 accumulator sets of kBlockN/2 registers fit 232

struct Config {
  const char* fn;  // the public function, for error messages
  GemmType type;
  int m_compiled;  // 0: M is a runtime argument
  int n, k;
  int block_m, block_n, num_stages, group_n;
  Residual residual;
  int num_sms;     // persistent grid size upper bound
  int smem_bytes;
  int swizzle_d;   // bytes of the epilogue's swizzle atom (128, 64, 32) or 0 for plain rows
  int multicast = 1;  // CTAs per cluster sharing A by TMA multicast (1: no cluster)
  int share_b = 0;    // 1: the cluster's CTAs hold adjacent m-blocks and share B instead
  unsigned scale_load = moe_kernels::kScaleGather;  // how the scales reach a stage (common/fp8_gemm_layout.h)
  int scale_warps = 3;  // warps issuing the scale copies (kScaleGather), taking the stages in turn
  int pingpong = 0;     // 1: the two math warpgroups (block M 128) take turns on the tensor cores
  int split_k = 0;      // units per tile of a single partial wave split over K (0: whole tiles)
  bool splits = true;   // false: planned for a launch without the split workspace (every tile whole)
  int pdl = 0;          // 1: programmatic dependent launch (the prologue overlaps the previous kernel)
  int k_unroll = 1;     // the math warpgroups' K loop unrolled this many times
  int overlap = 0;      // 1: block M 64 issues the next K block's wgmmas before it promotes (kOverlap)
  int wg_store = 0;     // 1: each math warpgroup runs its own epilogue, D stored in 64-row boxes (kWgStore)
  int tight_boxes = 0;  // kTightBoxes: 1 tail boxes for the last m-block and n-block where M and N cut them
  int sfa_copy = 0;     // 1: A's scales are copied MN-major into the workspace first, the launch planned on them
  int table_slots = 0;  // kScaleTmaKMajorTable's slots (1: no CTA runs a second tile; else 2), 0 otherwise
  bool tail_split_on = true;  // MOE_GEMM_TAIL_SPLIT when planned (the plan is redone when it changes)
  int swiglu = 0;       // 1: the SwiGLU epilogue (kSwiGlu; plan_swiglu): act and its scales instead of D
  int gather_chunk = 0;  // kGatherChunk: 0 cp.async copies, else K blocks per scale load (gather_chunk_for)

  // The last, partial wave's tiles split over K; kNormal only.
  TailSplit tail_split_of(int m) const {
    return type == GemmType::kNormal && splits && !share_b
               ? tail_split(num_tiles(m), num_sms, k, multicast, split_k, tail_split_on)
               : TailSplit{};
  }
  // The persistent grid of an m-row problem: whole clusters, at most one CTA per SM.
  int grid(int m) const { return tail_split_of(m).grid(num_tiles(m), num_sms, multicast); }

  // Tiles of an m-row problem (per group for kGroupedMasked; an upper bound for the grid), n-blocks
  // (m-blocks where the clusters share B) rounded up to whole clusters.
  int num_tiles(int m) const {
    const int cluster_n = share_b ? 1 : multicast, cluster_m = share_b ? multicast : 1;
    // The SwiGLU epilogue's tiles are 256 columns, one act scale group (a pair of 128-column n-blocks,
    // or one of 256).
    const int n_blocks = swiglu ? n / 256 : (n + block_n * cluster_n - 1) / (block_n * cluster_n) * cluster_n;
    return (m + block_m * cluster_m - 1) / (block_m * cluster_m) * cluster_m * n_blocks;
  }
  // Whether no CTA runs a second tile (whole clusters on the SMs; a split single wave runs one unit
  // a CTA).
  bool one_wave(int m) const { return num_tiles(m) <= num_sms / multicast * multicast; }
};

// MOE_FP8_MULTICAST=0 turns the clusters off and =2 on wherever the kernel takes them (dense, or
// grouped with kMulticastMinRows rows), sharing A; =b makes 2-CTA clusters share B instead where
// the heuristic picked a 128-row tile (dense, contiguous or masked, block N a multiple of 16, at
// least two m-blocks, an even SM count), without tail or single-wave splits, and otherwise acts as
// unset.
// Unset, contiguous 128 x 192 tiles share B (DeepGEMM's form of them): against A-sharing clusters,
// 0.96-0.99x the time at N x K = 4096 x 7168 and 0.99-1.00x at 7168 x 2048, in four timings of
// the four contiguous cells (bench/RESULTS.md, session 18); so do masked ones from
// kMaskedShareBMinRows rows per group (=a: those share A where N > 4096, else run single). Dense
// 128 x 192 tiles keep A: 4096 x 2112 x 7168 took 0.99-1.02x. Any other value (=a) keeps the heuristic's A-sharing clusters
// everywhere. MOE_FP8_PINGPONG=0 turns the math warpgroups' ping-pong off and =1 on at any block N
// (block M 128); MOE_GEMM_GROUP_N sets the scheduler's band width in n-blocks (read on every call,
// so a benchmark can compare both in one process).
inline bool env_enabled(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::string(value) != "0";
}

inline int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// A tile's columns may cover at most two 128-wide scale blocks of B.
inline bool block_n_fits_scales(int block_n) {
  return block_n <= 128 || 128 - gcd(block_n, 128) + block_n <= 256;
}

// One stage: the A and B tiles, then the scales (A's rows, B's two blocks) as `scale_load` lays them out.
inline int stage_bytes(int block_m, int block_n, unsigned scale_load) {
  return static_cast<int>(moe_kernels::fp8_gemm_stage_bytes(static_cast<unsigned>(block_m),
                                                            static_cast<unsigned>(block_n), scale_load));
}

// What contiguous K-major scales allow (the quantizers' layout): the configs and kernels of the
// precompile CLI and of config queries without tensors (plan_config applies MOE_FP8_SCALE_TMA).
inline unsigned contiguous_scale_load(int k) {
  return (k / 128) % 4 == 0 ? moe_kernels::kScaleTmaKMajor : moe_kernels::kScaleGather;
}

inline void check_shape(const char* fn, int m, int n, int k) {
  MOE_HOST_ASSERT(m >= 1, fn << ": M must be >= 1, got " << m);
  MOE_HOST_ASSERT(n >= 8 && n % 8 == 0, fn << ": N must be a positive multiple of 8, got " << n);
  MOE_HOST_ASSERT(k >= kBlockK && k % kBlockK == 0, fn << ": K must be a positive multiple of 128, got " << k);
}

inline const char* function_name(GemmType type) {
  return type == GemmType::kGroupedContiguous ? "m_grouped_fp8_gemm_nt_contiguous"
         : type == GemmType::kGroupedMasked   ? "m_grouped_fp8_gemm_nt_masked"
                                              : "fp8_gemm_nt";
}

// The table's `slots` slots and barriers beside the stages of t: the stages that still fit (capped by
// MOE_GEMM_STAGES like choose_tiles'), or false where fewer than min_stages would be left.
inline bool fit_sfa_slots(Tiles& t, int k, unsigned scale_load, int slots_count, int min_stages) {
  using namespace moe_kernels;
  const unsigned k_blocks = static_cast<unsigned>(k / kBlockK), count = static_cast<unsigned>(slots_count);
  const int slots = static_cast<int>(
      fp8_gemm_sfa_slots_bytes(static_cast<unsigned>(t.block_m), k_blocks, scale_load, count) +
      fp8_gemm_sfa_slot_barrier_bytes(count));
  const int per_stage = stage_bytes(t.block_m, t.block_n, scale_load);
  const int stages = stages_beside(pipeline_smem(t.block_m, t.block_n, 0, per_stage) + slots, per_stage);
  if (stages < min_stages) return false;
  t.num_stages = stages;
  t.smem_bytes = pipeline_smem(t.block_m, t.block_n, stages, per_stage) + slots;
  return true;
}

// The scale warps load their scales into registers, `chunk` K blocks per row at once, and store each K
// block's rows with coalesced stores, instead of 4-byte cp.async copies (common/scale_gather.cuh). Chunks
// of 2 and 4 need K-major A scales (`layout`, scale_layout_for the launch's tensors: kScaleTmaKMajor
// promises rows and base on 16 bytes, K blocks a multiple of 4). 128-row tiles load chunks of 2 split over
// two scale warps (scale_gather_row_warps: one warp's 4 rows spilled in the producers' 40 registers), else
// one K block; chunks of 4 spilled there even split, at K = 2048 (128 x 112 pairs, 128 x 192, 128 x 160
// ping-pong). 256-row tiles keep the copies.
// Unset, dense 128 x 192 tiles in clusters sharing A over at least 64 K blocks take chunks of 2: on an
// H100 0.92x the copies' time at 384 x 7168 x 16384 and 0.97x at 1024 rows (session 50). Then a warp
// waited for its loads before it stored, so elsewhere the loads' latency showed: 1.14-1.18x at 384 x 4096
// x 7168 (128 x 96) and 256 x 7168 x 16384 (128 x 112 pairs sharing B), 1.07-1.14x on 128 x 40 and 128 x
// 72, 1.19-1.36x with one K block a load on 64-row tiles; level at K <= 2048 on 128 x 192. Those plans
// now keep a second chunk in flight (session 51), not yet timed.
// MOE_FP8_GATHER_CHUNK=0 keeps the copies everywhere, =1|2|4 loads up to that many wherever it can.
inline int gather_chunk_for(const Config& c, unsigned layout) {
  const int setting = gather_chunk_setting(c.fn);
  if (c.scale_load != moe_kernels::kScaleGather || c.sfa_copy != 0) return 0;
  if (setting < 0) {
    const bool wide_a_clusters = c.type == GemmType::kNormal && c.block_m == 128 && c.block_n == 192 &&
                                 c.multicast == 2 && c.share_b == 0 && c.swiglu == 0 && c.k / 128 >= 64;
    return wide_a_clusters && c.scale_warps >= 2 && layout == moe_kernels::kScaleTmaKMajor ? 2 : 0;
  }
  const int most = c.block_m == 64 ? 4 : c.block_m == 128 ? (c.scale_warps >= 2 ? 2 : 1) : 0;
  const int chunk = std::min(setting, most);
  return chunk > 1 && layout != moe_kernels::kScaleTmaKMajor ? 1 : chunk;
}

// The chunk, and the scale warps that may then take turns (fp8_gemm_layout.h's scale_gather_warps).
// Starts from the copies' count, so the fallback from K-major boxes to gathers, whose inner plan has
// already set a chunk for its own layout, decides once for the real one.
inline void set_gather_chunk(Config& c, unsigned layout) {
  if (c.scale_warps > 0) c.scale_warps = copy_scale_warps(c.num_stages);
  c.gather_chunk = gather_chunk_for(c, layout);
  if (c.scale_warps > 0) {
    c.scale_warps = static_cast<int>(moe_kernels::scale_gather_warps(
        static_cast<unsigned>(c.scale_warps), static_cast<unsigned>(c.gather_chunk),
        static_cast<unsigned>(c.num_stages), static_cast<unsigned>(c.block_m)));
  }
}

// Analytic choice: fewest waves of tiles weighted by a tile's cost, then the larger block N. `m` is
// the rows of the problem; for kGroupedMasked the expected rows per group, times `num_groups`
// problems. contiguous_alignment: kGroupedContiguous's promise that every aligned block of that
// many rows lies in one group (or is padding); a multiple of 256 allows 256-row tiles.
// split_workspace: whether the launch gets the tail split's workspace (not inside a CUDA graph
// capture); without it the tiles are planned whole. scale_load: scale_layout_for the launch's tensors
// (MOE_FP8_SCALE_TMA=0 turns it into the gathers here).
inline Config plan_config(int m, int n, int k, int num_sms, bool compile_m, Residual residual,
                          GemmType type, int num_groups, int contiguous_alignment, bool split_workspace,
                          unsigned scale_load, bool allow_table = true) {
  const char* fn = function_name(type);
  check_shape(fn, m, n, k);
  MOE_HOST_ASSERT(num_sms >= 1, fn << ": num_sms must be >= 1, got " << num_sms);
  MOE_HOST_ASSERT(num_groups >= 1, fn << ": num_groups must be >= 1, got " << num_groups);
  if (!env_enabled("MOE_FP8_SCALE_TMA")) scale_load = moe_kernels::kScaleGather;
  // K-major A scales in a table per tile (dense; the box's rows at most 256 floats): where asked for
  // (=1), or unset, on the tiles where it was measured to pay (the rules' kScaleTable*).
  if (allow_table && scale_load == moe_kernels::kScaleTmaKMajor && type == GemmType::kNormal &&
      moe_kernels::fp8_gemm_table_cols(static_cast<unsigned>(k / kBlockK)) <= 256) {
    const char* table_env = std::getenv("MOE_FP8_SCALE_TABLE");
    if (table_env != nullptr && std::string(table_env) == "1") {
      scale_load = moe_kernels::kScaleTmaKMajorTable;
    } else if (table_env == nullptr && k / kBlockK <= kScaleTableMaxKBlocks && m >= kScaleTableMinRows) {
      const Config gathers = plan_config(m, n, k, num_sms, compile_m, residual, type, num_groups,
                                         contiguous_alignment, split_workspace, scale_load, false);
      if (gathers.scale_load != moe_kernels::kScaleGather || gathers.block_m != 64 ||
          gathers.block_n != kScaleTableBlockN || !gathers.one_wave(m)) {
        return gathers;
      }
      const Config table = plan_config(m, n, k, num_sms, compile_m, residual, type, num_groups, contiguous_alignment,
                                       split_workspace, moe_kernels::kScaleTmaKMajorTable, false);
      const bool same_tiles = table.block_m == gathers.block_m && table.block_n == gathers.block_n &&
                              table.multicast == gathers.multicast && table.split_k == gathers.split_k;
      return table.scale_load == moe_kernels::kScaleTmaKMajorTable && same_tiles ? table : gathers;
    }
  }
  Config cfg{};
  cfg.fn = fn;
  cfg.type = type;
  cfg.m_compiled = compile_m ? m : 0;
  cfg.n = n;
  cfg.k = k;
  cfg.residual = residual;
  cfg.num_sms = num_sms;
  cfg.scale_load = scale_load;
  const auto stage_bytes = [scale_load](int block_m, int block_n) {
    return sm90_fp8_gemm::stage_bytes(block_m, block_n, scale_load);
  };
  // Whole clusters on the SMs.
  const bool legal = type == GemmType::kNormal || m >= kMulticastMinRows;
  const bool wants = legal && (m <= 64    ? k >= kMulticastMinKSmallM
                               : m <= 128 ? scale_load == moe_kernels::kScaleTmaMnMajor && n >= kMulticastMinNMidM &&
                                                k >= kMulticastMinKMidM
                                          : n >= kMulticastMinNLargeM);
  const char* multicast_env = std::getenv("MOE_FP8_MULTICAST");
  const bool forced = multicast_env != nullptr && std::string(multicast_env) == "2";
  const bool share_b_forced = multicast_env != nullptr && std::string(multicast_env) == "b";
  const bool clusters_allowed = num_sms % 2 == 0 && env_enabled("MOE_FP8_MULTICAST");
  int multicast = (forced ? legal : wants) && clusters_allowed ? 2 : 1;
  MOE_HOST_ASSERT(contiguous_alignment >= 128 && contiguous_alignment % 128 == 0,
                  fn << ": the contiguous alignment must be a positive multiple of 128, got " << contiguous_alignment);
  // 256-row tiles: dense, or contiguous groups aligned to 256 rows (a tile then lies in one group).
  const bool wide_ok = type == GemmType::kNormal ||
                       (type == GemmType::kGroupedContiguous && contiguous_alignment % 256 == 0);
  const int max_block_m = wide_ok ? 256 : 128;
  // Without the workspace nothing splits, so the tiles are chosen as whole ones.
  const int split_k = type == GemmType::kNormal && split_workspace ? k : 0;
  const int split_env = env_int("MOE_GEMM_SPLIT_K");
  const bool tiles_forced = env_int("MOE_GEMM_BLOCK_M") != 0 || env_int("MOE_GEMM_BLOCK_N") != 0;
  int single_wave_ways = split_workspace ? split_env : 1;
  const bool masked_decode = type == GemmType::kGroupedMasked && m <= 128 && k / kBlockK <= kMaskedShortKBlocks;
  Tiles t = choose_tiles(fn, type == GemmType::kGroupedMasked ? num_groups : 1, m, n, num_sms, kMaxBlockN,
                         stage_bytes, block_n_fits_scales, multicast, split_k, max_block_m, 0, single_wave_ways,
                         masked_decode ? kMaskedDecodeMaxBlockN : 0);
  if (type == GemmType::kNormal && !tiles_forced) {
    if (m > 64 && m <= 128) {
      const Tiles rows128 = choose_tiles(fn, 1, m, n, num_sms, kMaxBlockN, stage_bytes, block_n_fits_scales,
                                         multicast, split_k, max_block_m, 128, single_wave_ways);
      if (rows128.waves < t.waves) t = rows128;
    }
    // 129-255 rows on lone CTAs: a 128-row tile's second m-block reads mostly rows past M, and such
    // boxes cost more than whole ones (x 2112 x 7168 on 128 x 32 tiles: 14.5 us at 256 rows, 20.0 at
    // 192, 22.5 at 160). 64-row tiles in no more waves took 0.55-0.78x the time of 128-row ones at
    // 144, 192 and 224 x {2112, 4096} x 7168; at N = 576 (whole 64 x 16 tiles against split 128 x 40
    // ones) 192 rows went from 10.5 to 9.1 us across two runs (bench/RESULTS.md, session 45).
    // From 256 rows on lone CTAs, 64-row tiles where they take no more waves and each CTA reads
    // fewer rows of A and B per K block (block M + block N): 0.76x the time of 128 x 32 at 256 x 2112
    // x 7168 (64 x 64, DeepGEMM's choice), 0.74x at 384 x 2112 x 7168, 0.80x and 0.88x at {384, 1024}
    // x 576 x 7168 (MN-major A scales). Not where the 128-row tiles leave a quarter of the SMs idle
    // (split over K below): at 256 x 576 x 7168 64 x 72 took 1.07x the time of 128 x 40 split in 4
    // (bench/RESULTS.md, session 47; the ratios as corrected in session 48). MOE_GEMM_LEAN_TILES=0
    // turns it off, and so does MOE_FP8_MULTICAST=b (128-row pairs).
    // At 129-255 rows the lone 64-row tiles also replace 2-CTA clusters (wide N) where they run in one
    // wave: 0.77x the time of 128 x 112 pairs sharing B at 144 x 7168 x 16384 (64 x 192, 54.9 against
    // 71.2 us; cuBLAS 50.0) and 0.97x at 144 x 7168 x 2048 (bench/RESULTS.md, session 48). Several
    // waves (x 32768 x 512) are not measured and keep the pairs; so do clusters that MOE_FP8_MULTICAST=2
    // or =b asks for.
    const bool lean = m >= 256 && t.block_m == 128 && t.tiles * 4 >= 3LL * num_sms && !share_b_forced &&
                      env_enabled("MOE_GEMM_LEAN_TILES");
    const bool clusters_kept = multicast > 1 && (forced || share_b_forced);
    if (m > 128 && (m < 256 ? !clusters_kept : multicast == 1 && lean)) {
      const Tiles rows64 = choose_tiles(fn, 1, m, n, num_sms, kMaxBlockN, stage_bytes, block_n_fits_scales, 1,
                                        split_k, max_block_m, 64, single_wave_ways);
      if (rows64.waves <= t.waves && (multicast == 1 || rows64.waves <= 16) &&
          (m < 256 || 64 + rows64.block_n < t.block_m + t.block_n)) {
        t = rows64;
        multicast = 1;
      }
    }
    if (single_wave_ways == 0 && t.tiles * 4 < 3LL * num_sms && k / kBlockK >= kSingleWaveSplit * kSingleWaveMinKBlocks) {
      single_wave_ways = kSingleWaveSplit;
      t = choose_tiles(fn, 1, m, n, num_sms, kMaxBlockN, stage_bytes, block_n_fits_scales, multicast, split_k,
                       max_block_m, t.block_m, single_wave_ways);
    }
  }
  // MOE_GEMM_WIDE_MIN_ROWS=<rows> moves kWideTileMinRows (read per call), for timing the rule's edge.
  // Below it, from kWideOneWaveMinRows, 256 x 128 tiles only where they run in one wave, the 128-row
  // plan needs more and N leaves no partial n-block (rules.hpp).
  const int wide_env = env_int("MOE_GEMM_WIDE_MIN_ROWS");
  const int wide_min_rows = wide_env > 0 ? wide_env : kWideTileMinRows;
  if (wide_ok && m >= std::min(wide_min_rows, kWideOneWaveMinRows) && n >= 256 && !tiles_forced) {
    const int wide_multicast = clusters_allowed ? 2 : 1;
    const Tiles wide = choose_tiles(fn, 1, m, n, num_sms, 128, stage_bytes, [](int bn) { return bn == 128; },
                                    wide_multicast, split_k, max_block_m, 256);
    // A 256-row tile does two 128-row tiles' work in kWideTileCost sixteenths of their time.
    const bool cheaper = wide.score * 2 * kWideTileCost < t.score * 16;
    const bool one_wave = wide.waves <= 16 && t.waves > 16 && n % 128 == 0;
    if (m >= wide_min_rows ? cheaper : one_wave) {
      t = wide;
      multicast = wide_multicast;
    }
  }
  if (scale_load == moe_kernels::kScaleTmaKMajor && (t.block_m < kScaleTmaKMajorMinBlockM || k < kScaleTmaKMajorMinK)) {
    Config gathers = plan_config(m, n, k, num_sms, compile_m, residual, type, num_groups, contiguous_alignment,
                                 split_workspace, moe_kernels::kScaleGather, false);
    set_gather_chunk(gathers, scale_load);
    return gathers;
  }
  // The clusters: a single n-block would pair with a padding one (nothing to share). Clusters sharing
  // B (MOE_FP8_MULTICAST=b, or unset on contiguous 128 x 192 tiles, on masked ones from
  // kMaskedShareBMinRows rows and on dense clusters of 129-256 rows): pairs of 128-row m-blocks of
  // one n-block (masked: inside one group, common/scheduler.cuh); every tile runs whole (no tail
  // split), the pair in step. Dense: with two m-blocks each pair reads its B tile once; at 144-256 x
  // {24576 x 1536, 32768 x 512} (128 x 192 and 128 x 128 tiles) 0.85-0.95x the time of clusters
  // sharing A; at 384 rows (three m-blocks, pairs across n-blocks) 1.12-1.16x (bench/RESULTS.md,
  // session 46).
  const int cluster_a = multicast > 1 && (n + t.block_n - 1) / t.block_n >= 2 ? multicast : 1;
  const bool dense_pairs = type == GemmType::kNormal && cluster_a > 1 && m <= 2 * 128;
  const bool grouped_pairs = t.block_n == kInStepBlockN &&
                             (type == GemmType::kGroupedContiguous ||
                              (type == GemmType::kGroupedMasked && m >= kMaskedShareBMinRows));
  const bool share_b_default = multicast_env == nullptr && (dense_pairs || grouped_pairs);
  const bool share_b = (share_b_forced || share_b_default) && t.block_m == 128 && t.block_n % 16 == 0 &&
                       num_sms % 2 == 0 && m > t.block_m;
  cfg.block_m = t.block_m;
  cfg.block_n = t.block_n;
  cfg.multicast = share_b ? 2 : cluster_a;
  cfg.share_b = share_b ? 1 : 0;
  if (share_b) single_wave_ways = 0;
  // The scheduler's bands: kGroupN n-blocks, for L2 reuse between waves. A dense single wave of
  // lone CTAs over several m-blocks walks bands of one n-block instead, so the CTAs reading one B
  // tile are neighbours in launch order: 0.82-0.86x the time of 8-wide bands at 128 x 4096 x 7168
  // and 0.88-0.91x at 128 x 2112 x 7168 (64-row tiles, two m-blocks; five processes on an H100),
  // level at 256 rows (128-row tiles), at 4096 x 576 x 7168 and at 64 rows (one m-block). Clusters
  // and several waves keep the bands: one n-block took 1.07x at 128 x 7168 x 16384 (clusters) and
  // 1.08x at 4096 x 32768 x 512 (bench/RESULTS.md, session 45). MOE_GEMM_GROUP_N=<n> overrides.
  const int group_n = env_int("MOE_GEMM_GROUP_N");
  const bool lone_single_wave = type == GemmType::kNormal && cfg.multicast == 1 && cfg.one_wave(m) &&
                                m > t.block_m;
  cfg.group_n = group_n > 0 ? group_n : lone_single_wave ? 1 : kGroupN;
  // Tight boxes: where M cuts the last m-block, or N the last n-block, boxes of A (and of MN-major
  // or table scales) and of B that end at row M and N instead of reading zeros past them (TMA's zero
  // fill costs more than the rows it replaces): tail maps for those blocks, in clusters the CTA whose
  // half M cuts loading the rest of it and a CTA whose half lies past M none. At 1-63 rows (one
  // m-block) x {2112, 4096} x 7168 0.62-0.94x the time of whole boxes, 0.74x and 0.85x in clusters at
  // 1 and 7 x 7168 x 16384 (session 46); A's on 64-row tiles 0.69-0.76x at 144 x {576, 2112, 4096}
  // x 7168 and 200 x 2112 x 7168, level at 200 x {576, 4096} x 7168 (MN-major A scales; session 47).
  // N's tail measured level at {384, 1024} x 7168 x 16384 (128 x 192 tiles; the 0.87-0.92x first
  // recorded compared it with the gathered plan: bench/RESULTS.md, session 48).
  // MOE_FP8_TIGHT_BOXES=0 turns it off. Pairs sharing B keep whole boxes unless
  // MOE_FP8_TIGHT_BOXES=pairs (not timed yet): then the CTA whose m-block M cuts loads A (and its
  // MN-major or table scales) through the tail maps; B's halves stay whole.
  const char* tight_env = std::getenv("MOE_FP8_TIGHT_BOXES");
  const bool tight_pairs = tight_env != nullptr && std::string(tight_env) == "pairs";
  const bool tight_ok = type == GemmType::kNormal && (!share_b || tight_pairs) &&
                        scale_load != moe_kernels::kScaleTmaKMajor && env_enabled("MOE_FP8_TIGHT_BOXES");
  const bool cuts = m % t.block_m != 0 || (!share_b && n % t.block_n != 0);
  cfg.tight_boxes = tight_ok && cuts ? 1 : 0;
  // The table: one slot where no CTA runs a second tile, else two, so the next tile's fills while
  // this one's is read.
  const int table_slots = cfg.one_wave(m) ? 1 : 2;
  if (scale_load == moe_kernels::kScaleTmaKMajorTable &&
      (t.block_m > 128 || !fit_sfa_slots(t, k, scale_load, table_slots, kScaleTableMinStages))) {
    // A 256-row tile, or one that the table would leave too few stages: the K-major rules above.
    return plan_config(m, n, k, num_sms, compile_m, residual, type, num_groups, contiguous_alignment, split_workspace,
                       moe_kernels::kScaleTmaKMajor, false);
  }
  cfg.num_stages = t.num_stages;
  cfg.table_slots = scale_load == moe_kernels::kScaleTmaKMajorTable ? table_slots : 0;
  cfg.smem_bytes = t.smem_bytes;
  cfg.swizzle_d = t.swizzle_d;
  cfg.scale_warps = scale_load == moe_kernels::kScaleGather ? copy_scale_warps(t.num_stages) : 0;
  cfg.split_k = single_wave_ways;
  cfg.splits = split_workspace;
  cfg.tail_split_on = tail_split_enabled();
  // Programmatic dependent launch unless MOE_GEMM_PDL=0 (read per call): in a CUDA graph of 8
  // dependent dense GEMMs at 64-128 rows, 1.00-1.10x per GEMM in 13 of 14 shapes, 0.95x at 128 x
  // 7168 x 16384 (bench/RESULTS.md, session 10). Grouped and large-M GEMMs were not timed against
  // it in one run; across runs they stayed level.
  cfg.pdl = env_enabled("MOE_GEMM_PDL") ? 1 : 0;
  // One math warpgroup (block M 64) has no partner to take turns with. 128 x 192 tiles (dense,
  // contiguous and masked) run without turns, their K loop unrolled 8 times (below); other wide
  // tiles (block N 152-184) keep the turns, not measured without. Masked 128 x 192 tiles in step
  // and unrolled 8 times took 0.86-0.93x the time of the turns at 256-1024 rows per expert (32
  // experts, 4096 x 7168 and 7168 x 2048, one interleaved run on an H200: bench/RESULTS.md, session
  // 33); only K block counts that are a multiple of 8 were timed (ptxas' remainder loops rebuild the
  // wgmma descriptors per K block: ~110 R2UR), so other masked K keep the turns.
  // MOE_FP8_PINGPONG=1|0 forces turns on or off.
  const char* pingpong = std::getenv("MOE_FP8_PINGPONG");
  const bool wide_tile = t.block_m == 128 && t.block_n >= kPingPongMinBlockN;
  const bool in_step_tile = wide_tile && t.block_n == kInStepBlockN &&
                            (type != GemmType::kGroupedMasked || (k / kBlockK) % 8 == 0);
  const bool wants_pingpong = pingpong == nullptr ? wide_tile && !in_step_tile : std::string(pingpong) != "0";
  cfg.pingpong = t.block_m == 128 && wants_pingpong ? 1 : 0;
  // The math K loop unrolled: ptxas then issues the next K block's full-barrier wait among the last
  // promotion's FMAs. 4 times on dense 256-row tiles: at 4096 rows, 0.95-1.00x the time of the plain
  // loop in all six 256 x 128 shapes (bench/RESULTS.md, session 11); and on dense and contiguous
  // 128-row ping-pong tiles (about 0.95x their plain loop, session 13). 8 times on dense and
  // contiguous 128 x 192 tiles without ping-pong, masked ones since session 33 (DeepGEMM's 128 x 192
  // kernel: no turns, unrolled 8):
  // 0.95-0.98x the time of the ping-pong tiles unrolled 4 times in the four contiguous cells, in
  // three timings each (once 0.92x), 0.96x at 4096 x 2112 x 7168 (bench/RESULTS.md, session 17). The
  // warpgroups' wgmmas then queue on the tensor cores together, and each promotes while the other's
  // run, without the turns' named barriers.
  // 8 times on the other dense 128-row tiles without ping-pong (DeepGEMM's loops on its 128 x 96 and
  // 128 x 112 plans are unrolled 8 too): 0.94x the time of the plain loop at 384 x 4096 x 7168 (128 x
  // 96: 22.0 against 23.4 us, DeepGEMM 20.2), 0.97-0.98x at 256 x {4096, 7168} x {7168, 16384}, 144 x
  // 7168 x 2048 and 1024 x 2112 x 7168; 4 times took 0.95x at 384 x 4096, 16 times 1.22x (bench/RESULTS.md,
  // session 48).
  // Other masked tiles, grouped 256-row tiles and grouped 128-row tiles without ping-pong other than
  // 128 x 192 are not measured and keep the plain loop. MOE_GEMM_K_UNROLL=N overrides.
  const int k_unroll = env_int("MOE_GEMM_K_UNROLL");
  const bool unrolled4 = (type == GemmType::kNormal && t.block_m == 256) ||
                         (type != GemmType::kGroupedMasked && cfg.pingpong == 1);
  const bool unrolled8 = (in_step_tile || (type == GemmType::kNormal && t.block_m == 128)) && cfg.pingpong == 0;
  cfg.k_unroll = k_unroll > 0 ? k_unroll : unrolled4 ? 4 : unrolled8 ? 8 : 1;
  // A lone math warpgroup (block M 64) overlaps its promotion with the next K block's wgmmas where
  // a third accumulator set fits (block N <= 128). Measured against the plain loop at M 64 and 128
  // (bench/RESULTS.md, session 13): 1.00-1.10x faster dense; masked 64 x 128 decode tiles level
  // (the weights bound them).
  // MOE_FP8_OVERLAP=0 turns it off.
  // Its K loop runs in rounds of max(4, k_unroll) K blocks (an even count), whole ones only;
  // MOE_GEMM_K_UNROLL=8 gives rounds of 8 (not measured yet; the default rounds are 4).
  const int overlap_round = std::max(4, cfg.k_unroll);
  cfg.overlap = t.block_m == 64 && t.block_n <= 128 && overlap_round % 2 == 0 && k % (kBlockK * overlap_round) == 0 &&
                        env_enabled("MOE_FP8_OVERLAP")
                    ? 1
                    : 0;
  // Per-warpgroup epilogues (kWgStore) on tiles of two math warpgroups without turns, with 2-D stores
  // (dense and contiguous): at 4096 rows 0.97x the time of the tile-wide epilogue at K = 512, 0.98-0.99x
  // on the contiguous cells, level elsewhere (bench/RESULTS.md, session 23). MOE_FP8_WG_STORE=0 turns
  // them off.
  cfg.wg_store = t.block_m >= 128 && cfg.pingpong == 0 && type != GemmType::kGroupedMasked &&
                         env_enabled("MOE_FP8_WG_STORE")
                     ? 1
                     : 0;
  // Which plans copy A scales MN-major first, and the measurements behind the rule:
  // launchers/sm90_fp8_gemm_workspace.hpp.
  const char* copy_env = std::getenv("MOE_FP8_SFA_COPY");
  const bool copy_all = copy_env != nullptr && std::string(copy_env) == "all";
  const bool copies = (type == GemmType::kNormal && (t.block_m == 256 || copy_all)) ||
                      (type == GemmType::kGroupedContiguous && m >= kSfaCopyMinRowsContiguous &&
                       (n >= kSfaCopyMinNContiguous || copy_all));
  // A table plan loads its K-major scales itself: no copy, under MOE_FP8_SFA_COPY=all too.
  cfg.sfa_copy = copies && split_workspace && scale_load != moe_kernels::kScaleTmaMnMajor &&
                         scale_load != moe_kernels::kScaleTmaKMajorTable && (k / kBlockK) % 4 == 0 &&
                         sfa_copy_fits(m, k) && env_enabled("MOE_FP8_SCALE_TMA") && env_enabled("MOE_FP8_SFA_COPY")
                     ? 1
                     : 0;
  set_gather_chunk(cfg, scale_load);
  return cfg;
}

using PlanMemo = moe_jit::EnvMemo<std::array<int, 11>, Config, moe_jit::IntArrayHash>;
inline PlanMemo& plan_memo() {
  static PlanMemo memo;
  return memo;
}

// plan_config once per shape and environment: a call then skips the heuristic and its getenv reads
// (the raw FP8 entry points' own host work went from 1.17-1.44 to 0.72-0.80 µs per call with this
// and the descriptor memo, bench/RESULTS.md session 20).
inline Config get_config(int m, int n, int k, int num_sms, bool compile_m, Residual residual,
                         GemmType type, int num_groups, int contiguous_alignment, bool split_workspace,
                         unsigned scale_load) {
  const std::array<int, 11> key = {m, n, k, num_sms, compile_m, static_cast<int>(residual), static_cast<int>(type),
                                   num_groups, contiguous_alignment, split_workspace, static_cast<int>(scale_load)};
  return plan_memo().get(key, [&] {
    return plan_config(m, n, k, num_sms, compile_m, residual, type, num_groups, contiguous_alignment,
                       split_workspace, scale_load);
  });
}

inline const char* swiglu_function_name(GemmType type) {
  return type == GemmType::kGroupedMasked ? "m_grouped_fp8_gemm_nt_swiglu_masked"
                                          : "m_grouped_fp8_gemm_nt_swiglu_contiguous";
}

// The L1 GEMM with the SwiGLU epilogue (kSwiGlu), grouped: 128-column tiles in pairs (one act scale
// group; MOE_SWIGLU_WIDE: one 256-column tile), 64 rows up to 128 rows (per group, masked) and 128
// beyond, like plan_config's first choice; none of its overlap, splits or scale copies (the held act
// or the wide tile's sums leave no room for a third accumulator set), clusters sharing B and turns
// only where asked for. m: rows (contiguous) or expected rows per group (masked); scale_load:
// scale_layout_for the arguments, K-major A scales gathered (TMA loads them for 256-row tiles only).
inline Config plan_swiglu(int m, int n, int k, int num_sms, GemmType type, int num_groups, unsigned scale_load) {
  const char* fn = swiglu_function_name(type);
  MOE_HOST_ASSERT(type != GemmType::kNormal, fn << ": the SwiGLU epilogue is for grouped GEMMs");
  check_shape(fn, m, n, k);
  MOE_HOST_ASSERT(n % 256 == 0, fn << ": N (2 x intermediate) must be a multiple of 256, got " << n);
  MOE_HOST_ASSERT(num_sms >= 1, fn << ": num_sms must be >= 1, got " << num_sms);
  MOE_HOST_ASSERT(num_groups >= 1, fn << ": num_groups must be >= 1, got " << num_groups);
  const unsigned layout = scale_load;
  if (!env_enabled("MOE_FP8_SCALE_TMA") || scale_load != moe_kernels::kScaleTmaMnMajor) {
    scale_load = moe_kernels::kScaleGather;
  }
  const auto stage_bytes = [scale_load](int block_m, int block_n) {
    return sm90_fp8_gemm::stage_bytes(block_m, block_n, scale_load);
  };
  Tiles t = choose_tiles(fn, type == GemmType::kGroupedMasked ? num_groups : 1, m, n, num_sms, 128, stage_bytes,
                         [](int bn) { return bn == 128; }, 2);
  // MOE_SWIGLU_WIDE=1: 256-column tiles, both n-blocks of a pair in one K loop (each math warpgroup's two
  // 128-column halves in turn): A and B cross L2 once per 128 x 256 outputs instead of twice per pair.
  // Off by default: 1.04-1.07x the pairs' time contiguous on an H200 (session 39). =2: and the two math
  // warpgroups of a 128-row tile take turns on the tensor cores, a half each (untimed).
  const int wide = env_int("MOE_SWIGLU_WIDE");
  if (wide == 1 || wide == 2) t.block_n = 256;
  // No D tile (the epilogue stores from registers): its shared memory goes to the stages.
  const int per_stage = stage_bytes(t.block_m, t.block_n);
  t.num_stages = stages_beside(pipeline_smem(t.block_m, t.block_n, 0, per_stage, false), per_stage);
  t.smem_bytes = pipeline_smem(t.block_m, t.block_n, t.num_stages, per_stage, false);
  Config cfg{};
  cfg.fn = fn;
  cfg.type = type;
  cfg.n = n;
  cfg.k = k;
  cfg.block_m = t.block_m;
  cfg.block_n = t.block_n;
  cfg.num_stages = t.num_stages;
  // Bands of pairs: kGroupN n-blocks of B, as plan_config's.
  const int group_n = env_int("MOE_GEMM_GROUP_N");
  cfg.group_n = group_n > 0 ? group_n : kGroupN / 2;
  cfg.residual = Residual::kNone;
  cfg.num_sms = num_sms;
  cfg.smem_bytes = t.smem_bytes;
  cfg.swizzle_d = t.swizzle_d;
  cfg.scale_load = scale_load;
  cfg.scale_warps = scale_load == moe_kernels::kScaleGather ? copy_scale_warps(t.num_stages) : 0;
  set_gather_chunk(cfg, layout);
  // MOE_FP8_MULTICAST=b: 2-CTA clusters of adjacent 128-row m-blocks share each B tile (as plan_config's
  // =b; not timed against single CTAs yet, so not the default).
  const char* multicast_env = std::getenv("MOE_FP8_MULTICAST");
  const bool share_b = multicast_env != nullptr && std::string(multicast_env) == "b" && t.block_m == 128 &&
                       num_sms % 2 == 0 && m > t.block_m;
  cfg.multicast = share_b ? 2 : 1;
  cfg.share_b = share_b ? 1 : 0;
  cfg.splits = false;
  cfg.pdl = env_enabled("MOE_GEMM_PDL") ? 1 : 0;
  const int k_unroll = env_int("MOE_GEMM_K_UNROLL");
  cfg.k_unroll = k_unroll > 0 ? k_unroll : 1;
  cfg.swiglu = 1;
  cfg.pingpong = wide == 2 && t.block_m == 128 ? 1 : 0;
  return cfg;
}

inline Config get_swiglu_config(int m, int n, int k, int num_sms, GemmType type, int num_groups, unsigned scale_load) {
  static PlanMemo memo;
  const std::array<int, 11> key = {m, n, k, num_sms, 0, 0, static_cast<int>(type), num_groups, 0, 0,
                                   static_cast<int>(scale_load)};
  return memo.get(key, [&] { return plan_swiglu(m, n, k, num_sms, type, num_groups, scale_load); });
}

}  // namespace moe_launchers::sm90_fp8_gemm
