#pragma once
// Facts about CUDA devices, read once through the driver and cached, and the SM-count override
// that kernels' heuristics use (set_num_sms). Every function raises JitError without a driver or
// for a device ordinal out of range.
#include <string>

#include "jit/driver.hpp"

namespace moe_jit {

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int num_sms = 0;
  int smem_optin = 0;   // max dynamic + static shared memory per block after opting in, bytes
  int smem_per_sm = 0;  // bytes
  int l2_bytes = 0;
  std::string name;
};

int device_count();
const DeviceInfo& device_info(int device);
// "sm_90a" for 9.0 and "sm_100a" for 10.0 (the arch-specific targets our kernels use), else
// "sm_<major><minor>".
std::string device_arch(int device);

// The SM count kernels should plan for: the set_num_sms() override, else the device's count.
int get_num_sms(int device);
// Overrides the SM count for every device; 1 <= num_sms <= the SM count of `device`.
void set_num_sms(int num_sms, int device);
// Back to each device's own SM count.
void reset_num_sms();

// The device's primary context, retained once per process.
driver::CUcontext primary_context(int device);

// Makes the device's primary context current for the guard's lifetime. A different context that
// was current is restored afterwards; when none was, the primary context stays current.
class ScopedDeviceContext {
 public:
  explicit ScopedDeviceContext(int device);
  ~ScopedDeviceContext();
  ScopedDeviceContext(const ScopedDeviceContext&) = delete;
  ScopedDeviceContext& operator=(const ScopedDeviceContext&) = delete;

 private:
  driver::CUcontext previous_ = nullptr;
  bool restore_ = false;
};

}  // namespace moe_jit
