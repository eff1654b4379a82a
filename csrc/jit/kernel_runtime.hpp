#pragma once
// Compiled kernel -> CUfunction per device (the module is loaded once per (kernel, device)) and
// launches through cuLaunchKernelEx. Raises JitError on any driver error.
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "jit/compiler.hpp"
#include "jit/driver.hpp"

namespace moe_jit {

struct LaunchConfig {
  unsigned grid_x = 1, grid_y = 1, grid_z = 1;
  unsigned block_x = 1, block_y = 1, block_z = 1;
  unsigned smem_bytes = 0;   // dynamic shared memory; > 48 KiB raises the function limit
  unsigned cluster_dim = 1;  // cluster along x when > 1
  bool pdl = false;          // programmatic dependent launch
  std::uint64_t stream = 0;  // CUstream as an integer (torch.cuda.current_stream().cuda_stream)
  int device = 0;            // CUDA device ordinal
};

// The kernel's one __global__ function, loaded on `device` (first call loads the module).
driver::CUfunction get_function(const CompiledKernel& kernel, int device);

// Launches with one pointer per kernel parameter, each to a value of the parameter's exact type.
void launch_with_params(const CompiledKernel& kernel, const LaunchConfig& cfg, void** params);

namespace detail {
template <typename Tuple, size_t... I>
void launch_tuple(const CompiledKernel& kernel, const LaunchConfig& cfg, Tuple& values,
                  std::index_sequence<I...>) {
  void* params[sizeof...(I) + 1] = {static_cast<void*>(&std::get<I>(values))..., nullptr};
  launch_with_params(kernel, cfg, params);
}
}  // namespace detail

// Launch: kernel arguments are passed by value; each must match the kernel's parameter type
// exactly (e.g. pass `static_cast<long long>(n)` for a `long long` parameter), since the driver
// copies sizeof(parameter) bytes from each argument.
template <typename... Args>
void launch(const CompiledKernel& kernel, const LaunchConfig& cfg, const Args&... args) {
  static_assert((std::is_trivially_copyable_v<Args> && ...),
                "kernel arguments must be trivially copyable values");
  static_assert(!(std::is_array_v<Args> || ...), "pass a pointer, not an array");
  // Typed copies: the driver reads each parameter through a pointer to storage of its own type.
  std::tuple<Args...> values(args...);
  detail::launch_tuple(kernel, cfg, values, std::index_sequence_for<Args...>{});
}

}  // namespace moe_jit
