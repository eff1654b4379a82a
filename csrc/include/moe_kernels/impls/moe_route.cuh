#pragma once
// Top-k routing from router logits in one launch, one warp per token (moe_runtime/router.py has the
// semantics): scores s = softmax(z) or sigmoid(z), choice c = s (+ bias); with groups, a group's
// score is the sum of its two largest c and all but the kTopKGroups best groups are dropped; the
// kTopK largest c (largest first, ties to the lower expert id) give the ids, their s the weights,
// divided by their sum (+1e-20) with kNorm, times `scaling`.
//
// Expert e sits in lane e % 32, register e / 32, so a lane's experts rise with the register index
// and a strict "ranks above" keeps the lowest id among equal values. NaN ranks above every number,
// as in torch.topk. Tied choices come out lowest id first; torch.topk leaves their order open.

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

struct RouteCandidate {
  float choice;
  uint32_t expert;
  float score;
};

// a ranks above b: NaN above everything (torch.topk's order), then the larger value.
__device__ __forceinline__ bool route_above(float a, float b) {
  const bool a_nan = a != a, b_nan = b != b;
  return (a_nan || b_nan) ? a_nan && !b_nan : a > b;
}

__device__ __forceinline__ bool route_tied(float a, float b) { return a == b || (a != a && b != b); }

// The higher-ranked choice first, then the lower expert id.
__device__ __forceinline__ bool route_better(const RouteCandidate& a, const RouteCandidate& b) {
  return route_above(a.choice, b.choice) || (route_tied(a.choice, b.choice) && a.expert < b.expert);
}

__device__ __forceinline__ RouteCandidate route_warp_best(RouteCandidate c) {
#pragma unroll
  for (uint32_t offset = 16; offset > 0; offset /= 2) {
    RouteCandidate other;
    other.choice = __shfl_xor_sync(0xFFFFFFFFu, c.choice, offset);
    other.expert = __shfl_xor_sync(0xFFFFFFFFu, c.expert, offset);
    other.score = __shfl_xor_sync(0xFFFFFFFFu, c.score, offset);
    if (route_better(other, c)) c = other;
  }
  return c;
}

template <uint32_t kNumExperts, uint32_t kTopK, uint32_t kNumGroups, uint32_t kTopKGroups, bool kSigmoid, bool kNorm,
          bool kHasBias, uint32_t kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    moe_route_kernel(const float* __restrict__ logits, const float* __restrict__ bias, uint32_t num_tokens,
                     float scaling, long long* __restrict__ topk_idx, float* __restrict__ topk_weights) {
  constexpr uint32_t kPerLane = (kNumExperts + 31) / 32;
  const float kNegInf = __int_as_float(0xFF800000);
  static_assert(kTopK >= 1 && kTopK <= 32, "one slot per lane");
  static_assert(kPerLane <= 32, "one bit of `taken` per register: at most 1024 experts");
  static_assert(kNumGroups == 0 || (kNumExperts % kNumGroups == 0 && kNumExperts / kNumGroups >= 2 &&
                                    kNumGroups <= 32 && kTopKGroups >= 1 && kTopKGroups <= kNumGroups),
                "groups of at least two experts divide the experts, at most 32 of them");
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t token = blockIdx.x * kWarps + threadIdx.x / 32;
  if (token >= num_tokens) return;
  const float* z = logits + uint64_t(token) * kNumExperts;

  float s[kPerLane], c[kPerLane];
  if constexpr (kSigmoid) {
#pragma unroll
    for (uint32_t i = 0; i < kPerLane; ++i) {
      const uint32_t e = i * 32 + lane;
      s[i] = e < kNumExperts ? 1.0f / (1.0f + expf(-z[e])) : 0.0f;
    }
  } else {
    float x[kPerLane], max_z = kNegInf;
#pragma unroll
    for (uint32_t i = 0; i < kPerLane; ++i) {
      const uint32_t e = i * 32 + lane;
      x[i] = e < kNumExperts ? z[e] : kNegInf;
      max_z = fmaxf(max_z, x[i]);
    }
#pragma unroll
    for (uint32_t offset = 16; offset > 0; offset /= 2) max_z = fmaxf(max_z, __shfl_xor_sync(0xFFFFFFFFu, max_z, offset));
    float sum = 0.0f;
#pragma unroll
    for (uint32_t i = 0; i < kPerLane; ++i) {
      x[i] = i * 32 + lane < kNumExperts ? expf(x[i] - max_z) : 0.0f;
      sum += x[i];
    }
#pragma unroll
    for (uint32_t offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
#pragma unroll
    for (uint32_t i = 0; i < kPerLane; ++i) s[i] = x[i] / sum;
  }
#pragma unroll
  for (uint32_t i = 0; i < kPerLane; ++i) {
    const uint32_t e = i * 32 + lane;
    c[i] = e < kNumExperts ? (kHasBias ? s[i] + bias[e] : s[i]) : kNegInf;
  }

  if constexpr (kNumGroups > 0) {
    constexpr uint32_t kPerGroup = kNumExperts / kNumGroups;
    // Group scores: the two largest choices of each group, summed (largest + second); lane g keeps
    // group g's, so the group choice below is a warp reduction like the top-k one.
    float my_group_score = kNegInf;
#pragma unroll 1
    for (uint32_t g = 0; g < kNumGroups; ++g) {
      float first = kNegInf, second = kNegInf;
#pragma unroll
      for (uint32_t i = 0; i < kPerLane; ++i) {
        const uint32_t e = i * 32 + lane;
        if (e < kNumExperts && e / kPerGroup == g) {
          if (route_above(c[i], first)) {
            second = first;
            first = c[i];
          } else if (route_above(c[i], second)) {
            second = c[i];
          }
        }
      }
#pragma unroll
      for (uint32_t offset = 16; offset > 0; offset /= 2) {
        const float other_first = __shfl_xor_sync(0xFFFFFFFFu, first, offset);
        const float other_second = __shfl_xor_sync(0xFFFFFFFFu, second, offset);
        if (route_above(other_first, first)) {
          second = route_above(first, other_second) ? first : other_second;
          first = other_first;
        } else if (route_above(other_first, second)) {
          second = other_first;
        }
      }
      if (lane == g) my_group_score = first + second;
    }
    // The kTopKGroups best groups (ties to the lower group), as a bit mask.
    uint32_t kept = 0;
#pragma unroll 1
    for (uint32_t round = 0; round < kTopKGroups; ++round) {
      RouteCandidate best{kNegInf, 0xFFFFFFFFu, 0.0f};
      const RouteCandidate mine{my_group_score, lane, 0.0f};
      if (lane < kNumGroups && !(kept >> lane & 1u) && route_better(mine, best)) best = mine;
      best = route_warp_best(best);
      if (best.expert < kNumGroups) kept |= 1u << best.expert;
    }
#pragma unroll
    for (uint32_t i = 0; i < kPerLane; ++i) {
      const uint32_t e = i * 32 + lane;
      if (e < kNumExperts && !(kept >> (e / kPerGroup) & 1u)) c[i] = kNegInf;
    }
  }

  // Top-k, largest first: lane j keeps slot j; `taken` marks this lane's registers already chosen.
  // A lane with nothing left offers (-inf, no expert), which every real candidate beats.
  long long my_id = 0;
  float my_weight = 0.0f;
  uint32_t taken = 0;
#pragma unroll 1
  for (uint32_t slot = 0; slot < kTopK; ++slot) {
    RouteCandidate best{kNegInf, 0xFFFFFFFFu, 0.0f};
#pragma unroll
    for (uint32_t i = 0; i < kPerLane; ++i) {
      const RouteCandidate mine{c[i], i * 32 + lane, s[i]};
      if (mine.expert < kNumExperts && !(taken >> i & 1u) && route_better(mine, best)) best = mine;
    }
    best = route_warp_best(best);
    if (lane == slot) {
      my_id = best.expert;
      my_weight = best.score;
    }
    if (best.expert < kNumExperts && best.expert % 32 == lane) taken |= 1u << (best.expert / 32);
  }

  if constexpr (kNorm) {
    // The slots' weights summed in slot order, as one thread would.
    float sum = 0.0f;
#pragma unroll
    for (uint32_t j = 0; j < kTopK; ++j) sum += __shfl_sync(0xFFFFFFFFu, my_weight, j);
    my_weight = my_weight / (sum + 1e-20f);
  }
  if (lane < kTopK) {
    topk_idx[uint64_t(token) * kTopK + lane] = my_id;
    topk_weights[uint64_t(token) * kTopK + lane] = my_weight * scaling;
  }
}

}  // namespace moe_kernels
