// perf/profile.h — Chrome traces from LibTorch's (Kineto) profiler, with labels.
//
//   {
//     perf::Profile p("trace.json", perf::ProfileOptions().record_shapes(true));
//     for (...) { perf::Range r("train_step"); step(); }
//   }   // trace.json written (open it in https://ui.perfetto.dev); top-N table printed
//
// perf::Range labels a region in the trace (a user-scope record function) and,
// when CUDA is present, in Nsight Systems (NVTX).
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
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace perf {

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
/// trace to `path`. One profile at a time per process, as in LibTorch.
class Profile {
 public:
  explicit Profile(std::string path, const ProfileOptions& options = ProfileOptions());
  ~Profile();
  Profile(const Profile&) = delete;
  Profile& operator=(const Profile&) = delete;
  /// Ends profiling, writes the trace, prints the table; idempotent.
  const ProfileSummary& stop();
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  ProfileOptions options_;
  bool running_ = false;
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
