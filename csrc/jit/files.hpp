#pragma once
// File-system and process helpers of the JIT, on POSIX calls: std::filesystem is avoided so that
// the module has no dependency on the libstdc++ that happens to be loaded first in the process.
#include <string>
#include <vector>

namespace moe_jit::files {

std::string join(const std::string& a, const std::string& b);
std::string dir_name(const std::string& path);
bool is_file(const std::string& path);
bool is_dir(const std::string& path);

// Returns false when the file cannot be opened or read.
bool try_read(const std::string& path, std::string& out);
// Raises JitError.
std::string read(const std::string& path);
void write(const std::string& path, const std::string& data);
// mkdir -p; raises JitError.
void make_dirs(const std::string& path);
// rm -rf; best effort (a cache folder that cannot be cleaned is left for the user).
void remove_tree(const std::string& path);
// Names in a folder (no "." or ".."); empty when it cannot be read.
std::vector<std::string> list_dir(const std::string& dir);
// Relative paths of all regular files under `dir`, sorted.
std::vector<std::string> list_files_recursive(const std::string& dir);
// An absolute version of `path` (relative paths are taken from the working folder).
std::string absolute(const std::string& path);

struct ProcessResult {
  int exit_code = -1;  // -1 when it could not be started or was killed by a signal
  std::string output;  // stdout and stderr together
};
// Runs argv[0] (searched in PATH when it has no '/') with stdout and stderr captured through the
// file `output_path`, which is removed afterwards.
ProcessResult run(const std::vector<std::string>& argv, const std::string& output_path);

// A name no other thread or process uses: "<pid>.<thread>.<counter>".
std::string unique_suffix();

}  // namespace moe_jit::files
