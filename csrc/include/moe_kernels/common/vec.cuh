#pragma once
// Fixed-width vectors of elements and the global loads/stores that move them in one instruction.
// Widths are 1, 2, 4, 8 or 16 bytes; the pointer must be aligned to the vector width.

namespace moe_kernels {

template <typename T, int kSize>
struct alignas(sizeof(T) * kSize) Vec {
  static_assert(kSize > 0 && (kSize & (kSize - 1)) == 0, "vector length must be a power of two");
  static_assert(sizeof(T) * kSize <= 16, "vectors are at most 16 bytes");
  T elems[kSize];
};

template <typename T, int kSize>
__device__ __forceinline__ Vec<T, kSize> zero_vec() {
  Vec<T, kSize> v;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(&v);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(v)); ++i) bytes[i] = 0;
  return v;
}

namespace detail {

// Read-only data read once: bypass L1 allocation so it does not evict data that is reused.
template <int kBytes>
__device__ __forceinline__ void ld_stream(const void* ptr, void* dst);

template <>
__device__ __forceinline__ void ld_stream<16>(const void* ptr, void* dst) {
  unsigned* d = static_cast<unsigned*>(dst);
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "l"(ptr));
}

template <>
__device__ __forceinline__ void ld_stream<8>(const void* ptr, void* dst) {
  unsigned* d = static_cast<unsigned*>(dst);
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(d[0]), "=r"(d[1])
               : "l"(ptr));
}

template <>
__device__ __forceinline__ void ld_stream<4>(const void* ptr, void* dst) {
  unsigned* d = static_cast<unsigned*>(dst);
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(d[0]) : "l"(ptr));
}

template <>
__device__ __forceinline__ void ld_stream<2>(const void* ptr, void* dst) {
  unsigned short* d = static_cast<unsigned short*>(dst);
  asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(d[0]) : "l"(ptr));
}

template <>
__device__ __forceinline__ void ld_stream<1>(const void* ptr, void* dst) {
  unsigned short wide;
  asm("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=h"(wide) : "l"(ptr));
  *static_cast<unsigned char*>(dst) = static_cast<unsigned char>(wide);
}

template <int kBytes>
__device__ __forceinline__ void st_global(void* ptr, const void* src);

template <>
__device__ __forceinline__ void st_global<16>(void* ptr, const void* src) {
  const unsigned* s = static_cast<const unsigned*>(src);
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
               :: "l"(ptr), "r"(s[0]), "r"(s[1]), "r"(s[2]), "r"(s[3]) : "memory");
}

template <>
__device__ __forceinline__ void st_global<8>(void* ptr, const void* src) {
  const unsigned* s = static_cast<const unsigned*>(src);
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(ptr), "r"(s[0]), "r"(s[1]) : "memory");
}

template <>
__device__ __forceinline__ void st_global<4>(void* ptr, const void* src) {
  asm volatile("st.global.u32 [%0], %1;"
               :: "l"(ptr), "r"(*static_cast<const unsigned*>(src)) : "memory");
}

template <>
__device__ __forceinline__ void st_global<2>(void* ptr, const void* src) {
  asm volatile("st.global.u16 [%0], %1;"
               :: "l"(ptr), "h"(*static_cast<const unsigned short*>(src)) : "memory");
}

template <>
__device__ __forceinline__ void st_global<1>(void* ptr, const void* src) {
  const unsigned short wide = *static_cast<const unsigned char*>(src);
  asm volatile("st.global.u8 [%0], %1;" :: "l"(ptr), "h"(wide) : "memory");
}

}  // namespace detail

// One streaming load of kSize elements starting at `ptr` (aligned to the vector width).
template <int kSize, typename T>
__device__ __forceinline__ Vec<T, kSize> load_stream(const T* ptr) {
  Vec<T, kSize> v;
  detail::ld_stream<sizeof(v)>(ptr, &v);
  return v;
}

// One store of kSize elements starting at `ptr` (aligned to the vector width).
template <typename T, int kSize>
__device__ __forceinline__ void store_global(T* ptr, const Vec<T, kSize>& v) {
  detail::st_global<sizeof(v)>(ptr, &v);
}

}  // namespace moe_kernels
