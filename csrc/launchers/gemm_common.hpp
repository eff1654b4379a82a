#pragma once
// Pieces shared by the SM90 GEMM launchers (sm90_fp8_gemm.hpp, sm90_fp8_fp4_gemm.hpp,
// sm90_bf16_gemm.hpp): the tile heuristic, TMA descriptors, the epilogue's swizzle choice and the
// scale-warp switch.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/driver.hpp"
#include "jit/env_memo.hpp"
#include "jit/exception.hpp"
#include "launchers/tma_memo.hpp"
#include "moe_kernels/common/masked_store.h"

namespace moe_launchers::sm90_gemm {

constexpr int kMaxStages = 32;
constexpr int kGroupN = 8;            // n-blocks per scheduler band (L2 reuse)
constexpr int kSmemLimit = 232448;    // SM90 opt-in shared memory per block
// A wgmma's fixed cost, in columns of N: the A operand is re-read for every instruction, so a
// tile costs about (block_n + kTileOverheadN) units of time.
constexpr int kTileOverheadN = 32;

enum class Residual : int { kNone = 0, kBFloat16 = 1, kFloat32 = 2 };
// Mirrors moe_kernels::GemmType.
enum class GemmType : int { kNormal = 0, kGroupedContiguous = 1, kGroupedMasked = 2 };

struct GeneratedKernel {
  std::string name;
  std::string code;
};

struct Tiles {
  int block_m, block_n, num_stages, smem_bytes;
  int swizzle_d;     // bytes of the epilogue's swizzle atom (128, 64, 32) or 0 for plain rows
  long long score;   // the chosen block N's cost: sixteenths of a wave x (block_n + kTileOverheadN)
  long long tiles;   // of the chosen block N (n-blocks in whole clusters)
  long long waves;   // sixteenths of a wave
};

// Shared-memory bytes of a pipeline: the D tile (unless the epilogue stores from registers) plus
// `stages` stages of `stage_bytes`, plus the two mbarriers of each stage.
inline int pipeline_smem(int block_m, int block_n, int stages, int stage_bytes, bool with_d = true) {
  return (with_d ? block_m * block_n * 2 : 0) + stages * stage_bytes + 2 * stages * 8;
}

// An integer environment switch, 0 when unset or empty.
inline int env_int(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || *value == '\0' ? 0 : std::atoi(value);
}

// Pipeline stages of `per_stage` bytes (and their two mbarriers) that fit in shared memory beside
// `fixed` bytes: at most kMaxStages, and at most MOE_GEMM_STAGES where that is set.
inline int stages_beside(int fixed, int per_stage) {
  const int stages = std::min(kMaxStages, (kSmemLimit - fixed) / (per_stage + 16));
  const int cap = env_int("MOE_GEMM_STAGES");
  return cap != 0 ? std::min(stages, cap) : stages;
}

// The tail split of dense FP8 GEMMs (common/scheduler.cuh): a last wave holding fewer tiles than
// the grid has clusters runs each of them split over K into units, as many per tile as the clusters
// hold, each unit at least kMinSplitKBlocks K blocks, at most kMaxTailSplits. Measured on an H200
// (bench/RESULTS.md, session 7): 4 units of 32 K blocks at 4096 x 7168 x 16384, 1.10x; units of 4
// to 19 K blocks (K = 1536, 2048, 7168) 0.94-1.00x: a last wave that few SMs run is already shorter
// than a full one (those SMs get the clock and memory to themselves), which short units do not
// beat. MOE_GEMM_TAIL_SPLIT=0 turns it off (read per call).
// A problem of one partial wave may split all its tiles the same way, into `single_wave_ways` units
// each (capped by the clusters free for them, the K blocks and kMaxTailSplits; 0 or 1: none): the
// SMs that whole tiles would leave idle then share the K loop. The FP8 heuristic takes it where
// whole tiles leave a quarter of the SMs idle (sm90_fp8_gemm_heuristic.hpp); MOE_GEMM_SPLIT_K=<ways> sets it.
constexpr int kMinSplitKBlocks = 32;
constexpr int kMaxTailSplits = 8;

struct TailSplit {
  int ways = 1;        // units per tail tile (1: none)
  int tail_tiles = 0;  // cluster tiles of the last, partial wave (all of them for a single wave; 0 where ways is 1)

  // CTAs that run a problem of `tiles` tiles on at most num_sms SMs: the split tail's units take SMs
  // that a single wave would leave idle.
  int grid(long long tiles, int num_sms, int multicast) const {
    const long long units = ways > 1 ? std::max<long long>(tiles, 1LL * tail_tiles * multicast * ways) : tiles;
    return std::max(multicast, static_cast<int>(std::min<long long>(units, num_sms)) / multicast * multicast);
  }
};

// MOE_GEMM_TAIL_SPLIT=0 turns every split off (read per call, once: the tile heuristic plans a
// split for each candidate block N).
inline bool tail_split_enabled() {
  const char* value = std::getenv("MOE_GEMM_TAIL_SPLIT");
  return value == nullptr || std::string(value) != "0";
}

// tiles: of the whole problem (a multiple of multicast), on num_sms SMs in clusters of multicast.
inline TailSplit tail_split(long long tiles, int num_sms, int k, int multicast, int single_wave_ways,
                            bool enabled = tail_split_enabled()) {
  if (!enabled) return {};
  const long long clusters = num_sms / multicast, cluster_tiles = tiles / multicast;
  if (clusters == 0 || cluster_tiles == 0) return {};
  if (cluster_tiles < clusters) {
    const int ways = static_cast<int>(
        std::min<long long>({single_wave_ways, clusters / cluster_tiles, k / 128, kMaxTailSplits}));
    return ways > 1 ? TailSplit{ways, static_cast<int>(cluster_tiles)} : TailSplit{};
  }
  const long long tail = cluster_tiles % clusters;
  if (tail == 0) return {};
  const int ways = static_cast<int>(std::max<long long>(
      1, std::min<long long>({clusters / tail, k / 128 / kMinSplitKBlocks, kMaxTailSplits})));
  return ways > 1 ? TailSplit{ways, static_cast<int>(tail)} : TailSplit{};
}

// Analytic choice: fewest waves of tiles weighted by a tile's cost, then the larger block N, then
// as many stages as shared memory holds. For A/B timing (read per call, like the kernels' other
// switches): MOE_GEMM_BLOCK_M=64|128 (|256 where max_block_m allows; block N then 128),
// MOE_GEMM_BLOCK_N=<multiple of 8> and MOE_GEMM_STAGES=<at most this many> replace the
// heuristic's choice; a value the kernel cannot take raises. `problems` independent problems of
// m x n each.
// `stage_bytes(block_m, block_n)` is one stage; `block_n_ok` filters candidates. With clusters of
// `n_block_multiple` CTAs on adjacent n-blocks the n-blocks are counted rounded up to whole
// clusters, so a block N whose padding would add a wave loses to one that does not. The search
// stops at `search_max_block_n` where nonzero (a heuristic's preference); a forced block N may go
// up to max_block_n (what the kernel takes).
template <typename StageBytes, typename BlockNOk>
Tiles choose_tiles(const char* fn, long long problems, int m, int n, int num_sms, int max_block_n,
                   StageBytes stage_bytes, BlockNOk block_n_ok, int n_block_multiple = 1, int tail_split_k = 0,
                   int max_block_m = 128, int block_m = 0, int single_wave_ways = 0, int search_max_block_n = 0) {
  Tiles t{};
  // Up to 128 rows the weights dominate the bytes: one math warpgroup per CTA leaves shared memory
  // to deep B stages (two 64-row CTAs share each B tile through L2). block_m: the caller's choice.
  t.block_m = block_m != 0 ? block_m : m <= 128 ? 64 : 128;
  if (const int forced = env_int("MOE_GEMM_BLOCK_M")) {
    MOE_HOST_ASSERT(forced == 64 || forced == 128 || (forced == 256 && max_block_m >= 256),
                    fn << ": MOE_GEMM_BLOCK_M must be 64 or 128" << (max_block_m >= 256 ? " or 256" : "") << ", got "
                       << forced);
    t.block_m = forced;
  }
  // A 256-row tile holds three accumulator sets of block N / 2 registers per thread: block N 128.
  const auto fits = [&](int bn) { return block_n_ok(bn) && (t.block_m != 256 || bn == 128); };
  long long best_score = -1;
  const bool split_enabled = tail_split_k > 0 && tail_split_enabled();
  for (int bn = 8; bn <= (search_max_block_n != 0 ? search_max_block_n : max_block_n); bn += 8) {
    if (!fits(bn)) continue;
    const long long n_blocks = ((n + bn - 1) / bn + n_block_multiple - 1) / n_block_multiple * n_block_multiple;
    const long long tiles = problems * ((m + t.block_m - 1) / t.block_m) * n_blocks;
    // In sixteenths of a wave. A split tail (tail_split_k: the K of a kernel that splits it) costs
    // 1/splits of a wave plus an eighth for the units' fill and the partials' round trip.
    const int sms = num_sms / n_block_multiple * n_block_multiple;
    const int splits =
        split_enabled ? tail_split(tiles, num_sms, tail_split_k, n_block_multiple, single_wave_ways, true).ways : 1;
    const long long waves = splits > 1 ? tiles / sms * 16 + (16 + splits - 1) / splits + 2
                                       : (tiles + num_sms - 1) / num_sms * 16;
    const long long score = waves * (bn + kTileOverheadN);
    if (best_score < 0 || score < best_score || (score == best_score && bn > t.block_n)) {
      best_score = score;
      t.block_n = bn;
      t.score = score;
      t.tiles = tiles;
      t.waves = waves;
    }
  }
  if (const int forced = env_int("MOE_GEMM_BLOCK_N")) {
    MOE_HOST_ASSERT(forced >= 8 && forced % 8 == 0 && forced <= max_block_n && fits(forced),
                    fn << ": MOE_GEMM_BLOCK_N=" << forced << " is not a block N this kernel takes (multiples of 8 up to "
                       << max_block_n << " whose columns span at most two 128-wide scale blocks; 128 at block M 256)");
    t.block_n = forced;
  }
  const int per_stage = stage_bytes(t.block_m, t.block_n);
  if (const int cap = env_int("MOE_GEMM_STAGES")) {
    MOE_HOST_ASSERT(cap >= 2, fn << ": MOE_GEMM_STAGES must be at least 2, got " << cap);
  }
  t.num_stages = stages_beside(pipeline_smem(t.block_m, t.block_n, 0, per_stage), per_stage);
  MOE_HOST_ASSERT(t.num_stages >= 2,
                  fn << ": no pipeline fits shared memory for block " << t.block_m << "x" << t.block_n);
  t.smem_bytes = pipeline_smem(t.block_m, t.block_n, t.num_stages, per_stage);
  // The widest swizzle whose atom (swizzle / 2 bf16 columns) divides block N.
  t.swizzle_d = t.block_n % 64 == 0 ? 128 : t.block_n % 32 == 0 ? 64 : t.block_n % 16 == 0 ? 32 : 0;
  return t;
}

// MOE_FP8_SCALE_WARPS=1|2 runs fewer scale warps than the default 3 in the FP8 and FP8 x FP4
// GEMMs (read on every call, for A/B timing: one scale warp was the pipeline's bound at block M 128).
inline int scale_warps_setting() {
  const char* value = std::getenv("MOE_FP8_SCALE_WARPS");
  if (value == nullptr) return 3;
  const int n = std::atoi(value);
  return n >= 1 && n <= 3 ? n : 3;
}
// The scale warps taking turns over the 4-byte copies: the setting, one per stage at most.
inline int copy_scale_warps(int num_stages) { return std::min(scale_warps_setting(), num_stages); }

// MOE_FP8_GATHER_CHUNK (common/scale_gather.cuh; both families' gather_chunk_for): -1 unset (or empty),
// else 0, 1, 2 or 4; any other value raises, naming `fn`.
inline int gather_chunk_setting(const char* fn) {
  const char* env = std::getenv("MOE_FP8_GATHER_CHUNK");
  const std::string setting = env == nullptr ? "" : env;
  MOE_HOST_ASSERT(setting.empty() || setting == "0" || setting == "1" || setting == "2" || setting == "4",
                  fn << ": MOE_FP8_GATHER_CHUNK must be 0, 1, 2 or 4, got '" << setting << "'");
  return setting.empty() ? -1 : setting[0] - '0';
}

inline moe_jit::driver::CUtensorMapSwizzle tma_swizzle(int bytes) {
  using namespace moe_jit::driver;
  return bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
         : bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
         : bytes == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                       : CU_TENSOR_MAP_SWIZZLE_NONE;
}

// Row-major tensor [outer2, outer, inner] with strides in elements; outer2 = 0: a 2-D tensor. A
// kernel that stores with 3-D coordinates needs a 3-D map even for one group (outer2 = 1).
inline moe_jit::driver::CUtensorMap make_tma(const char* fn, std::uint64_t ptr, moe_jit::driver::CUtensorMapDataType dtype,
                                            int elem_bytes, std::uint64_t inner, std::uint64_t outer,
                                            std::uint64_t row_stride, std::uint32_t box_inner, std::uint32_t box_outer,
                                            moe_jit::driver::CUtensorMapSwizzle swizzle, const char* what,
                                            std::uint64_t outer2 = 0, std::uint64_t outer2_stride = 0) {
  using namespace moe_jit::driver;
  MOE_HOST_ASSERT(ptr % 16 == 0, fn << ": " << what << " must be 16-byte aligned");
  MOE_HOST_ASSERT((row_stride * elem_bytes) % 16 == 0 && (outer2_stride * elem_bytes) % 16 == 0,
                  fn << ": the strides of " << what << " must be multiples of 16 bytes, got "
                     << row_stride * elem_bytes << " and " << outer2_stride * elem_bytes);
  // The kernels address rows with signed 32-bit TMA coordinates (group * rows + row).
  MOE_HOST_ASSERT(outer * std::max<std::uint64_t>(outer2, 1) < (1ull << 31),
                  fn << ": " << what << " has " << outer * std::max<std::uint64_t>(outer2, 1)
                     << " rows; the kernels address at most 2^31");
  const auto encode = [&] {
    CUtensorMap map{};
    const cuuint32_t rank = outer2 > 0 ? 3 : 2;
    const cuuint64_t dims[3] = {inner, outer, outer2 > 0 ? outer2 : 1};
    const cuuint64_t strides[2] = {row_stride * elem_bytes, outer2_stride * elem_bytes};
    const cuuint32_t box[3] = {box_inner, box_outer, 1};
    const cuuint32_t elem_strides[3] = {1, 1, 1};
    MOE_CU_CHECK(api().cuTensorMapEncodeTiled(&map, dtype, rank, reinterpret_cast<void*>(ptr), dims, strides, box,
                                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return map;
  };
  if (!tma_memo_enabled()) return encode();
  const TmaMemo::Key key = {ptr, inner, outer, row_stride, outer2, outer2_stride,
                            (static_cast<std::uint64_t>(box_inner) << 32) | box_outer,
                            (static_cast<std::uint64_t>(dtype) << 16) | (static_cast<std::uint64_t>(swizzle) << 8) |
                                static_cast<std::uint64_t>(elem_bytes)};
  return TmaMemo::get(key, encode);
}

// The bf16 D map of a GEMM epilogue: one TMA box per epilogue atom (swizzle_d / 2 columns, or the
// whole block N unswizzled) by block M rows. Masked groups store with 3-D coordinates so that a
// group's tile never spills into the next group's rows, in boxes of kMaskedStoreRows rows (only
// those below masked_m are stored).
inline moe_jit::driver::CUtensorMap make_tma_d(const char* fn, std::uint64_t d, int n, int m, long long ldd,
                                              int block_n, int block_m, int swizzle_d, bool masked,
                                              int num_groups) {
  using namespace moe_jit::driver;
  const std::uint32_t box_n = swizzle_d == 0 ? block_n : swizzle_d / 2;
  return masked ? make_tma(fn, d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, n, m, ldd, box_n, moe_kernels::kMaskedStoreRows,
                           tma_swizzle(swizzle_d), "D", num_groups, static_cast<std::uint64_t>(ldd) * m)
                : make_tma(fn, d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, n, m, ldd, box_n, block_m, tma_swizzle(swizzle_d),
                           "D");
}

// A GEMM kernel from its memo, generated and built on first use; GEMMs run on SM90 only.
template <typename Memo, typename Key, typename Generate>
auto sm90_kernel(Memo& memo, const Key& key, const char* fn, int device, Generate&& generate) {
  return memo.get(key, [&] {
    const std::string arch = moe_jit::device_arch(device);
    MOE_HOST_ASSERT(arch == "sm_90a", fn << ": this kernel needs an SM90 GPU (H100/H200), the device is " << arch);
    const GeneratedKernel gen = generate();
    return moe_jit::build(gen.name, gen.code, arch);
  });
}

}  // namespace moe_launchers::sm90_gemm
