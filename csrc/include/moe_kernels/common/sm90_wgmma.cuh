#pragma once
// Warpgroup MMAs with both operands K-major in shared memory, FP32 accumulators, for every N that
// is a multiple of 8 up to 256: FP8 (E4M3 x E4M3, 64 x N x 32) and BF16 (64 x N x 16). The
// instruction atoms come from CuTe; this wraps their per-register signature so kernels pass an
// accumulator array.

#include <cuda/std/utility>
// The non-power-of-two N shapes live in the extended header, opt-in.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
#include <cute/arch/mma_sm90_gmma.hpp>
#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels::sm90 {

template <uint32_t kN>
struct Fp8WgmmaAtom;

#define MOE_FP8_WGMMA_ATOM(N)                                                \
  template <>                                                                \
  struct Fp8WgmmaAtom<N> {                                                   \
    using type = cute::SM90::GMMA::MMA_64x##N##x32_F32E4M3E4M3_SS_TN<>;      \
  };
MOE_FP8_WGMMA_ATOM(8) MOE_FP8_WGMMA_ATOM(16) MOE_FP8_WGMMA_ATOM(24) MOE_FP8_WGMMA_ATOM(32)
MOE_FP8_WGMMA_ATOM(40) MOE_FP8_WGMMA_ATOM(48) MOE_FP8_WGMMA_ATOM(56) MOE_FP8_WGMMA_ATOM(64)
MOE_FP8_WGMMA_ATOM(72) MOE_FP8_WGMMA_ATOM(80) MOE_FP8_WGMMA_ATOM(88) MOE_FP8_WGMMA_ATOM(96)
MOE_FP8_WGMMA_ATOM(104) MOE_FP8_WGMMA_ATOM(112) MOE_FP8_WGMMA_ATOM(120) MOE_FP8_WGMMA_ATOM(128)
MOE_FP8_WGMMA_ATOM(136) MOE_FP8_WGMMA_ATOM(144) MOE_FP8_WGMMA_ATOM(152) MOE_FP8_WGMMA_ATOM(160)
MOE_FP8_WGMMA_ATOM(168) MOE_FP8_WGMMA_ATOM(176) MOE_FP8_WGMMA_ATOM(184) MOE_FP8_WGMMA_ATOM(192)
MOE_FP8_WGMMA_ATOM(200) MOE_FP8_WGMMA_ATOM(208) MOE_FP8_WGMMA_ATOM(216) MOE_FP8_WGMMA_ATOM(224)
MOE_FP8_WGMMA_ATOM(232) MOE_FP8_WGMMA_ATOM(240) MOE_FP8_WGMMA_ATOM(248) MOE_FP8_WGMMA_ATOM(256)
#undef MOE_FP8_WGMMA_ATOM

template <uint32_t kN>
struct Bf16WgmmaAtom;

#define MOE_BF16_WGMMA_ATOM(N)                                                                            \
  template <>                                                                                             \
  struct Bf16WgmmaAtom<N> {                                                                               \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,             \
                                                                    cute::SM90::GMMA::Major::K>;         \
  };
MOE_BF16_WGMMA_ATOM(8) MOE_BF16_WGMMA_ATOM(16) MOE_BF16_WGMMA_ATOM(24) MOE_BF16_WGMMA_ATOM(32)
MOE_BF16_WGMMA_ATOM(40) MOE_BF16_WGMMA_ATOM(48) MOE_BF16_WGMMA_ATOM(56) MOE_BF16_WGMMA_ATOM(64)
MOE_BF16_WGMMA_ATOM(72) MOE_BF16_WGMMA_ATOM(80) MOE_BF16_WGMMA_ATOM(88) MOE_BF16_WGMMA_ATOM(96)
MOE_BF16_WGMMA_ATOM(104) MOE_BF16_WGMMA_ATOM(112) MOE_BF16_WGMMA_ATOM(120) MOE_BF16_WGMMA_ATOM(128)
MOE_BF16_WGMMA_ATOM(136) MOE_BF16_WGMMA_ATOM(144) MOE_BF16_WGMMA_ATOM(152) MOE_BF16_WGMMA_ATOM(160)
MOE_BF16_WGMMA_ATOM(168) MOE_BF16_WGMMA_ATOM(176) MOE_BF16_WGMMA_ATOM(184) MOE_BF16_WGMMA_ATOM(192)
MOE_BF16_WGMMA_ATOM(200) MOE_BF16_WGMMA_ATOM(208) MOE_BF16_WGMMA_ATOM(216) MOE_BF16_WGMMA_ATOM(224)
MOE_BF16_WGMMA_ATOM(232) MOE_BF16_WGMMA_ATOM(240) MOE_BF16_WGMMA_ATOM(248) MOE_BF16_WGMMA_ATOM(256)
#undef MOE_BF16_WGMMA_ATOM

template <typename Atom, uint32_t kN, uint32_t kDepth>
struct WgmmaOp {
  static constexpr uint32_t kM = 64;
  static constexpr uint32_t kK = kDepth;         // elements of K per instruction (32 bytes)
  static constexpr uint32_t kNumAccum = kN / 2;  // FP32 accumulators per thread

  template <int... kI>
  __device__ __forceinline__ static void issue(uint64_t desc_a, uint64_t desc_b, float* d, bool accumulate,
                                               cuda::std::integer_sequence<int, kI...>) {
    Atom::fma(desc_a, desc_b, d[kI]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
  }

  // d (+)= A[64 x kK] * B[kN x kK]^T; descriptors point at the K-slice in shared memory.
  __device__ __forceinline__ static void mma(uint64_t desc_a, uint64_t desc_b, float* d, bool accumulate) {
    issue(desc_a, desc_b, d, accumulate, cuda::std::make_integer_sequence<int, kNumAccum>{});
  }

  // One K block of 128-byte swizzled K-major rows, as one committed group: each instruction's
  // 32-byte K slice starts 32 bytes (2 descriptor units) further along the rows. accumulate = false
  // starts d afresh with the first slice. The caller waits for the group (wait).
  __device__ __forceinline__ static void issue_k_block(uint64_t desc_a, uint64_t desc_b, float* d, bool accumulate) {
#pragma unroll
    for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(d[i]);
    wgmma_fence();
#pragma unroll
    for (uint32_t k = 0; k < 128 / 32; ++k) mma(desc_a + k * 2, desc_b + k * 2, d, accumulate || k > 0);
    wgmma_commit();
  }

  // Until at most kPending committed groups are in flight, then d is readable.
  template <int kPending>
  __device__ __forceinline__ static void wait(float* d) {
    wgmma_wait<kPending>();
#pragma unroll
    for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(d[i]);
  }
};

template <uint32_t kN>
using Fp8Wgmma = WgmmaOp<typename Fp8WgmmaAtom<kN>::type, kN, 32>;

// FP8 wgmma with A from registers (the m16n8k32 8-bit A fragment per warp: a0 = row l/4, K
// 4(l%4)..+3; a1 = row l/4 + 8; a2, a3 the same rows at K + 16) and B K-major in shared memory.
template <uint32_t kN>
struct Fp8WgmmaRSAtom;

#define MOE_FP8_WGMMA_RS_ATOM(N)                                             \
  template <>                                                                \
  struct Fp8WgmmaRSAtom<N> {                                                 \
    using type = cute::SM90::GMMA::MMA_64x##N##x32_F32E4M3E4M3_RS_TN<>;      \
  };
MOE_FP8_WGMMA_RS_ATOM(8) MOE_FP8_WGMMA_RS_ATOM(16) MOE_FP8_WGMMA_RS_ATOM(24) MOE_FP8_WGMMA_RS_ATOM(32)
MOE_FP8_WGMMA_RS_ATOM(40) MOE_FP8_WGMMA_RS_ATOM(48) MOE_FP8_WGMMA_RS_ATOM(56) MOE_FP8_WGMMA_RS_ATOM(64)
MOE_FP8_WGMMA_RS_ATOM(72) MOE_FP8_WGMMA_RS_ATOM(80) MOE_FP8_WGMMA_RS_ATOM(88) MOE_FP8_WGMMA_RS_ATOM(96)
MOE_FP8_WGMMA_RS_ATOM(104) MOE_FP8_WGMMA_RS_ATOM(112) MOE_FP8_WGMMA_RS_ATOM(120) MOE_FP8_WGMMA_RS_ATOM(128)
#undef MOE_FP8_WGMMA_RS_ATOM

template <uint32_t kN>
struct Fp8WgmmaRS {
  using Atom = typename Fp8WgmmaRSAtom<kN>::type;
  static constexpr uint32_t kK = 32;
  static constexpr uint32_t kNumAccum = kN / 2;

  template <int... kI>
  __device__ __forceinline__ static void issue(const uint32_t* a, uint64_t desc_b, float* d, bool accumulate,
                                               cuda::std::integer_sequence<int, kI...>) {
    Atom::fma(a[0], a[1], a[2], a[3], desc_b, d[kI]...,
              accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
  }

  // d (+)= A[64 x 32] (registers) * B[kN x 32]^T (descriptor at the K-slice in shared memory).
  __device__ __forceinline__ static void mma(const uint32_t* a, uint64_t desc_b, float* d, bool accumulate) {
    issue(a, desc_b, d, accumulate, cuda::std::make_integer_sequence<int, kNumAccum>{});
  }
};
template <uint32_t kN>
using Bf16Wgmma = WgmmaOp<typename Bf16WgmmaAtom<kN>::type, kN, 16>;

}  // namespace moe_kernels::sm90
