#pragma once
// The FP8 GEMM family's workspace, one per device and stream (kernels/gemm.py fp8_workspace, none in
// a CUDA graph capture): the dense tail split's partial sums of every CTA (one unit each at most),
// then a counter per CTA tile of the tail, then (from a 256-byte boundary) room for A's scales copied
// MN-major (Config::sfa_copy, dense and contiguous): kSfaCopyMaxFloats floats, 32768 rows at K = 7168
// or 16384 at K = 16384.
#include <cstdint>

#include "launchers/mn_major_sf.hpp"

namespace moe_launchers::sm90_fp8_gemm {

constexpr int kMaxTileFloats = 128 * 256;  // the largest tile: 128 x 192, 256 x 128

constexpr std::uint64_t kSfaCopyMaxFloats = 1ull << 21;

inline std::uint64_t sfa_copy_offset(int num_sms) {
  const std::uint64_t end = static_cast<std::uint64_t>(num_sms) * kMaxTileFloats * 4 + static_cast<std::uint64_t>(num_sms) * 4;
  return (end + 255) / 256 * 256;
}

inline std::uint64_t split_workspace_bytes(int num_sms) { return sfa_copy_offset(num_sms) + kSfaCopyMaxFloats * 4; }

// Which plans copy A scales that are not MN-major (the quantizers' K-major ones, or any strides)
// MN-major into the workspace first, with a small kernel (launchers/mn_major_sf.hpp), and run the
// MN-major plan on the copy (Config::sfa_copy, sfa_copy_args). Never inside a CUDA graph capture (no
// workspace) or past kSfaCopyMaxFloats; only where K is a multiple of 512 (the kernel behind the copy
// loads B's scales by TMA in boxes of 4 K blocks). MOE_FP8_SFA_COPY=0 turns every copy off.
// - Dense 256-row tiles. On an H100 at M = 4096 the MN-major kernel took 0.85x the time of the
//   K-major boxes at N x K = 7168 x 2048, 0.91x at 24576 x 1536, 0.97-0.98x at 7168 x 16384 and
//   4096 x 7168, and 0.97x the gathers' at 32768 x 512 (bench/RESULTS.md, session 26).
// - Contiguous layouts of kSfaCopyMinRowsContiguous rows and N >= kSfaCopyMinNContiguous, whose
//   128-row tiles would gather K-major scales. On an H100 (session 30, 4 x 8192 rows, the runs of
//   every variant interleaved, medians of 20) copy plus MN-major kernel took 1406.1 us against the
//   gathers' 1413.2 at N x K = 4096 x 7168 and 722.3 against 742.1 at 7168 x 2048 (the copy 6.2 and
//   3.2 us of that); the caller's MN-major scales 1378.9 and 717.3. The copy's share of the call
//   grows with M x K, what it saves with M x N x K: hence the bound on N.
// - MOE_FP8_SFA_COPY=all (opt-in): every dense tile and large contiguous layouts of any N. It lost in
//   12 of 14 dense cells of 64-128 rows, where the copy is a kernel of its own the gathers do not
//   pay (H100, session 28). On scales the caller had made MN-major (no copy in the time) the MN-major
//   kernel took 0.83-1.00x the gathers' time in 13 of the 14 dense cells of 64 and 128 rows, 1.03x at
//   64 x 7168 x 16384 (H100, session 26). A GEMM that loaded its first stages' A and B before waiting
//   for the copy lost 1.3-2.4 us in all four interleaved cells above and at 4096 x 7168 x 16384 and
//   4096 x 4096 x 7168 (session 30) and was removed.
constexpr int kSfaCopyMinRowsContiguous = 4096;
constexpr int kSfaCopyMinNContiguous = 4096;

// The copy's layout: K block kb of row r at kb * mn_major_sf::aligned_rows(m) + r.
inline bool sfa_copy_fits(long long m, int k) {
  return static_cast<std::uint64_t>(mn_major_sf::aligned_rows(m)) * static_cast<std::uint64_t>(k / 128) <=
         kSfaCopyMaxFloats;
}

}  // namespace moe_launchers::sm90_fp8_gemm
