#pragma once
// pybind entry points of the FP8 quantizers. Tensors arrive as raw integers (pointers, sizes,
// strides in elements, dtype codes from dtypes.hpp, device ordinal, stream); kernels/quant.py
// validates tensors first, the checks here guard what the kernels rely on. The *_code entry
// points generate a kernel's source without touching a GPU, for the offline precompile CLI.
#include <climits>
#include <cstdint>
#include <string>
#include <utility>

#include <pybind11/pybind11.h>

#include "apis/dtypes.hpp"
#include "launchers/quant.hpp"

namespace moe_apis::quant {

namespace detail {

inline DType input_dtype(int code, const char* fn) {
  const DType dtype = static_cast<DType>(code);
  MOE_HOST_ASSERT(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                  fn << ": x_dtype must be the code of float32, bfloat16 or float16, got " << code
                     << " (" << dtype_name(dtype) << ")");
  return dtype;
}

inline int row_length(long long value, const char* fn, const char* what) {
  MOE_HOST_ASSERT(value >= 1 && value <= INT_MAX,
                  fn << ": " << what << " must be in [1, 2^31 - 1], got " << value);
  return static_cast<int>(value);
}

// An explicit vector width for the code generators; 0 picks the one a contiguous input whose
// base is 16-byte aligned gets at run time.
inline int checked_vec(int vec, int heuristic_vec, DType dtype, long long row_len, const char* fn) {
  if (vec == 0) return heuristic_vec;
  const int max_vec = moe_launchers::quant::kMaxVecBytes / moe_launchers::quant::dtype_bytes(dtype);
  MOE_HOST_ASSERT(vec > 0 && vec <= max_vec && (vec & (vec - 1)) == 0 && row_len % vec == 0,
                  fn << ": vec must be 0 or a power of two <= " << max_vec
                     << " that divides the row length " << row_len << ", got " << vec);
  return vec;
}

inline pybind11::tuple as_tuple(const moe_launchers::quant::GeneratedKernel& g) {
  return pybind11::make_tuple(g.name, g.code);
}

}  // namespace detail

inline void per_token_cast_to_fp8(std::uint64_t x, int x_dtype, long long m, long long n,
                                  long long x_row_stride, std::uint64_t out, std::uint64_t sf,
                                  long long sf_stride_m, long long sf_stride_k, int gran_k, bool use_ue8m0,
                                  int device, std::uint64_t stream) {
  constexpr const char* kFn = "per_token_cast_to_fp8";
  const DType dtype = detail::input_dtype(x_dtype, kFn);
  const int n32 = detail::row_length(n, kFn, "n");
  MOE_HOST_ASSERT(m >= 0, kFn << ": m must be >= 0, got " << m);
  // Overlapping rows (a stride below n, e.g. an expanded tensor) are fine: x is only read.
  MOE_HOST_ASSERT(x_row_stride >= 0, kFn << ": x_row_stride must be >= 0, got " << x_row_stride);
  const auto config = moe_launchers::quant::per_token_config(dtype, n32, gran_k, use_ue8m0, x,
                                                             m > 1 ? x_row_stride : 0);
  if (m == 0) return;
  MOE_HOST_ASSERT(x != 0 && out != 0 && sf != 0, kFn << ": null data pointer");
  moe_launchers::quant::per_token_launch(config, {x, x_row_stride, out, sf, sf_stride_m, sf_stride_k, m, device,
                                                  stream});
}

inline void per_block_cast_to_fp8(std::uint64_t x, int x_dtype, long long batch, long long n,
                                  long long k, long long x_batch_stride, long long x_row_stride,
                                  std::uint64_t out, std::uint64_t sf, bool use_ue8m0, int device,
                                  std::uint64_t stream) {
  constexpr const char* kFn = "per_block_cast_to_fp8";
  const DType dtype = detail::input_dtype(x_dtype, kFn);
  const int k32 = detail::row_length(k, kFn, "k");
  MOE_HOST_ASSERT(batch >= 0 && n >= 0, kFn << ": batch and n must be >= 0, got batch = " << batch
                                            << ", n = " << n);
  MOE_HOST_ASSERT(x_batch_stride >= 0 && x_row_stride >= 0,
                  kFn << ": strides must be >= 0, got x_batch_stride = " << x_batch_stride
                      << ", x_row_stride = " << x_row_stride);
  if (batch == 0 || n == 0) return;
  MOE_HOST_ASSERT(x != 0 && out != 0 && sf != 0, kFn << ": null data pointer");
  const auto config = moe_launchers::quant::per_block_config(
      dtype, k32, use_ue8m0, x, batch > 1 ? x_batch_stride : 0, n > 1 ? x_row_stride : 0);
  moe_launchers::quant::per_block_launch(
      config, {x, x_batch_stride, x_row_stride, out, sf, batch, n, device, stream});
}

inline pybind11::tuple per_token_cast_to_fp8_code(int x_dtype, long long n, int gran_k,
                                                  bool use_ue8m0, const std::string& arch,
                                                  int vec) {
  constexpr const char* kFn = "per_token_cast_to_fp8_code";
  const DType dtype = detail::input_dtype(x_dtype, kFn);
  const int n32 = detail::row_length(n, kFn, "n");
  moe_launchers::quant::arch_checked(arch);
  auto config = moe_launchers::quant::per_token_config(dtype, n32, gran_k, use_ue8m0,
                                                       /*x_ptr=*/0, /*x_row_stride=*/n);
  config.vec = detail::checked_vec(vec, config.vec, dtype, n, kFn);
  return detail::as_tuple(moe_launchers::quant::per_token_code(config));
}

inline pybind11::tuple per_block_cast_to_fp8_code(int x_dtype, long long k, bool use_ue8m0,
                                                  const std::string& arch, int vec) {
  constexpr const char* kFn = "per_block_cast_to_fp8_code";
  const DType dtype = detail::input_dtype(x_dtype, kFn);
  const int k32 = detail::row_length(k, kFn, "k");
  moe_launchers::quant::arch_checked(arch);
  auto config = moe_launchers::quant::per_block_config(dtype, k32, use_ue8m0, /*x_ptr=*/0,
                                                       /*x_batch_stride=*/0, /*x_row_stride=*/k);
  config.vec = detail::checked_vec(vec, config.vec, dtype, k, kFn);
  return detail::as_tuple(moe_launchers::quant::per_block_code(config));
}

inline void cast_fp4_to_fp8_blocks(std::uint64_t packed, long long packed_stride_g, long long packed_stride_n,
                                   std::uint64_t sfb, long long sfb_stride_g, long long sfb_stride_n,
                                   std::uint64_t out, std::uint64_t sf, long long groups, long long n, long long k,
                                   int device, std::uint64_t stream) {
  constexpr const char* kFn = "cast_fp4_to_fp8_blocks";
  MOE_HOST_ASSERT(groups >= 0 && n >= 0 && k >= 0, kFn << ": groups, n and k must be >= 0, got " << groups << ", "
                                                     << n << ", " << k);
  if (groups == 0 || n == 0 || k == 0) return;
  MOE_HOST_ASSERT(packed != 0 && sfb != 0 && out != 0 && sf != 0, kFn << ": null data pointer");
  // 16-byte loads of every row's packed groups.
  MOE_HOST_ASSERT(packed % 16 == 0 && packed_stride_n % 16 == 0 && (groups == 1 || packed_stride_g % 16 == 0),
                  kFn << ": packed rows must be 16-byte aligned, got address " << packed << " and strides ("
                      << packed_stride_g << ", " << packed_stride_n << ")");
  MOE_HOST_ASSERT(out % 16 == 0, kFn << ": out must be 16-byte aligned");
  moe_launchers::quant::cast_fp4_to_fp8_blocks_launch(
      {packed, packed_stride_g, packed_stride_n, sfb, sfb_stride_g, sfb_stride_n, out, sf, groups, n, k, device, stream});
}

inline pybind11::tuple cast_fp4_to_fp8_blocks_code(const std::string& arch) {
  moe_launchers::quant::arch_checked(arch);
  return detail::as_tuple(moe_launchers::quant::cast_fp4_to_fp8_blocks_code());
}

inline void register_apis(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("per_token_cast_to_fp8", &per_token_cast_to_fp8, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("x_dtype"),
        py::arg("m"), py::arg("n"), py::arg("x_row_stride"), py::arg("out"), py::arg("sf"),
        py::arg("sf_stride_m"), py::arg("sf_stride_k"), py::arg("gran_k"), py::arg("use_ue8m0"), py::arg("device"),
        py::arg("stream"),
        "E4M3 quantization with one float32 scale per 1 x gran_k group of each row. x: [m, n] "
        "with row stride x_row_stride (elements), last dim contiguous; out: [m, n] E4M3, contiguous; "
        "sf: [m, ceil(n / gran_k)] float32 with strides (sf_stride_m, sf_stride_k) in elements. "
        "Launches on `stream`.");
  m.def("per_block_cast_to_fp8", &per_block_cast_to_fp8, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("x_dtype"),
        py::arg("batch"), py::arg("n"), py::arg("k"), py::arg("x_batch_stride"),
        py::arg("x_row_stride"), py::arg("out"), py::arg("sf"), py::arg("use_ue8m0"),
        py::arg("device"), py::arg("stream"),
        "E4M3 quantization with one float32 scale per 128 x 128 tile. x: [batch, n, k] with "
        "strides (x_batch_stride, x_row_stride, 1) in elements; out: [batch, n, k] E4M3, sf: "
        "[batch, ceil(n / 128), ceil(k / 128)] float32, both contiguous. Launches on `stream`.");
  m.def("per_token_cast_to_fp8_code", &per_token_cast_to_fp8_code, py::arg("x_dtype"),
        py::arg("n"), py::arg("gran_k"), py::arg("use_ue8m0"), py::arg("arch"), py::arg("vec") = 0,
        "(name, code) of the per-token kernel for these compile-time parameters; vec = 0 gives "
        "the vector width a contiguous, 16-byte-aligned x gets. Needs no GPU.");
  m.def("per_block_cast_to_fp8_code", &per_block_cast_to_fp8_code, py::arg("x_dtype"),
        py::arg("k"), py::arg("use_ue8m0"), py::arg("arch"), py::arg("vec") = 0,
        "(name, code) of the per-block kernel for these compile-time parameters; vec = 0 gives "
        "the vector width a contiguous, 16-byte-aligned x gets. Needs no GPU.");
  m.def("cast_fp4_to_fp8_blocks", &cast_fp4_to_fp8_blocks, py::call_guard<py::gil_scoped_release>(),
        py::arg("packed"), py::arg("packed_stride_g"), py::arg("packed_stride_n"), py::arg("sfb"),
        py::arg("sfb_stride_g"), py::arg("sfb_stride_n"), py::arg("out"), py::arg("sf"), py::arg("groups"),
        py::arg("n"), py::arg("k"), py::arg("device"), py::arg("stream"),
        "FP4 weights -> E4M3 weights with one float32 scale per 128 x 128 block. packed: [groups, n, k / 2] "
        "E2M1 pairs, sfb: [groups, n, k / 32] UE8M0 bytes, strides in bytes, last dims contiguous; out: "
        "[groups, n, k] E4M3 and sf: [groups, ceil(n / 128), k / 128] float32, both contiguous; k a multiple "
        "of 128. Launches on `stream`.");
  m.def("cast_fp4_to_fp8_blocks_code", &cast_fp4_to_fp8_blocks_code, py::arg("arch"),
        "(name, code) of the FP4 -> FP8 block cast kernel. Needs no GPU.");
}

}  // namespace moe_apis::quant
