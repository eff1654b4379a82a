#pragma once
// The FP8 GEMM heuristic's measured rules (launchers/sm90_fp8_gemm_heuristic.hpp's plan_config applies them):
// each constant with the measurements it rests on (bench/RESULTS.md).

namespace moe_launchers::sm90_fp8_gemm {

// Two CTAs on adjacent n-blocks share A by TMA multicast: a CTA then reads (block_m / 2 + block_n)
// x 128 bytes per K block from L2 instead of (block_m + block_n) x 128. That pays where L2 traffic
// bounds the kernel: large GEMMs (128 x 160 tiles: 22% less). Grouped GEMMs of few rows per group
// are bound by B, which multicast of A leaves alone: they get clusters from kMulticastMinRows rows
// per group.
constexpr int kMulticastMinRows = 512;
// Dense GEMMs of at most 64 rows (one m-block), whose narrow n-blocks each re-read the whole of A,
// ran faster without clusters except on long K. Single CTAs took 0.94-0.99x the clusters' time at
// N x K = 576, 2112 and 4096 x 7168, 7168 x 2048 and 24576 x 1536, 0.97-1.00x at 32768 x 512, and
// 1.00-1.01x at 7168 x 16384 (bench/RESULTS.md, session 9, "Clusters at small M"). Clusters stay
// from this K.
constexpr int kMulticastMinKSmallM = 8192;
// At 65-128 rows, single CTAs took 0.89-1.00x the clusters' time in all seven cells on K-major A
// scales (gathered), four timings each. On MN-major ones (loaded by TMA) they took 0.93-0.99x at
// N x K = 2112 x 7168, 4096 x 7168, 24576 x 1536 and 32768 x 512, but 1.04x at 7168 x 2048 and
// 7168 x 16384 (bench/RESULTS.md, session 18). Clusters stay only for TMA-loaded scales from this
// N and K.
constexpr int kMulticastMinNMidM = 7168;
constexpr int kMulticastMinKMidM = 2048;
// Past 128 rows, clusters measured 0.90-0.99x of single CTAs at N = 4096 (dense 4096 x 4096 x 7168,
// grouped 4 x 8192 and 8 x 4096 at N x K = 4096 x 7168) and 1.01-1.15x at N = 7168
// (bench/RESULTS.md, 2026-11-30): they stay for wider B only.
constexpr int kMulticastMinNLargeM = 4097;

// Wide 128-row tiles: the math warpgroups take turns on the tensor cores only where a K block's
// wgmmas (block N 160 and up) are long enough to cover the other warpgroup's promotion: at 128 x 128
// the strict turns measured 0.86x (4096 x 4096 x 7168) and at block N 144 0.97x in two runs, at
// block N 192 0.96-1.14x against the plain loop (bench/RESULTS.md, session 6).
constexpr int kPingPongMinBlockN = 145;
// Dense and contiguous tiles of this block N (128 x 192, the only width measured) run without
// turns instead, their K loop unrolled 8 times (get_config, session 17); masked ones too where K / 128
// is a multiple of 8 (session 33).
constexpr int kInStepBlockN = 192;
// Masked 128 x 192 tiles pair their m-blocks inside a group and share B from this many rows per group
// (expected_m): 0.84-0.89x the time of single CTAs at 256 experts x 512 and 1024 tokens, N x K =
// 4096 x 7168, 0.96-1.00x in the other cells from 512 tokens, in two runs; at 256 tokens 1.00-1.01x
// (H100, bench/RESULTS.md, session 34).
constexpr int kMaskedShareBMinRows = 512;

// Dense GEMMs of 65 to 128 rows run one 128-row m-block instead of two 64-row ones where that takes
// fewer waves (wide N: 128 x 192 at N = 24576, 128 x 128 at 32768 x 512): 0.90x and 0.95x the time
// on an H200 (bench/RESULTS.md, session 9). At equal waves the 128-row tiles are half as wide, so
// every SM reads twice the rows of A per byte of B: 1.02-1.18x at N x K = 2112 x 7168, 4096 x 7168
// and 576 x 7168 (0.96-0.98x at 7168 x 2048 and 7168 x 16384: kept at 64 rows, within noise).
//
// A dense problem whose whole tiles leave more than a quarter of the SMs idle (N = 576 at up to 128
// rows: 72 tiles on 132 SMs) splits every tile over K into kSingleWaveSplit units where each unit keeps
// at least kSingleWaveMinKBlocks K blocks: 0.72x and 0.77x the time at M = 64 and 128, N x K = 576
// x 7168; forced on shapes whose tiles fill the SMs it measured 0.99-1.17x (session 9).
constexpr int kSingleWaveSplit = 4;
constexpr int kSingleWaveMinKBlocks = 8;

// Dense GEMMs of at least kWideTileMinRows rows (the fewest measured) may run 256 x 128 tiles (two waves of 128 rows on
// the two math warpgroups, 2-CTA clusters): per FLOP they fill half the B tiles of 128-row tiles
// and read less from L2. Measured on an H200 at M = 4096 (bench/RESULTS.md, session 8), 256 x 128
// against the 128-row heuristic's tile: 0.90x the time at N x K = 4096 x 7168, 0.91x at 7168 x
// 2048, 0.97x at 7168 x 16384, 0.95x at 32768 x 512; at narrow or odd block N (256 x 88, x 120,
// x 72) 1.09-1.25x; at M = 2048 and 8192 0.95-0.97x at N >= 4096 but 1.04x at 7168 x 2048. The
// wave count weighs them: a 256 x 128 tile costing 2 x 14/16 of a 128-row one's (strictly less to
// win) reproduces every one of those choices. Block N is 128 only: wider runs out of registers, and
// narrower ones spilled the scale warps (40 registers for 8 row offsets).
constexpr int kWideTileMinRows = 2048;
constexpr int kWideTileCost = 14;  // sixteenths
// From kWideOneWaveMinRows to kWideTileMinRows, 256 x 128 tiles where they run in one wave and the
// 128-row plan takes more (H100, bench/RESULTS.md, session 47): 0.82x the time of 128 x 112 clusters
// at 512 x 7168 x 16384, 0.94x of lone 128 x 128 at 1024 x 4096 x 7168 (DeepGEMM's own 256 x 128
// there), 0.99x at 512 x 7168 x 2048. Where they only cut the waves (3 to 2, 4 to 3, 11 to 8 at
// 512-1024 rows x {7168 x 2048, 24576 x 1536, 32768 x 512}) they took 1.03-1.06x, and 0.83x once (512
// x 32768 x 512): not taken. N = 2112 (a partial n-block of 256 x 128 tiles) was not timed: kept.
constexpr int kWideOneWaveMinRows = 512;

// K-major A scales come by TMA (4 K blocks x block_m rows of 16 bytes per stage) on 256-row tiles
// with K >= kScaleTmaKMajorMinK only. Against the gathers, in two runs each (bench/RESULTS.md,
// session 12), at M = 4096: 256 x 128 tiles 0.93-0.96x the time at N x K = 4096 x 7168 and 7168 x
// 16384, 0.99x at 24576 x 1536 and 7168 x 2048, but 1.04-1.05x at 32768 x 512 (4 K blocks a tile: the
// gathers' L1 keeps a row's 4 scales, TMA fetches them 4 times); 128-row tiles 0.99-1.00x; at M = 64
// (64-row tiles) 1.01-1.39x, 2.08x at 32768 x 512. MN-major A scales (one contiguous box of block_m
// floats) measured 1.00-1.05x the K-major gathers at M = 64 and stay on TMA at every tile.
constexpr int kScaleTmaKMajorMinBlockM = 256;
constexpr int kScaleTmaKMajorMinK = 1024;

// The table (common/fp8_gemm_layout.h's kScaleTmaKMajorTable): K-major A scales of a dense 64- or
// 128-row tile, every K block, as one TMA box per tile beside the stages, instead of the gathers
// above (the scale warps' 4-byte copies, one per row and K block). MOE_FP8_SCALE_TABLE=1 takes it on
// every such tile that keeps kScaleTableMinStages stages beside it, =0 on none. Unset, only on
// 64 x kScaleTableBlockN tiles that run in one wave with at most kScaleTableMaxKBlocks K blocks, at
// kScaleTableMinRows rows or more, and only where the table keeps the gathers' tiles. Timed
// interleaved against the gathers on DeepGEMM's dense cells (bench/RESULTS.md, session 31, H100;
// 128 rows in two runs, 64 in one): 64 x 32 tiles in one wave took 0.87-0.92x the time at 128 x
// 2112 x 7168 and 0.98x at 64 x 4096 x 7168; every other tile 0.99-1.15x (64 x 16, 64 x 24 and 64 x
// 40 at 2112 or 576 columns 1.01-1.14x; 64 x 64 at 128 x 4096 x 7168 1.02-1.11x; 64 x 112 at 128 x
// 7168 x 16384 1.13-1.14x, its table 32 KB). With the table on by default on those tiles, two more
// runs against =0 (session 31, H100): 0.88x at 128 x 2112 x 7168, 0.83-0.91x at 16 and 64 x 4096 x
// 2048, 0.95-1.01x at 1-64 x 4096 (or 4224) x 7168, but 1.07-1.13x at 1 x 4096 x 2048 (likely: a
// single row's gathers are one copy per K block, while the first of only 16 K blocks waits for the
// table's box). Rows 2-15 were not timed; they gather. At 128 x 2112 x 7168 the gathers' kernel took
// 15.3 us under ncu, MN-major scales by TMA 12.3 with the same tiles (session 30): a narrow tile's
// stages fill later when its A scales are 64 copies of 4 bytes.
constexpr int kScaleTableBlockN = 32;
constexpr int kScaleTableMaxKBlocks = 64;
constexpr int kScaleTableMinRows = 16;
constexpr int kScaleTableMinStages = 4;

// Masked decode tiles (block M 64, up to 128 rows per group) of short K (at most
// kMaskedShortKBlocks K blocks) take block N up to 128 only: their few K blocks per tile leave the
// wave count that the score weighs mattering less than the deeper pipeline of narrower tiles. At
// N x K = 7168 x 2048, 64 x 128 took 0.97-0.98x the time of the score's choice (64 x 160 at 32
// experts, 64 x 192 at 256) at 4 and 16 / 1 and 8 tokens, and 0.96-0.99x that of 64 x 160 at
// 4-64 tokens (bench/RESULTS.md, 2026-12-01). At 4096 x 7168 and 256 experts 64 x 128 took
// 1.01x and 1.09x the time of the score's 64 x 192, so long K keeps the score.
constexpr int kMaskedDecodeMaxBlockN = 128;
constexpr int kMaskedShortKBlocks = 16;

}  // namespace moe_launchers::sm90_fp8_gemm
