#pragma once
// Python entry points of the JIT engine and the device runtime. kernels/jit.py wraps them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "jit/compiler.hpp"
#include "jit/config.hpp"
#include "jit/device_runtime.hpp"
#include "jit/exception.hpp"
#include "jit/kernel_runtime.hpp"

namespace moe_apis::runtime {

namespace py = pybind11;

inline py::dict config_to_dict(const moe_jit::JitConfig& c) {
  py::dict d;
  d["include_dirs"] = c.include_dirs;
  d["project_include_dir"] = c.project_include_dir;
  d["nvrtc_path"] = c.nvrtc_path;
  d["cache_dir"] = c.cache_dir;
  d["compiler"] = c.compiler;
  d["nvcc_path"] = c.nvcc_path;
  d["cuobjdump_path"] = c.cuobjdump_path;
  d["extra_flags"] = c.extra_flags;
  d["cache_salt"] = c.cache_salt;
  d["debug"] = c.debug;
  d["lineinfo"] = c.lineinfo;
  d["ptxas_verbose"] = c.ptxas_verbose;
  d["print_command"] = c.print_command;
  d["keep_ptx"] = c.keep_ptx;
  return d;
}

inline py::dict outcome_to_dict(const moe_jit::BuildOutcome& outcome) {
  const moe_jit::CompiledKernel& k = *outcome.kernel;
  py::dict d;
  d["name"] = k.name;
  d["arch"] = k.arch;
  d["key"] = k.key;
  d["compiler"] = k.compiler;
  d["cubin"] = py::bytes(k.cubin);
  d["cubin_path"] = k.cubin_path;
  d["source_path"] = k.source_path;
  d["from_cache"] = k.from_cache || outcome.memory_hit;
  d["memory_hit"] = outcome.memory_hit;
  d["compile_seconds"] = outcome.memory_hit ? outcome.seconds : k.compile_seconds;
  d["wgmma_serialized"] = k.wgmma_serialized;
  return d;
}

inline py::dict device_info_to_dict(int device) {
  const moe_jit::DeviceInfo& info = moe_jit::device_info(device);
  py::dict d;
  d["major"] = info.major;
  d["minor"] = info.minor;
  d["num_sms"] = info.num_sms;
  d["smem_optin"] = info.smem_optin;
  d["smem_per_sm"] = info.smem_per_sm;
  d["l2_bytes"] = info.l2_bytes;
  d["name"] = info.name;
  return d;
}

using Dim3 = std::tuple<unsigned, unsigned, unsigned>;

inline void launch_raw(const std::string& name, const std::string& code, const std::string& arch,
                       const Dim3& grid, const Dim3& block, unsigned smem_bytes,
                       unsigned cluster_dim, bool pdl, std::uint64_t stream, int device,
                       const std::vector<std::int64_t>& args) {
  const auto kernel = moe_jit::build(name, code, arch);
  moe_jit::LaunchConfig cfg;
  std::tie(cfg.grid_x, cfg.grid_y, cfg.grid_z) = grid;
  std::tie(cfg.block_x, cfg.block_y, cfg.block_z) = block;
  cfg.smem_bytes = smem_bytes;
  cfg.cluster_dim = cluster_dim;
  cfg.pdl = pdl;
  cfg.stream = stream;
  cfg.device = device;
  std::vector<std::int64_t> values = args;
  std::vector<void*> params;
  params.reserve(values.size() + 1);
  for (auto& v : values) params.push_back(&v);
  params.push_back(nullptr);
  moe_jit::launch_with_params(*kernel, cfg, params.data());
}

inline void register_apis(py::module_& m) {
  py::register_exception<moe_jit::JitError>(m, "JitError", PyExc_RuntimeError);

  m.def(
      "jit_configure",
      [](std::vector<std::string> include_dirs, std::string project_include_dir,
         std::string nvrtc_path, std::string cache_dir, std::string compiler,
         std::string nvcc_path, std::string cuobjdump_path, std::vector<std::string> extra_flags,
         std::string cache_salt, bool debug, bool lineinfo, bool ptxas_verbose,
         bool print_command, bool keep_ptx) {
        moe_jit::JitConfig c;
        c.include_dirs = std::move(include_dirs);
        c.project_include_dir = std::move(project_include_dir);
        c.nvrtc_path = std::move(nvrtc_path);
        c.cache_dir = std::move(cache_dir);
        c.compiler = std::move(compiler);
        c.nvcc_path = std::move(nvcc_path);
        c.cuobjdump_path = std::move(cuobjdump_path);
        c.extra_flags = std::move(extra_flags);
        c.cache_salt = std::move(cache_salt);
        c.debug = debug;
        c.lineinfo = lineinfo;
        c.ptxas_verbose = ptxas_verbose;
        c.print_command = print_command;
        c.keep_ptx = keep_ptx;
        moe_jit::set_config(c);
      },
      py::kw_only(), py::arg("include_dirs"), py::arg("project_include_dir"),
      py::arg("nvrtc_path"), py::arg("cache_dir"), py::arg("compiler") = "nvrtc",
      py::arg("nvcc_path") = "", py::arg("cuobjdump_path") = "",
      py::arg("extra_flags") = std::vector<std::string>{}, py::arg("cache_salt") = "",
      py::arg("debug") = false, py::arg("lineinfo") = false, py::arg("ptxas_verbose") = false,
      py::arg("print_command") = false, py::arg("keep_ptx") = false,
      "Set the JIT settings (all of them) and empty the in-memory kernel cache.");

  m.def(
      "jit_config", [] { return config_to_dict(moe_jit::get_config()); },
      "The current JIT settings as a dict.");

  m.def(
      "jit_build",
      [](const std::string& name, const std::string& code, const std::string& arch) {
        moe_jit::BuildOutcome outcome;
        {
          py::gil_scoped_release release;
          outcome = moe_jit::build_with_outcome(name, code, arch);
        }
        return outcome_to_dict(outcome);
      },
      py::arg("name"), py::arg("code"), py::arg("arch"),
      "Compile `code` for `arch` (or load it from the caches); no GPU needed. Returns a dict: "
      "name, arch, key, compiler, cubin (bytes), cubin_path, source_path, from_cache, memory_hit, "
      "compile_seconds, wgmma_serialized.");

  m.def(
      "jit_launch_raw",
      [](const std::string& name, const std::string& code, const std::string& arch,
         const Dim3& grid, const Dim3& block, unsigned smem_bytes, unsigned cluster_dim, bool pdl,
         std::uint64_t stream, int device, const std::vector<std::int64_t>& args) {
        py::gil_scoped_release release;
        launch_raw(name, code, arch, grid, block, smem_bytes, cluster_dim, pdl, stream, device,
                   args);
      },
      py::arg("name"), py::arg("code"), py::arg("arch"), py::arg("grid"), py::arg("block"),
      py::arg("smem_bytes") = 0, py::arg("cluster_dim") = 1, py::arg("pdl") = false,
      py::arg("stream") = 0, py::arg("device") = 0, py::arg("args") = std::vector<std::int64_t>{},
      "Build and launch a kernel whose parameters are all 64-bit (pointers, long long); each "
      "entry of `args` is passed as one 64-bit value. For testing the launch path.");

  m.def("device_count", &moe_jit::device_count, "Number of CUDA devices the driver sees.");
  m.def("device_info", &device_info_to_dict, py::arg("device"),
        "Cached device facts: major, minor, num_sms, smem_optin, smem_per_sm, l2_bytes, name.");
  m.def("device_arch", &moe_jit::device_arch, py::arg("device"),
        "'sm_90a' for 9.0, 'sm_100a' for 10.0, else 'sm_<major><minor>'.");
  m.def("get_num_sms", &moe_jit::get_num_sms, py::arg("device"),
        "SM count kernels plan for: the set_num_sms override or the device's count.");
  m.def("set_num_sms", &moe_jit::set_num_sms, py::arg("num_sms"), py::arg("device"),
        "Override the SM count kernels plan for; 1 <= num_sms <= the SM count of `device`.");
  m.def("reset_num_sms", &moe_jit::reset_num_sms, "Drop the set_num_sms override.");
}

}  // namespace moe_apis::runtime
