#pragma once
// Thin wrappers over the SM90 PTX the GEMM kernels use: mbarriers, TMA (bulk tensor) copies,
// async-proxy fences, wgmma fences, register reconfiguration and named barriers.
// Written as raw PTX so the kernels depend on CuTe only for the wgmma instruction atoms.

#include <cuda/std/cstdint>

namespace moe_kernels {
using cuda::std::int32_t;
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uint8_t;

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned. Declared here because the CUDA
// driver header is host-only (it pulls in stdlib.h, which NVRTC lacks).
struct alignas(64) TmaDescriptor {
  uint64_t opaque[16];
};
}  // namespace moe_kernels

namespace moe_kernels::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ---- mbarrier --------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Arrives on the mbarrier at `bar`'s offset in CTA `cta` of the cluster (this CTA included). The
// default CTA-scope release, as CUTLASS's ClusterBarrier does: what it orders is this thread's use of
// a stage that a peer's TMA refills next, and .release.cluster would add a GPU-wide MEMBAR per call.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

// Arrivals by the threads where `pred` holds, as one predicated instruction rather than a branch:
// with wgmmas in flight, ptxas serializes them around divergent paths (C7518).
__device__ __forceinline__ void mbarrier_arrive_if(uint64_t* bar, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}" ::"r"(smem_addr(bar)),
      "r"(static_cast<uint32_t>(pred))
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_cluster_if(uint64_t* bar, uint32_t cta, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b32 remote;\n"
      "setp.ne.b32 p, %2, 0;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "@p mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
      "r"(cta), "r"(static_cast<uint32_t>(pred))
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Blocks until the barrier's phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Makes mbarrier initialisation visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads (TMA store).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- cp.async (LDGSTS): small gathers that complete on an mbarrier -------------------------
// Copies 4 bytes, or writes 4 zero bytes when `src_bytes` is 0 (nothing is read then).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}

// Arrives on `bar` once all of this thread's earlier cp.async copies have landed; counts as one
// of the barrier's expected arrivals.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// ---- Loads of read-only data into registers ---------------------------------------------------
// kN (1, 2 or 4) consecutive floats at p (aligned to 4 x kN bytes) through the non-coherent path,
// not allocated in L1 (a CTA reads each once), or zeros where `valid` is false (nothing is read then).
// Volatile, so they issue where written: ahead of the barrier waits whose latency they hide.
template <uint32_t kN>
__device__ __forceinline__ void ld_nc_floats(float (&out)[kN], const float* p, bool valid) {
  static_assert(kN == 1 || kN == 2 || kN == 4, "1, 2 or 4 floats");
  if constexpr (kN == 4) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
        " @p ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];\n}"
        : "=f"(out[0]), "=f"(out[1]), "=f"(out[2]), "=f"(out[3])
        : "l"(p), "r"(static_cast<uint32_t>(valid)));
  } else if constexpr (kN == 2) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
        " @p ld.global.nc.L1::no_allocate.v2.f32 {%0, %1}, [%2];\n}"
        : "=f"(out[0]), "=f"(out[1])
        : "l"(p), "r"(static_cast<uint32_t>(valid)));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n mov.b32 %0, 0;\n"
        " @p ld.global.nc.L1::no_allocate.f32 %0, [%1];\n}"
        : "=f"(out[0])
        : "l"(p), "r"(static_cast<uint32_t>(valid)));
  }
}

__device__ __forceinline__ float ld_nc_float(const float* p, bool valid) {
  float v[1];
  ld_nc_floats<1>(v, p, valid);
  return v[0];
}

// ---- TMA ------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_prefetch_descriptor(const TmaDescriptor* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 2-D tile load global -> shared completing on `bar`; coordinates are (inner, outer) in elements.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDescriptor* map, uint64_t* bar, int32_t inner,
                                            int32_t outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// 2-D tile load multicast to the CTAs of `cta_mask` (bit i: CTA i of the cluster), into the same
// shared-memory offset in each, completing bytes on the mbarrier at `bar`'s offset in each.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TmaDescriptor* map, uint64_t* bar, int32_t inner,
                                                      int32_t outer, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(inner), "r"(outer), "h"(cta_mask)
      : "memory");
}

// ---- clusters --------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster. Relaxed arrive, as CUTLASS does after mbarrier inits:
// fence.mbarrier_init.release.cluster already publishes them, and a release arrive would add a
// GPU-wide MEMBAR.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) of this CTA's shared memory at
// `src` to `dst`'s offset in CTA `cta` of the cluster, completing them as tx bytes on the mbarrier at
// `bar`'s offset there. An async-proxy read: generic writes to `src` need fence_proxy_async_shared
// (by the writers) before it is issued.
__device__ __forceinline__ void bulk_copy_to_cluster_cta(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                                         uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote_dst, remote_bar;\n"
      "mapa.shared::cluster.u32 remote_dst, %0, %3;\n"
      "mapa.shared::cluster.u32 remote_bar, %2, %3;\n"
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [remote_dst], [%1], %4, [remote_bar];\n"
      "}" ::"r"(smem_addr(dst)),
      "r"(smem_addr(src)), "r"(smem_addr(bar)), "r"(cta), "r"(bytes)
      : "memory");
}

// ---- programmatic dependent launch -------------------------------------------------------------
// The next kernel of the stream, launched with programmatic stream serialization, may start (its
// CTAs take SMs as this grid's leave, and run their prologue); it waits in its own
// wait_prerequisites for this grid to finish.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Until the grids this one depends on have finished and their writes are visible (at once for a
// kernel launched without a programmatic dependency).
__device__ __forceinline__ void wait_prerequisites() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// 2-D tile store shared -> global; rows and columns outside the tensor are clipped by the TMA unit.
__device__ __forceinline__ void tma_store_2d(const TmaDescriptor* map, const void* src, int32_t inner, int32_t outer) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(inner), "r"(outer)
               : "memory");
}

// 3-D tile store [outer2][outer][inner]: clipping happens per dimension, so a tile never spills
// from one group (outer2) into the next.
__device__ __forceinline__ void tma_store_3d(const TmaDescriptor* map, const void* src, int32_t inner, int32_t outer,
                                             int32_t outer2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(inner), "r"(outer), "r"(outer2)
               : "memory");
}

__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most kPending bulk groups still read their shared-memory source.
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

template <int kPending>
__device__ __forceinline__ void tma_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// ---- warpgroup-level -------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps accumulator registers live across the asynchronous wgmma so the compiler neither
// reorders reads of them before the wait nor spills them.
__device__ __forceinline__ void fence_operand(float& reg) { asm volatile("" : "+f"(reg)::"memory"); }
// Register A operands of an in-flight wgmma must keep their registers until wgmma_wait: fencing
// them after the wait keeps the compiler from reusing those registers earlier.
__device__ __forceinline__ void fence_operand(uint32_t& reg) { asm volatile("" : "+r"(reg)::"memory"); }
// Hides how a pointer was derived, so that a base computed once (per tile) stays one 64-bit value
// instead of being rebuilt from its parts beside every use.
template <class T>
__device__ __forceinline__ const T* opaque(const T* p) {
  asm("" : "+l"(p));
  return p;
}

// setmaxnreg only moves registers inside what the CTA was given at launch: ptxas gives a kernel
// that uses it the most its launch bounds allow (65536 / threads, at most 255, whole steps of 8 per
// thread). Role budgets that add up to more make setmaxnreg.inc wait forever (a hang, no error).
template <uint32_t kNumThreads>
constexpr uint32_t launch_registers() {
  return (65536 / kNumThreads < 255 ? 65536 / kNumThreads : 255) / 8 * 8 * kNumThreads;
}

template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Barrier among a subset of warps (id 0 is __syncthreads'); `threads` is a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.sync that also ORs `pred` over the participating threads: every thread gets the result.
__device__ __forceinline__ bool named_barrier_or(uint32_t id, uint32_t threads, bool pred) {
  uint32_t result;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}"
      : "=r"(result)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return result != 0;
}
// Counts the calling warps towards barrier `id` without waiting for it to complete.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Shared-memory matrix descriptor for a K-major tile written by TMA with the 128-byte swizzle:
// rows of 128 bytes, 8-row swizzle atoms 1024 bytes apart (stride byte offset); the leading
// byte offset is unused for swizzled K-major layouts. Advancing K inside the 128-byte row is done
// by adding the byte offset (>> 4) to the start address field.
__device__ __forceinline__ uint64_t make_sw128_kmajor_desc(const void* smem_tile) {
  const uint64_t addr = smem_addr(smem_tile);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFF) >> 4;           // start address, bits 0-13
  desc |= uint64_t(1) << 16;               // leading byte offset (ignored), bits 16-29
  desc |= uint64_t(1024 >> 4) << 32;       // stride byte offset, bits 32-45
  desc |= uint64_t(1) << 62;               // layout: 128-byte swizzle, bits 62-63
  return desc;
}

// stmatrix: each of the warp's 8x8 b16 matrices takes one 32-bit register per thread (row lane / 4,
// columns 2 * (lane % 4) + {0, 1}: a wgmma accumulator fragment's layout); lane i gives the shared
// address of row i % 8 of matrix i / 8 (16 contiguous bytes).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x2(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};" ::"r"(addr), "r"(r0), "r"(r1) : "memory");
}
// The same, each matrix stored transposed: lane i's address takes column i % 8 of matrix i / 8
// (the fragment's 8 rows, 16 contiguous bytes).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(addr), "r"(r0), "r"(r1)
               : "memory");
}

__host__ __device__ constexpr uint32_t gcd_u32(uint32_t a, uint32_t b) { return b == 0 ? a : gcd_u32(b, a % b); }

__device__ __forceinline__ uint32_t lane_id() {
  uint32_t lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

}  // namespace moe_kernels::sm90
