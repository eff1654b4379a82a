#pragma once
// pybind entry points of the MoE data-movement kernels (combine). Tensors arrive as raw integers;
// kernels/moe.py validates them first.
#include <cstdint>

#include <pybind11/pybind11.h>

#include "launchers/moe_combine.hpp"

namespace moe_apis::moe {

inline void moe_combine(std::uint64_t src, long long num_src_rows, std::uint64_t rows, std::uint64_t routed,
                        std::uint64_t out, long long num_tokens, int top_k, int hidden, bool float_out, int device,
                        std::uint64_t stream) {
  namespace L = moe_launchers::moe_combine;
  L::launch(L::get_config(top_k, hidden, float_out), {src, num_src_rows, rows, routed, out, num_tokens, device, stream});
}

inline void register_apis(pybind11::module_& m) {
  m.def("moe_combine", &moe_combine, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "out[t] = sum over j of src[rows[t * k + j]] where routed[t, j], float32 in slot order, rounded once "
        "(rows, routed: 0 for the identity and all routed)");
  m.def(
      "moe_combine_code",
      [](int top_k, int hidden, bool float_out) {
        namespace L = moe_launchers::moe_combine;
        const auto g = L::generate(L::get_config(top_k, hidden, float_out));
        return pybind11::make_tuple(g.name, g.code);
      },
      "(name, code) of the combine kernel (no GPU needed)", pybind11::arg("top_k"), pybind11::arg("hidden"),
      pybind11::arg("float_out"));
}

}  // namespace moe_apis::moe
