#pragma once
// The part of the CUDA driver API that _C uses, declared here so that no CUDA header is needed to
// build. Types, enum values and signatures are copied from cuda.h (CUDA 13.0); the entry points are
// resolved with dlsym from libcuda.so.1, loaded at first use, under the names that cuda.h maps the
// plain names to (the `_v2` suffixes).
#include <cstddef>
#include <cstdint>

namespace moe_jit::driver {

using CUresult = int;
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;

using CUdevice = int;
using cuuint32_t = std::uint32_t;
using cuuint64_t = std::uint64_t;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;

enum CUdevice_attribute : int {
  CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81,
  CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
};

enum CUfunction_attribute : int {
  CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
  CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
  CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
  CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
  CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14,
};

enum CUlaunchAttributeID : int {
  CU_LAUNCH_ATTRIBUTE_IGNORE = 0,
  CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4,
  CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6,
};

// cuda.h's union has more members; its size (64-byte pad) and alignment (it holds pointers) are
// what the ABI needs.
union CUlaunchAttributeValue {
  char pad[64];
  void* align_as_pointer;
  struct {
    unsigned int x;
    unsigned int y;
    unsigned int z;
  } clusterDim;
  int programmaticStreamSerializationAllowed;
};

struct CUlaunchAttribute {
  CUlaunchAttributeID id;
  char pad[8 - sizeof(CUlaunchAttributeID)];
  CUlaunchAttributeValue value;
};

struct CUlaunchConfig {
  unsigned int gridDimX;
  unsigned int gridDimY;
  unsigned int gridDimZ;
  unsigned int blockDimX;
  unsigned int blockDimY;
  unsigned int blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned int numAttrs;
};

static_assert(sizeof(CUlaunchAttributeValue) == 64, "CUlaunchAttributeValue must match cuda.h");
static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute must match cuda.h");
static_assert(offsetof(CUlaunchAttribute, value) == 8, "CUlaunchAttribute must match cuda.h");
static_assert(offsetof(CUlaunchConfig, hStream) == 32, "CUlaunchConfig must match cuda.h");
static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig must match cuda.h");

// A TMA descriptor: 128 opaque bytes, 128-byte aligned as in cuda.h 13.0 (the driver needs 64).
constexpr int CU_TENSOR_MAP_NUM_QWORDS = 16;
struct alignas(128) CUtensorMap {
  cuuint64_t opaque[CU_TENSOR_MAP_NUM_QWORDS];
};
static_assert(sizeof(CUtensorMap) == 128, "CUtensorMap must match cuda.h");

enum CUtensorMapDataType : int {
  CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0,
  CU_TENSOR_MAP_DATA_TYPE_UINT16,
  CU_TENSOR_MAP_DATA_TYPE_UINT32,
  CU_TENSOR_MAP_DATA_TYPE_INT32,
  CU_TENSOR_MAP_DATA_TYPE_UINT64,
  CU_TENSOR_MAP_DATA_TYPE_INT64,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
  CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ,
  CU_TENSOR_MAP_DATA_TYPE_TFLOAT32,
  CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ,
  CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B,
  CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B,
  CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B,
};

enum CUtensorMapInterleave : int {
  CU_TENSOR_MAP_INTERLEAVE_NONE = 0,
  CU_TENSOR_MAP_INTERLEAVE_16B,
  CU_TENSOR_MAP_INTERLEAVE_32B,
};

enum CUtensorMapSwizzle : int {
  CU_TENSOR_MAP_SWIZZLE_NONE = 0,
  CU_TENSOR_MAP_SWIZZLE_32B,
  CU_TENSOR_MAP_SWIZZLE_64B,
  CU_TENSOR_MAP_SWIZZLE_128B,
  CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B,
  CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B_FLIP_8B,
  CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B,
};

enum CUtensorMapL2promotion : int {
  CU_TENSOR_MAP_L2_PROMOTION_NONE = 0,
  CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
  CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
};

enum CUtensorMapFloatOOBfill : int {
  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0,
  CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA,
};

// Entry points, filled by dlsym. Member names are the cuda.h names without the version suffix.
struct DriverApi {
  CUresult (*cuGetErrorName)(CUresult error, const char** pStr);
  CUresult (*cuGetErrorString)(CUresult error, const char** pStr);
  CUresult (*cuInit)(unsigned int flags);
  CUresult (*cuDriverGetVersion)(int* driverVersion);
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal);
  CUresult (*cuDeviceGetCount)(int* count);
  CUresult (*cuDeviceGetName)(char* name, int len, CUdevice dev);
  CUresult (*cuDeviceGetAttribute)(int* pi, CUdevice_attribute attrib, CUdevice dev);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext* pctx, CUdevice dev);
  CUresult (*cuCtxGetCurrent)(CUcontext* pctx);
  CUresult (*cuCtxSetCurrent)(CUcontext ctx);
  CUresult (*cuModuleLoadData)(CUmodule* module, const void* image);
  CUresult (*cuModuleUnload)(CUmodule hmod);
  CUresult (*cuModuleGetFunctionCount)(unsigned int* count, CUmodule mod);
  CUresult (*cuModuleEnumerateFunctions)(CUfunction* functions, unsigned int numFunctions,
                                         CUmodule mod);
  CUresult (*cuFuncGetName)(const char** name, CUfunction hfunc);
  CUresult (*cuFuncGetAttribute)(int* pi, CUfunction_attribute attrib, CUfunction hfunc);
  CUresult (*cuFuncSetAttribute)(CUfunction hfunc, CUfunction_attribute attrib, int value);
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig* config, CUfunction f, void** kernelParams,
                               void** extra);
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap* tensorMap, CUtensorMapDataType tensorDataType,
                                     cuuint32_t tensorRank, void* globalAddress,
                                     const cuuint64_t* globalDim, const cuuint64_t* globalStrides,
                                     const cuuint32_t* boxDim, const cuuint32_t* elementStrides,
                                     CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                     CUtensorMapL2promotion l2Promotion,
                                     CUtensorMapFloatOOBfill oobFill);
};

// Loads libcuda.so.1 and calls cuInit(0) on first use (thread-safe). Raises JitError when the
// library cannot be loaded, an entry point is missing, or there is no CUDA device.
const DriverApi& api();

}  // namespace moe_jit::driver
