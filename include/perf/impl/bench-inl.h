// perf/impl/bench-inl.h — the out-of-line definitions of perf/bench.h.
// Included by perf/bench.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/bench.h>

namespace perf {

namespace detail {

PERF_INLINE c10::Device bench_device(const BenchOptions& o) {
  if (o.device()) return *o.device();
#if PERF_WITH_CUDA
  if (c10::cuda::device_count() > 0) return c10::Device(c10::kCUDA, c10::cuda::current_device());
#endif
  return c10::Device(c10::kCPU);
}

PERF_INLINE void check_timer_device(const c10::Device& d) {
  TORCH_CHECK(d.is_cpu() || d.is_cuda(), "perf::Timer: device must be cpu or cuda, got ", d);
#if PERF_WITH_CUDA
  TORCH_CHECK(!d.is_cuda() || c10::cuda::device_count() > 0, "perf::Timer: device ", d,
              " requested but no CUDA device is available");
#else
  TORCH_CHECK(!d.is_cuda(), "perf::Timer: device ", d, " requested but perf was built without CUDA (PERF_WITH_CUDA=0)");
#endif
}

PERF_INLINE double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(pos));
  const auto hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

PERF_INLINE std::string fmt_ms(double ms) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(ms < 1 ? 4 : 3) << ms;
  return os.str();
}

}  // namespace detail

PERF_INLINE Timer::Timer(c10::Device device) : device_(device) { detail::check_timer_device(device_); }

PERF_INLINE void Timer::start() {
  started_ = true;
  stopped_ = false;
#if PERF_WITH_CUDA
  if (device_.is_cuda()) {
    e0_.emplace(cudaEventDefault);  // timing enabled (ATen's default disables it)
    e1_.emplace(cudaEventDefault);
    e0_->record(c10::cuda::getCurrentCUDAStream(device_.index()));
    return;
  }
#endif
  t0_ = std::chrono::steady_clock::now();
}

PERF_INLINE void Timer::stop() {
  TORCH_CHECK(started_, "perf::Timer::stop: start() was not called");
  stopped_ = true;
#if PERF_WITH_CUDA
  if (device_.is_cuda()) {
    e1_->record(c10::cuda::getCurrentCUDAStream(device_.index()));
    return;
  }
#endif
  t1_ = std::chrono::steady_clock::now();
}

PERF_INLINE double Timer::elapsed_ms() const {
  TORCH_CHECK(started_ && stopped_, "perf::Timer::elapsed_ms: call start() and stop() first");
#if PERF_WITH_CUDA
  if (device_.is_cuda()) {
    e1_->synchronize();
    return static_cast<double>(e0_->elapsed_time(*e1_));
  }
#endif
  return std::chrono::duration<double, std::milli>(t1_ - t0_).count();
}

PERF_INLINE Stats Stats::from(std::vector<double> d, std::string name, double items_per_call) {
  TORCH_CHECK(!d.empty(), "perf::Stats::from: no durations");
  std::sort(d.begin(), d.end());
  Stats s;
  s.name = std::move(name);
  s.iterations = static_cast<int64_t>(d.size());
  s.min_ms = d.front();
  s.max_ms = d.back();
  s.median_ms = detail::percentile(d, 0.5);
  s.p90_ms = detail::percentile(d, 0.9);
  s.mean_ms = std::accumulate(d.begin(), d.end(), 0.0) / static_cast<double>(d.size());
  if (items_per_call > 0 && s.median_ms > 0) s.items_per_second = items_per_call * 1000.0 / s.median_ms;
  return s;
}

PERF_INLINE std::string Stats::header() {
  std::ostringstream os;
  os << std::left << std::setw(24) << "name" << std::right << std::setw(8) << "iters" << std::setw(12) << "min ms"
     << std::setw(12) << "median ms" << std::setw(12) << "mean ms" << std::setw(12) << "p90 ms" << std::setw(12)
     << "max ms" << std::setw(14) << "items/s"
     << "\n";
  return os.str();
}

PERF_INLINE std::string Stats::to_string() const {
  std::ostringstream os;
  os << *this;
  return os.str();
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const Stats& s) {
  std::ostringstream line;
  line << std::left << std::setw(24) << s.name << std::right << std::setw(8) << s.iterations << std::setw(12)
       << detail::fmt_ms(s.min_ms) << std::setw(12) << detail::fmt_ms(s.median_ms) << std::setw(12)
       << detail::fmt_ms(s.mean_ms) << std::setw(12) << detail::fmt_ms(s.p90_ms) << std::setw(12)
       << detail::fmt_ms(s.max_ms) << std::setw(14);
  if (s.items_per_second > 0) {
    line << std::fixed << std::setprecision(1) << s.items_per_second;
  } else {
    line << "-";
  }
  return os << line.str() << "\n";
}

namespace detail {

PERF_INLINE void idle(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());  // -1: the current device
}

PERF_INLINE std::vector<std::vector<double>> time_round_robin(const std::vector<const std::function<void()>*>& fns,
                                                              const BenchOptions& o) {
  TORCH_CHECK(o.warmup() >= 0, "perf::BenchOptions::warmup: must be >= 0, got ", o.warmup());
  TORCH_CHECK(o.iters() >= 1, "perf::BenchOptions::iters: must be >= 1, got ", o.iters());
  TORCH_CHECK(o.min_time() >= 0, "perf::BenchOptions::min_time: must be >= 0 seconds, got ", o.min_time());
  TORCH_CHECK(o.items_per_call() >= 0 && std::isfinite(o.items_per_call()),
              "perf::BenchOptions::items_per_call: must be >= 0 (0: items/s not reported), got ", o.items_per_call());
  const c10::Device device = bench_device(o);
  check_timer_device(device);
  {  // A process's first CUDA event creates the context (~1 s): keep that out of min_time.
    Timer t(device);
    t.start();
    t.stop();
    (void)t.elapsed_ms();
  }
  for (int i = 0; i < o.warmup(); ++i)
    for (const auto* f : fns) (*f)();
  std::vector<std::vector<Timer>> timers(fns.size());
  const auto wall0 = std::chrono::steady_clock::now();
  auto wall_s = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count(); };
  constexpr int64_t kMaxIters = 10000000;
  const bool isolate = device.is_cuda() && fns.size() > 1;
  for (int64_t i = 0; i < kMaxIters && (i < o.iters() || wall_s() < o.min_time()); ++i) {
    for (size_t k = 0; k < fns.size(); ++k) {
      if (isolate) {
        // An event times the GPU's timeline, so a call whose start event waits behind another
        // configuration's queued kernels loses the host time it spent launching meanwhile (a
        // host-bound row after a graph replay measured up to that replay's time too fast). Each
        // call starts from an idle GPU instead, after an untimed call of its own, so that it
        // overlaps its own previous call as in a loop of it (as the Python peers time theirs).
        // Always, not by the time measured: ranks that call collectives must call alike.
        idle(device);
        (*fns[k])();
      }
      Timer t(device);
      t.start();
      (*fns[k])();
      t.stop();
      timers[k].push_back(std::move(t));
    }
  }
  std::vector<std::vector<double>> out(fns.size());
  for (size_t k = 0; k < fns.size(); ++k)
    for (const auto& t : timers[k]) out[k].push_back(t.elapsed_ms());
  return out;
}

}  // namespace detail

PERF_INLINE Stats benchmark(const std::function<void()>& fn, const BenchOptions& options) {
  auto d = detail::time_round_robin({&fn}, options);
  return Stats::from(std::move(d[0]), options.name(), options.items_per_call());
}

PERF_INLINE Comparison compare(const std::string& name_a, const std::function<void()>& a, const std::string& name_b,
                               const std::function<void()>& b, const BenchOptions& options) {
  auto d = detail::time_round_robin({&a, &b}, options);
  Comparison c;
  c.a = Stats::from(std::move(d[0]), name_a, options.items_per_call());
  c.b = Stats::from(std::move(d[1]), name_b, options.items_per_call());
  c.ratio = c.b.median_ms > 0 ? c.a.median_ms / c.b.median_ms : 0;
  return c;
}

PERF_INLINE std::vector<Stats> compare(const std::vector<std::pair<std::string, std::function<void()>>>& configurations,
                                       const BenchOptions& options) {
  TORCH_CHECK(!configurations.empty(), "perf::compare: no configurations given");
  std::vector<const std::function<void()>*> fns;
  for (const auto& [name, fn] : configurations) {
    TORCH_CHECK(fn, "perf::compare: configuration \"", name, "\" has no function");
    fns.push_back(&fn);
  }
  auto d = detail::time_round_robin(fns, options);
  std::vector<Stats> out;
  out.reserve(d.size());
  for (size_t k = 0; k < d.size(); ++k)
    out.push_back(Stats::from(std::move(d[k]), configurations[k].first, options.items_per_call()));
  return out;
}

PERF_INLINE std::string Comparison::to_string() const {
  std::ostringstream os;
  os << *this;
  return os.str();
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const Comparison& c) {
  os << Stats::header() << c.a << c.b;
  std::ostringstream r;
  r << std::fixed << std::setprecision(2) << c.ratio;
  return os << c.b.name << " vs " << c.a.name << ": " << r.str() << "x (ratio of medians, " << c.a.name << " / "
            << c.b.name << ", measured alternately)\n";
}

}  // namespace perf
