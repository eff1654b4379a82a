#pragma once
// Integer helpers usable both in constant expressions and in device code.

namespace moe_kernels {

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

template <typename T>
__host__ __device__ constexpr T constexpr_min(T a, T b) {
  return a < b ? a : b;
}

template <typename T>
__host__ __device__ constexpr T constexpr_gcd(T a, T b) {
  return b == 0 ? a : constexpr_gcd(b, a % b);
}

template <typename T>
__host__ __device__ constexpr bool is_power_of_two(T x) {
  return x > 0 && (x & (x - 1)) == 0;
}

}  // namespace moe_kernels
