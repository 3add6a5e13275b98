// perf/bench.h — timing that is right on GPUs: events, warm-up, statistics.
//
//   perf::Timer t(torch::kCUDA); t.start(); work(); t.stop(); double ms = t.elapsed_ms();
//   perf::Stats s = perf::benchmark([&] { model->forward(x); },
//                                   perf::BenchOptions().warmup(10).iters(100).items_per_call(64));
//   std::cout << perf::Stats::header() << s;
//   perf::Comparison c = perf::compare("eager", f, "graphed", g);   // A B A B ..., ratio of medians
//
// GPU work is asynchronous: a host clock around a launch measures the launch,
// not the work. On a CUDA device these tools record CUDA events on the current
// stream and synchronise only when the result is read; compare() also before
// each timed call, so that one configuration's queued kernels do not shift
// another's events.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <torch/arg.h>
#include <torch/cuda.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAEvent.h>  // at::cuda::CUDAEvent without ATen's cuBLAS/cuSOLVER includes
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iomanip>
#include <numeric>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace perf {

/// Measures one interval. On a CUDA device: events on the current stream (no
/// host sync until elapsed_ms()); on the CPU: the steady clock.
class Timer {
 public:
  explicit Timer(c10::Device device = c10::Device(c10::kCPU));
  void start();
  void stop();
  /// Milliseconds between start() and stop(); on CUDA waits for the stop event.
  double elapsed_ms() const;
  c10::Device device() const noexcept { return device_; }

 private:
  c10::Device device_;
  bool started_ = false, stopped_ = false;
  std::chrono::steady_clock::time_point t0_, t1_;
#if PERF_WITH_CUDA
  std::optional<at::cuda::CUDAEvent> e0_, e1_;
#endif
};

struct BenchOptions {
  /// Untimed calls first: allocator, autotuners, caches, clocks.
  TORCH_ARG(int, warmup) = 10;
  /// Timed calls (at least).
  TORCH_ARG(int, iters) = 100;
  /// Keep timing past `iters` until this many seconds were measured. The bound is
  /// this process's clock: functions that call collectives (DDP) must keep it 0,
  /// or ranks that stop after different counts would leave collectives unmatched.
  TORCH_ARG(double, min_time) = 0.0;
  /// Items (samples, images, tokens) per call, for items/s; 0 = not reported.
  TORCH_ARG(double, items_per_call) = 0.0;
  /// Where the work runs. Unset: the current CUDA device if there is one, else CPU.
  TORCH_ARG(std::optional<c10::Device>, device);
  TORCH_ARG(std::string, name) = "benchmark";
};

/// Statistics of per-call durations, in milliseconds.
struct Stats {
  std::string name;
  int64_t iterations = 0;
  double min_ms = 0, median_ms = 0, mean_ms = 0, p90_ms = 0, max_ms = 0;
  double items_per_second = 0;  // from the median; 0 when items_per_call was not given

  /// From raw durations (ms). Percentiles interpolate linearly (numpy's default).
  static Stats from(std::vector<double> durations_ms, std::string name = "", double items_per_call = 0);
  /// A header line matching operator<<'s columns.
  static std::string header();
  std::string to_string() const;
};
std::ostream& operator<<(std::ostream& os, const Stats& s);

/// Times `fn` per call after warm-up.
Stats benchmark(const std::function<void()>& fn, const BenchOptions& options = BenchOptions());

/// A and B measured alternately (A B A B ...) so that drift hits both alike.
/// On CUDA each timed call starts from an idle GPU (a device sync), right after
/// an untimed call of the same function: timed as in a loop of its own, never
/// behind the other's queued kernels. So a function runs twice per timed call
/// there.
struct Comparison {
  Stats a, b;
  /// a.median / b.median: how many times faster B is than A.
  double ratio = 0;
  std::string to_string() const;
};
std::ostream& operator<<(std::ostream& os, const Comparison& c);

Comparison compare(const std::string& name_a, const std::function<void()>& a, const std::string& name_b,
                   const std::function<void()>& b, const BenchOptions& options = BenchOptions());

/// Several configurations measured round-robin (A B C A B C ...), one Stats
/// each, in order; ratios: stats[0].median_ms / stats[k].median_ms. On CUDA each
/// timed call is isolated as for two (above).
std::vector<Stats> compare(const std::vector<std::pair<std::string, std::function<void()>>>& configurations,
                           const BenchOptions& options = BenchOptions());

// ---------------------------------------------------------------------------
namespace detail {

PERF_INLINE c10::Device bench_device(const BenchOptions& o);

PERF_INLINE void check_timer_device(const c10::Device& d);

PERF_INLINE double percentile(const std::vector<double>& sorted, double q);

PERF_INLINE std::string fmt_ms(double ms);

}  // namespace detail

// ---------------------------------------------------------------------------

namespace detail {

// Runs `fns` round-robin after warm-up; returns each one's per-call durations.
// CUDA: one event pair per call, read after the loop. One function: its calls
// back to back, as a loop runs them (no sync inside). Several: a device sync
// before each timed call, and one untimed call of the same function between
// the sync and it.
PERF_INLINE void idle(const c10::Device& device);  // waits for every stream of a CUDA device; else nothing
PERF_INLINE std::vector<std::vector<double>> time_round_robin(const std::vector<const std::function<void()>*>& fns,
                                                              const BenchOptions& o);

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/bench-inl.h>
#endif
