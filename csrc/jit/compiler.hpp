#pragma once
// Compile-or-load of generated CUDA translation units into cubins, with a disk cache shared by all
// processes and an in-memory cache per process.
//
// Disk layout: <cache_dir>/<name>/<key>/{kernel.cu, kernel.cubin[, kernel.ptx, kernel.sass,
// wgmma_serialized]}.
// A compile writes into <cache_dir>/tmp/<unique> and renames that folder into place, so a reader
// never sees a half-written cubin; the loser of a rename race uses the winner's files. A failed
// compile leaves its source in <cache_dir>/failed/<name>/<key>/.
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace moe_jit {

struct CompiledKernel {
  std::string name;         // family name, the cache sub-folder
  std::string arch;         // "sm_90a"
  std::string key;          // 32 hex digits: hash of everything that determines the cubin
  std::string compiler;     // "nvrtc 13.0" or nvcc's version line
  std::string cubin;        // the ELF image
  std::string cubin_path;
  std::string source_path;
  bool from_cache = false;  // loaded from the disk cache rather than compiled by this process
  // ptxas serialized the kernel's wgmmas (a wait after each; remarks C7510-C7520, which it prints
  // without -v). The tensor cores then idle between wgmmas: launchers may plan around such a kernel.
  bool wgmma_serialized = false;
  double compile_seconds = 0.0;  // time to compile it, or to load it from disk
};

// Compile-or-load. `name` is a short family name ([A-Za-z0-9_.-], at most 96 characters) used for
// the cache folder; `code` is the whole generated translation unit, which must define exactly one
// __global__ function (one explicit template instantiation); `arch` is "sm_90a", "sm_100a",
// "sm_89", ... Thread-safe; concurrent builds of one kernel compile it once. Memory cache keyed by
// (name, arch, code): a hit does no disk access and no hashing of headers. Raises JitError.
std::shared_ptr<const CompiledKernel> build(const std::string& name, const std::string& code,
                                            const std::string& arch);

struct BuildOutcome {
  std::shared_ptr<const CompiledKernel> kernel;
  bool memory_hit = false;  // served from this process's memory cache (or a concurrent build)
  double seconds = 0.0;     // wall time of this call
};
// build() that also says how the kernel was obtained (for Python and the tests).
BuildOutcome build_with_outcome(const std::string& name, const std::string& code,
                                const std::string& arch);

// True for "sm_<digits>" with an optional "a" or "f" suffix.
bool is_valid_arch(const std::string& arch);

// Bumped whenever the JIT configuration changes (set_config empties the caches).
unsigned long long config_generation();

// A launcher's memo from its compile-time parameters (a small key) to the kernel, so the per-call
// path neither generates nor hashes source code. Emptied when the JIT configuration changes.
template <typename Key, typename Hash>
class KernelMemo {
 public:
  template <typename Make>
  std::shared_ptr<const CompiledKernel> get(const Key& key, Make&& make) {
    const unsigned long long generation = config_generation();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (generation_ != generation) {
        map_.clear();
        generation_ = generation;
      }
      const auto it = map_.find(key);
      if (it != map_.end()) return it->second;
    }
    std::shared_ptr<const CompiledKernel> kernel = make();  // compiles or loads, unlocked
    std::lock_guard<std::mutex> lock(mutex_);
    if (generation_ == generation) map_.emplace(key, kernel);
    return kernel;
  }

 private:
  std::mutex mutex_;
  unsigned long long generation_ = ~0ull;
  std::unordered_map<Key, std::shared_ptr<const CompiledKernel>, Hash> map_;
};

// Hash of a std::array of ints, for KernelMemo keys.
struct IntArrayHash {
  template <typename Array>
  std::size_t operator()(const Array& a) const {
    std::size_t h = 1469598103934665603ull;
    for (const auto v : a) h = (h ^ static_cast<std::size_t>(v)) * 1099511628211ull;
    return h;
  }
};

}  // namespace moe_jit
