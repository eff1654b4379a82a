#pragma once
// A memo of values the launchers derive from the process environment on every call (the tile
// heuristics read a dozen MOE_* switches, each a getenv scan of the environment). A value stays
// while the environment is unchanged; any change empties the memo, so a switch set between two
// calls still applies to the second.
//
// "Unchanged" is decided on `environ` itself: glibc's setenv and unsetenv (os.environ's writes)
// replace or remove an entry's pointer and never edit or free the string it points to, so the same
// list of pointers means the same variables. Not covered: a C caller that edits a string it gave
// putenv in place, and C libraries whose setenv frees the old string (musl), where a new value can
// come back at the old address. Comparing the pointers costs about one cache line per eight
// variables (13 ns for 39 of them on the development CPU), against the heuristics it saves.
#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

extern "C" char** environ;

namespace moe_jit {

class EnvFingerprint {
 public:
  // Whether the environment is the one of the previous call (false on the first call); the
  // current one is remembered either way.
  bool unchanged() {
    std::size_t n = 0;
    bool same = taken_;
    for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry, ++n) {
      same = same && n < entries_.size() && entries_[n] == *entry;
    }
    same = same && n == entries_.size();
    if (!same) {
      entries_.assign(environ, environ + n);
      taken_ = true;
    }
    return same;
  }

 private:
  bool taken_ = false;
  std::vector<const char*> entries_;
};

// Key -> Value, computed by `make` on a miss. Thread-safe (the launchers run with the GIL released);
// `make` runs under the lock and may throw, which caches nothing. At most kMaxEntries keys (a
// serving loop's distinct M values included) before the memo starts over.
template <typename Key, typename Value, typename Hash>
class EnvMemo {
 public:
  static constexpr std::size_t kMaxEntries = 4096;

  template <typename Make>
  Value get(const Key& key, Make&& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!env_.unchanged()) map_.clear();
    const auto it = map_.find(key);
    if (it != map_.end()) return it->second;
    ++misses_;
    Value value = make();
    if (map_.size() >= kMaxEntries) map_.clear();
    map_.emplace(key, value);
    return value;
  }

  // Calls that ran `make` so far (for tests).
  long long misses() {
    std::lock_guard<std::mutex> lock(mutex_);
    return misses_;
  }

 private:
  long long misses_ = 0;
  std::mutex mutex_;
  EnvFingerprint env_;
  std::unordered_map<Key, Value, Hash> map_;
};

}  // namespace moe_jit
