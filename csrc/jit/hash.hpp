#pragma once
// 128-bit content hash for cache keys: two independent 64-bit lanes (FNV-1a, and a
// multiply-rotate lane with a different seed), each finished by the MurmurHash3 64-bit mixer.
// Not cryptographic; collisions are negligible for cache keys and no dependency is needed.
#include <cstdint>
#include <cstring>
#include <string>

namespace moe_jit {

class Hasher {
 public:
  Hasher& bytes(const void* data, size_t size) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) {
      lane_a_ = (lane_a_ ^ p[i]) * kFnvPrime;
      lane_b_ = rotl(lane_b_ + p[i] * kMulPrime1, 29) * kMulPrime2;
    }
    return *this;
  }

  // Length-prefixed, so that ("ab", "c") and ("a", "bc") hash differently.
  Hasher& field(const std::string& value) {
    const std::uint64_t size = value.size();
    bytes(&size, sizeof(size));
    return bytes(value.data(), value.size());
  }

  Hasher& field(std::uint64_t value) { return bytes(&value, sizeof(value)); }

  // 32 lowercase hex digits.
  std::string hex() const {
    const std::uint64_t a = mix(lane_a_ ^ rotl(lane_b_, 17));
    const std::uint64_t b = mix(lane_b_ ^ kMulPrime1) ^ a;
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string out(32, '0');
    for (int i = 0; i < 16; ++i) {
      out[i] = kDigits[(a >> (60 - 4 * i)) & 0xF];
      out[16 + i] = kDigits[(b >> (60 - 4 * i)) & 0xF];
    }
    return out;
  }

 private:
  static constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
  static constexpr std::uint64_t kFnvPrime = 0x100000001b3ULL;
  static constexpr std::uint64_t kMulPrime1 = 0x9e3779b185ebca87ULL;
  static constexpr std::uint64_t kMulPrime2 = 0xc2b2ae3d27d4eb4fULL;
  static constexpr std::uint64_t kSeedB = 0x27d4eb2f165667c5ULL;

  static std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

  static std::uint64_t mix(std::uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
  }

  std::uint64_t lane_a_ = kFnvOffset;
  std::uint64_t lane_b_ = kSeedB;
};

}  // namespace moe_jit
