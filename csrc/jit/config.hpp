#pragma once
// JIT settings, set once from Python (kernels/jit.py reads the MOE_JIT_* environment variables and
// finds the libraries and headers) and read by the compiler.
#include <mutex>
#include <string>
#include <vector>

namespace moe_jit {

struct JitConfig {
  // Passed as -I in this order. The project's own include dir must be among them.
  std::vector<std::string> include_dirs;
  // The project's device templates: every file under it is content-hashed into the cache key.
  std::string project_include_dir;
  std::string nvrtc_path;     // libnvrtc.so.*; loaded at the first NVRTC compile
  std::string cache_dir;      // <cache_dir>/<name>/<key>/kernel.cubin
  std::string compiler = "nvrtc";  // "nvrtc" or "nvcc"
  std::string nvcc_path;
  std::string cuobjdump_path;  // for kernel.sass when keep_ptx; empty when absent
  std::vector<std::string> extra_flags;
  // Versions of the header packages (CUTLASS, CCCL, CUDA headers) that the content hash of the
  // project include dir does not cover.
  std::string cache_salt;
  bool debug = false;          // -G, and no -DNDEBUG
  bool lineinfo = false;       // -lineinfo
  bool ptxas_verbose = false;  // ptxas -v, its report printed to stderr
  bool print_command = false;  // compiler command line and cache path printed to stderr
  bool keep_ptx = false;       // kernel.ptx (and kernel.sass) kept beside kernel.cubin
};

// A copy of the current settings.
JitConfig get_config();
// Replaces the settings and empties the in-memory kernel cache, whose entries were keyed under the
// old settings. Kernels already handed out stay valid.
void set_config(const JitConfig& config);

}  // namespace moe_jit
