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

// The copy's layout: K block kb of row r at kb * mn_major_sf::aligned_rows(m) + r.
inline bool sfa_copy_fits(long long m, int k) {
  return static_cast<std::uint64_t>(mn_major_sf::aligned_rows(m)) * static_cast<std::uint64_t>(k / 128) <=
         kSfaCopyMaxFloats;
}

}  // namespace moe_launchers::sm90_fp8_gemm
