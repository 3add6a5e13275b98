// perf/impl/profile-inl.h — the out-of-line definitions of perf/profile.h.
// Included by perf/profile.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/profile.h>

namespace perf {

namespace detail {

PERF_INLINE ProfileSummary summarize(const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
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

PERF_INLINE std::string ProfileSummary::table(int top) const {
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

PERF_INLINE Profile::Profile(std::string path, const ProfileOptions& options)
    : path_(std::move(path)), options_(options) {
  using namespace torch::profiler::impl;
  TORCH_CHECK(!path_.empty(), "perf::Profile: empty trace path");
  TORCH_CHECK(options_.top() >= 0, "perf::ProfileOptions::top: must be >= 0 (0: no table), got ", options_.top());
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

PERF_INLINE const ProfileSummary& Profile::stop() {
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

PERF_INLINE Profile::~Profile() {
  try {
    stop();
  } catch (const std::exception& e) {
    std::cerr << "perf::Profile: could not finish the trace " << path_ << ": " << e.what() << "\n";
  }
}

PERF_INLINE Range::Range(const std::string& name) : guard_(at::RecordScope::USER_SCOPE) {
  if (guard_.isActive()) guard_.before(name);
  // NVTX through LibTorch's CUDA profiler stubs (registered when torch_cuda is
  // loaded): NVTX's own header defines ~70 functions in every translation unit.
  const auto* stubs = torch::profiler::impl::cudaStubs();
  if (stubs->enabled()) {
    stubs->rangePush(name.c_str());
    nvtx_ = true;
  }
}

PERF_INLINE Range::~Range() {
  if (nvtx_) torch::profiler::impl::cudaStubs()->rangePop();
}

}  // namespace perf
