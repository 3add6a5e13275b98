// perf/impl/progress-inl.h — the out-of-line definitions of perf/progress.h.
// Included by perf/progress.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/progress.h>

// CUDA's headers only here, where the definitions use them: a perf::perf_static user's
// translation unit does not compile them (docs/compile-time.md).
#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace perf {

namespace detail {

PERF_INLINE std::string fmt_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%02lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  }
  return buf;
}

PERF_INLINE std::string fmt_number(double v) {
  std::ostringstream s;
  const double a = std::abs(v);
  if (!detail::same_value(a, 0.0) && (a < 1e-3 || a >= 1e6)) {
    s << std::scientific << std::setprecision(3) << v;
  } else {
    s << std::fixed << std::setprecision(a >= 100 ? 1 : 4) << v;
  }
  return s.str();
}

PERF_INLINE bool is_terminal(std::ostream* s) {
  if (s == &std::cerr || s == &std::clog) return ::isatty(2) == 1;
  if (s == &std::cout) return ::isatty(1) == 1;
  return false;
}

PERF_INLINE double value_of(const ProgressValue& v, int64_t& reads) {
  if (std::holds_alternative<double>(v)) return std::get<double>(v);
  const auto& t = std::get<at::Tensor>(v);
  if (!t.defined()) return std::nan("");
  ++reads;
  return t.detach().to(at::kDouble).mean().item<double>();  // one sync on CUDA
}

}  // namespace detail

PERF_INLINE Progress::Progress(int64_t total, ProgressOptions options)
    : total_(total), options_(std::move(options)), start_(std::chrono::steady_clock::now()), last_draw_(start_) {
  TORCH_CHECK(total >= 0, "perf::Progress: total must be >= 0 (0 = unknown), got ", total);
  TORCH_CHECK(options_.stream() != nullptr, "perf::ProgressOptions::stream must not be null");
  TORCH_CHECK(options_.every().count() >= 0, "perf::ProgressOptions::every must be >= 0 ms");
  terminal_ = options_.style() == ProgressStyle::terminal ||
              (options_.style() == ProgressStyle::automatic && detail::is_terminal(options_.stream()));
  history_.emplace_back(0.0, 0);
}

PERF_INLINE Progress::~Progress() {
  try {
    close();
  } catch (...) {  // a destructor must not throw; the line is lost, the program goes on
  }
}

PERF_INLINE void Progress::update(int64_t items, std::vector<std::pair<std::string, ProgressValue>> values) {
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

PERF_INLINE void Progress::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  draw(true);
  closed_ = true;
}

PERF_INLINE int64_t Progress::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

PERF_INLINE int64_t Progress::values_read() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return values_read_;
}

PERF_INLINE int64_t Progress::lines_drawn() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lines_;
}

PERF_INLINE std::string Progress::last_line() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_line_;
}

PERF_INLINE void Progress::draw(bool final) {
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

PERF_INLINE std::string Progress::format(double t, bool final) {
  std::ostringstream s;
  if (!options_.description().empty()) s << options_.description() << ": ";
  s << done_;
  if (total_ > 0) {
    s << "/" << total_ << " " << std::setw(3)
      << static_cast<int>(100.0 * static_cast<double>(done_) / static_cast<double>(total_)) << "%";
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

}  // namespace perf
