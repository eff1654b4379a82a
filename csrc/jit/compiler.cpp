#include "jit/compiler.hpp"

#include <atomic>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <future>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "jit/config.hpp"
#include "jit/exception.hpp"
#include "jit/files.hpp"
#include "jit/hash.hpp"
#include "jit/nvrtc.hpp"

namespace moe_jit {
namespace {

constexpr const char* kKeyVersion = "moe_jit cache v2";  // v2: the wgmma_serialized marker
constexpr size_t kMaxNameLength = 96;

using KernelPtr = std::shared_ptr<const CompiledKernel>;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct State {
  std::mutex mutex;
  JitConfig config;
  // Bumped by set_config so that builds started under old settings do not fill the new cache;
  // atomic so that KernelMemo can read it without the mutex.
  std::atomic<unsigned long long> generation{0};
  std::unordered_map<std::string, KernelPtr> ready;
  std::unordered_map<std::string, std::shared_future<KernelPtr>> pending;
  std::map<std::string, std::string> include_digests;
  std::map<std::string, std::string> nvcc_versions;
};

State& state() {
  static State s;
  return s;
}

bool is_valid_name(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameLength || name[0] == '.') return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}

std::string joined(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& p : parts) {
    if (!out.empty()) out += ' ';
    out += p;
  }
  return out;
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  if (from.empty()) return text;
  for (size_t pos = text.find(from); pos != std::string::npos; pos = text.find(from, pos)) {
    text.replace(pos, from.size(), to);
    pos += to.size();
  }
  return text;
}

// Content digest of the project's headers; computed once per folder per process.
std::string include_digest(const std::string& dir) {
  if (dir.empty()) return {};
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.include_digests.find(dir);
    if (it != s.include_digests.end()) return it->second;
  }
  MOE_HOST_ASSERT(files::is_dir(dir), "project include dir " << dir << " does not exist");
  Hasher hasher;
  for (const auto& rel : files::list_files_recursive(dir)) {
    hasher.field(rel).field(files::read(files::join(dir, rel)));
  }
  const std::string digest = hasher.hex();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.include_digests[dir] = digest;
  return digest;
}

std::string nvcc_version(const std::string& nvcc, const std::string& scratch) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.nvcc_versions.find(nvcc);
    if (it != s.nvcc_versions.end()) return it->second;
  }
  const auto result = files::run({nvcc, "--version"}, scratch);
  MOE_HOST_ASSERT(result.exit_code == 0,
                  "cannot run nvcc at '" << nvcc << "' (set MOE_JIT_NVCC or CUDA_HOME): "
                                         << result.output);
  // The last line, e.g. "Build cuda_13.0.r13.0/compiler.36424714_0", names the exact build.
  std::string text = result.output;
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  const auto last = text.find_last_of('\n');
  const std::string version = "nvcc " + (last == std::string::npos ? text : text.substr(last + 1));
  std::lock_guard<std::mutex> lock(s.mutex);
  s.nvcc_versions[nvcc] = version;
  return version;
}

// Options shared by both compilers, after the arch option.
std::vector<std::string> common_flags(const JitConfig& config) {
  std::vector<std::string> flags = {"-std=c++17"};
  if (!config.debug) flags.push_back("-DNDEBUG");
  if (config.debug) flags.push_back("-G");
  if (config.lineinfo) flags.push_back("-lineinfo");
  for (const auto& dir : config.include_dirs) flags.push_back("-I" + dir);
  for (const auto& flag : config.extra_flags) flags.push_back(flag);
  return flags;
}

std::vector<std::string> nvrtc_options(const JitConfig& config, const std::string& arch) {
  // -default-device makes unannotated (e.g. constexpr) functions usable in device code.
  std::vector<std::string> options = {"-arch=" + arch, "-default-device"};
  for (auto& flag : common_flags(config)) options.push_back(std::move(flag));
  if (config.ptxas_verbose) options.push_back("--ptxas-options=-v");
  return options;
}

// "sm_90a" -> "90a"
std::string arch_suffix(const std::string& arch) { return arch.substr(3); }

std::vector<std::string> nvcc_flags(const JitConfig& config, const std::string& arch) {
  const std::string target = arch_suffix(arch);
  // -gencode rather than -arch=sm_90a: the shorthand also runs a plain sm_90 pass that rejects
  // wgmma/setmaxnreg on some nvcc versions.
  std::vector<std::string> flags = {"-gencode=arch=compute_" + target + ",code=sm_" + target};
  for (auto& flag : common_flags(config)) flags.push_back(std::move(flag));
  // nvcc's counterpart of NVRTC's -default-device for constexpr functions.
  flags.push_back("--expt-relaxed-constexpr");
  if (config.ptxas_verbose) flags.push_back("-Xptxas=-v");
  return flags;
}

struct CompileOutput {
  bool ok = false;
  std::string log;
  std::string command;  // for messages
  std::string cubin;
  std::string ptx;
};

CompileOutput compile_nvrtc(const JitConfig& config, const std::string& arch,
                            const std::string& code, const std::string& source_path) {
  const nvrtc::NvrtcApi& api = nvrtc::api(config.nvrtc_path);
  const std::vector<std::string> options = nvrtc_options(config, arch);
  std::vector<const char*> option_ptrs;
  for (const auto& o : options) option_ptrs.push_back(o.c_str());

  CompileOutput out;
  out.command = "nvrtc (" + api.path + ") " + joined(options) + " " + source_path;
  if (config.print_command) std::fprintf(stderr, "[moe_jit] %s\n", out.command.c_str());

  nvrtc::nvrtcProgram program = nullptr;
  const auto created =
      api.nvrtcCreateProgram(&program, code.c_str(), source_path.c_str(), 0, nullptr, nullptr);
  MOE_HOST_ASSERT(created == nvrtc::NVRTC_SUCCESS,
                  "nvrtcCreateProgram failed: " << api.nvrtcGetErrorString(created));
  struct Destroy {
    const nvrtc::NvrtcApi& api;
    nvrtc::nvrtcProgram* program;
    ~Destroy() { api.nvrtcDestroyProgram(program); }
  } destroy{api, &program};

  const auto compiled =
      api.nvrtcCompileProgram(program, static_cast<int>(option_ptrs.size()), option_ptrs.data());
  size_t log_size = 0;
  if (api.nvrtcGetProgramLogSize(program, &log_size) == nvrtc::NVRTC_SUCCESS && log_size > 1) {
    out.log.resize(log_size);
    api.nvrtcGetProgramLog(program, &out.log[0]);
    out.log.resize(log_size - 1);
  }
  if (compiled != nvrtc::NVRTC_SUCCESS) {
    out.log = std::string(api.nvrtcGetErrorString(compiled)) + "\n" + out.log;
    return out;
  }
  size_t cubin_size = 0;
  MOE_HOST_ASSERT(api.nvrtcGetCUBINSize(program, &cubin_size) == nvrtc::NVRTC_SUCCESS &&
                      cubin_size > 0,
                  "NVRTC produced no cubin for " << arch << " (is the arch an sm_ target?)");
  out.cubin.resize(cubin_size);
  MOE_HOST_ASSERT(api.nvrtcGetCUBIN(program, &out.cubin[0]) == nvrtc::NVRTC_SUCCESS,
                  "nvrtcGetCUBIN failed");
  if (config.keep_ptx) {
    // NVRTC keeps the PTX of an sm_ compile, so no second compile is needed.
    size_t ptx_size = 0;
    if (api.nvrtcGetPTXSize(program, &ptx_size) == nvrtc::NVRTC_SUCCESS && ptx_size > 1) {
      out.ptx.resize(ptx_size);
      api.nvrtcGetPTX(program, &out.ptx[0]);
      out.ptx.resize(ptx_size - 1);
    }
  }
  out.ok = true;
  return out;
}

CompileOutput compile_nvcc(const JitConfig& config, const std::string& arch,
                           const std::string& dir) {
  const std::string source = files::join(dir, "kernel.cu");
  const std::string cubin = files::join(dir, "kernel.cubin");
  std::vector<std::string> argv = {config.nvcc_path, "-cubin", "-o", cubin, source};
  for (auto& flag : nvcc_flags(config, arch)) argv.push_back(std::move(flag));

  CompileOutput out;
  out.command = joined(argv);
  if (config.print_command) std::fprintf(stderr, "[moe_jit] %s\n", out.command.c_str());
  const auto result = files::run(argv, files::join(dir, "nvcc.log"));
  out.log = result.output;
  if (result.exit_code != 0 || !files::try_read(cubin, out.cubin) || out.cubin.empty()) {
    if (result.exit_code == 0) out.log += "\nnvcc exited 0 but wrote no cubin";
    return out;
  }
  if (config.keep_ptx) {
    const std::string ptx = files::join(dir, "kernel.ptx");
    const std::string target = arch_suffix(arch);
    std::vector<std::string> flags = nvcc_flags(config, arch);
    flags.front() = "-gencode=arch=compute_" + target + ",code=compute_" + target;
    std::vector<std::string> ptx_argv = {config.nvcc_path, "-ptx", "-o", ptx, source};
    for (auto& flag : flags) ptx_argv.push_back(std::move(flag));
    const auto ptx_result = files::run(ptx_argv, files::join(dir, "nvcc_ptx.log"));
    if (ptx_result.exit_code != 0 || !files::try_read(ptx, out.ptx)) {
      std::fprintf(stderr, "[moe_jit] warning: nvcc -ptx failed, no kernel.ptx kept:\n%s\n",
                   ptx_result.output.c_str());
    }
  }
  out.ok = true;
  return out;
}

// Where a failed compile's source is kept for the user; returns its kernel.cu path.
std::string keep_failed(const std::string& cache_dir, const std::string& name,
                        const std::string& key, const std::string& tmp_dir) {
  const std::string failed = files::join(files::join(files::join(cache_dir, "failed"), name), key);
  files::remove_tree(failed);
  files::make_dirs(files::dir_name(failed));
  if (std::rename(tmp_dir.c_str(), failed.c_str()) != 0) return files::join(tmp_dir, "kernel.cu");
  return files::join(failed, "kernel.cu");
}

void write_sass(const JitConfig& config, const std::string& dir) {
  if (config.cuobjdump_path.empty()) return;
  const auto result = files::run({config.cuobjdump_path, "-sass", files::join(dir, "kernel.cubin")},
                                 files::join(dir, "cuobjdump.log"));
  if (result.exit_code == 0) {
    files::write(files::join(dir, "kernel.sass"), result.output);
  } else {
    std::fprintf(stderr, "[moe_jit] warning: cuobjdump failed, no kernel.sass kept:\n%s\n",
                 result.output.c_str());
  }
}

// An ELF64 image whose program and section header tables lie inside it: a cubin cut short (a
// crash or power loss before the bytes reached the disk) or emptied fails, and is rebuilt.
bool is_whole_cubin(const std::string& bytes) {
  if (bytes.size() < 64 || bytes.compare(0, 4, "\x7f" "ELF") != 0 || bytes[4] != 2) return false;
  const auto read = [&](std::size_t offset, std::size_t width) {
    std::uint64_t value = 0;
    for (std::size_t i = 0; i < width; ++i) value |= std::uint64_t(static_cast<unsigned char>(bytes[offset + i])) << (8 * i);
    return value;
  };
  const std::uint64_t ph_end = read(0x20, 8) + read(0x36, 2) * read(0x38, 2);
  const std::uint64_t sh_end = read(0x28, 8) + read(0x3A, 2) * read(0x3C, 2);
  return ph_end <= bytes.size() && sh_end <= bytes.size() && read(0x3C, 2) > 0;
}

// ptxas's remark when it gives up pipelining wgmmas; a compile that printed it leaves a marker file
// (kWgmmaSerializedFile) beside the cubin so cache hits know it too.
constexpr const char* kWgmmaSerializedRemark = "wgmma.mma_async instructions are serialized";
constexpr const char* kWgmmaSerializedFile = "wgmma_serialized";

bool marked_serialized(const std::string& dir) { return files::is_file(files::join(dir, kWgmmaSerializedFile)); }

bool has_whole_cubin(const std::string& dir) {
  std::string bytes;
  return files::try_read(files::join(dir, "kernel.cubin"), bytes) && is_whole_cubin(bytes);
}

// Moves the finished tmp folder to `final_dir`. Returns false when another process got there
// first with a whole cubin (its files are then used and tmp is dropped).
bool publish(const std::string& tmp_dir, const std::string& final_dir) {
  files::make_dirs(files::dir_name(final_dir));
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (std::rename(tmp_dir.c_str(), final_dir.c_str()) == 0) return true;
    const int err = errno;
    MOE_HOST_ASSERT(err == EEXIST || err == ENOTEMPTY,
                    "cannot move " << tmp_dir << " to " << final_dir << ": " << std::strerror(err));
    if (has_whole_cubin(final_dir)) {
      files::remove_tree(tmp_dir);
      return false;
    }
    // A folder without a whole cubin was not made by a finished compile; replace it.
    files::remove_tree(final_dir);
  }
  MOE_JIT_THROW("cannot move " << tmp_dir << " to " << final_dir << ": it keeps reappearing");
}

KernelPtr compile_or_load(const JitConfig& config, const std::string& name,
                          const std::string& code, const std::string& arch) {
  const auto start = Clock::now();
  MOE_HOST_ASSERT(!config.cache_dir.empty(),
                  "the JIT is not configured: call kernels.jit.ensure_configured() first");
  const bool use_nvcc = config.compiler == "nvcc";
  const std::string tmp_root = files::join(config.cache_dir, "tmp");
  files::make_dirs(tmp_root);

  std::string compiler_id;
  std::vector<std::string> flags;
  if (use_nvcc) {
    compiler_id = nvcc_version(config.nvcc_path,
                               files::join(tmp_root, "nvcc-version." + files::unique_suffix()));
    flags = nvcc_flags(config, arch);
  } else {
    const auto& api = nvrtc::api(config.nvrtc_path);
    compiler_id = "nvrtc " + std::to_string(api.major) + "." + std::to_string(api.minor);
    flags = nvrtc_options(config, arch);
  }

  Hasher hasher;
  hasher.field(kKeyVersion).field(name).field(compiler_id).field(arch);
  hasher.field(static_cast<std::uint64_t>(flags.size()));
  // Include folders enter the key by what they hold, not where they are (a cache built in one
  // install location serves another): the project headers' content digest, and in the salt the
  // header packages' versions and the toolkit's CUDA_VERSION.
  for (const auto& flag : flags) hasher.field(flag.rfind("-I", 0) == 0 ? std::string("-I") : flag);
  hasher.field(config.cache_salt).field(include_digest(config.project_include_dir)).field(code);

  auto kernel = std::make_shared<CompiledKernel>();
  kernel->name = name;
  kernel->arch = arch;
  kernel->key = hasher.hex();
  kernel->compiler = compiler_id;
  const std::string final_dir = files::join(files::join(config.cache_dir, name), kernel->key);
  kernel->cubin_path = files::join(final_dir, "kernel.cubin");
  kernel->source_path = files::join(final_dir, "kernel.cu");

  if (files::try_read(kernel->cubin_path, kernel->cubin) && is_whole_cubin(kernel->cubin)) {
    kernel->from_cache = true;
    kernel->wgmma_serialized = marked_serialized(final_dir);
    kernel->compile_seconds = seconds_since(start);
    if (config.print_command) {
      std::fprintf(stderr, "[moe_jit] %s for %s: cache hit %s\n", name.c_str(), arch.c_str(),
                   kernel->cubin_path.c_str());
    }
    return kernel;
  }

  const std::string tmp_dir =
      files::join(tmp_root, name + "-" + kernel->key + "." + files::unique_suffix());
  files::make_dirs(tmp_dir);
  const std::string tmp_source = files::join(tmp_dir, "kernel.cu");
  files::write(tmp_source, code);
  if (config.print_command) {
    std::fprintf(stderr, "[moe_jit] compiling %s for %s into %s\n", name.c_str(), arch.c_str(),
                 final_dir.c_str());
  }

  CompileOutput output;
  try {
    output = use_nvcc ? compile_nvcc(config, arch, tmp_dir)
                      : compile_nvrtc(config, arch, code, tmp_source);
  } catch (...) {
    files::remove_tree(tmp_dir);
    throw;
  }
  if (!output.ok) {
    const std::string kept = keep_failed(config.cache_dir, name, kernel->key, tmp_dir);
    const std::string log = replace_all(output.log, tmp_dir, files::dir_name(kept));
    MOE_JIT_THROW("JIT compilation of kernel '" << name << "' for " << arch << " failed ("
                                                << compiler_id << ").\nGenerated source: " << kept
                                                << "\nCommand: "
                                                << replace_all(output.command, tmp_dir,
                                                               files::dir_name(kept))
                                                << "\nCompiler log:\n"
                                                << log);
  }
  if ((config.ptxas_verbose || config.print_command) && !output.log.empty()) {
    std::fprintf(stderr, "[moe_jit] %s (%s) compiler output:\n%s\n", name.c_str(),
                 kernel->key.c_str(), output.log.c_str());
  }

  kernel->wgmma_serialized = output.log.find(kWgmmaSerializedRemark) != std::string::npos;
  try {
    if (!use_nvcc) files::write(files::join(tmp_dir, "kernel.cubin"), output.cubin);
    if (kernel->wgmma_serialized) files::write(files::join(tmp_dir, kWgmmaSerializedFile), output.log);
    ::unlink(files::join(tmp_dir, "nvcc.log").c_str());
    if (config.keep_ptx) {
      if (!output.ptx.empty()) files::write(files::join(tmp_dir, "kernel.ptx"), output.ptx);
      write_sass(config, tmp_dir);
    }
    if (!publish(tmp_dir, final_dir)) {
      kernel->from_cache = true;
      kernel->wgmma_serialized = marked_serialized(final_dir);
      kernel->cubin = files::read(kernel->cubin_path);
      if (!is_whole_cubin(kernel->cubin)) kernel->cubin = std::move(output.cubin);  // damaged since: ours is whole
      kernel->compile_seconds = seconds_since(start);
      return kernel;
    }
  } catch (...) {
    files::remove_tree(tmp_dir);
    throw;
  }
  kernel->cubin = std::move(output.cubin);
  kernel->compile_seconds = seconds_since(start);
  return kernel;
}

}  // namespace

bool is_valid_arch(const std::string& arch) {
  if (arch.size() < 5 || arch.compare(0, 3, "sm_") != 0) return false;
  size_t i = 3;
  while (i < arch.size() && arch[i] >= '0' && arch[i] <= '9') ++i;
  const size_t digits = i - 3;
  if (digits < 2 || digits > 3) return false;
  if (i == arch.size()) return true;
  return i + 1 == arch.size() && (arch[i] == 'a' || arch[i] == 'f');
}

unsigned long long config_generation() { return state().generation.load(std::memory_order_acquire); }

JitConfig get_config() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.config;
}

// Removes what compiles killed mid-way left in <cache>/tmp: entries (named <...>.<pid>.<thread>.
// <counter>) whose process is gone and that are over an hour old (a process of another host
// sharing the folder may have a pid unknown here; no compile takes an hour).
void sweep_tmp(const std::string& cache_dir) {
  const std::string tmp_root = files::join(cache_dir, "tmp");
  if (!files::is_dir(tmp_root)) return;
  const std::time_t now = std::time(nullptr);
  for (const auto& entry : files::list_dir(tmp_root)) {
    const auto last = entry.rfind('.');
    const auto middle = last == std::string::npos || last == 0 ? std::string::npos : entry.rfind('.', last - 1);
    const auto first = middle == std::string::npos || middle == 0 ? std::string::npos : entry.rfind('.', middle - 1);
    if (first == std::string::npos) continue;
    const std::string pid_text = entry.substr(first + 1, middle - first - 1);
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    const std::string path = files::join(tmp_root, entry);
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0 || now - info.st_mtime < 3600) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    files::remove_tree(path);
  }
}

void set_config(const JitConfig& config) {
  MOE_HOST_ASSERT(config.compiler == "nvrtc" || config.compiler == "nvcc",
                  "JIT compiler must be 'nvrtc' or 'nvcc', got '" << config.compiler << "'");
  MOE_HOST_ASSERT(config.compiler != "nvcc" || !config.nvcc_path.empty(),
                  "the nvcc compiler was chosen but no nvcc path was given");
  MOE_HOST_ASSERT(!config.cache_dir.empty(), "the JIT cache dir must not be empty");
  JitConfig copy = config;
  copy.cache_dir = files::absolute(config.cache_dir);
  try {
    sweep_tmp(copy.cache_dir);
  } catch (...) {  // a folder another process is removing: the sweep is best effort
  }
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.config = std::move(copy);
  ++s.generation;
  s.ready.clear();
  s.pending.clear();
  s.include_digests.clear();  // headers edited since are hashed again
}

BuildOutcome build_with_outcome(const std::string& name, const std::string& code,
                                const std::string& arch) {
  const auto start = Clock::now();
  MOE_HOST_ASSERT(is_valid_name(name), "kernel name '" << name
                                                       << "' must be 1-" << kMaxNameLength
                                                       << " characters of [A-Za-z0-9_.-], "
                                                          "not starting with '.'");
  MOE_HOST_ASSERT(is_valid_arch(arch),
                  "arch '" << arch << "' must look like 'sm_90a', 'sm_100a' or 'sm_89'");
  MOE_HOST_ASSERT(!code.empty(), "kernel '" << name << "': the generated code is empty");

  std::string memory_key;
  memory_key.reserve(name.size() + arch.size() + code.size() + 2);
  memory_key.append(name).append(1, '\0').append(arch).append(1, '\0').append(code);

  State& s = state();
  std::promise<KernelPtr> promise;
  JitConfig config;
  unsigned long long generation = 0;
  {
    std::unique_lock<std::mutex> lock(s.mutex);
    const auto hit = s.ready.find(memory_key);
    if (hit != s.ready.end()) return {hit->second, true, seconds_since(start)};
    const auto in_flight = s.pending.find(memory_key);
    if (in_flight != s.pending.end()) {
      std::shared_future<KernelPtr> future = in_flight->second;
      lock.unlock();
      return {future.get(), true, seconds_since(start)};
    }
    s.pending.emplace(memory_key, promise.get_future().share());
    config = s.config;
    generation = s.generation;
  }

  KernelPtr kernel;
  try {
    kernel = compile_or_load(config, name, code, arch);
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (s.generation == generation) s.pending.erase(memory_key);
    }
    promise.set_exception(std::current_exception());
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.generation == generation) {
      s.ready.emplace(memory_key, kernel);
      s.pending.erase(memory_key);
    }
  }
  promise.set_value(kernel);
  return {kernel, false, seconds_since(start)};
}

std::shared_ptr<const CompiledKernel> build(const std::string& name, const std::string& code,
                                            const std::string& arch) {
  return build_with_outcome(name, code, arch).kernel;
}

}  // namespace moe_jit
