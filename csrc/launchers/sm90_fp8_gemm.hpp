#pragma once
// FP8 GEMM family (impls/sm90_fp8_gemm.cuh), dense and m-grouped (contiguous, masked): code
// generation, TMA descriptors and launch of the plans of sm90_fp8_gemm_heuristic.hpp.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "jit/compiler.hpp"
#include "jit/device_runtime.hpp"
#include "jit/driver.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"
#include "launchers/gemm_common.hpp"
#include "launchers/mn_major_sf.hpp"
#include "launchers/sm90_fp8_gemm_heuristic.hpp"
#include "launchers/sm90_fp8_gemm_rules.hpp"
#include "launchers/sm90_fp8_gemm_workspace.hpp"
#include "moe_kernels/common/fp8_gemm_layout.h"

namespace moe_launchers::sm90_fp8_gemm {

using namespace moe_launchers::sm90_gemm;

// The SwiGLU epilogue's outputs (act != 0; Args::d unused): act E4M3 [rows, ld_act], its 1 x 128
// scales at act_sf with the strides, the rows' fp32 weights. B's scales then have two rows per
// 128-row block of B (gate half, up half), sfb_stride_n apart.
struct SwiGluArgs {
  std::uint64_t weights = 0, act = 0, act_sf = 0;
  long long ld_act = 0, sf_stride_m = 0, sf_stride_k = 0;
};

struct Args {
  std::uint64_t a, sfa, b, sfb, d, c;
  long long lda, ldb, ldd, ldc;
  long long sfa_stride_m, sfa_stride_k, sfb_stride_g, sfb_stride_n, sfb_stride_k;
  int m;                       // rows of A (kGroupedMasked: rows per group, max_m)
  int num_groups;              // groups of B (1 for kNormal)
  std::uint64_t grouped_layout;  // m_indices or masked_m (int32, device)
  int device;
  std::uint64_t stream;
  // kNormal's tail split: split_workspace_bytes(num_sms) bytes, float partials then int counters
  // (zero before the first launch, left zero by every launch). 0: no workspace, so no split.
  std::uint64_t split_workspace = 0;
  std::uint64_t split_workspace_bytes = 0;
  SwiGluArgs swiglu = {};
};

// Rows of B's scales per group: one per 128-row block, two under the SwiGLU epilogue.
inline long long sfb_rows_per_group(const Args& a, int n) { return a.swiglu.act != 0 ? n / 64 : (n + 127) / 128; }

// The scales as 2-D views for TMA: A's over its rows (kGroupedMasked: groups x max_m) and K blocks,
// B's over groups x ceil(N / 128) rows and K blocks. Row stride of a view (elements), or -1 where
// the layout has none that TMA takes (16-byte multiples, rows not overlapping); a dimension of one
// takes any stride.
inline long long tma_row_stride(long long rows, long long stride, long long row_floats) {
  if (rows == 1) return (row_floats + 3) / 4 * 4;
  return stride % 4 == 0 && stride >= row_floats ? stride : -1;
}

inline std::uint64_t sfa_rows(GemmType type, const Args& a) {
  return type == GemmType::kGroupedMasked ? static_cast<std::uint64_t>(a.m) * a.num_groups : a.m;
}

// B's scales: rows of the [groups x sfb_rows_per_group, K blocks] view, their stride, or -1.
inline long long sfb_view_stride(const Args& a, int n, int k) {
  const long long kb = k / 128, nb = sfb_rows_per_group(a, n);
  if (a.sfb % 16 != 0 || kb % 4 != 0 || a.sfb_stride_k != 1) return -1;
  // One group's rows and the next group's must continue one another.
  if (a.num_groups > 1 && nb > 1 && a.sfb_stride_g != nb * a.sfb_stride_n) return -1;
  return tma_row_stride(nb * a.num_groups, nb > 1 ? a.sfb_stride_n : a.sfb_stride_g, kb);
}

// Masked GEMMs gather their scales whatever the layout: their 64- and 128-row decode tiles are
// bound by the weights, and at 64-row dense tiles MN-major TMA measured 1.00-1.05x the gathers'
// time (session 12).
inline bool takes_scale_tma(GemmType type) { return type != GemmType::kGroupedMasked; }

// The scale load a launch's layouts allow: TMA where both views exist (A MN-major preferred: a
// K block's box is block_m floats, against 4 x block_m K-major), else the scale warps' gathers,
// which take any strides. MOE_FP8_SCALE_TMA=0 keeps the gathers, for A/B timing: plan_config
// applies it (so the launch path reads no environment outside the plan memo), scale_load_for too.
inline unsigned scale_layout_for(GemmType type, const Args& a, int n, int k) {
  using namespace moe_kernels;
  if (!takes_scale_tma(type) || a.sfa % 16 != 0 || sfb_view_stride(a, n, k) < 0) return kScaleGather;
  const long long rows = static_cast<long long>(sfa_rows(type, a)), kb = k / 128;
  const bool mn_major = (rows == 1 || a.sfa_stride_m == 1) && tma_row_stride(kb, a.sfa_stride_k, rows) >= 0;
  if (mn_major) return kScaleTmaMnMajor;
  const bool k_major = kb % 4 == 0 && a.sfa_stride_k == 1 && tma_row_stride(rows, a.sfa_stride_m, kb) >= 0;
  return k_major ? kScaleTmaKMajor : kScaleGather;
}

inline unsigned scale_load_for(GemmType type, const Args& a, int n, int k) {
  return env_enabled("MOE_FP8_SCALE_TMA") ? scale_layout_for(type, a, n, k) : moe_kernels::kScaleGather;
}


inline GeneratedKernel generate(const Config& c) {
  std::ostringstream os;
  // Taking the address instantiates the kernel; an explicit instantiation directive would have
  // to repeat the __grid_constant__ parameter list.
  os << "#include <moe_kernels/impls/sm90_fp8_gemm.cuh>\n"
     << "static __device__ void* moe_instantiate() {\n"
     << "  return reinterpret_cast<void*>(&moe_kernels::sm90_fp8_gemm_nt<" << static_cast<int>(c.type) << ", "
     << c.m_compiled << ", " << c.n << ", "
     << c.k << ", " << c.block_m << ", " << c.block_n << ", " << c.num_stages << ", " << c.group_n << ", "
     << static_cast<int>(c.residual) << ", " << c.swizzle_d << ", " << c.multicast << ", " << c.scale_warps
     << ", " << (c.pingpong ? "true" : "false") << ", " << (c.pdl ? "true" : "false") << ", " << c.k_unroll
     << ", " << c.scale_load << ", " << (c.overlap ? "true" : "false") << ", " << (c.share_b ? "true" : "false")
     << ", " << (c.wg_store ? "true" : "false");
  // The trailing template arguments (the table's slots, SwiGLU, tight boxes, the gather chunk), each
  // written only where it or one after it differs from its default: other kernels' code stays as it was.
  const bool tail3 = c.gather_chunk != 0, tail2 = tail3 || c.tight_boxes != 0, tail1 = tail2 || c.swiglu;
  if (c.table_slots > 0 || tail1) os << ", " << c.table_slots;
  if (tail1) os << ", " << (c.swiglu ? "true" : "false");
  if (tail2) os << ", " << (c.tight_boxes != 0 ? "true" : "false");
  if (tail3) os << ", " << c.gather_chunk;
  const std::string table =
      c.table_slots > 0 ? ", " + std::to_string(c.k / kBlockK) + ", " + std::to_string(c.table_slots)
      : c.swiglu       ? ", 0, 0, false"
                       : "";
  os << ">);\n"
     << "}\n"
     // The launch's dynamic shared memory is what the kernel lays out (stages, table, barriers).
     << "static_assert(moe_kernels::Fp8GemmSmem<" << c.block_m << ", " << c.block_n << ", " << c.num_stages << ", "
     << c.scale_load << table << ">::kTotal == " << c.smem_bytes
     << ", \"the launcher's shared memory differs from the kernel's layout\");\n";
  return {"sm90_fp8_gemm_nt", os.str()};
}

// The compiled kernel of a plan on a device: from the memo, compiled (or loaded from the disk cache)
// on the first call.
inline std::shared_ptr<const moe_jit::CompiledKernel> kernel_of(const Config& c, int device) {
  static moe_jit::KernelMemo<std::array<int, 24>, moe_jit::IntArrayHash> memo;
  const std::array<int, 24> key = {static_cast<int>(c.type), c.m_compiled, c.n, c.k, c.block_m, c.block_n,
                                   c.num_stages, c.group_n, static_cast<int>(c.residual), c.swizzle_d, c.multicast,
                                   c.scale_warps, c.pingpong, c.pdl, c.k_unroll, static_cast<int>(c.scale_load),
                                   c.overlap, c.share_b, c.wg_store, c.table_slots, c.swiglu, c.tight_boxes,
                                   c.gather_chunk, device};
  return sm90_kernel(memo, key, c.fn, device, [&] { return generate(c); });
}

// `kernel`: kernel_of(c, a.device) where the caller holds it already (else looked up here).
inline void launch(const Config& c, const Args& a, std::shared_ptr<const moe_jit::CompiledKernel> kernel = nullptr) {
  using namespace moe_jit::driver;
  if (!kernel) kernel = kernel_of(c, a.device);

  const bool masked = c.type == GemmType::kGroupedMasked;
  const std::uint64_t rows_a = sfa_rows(c.type, a);
  // Each CTA of a cluster loads (and multicasts) its share of the A tile's rows, or of the B tile's
  // where the cluster shares B.
  const int a_share = c.share_b ? 1 : c.multicast, b_share = c.share_b ? c.multicast : 1;
  // tight_boxes (kTightBoxes): tail maps for the last m-block beside the whole main maps. A's holds
  // the rows M leaves it, or in a cluster those M leaves the CTA it cuts (the kernel picks the map
  // per CTA); B's the rows N leaves the last n-block (not in pairs sharing B, whose halves of B stay
  // whole). Where M cuts no m-block A's goes unused.
  MOE_HOST_ASSERT(c.tight_boxes == 0 || (c.type == GemmType::kNormal && !c.swiglu &&
                                         c.scale_load != moe_kernels::kScaleTmaKMajor),
                  c.fn << ": a plan with tight boxes launched for a GEMM that cannot take them");
  // A kernel with M compiled in reads its rows from kShapeM; the maps (the tail's too) from a.m.
  MOE_HOST_ASSERT(c.m_compiled == 0 || c.m_compiled == a.m,
                  c.fn << ": a kernel compiled for " << c.m_compiled << " rows launched for " << a.m);
  const unsigned share_rows = static_cast<unsigned>(c.block_m / a_share);
  const CUtensorMap map_a = make_tma(c.fn, a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k, rows_a, a.lda, kBlockK,
                                     share_rows, CU_TENSOR_MAP_SWIZZLE_128B, "A");
  const unsigned tail_rows = static_cast<unsigned>(a.m % c.block_m != 0 ? a.m % c.block_m : c.block_m);
  const unsigned a_tail_rows = tail_rows % share_rows != 0 ? tail_rows % share_rows : share_rows;
  const CUtensorMap map_a_tail = c.tight_boxes != 0 ? make_tma(c.fn, a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k,
                                                               rows_a, a.lda, kBlockK, a_tail_rows,
                                                               CU_TENSOR_MAP_SWIZZLE_128B, "A")
                                                    : CUtensorMap{};
  const CUtensorMap map_b = make_tma(c.fn, a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k,
                                     static_cast<std::uint64_t>(c.n) * a.num_groups, a.ldb, kBlockK,
                                     c.block_n / b_share, CU_TENSOR_MAP_SWIZZLE_128B, "B");
  const CUtensorMap map_b_tail = c.tight_boxes != 0 && !c.share_b && c.n % c.block_n != 0
                                     ? make_tma(c.fn, a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, c.k,
                                                static_cast<std::uint64_t>(c.n), a.ldb, kBlockK,
                                                static_cast<unsigned>(c.n % c.block_n), CU_TENSOR_MAP_SWIZZLE_128B, "B")
                                     : CUtensorMap{};
  // Per-warpgroup epilogues store 64-row stripes. The SwiGLU epilogue writes no D.
  MOE_HOST_ASSERT((a.swiglu.act != 0) == (c.swiglu != 0),
                  c.fn << ": the plan and the arguments disagree on the SwiGLU epilogue");
  const CUtensorMap map_d = c.swiglu ? CUtensorMap{}
                                     : make_tma_d(c.fn, a.d, c.n, a.m, a.ldd, c.block_n, c.wg_store ? 64 : c.block_m,
                                                  c.swizzle_d, masked, a.num_groups);

  // The scale warps address A's scales with 32-bit element offsets (row x stride_m, k block x
  // stride_k), the kernel's strides being 32-bit already.
  const std::uint64_t last_sfa_row = rows_a - 1, last_k_block = static_cast<std::uint64_t>(c.k / kBlockK - 1);
  MOE_HOST_ASSERT(a.sfa_stride_m >= 0 && a.sfa_stride_k >= 0 &&
                      last_sfa_row * static_cast<std::uint64_t>(a.sfa_stride_m) < (1ull << 32) &&
                      last_k_block * static_cast<std::uint64_t>(a.sfa_stride_k) < (1ull << 32),
                  c.fn << ": the scales of A span more than 2^32 elements (strides " << a.sfa_stride_m << ", "
                       << a.sfa_stride_k << ")");
  // Chunked gathers load gather_chunk K blocks of a row with one vector load (common/scale_gather.cuh).
  MOE_HOST_ASSERT(c.gather_chunk <= 1 || (a.sfa_stride_k == 1 && a.sfa_stride_m % c.gather_chunk == 0 &&
                                          a.sfa % (4 * c.gather_chunk) == 0 && (c.k / kBlockK) % c.gather_chunk == 0),
                  c.fn << ": the kernel was planned for chunked gathers of K-major A scales, which these scales' "
                          "layout does not allow (strides " << a.sfa_stride_m << ", " << a.sfa_stride_k << ")");
  // B's: 32-bit strides (group and row offsets are then taken in 64 bits), a K block's offset in 32 bits.
  MOE_HOST_ASSERT(a.sfb_stride_g >= 0 && a.sfb_stride_n >= 0 && a.sfb_stride_k >= 0 &&
                      static_cast<std::uint64_t>(a.sfb_stride_g) < (1ull << 32) &&
                      static_cast<std::uint64_t>(a.sfb_stride_n) < (1ull << 32) &&
                      last_k_block * static_cast<std::uint64_t>(a.sfb_stride_k) < (1ull << 32),
                  c.fn << ": the scales of B span more than 2^32 elements (strides " << a.sfb_stride_g << ", "
                       << a.sfb_stride_n << ", " << a.sfb_stride_k << ")");
  // The scale boxes of a TMA scale load (the kernel takes the maps either way; the gathers ignore them).
  CUtensorMap map_sfa{}, map_sfb{}, map_sfa_tail{};
  if (c.scale_load != moe_kernels::kScaleGather) {
    const unsigned layout = c.scale_load == moe_kernels::kScaleTmaKMajorTable ? moe_kernels::kScaleTmaKMajor : c.scale_load;
    MOE_HOST_ASSERT(scale_layout_for(c.type, a, c.n, c.k) == layout,
                    c.fn << ": the kernel was planned for TMA scale loads, which these scales' layouts do not allow");
    const std::uint64_t kb = static_cast<std::uint64_t>(c.k / kBlockK);
    const std::uint64_t sfb_rows = static_cast<std::uint64_t>(sfb_rows_per_group(a, c.n)) * a.num_groups;
    if (c.scale_load == moe_kernels::kScaleTmaMnMajor) {
      // A tail box: the rows up to M rounded up to 16 bytes (a box's inner extent).
      const auto sfa_map = [&](unsigned box) {
        return make_tma(c.fn, a.sfa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, rows_a, kb,
                        tma_row_stride(kb, a.sfa_stride_k, rows_a), box, 1, CU_TENSOR_MAP_SWIZZLE_NONE, "SFA");
      };
      map_sfa = sfa_map(static_cast<unsigned>(c.block_m));
      if (c.tight_boxes != 0) {
        map_sfa_tail = sfa_map(moe_kernels::fp8_gemm_sfa_box_rows(tail_rows, c.block_m, c.scale_load));
      }
    } else {
      // K-major: boxes of 4 K blocks, or a table's every K block (its columns past K read as zeros
      // and are never used).
      const unsigned cols = c.scale_load == moe_kernels::kScaleTmaKMajorTable
                                ? moe_kernels::fp8_gemm_table_cols(static_cast<unsigned>(kb))
                                : 4u;
      const auto sfa_map = [&](unsigned box) {
        return make_tma(c.fn, a.sfa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, kb, rows_a,
                        tma_row_stride(rows_a, a.sfa_stride_m, kb), cols, box, CU_TENSOR_MAP_SWIZZLE_NONE, "SFA");
      };
      map_sfa = sfa_map(static_cast<unsigned>(c.block_m));
      if (c.tight_boxes != 0) map_sfa_tail = sfa_map(tail_rows);  // the table's rows of the last m-block
    }
    map_sfb = make_tma(c.fn, a.sfb, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, kb, sfb_rows, sfb_view_stride(a, c.n, c.k), 4,
                       moe_kernels::fp8_gemm_sfb_rows(c.block_n, c.swiglu == 0), CU_TENSOR_MAP_SWIZZLE_NONE, "SFB");
  }

  moe_jit::LaunchConfig cfg;
  const int tiles = masked ? c.num_tiles(a.m) * a.num_groups : c.num_tiles(a.m);
  // No workspace (a call inside a CUDA graph capture): every tile runs whole.
  const TailSplit split = a.split_workspace == 0 ? TailSplit{} : c.tail_split_of(a.m);
  // Whole clusters: the tile count is a multiple of the cluster size already.
  const int grid = split.grid(tiles, c.num_sms, c.multicast);
  const int splits = split.ways;
  const int k_blocks = c.k / kBlockK;
  // The workspace is laid out for the device's own SM count, whatever set_num_sms plans for: its
  // counters stay where the last launch left them zero.
  const int device_sms = moe_jit::device_info(a.device).num_sms;
  MOE_HOST_ASSERT(splits == 1 || a.split_workspace_bytes >= split_workspace_bytes(device_sms),
                  c.fn << ": the tail split needs its workspace (" << split_workspace_bytes(device_sms) << " bytes)");
  const std::uint64_t split_counters =
      a.split_workspace == 0 ? 0 : a.split_workspace + static_cast<std::uint64_t>(device_sms) * kMaxTileFloats * 4;
  cfg.grid_x = static_cast<unsigned>(grid);
  cfg.cluster_dim = static_cast<unsigned>(c.multicast);
  cfg.block_x = moe_kernels::fp8_gemm_threads(static_cast<unsigned>(c.block_m));
  cfg.smem_bytes = static_cast<unsigned>(c.smem_bytes);
  cfg.stream = a.stream;
  cfg.device = a.device;
  cfg.pdl = c.pdl != 0;
  moe_jit::launch(*kernel, cfg, static_cast<std::uint32_t>(a.m), reinterpret_cast<const int*>(a.grouped_layout),
                  static_cast<std::uint32_t>(a.num_groups), reinterpret_cast<const float*>(a.sfa),
                  static_cast<std::uint32_t>(a.sfa_stride_m), static_cast<std::uint32_t>(a.sfa_stride_k),
                  reinterpret_cast<const float*>(a.sfb), static_cast<std::uint32_t>(a.sfb_stride_g),
                  static_cast<std::uint32_t>(a.sfb_stride_n), static_cast<std::uint32_t>(a.sfb_stride_k),
                  reinterpret_cast<const void*>(a.c), static_cast<std::uint32_t>(a.ldc),
                  static_cast<std::uint32_t>(splits), static_cast<std::uint32_t>(split.tail_tiles),
                  static_cast<std::uint32_t>(k_blocks / splits), static_cast<std::uint32_t>(k_blocks % splits),
                  reinterpret_cast<float*>(a.split_workspace),
                  reinterpret_cast<int*>(split_counters), map_a, map_b, map_d, map_sfa, map_sfb,
                  moe_kernels::SwiGluOut{reinterpret_cast<const float*>(a.swiglu.weights),
                                         reinterpret_cast<unsigned char*>(a.swiglu.act),
                                         reinterpret_cast<float*>(a.swiglu.act_sf),
                                         static_cast<unsigned>(a.swiglu.ld_act),
                                         static_cast<unsigned>(a.swiglu.sf_stride_m),
                                         static_cast<unsigned>(a.swiglu.sf_stride_k)},
                  map_a_tail, map_sfa_tail, map_b_tail);
}

// A planned sfa_copy's arguments (the plan checked that the copy fits the workspace's room): A's
// scales read from the workspace's copy, MN-major and TMA-aligned. False (args unchanged) where
// the launch has no workspace of that size.
inline bool sfa_copy_args(const Args& a, Args& copied) {
  const int device_sms = moe_jit::device_info(a.device).num_sms;
  if (a.split_workspace == 0 || a.split_workspace_bytes < split_workspace_bytes(device_sms)) return false;
  copied = a;
  copied.sfa = a.split_workspace + sfa_copy_offset(device_sms);
  copied.sfa_stride_m = 1;
  copied.sfa_stride_k = mn_major_sf::aligned_rows(a.m);
  return true;
}

// The copy of a's A scales into copied's (stream-ordered before the GEMM; with pdl, the GEMM's
// prologue runs beside it and its wait_prerequisites waits for it). `kernel`: mn_major_sf's.
inline void copy_sfa(const Args& a, const Args& copied, int k, bool pdl,
                     std::shared_ptr<const moe_jit::CompiledKernel> kernel) {
  const long long k_blocks = k / kBlockK;
  mn_major_sf::launch({a.sfa, 1, a.m, k_blocks, a.sfa_stride_m, a.sfa_stride_k, 0, copied.sfa, copied.sfa_stride_k,
                       copied.sfa_stride_k * k_blocks, a.device, a.stream, pdl},
                      std::move(kernel));
}

}  // namespace moe_launchers::sm90_fp8_gemm
