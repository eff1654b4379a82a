#pragma once
// pybind entry points of the dense GEMM family. kernels/gemm.py validates tensors (dtypes,
// shapes, contiguity, devices) and passes raw integers; the checks here guard what the kernel
// relies on. fp8_gemm_nt_code generates a kernel's source without a GPU (precompile CLI).
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>

#include <pybind11/pybind11.h>

#include "apis/dtypes.hpp"
#include "launchers/sm90_bf16_gemm.hpp"
#include "launchers/sm90_fp8_fp4_gemm.hpp"
#include "launchers/sm90_fp8_gemm.hpp"

namespace moe_apis::gemm {

namespace detail {

inline moe_launchers::sm90_fp8_gemm::Residual residual_type(int c_dtype) {
  using moe_launchers::sm90_fp8_gemm::Residual;
  if (c_dtype < 0) return Residual::kNone;
  const DType dtype = static_cast<DType>(c_dtype);
  MOE_HOST_ASSERT(dtype == DType::kBFloat16 || dtype == DType::kFloat32,
                  "gemm: c must be bfloat16 or float32, got dtype code " << c_dtype);
  return dtype == DType::kBFloat16 ? Residual::kBFloat16 : Residual::kFloat32;
}

inline moe_launchers::sm90_fp8_gemm::GemmType gemm_type(int value) {
  MOE_HOST_ASSERT(value >= 0 && value <= 2, "gemm_type must be 0 (dense), 1 (contiguous) or 2 (masked), got " << value);
  return static_cast<moe_launchers::sm90_fp8_gemm::GemmType>(value);
}

// -1: what contiguous K-major scales get; 0 gather, 1 TMA MN-major A scales, 2 TMA K-major (both
// with K-major B scales in whole boxes of 4 K blocks: K a multiple of 512; masked GEMMs gather).
inline unsigned scale_load(int value, int k, int gemm_type) {
  MOE_HOST_ASSERT(value >= -1 && value <= 2,
                  "scale_load must be -1 (contiguous K-major scales), 0 (gather), 1 (TMA, MN-major A scales) or 2 "
                  "(TMA, K-major), got " << value);
  MOE_HOST_ASSERT(value <= 0 || (k / 128) % 4 == 0,
                  "scale_load " << value << " (TMA) needs K a multiple of 512 (whole boxes of B's scales), got " << k);
  if (!moe_launchers::sm90_fp8_gemm::takes_scale_tma(detail::gemm_type(gemm_type))) return moe_kernels::kScaleGather;
  return value < 0 ? moe_launchers::sm90_fp8_gemm::contiguous_scale_load(k) : static_cast<unsigned>(value);
}

inline const char* scale_load_name(unsigned scale_load) {
  return scale_load == moe_kernels::kScaleGather          ? "gather"
         : scale_load == moe_kernels::kScaleTmaMnMajor     ? "tma_mn_major"
         : scale_load == moe_kernels::kScaleTmaKMajorTable ? "tma_k_major_table"
                                                            : "tma_k_major";
}

inline pybind11::dict config_dict(const moe_launchers::sm90_fp8_gemm::Config& c, int m) {
  pybind11::dict d;
  d["block_m"] = c.block_m;
  d["block_n"] = c.block_n;
  d["num_stages"] = c.num_stages;
  d["group_n"] = c.group_n;
  d["smem_bytes"] = c.smem_bytes;
  d["num_tiles"] = c.num_tiles(m);
  d["grid"] = c.grid(m);
  d["m_compiled"] = c.m_compiled;
  d["swizzle_d"] = c.swizzle_d;
  d["multicast"] = c.multicast;
  d["share_b"] = c.share_b;
  d["scale_warps"] = c.scale_warps;
  d["scale_load"] = scale_load_name(c.scale_load);
  d["sfa_copy"] = c.sfa_copy;
  d["table_slots"] = c.table_slots;
  d["pingpong"] = c.pingpong;
  d["pdl"] = c.pdl;
  d["k_unroll"] = c.k_unroll;
  d["overlap"] = c.overlap;
  d["wg_store"] = c.wg_store;
  d["tight_boxes"] = c.tight_boxes;
  d["tail_splits"] = c.tail_split_of(m).ways;
  d["swiglu"] = c.swiglu;
  d["gather_chunk"] = c.gather_chunk;
  return d;
}

// Held while a call launches its A-scale copy and the GEMM behind it: the launches run with the GIL
// released, and another thread's pair on the same stream (so the same workspace) must not land
// between them, or this GEMM would read that call's copy. One mutex for every entry point (a
// function, not a static of the launch_fp8 template, which would give each instantiation its own).
inline std::mutex& copy_pair_mutex() {
  static std::mutex mutex;
  return mutex;
}

// config's launch, config = plan(the scale load of args' scales). Where it planned sfa_copy, A's
// scales are first copied MN-major into the workspace and the kernel plan(kScaleTmaMnMajor) runs on
// that copy instead.
template <class Plan>
inline void launch_fp8(const moe_launchers::sm90_fp8_gemm::Config& config,
                       const moe_launchers::sm90_fp8_gemm::Args& args, Plan&& plan) {
  namespace L = moe_launchers::sm90_fp8_gemm;
  L::Args copied;
  // The copy is MN-major, so it loads by TMA wherever B's scales do too.
  if (config.sfa_copy && L::sfa_copy_args(args, copied) &&
      L::scale_layout_for(config.type, copied, config.n, config.k) == moe_kernels::kScaleTmaMnMajor) {
    const L::Config behind = plan(moe_kernels::kScaleTmaMnMajor);
    // Both kernels compiled (or loaded) before the lock: a compile takes seconds.
    auto copy_kernel = moe_launchers::mn_major_sf::kernel_of(args.device);
    auto gemm_kernel = L::kernel_of(behind, args.device);
    const std::lock_guard<std::mutex> pair(copy_pair_mutex());
    L::copy_sfa(args, copied, config.k, config.pdl != 0, std::move(copy_kernel));
    L::launch(behind, copied, std::move(gemm_kernel));
    return;
  }
  // No copy after all (a workspace without the room, B's scales not TMA-aligned): config's own kernel.
  L::launch(config, args);
}

}  // namespace detail

inline void fp8_gemm_nt(std::uint64_t a, long long lda, std::uint64_t sfa, long long sfa_stride_m,
                        long long sfa_stride_k, std::uint64_t b, long long ldb, std::uint64_t sfb,
                        long long sfb_stride_n, long long sfb_stride_k, std::uint64_t d, long long ldd,
                        std::uint64_t c, int c_dtype, long long ldc, int m, int n, int k, bool compile_m,
                        int device, std::uint64_t split_workspace, std::uint64_t split_workspace_bytes,
                        std::uint64_t stream) {
  namespace L = moe_launchers::sm90_fp8_gemm;
  L::Args args{a, sfa, b, sfb, d, c, lda, ldb, ldd, ldc, sfa_stride_m, sfa_stride_k, 0, sfb_stride_n,
               sfb_stride_k, m, 1, 0, device, stream};
  args.split_workspace = split_workspace;
  args.split_workspace_bytes = split_workspace_bytes;
  const int num_sms = moe_jit::get_num_sms(device);
  const auto residual = detail::residual_type(c_dtype);
  const auto plan = [&](unsigned scale_load) {
    return L::get_config(m, n, k, num_sms, compile_m, residual, L::GemmType::kNormal, 1, 128, split_workspace != 0,
                         scale_load);
  };
  detail::launch_fp8(plan(L::scale_layout_for(L::GemmType::kNormal, args, n, k)), args, plan);
}

// m_indices: int32 [m] on the device. Rows of a group are contiguous and every aligned block of
// `alignment` rows (a multiple of 128) belongs to one group (or is padding, -1).
inline void m_grouped_fp8_gemm_nt_contiguous(std::uint64_t a, long long lda, std::uint64_t sfa, long long sfa_stride_m,
                                             long long sfa_stride_k, std::uint64_t b, long long ldb, std::uint64_t sfb,
                                             long long sfb_stride_g, long long sfb_stride_n, long long sfb_stride_k,
                                             std::uint64_t d, long long ldd, std::uint64_t m_indices, int m, int n,
                                             int k, int num_groups, int alignment, int device,
                                             std::uint64_t workspace, std::uint64_t workspace_bytes,
                                             std::uint64_t stream) {
  namespace L = moe_launchers::sm90_fp8_gemm;
  L::Args args{a, sfa, b, sfb, d, 0, lda, ldb, ldd, 0, sfa_stride_m, sfa_stride_k, sfb_stride_g,
               sfb_stride_n, sfb_stride_k, m, num_groups, m_indices, device, stream};
  args.split_workspace = workspace;
  args.split_workspace_bytes = workspace_bytes;
  const int num_sms = moe_jit::get_num_sms(device);
  const auto plan = [&](unsigned scale_load) {
    return L::get_config(m, n, k, num_sms, false, L::Residual::kNone, L::GemmType::kGroupedContiguous, num_groups,
                         alignment, workspace != 0, scale_load);
  };
  detail::launch_fp8(plan(L::scale_layout_for(L::GemmType::kGroupedContiguous, args, n, k)), args, plan);
}

// masked_m: int32 [num_groups] on the device; a, d hold max_m rows per group (row stride lda/ldd,
// group stride max_m rows).
inline void m_grouped_fp8_gemm_nt_masked(std::uint64_t a, long long lda, std::uint64_t sfa, long long sfa_stride_m,
                                         long long sfa_stride_k, std::uint64_t b, long long ldb, std::uint64_t sfb,
                                         long long sfb_stride_g, long long sfb_stride_n, long long sfb_stride_k,
                                         std::uint64_t d, long long ldd, std::uint64_t masked_m, int max_m,
                                         int expected_m, int n, int k, int num_groups, int device,
                                         std::uint64_t stream) {
  namespace L = moe_launchers::sm90_fp8_gemm;
  MOE_HOST_ASSERT(expected_m >= 1, "m_grouped_fp8_gemm_nt_masked: expected_m must be >= 1, got " << expected_m);
  const L::Args args{a, sfa, b, sfb, d, 0, lda, ldb, ldd, 0, sfa_stride_m, sfa_stride_k, sfb_stride_g,
                     sfb_stride_n, sfb_stride_k, max_m, num_groups, masked_m, device, stream};
  const auto config = L::get_config(std::min(expected_m, max_m), n, k, moe_jit::get_num_sms(device), false,
                                    L::Residual::kNone, L::GemmType::kGroupedMasked, num_groups, 128, true,
                                    L::scale_layout_for(L::GemmType::kGroupedMasked, args, n, k));
  L::launch(config, args);
}

// The L1 GEMM with the SwiGLU epilogue (impls/sm90_fp8_gemm.cuh, kSwiGlu), one of each layout: b gate/up
// interleaved [G, n, k] with two scale rows per 128-row block (sfb_stride_n apart); act E4M3 [rows,
// n / 2] (ld_act), its 1 x 128 scales at act_sf (strides in elements), weights fp32 per row of a.
namespace detail {
inline moe_launchers::sm90_fp8_gemm::Args swiglu_args(
    std::uint64_t a, long long lda, std::uint64_t sfa, long long sfa_stride_m, long long sfa_stride_k, std::uint64_t b,
    long long ldb, std::uint64_t sfb, long long sfb_stride_g, long long sfb_stride_n, long long sfb_stride_k,
    std::uint64_t act, long long ld_act, std::uint64_t act_sf, long long act_sf_stride_m, long long act_sf_stride_k,
    std::uint64_t weights, std::uint64_t layout, int m, int num_groups, int device, std::uint64_t stream) {
  moe_launchers::sm90_fp8_gemm::Args args{a, sfa, b, sfb, 0, 0, lda, ldb, 0, 0, sfa_stride_m, sfa_stride_k,
                                          sfb_stride_g, sfb_stride_n, sfb_stride_k, m, num_groups, layout, device,
                                          stream};
  MOE_HOST_ASSERT(act != 0 && act_sf != 0 && weights != 0, "the SwiGLU epilogue needs act, its scales and the weights");
  // The kernel takes the row stride and the scales' strides as 32-bit values.
  for (const long long v : {ld_act, act_sf_stride_m, act_sf_stride_k}) {
    MOE_HOST_ASSERT(v >= 0 && v < (1ll << 32), "the SwiGLU epilogue's strides must fit 32 bits, got " << v);
  }
  args.swiglu = {weights, act, act_sf, ld_act, act_sf_stride_m, act_sf_stride_k};
  return args;
}
}  // namespace detail

inline void m_grouped_fp8_gemm_nt_swiglu_contiguous(
    std::uint64_t a, long long lda, std::uint64_t sfa, long long sfa_stride_m, long long sfa_stride_k, std::uint64_t b,
    long long ldb, std::uint64_t sfb, long long sfb_stride_g, long long sfb_stride_n, long long sfb_stride_k,
    std::uint64_t act, long long ld_act, std::uint64_t act_sf, long long act_sf_stride_m, long long act_sf_stride_k,
    std::uint64_t weights, std::uint64_t m_indices, int m, int n, int k, int num_groups, int device,
    std::uint64_t stream) {
  namespace L = moe_launchers::sm90_fp8_gemm;
  constexpr auto kType = L::GemmType::kGroupedContiguous;
  const auto args = detail::swiglu_args(a, lda, sfa, sfa_stride_m, sfa_stride_k, b, ldb, sfb, sfb_stride_g,
                                        sfb_stride_n, sfb_stride_k, act, ld_act, act_sf, act_sf_stride_m,
                                        act_sf_stride_k, weights, m_indices, m, num_groups, device, stream);
  L::launch(L::get_swiglu_config(m, n, k, moe_jit::get_num_sms(device), kType, num_groups,
                                 L::scale_layout_for(kType, args, n, k)),
            args);
}

inline void m_grouped_fp8_gemm_nt_swiglu_masked(
    std::uint64_t a, long long lda, std::uint64_t sfa, long long sfa_stride_m, long long sfa_stride_k, std::uint64_t b,
    long long ldb, std::uint64_t sfb, long long sfb_stride_g, long long sfb_stride_n, long long sfb_stride_k,
    std::uint64_t act, long long ld_act, std::uint64_t act_sf, long long act_sf_stride_m, long long act_sf_stride_k,
    std::uint64_t weights, std::uint64_t masked_m, int max_m, int expected_m, int n, int k, int num_groups, int device,
    std::uint64_t stream) {
  namespace L = moe_launchers::sm90_fp8_gemm;
  constexpr auto kType = L::GemmType::kGroupedMasked;
  MOE_HOST_ASSERT(expected_m >= 1, "m_grouped_fp8_gemm_nt_swiglu_masked: expected_m must be >= 1, got " << expected_m);
  const auto args = detail::swiglu_args(a, lda, sfa, sfa_stride_m, sfa_stride_k, b, ldb, sfb, sfb_stride_g,
                                        sfb_stride_n, sfb_stride_k, act, ld_act, act_sf, act_sf_stride_m,
                                        act_sf_stride_k, weights, masked_m, max_m, num_groups, device, stream);
  L::launch(L::get_swiglu_config(std::min(expected_m, max_m), n, k, moe_jit::get_num_sms(device), kType, num_groups,
                                 L::scale_layout_for(kType, args, n, k)),
            args);
}

// The kernel a plan picked (launchers/sm90_fp8_fp4_gemm.hpp): weights as the register operand of
// the swapped kernel (no converted tile in shared memory), or the converter kernel.
inline void launch_fp4(const moe_launchers::sm90_fp8_fp4_gemm::Plan& plan,
                       const moe_launchers::sm90_fp8_fp4_gemm::Args& args) {
  namespace L = moe_launchers::sm90_fp8_fp4_gemm;
  if (plan.swap_ab) {
    L::launch(plan.swapped, args);
  } else {
    L::launch(plan.converter, args);
  }
}

// FP4 weights: b packed E2M1 [num_groups * n, k / 2] with row stride ldb bytes; sfb UE8M0
// exponent bytes [num_groups, n, k / 32] (strides in bytes, the last one 1).
inline void m_grouped_fp8_fp4_gemm_nt_contiguous(std::uint64_t a, long long lda, std::uint64_t sfa,
                                                 long long sfa_stride_m, long long sfa_stride_k, std::uint64_t b,
                                                 long long ldb, std::uint64_t sfb, long long sfb_stride_g,
                                                 long long sfb_stride_n, std::uint64_t d, long long ldd,
                                                 std::uint64_t m_indices, int m, int n, int k, int num_groups,
                                                 int device, std::uint64_t stream) {
  namespace L = moe_launchers::sm90_fp8_fp4_gemm;
  const L::Args args{a, sfa, b, sfb, d, lda, ldb, ldd, sfa_stride_m, sfa_stride_k, sfb_stride_g, sfb_stride_n,
                     m, num_groups, m_indices, device, stream};
  launch_fp4(L::get_plan(L::GemmType::kGroupedContiguous, m, n, k, moe_jit::get_num_sms(device), num_groups), args);
}

inline void m_grouped_fp8_fp4_gemm_nt_masked(std::uint64_t a, long long lda, std::uint64_t sfa, long long sfa_stride_m,
                                             long long sfa_stride_k, std::uint64_t b, long long ldb, std::uint64_t sfb,
                                             long long sfb_stride_g, long long sfb_stride_n, std::uint64_t d,
                                             long long ldd, std::uint64_t masked_m, int max_m, int expected_m, int n,
                                             int k, int num_groups, int device, std::uint64_t stream) {
  namespace L = moe_launchers::sm90_fp8_fp4_gemm;
  MOE_HOST_ASSERT(expected_m >= 1, "m_grouped_fp8_fp4_gemm_nt_masked: expected_m must be >= 1, got " << expected_m);
  const int rows = std::min(expected_m, max_m);
  const L::Args args{a, sfa, b, sfb, d, lda, ldb, ldd, sfa_stride_m, sfa_stride_k, sfb_stride_g, sfb_stride_n,
                     max_m, num_groups, masked_m, device, stream};
  launch_fp4(L::get_plan(L::GemmType::kGroupedMasked, rows, n, k, moe_jit::get_num_sms(device), num_groups), args);
}

// Weights and their UE8M0 scales in kernels/_fp4_fragment.py's layout (b: uint8 [G, K/128,
// ceil(N/64), 4352]); decode sizes only (min(expected_m, max_m) <= 32).
inline void m_grouped_fp8_fp4_gemm_nt_masked_fragment(std::uint64_t a, long long lda, std::uint64_t sfa,
                                                      long long sfa_stride_m, long long sfa_stride_k, std::uint64_t b,
                                                      std::uint64_t d, long long ldd, std::uint64_t masked_m, int max_m,
                                                      int expected_m, int n, int k, int num_groups, int device,
                                                      std::uint64_t stream) {
  namespace L = moe_launchers::sm90_fp8_fp4_gemm;
  const int rows = std::min(expected_m, max_m);
  MOE_HOST_ASSERT(rows >= 1 && rows <= L::kSwapAbMaxTokens,
                  "m_grouped_fp8_fp4_gemm_nt_masked_fragment: min(expected_m, max_m) must be 1.."
                      << L::kSwapAbMaxTokens << ", got " << rows);
  // The scales travel inside b: no SFB pointer.
  const L::Args args{a, sfa, b, 0, d, lda, 0, ldd, sfa_stride_m, sfa_stride_k, 0, 0,
                     max_m, num_groups, masked_m, device, stream};
  L::launch(L::get_swap_ab_config(L::GemmType::kGroupedMasked, rows, n, k, moe_jit::get_num_sms(device), num_groups,
                                  true),
            args);
}

inline void bf16_gemm_nt(std::uint64_t a, long long lda, std::uint64_t b, long long ldb, std::uint64_t d,
                         long long ldd, std::uint64_t c, int c_dtype, long long ldc, int m, int n, int k, bool compile_m,
                         int device, std::uint64_t stream) {
  namespace L = moe_launchers::sm90_bf16_gemm;
  const auto config = L::get_config(m, n, k, moe_jit::get_num_sms(device), compile_m, detail::residual_type(c_dtype));
  L::launch(config, L::Args{a, b, d, c, lda, ldb, ldd, ldc, m, device, stream});
}

// M-grouped BF16 GEMMs: B [G, N, K] with groups stacked (ldb between rows, N rows per group); contiguous
// A [M, K] and D [M, N] with m_indices int32 [M]; masked A [G, max_m, K] and D [G, max_m, N] stacked
// (lda / ldd between rows, max_m rows per group) with masked_m int32 [G].
inline void m_grouped_bf16_gemm_nt_contiguous(std::uint64_t a, std::uint64_t b, std::uint64_t d,
                                              std::uint64_t m_indices, long long lda, long long ldb, long long ldd,
                                              int m, int n, int k, int num_groups, int device, std::uint64_t stream) {
  namespace L = moe_launchers::sm90_bf16_gemm;
  const auto config = L::get_config(m, n, k, moe_jit::get_num_sms(device), false, L::Residual::kNone,
                                    L::GemmType::kGroupedContiguous, num_groups);
  L::launch(config, L::Args{a, b, d, 0, lda, ldb, ldd, 0, m, device, stream, m_indices, num_groups});
}

inline void m_grouped_bf16_gemm_nt_masked(std::uint64_t a, std::uint64_t b, std::uint64_t d, std::uint64_t masked_m,
                                          long long lda, long long ldb, long long ldd, int max_m, int expected_m,
                                          int n, int k, int num_groups, int device, std::uint64_t stream) {
  namespace L = moe_launchers::sm90_bf16_gemm;
  const auto config = L::get_config(std::min(expected_m, max_m), n, k, moe_jit::get_num_sms(device), false,
                                    L::Residual::kNone, L::GemmType::kGroupedMasked, num_groups);
  L::launch(config, L::Args{a, b, d, 0, lda, ldb, ldd, 0, max_m, device, stream, masked_m, num_groups});
}

inline void register_apis(pybind11::module_& m) {
  namespace L = moe_launchers::sm90_fp8_gemm;
  m.def("fp8_gemm_nt", &fp8_gemm_nt, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "D[M,N] (bf16) = (A*SFA) @ (B*SFB)^T (+ C) on the current stream; raw pointers and strides in elements; "
        "split_workspace: fp8_gemm_split_workspace_bytes(num_sms) bytes for the tail split (0: none)",
        pybind11::arg("a"), pybind11::arg("lda"), pybind11::arg("sfa"), pybind11::arg("sfa_stride_m"),
        pybind11::arg("sfa_stride_k"), pybind11::arg("b"), pybind11::arg("ldb"), pybind11::arg("sfb"),
        pybind11::arg("sfb_stride_n"), pybind11::arg("sfb_stride_k"), pybind11::arg("d"), pybind11::arg("ldd"),
        pybind11::arg("c"), pybind11::arg("c_dtype"), pybind11::arg("ldc"), pybind11::arg("m"), pybind11::arg("n"),
        pybind11::arg("k"), pybind11::arg("compile_m"), pybind11::arg("device"), pybind11::arg("split_workspace"),
        pybind11::arg("split_workspace_bytes"), pybind11::arg("stream"));
  m.def("bf16_gemm_nt", &bf16_gemm_nt, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "D[M,N] (bf16) = A @ B^T (+ C) for bf16 A [M,K], B [N,K]; raw pointers and strides in elements");
  m.def(
      "bf16_gemm_nt_code",
      [](int m_, int n, int k, int num_sms, bool compile_m, int c_dtype, int gemm_type, int num_groups) {
        namespace B = moe_launchers::sm90_bf16_gemm;
        const auto g = B::generate(B::get_config(m_, n, k, num_sms, compile_m, detail::residual_type(c_dtype),
                                                 detail::gemm_type(gemm_type), num_groups));
        return pybind11::make_tuple(g.name, g.code);
      },
      "(name, code) of the BF16 kernel a shape gets (no GPU needed); gemm_type 1 contiguous, 2 masked (m the "
      "expected rows per group)",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("num_sms"),
      pybind11::arg("compile_m") = false, pybind11::arg("c_dtype") = -1, pybind11::arg("gemm_type") = 0,
      pybind11::arg("num_groups") = 1);
  m.def(
      "bf16_gemm_nt_config",
      [](int m_, int n, int k, int num_sms, int gemm_type, int num_groups) {
        namespace B = moe_launchers::sm90_bf16_gemm;
        const auto c = B::get_config(m_, n, k, num_sms, false, B::Residual::kNone, detail::gemm_type(gemm_type),
                                     num_groups);
        pybind11::dict out;
        out["block_m"] = c.tiles.block_m;
        out["block_n"] = c.tiles.block_n;
        out["num_stages"] = c.tiles.num_stages;
        out["smem_bytes"] = c.tiles.smem_bytes;
        out["swizzle_d"] = c.tiles.swizzle_d;
        return out;
      },
      "the BF16 heuristic's tiles for a shape (no GPU needed); gemm_type as bf16_gemm_nt_code's",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("num_sms"),
      pybind11::arg("gemm_type") = 0, pybind11::arg("num_groups") = 1);
  // The m-grouped BF16 GEMMs: raw pointers (A, B, D, m_indices or masked_m), then strides in elements.
  const auto gil_free = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("m_grouped_bf16_gemm_nt_contiguous", &m_grouped_bf16_gemm_nt_contiguous, gil_free,
        "grouped D = A @ B[g]^T (bf16) over contiguous row blocks (m_indices)");
  m.def("m_grouped_bf16_gemm_nt_masked", &m_grouped_bf16_gemm_nt_masked, gil_free,
        "grouped D[g] = A[g] @ B[g]^T (bf16) over the first masked_m[g] rows");
  m.def("m_grouped_fp8_gemm_nt_contiguous", &m_grouped_fp8_gemm_nt_contiguous,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "grouped D = A @ B[g]^T over contiguous row blocks (m_indices); raw pointers, strides in elements; "
        "workspace: fp8_gemm_split_workspace_bytes(num_sms) bytes, where A's scales are copied MN-major (0: none)");
  m.def("m_grouped_fp8_gemm_nt_masked", &m_grouped_fp8_gemm_nt_masked,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "grouped D[g] = A[g] @ B[g]^T over the first masked_m[g] rows; raw pointers, strides in elements");
  m.def("m_grouped_fp8_gemm_nt_swiglu_contiguous", &m_grouped_fp8_gemm_nt_swiglu_contiguous,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "grouped act = SwiGLU(A @ B[g]^T) x weight, quantized 1 x 128, over contiguous row blocks (m_indices); "
        "B gate/up interleaved; raw pointers, strides in elements");
  m.def("m_grouped_fp8_gemm_nt_swiglu_masked", &m_grouped_fp8_gemm_nt_swiglu_masked,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "grouped act[g] = SwiGLU(A[g] @ B[g]^T) x weight, quantized 1 x 128, over the first masked_m[g] rows; "
        "B gate/up interleaved; raw pointers, strides in elements");
  m.def(
      "fp8_gemm_nt_swiglu_code",
      [](int m_, int n, int k, int num_sms, int gemm_type, int num_groups, int scale_load) {
        const auto cfg = L::get_swiglu_config(m_, n, k, num_sms, detail::gemm_type(gemm_type), num_groups,
                                              detail::scale_load(scale_load, k, gemm_type));
        const auto g = L::generate(cfg);
        return pybind11::make_tuple(g.name, g.code, detail::config_dict(cfg, m_));
      },
      "(name, code, config) of the SwiGLU-epilogue kernel a grouped shape gets (gemm_type 1 contiguous, 2 masked with "
      "m the expected rows per group; scale_load as fp8_gemm_nt_config's; no GPU needed)",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("num_sms"), pybind11::arg("gemm_type"),
      pybind11::arg("num_groups"), pybind11::arg("scale_load") = -1);
  m.def("m_grouped_fp8_fp4_gemm_nt_contiguous", &m_grouped_fp8_fp4_gemm_nt_contiguous,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "grouped D = A @ B[g]^T (B packed E2M1, UE8M0 1x32 scales) over contiguous row blocks; raw pointers");
  m.def("m_grouped_fp8_fp4_gemm_nt_masked", &m_grouped_fp8_fp4_gemm_nt_masked,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "grouped D[g] = A[g] @ B[g]^T (B packed E2M1, UE8M0 1x32 scales) over the first masked_m[g] rows");
  // gemm_type: 1 contiguous, 2 masked (m = expected rows per group).
  m.def(
      "fp8_fp4_gemm_nt_code",
      [](int m_, int n, int k, int num_sms, int gemm_type, int num_groups) {
        namespace F = moe_launchers::sm90_fp8_fp4_gemm;
        const auto cfg = F::get_config(m_, n, k, num_sms, detail::gemm_type(gemm_type), num_groups);
        const auto g = F::generate(cfg);
        pybind11::dict d;
        d["block_m"] = cfg.block_m;
        d["block_n"] = cfg.block_n;
        d["num_stages"] = cfg.num_stages;
        d["smem_bytes"] = cfg.smem_bytes;
        d["swizzle_d"] = cfg.swizzle_d;
        d["scale_warps"] = cfg.scale_warps;
        d["multicast"] = cfg.multicast;
        d["gather_chunk"] = cfg.gather_chunk;
        return pybind11::make_tuple(g.name, g.code, d);
      },
      "(name, code, config) of the FP8 x FP4 kernel a grouped shape gets (no GPU needed)", pybind11::arg("m"),
      pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("num_sms"), pybind11::arg("gemm_type"),
      pybind11::arg("num_groups"));
  m.def("m_grouped_fp8_fp4_gemm_nt_masked_fragment", &m_grouped_fp8_fp4_gemm_nt_masked_fragment,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "masked FP8 x FP4 GEMM with weights and scales in the fragment layout (kernels/_fp4_fragment.py)");
  m.def(
      "fp8_fp4_gemm_nt_swap_ab_code",
      [](int expected_m, int n, int k, int num_sms, int num_groups, bool fragment_layout, int gemm_type) {
        namespace F = moe_launchers::sm90_fp8_fp4_gemm;
        const auto cfg = F::get_swap_ab_config(detail::gemm_type(gemm_type), expected_m, n, k, num_sms, num_groups,
                                               fragment_layout);
        const auto g = F::generate(cfg);
        pybind11::dict d;
        d["block_t"] = cfg.block_t;
        d["block_w"] = cfg.block_w();
        d["k_blocks"] = cfg.k_blocks;
        d["num_stages"] = cfg.num_stages;
        d["smem_bytes"] = cfg.smem_bytes;
        d["block_ref"] = cfg.block_ref;
        return pybind11::make_tuple(g.name, g.code, d);
      },
      "(name, code, config) of the swapped FP8 x FP4 kernel (gemm_type 2 masked: expected_m up to 32 in the "
      "decode layout, any on packed weights; 1 contiguous: expected_m = the rows of A; no GPU needed)",
      pybind11::arg("expected_m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("num_sms"),
      pybind11::arg("num_groups"), pybind11::arg("fragment_layout") = false, pybind11::arg("gemm_type") = 2);
  m.attr("FP8_FP4_STAGED_MIN_ROWS") = moe_launchers::sm90_fp8_fp4_gemm::kStagedMinRows;
  m.def(
      "fp8_fp4_gemm_nt_uses_swap_ab",
      [](int m_, int n, int k, int num_sms, int gemm_type, int num_groups) {
        namespace F = moe_launchers::sm90_fp8_fp4_gemm;
        return F::get_plan(detail::gemm_type(gemm_type), m_, n, k, num_sms, num_groups).swap_ab;
      },
      "whether an FP8 x FP4 call on packed weights runs the swapped kernel (else fp8_fp4_gemm_nt_code's converter "
      "kernel); m: the rows of A (contiguous) or expected rows per group (masked)",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("num_sms"), pybind11::arg("gemm_type"),
      pybind11::arg("num_groups"));
  // gemm_type: 0 dense, 1 m-grouped contiguous, 2 m-grouped masked (m = expected rows per group).
  m.def(
      "fp8_gemm_plan_misses", [] { return L::plan_memo().misses(); },
      "how many FP8 GEMM calls (and config queries) so far ran the tile heuristic instead of taking its memoized "
      "plan (for tests)");
  m.def("fp8_gemm_split_workspace_bytes", &L::split_workspace_bytes,
        "bytes of fp8_gemm_nt's workspace for a device of num_sms SMs (zeroed once, then reused on one stream): "
        "the tail split's partials and counters, then room for A's scales copied MN-major",
        pybind11::arg("num_sms"));
  m.def(
      "mn_major_sf",
      [](std::uint64_t src, long long groups, long long rows, long long k_blocks, long long src_stride_m,
         long long src_stride_k, long long src_group_stride, std::uint64_t dst, long long dst_stride,
         long long dst_group_stride, int device, std::uint64_t stream) {
        moe_launchers::mn_major_sf::launch({src, groups, rows, k_blocks, src_stride_m, src_stride_k, src_group_stride,
                                            dst, dst_stride, dst_group_stride, device, stream});
      },
      pybind11::call_guard<pybind11::gil_scoped_release>(),
      "float32 scales [groups][rows][k_blocks] (strides in elements) into dst[g][kb][r] at g * dst_group_stride + "
      "kb * dst_stride + r (SM90)",
      pybind11::arg("src"), pybind11::arg("groups"), pybind11::arg("rows"), pybind11::arg("k_blocks"),
      pybind11::arg("src_stride_m"), pybind11::arg("src_stride_k"), pybind11::arg("src_group_stride"),
      pybind11::arg("dst"), pybind11::arg("dst_stride"), pybind11::arg("dst_group_stride"), pybind11::arg("device"),
      pybind11::arg("stream"));
  m.def(
      "mn_major_sf_code", [] { return pybind11::make_tuple(moe_launchers::mn_major_sf::kFn, moe_launchers::mn_major_sf::code()); },
      "(name, code) of the MN-major scale copy kernel (no GPU needed)");
  m.def(
      "fp8_gemm_nt_config",
      [](int m_, int n, int k, int num_sms, bool compile_m, int c_dtype, int gemm_type, int num_groups,
         int alignment, bool split_workspace, int scale_load) {
        const auto cfg = L::get_config(m_, n, k, num_sms, compile_m, detail::residual_type(c_dtype),
                                       detail::gemm_type(gemm_type), num_groups, alignment, split_workspace,
                                       detail::scale_load(scale_load, k, gemm_type));
        return detail::config_dict(cfg, m_);
      },
      "the heuristic's choice for a shape (no GPU needed); alignment: the contiguous layout's; "
      "split_workspace=False: a call inside a CUDA graph capture (tiles planned whole); scale_load: -1 for "
      "contiguous K-major scales, else 0 gather, 1 TMA with MN-major A scales, 2 TMA K-major",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("num_sms"),
      pybind11::arg("compile_m") = false, pybind11::arg("c_dtype") = -1, pybind11::arg("gemm_type") = 0,
      pybind11::arg("num_groups") = 1, pybind11::arg("alignment") = 128, pybind11::arg("split_workspace") = true,
      pybind11::arg("scale_load") = -1);
  m.def(
      "fp8_gemm_scale_load",
      [](int gemm_type, int m_, int n, int k, int num_groups, std::uint64_t sfa, long long sfa_stride_m,
         long long sfa_stride_k, std::uint64_t sfb, long long sfb_stride_g, long long sfb_stride_n,
         long long sfb_stride_k) {
        L::Args args{};
        args.sfa = sfa;
        args.sfa_stride_m = sfa_stride_m;
        args.sfa_stride_k = sfa_stride_k;
        args.sfb = sfb;
        args.sfb_stride_g = sfb_stride_g;
        args.sfb_stride_n = sfb_stride_n;
        args.sfb_stride_k = sfb_stride_k;
        args.m = m_;
        args.num_groups = num_groups;
        return detail::scale_load_name(L::scale_load_for(detail::gemm_type(gemm_type), args, n, k));
      },
      "how a launch with these scales (addresses, strides in elements) gets them: gather, tma_mn_major or "
      "tma_k_major (no GPU needed; m is max_m for masked GEMMs)",
      pybind11::arg("gemm_type"), pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"),
      pybind11::arg("num_groups"), pybind11::arg("sfa"), pybind11::arg("sfa_stride_m"), pybind11::arg("sfa_stride_k"),
      pybind11::arg("sfb"), pybind11::arg("sfb_stride_g"), pybind11::arg("sfb_stride_n"),
      pybind11::arg("sfb_stride_k"));
  m.def(
      "fp8_gemm_nt_code",
      [](int m_, int n, int k, int num_sms, bool compile_m, int c_dtype, int gemm_type, int num_groups,
         int alignment, bool split_workspace, int scale_load) {
        const auto plan = [&](unsigned load) {
          return L::get_config(m_, n, k, num_sms, compile_m, detail::residual_type(c_dtype),
                               detail::gemm_type(gemm_type), num_groups, alignment, split_workspace, load);
        };
        const auto config = plan(detail::scale_load(scale_load, k, gemm_type));
        // The kernel that runs on the copy of A's scales (B's scales contiguous, as scale_load -1 assumes).
        const auto g = L::generate(config.sfa_copy ? plan(moe_kernels::kScaleTmaMnMajor) : config);
        return pybind11::make_tuple(g.name, g.code);
      },
      "(name, code) of the kernel a shape gets (no GPU needed)", pybind11::arg("m"), pybind11::arg("n"),
      pybind11::arg("k"), pybind11::arg("num_sms"), pybind11::arg("compile_m") = false,
      pybind11::arg("c_dtype") = -1, pybind11::arg("gemm_type") = 0, pybind11::arg("num_groups") = 1,
      pybind11::arg("alignment") = 128, pybind11::arg("split_workspace") = true, pybind11::arg("scale_load") = -1);
}

}  // namespace moe_apis::gemm
