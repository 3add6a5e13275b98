// perf/advise.h — what slows a training step down, with the evidence and the perf call that fixes it.
//
//   std::cout << perf::advise([&] { train_step(); });   // findings, each with evidence and the fix
//
// advise() observes the step through LibTorch's RecordFunction callbacks (what
// its profiler is built on) and, where the step uses CUDA, the sync-debug mode.
// The device under study is the one the step's operators run on (forced with
// AdviseOptions().device()). The observer never blocks an operator it
// observes: it takes its lock only to add to counters, never around anything
// that dispatches an operator, and ignores operators that it causes itself.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/detail/cpu.h>
#include <perf/detail/cuda.h>
#include <perf/memory.h>
#include <torch/arg.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iomanip>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace perf {

struct AdviseOptions {
  /// Observed steps (after warm-up).
  TORCH_ARG(int, steps) = 20;
  TORCH_ARG(int, warmup) = 3;
  /// The device under study. Unset: the one the step's operators run on (CUDA
  /// if any operator of the step sees a CUDA tensor, else the CPU), detected
  /// in the warm-up steps (with warmup(0), in the observed ones).
  TORCH_ARG(std::optional<c10::Device>, device);
  /// Share of step time waiting for data above which it is a finding.
  TORCH_ARG(double, data_wait_share) = 0.10;
};

/// One thing to change, with the evidence and the perf call that fixes it.
struct Finding {
  std::string what;      ///< short title
  std::string evidence;  ///< what was measured
  std::string fix;       ///< the perf call (or change) that fixes it
};

struct Advice {
  c10::Device device = c10::Device(c10::kCPU);
  int steps = 0;
  double median_step_ms = 0;
  std::vector<Finding> findings;
  /// Findings whose title contains `text`.
  bool has(const std::string& text) const;
  std::string to_string() const;
};
std::ostream& operator<<(std::ostream& os, const Advice& a);

/// Runs `step` (warm-up, then `steps` observed calls) and reports what slows it down.
Advice advise(const std::function<void()>& step, const AdviseOptions& options = AdviseOptions());

// --------------------------------------------------------------------------- implementation

namespace detail {

// What the RecordFunction observer sees during the observed steps.
struct AdviseCounters {
  std::mutex mutex;
  std::thread::id caller;
  int64_t convs = 0, convs_nchw = 0, compute_ops = 0, compute_fp32 = 0, cuda_compute_fp32 = 0;
  int64_t pageable_h2d = 0, pageable_h2d_bytes = 0, h2d = 0;
  std::map<std::string, int64_t> sync_sites;
  int64_t syncs = 0;
  double data_wait_s = 0;
  // Operators of the step (caller thread) that saw a CUDA tensor: the device under study.
  int64_t cuda_ops = 0;
  c10::DeviceIndex cuda_index = 0;
  // Convolution input shapes in call order, this step's and the first step's:
  // static shapes = every step calls the same convolutions on the same shapes.
  std::vector<std::vector<int64_t>> conv_shapes, first_conv_shapes;
  int steps_seen = 0;
  bool conv_shapes_vary = false;
  // Attention written out: softmax over the last dim of what the last bmm returned, outside
  // scaled_dot_product_attention (LibTorch's MultiheadAttention does it so; perf/attention.h does not).
  std::vector<int64_t> last_bmm, attention_shape;
  int64_t written_attention = 0;
  void end_step() {  // under mutex
    if (steps_seen++ == 0) {
      first_conv_shapes = std::move(conv_shapes);
    } else if (conv_shapes != first_conv_shapes) {
      conv_shapes_vary = true;
    }
    conv_shapes.clear();
  }
  // Open user scopes counted as data waits, per record-function handle.
  std::map<uint64_t, std::chrono::steady_clock::time_point> open_waits;
};

// The running advise's counters. Shared ownership: an op on another thread (a
// loader worker) may end after advise() returned.
struct AdviseSlot {
  std::mutex mutex;
  std::shared_ptr<AdviseCounters> current;
};
PERF_INLINE AdviseSlot& advise_slot();
PERF_INLINE std::shared_ptr<AdviseCounters> advise_counters();

inline thread_local std::vector<std::string> op_stack;
// Set while the observer itself works: operators it causes (is_pinned, say)
// are not observed, so it never re-enters itself.
inline thread_local bool in_observer = false;

PERF_INLINE bool is_data_scope(const std::string& name);

// Sets in_observer for a scope (restoring it: the observer may run inside one of its own).
class ObserverScope {
 public:
  ObserverScope() : was_(in_observer) { in_observer = true; }
  ~ObserverScope() { in_observer = was_; }
  ObserverScope(const ObserverScope&) = delete;
  ObserverScope& operator=(const ObserverScope&) = delete;

 private:
  bool was_;
};

// Everything that may dispatch an operator (is_pinned) happens before the
// counters' lock is taken, with in_observer set: the operators it causes are
// not observed, and no operator ever waits on that lock while holding it.
PERF_INLINE std::unique_ptr<at::ObserverContext> advise_start(const at::RecordFunction& fn);

PERF_INLINE void advise_end(const at::RecordFunction& fn, at::ObserverContext*);

// Sync-debug warnings (CUDA), counted with the innermost and outermost op when they fired.
class SyncWarningCounter : public c10::WarningHandler {
 public:
  explicit SyncWarningCounter(AdviseCounters* c) : counters_(c), previous_(c10::WarningUtils::get_warning_handler()) {}
  void process(const c10::Warning& warning) override {
    const std::string& msg = warning.msg();
    if (in_observer) return;  // the observer's own work is not the step's
    if (msg.find("synchroniz") == std::string::npos) {
      if (previous_ != nullptr) previous_->process(warning);
      return;
    }
    std::string where = op_stack.empty() ? std::string("(no op)") : op_stack.back();
    if (op_stack.size() > 1 && op_stack.front() != where) where = op_stack.front() + " > " + where;
    std::lock_guard<std::mutex> lock(counters_->mutex);
    ++counters_->syncs;
    ++counters_->sync_sites[where];
  }

 private:
  AdviseCounters* counters_;
  c10::WarningHandler* previous_;  // other warnings go on to it
};

// advise()'s observation: publishes the counters and installs the RecordFunction
// observer; the destructor takes both away, also when the step throws.
class AdviseScope {
 public:
  explicit AdviseScope(std::shared_ptr<AdviseCounters> counters) {
    auto& slot = advise_slot();
    {
      std::lock_guard<std::mutex> lock(slot.mutex);
      TORCH_CHECK(slot.current == nullptr, "perf::advise: already running in another thread (one advise at a time)");
      slot.current = std::move(counters);
    }
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(advise_start, advise_end)
                                        .needsInputs(true)
                                        .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
  }
  ~AdviseScope() {
    at::removeCallback(handle_);
    auto& slot = advise_slot();
    std::lock_guard<std::mutex> lock(slot.mutex);
    slot.current.reset();
  }
  AdviseScope(const AdviseScope&) = delete;
  AdviseScope& operator=(const AdviseScope&) = delete;

 private:
  at::CallbackHandle handle_ = 0;
};

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/advise-inl.h>
#endif
