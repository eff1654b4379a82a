#pragma once
// The FP8 GEMM's thread and stage layout, shared by the kernel (impls/sm90_fp8_gemm.cuh) and its
// host launcher (launchers/sm90_fp8_gemm.hpp), so the launch and the kernel cannot disagree: no
// includes and nothing CUDA-only, for NVRTC and the host compiler alike.

namespace moe_kernels {

// Block M 64 runs one math warpgroup; 128 two; 256 the same two, in two waves of 128 rows.
constexpr unsigned fp8_gemm_math_warpgroups(unsigned block_m) { return block_m == 64 ? 1u : 2u; }

// The math warpgroups and one producer warpgroup.
constexpr unsigned fp8_gemm_threads(unsigned block_m) { return (fp8_gemm_math_warpgroups(block_m) + 1) * 128; }

// 128-row tiles in chunks of 2 or 4 split a chunk's rows over two warps of 64 rows (one warp's 4 rows
// x chunk spilled in the producers' 40 registers); the pair then takes every chunk, so no turns.
constexpr unsigned scale_gather_row_warps(unsigned block_m, unsigned chunk) {
  return block_m == 128 && chunk > 1 ? 2u : 1u;
}
// The scale warps that take turns: each owns a chunk of `chunk` K blocks in turn (the copies, chunk 0,
// one), and must never run two phases ahead of the consumers' releases (an empty barrier's parity
// cannot tell them apart). That holds while the K blocks one warp owns lie at most num_stages apart:
// releases come in order, so waiting for the stage of its previous K block covers the one before this
// K block's stage use. A pair splitting the rows is the only one.
constexpr unsigned scale_gather_warps(unsigned warps, unsigned chunk, unsigned num_stages, unsigned block_m) {
  const unsigned k_blocks = chunk > 0 ? chunk : 1;
  if (scale_gather_row_warps(block_m, chunk) > 1) return scale_gather_row_warps(block_m, chunk);
  return (warps - 1) * k_blocks + 1 <= num_stages ? warps : (num_stages - 1) / k_blocks + 1;
}

// How a stage's scales arrive.
//   kScaleGather: scale warps gather them, any strides (common/scale_gather.cuh). With 4-byte
//     cp.async copies (kGatherChunk 0, most plans) a K-major A scale costs a 32-byte sector and a
//     shared-memory wavefront per row and K block: at 256-row tiles 256 wavefronts per K block beside
//     the wgmmas' 768 operand reads (ncu, 4096 x 4096 x 7168: 81% of the shared-memory pipe against
//     DeepGEMM's 68%, and 9% less tensor-pipe use). Loads into registers store 32 rows per wavefront.
//   kScaleTmaMnMajor / kScaleTmaKMajor: the TMA warp loads them with the tiles. A scales MN-major
//     (a K block's rows contiguous): one box of block_m floats; K-major: a box of 4 K blocks by
//     block_m rows (16 bytes, TMA's narrowest, starting on a multiple of 4 K blocks: the unit
//     faults on innermost coordinates off 16 bytes), of which the stage uses the K block's
//     column. B scales (K-major): a box of 4 K blocks by the tile's two 128-column blocks, alike.
//     The launcher picks these for dense and contiguous GEMMs (launchers/sm90_fp8_gemm.hpp).
//   kScaleTmaKMajorTable: K-major A scales of a dense tile of one wave (block M 64 or 128) come in
//     one TMA box per tile, every K block of its rows, into a table beside the stages (a second
//     slot, where a CTA runs a second tile, fills while the first is read): each scale crosses L2
//     once instead of once per K block (gathers) or four times (kScaleTmaKMajor's 16-byte rows). A
//     stage carries B's box only. The launcher takes it on one-wave 64 x 32 tiles, the only tiles
//     timed faster with it than with the gathers (MOE_FP8_SCALE_TABLE=1: wherever it fits).
enum : unsigned {
  kScaleGather = 0, kScaleTmaMnMajor = 1, kScaleTmaKMajor = 2, kScaleTmaKMajorTable = 3
};

// Floats per row of a tile's scale table: the K blocks rounded up to 16 bytes (TMA's box rows) and
// to an odd count of 16 bytes, so the 8 rows a warp reads per K block (wgmma's row layout) fall on
// 8 different banks. The box's columns past K read as zeros.
constexpr unsigned fp8_gemm_table_cols(unsigned k_blocks) {
  return ((k_blocks + 3) / 4 % 2 == 1) ? (k_blocks + 3) / 4 * 4 : (k_blocks + 3) / 4 * 4 + 4;
}

// The table's slots: 1 where no CTA runs a second tile, else 2 (the next tile's fills while this
// one's is read); the bytes of one slot and of all `slots`, and their full and empty barriers,
// after the stages' barriers. Other scale loads have none.
constexpr unsigned fp8_gemm_sfa_slot_bytes(unsigned block_m, unsigned k_blocks, unsigned scale_load) {
  return scale_load == kScaleTmaKMajorTable ? block_m * fp8_gemm_table_cols(k_blocks) * 4 : 0u;
}
constexpr unsigned fp8_gemm_sfa_slots_bytes(unsigned block_m, unsigned k_blocks, unsigned scale_load, unsigned slots) {
  return slots * fp8_gemm_sfa_slot_bytes(block_m, k_blocks, scale_load);
}
constexpr unsigned fp8_gemm_sfa_slot_barrier_bytes(unsigned slots) { return slots * 16; }

// Floats between consecutive rows' A scales in a stage.
constexpr unsigned fp8_gemm_sfa_row_floats(unsigned scale_load) { return scale_load == kScaleTmaKMajor ? 4u : 1u; }

// The stage's B scales: the first 128-column block's at fp8_gemm_sfb_offset, the second's
// fp8_gemm_sfb_step floats after it.
constexpr unsigned fp8_gemm_sfb_offset(unsigned block_m, unsigned scale_load) {
  return scale_load == kScaleTmaKMajorTable ? 0u : block_m * fp8_gemm_sfa_row_floats(scale_load);
}
constexpr unsigned fp8_gemm_sfb_step(unsigned scale_load) { return scale_load == kScaleGather ? 1u : 4u; }

// Floats of a stage's scales: gathered, block_m + 2 (up to 4) padded to 16 bytes; by TMA, whose boxes
// land on 128-byte boundaries, the A box then a 128-byte slot for B's 2 (up to 8) x 4.
constexpr unsigned fp8_gemm_sf_floats(unsigned block_m, unsigned scale_load) {
  return scale_load == kScaleGather ? block_m + 4 : fp8_gemm_sfb_offset(block_m, scale_load) + 32;
}

// B scales a stage holds per K block: the tile's two 128-column blocks, or (the SwiGLU epilogue,
// which stores no D) the gate and up halves of each of its 128-row blocks.
constexpr unsigned fp8_gemm_sfb_rows(unsigned block_n, bool stores_d) { return stores_d ? 2u : block_n / 64; }

// Rows of A's scale box where A's box holds `rows` of a block_m-row tile (tight boxes end at row M):
// MN-major boxes run along M, and their inner extent is a multiple of 16 bytes (4 floats).
constexpr unsigned fp8_gemm_sfa_box_rows(unsigned rows, unsigned block_m, unsigned scale_load) {
  return scale_load == kScaleTmaMnMajor ? ((rows + 3) / 4 * 4 < block_m ? (rows + 3) / 4 * 4 : block_m) : rows;
}

// Bytes the TMA scale boxes add to a stage's transaction count: A's box, B's of 4 K blocks by
// sfb_rows (fp8_gemm_sfb_rows).
constexpr unsigned fp8_gemm_sf_tma_bytes(unsigned block_m, unsigned scale_load, unsigned sfb_rows = 2) {
  return scale_load == kScaleGather ? 0u : fp8_gemm_sfb_offset(block_m, scale_load) * 4 + sfb_rows * 4 * 4;
}

// One pipeline stage: the A and B tiles of a 128-deep K block, then the scales.
constexpr unsigned fp8_gemm_stage_bytes(unsigned block_m, unsigned block_n, unsigned scale_load = kScaleGather) {
  return (block_m + block_n) * 128 + fp8_gemm_sf_floats(block_m, scale_load) * 4;
}

// The SwiGLU epilogue's outputs (kSwiGlu, common/swiglu_epilogue.cuh), a kernel argument by value:
// act E4M3 [rows, ld_act] row-major, the scale of (row, 128-column group) at sf[row * sf_stride_m +
// group * sf_stride_k], one fp32 weight per row of A. Zeros for kernels without the epilogue.
struct SwiGluOut {
  const float* weights;
  unsigned char* act;
  float* sf;
  unsigned ld_act;
  unsigned sf_stride_m, sf_stride_k;
};

// The kernel's shared memory: D's tile, the stages, their scales, the table's slots and the barriers.
// kNumKBlocks and kTableSlots size kScaleTmaKMajorTable's slots; other scale loads leave them 0.
// kStoresD: false for the SwiGLU epilogue, which stores from registers (no D tile).
template <unsigned kBlockM, unsigned kBlockN, unsigned kNumStages, unsigned kScaleLoad, unsigned kNumKBlocks = 0,
          unsigned kTableSlots = 0, bool kStoresD = true>
struct Fp8GemmSmem {
  static constexpr unsigned kBlockK = 128;
  static constexpr unsigned kD = kStoresD ? kBlockM * kBlockN * 2 : 0;
  static constexpr unsigned kA = kBlockM * kBlockK;
  static constexpr unsigned kB = kBlockN * kBlockK;
  // A scales (kSfaRow floats apart), then kSfbRows B scales (kSfbStep apart from kSfb): a tile's two
  // 128-column blocks, or (the SwiGLU epilogue, no D) the gate and up halves of each of its blocks.
  static constexpr unsigned kSfFloats = fp8_gemm_sf_floats(kBlockM, kScaleLoad);
  static constexpr unsigned kSfaRow = fp8_gemm_sfa_row_floats(kScaleLoad);
  static constexpr unsigned kSfb = fp8_gemm_sfb_offset(kBlockM, kScaleLoad);
  static constexpr unsigned kSfbStep = fp8_gemm_sfb_step(kScaleLoad);
  static constexpr unsigned kSfbRows = fp8_gemm_sfb_rows(kBlockN, kStoresD);
  static_assert(kSfbRows <= 4, "a stage holds up to 4 B scales a K block");
  static constexpr unsigned kTmaBytes = kA + kB + fp8_gemm_sf_tma_bytes(kBlockM, kScaleLoad, kSfbRows);
  static constexpr unsigned kOffsetA = kD;
  static constexpr unsigned kOffsetB = kOffsetA + kNumStages * kA;
  static constexpr unsigned kOffsetSf = kOffsetB + kNumStages * kB;
  // kScaleTmaKMajorTable: the table's kTableSlots slots, [kBlockM rows][kSfaCols] each, after the
  // stages (at least one slot's worth of barriers is named, none is used elsewhere).
  static_assert((kScaleLoad == kScaleTmaKMajorTable) == (kTableSlots == 1 || kTableSlots == 2) &&
                    kTableSlots <= 2,
                "the table has 1 or 2 slots, other scale loads none");
  static constexpr unsigned kSfaSlots = kTableSlots;
  static constexpr unsigned kSfaRing = kSfaSlots > 0 ? kSfaSlots : 1;
  static constexpr unsigned kSfaCols = kSfaSlots > 0 ? fp8_gemm_table_cols(kNumKBlocks) : 0;
  static constexpr unsigned kSfaSlot = fp8_gemm_sfa_slot_bytes(kBlockM, kNumKBlocks, kScaleLoad);
  static constexpr unsigned kOffsetSfaSlots = kOffsetSf + kNumStages * kSfFloats * 4;
  static constexpr unsigned kOffsetBarriers =
      kOffsetSfaSlots + fp8_gemm_sfa_slots_bytes(kBlockM, kNumKBlocks, kScaleLoad, kTableSlots);
  static constexpr unsigned kTotal =
      kOffsetBarriers + 2 * kNumStages * 8 + fp8_gemm_sfa_slot_barrier_bytes(kTableSlots);
  static_assert(kA + kB + kSfFloats * 4 == fp8_gemm_stage_bytes(kBlockM, kBlockN, kScaleLoad),
                "the launcher sizes stages alike");
  // 128-byte swizzled TMA tiles need 1024-byte aligned stage buffers, TMA scale boxes 128-byte ones.
  static_assert(kD % 1024 == 0 && kA % 1024 == 0 && kB % 1024 == 0, "stage buffers must stay 1024-byte aligned");
  static_assert(kScaleLoad == kScaleGather || (kSfFloats % 32 == 0 && kSfb % 32 == 0),
                "TMA scale boxes must land on 128-byte boundaries");
  static_assert(kSfaSlots == 0 || (kOffsetSfaSlots % 128 == 0 && kSfaSlot % 128 == 0),
                "the A scales' slots must land on 128-byte boundaries");
};

}  // namespace moe_kernels
