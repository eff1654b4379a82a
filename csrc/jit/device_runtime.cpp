#include "jit/device_runtime.hpp"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "jit/exception.hpp"

namespace moe_jit {
namespace {

std::mutex& mutex() {
  static std::mutex m;
  return m;
}

std::atomic<int>& num_sms_override() {
  static std::atomic<int> value{0};
  return value;
}

void check_device(int device) {
  const int count = device_count();
  MOE_HOST_ASSERT(device >= 0 && device < count,
                  "CUDA device " << device << " is out of range: " << count << " device(s)");
}

int attribute(driver::CUdevice_attribute attr, driver::CUdevice dev) {
  int value = 0;
  MOE_CU_CHECK(driver::api().cuDeviceGetAttribute(&value, attr, dev));
  return value;
}

}  // namespace

int device_count() {
  static const int count = [] {
    int n = 0;
    MOE_CU_CHECK(driver::api().cuDeviceGetCount(&n));
    return n;
  }();
  return count;
}

const DeviceInfo& device_info(int device) {
  check_device(device);
  static std::map<int, std::unique_ptr<DeviceInfo>> cache;
  std::lock_guard<std::mutex> lock(mutex());
  auto it = cache.find(device);
  if (it != cache.end()) return *it->second;

  const auto& api = driver::api();
  driver::CUdevice dev = 0;
  MOE_CU_CHECK(api.cuDeviceGet(&dev, device));
  auto info = std::make_unique<DeviceInfo>();
  info->major = attribute(driver::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  info->minor = attribute(driver::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  info->num_sms = attribute(driver::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  info->smem_optin = attribute(driver::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev);
  info->smem_per_sm = attribute(driver::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, dev);
  info->l2_bytes = attribute(driver::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev);
  char name[256] = {};
  MOE_CU_CHECK(api.cuDeviceGetName(name, static_cast<int>(sizeof(name)) - 1, dev));
  info->name = name;
  return *cache.emplace(device, std::move(info)).first->second;
}

std::string device_arch(int device) {
  const DeviceInfo& info = device_info(device);
  std::string arch = "sm_" + std::to_string(info.major) + std::to_string(info.minor);
  if ((info.major == 9 || info.major == 10) && info.minor == 0) arch += "a";
  return arch;
}

int get_num_sms(int device) {
  const int device_sms = device_info(device).num_sms;
  const int override_sms = num_sms_override().load(std::memory_order_relaxed);
  return override_sms > 0 && override_sms < device_sms ? override_sms : device_sms;
}

void set_num_sms(int num_sms, int device) {
  const int device_sms = device_info(device).num_sms;
  MOE_HOST_ASSERT(num_sms >= 1 && num_sms <= device_sms,
                  "num_sms must be in [1, " << device_sms << "] (the SM count of device " << device
                                            << "), got " << num_sms);
  num_sms_override().store(num_sms, std::memory_order_relaxed);
}

void reset_num_sms() { num_sms_override().store(0, std::memory_order_relaxed); }

driver::CUcontext primary_context(int device) {
  check_device(device);
  static std::map<int, driver::CUcontext> contexts;
  std::lock_guard<std::mutex> lock(mutex());
  auto it = contexts.find(device);
  if (it != contexts.end()) return it->second;
  const auto& api = driver::api();
  driver::CUdevice dev = 0;
  MOE_CU_CHECK(api.cuDeviceGet(&dev, device));
  driver::CUcontext ctx = nullptr;
  MOE_CU_CHECK(api.cuDevicePrimaryCtxRetain(&ctx, dev));
  contexts.emplace(device, ctx);
  return ctx;
}

ScopedDeviceContext::ScopedDeviceContext(int device) {
  const driver::CUcontext target = primary_context(device);
  const auto& api = driver::api();
  MOE_CU_CHECK(api.cuCtxGetCurrent(&previous_));
  if (previous_ != target) {
    MOE_CU_CHECK(api.cuCtxSetCurrent(target));
    restore_ = previous_ != nullptr;
  }
}

ScopedDeviceContext::~ScopedDeviceContext() {
  if (restore_) driver::api().cuCtxSetCurrent(previous_);
}

}  // namespace moe_jit
