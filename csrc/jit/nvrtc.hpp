#pragma once
// The NVRTC entry points the compiler uses, declared here (signatures from nvrtc.h, CUDA 13.0) and
// resolved with dlsym from the library whose path Python gives.
#include <cstddef>
#include <string>

namespace moe_jit::nvrtc {

using nvrtcResult = int;
constexpr nvrtcResult NVRTC_SUCCESS = 0;
using nvrtcProgram = struct _nvrtcProgram*;

struct NvrtcApi {
  const char* (*nvrtcGetErrorString)(nvrtcResult result);
  nvrtcResult (*nvrtcVersion)(int* major, int* minor);
  nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram* prog, const char* src, const char* name,
                                    int numHeaders, const char* const* headers,
                                    const char* const* includeNames);
  nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram* prog);
  nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram prog, int numOptions,
                                     const char* const* options);
  nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram prog, size_t* logSizeRet);
  nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram prog, char* log);
  nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram prog, size_t* cubinSizeRet);
  nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram prog, char* cubin);
  nvrtcResult (*nvrtcGetPTXSize)(nvrtcProgram prog, size_t* ptxSizeRet);
  nvrtcResult (*nvrtcGetPTX)(nvrtcProgram prog, char* ptx);

  std::string path;
  int major = 0;
  int minor = 0;
};

// Loads the NVRTC library at `path` once per path (thread-safe), after loading the
// libnvrtc-builtins library found beside it with RTLD_GLOBAL, which NVRTC looks up by name at
// compile time and would otherwise not find outside the loader's search path. Raises JitError.
const NvrtcApi& api(const std::string& path);

}  // namespace moe_jit::nvrtc
