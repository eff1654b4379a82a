// A host-only stand-in for libcuda.so.1: the 20 entry points kernels/_C resolves, answering as one
// H200 (SM 9.0, 132 SMs) and recording what the launchers ask of it, without a GPU. It lets the
// launchers' host path (heuristics, memos, TMA descriptors, launch configuration) run and be timed
// on a CPU-only machine: a process started with this library's folder first on LD_LIBRARY_PATH
// loads it as the driver. Nothing runs: a launch only records its configuration.
//
// Built by kernels/testing/host_driver.py (build_host_driver); read through its extern "C"
// counters with ctypes.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "jit/driver.hpp"

using namespace moe_jit::driver;

namespace {

std::atomic<long long> g_encodes{0};
std::atomic<long long> g_launches{0};
std::atomic<long long> g_module_loads{0};
std::mutex g_last_mutex;
CUlaunchConfig g_last_launch{};
unsigned g_last_cluster = 1;
bool g_last_pdl = false;

// The last kLogSize maps encoded: data type, rank, sizes and box of the first three dimensions.
struct EncodedMap {
  long long dtype, rank, dims[3], box[3];
};
constexpr int kLogSize = 64;
std::mutex g_log_mutex;
EncodedMap g_log[kLogSize];
long long g_log_next = 0;

constexpr CUresult kInvalidValue = 1;  // CUDA_ERROR_INVALID_VALUE

// The rules the real driver enforces for a tiled, non-interleaved map (CUDA driver API,
// cuTensorMapEncodeTiled), so that a map a GPU would refuse fails here too.
bool legal_map(CUtensorMapDataType dtype, cuuint32_t rank, const void* address, const cuuint64_t* dims,
               const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapInterleave interleave,
               CUtensorMapSwizzle swizzle) {
  static constexpr int kElemBytes[] = {1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4};
  if (static_cast<unsigned>(dtype) >= sizeof(kElemBytes) / sizeof(kElemBytes[0])) return false;
  if (rank < 1 || rank > 5 || interleave != CU_TENSOR_MAP_INTERLEAVE_NONE) return false;
  if (reinterpret_cast<std::uintptr_t>(address) % 16 != 0) return false;
  const unsigned elem = static_cast<unsigned>(kElemBytes[dtype]);
  for (cuuint32_t i = 0; i < rank; ++i) {
    if (dims[i] < 1 || dims[i] > (1ull << 32) || box[i] < 1 || box[i] > 256) return false;
    if (i + 1 < rank && (strides[i] % 16 != 0 || strides[i] >= (1ull << 40))) return false;
  }
  const unsigned inner_bytes = box[0] * elem;
  if (inner_bytes % 16 != 0) return false;
  const unsigned span = swizzle == CU_TENSOR_MAP_SWIZZLE_32B    ? 32
                        : swizzle == CU_TENSOR_MAP_SWIZZLE_64B  ? 64
                        : swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? 128
                                                                : 0;
  return span == 0 || inner_bytes <= span;
}

CUctx_st* const kContext = reinterpret_cast<CUctx_st*>(0x1000);
CUmod_st* const kModule = reinterpret_cast<CUmod_st*>(0x2000);
CUfunc_st* const kFunction = reinterpret_cast<CUfunc_st*>(0x3000);
thread_local CUcontext t_current = nullptr;

}  // namespace

extern "C" {

CUresult cuGetErrorName(CUresult, const char** s) {
  *s = "HOST_DRIVER_ERROR";
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult, const char** s) {
  *s = "host-only driver";
  return CUDA_SUCCESS;
}
CUresult cuInit(unsigned) { return CUDA_SUCCESS; }
// NVRTC opens the driver too and asks for its private export tables: refused, it compiles without.
CUresult cuGetExportTable(const void** table, const void*) {
  *table = nullptr;
  return 801;  // CUDA_ERROR_NOT_SUPPORTED
}
CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
  std::strncpy(name, "host-only driver (H200 attributes)", static_cast<std::size_t>(len));
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *v = 60 << 20; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *v = 233472; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = 232448; break;
    default: *v = 0;
  }
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
  *c = kContext;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = t_current;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext c) {
  t_current = c;
  return CUDA_SUCCESS;
}
CUresult cuModuleLoadData(CUmodule* m, const void*) {
  ++g_module_loads;
  *m = kModule;
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunctionCount(unsigned* n, CUmodule) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult cuModuleEnumerateFunctions(CUfunction* f, unsigned n, CUmodule) {
  if (n >= 1) f[0] = kFunction;
  return CUDA_SUCCESS;
}
CUresult cuFuncGetName(const char** name, CUfunction) {
  *name = "host_driver_kernel";
  return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction) {
  *v = a == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : a == CU_FUNC_ATTRIBUTE_NUM_REGS ? 128 : 0;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction, CUfunction_attribute, int) { return CUDA_SUCCESS; }
CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction, void**, void**) {
  ++g_launches;
  std::lock_guard<std::mutex> lock(g_last_mutex);
  g_last_launch = *config;
  g_last_cluster = 1;
  g_last_pdl = false;
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) g_last_cluster = config->attrs[i].value.clusterDim.x;
    if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) g_last_pdl = true;
  }
  g_last_launch.attrs = nullptr;
  return CUDA_SUCCESS;
}
CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType dtype, cuuint32_t rank, void* address,
                                const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                const cuuint32_t*, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  ++g_encodes;
  if (!legal_map(dtype, rank, address, dims, strides, box, interleave, swizzle)) return kInvalidValue;
  {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    EncodedMap& entry = g_log[g_log_next++ % kLogSize];
    entry = {static_cast<long long>(dtype), static_cast<long long>(rank), {1, 1, 1}, {1, 1, 1}};
    for (cuuint32_t i = 0; i < rank && i < 3; ++i) {
      entry.dims[i] = static_cast<long long>(dims[i]);
      entry.box[i] = box[i];
    }
  }
  std::memset(map, 0, sizeof(*map));
  // The arguments, so that a test can tell maps apart.
  std::uint64_t words[16] = {reinterpret_cast<std::uint64_t>(address), static_cast<std::uint64_t>(dtype), rank,
                             static_cast<std::uint64_t>(swizzle)};
  for (cuuint32_t i = 0; i < rank && i < 3; ++i) {
    words[4 + i] = dims[i];
    words[7 + i] = box[i];
    if (i + 1 < rank) words[10 + i] = strides[i];
  }
  std::memcpy(map, words, sizeof(words));
  return CUDA_SUCCESS;
}

// ---- the record, for ctypes --------------------------------------------------------------------------

long long host_driver_encodes() { return g_encodes.load(); }
long long host_driver_launches() { return g_launches.load(); }
long long host_driver_module_loads() { return g_module_loads.load(); }
// The last `count` (at most 64) maps encoded, oldest first, 8 values each: data type, rank, the
// first three sizes, the first three box sizes (1 past the rank).
void host_driver_encoded_maps(long long* out, int count) {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  count = static_cast<int>(std::min<long long>({count, kLogSize, g_log_next}));
  for (int i = 0; i < count; ++i) {
    const EncodedMap& entry = g_log[(g_log_next - count + i) % kLogSize];
    const long long values[8] = {entry.dtype, entry.rank, entry.dims[0], entry.dims[1], entry.dims[2],
                                 entry.box[0], entry.box[1], entry.box[2]};
    std::memcpy(out + 8 * i, values, sizeof(values));
  }
}
// grid x, block x, dynamic shared memory, cluster size, PDL (0/1) of the last launch.
void host_driver_last_launch(long long* out) {
  std::lock_guard<std::mutex> lock(g_last_mutex);
  out[0] = g_last_launch.gridDimX;
  out[1] = g_last_launch.blockDimX;
  out[2] = g_last_launch.sharedMemBytes;
  out[3] = g_last_cluster;
  out[4] = g_last_pdl ? 1 : 0;
}

}  // extern "C"
