#pragma once
// Dtype codes that cross the Python boundary; mirrored in kernels/_descriptors.py.
namespace moe_apis {

enum class DType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFloat8E4M3 = 3,
  kUInt8 = 4,
  kInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
};

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

// The device-side C++ type name the code generator writes for a dtype.
inline const char* dtype_cuda_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float";
    case DType::kBFloat16: return "__nv_bfloat16";
    case DType::kFloat16: return "__half";
    case DType::kFloat8E4M3: return "__nv_fp8_e4m3";
    case DType::kUInt8: return "uint8_t";
    case DType::kInt8: return "int8_t";
    case DType::kInt32: return "int";
    case DType::kInt64: return "long long";
  }
  return "void";
}

}  // namespace moe_apis
