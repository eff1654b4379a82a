#include "jit/nvrtc.hpp"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>

#include "jit/exception.hpp"
#include "jit/files.hpp"

namespace moe_jit::nvrtc {
namespace {

constexpr const char* kBuiltinsPrefix = "libnvrtc-builtins.so.";
constexpr const char* kInstallHint =
    "install it with `pip install nvidia-cuda-nvrtc==13.0.88` (the package's `jit` extra) or point "
    "MOE_JIT_NVRTC at libnvrtc.so";

template <typename Fn>
void resolve(void* handle, const std::string& path, const char* symbol, Fn*& slot) {
  void* address = dlsym(handle, symbol);
  MOE_HOST_ASSERT(address != nullptr, path << " has no entry point " << symbol);
  slot = reinterpret_cast<Fn*>(address);
}

// The builtins library beside NVRTC, preferring the most specific version suffix
// ("libnvrtc-builtins.so.13.0" over "libnvrtc-builtins.so.13"); the ".alt" variant belongs to
// libnvrtc.alt.
std::string find_builtins(const std::string& nvrtc_path) {
  std::string best;
  const std::string prefix = kBuiltinsPrefix;
  for (const auto& name : files::list_dir(files::dir_name(nvrtc_path))) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    if (name.size() > best.size()) best = name;
  }
  return best.empty() ? best : files::join(files::dir_name(nvrtc_path), best);
}

std::unique_ptr<NvrtcApi> load(const std::string& path) {
  MOE_HOST_ASSERT(!path.empty(), "no NVRTC library was found; " << kInstallHint);
  const std::string builtins = find_builtins(path);
  if (!builtins.empty()) {
    // Kept loaded for the life of the process, like NVRTC itself.
    if (dlopen(builtins.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* reason = dlerror();
      MOE_JIT_THROW("could not load " << builtins << ": " << (reason ? reason : "unknown reason"));
    }
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    MOE_JIT_THROW("could not load NVRTC from " << path << " (" << (reason ? reason : "unknown reason")
                                               << "); " << kInstallHint);
  }
  auto api = std::make_unique<NvrtcApi>();
  resolve(handle, path, "nvrtcGetErrorString", api->nvrtcGetErrorString);
  resolve(handle, path, "nvrtcVersion", api->nvrtcVersion);
  resolve(handle, path, "nvrtcCreateProgram", api->nvrtcCreateProgram);
  resolve(handle, path, "nvrtcDestroyProgram", api->nvrtcDestroyProgram);
  resolve(handle, path, "nvrtcCompileProgram", api->nvrtcCompileProgram);
  resolve(handle, path, "nvrtcGetProgramLogSize", api->nvrtcGetProgramLogSize);
  resolve(handle, path, "nvrtcGetProgramLog", api->nvrtcGetProgramLog);
  resolve(handle, path, "nvrtcGetCUBINSize", api->nvrtcGetCUBINSize);
  resolve(handle, path, "nvrtcGetCUBIN", api->nvrtcGetCUBIN);
  resolve(handle, path, "nvrtcGetPTXSize", api->nvrtcGetPTXSize);
  resolve(handle, path, "nvrtcGetPTX", api->nvrtcGetPTX);
  api->path = path;
  const nvrtcResult version = api->nvrtcVersion(&api->major, &api->minor);
  MOE_HOST_ASSERT(version == NVRTC_SUCCESS,
                  "nvrtcVersion failed: " << api->nvrtcGetErrorString(version));
  return api;
}

}  // namespace

const NvrtcApi& api(const std::string& path) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<NvrtcApi>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(path);
  if (it == loaded.end()) it = loaded.emplace(path, load(path)).first;
  return *it->second;
}

}  // namespace moe_jit::nvrtc
