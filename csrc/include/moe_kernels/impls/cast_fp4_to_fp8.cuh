#pragma once
// FP4 weights (packed E2M1, one UE8M0 exponent per 1x32) -> E4M3 weights with one FP32 scale per
// kBlock x kBlock block: the layout of the FP8 grouped GEMMs' B. The staged FP8 x FP4 path runs
// this once per call and then the FP8 GEMM, which pays where many tokens share each weight: the
// GEMMs that convert in-kernel redo the conversion for every M tile.
//
// Numerics (kernels/reference/fp4.py's cast_fp4_to_fp8_blocks matches bit for bit): a block takes
// the largest exponent e_ref of its rows' groups; its scale is 2^(e_ref - 127 - kHeadroomLog2) and
// element v of a group with exponent e becomes E4M3(v * 2^(kHeadroomLog2 - d)), d = e_ref - e,
// rounded to nearest even. E2M1 magnitudes are multiples of 1/2 with two significant bits, so the
// result is exact for d <= kMaxExactStagedShift, where E4M3's subnormal step 2^-9 still holds the
// smallest, 2^(5 - d); deeper groups round to that step.
//
// One CTA per block, one thread per (row, 1x32 group): 16 packed bytes in, 32 E4M3 bytes out; the
// four threads of a row read 64 and write 128 contiguous bytes.
#include <moe_kernels/common/fp4.cuh>
#include <moe_kernels/common/fp8.cuh>

namespace moe_kernels {

constexpr uint32_t kMaxExactStagedShift = 14;

// E2M1 code (bit 3 sign, bits 0-2 magnitude index) -> its value as FP32 bits, from the fields:
// index 1 is 0.5; index i >= 2 has exponent i / 2 - 1 and mantissa bit i % 2.
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t mag = code & 7u;
  const uint32_t bits = mag >= 2u ? (((mag >> 1) + 126u) << 23) | ((mag & 1u) << 22) : mag * 0x3F000000u;
  return __uint_as_float(bits | ((code & 8u) << 28));
}

// Eight codes of `w` (nibble j = element j) times `factor` (a normal power of two, so the product
// is exact) -> eight E4M3 bytes, rounded to nearest even.
__device__ __forceinline__ uint2 convert8_rounded(uint32_t w, float factor) {
  uint32_t out[2];
#pragma unroll
  for (uint32_t half = 0; half < 2; ++half) {
    uint32_t word = 0;
#pragma unroll
    for (uint32_t pair = 0; pair < 2; ++pair) {
      const uint32_t j = half * 4 + pair * 2;
      const unsigned short two = float2_to_e4m3x2(e2m1_to_float(w >> (4 * j)) * factor,
                                                  e2m1_to_float(w >> (4 * j + 4)) * factor);
      word |= uint32_t(two) << (16 * pair);
    }
    out[half] = word;
  }
  return make_uint2(out[0], out[1]);
}

// packed: [G, n, k / 2] bytes with strides (packed_stride_g, packed_stride_n), 16-byte aligned rows;
// sfb: [G, n, k / 32] exponent bytes with strides (sfb_stride_g, sfb_stride_n); out: [G, n, k] E4M3,
// contiguous; sf: [G, ceil(n / kBlock), k / kBlock] FP32, contiguous. Grid (k / kBlock,
// ceil(n / kBlock), G), kBlock * kBlock / 32 threads.
template <uint32_t kBlock>
__global__ void __launch_bounds__(kBlock * kBlock / 32)
    cast_fp4_to_fp8_blocks_kernel(const uint8_t* __restrict__ packed, unsigned long long packed_stride_g,
                                  unsigned long long packed_stride_n, const uint8_t* __restrict__ sfb,
                                  unsigned long long sfb_stride_g, unsigned long long sfb_stride_n,
                                  uint8_t* __restrict__ out, float* __restrict__ sf, uint32_t n, uint32_t k) {
  constexpr uint32_t kGroupsPerRow = kBlock / 32;
  constexpr uint32_t kWarps = kBlock * kGroupsPerRow / 32;
  static_assert(kBlock % 32 == 0 && kWarps <= 32, "whole 1x32 groups, at most 32 warps");
  __shared__ uint32_t warp_max[kWarps];

  const uint32_t group = threadIdx.x % kGroupsPerRow;
  const uint32_t row = blockIdx.y * kBlock + threadIdx.x / kGroupsPerRow;
  const uint64_t g = blockIdx.z;
  const bool valid = row < n;
  const uint32_t k_group = blockIdx.x * kGroupsPerRow + group;
  // The scale exponents first: the reduction waits on them, the packed load overlaps it.
  const uint32_t e = valid ? sfb[g * sfb_stride_g + row * sfb_stride_n + k_group] : 0u;
  uint4 in = make_uint4(0, 0, 0, 0);
  if (valid) in = *reinterpret_cast<const uint4*>(packed + g * packed_stride_g + row * packed_stride_n + k_group * 16);

  const uint32_t m = __reduce_max_sync(0xffffffffu, e);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  uint32_t e_ref = 0;
#pragma unroll
  for (uint32_t w = 0; w < kWarps; ++w) e_ref = max(e_ref, warp_max[w]);

  if (threadIdx.x == 0) {
    sf[(g * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] =
        ldexpf(1.0f, static_cast<int>(e_ref) - 127 - static_cast<int>(fp4::kHeadroomLog2));
  }
  if (!valid) return;

  const uint32_t d = e_ref - e;
  uint2 c[4];
  if (d <= fp4::kMaxExactShift) {
    // E4M3 normals throughout: the byte tables of the in-kernel conversion.
    const fp4::Lut lut = fp4::make_lut(d);
    c[0] = fp4::convert8(in.x, lut), c[1] = fp4::convert8(in.y, lut);
    c[2] = fp4::convert8(in.z, lut), c[3] = fp4::convert8(in.w, lut);
  } else {
    // Past 24 binades every value rounds to zero; the clamp keeps the factor a normal float.
    const float factor = ldexpf(1.0f, static_cast<int>(fp4::kHeadroomLog2) - static_cast<int>(min(d, 24u)));
    c[0] = convert8_rounded(in.x, factor), c[1] = convert8_rounded(in.y, factor);
    c[2] = convert8_rounded(in.z, factor), c[3] = convert8_rounded(in.w, factor);
  }
  uint4* dst = reinterpret_cast<uint4*>(out + (g * n + row) * k + k_group * 32);
  dst[0] = make_uint4(c[0].x, c[0].y, c[1].x, c[1].y);
  dst[1] = make_uint4(c[2].x, c[2].y, c[3].x, c[3].y);
}

}  // namespace moe_kernels
