// kernels._C: the JIT engine, the device runtime and each kernel domain's entry points.
#include <pybind11/pybind11.h>

#include "apis/gemm.hpp"
#include "apis/gemm_tensors.hpp"
#include "apis/grouped_swiglu_tensors.hpp"
#include "apis/moe.hpp"
#include "apis/quant.hpp"
#include "apis/runtime.hpp"

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_runtime kernel library: JIT engine, device runtime and kernel entry points";
  moe_apis::runtime::register_apis(m);
  moe_apis::quant::register_apis(m);
  moe_apis::gemm::register_apis(m);
  moe_apis::gemm_tensors::register_apis(m);
  moe_apis::grouped_swiglu_tensors::register_apis(m);
  moe_apis::moe::register_apis(m);
}
