#pragma once
// How long a kernel that waits on the device for another rank (the low-latency transport's steps,
// the staged exchange's barrier) spins before it traps: MOE_EP_TIMEOUT_S seconds (read per call),
// default 120, long enough for a peer that compiles its expert kernels on a cold cache meanwhile.
#include <cstdlib>

#include "jit/exception.hpp"

namespace moe_launchers {

inline unsigned long long peer_timeout_ns() {
  const char* value = std::getenv("MOE_EP_TIMEOUT_S");
  double seconds = 120.0;
  if (value != nullptr) {
    char* end = nullptr;
    seconds = std::strtod(value, &end);
    MOE_HOST_ASSERT(end != value && *end == '\0' && seconds > 0 && seconds < 1e9,
                    "MOE_EP_TIMEOUT_S must be a positive number of seconds, got '" << value << "'");
  }
  return static_cast<unsigned long long>(seconds * 1e9);
}

}  // namespace moe_launchers
