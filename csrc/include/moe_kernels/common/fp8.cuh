#pragma once
// FP8 E4M3 scaling and conversion with every rounding step pinned down, so that kernels agree bit
// for bit with kernels/reference/quant.py (no fast-math approximations).

namespace moe_kernels {

constexpr float kE4M3Max = 448.0f;
// Floor of a group's amax, so that an all-zero group gets a finite, non-zero scale.
constexpr float kAmaxFloor = 1e-4f;

// Smallest power of two >= x, exact on the float bits. Defined for x > 0, normal or subnormal;
// NaN and +inf are returned unchanged, and values above 2^127 round up to +inf.
__device__ __forceinline__ float ceil_to_ue8m0(float x) {
  const unsigned bits = __float_as_uint(x);
  const unsigned exponent = bits >> 23;
  if (exponent == 0xffu) return x;
  if (exponent != 0) {
    // A non-zero mantissa carries into the exponent; clearing the mantissa then leaves 2^(e+1).
    return __uint_as_float((bits + 0x007fffffu) & 0xff800000u);
  }
  // Subnormal: x = bits * 2^-149 with bits in [1, 2^23); the next power of two of the integer.
  return __uint_as_float(bits <= 1u ? bits : 1u << (32 - __clz(bits - 1u)));
}

// Scale of one group from its amax: IEEE amax / 448 after the floor, optionally rounded up to
// a power of two (UE8M0). A NaN amax gives a NaN scale.
template <bool kUseUE8M0>
__device__ __forceinline__ float fp8_scale_from_amax(float amax) {
  const float clamped = amax < kAmaxFloor ? kAmaxFloor : amax;
  const float sf = __fdiv_rn(clamped, kE4M3Max);
  return kUseUE8M0 ? ceil_to_ue8m0(sf) : sf;
}

// Two floats to two E4M3 bytes (lo in the low byte), round-to-nearest-even, saturating finite
// values and infinities to +-448; NaN stays NaN.
__device__ __forceinline__ unsigned short float2_to_e4m3x2(float lo, float hi) {
  unsigned short packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

__device__ __forceinline__ unsigned char float_to_e4m3(float x) {
  return static_cast<unsigned char>(float2_to_e4m3x2(x, 0.0f) & 0xffu);
}

// kSize scaled values (x * inv_scale, IEEE multiply) packed as E4M3 bytes into `out`.
template <int kSize>
__device__ __forceinline__ void scale_to_e4m3(const float (&x)[kSize], float inv_scale,
                                              unsigned char (&out)[kSize]) {
  if constexpr (kSize == 1) {
    out[0] = float_to_e4m3(__fmul_rn(x[0], inv_scale));
  } else {
    static_assert(kSize % 2 == 0, "vectors longer than one element have even length");
#pragma unroll
    for (int i = 0; i < kSize; i += 2) {
      const unsigned short pair =
          float2_to_e4m3x2(__fmul_rn(x[i], inv_scale), __fmul_rn(x[i + 1], inv_scale));
      out[i] = static_cast<unsigned char>(pair & 0xffu);
      out[i + 1] = static_cast<unsigned char>(pair >> 8);
    }
  }
}

}  // namespace moe_kernels
