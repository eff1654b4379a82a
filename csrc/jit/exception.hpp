#pragma once
// The one exception type of the JIT engine and the checks that raise it. Python sees it as
// kernels._C.JitError (a RuntimeError).
#include <sstream>
#include <stdexcept>
#include <string>

namespace moe_jit {

class JitError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

inline const char* base_name(const char* path) {
  const char* base = path;
  for (const char* p = path; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  return base;
}

[[noreturn]] inline void throw_jit_error(const char* file, int line, const std::string& message) {
  std::ostringstream os;
  os << message << " [" << base_name(file) << ":" << line << "]";
  throw JitError(os.str());
}

}  // namespace detail

namespace driver {
// "CUDA_ERROR_X: description" for a CUresult; defined in driver.cpp, which owns the dlopen'ed
// driver.
std::string describe_error(int result);
}  // namespace driver

}  // namespace moe_jit

// Message arguments are streamed: MOE_HOST_ASSERT(n > 0, "n must be positive, got " << n).
#define MOE_JIT_THROW(message_stream)                                      \
  do {                                                                     \
    std::ostringstream moe_jit_os_;                                        \
    moe_jit_os_ << message_stream;                                         \
    ::moe_jit::detail::throw_jit_error(__FILE__, __LINE__, moe_jit_os_.str()); \
  } while (0)

#define MOE_HOST_ASSERT(cond, message_stream)                        \
  do {                                                               \
    if (!(cond)) {                                                   \
      MOE_JIT_THROW(message_stream << " (check failed: " #cond ")"); \
    }                                                                \
  } while (0)

// Wraps a driver call (any expression returning CUresult).
#define MOE_CU_CHECK(call)                                                                  \
  do {                                                                                      \
    const int moe_cu_result_ = static_cast<int>(call);                                      \
    if (moe_cu_result_ != 0) {                                                              \
      MOE_JIT_THROW(#call << " failed: " << ::moe_jit::driver::describe_error(moe_cu_result_)); \
    }                                                                                       \
  } while (0)
