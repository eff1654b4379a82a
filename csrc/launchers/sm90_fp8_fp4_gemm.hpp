#pragma once
// FP8 x FP4 m-grouped GEMM family (impls/sm90_fp8_fp4_gemm.cuh), contiguous and masked: heuristic,
// code generation, TMA descriptors and launch.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/driver.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"
#include "launchers/gemm_common.hpp"
#include "moe_kernels/common/fp8_gemm_layout.h"

namespace moe_launchers::sm90_fp8_fp4_gemm {

using namespace moe_launchers::sm90_gemm;

constexpr int kBlockK = 128;
// The converter warpgroup writes 16 rows per pass; math holds two accumulator sets of block N / 2
// registers in its 208-232 budget.
constexpr int kMaxBlockN = 128;

// What both kernels' plans start from: the call, its N x K, the raster band and the SMs.
struct Problem {
  const char* fn;
  GemmType type;
  int n, k;
  int group_n, num_sms;
};

struct Config : Problem {
  int block_m, block_n, num_stages;
  int smem_bytes;
  int swizzle_d;
  int scale_warps = 3;  // warps issuing the scale copies, taking the stages in turn
  int multicast = 1;    // 2: clusters of two m-blocks converting their shared B tile once (kShareB)
  int gather_chunk = 0;  // kGatherChunk where the scales lie on 16 bytes (gather_chunk_for; launch may take 0)

  int num_tiles(int m) const { return ((m + block_m - 1) / block_m) * ((n + block_n - 1) / block_n); }
};

// A 0/1 switch of this family: -1 unset (or empty), 0 or 1; any other value raises, naming `fn`.
inline int switch_setting(const char* fn, const char* name) {
  const char* env = std::getenv(name);
  const std::string setting = env == nullptr ? "" : env;
  MOE_HOST_ASSERT(setting.empty() || setting == "0" || setting == "1",
                  fn << ": " << name << " must be 0 or 1, got '" << setting << "'");
  return setting.empty() ? -1 : setting == "1";
}

// MOE_FP4_SHARE_B=1: pairs of m-blocks on one weight tile convert it once, each CTA half of it
// (impls/sm90_fp8_fp4_gemm.cuh, kNumMulticast = 2), where groups have two m-blocks or more on
// average and the SMs pair up. Off by default: 0.98-1.01x the single CTAs' time at 256 tokens per
// expert on an H100 (bench/RESULTS.md, session 34), since the conversions do not bound that kernel.
inline bool share_b_setting(const char* fn) { return switch_setting(fn, "MOE_FP4_SHARE_B") == 1; }

// One stage: A, the converted and the packed B tiles, the scales (A rows, B exponent words, B
// column scales in ColumnScaleLayout's order: the four quads' runs padded 16 bytes apart when
// block N / 16 is even), and the stage's third mbarrier (converted).
inline int stage_bytes(int block_m, int block_n) {
  const int column_scale_floats = block_n + ((block_n / 16) % 2 == 0 ? 3 * 4 : 0);
  return block_m * kBlockK + block_n * kBlockK + block_n * kBlockK / 2 + (block_m + block_n + column_scale_floats) * 4 +
         8;
}

// Math warpgroups (block_m / 64), converter warpgroups (two beside one math warpgroup, else one)
// and the producer warpgroup; mirrors the kernel's launch bounds.
inline int block_threads(int block_m) { return (block_m / 64 + (block_m == 64 ? 2 : 1) + 1) * 128; }

inline const char* function_name(GemmType type) {
  return type == GemmType::kGroupedMasked ? "m_grouped_fp8_fp4_gemm_nt_masked" : "m_grouped_fp8_fp4_gemm_nt_contiguous";
}

// N and K as both kernels of the family take them.
inline void check_nk(const char* fn, int n, int k) {
  MOE_HOST_ASSERT(n >= 8 && n % 8 == 0, fn << ": N must be a positive multiple of 8, got " << n);
  MOE_HOST_ASSERT(k >= kBlockK && k % kBlockK == 0, fn << ": K must be a positive multiple of 128, got " << k);
}

// MOE_FP8_GATHER_CHUNK as the FP8 GEMM's: the scale warps load A's scales and B's exponent words into
// registers, that many K blocks per row at once, and store each K block's rows with coalesced stores
// instead of 4-byte cp.async copies (common/scale_gather.cuh). Chunks are capped where a lane's A rows or
// B rows would take more than 8 registers (block N 128: 2), and to 1 where K blocks are not a multiple of
// 4 (rows off 16 bytes); 128-row tiles in chunks of 2 split A's rows over two scale warps. The launch
// takes the copies where the scales' strides or bases are off the chunk.
// Unset, 128 x 128 tiles take chunks of 2: on an H100 at 32 experts x 256 tokens 0.93x the copies' time
// (4096 x 7168) and 0.96x (7168 x 2048); 64 x 128 tiles keep the copies (1.10x and 0.99x at 64 tokens,
// timed before the scale warps kept a second chunk in flight, session 51).
inline int gather_chunk_for(const Config& c) {
  const int setting = gather_chunk_setting(c.fn);
  const bool whole_chunks = (c.k / kBlockK) % 4 == 0;
  if (setting < 0) return c.block_m == 128 && c.block_n == 128 && c.scale_warps >= 2 && whole_chunks ? 2 : 0;
  if (setting == 0) return 0;
  if (c.block_m == 128 && c.scale_warps < 2) return 1;  // 4 A rows per lane and no pair: no room for more
  // A rows per lane (a 128-row tile's pair of warps: 2 each) and B rows per lane.
  const int rows_a = c.block_m == 128 ? 2 : c.block_m / 32, rows_b = (c.block_n + 31) / 32;
  int chunk = setting;
  while (chunk > 1 && (rows_a * chunk > 8 || rows_b * chunk > 8)) chunk /= 2;
  return chunk > 1 && !whole_chunks ? 1 : chunk;
}

// `m`: rows of A (contiguous) or the expected rows per group (masked, `num_groups` problems).
inline Config plan_config(int m, int n, int k, int num_sms, GemmType type, int num_groups) {
  const char* fn = function_name(type);
  MOE_HOST_ASSERT(type != GemmType::kNormal, fn << ": the FP4-weight GEMM is m-grouped");
  MOE_HOST_ASSERT(m >= 1, fn << ": M must be >= 1, got " << m);
  check_nk(fn, n, k);
  MOE_HOST_ASSERT(num_sms >= 1, fn << ": num_sms must be >= 1, got " << num_sms);
  MOE_HOST_ASSERT(num_groups >= 1, fn << ": num_groups must be >= 1, got " << num_groups);
  Config cfg{};
  static_cast<Problem&>(cfg) = Problem{fn, type, n, k, kGroupN, num_sms};
  const Tiles t = choose_tiles(fn, type == GemmType::kGroupedMasked ? num_groups : 1, m, n, num_sms, kMaxBlockN,
                               stage_bytes, [](int bn) { return bn % 16 == 0; });
  cfg.block_m = t.block_m;
  cfg.block_n = t.block_n;
  cfg.num_stages = t.num_stages;
  cfg.smem_bytes = pipeline_smem(t.block_m, t.block_n, t.num_stages, stage_bytes(t.block_m, t.block_n));
  cfg.swizzle_d = t.swizzle_d;
  cfg.scale_warps = copy_scale_warps(t.num_stages);
  // `m` per group: the contiguous rows over the groups, or the expected rows of a masked group.
  const long long rows_per_group = type == GemmType::kGroupedMasked ? m : m / num_groups;
  cfg.multicast = share_b_setting(fn) && num_sms >= 2 && rows_per_group > t.block_m ? 2 : 1;
  cfg.gather_chunk = gather_chunk_for(cfg);
  // The scale warps that may take turns (a pair where 128-row chunks split the rows), as the kernel
  // works them out.
  cfg.scale_warps = static_cast<int>(moe_kernels::scale_gather_warps(
      static_cast<unsigned>(cfg.scale_warps), static_cast<unsigned>(cfg.gather_chunk),
      static_cast<unsigned>(cfg.num_stages), static_cast<unsigned>(cfg.block_m)));
  return cfg;
}

// plan_config once per shape and environment (moe_jit::EnvMemo), as the FP8 family does.
inline Config get_config(int m, int n, int k, int num_sms, GemmType type, int num_groups) {
  static moe_jit::EnvMemo<std::array<int, 6>, Config, moe_jit::IntArrayHash> memo;
  const std::array<int, 6> key = {m, n, k, num_sms, static_cast<int>(type), num_groups};
  return memo.get(key, [&] { return plan_config(m, n, k, num_sms, type, num_groups); });
}

inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/sm90_fp8_fp4_gemm.cuh>\n"
     << "static __device__ void* moe_instantiate() {\n"
     << "  return reinterpret_cast<void*>(&moe_kernels::sm90_fp8_fp4_gemm_nt<" << static_cast<int>(c.type)
     << ", 0, " << c.n << ", " << c.k << ", " << c.block_m << ", " << c.block_n << ", " << c.num_stages << ", "
     << c.group_n << ", " << c.swizzle_d << ", " << c.scale_warps << ", " << c.multicast;
  if (c.gather_chunk != 0) os << ", " << c.gather_chunk;
  os << ">);\n"
     << "}\n";
  return {"sm90_fp8_fp4_gemm_nt", os.str()};
}

struct Args {
  std::uint64_t a, sfa, b, sfb, d;
  long long lda, ldb, ldd;      // A and D in elements; B (packed) in bytes
  long long sfa_stride_m, sfa_stride_k;
  long long sfb_stride_g, sfb_stride_n;  // bytes
  int m;                        // rows of A (masked: rows per group, max_m)
  int num_groups;
  std::uint64_t grouped_layout;  // m_indices or masked_m (int32, device)
  int device;
  std::uint64_t stream;
};

// Whether the launch's scales lie on the chunk: K-major A scales with rows and base on 4 x chunk bytes,
// exponent rows and groups likewise.
inline bool gather_chunk_fits(const Args& a, int chunk) {
  const std::uint64_t bytes = 4ull * static_cast<unsigned>(chunk);
  const long long stride_bytes = 4ll * chunk;
  return chunk <= 1 || (a.sfa_stride_k == 1 && a.sfa_stride_m % chunk == 0 && a.sfa % bytes == 0 &&
                        a.sfb % bytes == 0 && a.sfb_stride_n % stride_bytes == 0 && a.sfb_stride_g % stride_bytes == 0);
}

// Both FP4 kernels (converter and swapped) take the same arguments after their maps.
inline void check_sfb(const char* fn, const Args& a) {
  MOE_HOST_ASSERT(a.sfb % 4 == 0 && a.sfb_stride_n % 4 == 0 && a.sfb_stride_g % 4 == 0,
                  fn << ": SFB must be 4-byte aligned with strides that are multiples of 4 bytes");
}

inline void launch_with(const moe_jit::CompiledKernel& kernel, const moe_jit::LaunchConfig& cfg, const Args& a,
                        const moe_jit::driver::CUtensorMap& map_a, const moe_jit::driver::CUtensorMap& map_b,
                        const moe_jit::driver::CUtensorMap& map_d) {
  moe_jit::launch(kernel, cfg, static_cast<std::uint32_t>(a.m), reinterpret_cast<const int*>(a.grouped_layout),
                  static_cast<std::uint32_t>(a.num_groups), reinterpret_cast<const float*>(a.sfa),
                  static_cast<std::uint32_t>(a.sfa_stride_m), static_cast<std::uint32_t>(a.sfa_stride_k),
                  reinterpret_cast<const std::uint8_t*>(a.sfb), static_cast<std::uint32_t>(a.sfb_stride_g),
                  static_cast<std::uint32_t>(a.sfb_stride_n), map_a, map_b, map_d);
}

inline void launch(const Config& planned, const Args& a) {
  using namespace moe_jit::driver;
  check_sfb(planned.fn, a);
  // Scales off the chunk's alignment take the copies (any strides), with the warps that plan would have.
  Config c = planned;
  if (!gather_chunk_fits(a, c.gather_chunk)) {
    c.gather_chunk = 0;
    c.scale_warps = copy_scale_warps(c.num_stages);
  }
  static moe_jit::KernelMemo<std::array<int, 12>, moe_jit::IntArrayHash> memo;
  const std::array<int, 12> key = {static_cast<int>(c.type), c.n, c.k, c.block_m, c.block_n, c.num_stages, c.group_n,
                                   c.swizzle_d, c.scale_warps, c.multicast, c.gather_chunk, a.device};
  const auto kernel = sm90_kernel(memo, key, c.fn, a.device, [&] { return generate(c); });

  const bool masked = c.type == GemmType::kGroupedMasked;
  const std::uint64_t rows_a = masked ? static_cast<std::uint64_t>(a.m) * a.num_groups : a.m;
  const CUtensorMap map_a = make_tma(c.fn, a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k, rows_a, a.lda, kBlockK,
                                     c.block_m, CU_TENSOR_MAP_SWIZZLE_128B, "A");
  // Packed B: 64-byte rows, 64-byte swizzled so that the converter's 16-byte loads (a row per
  // thread) hit distinct banks; it re-lays them out 128-byte swizzled for wgmma.
  const CUtensorMap map_b = make_tma(c.fn, a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k / 2,
                                     static_cast<std::uint64_t>(c.n) * a.num_groups, a.ldb, kBlockK / 2, c.block_n,
                                     CU_TENSOR_MAP_SWIZZLE_64B, "B");
  const CUtensorMap map_d = make_tma_d(c.fn, a.d, c.n, a.m, a.ldd, c.block_n, c.block_m, c.swizzle_d, masked,
                                       a.num_groups);

  // The scale warps address A's scales and a group's exponent rows with 32-bit byte offsets (the
  // K block's part is added in 64 bits).
  const std::uint64_t last_sfa_row = rows_a - 1, last_sfb_row = static_cast<std::uint64_t>(c.n - 1);
  MOE_HOST_ASSERT(a.sfa_stride_m >= 0 && a.sfa_stride_k >= 0 && a.sfb_stride_n >= 0 && a.sfb_stride_g >= 0 &&
                      last_sfa_row * static_cast<std::uint64_t>(a.sfa_stride_m) * 4 < (1ull << 32) &&
                      last_sfb_row * static_cast<std::uint64_t>(a.sfb_stride_n) < (1ull << 32),
                  c.fn << ": the scales span more than 2^32 bytes (SFA stride_m " << a.sfa_stride_m
                       << " elements, SFB stride_n " << a.sfb_stride_n << " bytes)");

  moe_jit::LaunchConfig cfg;
  const int tiles = masked ? c.num_tiles(a.m) * a.num_groups : c.num_tiles(a.m);
  if (c.multicast > 1) {
    // Whole clusters: the pairs of m-blocks (rounded up per group) of every n-block, at most the SMs
    // that pair up.
    const int m_blocks = (a.m + c.block_m - 1) / c.block_m, n_blocks = (c.n + c.block_n - 1) / c.block_n;
    const int pairs = masked ? (m_blocks + 1) / 2 * n_blocks * a.num_groups : (m_blocks + 1) / 2 * n_blocks;
    cfg.grid_x = static_cast<unsigned>(2 * std::max(1, std::min(pairs, c.num_sms / 2)));
    cfg.cluster_dim = 2;
  } else {
    cfg.grid_x = static_cast<unsigned>(std::max(1, std::min(tiles, c.num_sms)));
  }
  cfg.block_x = static_cast<unsigned>(block_threads(c.block_m));
  cfg.smem_bytes = static_cast<unsigned>(c.smem_bytes);
  cfg.stream = a.stream;
  cfg.device = a.device;
  launch_with(*kernel, cfg, a, map_a, map_b, map_d);
}

// ---- the swapped kernel (impls/sm90_fp8_fp4_gemm_swap_ab.cuh): decode and prefill ---------------

constexpr int kSwapAbMaxTokens = 32;  // decode token blocks (masked); the decode layout's limit
constexpr int kSwapAbPrefillTokens = 128;  // prefill token blocks (contiguous; masked past 64 rows)

struct SwapAbConfig : Problem {
  int block_t;        // tokens per tile (wgmma N): a multiple of 8 up to 32 (decode), 64 or 128 (prefill)
  int num_math_wg;    // 64 weight rows each: 1, 2 or 4
  int k_blocks;       // 128-deep K blocks per pipeline stage: 2 halves the per-stage overhead
  int num_stages, smem_bytes;
  bool fragment_layout;  // weights in kernels/_fp4_fragment.py's layout (v2 decode)
  bool block_ref;        // packed weights: the tile's reference exponent per K block where it fits

  int block_w() const { return 64 * num_math_wg; }
  int num_tiles(int tokens_per_group, int num_groups) const {
    return num_groups * ((tokens_per_group + block_t - 1) / block_t) * ((n + block_w() - 1) / block_w());
  }
};

// Mirrors Fp8Fp4SwapAbSmem: fragment-layout blocks carry their exponent words (kFragmentBlockBytes
// per 64 rows); for packed weights the scale warps write theirs next to the A scales, with the K
// block's reference word (16 bytes).
constexpr int kFragmentBlockBytes = 4096 + 64 * 4;
inline int swap_ab_stage_bytes(int block_t, int block_w, int k_blocks, bool fragment_layout) {
  const int weights = fragment_layout ? block_w / 64 * kFragmentBlockBytes : block_w * kBlockK / 2;
  return k_blocks * (block_t * kBlockK + weights + (block_t + (fragment_layout ? 0 : block_w + 4)) * 4);
}

// Decode tiles: the widest weight block that still gives every SM a tile, and the A/B overrides
// MOE_FP4_DECODE_WG (math warpgroups of 64 weight rows: 1, 2 or 4) and MOE_FP4_DECODE_K_BLOCKS
// (128-deep K blocks per stage: 1, or 2 where K holds an even number).
inline void plan_decode_warpgroups(SwapAbConfig& c, int expected_m, int num_groups) {
  // Four accumulator sets (fragment layout) past 16 tokens do not fit five warpgroups' registers.
  const auto registers_fit = [&](int wg) { return !(c.fragment_layout && wg == 4 && c.block_t > 16); };
  for (int wg : {4, 2}) {
    if (!registers_fit(wg)) continue;
    SwapAbConfig trial = c;
    trial.num_math_wg = wg;
    if (trial.num_tiles(expected_m, num_groups) >= c.num_sms) {
      c.num_math_wg = wg;
      break;
    }
  }
  if (const int wg = env_int("MOE_FP4_DECODE_WG"); wg != 0) {
    MOE_HOST_ASSERT((wg == 1 || wg == 2 || wg == 4) && registers_fit(wg),
                    c.fn << ": MOE_FP4_DECODE_WG must be 1, 2 or 4 (4 only up to 16 tokens with the decode layout), got "
                         << wg);
    c.num_math_wg = wg;
  }
  if (const int kb = env_int("MOE_FP4_DECODE_K_BLOCKS"); kb != 0) {
    MOE_HOST_ASSERT(kb == 1 || (kb == 2 && (c.k / kBlockK) % 2 == 0),
                    c.fn << ": MOE_FP4_DECODE_K_BLOCKS must be 1, or 2 when K / 128 is even, got " << kb);
    c.k_blocks = kb;
  }
}

// Masked: `expected_m` rows per group, up to kSwapAbMaxTokens for decode tiles: the token block
// covers expected_m; the weight block is the widest (most math warps to hide the conversion's
// latency) that still gives every SM a tile. Past 32 expected rows (a group of more rows takes
// several), and for contiguous layouts (`expected_m` = the rows of A), prefill tiles:
// kSwapAbPrefillTokens tokens (64 for masked calls of up to 64 rows) x 128 weight rows, one K block
// per stage (a K block's wgmmas take long enough that the per-stage overhead does not count).
inline SwapAbConfig plan_swap_ab_config(GemmType type, int expected_m, int n, int k, int num_sms, int num_groups,
                                        bool fragment_layout) {
  const char* fn = function_name(type);
  const bool masked = type == GemmType::kGroupedMasked;
  MOE_HOST_ASSERT(type != GemmType::kNormal, fn << ": the FP4-weight GEMM is m-grouped");
  MOE_HOST_ASSERT(expected_m >= 1, fn << ": expected_m must be >= 1, got " << expected_m);
  MOE_HOST_ASSERT(!fragment_layout || expected_m <= kSwapAbMaxTokens,
                  fn << ": the decode layout takes 1.." << kSwapAbMaxTokens << " expected rows, got " << expected_m);
  MOE_HOST_ASSERT(!fragment_layout || masked, fn << ": the decode layout serves masked calls");
  check_nk(fn, n, k);
  SwapAbConfig c{};
  static_cast<Problem&>(c) = Problem{fn, type, n, k, kGroupN, num_sms};
  c.fragment_layout = fragment_layout;
  // MOE_FP4_BLOCK_REF=0: every K block on its rows' own scales (impls/sm90_fp8_fp4_gemm_swap_ab.cuh).
  c.block_ref = !fragment_layout && switch_setting(fn, "MOE_FP4_BLOCK_REF") != 0;
  const bool prefill = !masked || expected_m > kSwapAbMaxTokens;
  if (prefill) {
    // 64 or 128 tokens: at 104 ptxas kept three values of the K loop in local memory.
    c.block_t = masked && expected_m <= 64 ? 64 : kSwapAbPrefillTokens;
    c.num_math_wg = 2;
    c.k_blocks = 1;
  } else {
    c.block_t = (expected_m + 7) / 8 * 8;
    c.num_math_wg = 1;
    c.k_blocks = (k / kBlockK) % 2 == 0 ? 2 : 1;
    plan_decode_warpgroups(c, expected_m, num_groups);
  }
  const int per_stage = swap_ab_stage_bytes(c.block_t, c.block_w(), c.k_blocks, c.fragment_layout) + 16;
  const int d_bytes = (c.block_t * c.block_w() * 2 + 1023) / 1024 * 1024;
  c.num_stages = std::min(kMaxStages, (kSmemLimit - d_bytes) / per_stage);
  // Packed weights: the three scale warps take the stages in turn (impls/sm90_fp8_fp4_gemm_swap_ab.cuh).
  MOE_HOST_ASSERT(c.num_stages >= (c.fragment_layout ? 2 : 3), fn << ": no pipeline fits shared memory");
  c.smem_bytes = d_bytes + c.num_stages * per_stage;
  return c;
}

inline SwapAbConfig get_swap_ab_config(GemmType type, int expected_m, int n, int k, int num_sms, int num_groups,
                                       bool fragment_layout = false) {
  static moe_jit::EnvMemo<std::array<int, 7>, SwapAbConfig, moe_jit::IntArrayHash> memo;
  const std::array<int, 7> key = {static_cast<int>(type), expected_m, n, k, num_sms, num_groups, fragment_layout};
  return memo.get(key,
                  [&] { return plan_swap_ab_config(type, expected_m, n, k, num_sms, num_groups, fragment_layout); });
}

// Which kernel a call on packed weights runs: the swapped one for masked calls of up to
// kSwapAbMaxTokens expected rows (decode tiles) and of 65-128 (128-token prefill tiles), the
// converter kernel for contiguous layouts and the other masked calls. Measured on an H100
// (bench/RESULTS.md, session 32), the swapped kernel's prefill tiles over the converter kernel's
// time: masked 32 experts x 128 tokens 0.75-0.76x, x 64 tokens (64-token tiles) 1.05-1.06x;
// contiguous 0.99x at 4096 x 7168, 1.07x at 7168 x 2048. MOE_FP4_SWAP_AB (read per plan) changes
// that for A/B runs: 0, the converter kernel everywhere; 1, the swapped one wherever it can run
// (contiguous layouts, masked calls of any size).
struct Plan {
  bool swap_ab;
  Config converter;     // when !swap_ab
  SwapAbConfig swapped;  // when swap_ab
};

// ---- the staged path (kernels/grouped.py runs it): cast_fp4_to_fp8_blocks, then the FP8 GEMM ------
// From this many rows per group on, one pass over the weights costs less than the in-kernel
// conversions, which repeat a weight tile's conversion for every M tile (bench/RESULTS.md, session
// 33). kernels/_fp4.py's STAGED_MIN_ROWS is the same number.
constexpr int kStagedMinRows = 512;

// Whether a call of `rows` rows over `groups` groups (masked: min(expected_m, max_m) rows, one
// group) may run staged; the tensor entry points leave those calls to Python, which decides and
// checks MOE_FP4_STAGED (any setting but "0" counts as maybe here).
inline bool may_stage(long long rows, long long groups) {
  const char* env = std::getenv("MOE_FP4_STAGED");
  if (env != nullptr && env[0] != '\0') return !(env[0] == '0' && env[1] == '\0');
  return rows >= kStagedMinRows * groups;
}

inline Plan plan_kernel(GemmType type, int m, int n, int k, int num_sms, int num_groups) {
  const int forced = switch_setting(function_name(type), "MOE_FP4_SWAP_AB");
  const bool masked = type == GemmType::kGroupedMasked;
  Plan p{};
  p.swap_ab = forced == 1   ? true
              : forced == 0 ? false
                            : masked && (m <= kSwapAbMaxTokens || (m > 64 && m <= kSwapAbPrefillTokens));
  if (p.swap_ab) {
    p.swapped = plan_swap_ab_config(type, m, n, k, num_sms, num_groups, false);
  } else {
    p.converter = plan_config(m, n, k, num_sms, type, num_groups);
  }
  return p;
}

inline Plan get_plan(GemmType type, int m, int n, int k, int num_sms, int num_groups) {
  static moe_jit::EnvMemo<std::array<int, 6>, Plan, moe_jit::IntArrayHash> memo;
  const std::array<int, 6> key = {static_cast<int>(type), m, n, k, num_sms, num_groups};
  return memo.get(key, [&] { return plan_kernel(type, m, n, k, num_sms, num_groups); });
}

inline GeneratedKernel generate(const SwapAbConfig& c) {
  std::ostringstream os;
  os << "#include <moe_kernels/impls/sm90_fp8_fp4_gemm_swap_ab.cuh>\n"
     << "static __device__ void* moe_instantiate() {\n"
     << "  return reinterpret_cast<void*>(&moe_kernels::sm90_fp8_fp4_gemm_nt_swap_ab<" << static_cast<int>(c.type)
     << ", " << c.n << ", " << c.k << ", "
     << c.block_t << ", " << c.num_math_wg << ", " << c.k_blocks << ", " << c.num_stages << ", " << c.group_n << ", "
     << (c.fragment_layout ? "true" : "false") << ", " << (c.block_ref ? "true" : "false") << ">);\n"
     << "}\n";
  return {"sm90_fp8_fp4_gemm_nt_swap_ab", os.str()};
}

inline void launch(const SwapAbConfig& c, const Args& a) {
  using namespace moe_jit::driver;
  check_sfb(c.fn, a);
  static moe_jit::KernelMemo<std::array<int, 11>, moe_jit::IntArrayHash> memo;
  const std::array<int, 11> key = {static_cast<int>(c.type), c.n, c.k, c.block_t, c.num_math_wg, c.k_blocks,
                                   c.num_stages, c.group_n, static_cast<int>(c.fragment_layout),
                                   static_cast<int>(c.block_ref), a.device};
  const auto kernel = sm90_kernel(memo, key, c.fn, a.device, [&] { return generate(c); });
  const bool masked = c.type == GemmType::kGroupedMasked;
  const std::uint64_t rows_a = masked ? static_cast<std::uint64_t>(a.m) * a.num_groups : a.m;
  const CUtensorMap map_a = make_tma(c.fn, a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k, rows_a, a.lda, kBlockK,
                                     c.block_t, CU_TENSOR_MAP_SWIZZLE_128B, "A");
  // Fragment layout: [G, K/128, ceil(N/64), kFragmentBlockBytes] as rows of 256 bytes.
  constexpr int kRowsPerBlock = kFragmentBlockBytes / 256;
  const std::uint64_t fragment_rows =
      static_cast<std::uint64_t>(a.num_groups) * (c.k / kBlockK) * ((c.n + 63) / 64) * kRowsPerBlock;
  const CUtensorMap map_w =
      c.fragment_layout
          ? make_tma(c.fn, a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 256, fragment_rows, 256, 256,
                     kRowsPerBlock * c.num_math_wg, CU_TENSOR_MAP_SWIZZLE_NONE, "B")
          : make_tma(c.fn, a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k / 2, static_cast<std::uint64_t>(c.n) * a.num_groups,
                     a.ldb, kBlockK / 2, c.block_w(), CU_TENSOR_MAP_SWIZZLE_64B, "B");
  // D in 128-byte swizzled atoms of 64 columns (common/epilogue.cuh): boxes of kMaskedStoreRows
  // rows of a masked group, or the tile's block_t rows.
  const CUtensorMap map_d = make_tma_d(c.fn, a.d, c.n, a.m, a.ldd, c.block_w(), c.block_t, 128, masked, a.num_groups);
  moe_jit::LaunchConfig cfg;
  const int tiles = masked ? c.num_tiles(a.m, a.num_groups) : c.num_tiles(a.m, 1);
  cfg.grid_x = static_cast<unsigned>(std::max(1, std::min(tiles, c.num_sms)));
  cfg.block_x = static_cast<unsigned>((c.num_math_wg + 1) * 128);
  cfg.smem_bytes = static_cast<unsigned>(c.smem_bytes);
  cfg.stream = a.stream;
  cfg.device = a.device;
  launch_with(*kernel, cfg, a, map_a, map_w, map_d);
}

}  // namespace moe_launchers::sm90_fp8_fp4_gemm
