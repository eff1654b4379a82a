// kernels/grouped_swiglu.py's checks (its _contiguous_call and _masked_call, mirrored one for one)
// read from the tensors themselves, and the launch of the L1 GEMM with the SwiGLU epilogue, in one
// call from Python: the Python checks cost a call ~26 us on the H200's host (bench/RESULTS.md,
// session 39). A call these checks decline (a bad argument, a CPU tensor, a tensor subclass) returns
// False and the Python path runs as before: its messages, its CPU reference. The tests compare both
// checks on CPU tensors (tests/kernels/test_grouped_swiglu_args.py).
#include "apis/tensor_args.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "apis/gemm.hpp"
#include "apis/grouped_swiglu_tensors.hpp"

namespace moe_apis::grouped_swiglu_tensors {
namespace {

namespace T = moe_apis::tensor_args;
using c10::ScalarType;

constexpr std::int64_t kBlock = 128;

struct SwiGluArgs {
  T::View a, sfa, b, sfb, act, act_sf, index, weights;
  int m = 0, n = 0, k = 0, groups = 0;  // m: rows (contiguous) or max_m (masked); n: 2I
};

// torch's is_contiguous: each dimension's stride the product of the later sizes, size-1 dims aside.
bool contiguous(const T::View& t, int dim) {
  std::int64_t expected = 1;
  for (int i = dim - 1; i >= 0; --i) {
    if (t.size[i] == 0) return true;
    if (t.size[i] != 1 && t.stride[i] != expected) return false;
    expected *= t.size[i];
  }
  return true;
}

// grouped_swiglu._rows_apart: `rows` rows of the scales (at its second-to-last stride) by its last
// dimension address distinct elements.
bool rows_apart(const T::View& sf, int dim, std::int64_t rows) {
  const std::int64_t groups = sf.size[dim - 1], stride_m = sf.stride[dim - 2], stride_k = sf.stride[dim - 1];
  if (rows <= 1 || groups <= 1) return std::min(rows > 1 ? stride_m : 1, groups > 1 ? stride_k : 1) >= 1;
  const bool m_inner = stride_m < stride_k || (stride_m == stride_k && rows <= groups);
  const std::int64_t inner = m_inner ? stride_m : stride_k, inner_n = m_inner ? rows : groups,
                     outer = m_inner ? stride_k : stride_m;
  return inner >= 1 && outer >= inner * inner_n;
}

// args: (a, b, d, index, weights) with a_dim 2 (contiguous) or 3 (masked).
bool swiglu_args(PyObject* a_obj, PyObject* b_obj, PyObject* d_obj, PyObject* index_obj, PyObject* weights_obj,
                 int a_dim, bool any_device, SwiGluArgs& out) {
  // SFB is 4-D: [G, 2I/128, 2, K/128].
  if (!T::read_pair(a_obj, a_dim, any_device, out.a, out.sfa) ||
      !T::read_pair(b_obj, 3, any_device, out.b, out.sfb, false, 4)) {
    return false;
  }
  if (!T::read_pair(d_obj, a_dim, any_device, out.act, out.act_sf, true) ||
      !T::read(index_obj, 1, false, any_device, out.index) ||
      !T::read(weights_obj, a_dim - 1, false, any_device, out.weights)) {
    return false;
  }
  const T::View &a = out.a, &sfa = out.sfa, &b = out.b, &sfb = out.sfb, &act = out.act, &act_sf = out.act_sf,
                &index = out.index, &weights = out.weights;
  if (a.dtype != ScalarType::Float8_e4m3fn || sfa.dtype != ScalarType::Float || b.dtype != ScalarType::Float8_e4m3fn ||
      sfb.dtype != ScalarType::Float || act.dtype != ScalarType::Float8_e4m3fn || act_sf.dtype != ScalarType::Float ||
      index.dtype != ScalarType::Int || weights.dtype != ScalarType::Float) {
    return false;
  }
  const int r = a_dim - 2;  // the row dimension
  const std::int64_t m = a.size[r], k = a.size[r + 1], g = b.size[0], n = b.size[1], inter = n / 2,
                     groups = a_dim == 3 ? a.size[0] : 1, rows = groups * m;
  if (m == 0 || k == 0 || k % kBlock != 0 || m > INT_MAX || k > INT_MAX || g == 0 || g > INT_MAX || n == 0 ||
      n % (2 * kBlock) != 0 || n > INT_MAX) {
    return false;
  }
  // A (and masked: stacked groups), SFA.
  if (!T::a_operand(a, sfa, r, m, k)) return false;
  if (a_dim == 3 && (sfa.size[0] != groups || sfa.stride[0] < 0 || groups != g ||
                     (groups > 1 && (a.stride[0] != m * a.stride[1] || sfa.stride[0] != m * sfa.stride[1])))) {
    return false;
  }
  // B [G, 2I, K] K-major, groups stacked; SFB [G, 2I/128, 2, K/128], a block's halves adjacent rows.
  if (b.size[2] != k || b.stride[2] != 1 || b.stride[1] % 16 != 0 || b.stride[1] < k ||
      (g > 1 && b.stride[0] != n * b.stride[1]) || sfb.size[0] != g || sfb.size[1] != n / kBlock || sfb.size[2] != 2 ||
      sfb.size[3] != k / kBlock || sfb.stride[0] < 0 || sfb.stride[1] < 0 || sfb.stride[2] < 0 || sfb.stride[3] < 0 ||
      sfb.stride[1] != 2 * sfb.stride[2]) {
    return false;
  }
  // act [rows, I] (unit stride along I, an even row stride of at least I, an even address), act_sf
  // [rows, I/128], masked groups stacked, the scales' elements apart.
  for (int i = 0; i < r; ++i) {
    if (act.size[i] != groups || act_sf.size[i] != groups) return false;
  }
  if (act.size[r] != m || act.size[r + 1] != inter || act_sf.size[r] != m || act_sf.size[r + 1] != inter / kBlock ||
      act.stride[r + 1] != 1 || act.stride[r] % 2 != 0 || act.stride[r] < inter || act.ptr % 2 != 0) {
    return false;
  }
  if (a_dim == 3 && groups > 1 && (act.stride[0] != m * act.stride[1] || act_sf.stride[0] != m * act_sf.stride[1])) {
    return false;
  }
  if (!rows_apart(act_sf, a_dim, rows)) return false;
  // The index (m_indices [M] or masked_m [G]) and the rows' weights [rows] contiguous.
  if (index.size[0] != (a_dim == 3 ? g : m) || index.stride[0] != 1) return false;
  for (int i = 0; i < r; ++i) {
    if (weights.size[i] != groups) return false;
  }
  if (weights.size[r] != m || !contiguous(weights, a_dim - 1)) return false;
  const int device = a.device;
  for (const T::View* t : {&sfa, &b, &sfb, &act, &act_sf, &index, &weights}) {
    if (t->device != device) return false;
  }
  out.m = static_cast<int>(m);
  out.n = static_cast<int>(n);
  out.k = static_cast<int>(k);
  out.groups = static_cast<int>(g);
  return true;
}

// The native call's arguments in kernels/grouped_swiglu.py's order (without the stream).
void launch_swiglu(const SwiGluArgs& s, bool masked, long long expected_m, int device, std::uint64_t stream) {
  const int r = masked ? 1 : 0;
  if (masked) {
    gemm::m_grouped_fp8_gemm_nt_swiglu_masked(
        s.a.ptr, s.a.stride[r], s.sfa.ptr, s.sfa.stride[r], s.sfa.stride[r + 1], s.b.ptr, s.b.stride[1], s.sfb.ptr,
        s.sfb.stride[0], s.sfb.stride[2], s.sfb.stride[3], s.act.ptr, s.act.stride[r], s.act_sf.ptr,
        s.act_sf.stride[r], s.act_sf.stride[r + 1], s.weights.ptr, s.index.ptr, s.m, static_cast<int>(expected_m),
        s.n, s.k, s.groups, device, stream);
  } else {
    gemm::m_grouped_fp8_gemm_nt_swiglu_contiguous(
        s.a.ptr, s.a.stride[r], s.sfa.ptr, s.sfa.stride[r], s.sfa.stride[r + 1], s.b.ptr, s.b.stride[1], s.sfb.ptr,
        s.sfb.stride[0], s.sfb.stride[2], s.sfb.stride[3], s.act.ptr, s.act.stride[r], s.act_sf.ptr,
        s.act_sf.stride[r], s.act_sf.stride[r + 1], s.weights.ptr, s.index.ptr, s.m, s.n, s.k, s.groups, device,
        stream);
  }
}

// m_grouped_fp8_gemm_nt_swiglu_contiguous_tensors(a, b, d, m_indices, weights, device, stream) -> bool
PyObject* m_grouped_fp8_gemm_nt_swiglu_contiguous_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long device = 0, stream = 0;
  SwiGluArgs s;
  if (nargs != 7 || !T::read_int(args[5], device) || !T::read_int(args[6], stream) ||
      !swiglu_args(args[0], args[1], args[2], args[3], args[4], 2, false, s) || s.a.device != device) {
    Py_RETURN_FALSE;
  }
  return T::launch_released([&] {
    launch_swiglu(s, false, 0, static_cast<int>(device), static_cast<std::uint64_t>(stream));
  });
}

// m_grouped_fp8_gemm_nt_swiglu_masked_tensors(a, b, d, masked_m, expected_m, weights, device, stream) -> bool
PyObject* m_grouped_fp8_gemm_nt_swiglu_masked_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long expected_m = 0, device = 0, stream = 0;
  SwiGluArgs s;
  if (nargs != 8 || !T::read_expected_m(args[4], expected_m) || !T::read_int(args[6], device) ||
      !T::read_int(args[7], stream) || !swiglu_args(args[0], args[1], args[2], args[3], args[5], 3, false, s) ||
      s.a.device != device) {
    Py_RETURN_FALSE;
  }
  return T::launch_released([&] {
    launch_swiglu(s, true, expected_m, static_cast<int>(device), static_cast<std::uint64_t>(stream));
  });
}

// The checks alone, CPU tensors too: the native call's arguments as grouped_swiglu's _launch_args
// gives them (device last, -1 on the CPU), or None. For the tests.
PyObject* swiglu_launch_args(PyObject* const* args, Py_ssize_t nargs, bool masked) {
  long long expected_m = 0;
  SwiGluArgs s;
  if (nargs != (masked ? 6 : 5) || (masked && !T::read_expected_m(args[4], expected_m)) ||
      !swiglu_args(args[0], args[1], args[2], args[3], args[masked ? 5 : 4], masked ? 3 : 2, true, s)) {
    Py_RETURN_NONE;
  }
  const int r = masked ? 1 : 0;
  PyObject* head = Py_BuildValue("(KLKLLKLKLLLKLKLLKK)", s.a.ptr, s.a.stride[r], s.sfa.ptr, s.sfa.stride[r],
                                 s.sfa.stride[r + 1], s.b.ptr, s.b.stride[1], s.sfb.ptr, s.sfb.stride[0],
                                 s.sfb.stride[2], s.sfb.stride[3], s.act.ptr, s.act.stride[r], s.act_sf.ptr,
                                 s.act_sf.stride[r], s.act_sf.stride[r + 1], s.weights.ptr, s.index.ptr);
  PyObject* tail = masked ? Py_BuildValue("(iLiiii)", s.m, expected_m, s.n, s.k, s.groups, s.a.device)
                          : Py_BuildValue("(iiiii)", s.m, s.n, s.k, s.groups, s.a.device);
  PyObject* whole = head != nullptr && tail != nullptr ? PySequence_Concat(head, tail) : nullptr;
  Py_XDECREF(head);
  Py_XDECREF(tail);
  return whole;
}

PyObject* m_grouped_fp8_gemm_nt_swiglu_contiguous_args(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return swiglu_launch_args(args, nargs, false);
}

PyObject* m_grouped_fp8_gemm_nt_swiglu_masked_args(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return swiglu_launch_args(args, nargs, true);
}

PyMethodDef kMethods[] = {
    MOE_FASTCALL(m_grouped_fp8_gemm_nt_swiglu_contiguous_tensors,
                 "m_grouped_fp8_gemm_nt_swiglu_contiguous_tensors(a, b, d, m_indices, weights, device, stream) -> bool"),
    MOE_FASTCALL(m_grouped_fp8_gemm_nt_swiglu_masked_tensors,
                 "m_grouped_fp8_gemm_nt_swiglu_masked_tensors(a, b, d, masked_m, expected_m, weights, device, stream) "
                 "-> bool"),
    MOE_FASTCALL(m_grouped_fp8_gemm_nt_swiglu_contiguous_args,
                 "m_grouped_fp8_gemm_nt_swiglu_contiguous_args(a, b, d, m_indices, weights) -> the launch arguments, "
                 "or None"),
    MOE_FASTCALL(m_grouped_fp8_gemm_nt_swiglu_masked_args,
                 "m_grouped_fp8_gemm_nt_swiglu_masked_args(a, b, d, masked_m, expected_m, weights) -> the launch "
                 "arguments, or None"),
};

}  // namespace

void register_apis(pybind11::module_& m) {
  T::set_jit_error_type(m);
  T::add_methods(m, kMethods);
}

}  // namespace moe_apis::grouped_swiglu_tensors
