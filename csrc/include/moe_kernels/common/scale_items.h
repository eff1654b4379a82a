#pragma once
// How the quantizers (impls/quant.cuh, impls/swiglu_quant.cuh) number their work items, one per
// (row, 1 x group scale), shared with their host launchers (launchers/quant.hpp,
// launchers/swiglu_quant.hpp) so that the grid covers the items in one step: no includes and
// nothing CUDA-only, for NVRTC and the host compiler alike (device code calls these constexpr
// functions through --expt-relaxed-constexpr).
//
// K-major scales: row-major. MN-major scales (a column's rows adjacent): bands of kScaleBandRows
// rows, group-major inside a band, so consecutive items store a column's adjacent scales (32
// bytes, one or two sectors: a column starts on 16 bytes) and a band's rows are read whole before
// the next band (numbering whole columns row after row instead strided the reads across all rows:
// the SwiGLU step took 1.3x longer). MN-major rounds the rows up to a band: items of rows past
// num_rows are not valid.

namespace moe_kernels {

constexpr unsigned kScaleBandRows = 8;

// Items to cover, including a last band's rows past num_rows.
template <typename Index>
constexpr Index scale_items(Index num_rows, unsigned num_groups, bool mn_major) {
  return (mn_major ? (num_rows + kScaleBandRows - 1) / kScaleBandRows * kScaleBandRows : num_rows) * num_groups;
}

// The scales are written MN-major (and numbered in bands) when a row's scales are not adjacent.
constexpr bool scale_items_mn_major(long long sf_stride_m, unsigned num_groups) {
  return sf_stride_m == 1 && num_groups > 1;
}

// The scales are written, so no two may share an address: strides of at least 1 that fit the
// kernels' 32-bit arguments, one dimension's stride spanning the other's whole extent (K-major
// (groups, 1) and MN-major (1, rows rounded up) both do). Callers bound rows below 2^31 first.
constexpr bool scale_strides_disjoint(long long num_rows, long long num_groups, long long sf_stride_m,
                                      long long sf_stride_k) {
  return sf_stride_m >= 1 && sf_stride_k >= 1 && sf_stride_m <= 0xffffffffll && sf_stride_k <= 0xffffffffll &&
         (num_groups == 1 || num_rows <= 1 || sf_stride_m >= num_groups * sf_stride_k ||
          sf_stride_k >= num_rows * sf_stride_m);
}

struct ScaleItem {
  unsigned row, group;
};

template <typename Index>
constexpr ScaleItem scale_item(Index item, unsigned num_groups, bool mn_major) {
  if (!mn_major) return {static_cast<unsigned>(item / num_groups), static_cast<unsigned>(item % num_groups)};
  const Index band = item / (kScaleBandRows * num_groups), within = item % (kScaleBandRows * num_groups);
  return {static_cast<unsigned>(band * kScaleBandRows + within % kScaleBandRows),
          static_cast<unsigned>(within / kScaleBandRows)};
}

}  // namespace moe_kernels
