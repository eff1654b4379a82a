#include "jit/driver.hpp"

#include <dlfcn.h>

#include <string>

#include "jit/exception.hpp"

namespace moe_jit::driver {
namespace {

constexpr const char* kDriverLibrary = "libcuda.so.1";

template <typename Fn>
void resolve(void* handle, const char* symbol, Fn*& slot) {
  void* address = dlsym(handle, symbol);
  MOE_HOST_ASSERT(address != nullptr, "the CUDA driver (" << kDriverLibrary << ") has no entry point "
                                                          << symbol << "; the driver is too old");
  slot = reinterpret_cast<Fn*>(address);
}

DriverApi load() {
  void* handle = dlopen(kDriverLibrary, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    MOE_JIT_THROW("could not load " << kDriverLibrary << " (" << (reason ? reason : "unknown reason")
                                    << "): no NVIDIA driver on this machine, so no CUDA device "
                                       "can be used; compiling kernels needs no driver");
  }
  DriverApi api{};
  resolve(handle, "cuGetErrorName", api.cuGetErrorName);
  resolve(handle, "cuGetErrorString", api.cuGetErrorString);
  resolve(handle, "cuInit", api.cuInit);
  resolve(handle, "cuDriverGetVersion", api.cuDriverGetVersion);
  resolve(handle, "cuDeviceGet", api.cuDeviceGet);
  resolve(handle, "cuDeviceGetCount", api.cuDeviceGetCount);
  resolve(handle, "cuDeviceGetName", api.cuDeviceGetName);
  resolve(handle, "cuDeviceGetAttribute", api.cuDeviceGetAttribute);
  resolve(handle, "cuDevicePrimaryCtxRetain", api.cuDevicePrimaryCtxRetain);
  resolve(handle, "cuCtxGetCurrent", api.cuCtxGetCurrent);
  resolve(handle, "cuCtxSetCurrent", api.cuCtxSetCurrent);
  resolve(handle, "cuModuleLoadData", api.cuModuleLoadData);
  resolve(handle, "cuModuleUnload", api.cuModuleUnload);
  resolve(handle, "cuModuleGetFunctionCount", api.cuModuleGetFunctionCount);
  resolve(handle, "cuModuleEnumerateFunctions", api.cuModuleEnumerateFunctions);
  resolve(handle, "cuFuncGetName", api.cuFuncGetName);
  resolve(handle, "cuFuncGetAttribute", api.cuFuncGetAttribute);
  resolve(handle, "cuFuncSetAttribute", api.cuFuncSetAttribute);
  resolve(handle, "cuLaunchKernelEx", api.cuLaunchKernelEx);
  resolve(handle, "cuTensorMapEncodeTiled", api.cuTensorMapEncodeTiled);

  const CUresult init = api.cuInit(0);
  if (init != CUDA_SUCCESS) {
    const char* name = nullptr;
    const char* text = nullptr;
    api.cuGetErrorName(init, &name);
    api.cuGetErrorString(init, &text);
    MOE_JIT_THROW("cuInit failed: " << (name ? name : "unknown CUresult") << ": "
                                    << (text ? text : "")
                                    << (init == CUDA_ERROR_NO_DEVICE ? " (no CUDA device)" : ""));
  }
  return api;
}

}  // namespace

const DriverApi& api() {
  // A throwing initializer leaves the static uninitialized, so a later call tries again.
  static const DriverApi loaded = load();
  return loaded;
}

std::string describe_error(int result) {
  const DriverApi& driver = api();
  const char* name = nullptr;
  const char* text = nullptr;
  driver.cuGetErrorName(result, &name);
  driver.cuGetErrorString(result, &text);
  std::string out = name ? name : ("CUresult " + std::to_string(result));
  if (text) out += std::string(": ") + text;
  return out;
}

}  // namespace moe_jit::driver
