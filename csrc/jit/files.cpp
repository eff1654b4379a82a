#include "jit/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>

#include "jit/exception.hpp"

extern char** environ;

namespace moe_jit::files {

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (a.back() == '/') return a + b;
  return a + "/" + b;
}

std::string dir_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool try_read(const std::string& path, std::string& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string data;
  char buffer[1 << 16];
  bool ok = true;
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      ok = false;
      break;
    }
    data.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  if (ok) out = std::move(data);
  return ok;
}

std::string read(const std::string& path) {
  std::string data;
  MOE_HOST_ASSERT(try_read(path, data), "cannot read " << path << ": " << std::strerror(errno));
  return data;
}

void write(const std::string& path, const std::string& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MOE_HOST_ASSERT(fd >= 0, "cannot create " << path << ": " << std::strerror(errno));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      MOE_JIT_THROW("cannot write " << path << ": " << std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  MOE_HOST_ASSERT(::close(fd) == 0, "cannot write " << path << ": " << std::strerror(errno));
}

void make_dirs(const std::string& path) {
  if (path.empty() || is_dir(path)) return;
  const std::string parent = dir_name(path);
  if (parent != path) make_dirs(parent);
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    MOE_JIT_THROW("cannot create folder " << path << ": " << std::strerror(errno));
  }
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& name : list_dir(path)) remove_tree(join(path, name));
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) return names;
  while (const dirent* entry = ::readdir(handle)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(handle);
  std::sort(names.begin(), names.end());
  return names;
}

namespace {
void collect_files(const std::string& root, const std::string& relative,
                   std::vector<std::string>& out) {
  const std::string dir = relative.empty() ? root : join(root, relative);
  for (const auto& name : list_dir(dir)) {
    const std::string rel = relative.empty() ? name : join(relative, name);
    const std::string full = join(root, rel);
    if (is_dir(full)) {
      collect_files(root, rel, out);
    } else if (is_file(full)) {
      out.push_back(rel);
    }
  }
}
}  // namespace

std::vector<std::string> list_files_recursive(const std::string& dir) {
  std::vector<std::string> out;
  collect_files(dir, "", out);
  std::sort(out.begin(), out.end());
  return out;
}

std::string absolute(const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  char buffer[4096];
  MOE_HOST_ASSERT(::getcwd(buffer, sizeof(buffer)) != nullptr,
                  "cannot read the working folder: " << std::strerror(errno));
  return join(buffer, path);
}

ProcessResult run(const std::vector<std::string>& argv, const std::string& output_path) {
  MOE_HOST_ASSERT(!argv.empty(), "run: empty command");
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, output_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);

  ProcessResult result;
  pid_t pid = 0;
  const int spawn_error = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawn_error != 0) {
    result.output = "cannot start " + argv[0] + ": " + std::strerror(spawn_error);
    return result;
  }
  int status = 0;
  bool waited = true;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {  // e.g. ECHILD with SIGCHLD ignored: the exit status is unknown, not 0
      waited = false;
      break;
    }
  }
  if (waited && WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  try_read(output_path, result.output);
  ::unlink(output_path.c_str());
  return result;
}

std::string unique_suffix() {
  static std::atomic<unsigned long long> counter{0};
  const auto thread = std::hash<std::thread::id>{}(std::this_thread::get_id());
  return std::to_string(::getpid()) + "." + std::to_string(thread % 1000000007ULL) + "." +
         std::to_string(counter.fetch_add(1));
}

}  // namespace moe_jit::files
