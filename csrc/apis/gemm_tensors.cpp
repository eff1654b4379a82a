// kernels.fp8_gemm_nt's checks (kernels/gemm.py's _launch_args, mirrored one for one) read from
// the tensors themselves, and the launch, in one call from Python. A call these checks decline
// (a bad argument, a CPU tensor, a tensor subclass) returns False and the Python path runs as
// before: its messages, its CPU reference. The tests compare both checks on CPU tensors.
#include "apis/tensor_args.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <exception>
#include <string>

#include "apis/gemm.hpp"
#include "apis/gemm_tensors.hpp"
#include "jit/exception.hpp"

namespace moe_apis::gemm_tensors {
namespace {

namespace T = moe_apis::tensor_args;
using c10::ScalarType;
using T::launch_released;
using T::read_expected_m;
using T::read_int;

constexpr std::int64_t kBlock = 128;
// The kernels' scale offsets and C's row stride are 32-bit.
constexpr std::int64_t kSpan = std::int64_t{1} << 32;

struct Fp8GemmArgs {
  T::View a, sfa, b, sfb, d;
  std::uint64_t c = 0;
  int c_code = -1;
  std::int64_t ldc = 0;
};

bool fp8_gemm_args(PyObject* a, PyObject* b, PyObject* d, PyObject* c, bool any_device, Fp8GemmArgs& out) {
  if (!T::read_pair(a, 2, any_device, out.a, out.sfa) || !T::read_pair(b, 2, any_device, out.b, out.sfb) ||
      !T::read(d, 2, true, any_device, out.d)) {
    return false;
  }
  const T::View &at = out.a, &sfa = out.sfa, &bt = out.b, &sfb = out.sfb, &dt = out.d;
  if (at.dtype != ScalarType::Float8_e4m3fn || bt.dtype != ScalarType::Float8_e4m3fn ||
      sfa.dtype != ScalarType::Float || sfb.dtype != ScalarType::Float || dt.dtype != ScalarType::BFloat16) {
    return false;
  }
  const std::int64_t m = at.size[0], k = at.size[1], n = bt.size[0], kb = k / kBlock;
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX) return false;
  if (k == 0 || k % kBlock != 0 || n == 0 || n % 8 != 0 || bt.size[1] != k || dt.size[0] != m || dt.size[1] != n ||
      sfa.size[0] != m || sfa.size[1] != kb || sfb.size[0] != (n + kBlock - 1) / kBlock || sfb.size[1] != kb ||
      at.stride[1] != 1 || at.stride[0] % 16 != 0 || at.stride[0] < k || bt.stride[1] != 1 ||
      bt.stride[0] % 16 != 0 || bt.stride[0] < k || dt.stride[1] != 1 || dt.stride[0] % 8 != 0 ||
      dt.stride[0] < n || sfa.stride[0] < 0 || sfa.stride[1] < 0 || sfb.stride[0] < 0 || sfb.stride[1] < 0 ||
      (m - 1) * sfa.stride[0] >= kSpan || (kb - 1) * sfa.stride[1] >= kSpan ||
      ((n - 1) / kBlock) * sfb.stride[0] >= kSpan || (kb - 1) * sfb.stride[1] >= kSpan) {
    return false;
  }
  const int device = dt.device;
  if (at.device != device || bt.device != device || sfa.device != device || sfb.device != device) return false;
  if (c != Py_None) {
    T::View ct;
    if (!T::read(c, 2, false, any_device, ct)) return false;
    out.c_code = T::residual_code(ct.dtype);
    if (out.c_code < 0 || ct.size[0] != m || ct.size[1] != n || ct.stride[1] != 1 || ct.stride[0] >= kSpan ||
        ct.device != device) {
      return false;
    }
    out.c = ct.ptr;
    out.ldc = ct.stride[0];
  }
  return true;
}

// fp8_gemm_nt_tensors(a, b, d, c, compile_m, device, stream, split_workspace, split_workspace_bytes)
// -> True (launched, or M = 0: nothing to launch) or False (declined: nothing was done).
PyObject* fp8_gemm_nt_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long device = 0, stream = 0, workspace = 0, workspace_bytes = 0;
  if (nargs != 9 || !read_int(args[5], device) || !read_int(args[6], stream) || !read_int(args[7], workspace) ||
      !read_int(args[8], workspace_bytes)) {
    Py_RETURN_FALSE;
  }
  Fp8GemmArgs g;
  if (!fp8_gemm_args(args[0], args[1], args[2], args[3], false, g) || g.d.device != device) Py_RETURN_FALSE;
  const int m = static_cast<int>(g.a.size[0]);
  if (m == 0) Py_RETURN_TRUE;
  const bool compile_m = args[4] == Py_True;
  return launch_released([&] {
    gemm::fp8_gemm_nt(g.a.ptr, g.a.stride[0], g.sfa.ptr, g.sfa.stride[0], g.sfa.stride[1], g.b.ptr, g.b.stride[0],
                      g.sfb.ptr, g.sfb.stride[0], g.sfb.stride[1], g.d.ptr, g.d.stride[0], g.c, g.c_code, g.ldc, m,
                      static_cast<int>(g.b.size[0]), static_cast<int>(g.a.size[1]), compile_m,
                      static_cast<int>(device), static_cast<std::uint64_t>(workspace),
                      static_cast<std::uint64_t>(workspace_bytes), static_cast<std::uint64_t>(stream));
  });
}

// fp8_gemm_nt_args(a, b, d, c, compile_m) -> the tuple kernels.gemm._launch_args returns for the
// same arguments, or None where these checks decline; CPU tensors too (device -1). For the tests.
PyObject* fp8_gemm_nt_args(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Fp8GemmArgs g;
  if (nargs != 5 || !fp8_gemm_args(args[0], args[1], args[2], args[3], true, g)) Py_RETURN_NONE;
  return Py_BuildValue("(KLKLLKLKLLKLKiLLLLOi)", g.a.ptr, g.a.stride[0], g.sfa.ptr, g.sfa.stride[0],
                       g.sfa.stride[1], g.b.ptr, g.b.stride[0], g.sfb.ptr, g.sfb.stride[0], g.sfb.stride[1], g.d.ptr,
                       g.d.stride[0], g.c, g.c_code, g.ldc, g.a.size[0], g.b.size[0], g.a.size[1],
                       args[4] == Py_True ? Py_True : Py_False, g.d.device);
}

// The grouped FP8 GEMMs and their FP4-weight forms: kernels/grouped.py's _contiguous_launch_args
// and _masked_launch_args.
struct GroupedArgs {
  T::View a, sfa, b, sfb, d, index;
  int m = 0, n = 0, k = 0, groups = 0;  // m: rows (contiguous) or max_m (masked)
};

// FP8 weights B [G, N, K], SFB [G, ceil(N/128), K/128] as grouped.py's _fp8_weights_fast takes them.
bool fp8_weights(const T::View& b, const T::View& sfb, std::int64_t k) {
  const std::int64_t g = b.size[0], n = b.size[1];
  return g != 0 && n != 0 && n % 8 == 0 && b.size[2] == k && b.stride[2] == 1 && b.stride[1] % 16 == 0 &&
         b.stride[1] >= k && (g == 1 || b.stride[0] == n * b.stride[1]) && sfb.size[0] == g &&
         sfb.size[1] == (n + kBlock - 1) / kBlock && sfb.size[2] == k / kBlock && sfb.stride[0] >= 0 &&
         sfb.stride[1] >= 0 && sfb.stride[2] >= 0 && g <= INT_MAX && n <= INT_MAX;
}

// Packed FP4 weights B [G, N, K/2] with UE8M0 byte scales SFB [G, N, K/32] as grouped.py's
// _fp4_weights_fast takes them: float32 scales and misaligned pointers are left to the full checks.
bool fp4_weights(const T::View& b, const T::View& sfb, std::int64_t k) {
  const std::int64_t g = b.size[0], n = b.size[1];
  const bool dtypes = (b.dtype == ScalarType::Byte || b.dtype == ScalarType::Char) &&
                      (sfb.dtype == ScalarType::Byte || sfb.dtype == ScalarType::Float8_e8m0fnu);
  return dtypes && g != 0 && n != 0 && n % 8 == 0 && b.size[2] * 2 == k && b.stride[2] == 1 &&
         b.stride[1] % 16 == 0 && b.stride[1] >= k / 2 && (g == 1 || b.stride[0] == n * b.stride[1]) &&
         sfb.size[0] == g && sfb.size[1] == n && sfb.size[2] == k / 32 && sfb.stride[2] == 1 &&
         sfb.stride[1] % 4 == 0 && (g == 1 || sfb.stride[0] % 4 == 0) && b.ptr % 16 == 0 && sfb.ptr % 4 == 0 &&
         g <= INT_MAX && n <= INT_MAX;
}

// Weights in transform_fp4_for_decode's layout (kernels/_fp4_fragment.py), uint8 [G, K/128,
// ceil(N/64), kFragmentBlockBytes] contiguous and 16-byte aligned, as grouped.py's
// _fragment_weights_fast takes them (N is D's; the rows per group are checked by the caller).
constexpr std::int64_t kFragmentBlockBytes = moe_launchers::sm90_fp8_fp4_gemm::kFragmentBlockBytes;
bool fragment_weights(const T::View& b, std::int64_t k, std::int64_t n) {
  const std::int64_t g = b.size[0], kb = k / kBlock, row_blocks = (n + 63) / 64;
  return b.dtype == ScalarType::Byte && n != 0 && n % 8 == 0 && g != 0 && b.size[1] == kb &&
         b.size[2] == row_blocks && b.size[3] == kFragmentBlockBytes && b.stride[3] == 1 &&
         b.stride[2] == kFragmentBlockBytes && b.stride[1] == row_blocks * kFragmentBlockBytes &&
         b.stride[0] == kb * row_blocks * kFragmentBlockBytes && b.ptr % 16 == 0 && g <= INT_MAX && n <= INT_MAX;
}
// min(expected_m, max_m) the decode-layout kernel serves.
constexpr long long kFragmentMaxRows = moe_launchers::sm90_fp8_fp4_gemm::kSwapAbMaxTokens;

enum class Weights { kFp8, kFp4, kFragment };  // FP8, packed FP4 with byte scales, the decode layout

// `a_dim`: 2 (contiguous: A [M, K]) or 3 (masked: A [G, max_m, K]).
bool grouped_args(PyObject* const* args, int a_dim, Weights weights, bool any_device, GroupedArgs& out) {
  const bool fragment = weights == Weights::kFragment;
  if (!T::read_pair(args[0], a_dim, any_device, out.a, out.sfa) ||
      !(fragment ? T::read(args[1], 4, false, any_device, out.b)
                 : T::read_pair(args[1], 3, any_device, out.b, out.sfb)) ||
      !T::read(args[2], a_dim, true, any_device, out.d) || !T::read(args[3], 1, false, any_device, out.index)) {
    return false;
  }
  const T::View &a = out.a, &sfa = out.sfa, &b = out.b, &sfb = out.sfb, &d = out.d, &index = out.index;
  if (a.dtype != ScalarType::Float8_e4m3fn || sfa.dtype != ScalarType::Float || d.dtype != ScalarType::BFloat16 ||
      index.dtype != ScalarType::Int ||
      (weights == Weights::kFp8 && (b.dtype != ScalarType::Float8_e4m3fn || sfb.dtype != ScalarType::Float))) {
    return false;
  }
  const int r = a_dim - 2;  // the row dimension
  const std::int64_t m = a.size[r], k = a.size[r + 1], g = b.size[0], n = fragment ? d.size[r + 1] : b.size[1],
                     lda = a.stride[r], ldd = d.stride[r];
  if (m == 0 || k == 0 || k % kBlock != 0 || m > INT_MAX || k > INT_MAX) return false;
  if (!(weights == Weights::kFragment ? fragment_weights(b, k, n)
        : weights == Weights::kFp4    ? fp4_weights(b, sfb, k)
                                      : fp8_weights(b, sfb, k))) {
    return false;
  }
  if (!T::a_operand(a, sfa, r, m, k) || d.size[r] != m || d.size[r + 1] != n || d.stride[r + 1] != 1 ||
      ldd % 8 != 0 || ldd < n || index.stride[0] != 1) {
    return false;
  }
  if (a_dim == 2) {
    if (index.size[0] != m) return false;
  } else {
    const bool stacked = a.size[0] == 1 || (a.stride[0] == m * lda && sfa.stride[0] == m * sfa.stride[1] &&
                                            d.stride[0] == m * ldd);
    if (a.size[0] != g || sfa.size[0] != g || d.size[0] != g || sfa.stride[0] < 0 || !stacked ||
        index.size[0] != g) {
      return false;
    }
  }
  const int device = a.device;
  if (sfa.device != device || b.device != device || (!fragment && sfb.device != device) || d.device != device ||
      index.device != device) {
    return false;
  }
  out.m = static_cast<int>(m);
  out.n = static_cast<int>(n);
  out.k = static_cast<int>(k);
  out.groups = static_cast<int>(g);
  return true;
}

// m_grouped_fp8_gemm_nt_contiguous_tensors(a, b, d, m_indices, alignment, device, stream, workspace,
// workspace_bytes) -> bool
PyObject* m_grouped_fp8_gemm_nt_contiguous_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long alignment = 0, device = 0, stream = 0, workspace = 0, workspace_bytes = 0;
  GroupedArgs g;
  if (nargs != 9 || !read_int(args[4], alignment) || !read_int(args[5], device) || !read_int(args[6], stream) ||
      !read_int(args[7], workspace) || !read_int(args[8], workspace_bytes) || alignment <= 0 ||
      alignment > INT_MAX || !grouped_args(args, 2, Weights::kFp8, false, g) || g.d.device != device) {
    Py_RETURN_FALSE;
  }
  return launch_released([&] {
    gemm::m_grouped_fp8_gemm_nt_contiguous(g.a.ptr, g.a.stride[0], g.sfa.ptr, g.sfa.stride[0], g.sfa.stride[1],
                                           g.b.ptr, g.b.stride[1], g.sfb.ptr, g.sfb.stride[0], g.sfb.stride[1],
                                           g.sfb.stride[2], g.d.ptr, g.d.stride[0], g.index.ptr, g.m, g.n, g.k,
                                           g.groups, static_cast<int>(alignment), static_cast<int>(device),
                                           static_cast<std::uint64_t>(workspace),
                                           static_cast<std::uint64_t>(workspace_bytes),
                                           static_cast<std::uint64_t>(stream));
  });
}

// The masked entry points' arguments (a, b, d, masked_m, expected_m, device, stream), checked.
bool masked_call_args(PyObject* const* args, Py_ssize_t nargs, Weights weights, GroupedArgs& g,
                      long long& expected_m, long long& device, long long& stream) {
  return nargs == 7 && read_expected_m(args[4], expected_m) && read_int(args[5], device) &&
         read_int(args[6], stream) && grouped_args(args, 3, weights, false, g) && g.d.device == device &&
         (weights != Weights::kFragment || std::min<long long>(expected_m, g.m) <= kFragmentMaxRows);
}

// m_grouped_fp8_gemm_nt_masked_tensors(a, b, d, masked_m, expected_m, device, stream) -> bool
PyObject* m_grouped_fp8_gemm_nt_masked_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long expected_m = 0, device = 0, stream = 0;
  GroupedArgs g;
  if (!masked_call_args(args, nargs, Weights::kFp8, g, expected_m, device, stream)) Py_RETURN_FALSE;
  return launch_released([&] {
    gemm::m_grouped_fp8_gemm_nt_masked(g.a.ptr, g.a.stride[1], g.sfa.ptr, g.sfa.stride[1], g.sfa.stride[2], g.b.ptr,
                                       g.b.stride[1], g.sfb.ptr, g.sfb.stride[0], g.sfb.stride[1], g.sfb.stride[2],
                                       g.d.ptr, g.d.stride[1], g.index.ptr, g.m, static_cast<int>(expected_m), g.n,
                                       g.k, g.groups, static_cast<int>(device), static_cast<std::uint64_t>(stream));
  });
}

// m_grouped_fp8_fp4_gemm_nt_contiguous_tensors(a, b, d, m_indices, device, stream) -> bool
PyObject* m_grouped_fp8_fp4_gemm_nt_contiguous_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long device = 0, stream = 0;
  GroupedArgs g;
  if (nargs != 6 || !read_int(args[4], device) || !read_int(args[5], stream) ||
      !grouped_args(args, 2, Weights::kFp4, false, g) || g.d.device != device ||
      moe_launchers::sm90_fp8_fp4_gemm::may_stage(g.m, g.groups)) {
    Py_RETURN_FALSE;
  }
  return launch_released([&] {
    gemm::m_grouped_fp8_fp4_gemm_nt_contiguous(g.a.ptr, g.a.stride[0], g.sfa.ptr, g.sfa.stride[0], g.sfa.stride[1],
                                               g.b.ptr, g.b.stride[1], g.sfb.ptr, g.sfb.stride[0], g.sfb.stride[1],
                                               g.d.ptr, g.d.stride[0], g.index.ptr, g.m, g.n, g.k, g.groups,
                                               static_cast<int>(device), static_cast<std::uint64_t>(stream));
  });
}

// m_grouped_fp8_fp4_gemm_nt_masked_tensors(a, b, d, masked_m, expected_m, device, stream) -> bool
PyObject* m_grouped_fp8_fp4_gemm_nt_masked_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long expected_m = 0, device = 0, stream = 0;
  GroupedArgs g;
  if (!masked_call_args(args, nargs, Weights::kFp4, g, expected_m, device, stream) ||
      moe_launchers::sm90_fp8_fp4_gemm::may_stage(std::min<long long>(expected_m, g.m), 1)) {
    Py_RETURN_FALSE;
  }
  return launch_released([&] {
    gemm::m_grouped_fp8_fp4_gemm_nt_masked(g.a.ptr, g.a.stride[1], g.sfa.ptr, g.sfa.stride[1], g.sfa.stride[2],
                                           g.b.ptr, g.b.stride[1], g.sfb.ptr, g.sfb.stride[0], g.sfb.stride[1],
                                           g.d.ptr, g.d.stride[1], g.index.ptr, g.m, static_cast<int>(expected_m),
                                           g.n, g.k, g.groups, static_cast<int>(device),
                                           static_cast<std::uint64_t>(stream));
  });
}

// m_grouped_fp8_fp4_gemm_nt_masked_fragment_tensors(a, b, d, masked_m, expected_m, device, stream) -> bool
PyObject* m_grouped_fp8_fp4_gemm_nt_masked_fragment_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long expected_m = 0, device = 0, stream = 0;
  GroupedArgs g;
  if (!masked_call_args(args, nargs, Weights::kFragment, g, expected_m, device, stream)) Py_RETURN_FALSE;
  return launch_released([&] {
    gemm::m_grouped_fp8_fp4_gemm_nt_masked_fragment(g.a.ptr, g.a.stride[1], g.sfa.ptr, g.sfa.stride[1],
                                                    g.sfa.stride[2], g.b.ptr, g.d.ptr, g.d.stride[1], g.index.ptr, g.m,
                                                    static_cast<int>(expected_m), g.n, g.k, g.groups,
                                                    static_cast<int>(device), static_cast<std::uint64_t>(stream));
  });
}

// The checks alone, CPU tensors too, returning what grouped.py's fast checks return (its tuples
// end in m, n, k, G, alignment (FP8 only), device for the contiguous layout and in max_m,
// expected_m, n, k, G, device for the masked one; FP4 weights pass SFB's group and row strides).
// For the tests.
PyObject* grouped_launch_args(PyObject* const* args, Py_ssize_t nargs, bool masked, Weights weights) {
  long long extra = 0;
  GroupedArgs g;
  const bool fp8 = weights == Weights::kFp8;
  const Py_ssize_t expected_args = masked || fp8 ? 5 : 4;
  if (nargs != expected_args || (masked && !read_expected_m(args[4], extra)) ||
      (!masked && fp8 && !read_int(args[4], extra)) || !grouped_args(args, masked ? 3 : 2, weights, true, g) ||
      (weights == Weights::kFragment && std::min<long long>(extra, g.m) > kFragmentMaxRows)) {
    Py_RETURN_NONE;
  }
  const int r = masked ? 1 : 0;
  PyObject* head =
      weights == Weights::kFragment
          ? Py_BuildValue("(KLKLLKKLK)", g.a.ptr, g.a.stride[r], g.sfa.ptr, g.sfa.stride[r], g.sfa.stride[r + 1],
                          g.b.ptr, g.d.ptr, g.d.stride[r], g.index.ptr)
      : weights == Weights::kFp4
          ? Py_BuildValue("(KLKLLKLKLLKLK)", g.a.ptr, g.a.stride[r], g.sfa.ptr, g.sfa.stride[r], g.sfa.stride[r + 1],
                          g.b.ptr, g.b.stride[1], g.sfb.ptr, g.sfb.stride[0], g.sfb.stride[1], g.d.ptr, g.d.stride[r],
                          g.index.ptr)
          : Py_BuildValue("(KLKLLKLKLLLKLK)", g.a.ptr, g.a.stride[r], g.sfa.ptr, g.sfa.stride[r],
                          g.sfa.stride[r + 1], g.b.ptr, g.b.stride[1], g.sfb.ptr, g.sfb.stride[0], g.sfb.stride[1],
                          g.sfb.stride[2], g.d.ptr, g.d.stride[r], g.index.ptr);
  PyObject* tail = masked ? Py_BuildValue("(iLiiii)", g.m, extra, g.n, g.k, g.groups, g.d.device)
                   : !fp8 ? Py_BuildValue("(iiiii)", g.m, g.n, g.k, g.groups, g.d.device)
                          : Py_BuildValue("(iiiiLi)", g.m, g.n, g.k, g.groups, extra, g.d.device);
  PyObject* whole = head != nullptr && tail != nullptr ? PySequence_Concat(head, tail) : nullptr;
  Py_XDECREF(head);
  Py_XDECREF(tail);
  return whole;
}

PyObject* m_grouped_fp8_gemm_nt_contiguous_args(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return grouped_launch_args(args, nargs, false, Weights::kFp8);
}

PyObject* m_grouped_fp8_gemm_nt_masked_args(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return grouped_launch_args(args, nargs, true, Weights::kFp8);
}

PyObject* m_grouped_fp8_fp4_gemm_nt_contiguous_args(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return grouped_launch_args(args, nargs, false, Weights::kFp4);
}

PyObject* m_grouped_fp8_fp4_gemm_nt_masked_args(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return grouped_launch_args(args, nargs, true, Weights::kFp4);
}

PyObject* m_grouped_fp8_fp4_gemm_nt_masked_fragment_args(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return grouped_launch_args(args, nargs, true, Weights::kFragment);
}

PyMethodDef kMethods[] = {
    MOE_FASTCALL(fp8_gemm_nt_tensors,
                 "fp8_gemm_nt_tensors(a, b, d, c, compile_m, device, stream, split_workspace, split_workspace_bytes)"
                 " -> bool: kernels.fp8_gemm_nt's checks on the tensors and the launch; False (nothing done) where "
                 "they decline"),
    MOE_FASTCALL(fp8_gemm_nt_args, "fp8_gemm_nt_args(a, b, d, c, compile_m) -> the launch arguments, or None"),
    MOE_FASTCALL(m_grouped_fp8_gemm_nt_contiguous_tensors,
                 "m_grouped_fp8_gemm_nt_contiguous_tensors(a, b, d, m_indices, alignment, device, stream, workspace, "
                 "workspace_bytes) -> bool"),
    MOE_FASTCALL(m_grouped_fp8_gemm_nt_masked_tensors,
                 "m_grouped_fp8_gemm_nt_masked_tensors(a, b, d, masked_m, expected_m, device, stream) -> bool"),
    MOE_FASTCALL(m_grouped_fp8_gemm_nt_contiguous_args,
                 "m_grouped_fp8_gemm_nt_contiguous_args(a, b, d, m_indices, alignment) -> the launch arguments, "
                 "or None"),
    MOE_FASTCALL(m_grouped_fp8_gemm_nt_masked_args,
                 "m_grouped_fp8_gemm_nt_masked_args(a, b, d, masked_m, expected_m) -> the launch arguments, or None"),
    MOE_FASTCALL(m_grouped_fp8_fp4_gemm_nt_contiguous_tensors,
                 "m_grouped_fp8_fp4_gemm_nt_contiguous_tensors(a, b, d, m_indices, device, stream) -> bool"),
    MOE_FASTCALL(m_grouped_fp8_fp4_gemm_nt_masked_tensors,
                 "m_grouped_fp8_fp4_gemm_nt_masked_tensors(a, b, d, masked_m, expected_m, device, stream) -> bool"),
    MOE_FASTCALL(m_grouped_fp8_fp4_gemm_nt_contiguous_args,
                 "m_grouped_fp8_fp4_gemm_nt_contiguous_args(a, b, d, m_indices) -> the launch arguments, or None"),
    MOE_FASTCALL(m_grouped_fp8_fp4_gemm_nt_masked_args,
                 "m_grouped_fp8_fp4_gemm_nt_masked_args(a, b, d, masked_m, expected_m) -> the launch arguments, "
                 "or None"),
    MOE_FASTCALL(m_grouped_fp8_fp4_gemm_nt_masked_fragment_tensors,
                 "m_grouped_fp8_fp4_gemm_nt_masked_fragment_tensors(a, b, d, masked_m, expected_m, device, stream) "
                 "-> bool"),
    MOE_FASTCALL(m_grouped_fp8_fp4_gemm_nt_masked_fragment_args,
                 "m_grouped_fp8_fp4_gemm_nt_masked_fragment_args(a, b, d, masked_m, expected_m) -> the launch "
                 "arguments, or None"),
};

}  // namespace

void register_apis(pybind11::module_& m) {
  // The torch these entry points read tensors of; another one may lay TensorImpl out otherwise.
  m.attr("tensor_api_torch_version") = MOE_TORCH_VERSION;
  T::set_jit_error_type(m);
  T::add_methods(m, kMethods);
}

}  // namespace moe_apis::gemm_tensors
