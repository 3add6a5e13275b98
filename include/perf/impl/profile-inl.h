// perf/impl/profile-inl.h — the out-of-line definitions of perf/profile.h.
// Included by perf/profile.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <c10/util/ScopeExit.h>
#include <perf/profile.h>

#include <filesystem>

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

namespace detail {

PERF_INLINE torch::profiler::impl::ProfilerConfig profiler_config(const ProfileOptions& o) {
  return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO, o.record_shapes(),
                                               o.profile_memory(), o.with_stack());
}

PERF_INLINE std::set<torch::profiler::impl::ActivityType> profiler_activities(const ProfileOptions& o) {
  std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CPU};
#if PERF_WITH_CUDA
  if (o.cuda() && c10::cuda::device_count() > 0) activities.insert(torch::profiler::impl::ActivityType::CUDA);
#else
  (void)o;
#endif
  return activities;
}

// Whether a perf::Profile is between its construction and stop(): one whose schedule waits has no profiler running
// that LibTorch would see.
PERF_INLINE std::atomic<bool>& profile_running() {
  static std::atomic<bool> running{false};
  return running;
}

// "dir/trace.json", 2 -> "dir/trace-2.json".
PERF_INLINE std::string cycle_path(const std::string& path, int64_t cycle) {
  const auto dot = path.find_last_of('.');
  const auto slash = path.find_last_of('/');
  const bool has_ext = dot != std::string::npos && dot > 0 && (slash == std::string::npos || dot > slash + 1);
  const auto stem_end = has_ext ? dot : path.size();
  return path.substr(0, stem_end) + "-" + std::to_string(cycle) + (has_ext ? path.substr(dot) : "");
}

}  // namespace detail

PERF_INLINE Profile::Profile(std::string path, const ProfileOptions& options)
    : path_(std::move(path)), options_(options) {
  TORCH_CHECK(!path_.empty(), "perf::Profile: empty trace path");
  // Kineto drops a trace it cannot write with a log line, at the end of the run: said here, before anything runs.
  const auto dir = std::filesystem::path(path_).parent_path();
  TORCH_CHECK(dir.empty() || std::filesystem::is_directory(dir), "perf::Profile: the trace's directory '", dir.string(),
              "' does not exist; create it first");
  TORCH_CHECK(options_.top() >= 0, "perf::ProfileOptions::top: must be >= 0 (0: no table), got ", options_.top());
  if (const auto& s = options_.schedule()) {
    TORCH_CHECK(s->wait() >= 0, "perf::ProfileSchedule::wait: must be >= 0, got ", s->wait());
    TORCH_CHECK(s->warmup() >= 0, "perf::ProfileSchedule::warmup: must be >= 0, got ", s->warmup());
    TORCH_CHECK(s->active() >= 1, "perf::ProfileSchedule::active: must be >= 1 (steps recorded a cycle), got ",
                s->active());
    TORCH_CHECK(s->repeat() >= 0,
                "perf::ProfileSchedule::repeat: must be >= 0 (0: cycles until the profile ends), got ", s->repeat());
    TORCH_CHECK(s->skip_first() >= 0, "perf::ProfileSchedule::skip_first: must be >= 0, got ", s->skip_first());
  }
  TORCH_CHECK(!torch::autograd::profiler::isProfilerEnabledInMainThread(),
              "perf::Profile: a profiler is already running in this process; end it first");
  TORCH_CHECK(!detail::profile_running().exchange(true),
              "perf::Profile: another perf::Profile is running in this process (its schedule may be between "
              "recordings); end it first");
  running_ = true;
  try {
    action_ = action_at(0);
    transit(Action::none, action_, /*ending=*/false);
    label_step();
  } catch (...) {
    running_ = false;
    step_label_.reset();
    if (recording_) {
      try {
        torch::autograd::profiler::disableProfiler();
      } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
      }
    }
    detail::profile_running() = false;
    throw;
  }
}

// torch.profiler.schedule's arithmetic.
PERF_INLINE Profile::Action Profile::action_at(int64_t step) const {
  if (!options_.schedule()) return Action::record;
  const auto& s = *options_.schedule();
  if (step < s.skip_first()) return Action::none;
  step -= s.skip_first();
  const int64_t cycle = s.wait() + s.warmup() + s.active();
  if (s.repeat() > 0 && step / cycle >= s.repeat()) return Action::none;
  const int64_t at = step % cycle;
  if (at < s.wait()) return Action::none;
  if (at < s.wait() + s.warmup()) return Action::warmup;
  return at < cycle - 1 ? Action::record : Action::record_and_save;
}

// torch.profiler.profile's transitions between the actions of two steps (or of the last step and the end).
PERF_INLINE void Profile::transit(Action from, Action to, bool ending) {
  const bool was_recording = from == Action::record || from == Action::record_and_save;
  const bool records = !ending && (to == Action::record || to == Action::record_and_save);
  const bool warms_up = !ending && to == Action::warmup;
  // A cycle ends after its last recorded step, or where recording stops early (the profile ends).
  if (was_recording && (from == Action::record_and_save || !records)) finish(/*write=*/true);
  if (from == Action::warmup && !records && !warms_up) {  // prepared, never recorded: torn down, nothing written
    start();
    finish(/*write=*/false);
  }
  if ((records || warms_up) && !prepared_) prepare();
  if (records && !recording_) start();
}

PERF_INLINE void Profile::prepare() {
  torch::autograd::profiler::prepareProfiler(detail::profiler_config(options_), detail::profiler_activities(options_));
  prepared_ = true;
}

PERF_INLINE void Profile::start() {
  if (!prepared_) prepare();
  torch::autograd::profiler::enableProfiler(detail::profiler_config(options_), detail::profiler_activities(options_));
  recording_ = true;
}

PERF_INLINE void Profile::finish(bool write) {
  step_label_.reset();
  if (!recording_) return;  // a transition that threw before its start()
  prepared_ = recording_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  if (!write) return;
  ++cycle_;
  const bool one_trace = !options_.schedule() || options_.schedule()->repeat() == 1;
  const std::string path = one_trace ? path_ : detail::cycle_path(path_, cycle_);
  result->save(path);
  TORCH_CHECK(std::filesystem::exists(path), "perf::Profile: the profiler could not write the trace to '", path,
              "' (its own message is above)");
  traces_.push_back(path);
  summary_ = detail::summarize(result->events());
  if (options_.out() && options_.top() > 0) {
    *options_.out() << "perf::Profile: trace written to " << path << "\n" << summary_.table(options_.top());
  }
}

PERF_INLINE void Profile::label_step() {
  if (!recording_) return;
  step_label_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (step_label_->isActive()) step_label_->before("ProfilerStep#" + std::to_string(step_num_));
}

PERF_INLINE void Profile::step() {
  TORCH_CHECK(running_, "perf::Profile::step: the profile has stopped");
  step_label_.reset();
  ++step_num_;
  const Action from = action_;
  action_ = action_at(step_num_);  // where a transition throws (a trace that cannot be written), the next goes on
  transit(from, action_, /*ending=*/false);
  label_step();
}

PERF_INLINE const ProfileSummary& Profile::stop() {
  if (!running_) return summary_;
  running_ = false;
  step_label_.reset();
  // The next profile may start, even where writing this one's trace failed.
  const auto release = c10::make_scope_exit([] { detail::profile_running() = false; });
  transit(action_, Action::none, /*ending=*/true);
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
