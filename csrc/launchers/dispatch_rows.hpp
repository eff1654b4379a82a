#pragma once
// The token rows a dispatch kernel reads (staged exchange and low-latency transport alike): E4M3
// bits with their per-128 scales, or bfloat16 / float16 / float32 rows it quantizes itself
// (common/fp8_row.cuh). One place for their dtype, kernel type name, memo key and layout checks.
#include <cstdint>

#include "jit/exception.hpp"
#include "apis/dtypes.hpp"

namespace moe_launchers::dispatch_rows {

inline bool is_fp8(moe_apis::DType dtype) {
  return dtype == moe_apis::DType::kFloat8E4M3 || dtype == moe_apis::DType::kUInt8;
}

// The kernel's InT for rows of `dtype`; fn names the caller in the error.
inline const char* input_type(const char* fn, moe_apis::DType dtype) {
  using moe_apis::DType;
  MOE_HOST_ASSERT(is_fp8(dtype) || dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32,
                  fn << ": dispatch rows must be E4M3 (with scales), bfloat16, float16 or float32, got "
                     << moe_apis::dtype_name(dtype));
  return is_fp8(dtype) ? "moe_kernels::uint8_t" : moe_apis::dtype_cuda_name(dtype);
}

// E4M3 bits arrive as float8_e4m3fn or uint8: one compiled kernel for both.
inline int memo_key(moe_apis::DType dtype) {
  return static_cast<int>(is_fp8(dtype) ? moe_apis::DType::kFloat8E4M3 : dtype);
}

// x: [T, H] rows, row stride x_row_stride elements, read 16 bytes at a time; xs: E4M3 rows' scales
// (0 for rows the kernel quantizes).
inline void check(const char* fn, std::uint64_t x, moe_apis::DType dtype, long long x_row_stride, int hidden,
                  std::uint64_t xs) {
  const int elem = dtype == moe_apis::DType::kFloat32 ? 4 : is_fp8(dtype) ? 1 : 2;
  MOE_HOST_ASSERT(x % 16 == 0 && x_row_stride >= hidden && (x_row_stride * elem) % 16 == 0,
                  fn << ": x must be 16-byte aligned with rows of at least hidden elements, 16-byte aligned");
  MOE_HOST_ASSERT(is_fp8(dtype) == (xs != 0), fn << ": E4M3 rows take their scales (xs), other rows none");
}

}  // namespace moe_launchers::dispatch_rows
