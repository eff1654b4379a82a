#pragma once
// Reading torch tensors' metadata in C++ for the entry points' fast argument paths: one call's
// Python checks read ~25 tensor attributes (3-4 us on the H200's host, as much as the launch);
// here they cost tens of nanoseconds. Only the sources that define the fast paths include torch
// (gemm_tensors.cpp, grouped_swiglu_tensors.cpp).
//
// Nothing here may throw: _C carries its own hidden libstdc++, so an exception from libtorch
// must never unwind through it. Every accessor used is one that cannot throw for the tensors let
// through, and anything unusual is declined (the Python path, with its messages, then runs).
#include <climits>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include <Python.h>
#include <pybind11/pybind11.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/COW.h>
#include <torch/csrc/autograd/python_variable.h>

#include "jit/exception.hpp"

namespace moe_apis::tensor_args {

// One tensor as the launchers see it; `dim` at most kMaxDim (the decode layout's weights have 4).
constexpr int kMaxDim = 4;
struct View {
  std::uint64_t ptr = 0;
  std::int64_t size[kMaxDim] = {0, 0, 0, 0};
  std::int64_t stride[kMaxDim] = {0, 0, 0, 0};
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int device = -1;
};

// Whether torch would let an in-place op write the tensor without recording it: not one requiring
// grad with grad mode on, nor an inference tensor outside inference mode (kernels/_checks.py's
// writable, which names the refusal).
inline bool writable_in_place(const c10::TensorImpl* impl) {
  if (c10::GradMode::is_enabled() && impl->requires_grad()) return false;
  return c10::InferenceMode::is_enabled() || !const_cast<c10::TensorImpl*>(impl)->is_inference();
}

// A plain strided CUDA tensor of `dim` dimensions (torch.Tensor or nn.Parameter, not a subclass:
// those may redefine what their storage means; not a lazily negated or conjugated view, whose
// memory is not the values it shows), or false. `written`: the kernel writes through
// the pointer, so a copy-on-write storage (shared until materialized) and a tensor torch would not
// let an in-place op write (writable_in_place) are declined. `any_device`
// also takes CPU tensors (device -1): the tests compare these checks with the Python ones on CPU.
inline bool read(PyObject* obj, int dim, bool written, bool any_device, View& out) {
  if (obj == nullptr || THPVariableClass == nullptr || !THPVariable_CheckExact(obj)) return false;
  const c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  if (impl == nullptr || !(impl->is_cuda() || (any_device && impl->is_cpu())) || impl->layout() != c10::kStrided ||
      impl->is_nested() || impl->is_neg() || impl->is_conj() || impl->is_python_dispatch() ||
      impl->has_symbolic_sizes_strides() || impl->key_set().has(c10::DispatchKey::Functionalize) ||
      !impl->has_storage() || !impl->dtype_initialized() ||
      !impl->dtype().isScalarType() || dim > kMaxDim || impl->dim() != dim) {
    return false;
  }
  const c10::IntArrayRef sizes = impl->sizes();
  const c10::IntArrayRef strides = impl->strides();
  std::int64_t numel = 1;
  for (int i = 0; i < dim; ++i) {
    out.size[i] = sizes[i];
    out.stride[i] = strides[i];
    numel *= sizes[i];
  }
  c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr) return false;
  const c10::DataPtr& data = storage->_mutable_data_ptr_no_checks();
  if (written && (c10::impl::cow::is_cow_data_ptr(data) || !writable_in_place(impl))) return false;
  // As Tensor.data_ptr(): 0 for an empty tensor.
  out.ptr = numel == 0 ? 0
                       : reinterpret_cast<std::uint64_t>(static_cast<const char*>(data.get()) +
                                                         impl->itemsize() * impl->storage_offset());
  out.dtype = impl->dtype().toScalarType();
  out.device = impl->is_cuda() ? impl->device().index() : -1;
  return true;
}

// The two items of a pair (a tuple or list of two), or false.
inline bool pair_items(PyObject* obj, PyObject* (&items)[2]) {
  if (PyTuple_CheckExact(obj) && PyTuple_GET_SIZE(obj) == 2) {
    items[0] = PyTuple_GET_ITEM(obj, 0);
    items[1] = PyTuple_GET_ITEM(obj, 1);
  } else if (PyList_CheckExact(obj) && PyList_GET_SIZE(obj) == 2) {
    items[0] = PyList_GET_ITEM(obj, 0);
    items[1] = PyList_GET_ITEM(obj, 1);
  } else {
    return false;
  }
  return true;
}

// A pair of plain CUDA tensors of `dim` dimensions (`second_dim` for the second where given);
// `written`: the kernel writes both.
inline bool read_pair(PyObject* obj, int dim, bool any_device, View& first, View& second, bool written = false,
                      int second_dim = 0) {
  PyObject* items[2];
  return pair_items(obj, items) && read(items[0], dim, written, any_device, first) &&
         read(items[1], second_dim > 0 ? second_dim : dim, written, any_device, second);
}

// The grouped GEMMs' A [.., M, K] (K-major rows of a 16-byte multiple, at least K apart) and its 1 x 128
// scales SFA [.., M, K/128] (any non-negative strides), read at row dimension `r`.
inline bool a_operand(const View& a, const View& sfa, int r, std::int64_t m, std::int64_t k) {
  return a.stride[r + 1] == 1 && a.stride[r] % 16 == 0 && a.stride[r] >= k && sfa.size[r] == m &&
         sfa.size[r + 1] == k / 128 && sfa.stride[r] >= 0 && sfa.stride[r + 1] >= 0;
}

// An exact Python int (not a bool) in `out`, or false.
inline bool read_int(PyObject* obj, long long& out) {
  if (!PyLong_CheckExact(obj)) return false;
  out = PyLong_AsLongLong(obj);
  if (out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// expected_m as grouped.py takes it: an int (not a bool), positive, below 2^31.
inline bool read_expected_m(PyObject* obj, long long& out) {
  return read_int(obj, out) && out > 0 && out <= INT_MAX;
}

// kernels._C.JitError, for the fast paths' launch errors (set once by set_jit_error_type).
inline PyObject*& jit_error_type() {
  static PyObject* type = nullptr;
  return type;
}

inline void set_jit_error_type(pybind11::module_& m) {
  if (jit_error_type() == nullptr) {
    jit_error_type() = m.attr("JitError").ptr();
    Py_INCREF(jit_error_type());
  }
}

// Runs `launch` without the GIL; a launcher's error becomes kernels._C.JitError (RuntimeError for
// any other exception), as through the pybind11 entry points. Returns True, or null with the error set.
template <typename Launch>
inline PyObject* launch_released(Launch&& launch) {
  std::string error;
  PyObject* error_type = nullptr;
  PyThreadState* state = PyEval_SaveThread();
  try {
    launch();
  } catch (const moe_jit::JitError& e) {
    error = e.what();
    error_type = jit_error_type();
  } catch (const std::exception& e) {
    error = e.what();
    error_type = PyExc_RuntimeError;
  }
  PyEval_RestoreThread(state);
  if (error_type != nullptr) {
    PyErr_SetString(error_type, error.c_str());
    return nullptr;
  }
  Py_RETURN_TRUE;
}

// A METH_FASTCALL entry of a module's method table.
#define MOE_FASTCALL(fn, doc) \
  {#fn, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)), METH_FASTCALL, doc}

// Adds the methods of `table` to `m`.
template <std::size_t kCount>
inline void add_methods(pybind11::module_& m, PyMethodDef (&table)[kCount]) {
  for (PyMethodDef& def : table) {
    m.add_object(def.ml_name, pybind11::reinterpret_steal<pybind11::object>(PyCFunction_NewEx(&def, nullptr, nullptr)));
  }
}

// kernels/_descriptors.py's DTYPE_CODES for the residual C (bf16 or fp32), -1 otherwise.
inline int residual_code(c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Float) return 0;
  if (dtype == c10::ScalarType::BFloat16) return 1;
  return -1;
}

}  // namespace moe_apis::tensor_args
