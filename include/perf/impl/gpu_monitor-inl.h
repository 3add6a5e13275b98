// perf/impl/gpu_monitor-inl.h — the out-of-line definitions of perf/gpu_monitor.h.
// Included by perf/gpu_monitor.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/gpu_monitor.h>

namespace perf {

PERF_INLINE GpuMonitor::GpuMonitor(GpuMonitorOptions options)
    : options_(std::move(options)), start_(std::chrono::steady_clock::now()) {
  TORCH_CHECK(options_.interval().count() > 0, "perf::GpuMonitorOptions::interval must be > 0 ms, got ",
              options_.interval().count());
  detail::check_count(options_.max_samples(), 1, "perf::GpuMonitorOptions::max_samples");
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

PERF_INLINE GpuMonitor::~GpuMonitor() { stop(); }

PERF_INLINE void GpuMonitor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

PERF_INLINE std::vector<GpuSample> GpuMonitor::read_now() const {
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

PERF_INLINE void GpuMonitor::loop() {
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

PERF_INLINE std::vector<std::vector<GpuSample>> GpuMonitor::samples() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<GpuSample>> out;
  out.reserve(samples_.size());
  for (const auto& d : samples_) out.emplace_back(d.begin(), d.end());
  return out;
}

PERF_INLINE GpuSummary GpuMonitor::summary() const {
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

PERF_INLINE std::string GpuSummary::to_string() const {
  std::ostringstream s;
  s << *this;
  return s.str();
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const GpuSummary& s) {
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

}  // namespace perf
