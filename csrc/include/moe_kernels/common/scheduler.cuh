#pragma once
// Persistent tile scheduler: CTA b takes tiles b, b + grid, b + 2 grid, ... Inside a problem (or a
// group) tiles are ordered in bands of kGroupN n-blocks with the m-block varying slowest inside a
// band, so the tiles that run at the same time share a few m-blocks of A and a few n-blocks of B
// in L2. Every role of a CTA walks the same sequence, each with its own scheduler copy.
//
// kNumMulticast > 1 (clusters of that many CTAs along x sharing A through TMA multicast): the
// scheduler walks tiles of kNumMulticast adjacent n-blocks, one per cluster, and each CTA takes
// the n-block of its rank, so the CTAs of a cluster always hold the same m-block (and group) and
// run the same number of K blocks. A CTA's n-block may lie past N (N not a multiple of the
// cluster's width): it still loads and computes, in step with its peer, and stores nothing.
//
// kShareB (2-CTA clusters sharing B instead, DeepGEMM's form of its 128 x 192 tiles): the
// scheduler walks pairs of adjacent m-blocks, and each CTA takes the m-block of its rank, so the
// CTAs of a cluster hold the same n-block. A pair whose blocks both lie in one group (or one of them
// is padding or past M) shares B: each CTA loads half of its rows and multicasts it (Tile::share_b);
// a pair straddling two groups loads two whole B tiles, one per CTA. A block past M or of padding
// beside a valid one runs in step and stores nothing (Tile::valid); a pair of two is skipped.
// Masked layouts pair the m-blocks of each group (a group's last pair may have one valid block), so
// every pair shares B.
//
// Tail split (kNormal, set_tail_split): when the tiles leave a last, partial wave of `tail` tiles
// (per cluster), each of them is split over K into `splits` units, tail * splits <= the clusters,
// so the last wave takes about 1/splits of a wave instead of a whole one. Unit u of the tail is
// tile full + u % tail, split s = u / tail, the splits' K ranges consecutive. The kernel
// adds a tile's partial sums (common/split_reduce.cuh); tiles before the tail run whole.
//
// GEMM types:
//   kNormal:          one problem, M rows.
//   kGroupedContiguous: rows sorted by group, each block_m-aligned block in one group; the group
//                     of a block is grouped_layout[first row] (m_indices), -1 marks padding
//                     blocks, which are skipped.
//   kGroupedMasked:   num_groups problems of max_m rows each, of which grouped_layout[g]
//                     (masked_m) are valid.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

enum class GemmType : int { kNormal = 0, kGroupedContiguous = 1, kGroupedMasked = 2 };

struct Tile {
  uint32_t m_block;  // within the group for kGroupedMasked, global otherwise
  uint32_t n_block;
  uint32_t group;    // 0 for kNormal
  // Tail split: this unit's K blocks [k_begin, k_end), split index and count, and the tail tile's
  // index (of the cluster: the CTA's own adds its rank). num_splits == 1: the whole K, k_end unset.
  uint32_t k_begin = 0, k_end = 0;
  uint32_t split = 0, num_splits = 1;
  uint32_t tail_tile = 0;
  // kShareB: whether this CTA's m-block is stored, and whether the pair multicasts B.
  bool valid = true, share_b = false;
};

template <GemmType kType, uint32_t kBlockM, uint32_t kBlockN, uint32_t kGroupN, uint32_t kNumMulticast = 1,
          bool kShareB = false>
struct TileScheduler {
  static_assert(!kShareB || kNumMulticast == 2, "B is shared by the 2 CTAs of a cluster");
  // Clusters share A along n-blocks, or B along m-blocks (kShareB).
  static constexpr uint32_t kClusterM = kShareB ? kNumMulticast : 1;
  static constexpr uint32_t kClusterN = kShareB ? 1 : kNumMulticast;
  uint32_t num_m_blocks;  // kGroupedMasked: of the current group; kShareB: pairs of m-blocks (both)
  uint32_t num_n_blocks;
  uint32_t total_m_blocks;  // the problem's m-blocks (kShareB: the last pair may have one)
  const int* grouped_layout;
  uint32_t num_groups;
  uint32_t next_tile;
  uint32_t rows_per_group;     // kGroupedMasked: max_m
  uint32_t group = 0;          // kGroupedMasked: the group next_tile is searched from
  uint32_t group_first_tile = 0;
  uint32_t splits = 1, tail = 0, full = 0, quot = 0, rem = 0;  // tail split (kNormal)

  __device__ __forceinline__ TileScheduler(uint32_t m, uint32_t n, const int* layout, uint32_t groups)
      : num_m_blocks((m + kBlockM * kClusterM - 1) / (kBlockM * kClusterM)),
        num_n_blocks((n + kBlockN * kClusterN - 1) / (kBlockN * kClusterN)),
        total_m_blocks((m + kBlockM - 1) / kBlockM),
        grouped_layout(layout),
        num_groups(groups),
        next_tile(blockIdx.x / kNumMulticast),
        rows_per_group(m) {
    if constexpr (kType == GemmType::kGroupedMasked) num_m_blocks = masked_units(0);
  }

  // kNormal: split the last `tail_tiles` tiles (per cluster; fewer than the clusters) `num_splits`
  // ways over the K blocks, split s getting k_quot + (s < k_rem) of them (the launcher's quotient
  // and remainder of the K blocks by num_splits). The launcher chooses tail_tiles * num_splits <=
  // the clusters. A single, partial wave may be all tail (full == 0: next() yields nothing and
  // each cluster runs one unit, the grid being the units). Only subtractions and compares on kernel arguments here: a division would leave
  // the K range, the pipeline's trip count, in vector registers, and ptxas then rebuilds the wgmma
  // descriptors from them in every K block.
  __device__ __forceinline__ void set_tail_split(uint32_t num_splits, uint32_t tail_tiles, uint32_t k_quot,
                                                 uint32_t k_rem) {
    static_assert(kType == GemmType::kNormal, "the tail split is for dense GEMMs");
    // Pairs sharing B run whole (the launcher plans no split for them).
    if (kShareB || num_splits <= 1 || tail_tiles == 0) return;
    splits = num_splits;
    tail = tail_tiles;
    full = num_m_blocks * num_n_blocks - tail_tiles;
    quot = k_quot;
    rem = k_rem;
  }

  // After next() returned false: this CTA's unit of the split tail, if it has one (tile, split and
  // K range in t). Unit u = next_tile - full: tile full + u % tail, split u / tail.
  __device__ __forceinline__ bool tail_unit(Tile& t) {
    if (kType != GemmType::kNormal || kShareB || tail == 0 || next_tile < full) return false;
    uint32_t unit = next_tile - full, split = 0;
    if (unit >= tail * splits) return false;
    for (; unit >= tail; unit -= tail) ++split;
    next_tile += gridDim.x / kNumMulticast;
    raster(full + unit, t.m_block, t.n_block);
    t.n_block = own_n_block(t.n_block);
    t.group = 0;
    t.split = split;
    t.num_splits = splits;
    t.tail_tile = unit;
    t.k_begin = split * quot + min(split, rem);
    t.k_end = t.k_begin + quot + (split < rem ? 1 : 0);
    return true;
  }

  // Counts outside [0, max_m] are clamped, so bad masked_m values cannot address other groups.
  __device__ __forceinline__ uint32_t clamped_rows(uint32_t g) const {
    return static_cast<uint32_t>(
        min(max(__ldg(grouped_layout + g), 0), static_cast<int>(rows_per_group)));
  }

  __device__ __forceinline__ uint32_t masked_blocks(uint32_t g) const {
    if (g >= num_groups) return 0;
    return (clamped_rows(g) + kBlockM - 1) / kBlockM;
  }

  // The m-units the raster walks in group g: its m-blocks, or (kShareB) their pairs.
  __device__ __forceinline__ uint32_t masked_units(uint32_t g) const {
    return kShareB ? (masked_blocks(g) + 1) / 2 : masked_blocks(g);
  }

  // kGroupedMasked: the group of the cluster's tile `tile` and its m-unit and n-block in it; the
  // search only moves forward (a CTA's tiles increase).
  __device__ __forceinline__ bool masked_tile(uint32_t tile, uint32_t& unit, uint32_t& n_block) {
    while (tile >= group_first_tile + num_m_blocks * num_n_blocks) {
      if (group >= num_groups) return false;
      group_first_tile += num_m_blocks * num_n_blocks;
      num_m_blocks = masked_units(++group);
    }
    if (group >= num_groups) return false;
    raster(tile - group_first_tile, unit, n_block);
    return true;
  }

  // kGroupedMasked: the rows of tile t below its group's masked_m.
  __device__ __forceinline__ uint32_t masked_rows(const Tile& t) const {
    return min(clamped_rows(t.group) - t.m_block * kBlockM, kBlockM);
  }

  // Band rasterisation of a tile index inside one problem of num_m_blocks x num_n_blocks.
  __device__ __forceinline__ void raster(uint32_t tile, uint32_t& m_block, uint32_t& n_block) const {
    const uint32_t band_size = kGroupN * num_m_blocks;
    const uint32_t band = tile / band_size;
    const uint32_t first_n = band * kGroupN;
    const uint32_t width = min(kGroupN, num_n_blocks - first_n);
    const uint32_t in_band = tile - band * band_size;
    m_block = in_band / width;
    n_block = first_n + in_band % width;
  }

  __device__ __forceinline__ bool next(Tile& t) {
    if constexpr (kShareB) {
      return next_pair_tile(t);
    } else {
      if (!next_cluster_tile(t)) return false;
      t.n_block = own_n_block(t.n_block);
      return true;
    }
  }

  // This CTA's n-block within its cluster's n-block (a 1-D cluster along x: the rank of a CTA is
  // its x index modulo the cluster size).
  __device__ __forceinline__ static uint32_t own_n_block(uint32_t cluster_n_block) {
    return cluster_n_block * kNumMulticast + blockIdx.x % kNumMulticast;
  }

  // kShareB: the next pair of m-blocks of this CTA's cluster; t takes this CTA's m-block.
  __device__ __forceinline__ bool next_pair_tile(Tile& t) {
    const uint32_t rank = blockIdx.x % kNumMulticast;
    if constexpr (kType == GemmType::kGroupedMasked) {
      const uint32_t tile = next_tile;
      next_tile += gridDim.x / kNumMulticast;
      uint32_t pair;
      if (!masked_tile(tile, pair, t.n_block)) return false;
      t.m_block = pair * kNumMulticast + rank;
      t.group = group;
      t.valid = t.m_block < masked_blocks(group);
      t.share_b = true;
      return true;
    } else {
      while (true) {
        const uint32_t tile = next_tile;
        if (tile >= num_m_blocks * num_n_blocks) return false;
        next_tile += gridDim.x / kNumMulticast;
        uint32_t pair;
        raster(tile, pair, t.n_block);
        t.m_block = pair * kNumMulticast + rank;
        const uint32_t peer_block = pair * kNumMulticast + (rank ^ 1);
        if constexpr (kType == GemmType::kGroupedContiguous) {
          int own = -1, peer = -1;
          const bool own_valid = t.m_block < total_m_blocks && block_group(t.m_block, own);
          const bool peer_valid = peer_block < total_m_blocks && block_group(peer_block, peer);
          if (!own_valid && !peer_valid) continue;  // both padding (or past M): skipped by both CTAs
          t.valid = own_valid;
          t.group = static_cast<uint32_t>(own_valid ? own : peer);
          t.share_b = !own_valid || !peer_valid || own == peer;
        } else {
          t.valid = t.m_block < total_m_blocks;
          t.group = 0;
          t.share_b = true;
        }
        return true;
      }
    }
  }

  // kGroupedContiguous: m-block b's group in g; false for padding (-1) and for ids outside
  // [0, num_groups), which would address memory past B.
  __device__ __forceinline__ bool block_group(uint32_t block, int& g) const {
    g = __ldg(grouped_layout + block * kBlockM);
    return !(g < 0 || g >= static_cast<int>(num_groups));
  }

  // The next tile of this CTA's cluster (n_block in units of kNumMulticast n-blocks).
  __device__ __forceinline__ bool next_cluster_tile(Tile& t) {
    if constexpr (kType == GemmType::kGroupedMasked) {
      const uint32_t tile = next_tile;
      next_tile += gridDim.x / kNumMulticast;  // one step per cluster
      if (!masked_tile(tile, t.m_block, t.n_block)) return false;
      t.group = group;
      return true;
    } else {
      while (true) {
        const uint32_t tile = next_tile;
        // With a split tail, the whole tiles end where it starts (tail_unit takes it from there).
        if (tile >= (kType == GemmType::kNormal && tail != 0 ? full : num_m_blocks * num_n_blocks)) return false;
        next_tile += gridDim.x / kNumMulticast;  // one step per cluster
        raster(tile, t.m_block, t.n_block);
        if constexpr (kType == GemmType::kGroupedContiguous) {
          int g;
          if (!block_group(t.m_block, g)) continue;
          t.group = static_cast<uint32_t>(g);
        } else {
          t.group = 0;
        }
        return true;
      }
    }
  }
};

}  // namespace moe_kernels
