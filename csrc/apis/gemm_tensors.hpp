#pragma once
// The GEMM entry points that take torch tensors (the fast argument paths of kernels/gemm.py);
// defined in gemm_tensors.cpp (torch's headers are included by the fast paths' sources only).
#include <pybind11/pybind11.h>

namespace moe_apis::gemm_tensors {

// Registers the fast entry points on `m`; kernels._C.JitError must be registered already.
void register_apis(pybind11::module_& m);

}  // namespace moe_apis::gemm_tensors
