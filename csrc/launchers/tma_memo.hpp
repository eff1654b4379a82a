#pragma once
// Encoded TMA descriptors kept by their arguments, so that a launch on the buffers of an earlier
// one (weights always, activations whenever the caching allocator hands the same blocks out again)
// skips cuTensorMapEncodeTiled. A map holds the address, sizes, strides, box and modes and nothing
// of the memory's contents or of the context: the same arguments give the same 128 bytes.
//
// Per thread (no lock), 4-way set-associative with least-recently-used replacement over kSets
// sets: a forward of 60 MoE layers asks for a few hundred weight maps, which a direct-mapped
// table of that size lost to collisions. Allocated on the thread's first use (about 0.5 MB).
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "jit/compiler.hpp"
#include "jit/driver.hpp"

namespace moe_launchers::sm90_gemm {

// MOE_TMA_MEMO=0 encodes every map afresh (A/B timing of the memo). Read once per process: a check
// per map would cost more than the memo saves in a large environment.
inline bool tma_memo_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("MOE_TMA_MEMO");
    return value == nullptr || std::string(value) != "0";
  }();
  return enabled;
}

class TmaMemo {
 public:
  static constexpr int kSets = 512;
  static constexpr int kWays = 4;
  using Key = std::array<std::uint64_t, 8>;

  template <typename Encode>
  static moe_jit::driver::CUtensorMap get(const Key& key, Encode&& encode) {
    static thread_local std::unique_ptr<TmaMemo> memo;
    if (!memo) memo = std::make_unique<TmaMemo>();
    return memo->find(key, encode);
  }

 private:
  struct Slot {
    moe_jit::driver::CUtensorMap map{};
    Key key{};
    std::uint64_t last_use = 0;  // 0: empty
  };

  template <typename Encode>
  moe_jit::driver::CUtensorMap find(const Key& key, Encode& encode) {
    std::array<Slot, kWays>& set = sets_[set_of(key)];
    Slot* victim = &set[0];
    for (Slot& slot : set) {
      if (slot.last_use != 0 && slot.key == key) {
        slot.last_use = ++clock_;
        return slot.map;
      }
      if (slot.last_use < victim->last_use) victim = &slot;
    }
    victim->last_use = 0;  // an encode that throws leaves the slot empty
    victim->map = encode();
    victim->key = key;
    victim->last_use = ++clock_;
    return victim->map;
  }

  // FNV over the words, then a finalizer: addresses differ in their high bits, which FNV's low bits
  // do not see.
  static std::size_t set_of(const Key& key) {
    std::uint64_t h = moe_jit::IntArrayHash{}(key);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    return static_cast<std::size_t>((h ^ (h >> 31)) % kSets);
  }

  std::uint64_t clock_ = 0;
  std::array<std::array<Slot, kWays>, kSets> sets_{};
};

}  // namespace moe_launchers::sm90_gemm
