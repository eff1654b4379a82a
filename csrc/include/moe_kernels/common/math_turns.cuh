#pragma once
// Turns of two math warpgroups on the tensor cores (the FP8 GEMM's kPingPong).

#include <moe_kernels/common/sm90_ptx.cuh>

namespace moe_kernels {

// Ping-pong of a 128-row tile's two math warpgroups: they issue their K blocks' wgmmas in turn (WG0
// kb 0, WG1 kb 0, WG0 kb 1, ...), so the tensor cores run one warpgroup's K block while the other
// promotes its previous one. Issued together, both finished together and promoted with the tensor
// cores idle (ncu, 4096 x 4096 x 7168: 42% of the math warps' time waiting on wgmma, 19% promoting).
// Named barrier kFirstBarrier + w is warpgroup w's turn (ids 0 and 1 are __syncthreads' and the
// epilogue's): w waits on it (bar.sync), the other warpgroup gives it (bar.arrive), 128 threads each.
// Both warpgroups walk the same tiles with the same K blocks, N issues in all (one per K block, or
// one per half of a 256-column SwiGLU tile): WG1 gives WG0 its first turn and one after each of its
// issues (N + 1), which WG0 takes before each of its issues and once after its last tile (N + 1); WG0
// gives WG1 N turns, which WG1 takes. Every generation of both barriers completes, for a CTA without
// tiles too, and none is pending when the CTA exits. A turn is given only after the giver's issue, so
// the issues strictly alternate across K blocks and tiles;
// each warpgroup gives its tile's last turn before the epilogue's barrier (id 1), so neither waits
// there on the other; and no stage release waits on a turn (a warpgroup releases a stage once its
// own wgmmas on it are done), so the producers always get the stages the turns are waiting for.
struct MathTurns {
  static constexpr uint32_t kFirstBarrier = 2;
  static constexpr uint32_t kThreads = 256;
  uint32_t wg;  // 0 or 1, uniform

  __device__ __forceinline__ void start() const {
    if (wg == 1) sm90::named_barrier_arrive(kFirstBarrier, kThreads);
  }
  __device__ __forceinline__ void take() const { sm90::named_barrier_sync(kFirstBarrier + wg, kThreads); }
  __device__ __forceinline__ void pass() const { sm90::named_barrier_arrive(kFirstBarrier + (wg ^ 1), kThreads); }
  __device__ __forceinline__ void finish() const {
    if (wg == 0) sm90::named_barrier_sync(kFirstBarrier, kThreads);
  }
};

}  // namespace moe_kernels
