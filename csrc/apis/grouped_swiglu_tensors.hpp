#pragma once
// The SwiGLU GEMM's entry points that take torch tensors (the fast argument path of
// kernels/grouped_swiglu.py); defined in grouped_swiglu_tensors.cpp.
#include <pybind11/pybind11.h>

namespace moe_apis::grouped_swiglu_tensors {

// Registers the fast entry points on `m`; kernels._C.JitError must be registered already.
void register_apis(pybind11::module_& m);

}  // namespace moe_apis::grouped_swiglu_tensors
