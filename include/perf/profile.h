// perf/profile.h — Chrome traces from LibTorch's (Kineto) profiler, with labels.
//
//   {
//     perf::Profile p("trace.json", perf::ProfileOptions().record_shapes(true));
//     for (...) { perf::Range r("train_step"); step(); }
//   }   // trace.json written (open it in https://ui.perfetto.dev); top-N table printed
//
// perf::Range labels a region in the trace (a user-scope record function) and,
// when CUDA is present, in Nsight Systems (NVTX).
//
// Training loops profile a few steps past the first ones, as with Python's
// torch.profiler.schedule: step() ends each step.
//
//   perf::Profile p("trace.json", perf::ProfileOptions().schedule(
//                                     perf::ProfileSchedule().wait(1).warmup(1).active(3).repeat(1)));
//   for (auto& batch : *loader) { train_step(batch); p.step(); }   // steps 2-4 in trace.json
#pragma once

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <torch/arg.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/stubs/base.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace perf {

/// torch.profiler.schedule: after skip_first steps, cycles of `wait` steps
/// unprofiled, `warmup` steps profiled but discarded (the profiler's start-up
/// cost stays out of the trace), `active` steps recorded and written; `repeat`
/// cycles, 0 for as many as the profile lasts.
struct ProfileSchedule {
  TORCH_ARG(int64_t, wait) = 0;
  TORCH_ARG(int64_t, warmup) = 0;
  TORCH_ARG(int64_t, active) = 1;
  TORCH_ARG(int64_t, repeat) = 0;
  TORCH_ARG(int64_t, skip_first) = 0;
};

struct ProfileOptions {
  /// Also trace CUDA kernels and copies (when a CUDA device is present).
  TORCH_ARG(bool, cuda) = true;
  TORCH_ARG(bool, record_shapes) = false;
  TORCH_ARG(bool, profile_memory) = false;
  TORCH_ARG(bool, with_stack) = false;
  /// Rows of the operator table printed when the profile ends; 0 = none.
  TORCH_ARG(int, top) = 15;
  /// Where the table goes; nullptr = nowhere (summary() still has it).
  TORCH_ARG(OstreamPtr, out) = &std::cout;
  /// Profile only the steps it selects (Profile::step() ends a step); each
  /// cycle writes its own trace and table. Unset: everything until stop().
  TORCH_ARG(std::optional<ProfileSchedule>, schedule);
};

/// One operator (or kernel) aggregated over the profile.
struct OpStat {
  std::string name;
  std::string device;  // "cpu" or "cuda"
  int64_t calls = 0;
  double self_us = 0;   // time not spent in nested operators
  double total_us = 0;  // including nested operators
};

/// Aggregated profile: operators sorted by self time, largest first.
struct ProfileSummary {
  std::vector<OpStat> ops;
  std::string table(int top = 15) const;
};

/// Profiles from construction to stop() (or destruction) and writes a Chrome
/// trace to `path`; with a schedule, the steps it selects, one trace per cycle
/// (`path`, or with repeat other than 1 its stem + "-<cycle>" + its extension:
/// trace-1.json, trace-2.json). One profile at a time per process, as in LibTorch.
class Profile {
 public:
  explicit Profile(std::string path, const ProfileOptions& options = ProfileOptions());
  ~Profile();
  Profile(const Profile&) = delete;
  Profile& operator=(const Profile&) = delete;
  /// Ends a step, as Python's prof.step(): the schedule moves on, and each
  /// recorded step is labelled "ProfilerStep#N" in the trace.
  void step();
  /// Ends profiling, writes the trace (a cycle cut short by it too), prints the
  /// table; idempotent. The summary of the last trace written.
  const ProfileSummary& stop();
  const std::string& path() const noexcept { return path_; }
  /// Steps ended so far.
  int64_t step_num() const noexcept { return step_num_; }
  /// The traces written so far, in order.
  const std::vector<std::string>& traces() const noexcept { return traces_; }

 private:
  enum class Action { none, warmup, record, record_and_save };
  Action action_at(int64_t step) const;
  void transit(Action from, Action to, bool ending);
  void prepare();
  void start();
  void finish(bool write);  // ends the profiler; writes the trace and table if `write`
  void label_step();

  std::string path_;
  ProfileOptions options_;
  bool running_ = false;  // not stopped
  bool prepared_ = false, recording_ = false;
  int64_t step_num_ = 0, cycle_ = 0;
  Action action_ = Action::record;
  std::unique_ptr<at::RecordFunction> step_label_;
  std::vector<std::string> traces_;
  ProfileSummary summary_;
};

/// Labels the enclosing scope in the trace (and NVTX when CUDA is present).
class Range {
 public:
  explicit Range(const std::string& name);
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  at::RecordFunction guard_;
  bool nvtx_ = false;  // pushed an NVTX range: pop it, even if the stubs changed since
};

// ---------------------------------------------------------------------------
namespace detail {

struct Interval {
  std::string name;
  bool cuda;
  uint64_t thread, start, end;
};

// Self time: an operator's duration minus that of the operators nested directly
// in it on the same thread. GPU activity does not nest; its self = total.
PERF_INLINE ProfileSummary summarize(const std::vector<torch::autograd::profiler::KinetoEvent>& events);

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/profile-inl.h>
#endif
