// perf/gpu_monitor.h — what the GPU is doing while a program runs, from NVML.
//
//   perf::GpuMonitor mon;                  // samples NVML every 100 ms in a background thread
//   ...; std::cout << mon.summary();        // SM utilisation, memory, clock, power, temperature
//
// NVML is loaded with dlopen("libnvidia-ml.so.1"), as LibTorch does: no
// link-time dependency, and without a driver available() is false with the
// reason, never an exception.
#pragma once

#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <perf/config.h>
#include <perf/detail/check.h>
#include <perf/memory.h>
#include <torch/arg.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <iomanip>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace perf {

struct GpuMonitorOptions {
  TORCH_ARG(std::chrono::milliseconds, interval) = std::chrono::milliseconds(100);
  /// NVML devices to sample (NVML's order, which is nvidia-smi's); empty: all.
  TORCH_ARG(std::vector<int>, devices);
  /// The NVML library to load (tests load a fake one).
  TORCH_ARG(std::string, library) = "libnvidia-ml.so.1";
  /// Samples kept per device (oldest dropped); the summary covers those kept.
  TORCH_ARG(size_t, max_samples) = 100000;
};

struct GpuSample {
  double time_s = 0;                     ///< since the monitor started
  unsigned sm_util = 0;                  ///< % of time a kernel ran (NVML "gpu" utilisation)
  unsigned mem_util = 0;                 ///< % of time memory was read or written
  uint64_t mem_used = 0, mem_total = 0;  ///< bytes
  unsigned sm_clock_mhz = 0;
  double power_w = 0;
  unsigned temperature_c = 0;
};

struct GpuDeviceSummary {
  int index = 0;
  std::string name;
  size_t samples = 0;
  double mean_sm_util = 0, max_sm_util = 0, mean_mem_util = 0;
  uint64_t max_mem_used = 0, mem_total = 0;
  double mean_sm_clock_mhz = 0, mean_power_w = 0, max_power_w = 0;
  unsigned max_temperature_c = 0;
};

struct GpuSummary {
  double seconds = 0;
  std::vector<GpuDeviceSummary> devices;
  std::string unavailable;  ///< why there is nothing, when there is nothing
  std::string to_string() const;
};
std::ostream& operator<<(std::ostream& os, const GpuSummary& s);

class GpuMonitor {
 public:
  explicit GpuMonitor(GpuMonitorOptions options = GpuMonitorOptions());
  ~GpuMonitor();
  GpuMonitor(const GpuMonitor&) = delete;
  GpuMonitor& operator=(const GpuMonitor&) = delete;

  /// NVML loaded and at least one device sampled.
  bool available() const noexcept { return reason_.empty(); }
  /// Why not available ("" when it is).
  const std::string& reason() const noexcept { return reason_; }
  /// Stops sampling (idempotent; the destructor calls it).
  void stop();
  /// Samples so far, per monitored device.
  std::vector<std::vector<GpuSample>> samples() const;
  /// One reading now, outside the sampling thread.
  std::vector<GpuSample> read_now() const;
  GpuSummary summary() const;
  const std::vector<std::string>& names() const noexcept { return names_; }

 private:
  void loop();

  GpuMonitorOptions options_;
  std::string reason_;
  std::vector<void*> handles_;
  std::vector<int> indices_;
  std::vector<std::string> names_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::deque<GpuSample>> samples_;
  std::thread thread_;
};

// --------------------------------------------------------------------------- implementation

namespace detail {

// NVML through dlopen: the few entry points perf uses, with NVML's ABI types
// spelled out here so that no NVML header is needed.
class Nvml {
 public:
  struct Utilization {
    unsigned gpu, memory;
  };
  struct Memory {
    unsigned long long total, free, used;
  };
  using Device = void*;

  /// The library at `path`, loaded and initialised once per path for the process.
  static Nvml& get(const std::string& path) {
    static std::mutex mutex;
    static std::map<std::string, std::unique_ptr<Nvml>> loaded;
    std::lock_guard<std::mutex> lock(mutex);
    auto& slot = loaded[path];
    if (!slot) slot.reset(new Nvml(path));
    return *slot;
  }
  bool ok() const noexcept { return error_.empty(); }
  const std::string& error() const noexcept { return error_; }

  int count() const {
    unsigned n = 0;
    return ok() && device_count_(&n) == 0 ? static_cast<int>(n) : 0;
  }
  Device handle(int index) const {
    Device d = nullptr;
    return ok() && by_index_(static_cast<unsigned>(index), &d) == 0 ? d : nullptr;
  }
  std::string name(Device d) const {
    char buf[96] = {0};
    return name_ != nullptr && name_(d, buf, sizeof(buf)) == 0 ? std::string(buf) : std::string("?");
  }
  GpuSample sample(Device d) const {
    GpuSample s;
    Utilization u{0, 0};
    if (util_ != nullptr && util_(d, &u) == 0) {
      s.sm_util = u.gpu;
      s.mem_util = u.memory;
    }
    Memory m{0, 0, 0};
    if (memory_ != nullptr && memory_(d, &m) == 0) {
      s.mem_used = m.used;
      s.mem_total = m.total;
    }
    unsigned v = 0;
    if (clock_ != nullptr && clock_(d, /*NVML_CLOCK_SM*/ 1, &v) == 0) s.sm_clock_mhz = v;
    if (power_ != nullptr && power_(d, &v) == 0) s.power_w = v / 1000.0;  // milliwatts
    if (temperature_ != nullptr && temperature_(d, /*NVML_TEMPERATURE_GPU*/ 0, &v) == 0) s.temperature_c = v;
    return s;
  }

 private:
  explicit Nvml(const std::string& path) {
    lib_ = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) {
      const char* e = ::dlerror();
      error_ = "cannot load " + path + " (" + (e != nullptr ? e : "unknown error") +
               "): no NVIDIA driver on this machine, or it is not on the library path";
      return;
    }
    auto sym = [&](const char* name) { return ::dlsym(lib_, name); };
    auto init = reinterpret_cast<int (*)()>(sym("nvmlInit_v2"));
    device_count_ = reinterpret_cast<int (*)(unsigned*)>(sym("nvmlDeviceGetCount_v2"));
    by_index_ = reinterpret_cast<int (*)(unsigned, Device*)>(sym("nvmlDeviceGetHandleByIndex_v2"));
    name_ = reinterpret_cast<int (*)(Device, char*, unsigned)>(sym("nvmlDeviceGetName"));
    util_ = reinterpret_cast<int (*)(Device, Utilization*)>(sym("nvmlDeviceGetUtilizationRates"));
    memory_ = reinterpret_cast<int (*)(Device, Memory*)>(sym("nvmlDeviceGetMemoryInfo"));
    clock_ = reinterpret_cast<int (*)(Device, int, unsigned*)>(sym("nvmlDeviceGetClockInfo"));
    power_ = reinterpret_cast<int (*)(Device, unsigned*)>(sym("nvmlDeviceGetPowerUsage"));
    temperature_ = reinterpret_cast<int (*)(Device, int, unsigned*)>(sym("nvmlDeviceGetTemperature"));
    if (init == nullptr || device_count_ == nullptr || by_index_ == nullptr) {
      error_ = path + " lacks nvmlInit_v2/nvmlDeviceGetCount_v2/nvmlDeviceGetHandleByIndex_v2 (not NVML?)";
      return;
    }
    const int rc = init();
    if (rc != 0) error_ = "nvmlInit_v2 failed with NVML error " + std::to_string(rc) + " (driver not loaded?)";
    // Never unloaded or shut down: other threads may still sample at exit.
  }

  void* lib_ = nullptr;
  std::string error_;
  int (*device_count_)(unsigned*) = nullptr;
  int (*by_index_)(unsigned, Device*) = nullptr;
  int (*name_)(Device, char*, unsigned) = nullptr;
  int (*util_)(Device, Utilization*) = nullptr;
  int (*memory_)(Device, Memory*) = nullptr;
  int (*clock_)(Device, int, unsigned*) = nullptr;
  int (*power_)(Device, unsigned*) = nullptr;
  int (*temperature_)(Device, int, unsigned*) = nullptr;
};

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/gpu_monitor-inl.h>
#endif
