#include "jit/kernel_runtime.hpp"

#include <map>
#include <mutex>
#include <string>

#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"

namespace moe_jit {
namespace {

// Dynamic shared memory a function may use without opting in.
constexpr unsigned kDefaultSmemLimit = 48 * 1024;
// Clusters larger than this need the non-portable-size opt-in.
constexpr unsigned kPortableClusterLimit = 8;

struct LoadedFunction {
  driver::CUmodule module = nullptr;
  driver::CUfunction function = nullptr;
  std::string function_name;
  unsigned smem_limit = kDefaultSmemLimit;  // the dynamic shared-memory limit set so far
  bool non_portable_cluster = false;
};

struct Registry {
  std::mutex mutex;
  // Cache key (which identifies the cubin) -> device ordinal -> function. Entries are never
  // erased, so references to them stay valid.
  std::map<std::string, std::map<int, LoadedFunction>, std::less<>> functions;
};

Registry& registry() {
  static Registry r;
  return r;
}

LoadedFunction load(const CompiledKernel& kernel) {
  const auto& api = driver::api();
  LoadedFunction loaded;
  MOE_CU_CHECK(api.cuModuleLoadData(&loaded.module, kernel.cubin.data()));
  unsigned count = 0;
  const int counted = api.cuModuleGetFunctionCount(&count, loaded.module);
  if (counted != driver::CUDA_SUCCESS || count != 1) {
    api.cuModuleUnload(loaded.module);
    MOE_CU_CHECK(counted);
    MOE_JIT_THROW("kernel '" << kernel.name << "' (" << kernel.cubin_path << ") has " << count
                             << " __global__ functions; the generated code must define exactly "
                                "one");
  }
  MOE_CU_CHECK(api.cuModuleEnumerateFunctions(&loaded.function, 1, loaded.module));
  const char* name = nullptr;
  if (api.cuFuncGetName(&name, loaded.function) == driver::CUDA_SUCCESS && name != nullptr) {
    loaded.function_name = name;
  }
  return loaded;
}

// Loads on first use; the context of `device` must be current. The registry's mutex is held.
LoadedFunction& find_or_load(Registry& r, const CompiledKernel& kernel, int device) {
  auto by_key = r.functions.find(kernel.key);
  if (by_key == r.functions.end()) by_key = r.functions.emplace(kernel.key, std::map<int, LoadedFunction>{}).first;
  auto& by_device = by_key->second;
  auto it = by_device.find(device);
  if (it == by_device.end()) it = by_device.emplace(device, load(kernel)).first;
  return it->second;
}

void check_config(const CompiledKernel& kernel, const LaunchConfig& cfg) {
  MOE_HOST_ASSERT(cfg.grid_x > 0 && cfg.grid_y > 0 && cfg.grid_z > 0,
                  "kernel '" << kernel.name << "': grid (" << cfg.grid_x << ", " << cfg.grid_y
                             << ", " << cfg.grid_z << ") must be positive");
  MOE_HOST_ASSERT(cfg.block_x > 0 && cfg.block_y > 0 && cfg.block_z > 0,
                  "kernel '" << kernel.name << "': block (" << cfg.block_x << ", " << cfg.block_y
                             << ", " << cfg.block_z << ") must be positive");
  MOE_HOST_ASSERT(cfg.cluster_dim >= 1 && cfg.grid_x % cfg.cluster_dim == 0,
                  "kernel '" << kernel.name << "': cluster_dim " << cfg.cluster_dim
                             << " must be >= 1 and divide grid_x " << cfg.grid_x);
}

// Raises the function's limits as the launch needs. The registry's mutex is held.
void prepare(LoadedFunction& f, const CompiledKernel& kernel, const LaunchConfig& cfg) {
  const auto& api = driver::api();
  if (cfg.smem_bytes > f.smem_limit) {
    const int optin = device_info(cfg.device).smem_optin;
    MOE_HOST_ASSERT(cfg.smem_bytes <= static_cast<unsigned>(optin),
                    "kernel '" << kernel.name << "' asks for " << cfg.smem_bytes
                               << " bytes of dynamic shared memory; device " << cfg.device
                               << " allows at most " << optin << " per block");
    MOE_CU_CHECK(api.cuFuncSetAttribute(f.function,
                                        driver::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        static_cast<int>(cfg.smem_bytes)));
    f.smem_limit = cfg.smem_bytes;
  }
  if (cfg.cluster_dim > kPortableClusterLimit && !f.non_portable_cluster) {
    MOE_CU_CHECK(api.cuFuncSetAttribute(
        f.function, driver::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1));
    f.non_portable_cluster = true;
  }
}

}  // namespace

driver::CUfunction get_function(const CompiledKernel& kernel, int device) {
  ScopedDeviceContext context(device);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return find_or_load(r, kernel, device).function;
}

void launch_with_params(const CompiledKernel& kernel, const LaunchConfig& cfg, void** params) {
  check_config(kernel, cfg);
  ScopedDeviceContext context(cfg.device);
  const LoadedFunction* loaded = nullptr;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    LoadedFunction& f = find_or_load(r, kernel, cfg.device);
    prepare(f, kernel, cfg);
    loaded = &f;
  }

  driver::CUlaunchAttribute attrs[2] = {};
  unsigned num_attrs = 0;
  if (cfg.cluster_dim > 1) {
    attrs[num_attrs].id = driver::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[num_attrs].value.clusterDim.x = cfg.cluster_dim;
    attrs[num_attrs].value.clusterDim.y = 1;
    attrs[num_attrs].value.clusterDim.z = 1;
    ++num_attrs;
  }
  if (cfg.pdl) {
    attrs[num_attrs].id = driver::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[num_attrs].value.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  driver::CUlaunchConfig launch{};
  launch.gridDimX = cfg.grid_x;
  launch.gridDimY = cfg.grid_y;
  launch.gridDimZ = cfg.grid_z;
  launch.blockDimX = cfg.block_x;
  launch.blockDimY = cfg.block_y;
  launch.blockDimZ = cfg.block_z;
  launch.sharedMemBytes = cfg.smem_bytes;
  launch.hStream = reinterpret_cast<driver::CUstream>(static_cast<std::uintptr_t>(cfg.stream));
  launch.attrs = num_attrs > 0 ? attrs : nullptr;
  launch.numAttrs = num_attrs;

  const int result = driver::api().cuLaunchKernelEx(&launch, loaded->function, params, nullptr);
  if (result != driver::CUDA_SUCCESS) {
    MOE_JIT_THROW("launch of kernel '" << kernel.name << "' (" << loaded->function_name << ") failed: "
                                       << driver::describe_error(result) << "; grid ("
                                       << cfg.grid_x << ", " << cfg.grid_y << ", " << cfg.grid_z
                                       << "), block (" << cfg.block_x << ", " << cfg.block_y
                                       << ", " << cfg.block_z << "), smem " << cfg.smem_bytes
                                       << ", cluster " << cfg.cluster_dim << ", pdl " << cfg.pdl
                                       << ", device " << cfg.device);
  }
}

}  // namespace moe_jit
