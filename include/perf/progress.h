// perf/progress.h — a progress line for training loops that costs nothing per step.
//
//   perf::Progress bar(steps, perf::ProgressOptions().unit("img"));
//   for (...) { ...; bar.update(batch_size, {{"loss", loss}}); }   // loss read only when a line is drawn
//
// Progress reads tensor values (a device sync on CUDA) at most once per drawn
// line, never per update; with show_memory it adds host RSS, the CUDA
// allocator's memory and the GPU's utilisation (NVML, perf/gpu_monitor.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/detail/float.h>
#include <perf/gpu_monitor.h>
#include <perf/memory.h>
#include <torch/arg.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace perf {

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

// --------------------------------------------------------------------------- implementation

namespace detail {

PERF_INLINE std::string fmt_duration(double seconds);

PERF_INLINE std::string fmt_number(double v);

PERF_INLINE bool is_terminal(std::ostream* s);

PERF_INLINE double value_of(const ProgressValue& v, int64_t& reads);

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/progress-inl.h>
#endif
