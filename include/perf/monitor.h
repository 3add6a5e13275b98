// perf/monitor.h — see where a training loop's time goes: a progress line that
// costs nothing per step, GPU monitoring through NVML, and perf::advise.
//
//   perf::Progress bar(steps, perf::ProgressOptions().unit("img"));
//   for (...) { ...; bar.update(batch_size, {{"loss", loss}}); }   // loss read only when a line is drawn
//
//   perf::GpuMonitor mon;                  // samples NVML every 100 ms in a background thread
//   ...; std::cout << mon.summary();        // SM utilisation, memory, clock, power, temperature
//
//   std::cout << perf::advise([&] { train_step(); });   // findings, each with evidence and the fix
//
// Progress reads tensor values (a device sync on CUDA) at most once per drawn
// line, never per update. NVML is loaded with dlopen("libnvidia-ml.so.1"), as
// LibTorch does: no link-time dependency, and without a driver available() is
// false with the reason. advise() observes the step through LibTorch's
// RecordFunction callbacks (what its profiler is built on) and, on CUDA, the
// sync-debug mode.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/cpu/Utils.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/detail/cpu.h>
#include <perf/detail/cuda.h>
#include <perf/memory.h>
#include <torch/arg.h>

#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

namespace perf {

// =========================================================================== Progress

/// When Progress redraws in place: auto = when its stream is a terminal.
enum class ProgressStyle { automatic, terminal, lines };

using OStreamPtr = std::ostream*;  // TORCH_ARG needs one token

struct ProgressOptions {
  /// What one item is ("img", "tok", "sample"): shown as items/s.
  TORCH_ARG(std::string, unit) = "it";
  /// Shortest time between two drawn lines (and tensor reads).
  TORCH_ARG(std::chrono::milliseconds, every) = std::chrono::milliseconds(500);
  /// Window of the "recent" rate.
  TORCH_ARG(std::chrono::milliseconds, window) = std::chrono::milliseconds(5000);
  /// Where lines go; stderr by default, like tqdm.
  TORCH_ARG(OStreamPtr, stream) = &std::cerr;
  TORCH_ARG(ProgressStyle, style) = ProgressStyle::automatic;
  /// Description printed first.
  TORCH_ARG(std::string, description) = "";
  /// Host RSS, and on CUDA the allocator's memory and the GPU's utilisation.
  TORCH_ARG(bool, show_memory) = true;
};

/// A named value for a progress line: a tensor (read when the line is drawn) or a number.
using ProgressValue = std::variant<at::Tensor, double>;

class Progress {
 public:
  /// total: items expected (0: unknown, no ETA).
  explicit Progress(int64_t total = 0, ProgressOptions options = ProgressOptions());
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// Counts `items` done and keeps the named values for the next drawn line. Thread-safe.
  void update(int64_t items = 1, std::vector<std::pair<std::string, ProgressValue>> values = {});
  /// Draws the final line and ends it; later updates are ignored. Called by the destructor.
  void close();

  int64_t done() const;
  /// Tensor values converted to numbers so far (each a device sync on CUDA): at most one per value per line.
  int64_t values_read() const;
  /// Lines drawn so far.
  int64_t lines_drawn() const;
  /// The last line drawn, without control characters.
  std::string last_line() const;

 private:
  void draw(bool final);  // with mutex_ held
  std::string format(double now_s, bool final);

  int64_t total_;
  ProgressOptions options_;
  bool terminal_;
  mutable std::mutex mutex_;
  int64_t done_ = 0;
  bool closed_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
  std::deque<std::pair<double, int64_t>> history_;  // (seconds since start, done) for the recent rate
  std::vector<std::pair<std::string, ProgressValue>> values_;
  int64_t values_read_ = 0, lines_ = 0;
  std::string last_line_;
};

// =========================================================================== GpuMonitor

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

// =========================================================================== advise

struct AdviseOptions {
  /// Observed steps (after warm-up).
  TORCH_ARG(int, steps) = 20;
  TORCH_ARG(int, warmup) = 3;
  /// Where the step runs. Unset: CUDA when available, else CPU.
  TORCH_ARG(std::optional<c10::Device>, device);
  /// Share of step time waiting for data above which it is a finding.
  TORCH_ARG(double, data_wait_share) = 0.10;
};

/// One thing to change, with the evidence and the perf call that fixes it.
struct Finding {
  std::string what;      ///< short title
  std::string evidence;  ///< what was measured
  std::string fix;       ///< the perf call (or change) that fixes it
};

struct Advice {
  c10::Device device = c10::Device(c10::kCPU);
  int steps = 0;
  double median_step_ms = 0;
  std::vector<Finding> findings;
  /// Findings whose title contains `text`.
  bool has(const std::string& text) const;
  std::string to_string() const;
};
std::ostream& operator<<(std::ostream& os, const Advice& a);

/// Runs `step` (warm-up, then `steps` observed calls) and reports what slows it down.
Advice advise(const std::function<void()>& step, const AdviseOptions& options = AdviseOptions());

// --------------------------------------------------------------------------- implementation

namespace detail {

inline std::string fmt_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%02lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  }
  return buf;
}

inline std::string fmt_number(double v) {
  std::ostringstream s;
  const double a = std::abs(v);
  if (a != 0 && (a < 1e-3 || a >= 1e6)) {
    s << std::scientific << std::setprecision(3) << v;
  } else {
    s << std::fixed << std::setprecision(a >= 100 ? 1 : 4) << v;
  }
  return s.str();
}

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

inline bool is_terminal(std::ostream* s) {
  if (s == &std::cerr || s == &std::clog) return ::isatty(2) == 1;
  if (s == &std::cout) return ::isatty(1) == 1;
  return false;
}

inline double value_of(const ProgressValue& v, int64_t& reads) {
  if (std::holds_alternative<double>(v)) return std::get<double>(v);
  const auto& t = std::get<at::Tensor>(v);
  if (!t.defined()) return std::nan("");
  ++reads;
  return t.detach().to(at::kDouble).mean().item<double>();  // one sync on CUDA
}

}  // namespace detail

// --------------------------------------------------------------------------- Progress

inline Progress::Progress(int64_t total, ProgressOptions options)
    : total_(total), options_(std::move(options)), start_(std::chrono::steady_clock::now()), last_draw_(start_) {
  TORCH_CHECK(total >= 0, "perf::Progress: total must be >= 0 (0 = unknown), got ", total);
  TORCH_CHECK(options_.stream() != nullptr, "perf::ProgressOptions::stream must not be null");
  TORCH_CHECK(options_.every().count() >= 0, "perf::ProgressOptions::every must be >= 0 ms");
  terminal_ = options_.style() == ProgressStyle::terminal ||
              (options_.style() == ProgressStyle::automatic && detail::is_terminal(options_.stream()));
  history_.emplace_back(0.0, 0);
}

inline Progress::~Progress() {
  try {
    close();
  } catch (...) {  // a destructor must not throw; the line is lost, the program goes on
  }
}

inline void Progress::update(int64_t items, std::vector<std::pair<std::string, ProgressValue>> values) {
  TORCH_CHECK(items >= 0, "perf::Progress::update: items must be >= 0, got ", items);
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  done_ += items;
  for (auto& kv : values) {
    auto it = std::find_if(values_.begin(), values_.end(), [&](const auto& e) { return e.first == kv.first; });
    if (it == values_.end()) {
      values_.push_back(std::move(kv));
    } else {
      it->second = std::move(kv.second);
    }
  }
  if (now - last_draw_ >= options_.every()) draw(false);
}

inline void Progress::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  draw(true);
  closed_ = true;
}

inline int64_t Progress::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}
inline int64_t Progress::values_read() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return values_read_;
}
inline int64_t Progress::lines_drawn() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lines_;
}
inline std::string Progress::last_line() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_line_;
}

inline void Progress::draw(bool final) {
  const auto now = std::chrono::steady_clock::now();
  last_draw_ = now;
  const double t = std::chrono::duration<double>(now - start_).count();
  history_.emplace_back(t, done_);
  const double window = std::chrono::duration<double>(options_.window()).count();
  while (history_.size() > 2 && history_[1].first < t - window) history_.pop_front();
  last_line_ = format(t, final);
  ++lines_;
  auto& out = *options_.stream();
  if (terminal_) {
    out << "\r" << last_line_ << "\x1b[K" << (final ? "\n" : "") << std::flush;
  } else {
    out << last_line_ << "\n" << std::flush;
  }
}

inline std::string Progress::format(double t, bool final) {
  std::ostringstream s;
  if (!options_.description().empty()) s << options_.description() << ": ";
  s << done_;
  if (total_ > 0) {
    s << "/" << total_ << " " << std::setw(3) << static_cast<int>(100.0 * static_cast<double>(done_) / total_) << "%";
  }
  s << " " << options_.unit();
  const double overall = t > 0 ? static_cast<double>(done_) / t : 0.0;
  const auto& first = history_.front();
  const double recent_dt = t - first.first;
  const double recent = recent_dt > 0 ? static_cast<double>(done_ - first.second) / recent_dt : overall;
  s << " | " << std::fixed << std::setprecision(1) << recent << " " << options_.unit() << "/s";
  if (!final) s << " (avg " << overall << ")";
  if (total_ > 0 && !final) {
    s << " | ETA " << detail::fmt_duration(recent > 0 ? static_cast<double>(total_ - done_) / recent : -1);
  }
  s << " | " << (final ? "took " : "elapsed ") << detail::fmt_duration(t);
  for (const auto& kv : values_)
    s << " | " << kv.first << " " << detail::fmt_number(detail::value_of(kv.second, values_read_));
  if (options_.show_memory()) {
    const auto host = memory_stats(c10::Device(c10::kCPU));
    if (host.rss) s << " | rss " << detail::bytes_str(*host.rss);
#if PERF_WITH_CUDA
    if (at::cuda::is_available()) {
      const auto dev = c10::cuda::current_device();
      const auto gpu = memory_stats(c10::Device(c10::kCUDA, dev));
      if (gpu.allocated && gpu.reserved) {
        s << " | cuda " << detail::bytes_str(*gpu.allocated) << " / " << detail::bytes_str(*gpu.reserved)
          << " reserved";
      }
      // NVML numbers devices as nvidia-smi does; without CUDA_VISIBLE_DEVICES remapping this is the same GPU.
      auto& nvml = detail::Nvml::get("libnvidia-ml.so.1");
      if (nvml.ok() && dev < nvml.count()) {
        if (auto h = nvml.handle(dev)) s << " | util " << nvml.sample(h).sm_util << "%";
      }
    }
#endif
  }
  return s.str();
}

// --------------------------------------------------------------------------- GpuMonitor

inline GpuMonitor::GpuMonitor(GpuMonitorOptions options)
    : options_(std::move(options)), start_(std::chrono::steady_clock::now()) {
  TORCH_CHECK(options_.interval().count() > 0, "perf::GpuMonitorOptions::interval must be > 0 ms, got ",
              options_.interval().count());
  TORCH_CHECK(options_.max_samples() > 0, "perf::GpuMonitorOptions::max_samples must be > 0");
  auto& nvml = detail::Nvml::get(options_.library());
  if (!nvml.ok()) {
    reason_ = nvml.error();
    return;
  }
  const int n = nvml.count();
  if (n == 0) {
    reason_ = "NVML reports no GPU";
    return;
  }
  indices_ = options_.devices();
  if (indices_.empty()) {
    for (int i = 0; i < n; ++i) indices_.push_back(i);
  }
  for (int i : indices_) {
    TORCH_CHECK(i >= 0 && i < n, "perf::GpuMonitorOptions::devices: ", i, " is out of range, NVML sees ", n,
                " GPU(s) (0..", n - 1, ")");
  }
  for (int i : indices_) {
    handles_.push_back(nvml.handle(i));
    names_.push_back(nvml.name(handles_.back()));
  }
  samples_.resize(indices_.size());
  thread_ = std::thread([this] { loop(); });
}

inline GpuMonitor::~GpuMonitor() { stop(); }

inline void GpuMonitor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

inline std::vector<GpuSample> GpuMonitor::read_now() const {
  std::vector<GpuSample> out;
  if (!available()) return out;
  auto& nvml = detail::Nvml::get(options_.library());
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  for (auto* h : handles_) {
    out.push_back(nvml.sample(h));
    out.back().time_s = t;
  }
  return out;
}

inline void GpuMonitor::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    auto now = read_now();
    lock.lock();
    for (size_t d = 0; d < now.size(); ++d) {
      samples_[d].push_back(now[d]);
      if (samples_[d].size() > options_.max_samples()) samples_[d].pop_front();
    }
    cv_.wait_for(lock, options_.interval(), [&] { return stop_; });
  }
}

inline std::vector<std::vector<GpuSample>> GpuMonitor::samples() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<GpuSample>> out;
  for (const auto& d : samples_) out.emplace_back(d.begin(), d.end());
  return out;
}

inline GpuSummary GpuMonitor::summary() const {
  GpuSummary s;
  s.unavailable = reason_;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const auto all = samples();
  for (size_t d = 0; d < all.size(); ++d) {
    GpuDeviceSummary g;
    g.index = indices_[d];
    g.name = names_[d];
    g.samples = all[d].size();
    for (const auto& x : all[d]) {
      g.mean_sm_util += x.sm_util;
      g.max_sm_util = std::max(g.max_sm_util, static_cast<double>(x.sm_util));
      g.mean_mem_util += x.mem_util;
      g.max_mem_used = std::max(g.max_mem_used, x.mem_used);
      g.mem_total = x.mem_total;
      g.mean_sm_clock_mhz += x.sm_clock_mhz;
      g.mean_power_w += x.power_w;
      g.max_power_w = std::max(g.max_power_w, x.power_w);
      g.max_temperature_c = std::max(g.max_temperature_c, x.temperature_c);
    }
    if (g.samples > 0) {
      const double n = static_cast<double>(g.samples);
      g.mean_sm_util /= n;
      g.mean_mem_util /= n;
      g.mean_sm_clock_mhz /= n;
      g.mean_power_w /= n;
    }
    s.devices.push_back(g);
  }
  return s;
}

inline std::string GpuSummary::to_string() const {
  std::ostringstream s;
  s << *this;
  return s.str();
}

inline std::ostream& operator<<(std::ostream& os, const GpuSummary& s) {
  if (!s.unavailable.empty()) return os << "GPU monitor: unavailable: " << s.unavailable << "\n";
  os << "GPU monitor over " << std::fixed << std::setprecision(1) << s.seconds << " s\n";
  for (const auto& d : s.devices) {
    os << "  gpu " << d.index << " " << d.name << ": " << d.samples << " samples, SM util mean " << std::setprecision(1)
       << d.mean_sm_util << "% max " << d.max_sm_util << "%, memory util mean " << d.mean_mem_util << "%, memory max "
       << detail::bytes_str(static_cast<int64_t>(d.max_mem_used)) << " of "
       << detail::bytes_str(static_cast<int64_t>(d.mem_total)) << ", SM clock mean " << std::setprecision(0)
       << d.mean_sm_clock_mhz << " MHz, power mean " << std::setprecision(1) << d.mean_power_w << " W max "
       << d.max_power_w << " W, temperature max " << d.max_temperature_c << " C\n";
  }
  return os;
}

// --------------------------------------------------------------------------- advise

namespace detail {

// What the RecordFunction observer sees during the observed steps.
struct AdviseCounters {
  std::mutex mutex;
  std::thread::id caller;
  int64_t convs = 0, convs_nchw = 0, compute_ops = 0, compute_fp32 = 0, cuda_compute_fp32 = 0;
  int64_t pageable_h2d = 0, pageable_h2d_bytes = 0, h2d = 0;
  std::map<std::string, int64_t> sync_sites;
  int64_t syncs = 0;
  double data_wait_s = 0;
  std::set<std::vector<int64_t>> conv_shapes;
  // Open user scopes counted as data waits, per record-function handle.
  std::map<uint64_t, std::chrono::steady_clock::time_point> open_waits;
};

// The running advise's counters. Shared ownership: an op on another thread (a
// loader worker) may end after advise() returned.
struct AdviseSlot {
  std::mutex mutex;
  std::shared_ptr<AdviseCounters> current;
};
inline AdviseSlot& advise_slot() {
  static AdviseSlot slot;
  return slot;
}
inline std::shared_ptr<AdviseCounters> advise_counters() {
  auto& slot = advise_slot();
  std::lock_guard<std::mutex> lock(slot.mutex);
  return slot.current;
}

inline thread_local std::vector<std::string> op_stack;

inline bool is_data_scope(const std::string& name) {
  return name == "data" || name.rfind("perf::prefetch", 0) == 0 || name.rfind("data/", 0) == 0;
}

inline std::unique_ptr<at::ObserverContext> advise_start(const at::RecordFunction& fn) {
  const auto c = advise_counters();
  if (c == nullptr) return nullptr;
  const std::string name = fn.name();
  op_stack.push_back(name);
  if (fn.scope() == at::RecordScope::USER_SCOPE) {
    if (is_data_scope(name)) {
      std::lock_guard<std::mutex> lock(c->mutex);
      c->open_waits[fn.handle()] = std::chrono::steady_clock::now();
    }
    return nullptr;
  }
  const auto inputs = fn.inputs();
  const bool forward_thread = std::this_thread::get_id() == c->caller;
  std::lock_guard<std::mutex> lock(c->mutex);
  if (name == "aten::_convolution" && !inputs.empty() && inputs[0].isTensor()) {
    const auto& x = inputs[0].toTensor();
    if (forward_thread && x.dim() == 4) {
      ++c->convs;
      if (x.size(1) > 1 && x.size(2) * x.size(3) > 1 && x.is_contiguous() &&
          !x.is_contiguous(at::MemoryFormat::ChannelsLast))
        ++c->convs_nchw;
      c->conv_shapes.insert(x.sizes().vec());
    }
  }
  if (forward_thread && (name == "aten::_convolution" || name == "aten::mm" || name == "aten::addmm" ||
                         name == "aten::bmm" || name == "aten::baddbmm")) {
    // The first tensor input that is not a bias-like 1-d tensor.
    for (const auto& v : inputs) {
      if (!v.isTensor()) continue;
      const auto& t = v.toTensor();
      if (t.dim() < 2) continue;
      ++c->compute_ops;
      if (t.scalar_type() == at::kFloat) {
        ++c->compute_fp32;
        if (t.is_cuda()) ++c->cuda_compute_fp32;
      }
      break;
    }
  }
  if (name == "aten::copy_" && inputs.size() >= 2 && inputs[0].isTensor() && inputs[1].isTensor()) {
    const auto& dst = inputs[0].toTensor();
    const auto& src = inputs[1].toTensor();
    if (dst.is_cuda() && src.is_cpu()) {
      ++c->h2d;
      if (!src.is_pinned()) {
        ++c->pageable_h2d;
        c->pageable_h2d_bytes += static_cast<int64_t>(src.nbytes());
      }
    }
  }
  return nullptr;
}

inline void advise_end(const at::RecordFunction& fn, at::ObserverContext*) {
  const auto c = advise_counters();
  if (!op_stack.empty()) op_stack.pop_back();
  if (c == nullptr || fn.scope() != at::RecordScope::USER_SCOPE) return;
  std::lock_guard<std::mutex> lock(c->mutex);
  auto it = c->open_waits.find(fn.handle());
  if (it == c->open_waits.end()) return;
  c->data_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - it->second).count();
  c->open_waits.erase(it);
}

// Sync-debug warnings (CUDA), counted with the innermost and outermost op when they fired.
class SyncWarningCounter : public c10::WarningHandler {
 public:
  explicit SyncWarningCounter(AdviseCounters* c) : counters_(c), previous_(c10::WarningUtils::get_warning_handler()) {}
  void process(const c10::Warning& warning) override {
    const std::string msg = warning.msg();
    if (msg.find("synchroniz") == std::string::npos) {
      if (previous_ != nullptr) previous_->process(warning);
      return;
    }
    std::string where = op_stack.empty() ? std::string("(no op)") : op_stack.back();
    if (op_stack.size() > 1 && op_stack.front() != where) where = op_stack.front() + " > " + where;
    std::lock_guard<std::mutex> lock(counters_->mutex);
    ++counters_->syncs;
    ++counters_->sync_sites[where];
  }

 private:
  AdviseCounters* counters_;
  c10::WarningHandler* previous_;  // other warnings go on to it
};

// advise()'s observation: publishes the counters and installs the RecordFunction
// observer; the destructor takes both away, also when the step throws.
class AdviseScope {
 public:
  explicit AdviseScope(std::shared_ptr<AdviseCounters> counters) {
    auto& slot = advise_slot();
    {
      std::lock_guard<std::mutex> lock(slot.mutex);
      TORCH_CHECK(slot.current == nullptr, "perf::advise: already running in another thread (one advise at a time)");
      slot.current = std::move(counters);
    }
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(advise_start, advise_end)
                                        .needsInputs(true)
                                        .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
  }
  ~AdviseScope() {
    at::removeCallback(handle_);
    auto& slot = advise_slot();
    std::lock_guard<std::mutex> lock(slot.mutex);
    slot.current.reset();
  }
  AdviseScope(const AdviseScope&) = delete;
  AdviseScope& operator=(const AdviseScope&) = delete;

 private:
  at::CallbackHandle handle_ = 0;
};

}  // namespace detail

inline bool Advice::has(const std::string& text) const {
  return std::any_of(findings.begin(), findings.end(),
                     [&](const Finding& f) { return f.what.find(text) != std::string::npos; });
}

inline std::string Advice::to_string() const {
  std::ostringstream s;
  s << *this;
  return s.str();
}

inline std::ostream& operator<<(std::ostream& os, const Advice& a) {
  os << "perf::advise: " << a.steps << " steps on " << a.device << ", median " << std::fixed << std::setprecision(2)
     << a.median_step_ms << " ms per step\n";
  if (a.findings.empty()) return os << "  no findings: nothing perf knows how to speed up here\n";
  for (size_t i = 0; i < a.findings.size(); ++i) {
    const auto& f = a.findings[i];
    os << "  [" << i + 1 << "] " << f.what << "\n      evidence: " << f.evidence << "\n      fix: " << f.fix << "\n";
  }
  return os;
}

inline Advice advise(const std::function<void()>& step, const AdviseOptions& options) {
  TORCH_CHECK(options.steps() >= 1, "perf::AdviseOptions::steps must be >= 1, got ", options.steps());
  TORCH_CHECK(options.warmup() >= 0, "perf::AdviseOptions::warmup must be >= 0, got ", options.warmup());
  TORCH_CHECK(options.data_wait_share() > 0 && options.data_wait_share() < 1,
              "perf::AdviseOptions::data_wait_share must be in (0, 1), got ", options.data_wait_share());
  Advice advice;
#if PERF_WITH_CUDA
  const bool cuda = options.device() ? options.device()->is_cuda() : at::cuda::is_available();
#else
  TORCH_CHECK(!options.device() || !options.device()->is_cuda(),
              "perf::advise: device cuda needs perf built with CUDA (PERF_WITH_CUDA=1)");
  const bool cuda = false;
#endif
  advice.device = cuda ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  auto sync = [&] {
#if PERF_WITH_CUDA
    if (cuda) c10::cuda::device_synchronize();
#endif
  };
  for (int i = 0; i < options.warmup(); ++i) step();
  sync();

  auto shared = std::make_shared<detail::AdviseCounters>();
  auto& counters = *shared;
  counters.caller = std::this_thread::get_id();
  std::vector<double> step_s, host_s;
  {
    detail::AdviseScope observing(shared);
    detail::SyncWarningCounter warnings(shared.get());
    std::optional<c10::WarningUtils::WarningHandlerGuard> handler;
#if PERF_WITH_CUDA
    std::optional<detail::SyncDebugGuard> warn_on_sync;
    if (cuda) {
      handler.emplace(&warnings);
      warn_on_sync.emplace(c10::cuda::SyncDebugMode::L_WARN);
    }
#endif
    for (int i = 0; i < options.steps(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      step();
      const auto t1 = std::chrono::steady_clock::now();
#if PERF_WITH_CUDA
      if (cuda) {
        detail::SyncDebugGuard quiet(c10::cuda::SyncDebugMode::L_DISABLED);  // our own sync is not the user's
        sync();
      }
#endif
      const auto t2 = std::chrono::steady_clock::now();
      host_s.push_back(std::chrono::duration<double>(t1 - t0).count());
      step_s.push_back(std::chrono::duration<double>(t2 - t0).count());
    }
  }

  std::lock_guard<std::mutex> read_lock(counters.mutex);  // ops still ending on other threads
  const int n = options.steps();
  advice.steps = n;
  auto sorted = step_s;
  std::sort(sorted.begin(), sorted.end());
  advice.median_step_ms = sorted[sorted.size() / 2] * 1e3;
  double total = 0, host_total = 0;
  for (size_t i = 0; i < step_s.size(); ++i) {
    total += step_s[i];
    host_total += host_s[i];
  }
  auto pct = [](double share) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(0) << 100.0 * share << "%";
    return s.str();
  };
  auto per_step = [&](int64_t count) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(count % n == 0 ? 0 : 1) << static_cast<double>(count) / n;
    return s.str();
  };
  auto& f = advice.findings;

  // Data.
  if (total > 0 && counters.data_wait_s / total > options.data_wait_share()) {
    std::ostringstream ev;
    ev << pct(counters.data_wait_s / total) << " of step time waiting for batches (" << std::fixed
       << std::setprecision(2) << counters.data_wait_s / n * 1e3 << " ms of " << total / n * 1e3
       << " ms per step, in perf::prefetch or perf::Range(\"data\") scopes)";
    f.push_back({"the loop waits on data", ev.str(),
                 "perf::loader_options(batch, perf::LoaderTuning().workers(N)) with more workers (perf::tune_workers "
                 "measures them), and perf::prefetch(loader, device) to load ahead"});
  }
  // Syncs (CUDA).
  if (counters.syncs > 0) {
    std::ostringstream ev;
    ev << per_step(counters.syncs) << " host-device syncs per step, at:";
    for (const auto& [where, count] : counters.sync_sites) ev << " " << where << " (" << count << "x)";
    f.push_back({"host-device syncs in the step", ev.str(),
                 "remove .item()/.cpu()/printing of CUDA tensors from the step (perf::Progress reads values once per "
                 "line); perf::GradScaler and perf::clip_grad_norm_ keep their checks on the GPU"});
  }
  // Memory format.
  if (counters.convs > 0 && counters.convs_nchw * 2 >= counters.convs) {
    f.push_back({"convolutions on NCHW inputs",
                 per_step(counters.convs_nchw) + " of " + per_step(counters.convs) +
                     " convolutions per step take contiguous (NCHW) inputs",
                 "perf::optimize(model) (channels-last + autocast), or perf::to_channels_last(module) and "
                 "perf::channels_last(input)"});
  }
  // Precision.
  const bool autocast_used = counters.compute_ops > 0 && counters.compute_fp32 * 2 < counters.compute_ops;
#if PERF_WITH_CUDA
  if (cuda && counters.cuda_compute_fp32 > 0 && counters.cuda_compute_fp32 * 2 >= counters.compute_ops) {
    const bool tf32 = at::globalContext().allowTF32CuBLAS() && at::globalContext().allowTF32CuDNN();
    f.push_back({tf32 ? "fp32 matmuls/convolutions without autocast" : "fp32 matmuls/convolutions with TF32 off",
                 per_step(counters.cuda_compute_fp32) + " of " + per_step(counters.compute_ops) +
                     " matmuls/convolutions per step run in fp32" + (tf32 ? " (TF32 on)" : " with TF32 off"),
                 std::string(tf32 ? "" : "perf::setup() (TF32 on); ") +
                     "perf::Autocast (bf16, or fp16 with perf::GradScaler), or perf::optimize(model)"});
  }
  if (cuda && counters.convs > 0 && !at::globalContext().benchmarkCuDNN() && counters.conv_shapes.size() <= 8) {
    f.push_back({"cuDNN autotuning off with static shapes",
                 std::to_string(counters.conv_shapes.size()) +
                     " distinct convolution input shapes over all steps, cudnn_benchmark off",
                 "perf::setup() (cudnn_benchmark on unless deterministic)"});
  }
  if (counters.pageable_h2d > 0) {
    f.push_back({"pageable host-to-device copies",
                 per_step(counters.pageable_h2d) + " copies per step from pageable memory (" +
                     detail::bytes_str(counters.pageable_h2d_bytes / n) +
                     " per step): each is synchronous and half speed",
                 "perf::prefetch(loader, device) (pinned, async, on a side stream), or .pin_memory() and "
                 "non_blocking copies"});
  }
  if (cuda && total > 0 && host_total / total > 0.8 && advice.median_step_ms < 50) {
    std::ostringstream ev;
    ev << "the host spends " << pct(host_total / total)
       << " of the step launching work (the GPU waits for the CPU); median step " << std::fixed << std::setprecision(2)
       << advice.median_step_ms << " ms";
    f.push_back({"launch-bound step", ev.str(),
                 "perf::graph(model, example) for inference, perf::TrainStep for training (CUDA graphs: one launch)"});
  }
#endif
  // CPU.
  if (!cuda) {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("num_physical_cores");
    const int64_t cores = it != caps.end() && it->second.isInt() ? it->second.toInt() : 0;
    if (cores > 0 && at::get_num_threads() < cores) {
      f.push_back(
          {"intra-op threads below the physical cores",
           std::to_string(at::get_num_threads()) + " intra-op threads on " + std::to_string(cores) + " physical cores",
           "perf::setup() (threads = physical cores), or perf::Settings().num_threads(" + std::to_string(cores) + ")"});
    }
    if (detail::cpu_bf16().native() && counters.compute_fp32 > 0 && !autocast_used) {
      f.push_back({"bf16 autocast off on a CPU with native bf16",
                   per_step(counters.compute_fp32) + " of " + per_step(counters.compute_ops) +
                       " matmuls/convolutions per step in fp32; this CPU has " + detail::cpu_bf16().features(),
                   "perf::Autocast (bf16 on such CPUs by default), or perf::optimize(model)"});
    }
  }
  return advice;
}

}  // namespace perf
