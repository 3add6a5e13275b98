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

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#if defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define PERF_HAS_NVTX 1
#endif
#endif
#endif
#ifndef PERF_HAS_NVTX
#define PERF_HAS_NVTX 0
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
inline ProfileSummary summarize(const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
  std::vector<Interval> iv;
  for (const auto& e : events) {
    if (e.isAsync() || e.endNs() < e.startNs()) continue;
    iv.push_back({e.name(), e.deviceType() == c10::DeviceType::CUDA, e.startThreadId(), e.startNs(), e.endNs()});
  }
  std::sort(iv.begin(), iv.end(), [](const Interval& a, const Interval& b) {
    if (a.cuda != b.cuda) return a.cuda < b.cuda;
    if (a.thread != b.thread) return a.thread < b.thread;
    if (a.start != b.start) return a.start < b.start;
    return a.end > b.end;
  });
  std::vector<double> child(iv.size(), 0.0);
  std::vector<size_t> stack;
  for (size_t i = 0; i < iv.size(); ++i) {
    if (iv[i].cuda) continue;
    while (!stack.empty() && (iv[stack.back()].thread != iv[i].thread || iv[stack.back()].end <= iv[i].start))
      stack.pop_back();
    if (!stack.empty()) child[stack.back()] += static_cast<double>(iv[i].end - iv[i].start) / 1000.0;
    stack.push_back(i);
  }
  std::map<std::pair<std::string, bool>, OpStat> agg;
  for (size_t i = 0; i < iv.size(); ++i) {
    auto& s = agg[{iv[i].name, iv[i].cuda}];
    s.name = iv[i].name;
    s.device = iv[i].cuda ? "cuda" : "cpu";
    const double total = static_cast<double>(iv[i].end - iv[i].start) / 1000.0;
    s.calls += 1;
    s.total_us += total;
    s.self_us += std::max(0.0, total - child[i]);
  }
  ProfileSummary out;
  for (auto& [k, v] : agg) out.ops.push_back(v);
  std::sort(out.ops.begin(), out.ops.end(), [](const OpStat& a, const OpStat& b) { return a.self_us > b.self_us; });
  return out;
}

}  // namespace detail

// ---------------------------------------------------------------------------

inline std::string ProfileSummary::table(int top) const {
  std::ostringstream os;
  os << std::left << std::setw(44) << "operator" << std::setw(6) << "dev" << std::right << std::setw(8) << "calls"
     << std::setw(14) << "self ms" << std::setw(14) << "total ms"
     << "\n";
  const size_t n = std::min(ops.size(), static_cast<size_t>(std::max(top, 0)));
  for (size_t i = 0; i < n; ++i) {
    const auto& o = ops[i];
    const std::string name = o.name.size() > 42 ? o.name.substr(0, 39) + "..." : o.name;
    os << std::left << std::setw(44) << name << std::setw(6) << o.device << std::right << std::setw(8) << o.calls
       << std::setw(14) << std::fixed << std::setprecision(3) << o.self_us / 1000.0 << std::setw(14)
       << o.total_us / 1000.0 << "\n";
  }
  return os.str();
}

inline Profile::Profile(std::string path, const ProfileOptions& options) : path_(std::move(path)), options_(options) {
  using namespace torch::profiler::impl;
  TORCH_CHECK(!path_.empty(), "perf::Profile: empty trace path");
  TORCH_CHECK(!torch::autograd::profiler::isProfilerEnabledInMainThread(),
              "perf::Profile: a profiler is already running in this process; end it first");
  std::set<ActivityType> activities{ActivityType::CPU};
#if PERF_WITH_CUDA
  if (options_.cuda() && c10::cuda::device_count() > 0) activities.insert(ActivityType::CUDA);
#endif
  const ProfilerConfig config(ProfilerState::KINETO, options_.record_shapes(), options_.profile_memory(),
                              options_.with_stack());
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  running_ = true;
}

inline const ProfileSummary& Profile::stop() {
  if (!running_) return summary_;
  running_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  result->save(path_);
  summary_ = detail::summarize(result->events());
  if (options_.out() && options_.top() > 0) {
    *options_.out() << "perf::Profile: trace written to " << path_ << "\n" << summary_.table(options_.top());
  }
  return summary_;
}

inline Profile::~Profile() {
  try {
    stop();
  } catch (const std::exception& e) {
    std::cerr << "perf::Profile: could not finish the trace " << path_ << ": " << e.what() << "\n";
  }
}

inline Range::Range(const std::string& name) : guard_(at::RecordScope::USER_SCOPE) {
  if (guard_.isActive()) guard_.before(name);
#if PERF_HAS_NVTX
  nvtxRangePushA(name.c_str());
#endif
}

inline Range::~Range() {
#if PERF_HAS_NVTX
  nvtxRangePop();
#endif
}

}  // namespace perf
