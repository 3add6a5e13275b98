// perf/impl/lr_scheduler-inl.h — the out-of-line definitions of perf/lr_scheduler.h.
// Included by perf/lr_scheduler.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
//
// Each get_lr() is Python's (torch/optim/lr_scheduler.py in 2.11), operation for
// operation, so that the rates are Python's to the last bit.
#pragma once

#include <c10/util/Exception.h>
#include <perf/detail/float.h>
#include <perf/lr_scheduler.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace perf::optim {

namespace detail {

// Python's math.pi.
constexpr double kPi = 3.141592653589793;

// Python's _format_param: one value for every group, or one per group.
PERF_INLINE std::vector<double> per_group(const PerGroup& value, const torch::optim::Optimizer& optimizer,
                                          const std::string& who, const char* name) {
  const std::size_t groups = optimizer.param_groups().size();
  TORCH_CHECK(value.values.size() == 1 || value.values.size() == groups, who, ": ", name, " has ", value.values.size(),
              " values and the optimizer ", groups, " param groups; give one value, or one per param group");
  return value.values.size() == 1 ? std::vector<double>(groups, value.values[0]) : value.values;
}

// How the optimizer takes momentum, as Python's CyclicLR and OneCycleLR look for it in optimizer.defaults:
// "betas" (its first is set) or "momentum"; none: an error naming what to do.
enum class MomentumKind { momentum, beta1 };
PERF_INLINE std::optional<MomentumKind> momentum_kind(const torch::optim::OptimizerOptions& o) {
  if (dynamic_cast<const torch::optim::SGDOptions*>(&o) || dynamic_cast<const torch::optim::RMSpropOptions*>(&o) ||
      dynamic_cast<const perf::optim::SGDOptions*>(&o))
    return MomentumKind::momentum;
  if (dynamic_cast<const torch::optim::AdamOptions*>(&o) || dynamic_cast<const torch::optim::AdamWOptions*>(&o) ||
      dynamic_cast<const perf::optim::AdamOptions*>(&o) || dynamic_cast<const perf::optim::AdamWOptions*>(&o))
    return MomentumKind::beta1;
  return std::nullopt;
}
PERF_INLINE MomentumKind check_momentum(const torch::optim::Optimizer& optimizer, const std::string& who) {
  const auto kind = momentum_kind(optimizer.defaults());
  TORCH_CHECK(kind, who,
              ": cycle_momentum is true, and the optimizer has neither momentum nor betas (Python's error: "
              "\"optimizer must support momentum or beta1 with `cycle_momentum` option enabled\"); "
              "use SGD, RMSprop, Adam or AdamW (torch::optim's or perf::optim's), or cycle_momentum(false)");
  return *kind;
}
PERF_INLINE void set_momentum(torch::optim::OptimizerOptions& o, double m) {
  if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&o)) {
    s->momentum(m);
  } else if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(&o)) {
    r->momentum(m);
  } else if (auto* ps = dynamic_cast<perf::optim::SGDOptions*>(&o)) {
    ps->momentum(m);
  } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) {
    a->betas({m, std::get<1>(a->betas())});
  } else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) {
    w->betas({m, std::get<1>(w->betas())});
  } else if (auto* pa = dynamic_cast<perf::optim::AdamOptions*>(&o)) {
    pa->betas({m, std::get<1>(pa->betas())});
  } else if (auto* pw = dynamic_cast<perf::optim::AdamWOptions*>(&o)) {
    pw->betas({m, std::get<1>(pw->betas())});
  }
}

// Reading Python's state_dict() values: `who` names the scheduler's load in errors.
PERF_INLINE int64_t state_int(const c10::impl::GenericDict& d, const char* key, const std::string& who) {
  TORCH_CHECK(d.contains(key), who, ": the state has no \"", key, "\"");
  const c10::IValue v = d.at(key);
  TORCH_CHECK(v.isInt(), who, ": \"", key, "\" is a ", v.tagKind(), ", not an int");
  return v.toInt();
}
PERF_INLINE std::vector<double> state_numbers(const c10::impl::GenericDict& d, const char* key,
                                              const std::string& who) {
  TORCH_CHECK(d.contains(key), who, ": the state has no \"", key, "\"");
  const c10::IValue v = d.at(key);
  TORCH_CHECK(v.isList() || v.isDoubleList() || v.isIntList(), who, ": \"", key, "\" is a ", v.tagKind(),
              ", not a list of numbers");
  std::vector<double> out;
  for (const c10::IValue& e : v.toListRef()) {
    TORCH_CHECK(e.isDouble() || e.isInt(), who, ": \"", key, "\" holds a ", e.tagKind(), ", not a number");
    out.push_back(e.isDouble() ? e.toDouble() : static_cast<double>(e.toInt()));
  }
  return out;
}
PERF_INLINE std::string state_string(const c10::impl::GenericDict& d, const char* key, const std::string& who) {
  TORCH_CHECK(d.contains(key), who, ": the state has no \"", key, "\"");
  const c10::IValue v = d.at(key);
  TORCH_CHECK(v.isString(), who, ": \"", key, "\" is a ", v.tagKind(), ", not a str");
  return v.toStringRef();
}
PERF_INLINE c10::IValue numbers_value(const std::vector<double>& values) {
  return c10::IValue(c10::List<double>(values));
}
// The functions of LambdaLR and MultiplicativeLR: None for each (Python writes an object's attributes there,
// which a std::function has none of).
PERF_INLINE void check_lambdas_state(const c10::impl::GenericDict& d, std::size_t n, const std::string& who) {
  TORCH_CHECK(d.contains("lr_lambdas"), who, ": the state has no \"lr_lambdas\"");
  const c10::IValue v = d.at("lr_lambdas");
  TORCH_CHECK(v.isList() && v.toListRef().size() == n, who, ": \"lr_lambdas\" is not a list of ", n,
              " entries (one per param group)");
  for (const c10::IValue& e : v.toListRef())
    TORCH_CHECK(e.isNone(), who,
                ": \"lr_lambdas\" holds the attributes of a Python callable object; a C++ function has none to "
                "load (save the state from a plain function, or leave it out)");
}
PERF_INLINE c10::IValue lambdas_state(std::size_t n) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (std::size_t i = 0; i < n; ++i) list.push_back(c10::IValue());
  return list;
}

}  // namespace detail

// ---- LRScheduler ---------------------------------------------------------------------------------------------

PERF_INLINE LRScheduler::~LRScheduler() {
  if (!registered_) return;
  std::lock_guard<std::mutex> lock(detail::scheduler_group_values_mutex());
  auto& registry = detail::scheduler_group_values();
  auto it = registry.find(&optimizer_);
  if (it != registry.end() && --it->second.schedulers == 0) registry.erase(it);
}

PERF_INLINE std::string LRScheduler::who(const char* what) const {
  return std::string("perf::optim::") + name() + (what[0] ? "::" : "") + what;
}

PERF_INLINE detail::SchedulerGroupValues& LRScheduler::record() {
  auto& record = detail::scheduler_group_values()[&optimizer_];
  if (!registered_) {
    ++record.schedulers;
    registered_ = true;
  }
  return record;
}

PERF_INLINE void LRScheduler::start() {
  {
    std::lock_guard<std::mutex> lock(detail::scheduler_group_values_mutex());
    auto& initial = record()["initial_lr"];  // Python: group.setdefault("initial_lr", group["lr"])
    const auto& groups = optimizer_.param_groups();
    for (std::size_t i = initial.size(); i < groups.size(); ++i) initial.push_back(groups[i].options().get_lr());
    base_lrs_.assign(initial.begin(), initial.begin() + static_cast<std::ptrdiff_t>(groups.size()));
  }
  initial_step();
}

PERF_INLINE void LRScheduler::set_group_values(const std::string& key, const std::vector<double>& values) {
  std::lock_guard<std::mutex> lock(detail::scheduler_group_values_mutex());
  record()[key] = values;
}

PERF_INLINE void LRScheduler::initial_step() {
  step_count_ = 0;
  is_initial_ = true;
  try {
    step();
  } catch (...) {
    is_initial_ = false;
    throw;
  }
  is_initial_ = false;
}

PERF_INLINE void LRScheduler::step() {
  ++step_count_;
  update_lr();
}

PERF_INLINE void LRScheduler::update_lr(std::optional<int64_t> epoch) {
  std::vector<double> values;
  if (!epoch) {
    ++last_epoch_;
    values = get_lr();
  } else {
    last_epoch_ = *epoch;
    auto closed = closed_form_lr();
    values = closed ? std::move(*closed) : get_lr();
  }
  set_lrs(values);
  last_lr_ = group_lrs();
}

PERF_INLINE std::vector<double> LRScheduler::get_lr() {
  TORCH_CHECK(false, who("step"),
              ": has no rates of its own to restart from at a SequentialLR milestone (Python's raises "
              "NotImplementedError there too); put the schedulers it holds in the outer SequentialLR instead");
  return {};
}

PERF_INLINE void LRScheduler::undo_epoch() { --last_epoch_; }

PERF_INLINE void LRScheduler::set_lrs(const std::vector<double>& lrs) {
  auto& groups = optimizer_.param_groups();
  check_groups(lrs.size(), "rates");
  for (std::size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(lrs[i]);
}

PERF_INLINE std::vector<double> LRScheduler::group_lrs() const {
  std::vector<double> out;
  for (const auto& g : optimizer_.param_groups()) out.push_back(g.options().get_lr());
  return out;
}

PERF_INLINE void LRScheduler::check_groups(std::size_t kept, const char* what) const {
  const std::size_t groups = optimizer_.param_groups().size();
  TORCH_CHECK(kept == groups, who("step"), ": the optimizer has ", groups, " param groups and the scheduler ", kept,
              " ", what,
              " (a group added after the scheduler was made; Python's zip(strict=True) refuses it too): make "
              "the scheduler after add_param_group");
}

PERF_INLINE c10::impl::GenericDict LRScheduler::state_dict() const {
  auto d = perf::optim::detail::python_dict();
  write_state(d);
  d.insert("base_lrs", detail::numbers_value(base_lrs_));
  d.insert("last_epoch", last_epoch_);
  d.insert("_step_count", step_count_);
  d.insert("_is_initial", false);
  d.insert("_get_lr_called_within_step", false);
  d.insert("_last_lr", detail::numbers_value(last_lr_));
  if (d.contains("lr_lambdas")) {  // Python's LambdaLR and MultiplicativeLR write it last
    const c10::IValue lambdas = d.at("lr_lambdas");
    (void)d.erase("lr_lambdas");
    d.insert("lr_lambdas", lambdas);
  }
  return d;
}

PERF_INLINE std::function<void()> LRScheduler::prepare_load(const c10::IValue& state) {
  const std::string w = who("load_state_dict");
  TORCH_CHECK(state.isGenericDict(), w, ": the state is a ", state.tagKind(), ", not a dict (Python's ", name(),
              ".state_dict(), or this class's)");
  const auto d = state.toGenericDict();
  for (const auto& item : d)
    TORCH_CHECK(item.key().isString(), w, ": a key of the state is a ", item.key().tagKind(), ", not a str");
  const int64_t last_epoch = detail::state_int(d, "last_epoch", w);
  const int64_t step_count = detail::state_int(d, "_step_count", w);
  auto base_lrs = detail::state_numbers(d, "base_lrs", w);
  auto last_lr = detail::state_numbers(d, "_last_lr", w);
  const std::size_t groups = optimizer_.param_groups().size();
  TORCH_CHECK(base_lrs.size() == groups && last_lr.size() == groups, w, ": the state has ", base_lrs.size(),
              " base_lrs and ", last_lr.size(), " _last_lr for an optimizer of ", groups, " param groups");
  auto apply_own = read_state(d);
  return [this, last_epoch, step_count, base_lrs = std::move(base_lrs), last_lr = std::move(last_lr),
          apply_own = std::move(apply_own)]() {
    apply_own();
    last_epoch_ = last_epoch;
    step_count_ = step_count;
    base_lrs_ = base_lrs;
    last_lr_ = last_lr;
  };
}

PERF_INLINE std::function<void()> LRScheduler::read_state(const c10::impl::GenericDict& state) {
  (void)state;
  return [] {};
}

PERF_INLINE void LRScheduler::load_state_dict(const c10::IValue& state) { prepare_load(state)(); }

// ---- LambdaLR, MultiplicativeLR ------------------------------------------------------------------------------

PERF_INLINE detail::LambdaScheduler::LambdaScheduler(torch::optim::Optimizer& optimizer, std::vector<Lambda> lr_lambdas,
                                                     const char* name)
    : LRScheduler(optimizer), lr_lambdas_(std::move(lr_lambdas)) {
  const std::string w = std::string("perf::optim::") + name;
  TORCH_CHECK(lr_lambdas_.size() == optimizer.param_groups().size(), w, ": expected ", optimizer.param_groups().size(),
              " lr_lambdas (one per param group), but got ", lr_lambdas_.size());
  for (std::size_t i = 0; i < lr_lambdas_.size(); ++i) TORCH_CHECK(lr_lambdas_[i], w, ": lr_lambda ", i, " is empty");
}

PERF_INLINE void detail::LambdaScheduler::write_state(c10::impl::GenericDict& state) const {
  state.insert("lr_lambdas", detail::lambdas_state(lr_lambdas_.size()));
}

PERF_INLINE std::function<void()> detail::LambdaScheduler::read_state(const c10::impl::GenericDict& state) {
  detail::check_lambdas_state(state, lr_lambdas_.size(), who("load_state_dict"));
  return [] {};
}

PERF_INLINE LambdaLR::LambdaLR(torch::optim::Optimizer& optimizer, Lambda lr_lambda)
    : LambdaLR(optimizer, std::vector<Lambda>(optimizer.param_groups().size(), std::move(lr_lambda))) {}

PERF_INLINE LambdaLR::LambdaLR(torch::optim::Optimizer& optimizer, std::vector<Lambda> lr_lambdas)
    : LambdaScheduler(optimizer, std::move(lr_lambdas), "LambdaLR") {
  start();
}

PERF_INLINE std::vector<double> LambdaLR::get_lr() {
  check_groups(lr_lambdas_.size(), "lr_lambdas");
  check_groups(base_lrs_.size(), "base_lrs");
  std::vector<double> out;
  for (std::size_t i = 0; i < lr_lambdas_.size(); ++i) out.push_back(base_lrs_[i] * lr_lambdas_[i](last_epoch_));
  return out;
}

PERF_INLINE MultiplicativeLR::MultiplicativeLR(torch::optim::Optimizer& optimizer, Lambda lr_lambda)
    : MultiplicativeLR(optimizer, std::vector<Lambda>(optimizer.param_groups().size(), std::move(lr_lambda))) {}

PERF_INLINE MultiplicativeLR::MultiplicativeLR(torch::optim::Optimizer& optimizer, std::vector<Lambda> lr_lambdas)
    : LambdaScheduler(optimizer, std::move(lr_lambdas), "MultiplicativeLR") {
  start();
}

PERF_INLINE std::vector<double> MultiplicativeLR::get_lr() {
  if (is_initial_) return group_lrs();
  check_groups(lr_lambdas_.size(), "lr_lambdas");
  std::vector<double> out = group_lrs();
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = out[i] * lr_lambdas_[i](last_epoch_);
  return out;
}

// ---- StepLR, MultiStepLR, ConstantLR, LinearLR, ExponentialLR, PolynomialLR ----------------------------------

namespace detail {
// Each rate times `factor`.
PERF_INLINE std::vector<double> scaled(std::vector<double> lrs, double factor) {
  for (double& lr : lrs) lr = lr * factor;
  return lrs;
}
}  // namespace detail

PERF_INLINE StepLR::StepLR(torch::optim::Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  TORCH_CHECK(step_size > 0, who(""), ": step_size is ", step_size, "; it must be a positive number of epochs");
  start();
}

PERF_INLINE std::vector<double> StepLR::get_lr() {
  if (last_epoch_ == 0 || last_epoch_ % step_size_ != 0) return group_lrs();
  return detail::scaled(group_lrs(), gamma_);
}

PERF_INLINE std::optional<std::vector<double>> StepLR::closed_form_lr() const {
  // Python's floor division: last_epoch is never negative here.
  return detail::scaled(base_lrs_, std::pow(gamma_, static_cast<double>(last_epoch_ / step_size_)));
}

PERF_INLINE void StepLR::write_state(c10::impl::GenericDict& state) const {
  state.insert("step_size", step_size_);
  state.insert("gamma", gamma_);
}

PERF_INLINE std::function<void()> StepLR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  const int64_t step_size = detail::state_int(state, "step_size", w);
  TORCH_CHECK(step_size > 0, w, ": step_size is ", step_size, "; it must be positive");
  const double gamma = perf::optim::detail::python_number(state, "gamma", w, "");
  return [this, step_size, gamma] {
    step_size_ = step_size;
    gamma_ = gamma;
  };
}

PERF_INLINE MultiStepLR::MultiStepLR(torch::optim::Optimizer& optimizer, std::vector<int64_t> milestones, double gamma)
    : LRScheduler(optimizer), milestones_(std::move(milestones)), gamma_(gamma) {
  std::sort(milestones_.begin(), milestones_.end());
  start();
}

PERF_INLINE std::vector<double> MultiStepLR::get_lr() {
  const auto count = std::count(milestones_.begin(), milestones_.end(), last_epoch_);
  if (count == 0) return group_lrs();
  return detail::scaled(group_lrs(), std::pow(gamma_, static_cast<double>(count)));
}

PERF_INLINE std::optional<std::vector<double>> MultiStepLR::closed_form_lr() const {
  const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin();
  return detail::scaled(base_lrs_, std::pow(gamma_, static_cast<double>(passed)));
}

PERF_INLINE void MultiStepLR::write_state(c10::impl::GenericDict& state) const {
  // Python's Counter({milestone: times}); a dict in the file (Python's get_lr reads it as one).
  auto counts = perf::optim::detail::python_dict();
  for (int64_t m : milestones_)
    counts.insert_or_assign(m, counts.contains(m) ? c10::IValue(counts.at(m).toInt() + 1) : c10::IValue(int64_t{1}));
  state.insert("milestones", counts);
  state.insert("gamma", gamma_);
}

PERF_INLINE std::function<void()> MultiStepLR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  TORCH_CHECK(state.contains("milestones"), w, ": the state has no \"milestones\"");
  const c10::IValue m = state.at("milestones");
  std::vector<int64_t> milestones;
  if (m.isGenericDict()) {  // Python's Counter ({epoch: times})
    for (const auto& item : m.toGenericDict()) {
      TORCH_CHECK(item.key().isInt() && item.value().isInt() && item.value().toInt() >= 0, w,
                  ": \"milestones\" is not a Counter of epochs");
      milestones.insert(milestones.end(), static_cast<std::size_t>(item.value().toInt()), item.key().toInt());
    }
  } else {
    TORCH_CHECK(m.isIntList() || m.isList(), w, ": \"milestones\" is a ", m.tagKind(), ", not a Counter of epochs");
    for (const c10::IValue& e : m.toListRef()) {
      TORCH_CHECK(e.isInt(), w, ": \"milestones\" holds a ", e.tagKind(), ", not an epoch");
      milestones.push_back(e.toInt());
    }
  }
  std::sort(milestones.begin(), milestones.end());
  const double gamma = perf::optim::detail::python_number(state, "gamma", w, "");
  return [this, milestones = std::move(milestones), gamma] {
    milestones_ = milestones;
    gamma_ = gamma;
  };
}

PERF_INLINE ConstantLR::ConstantLR(torch::optim::Optimizer& optimizer, double factor, int64_t total_iters)
    : LRScheduler(optimizer), factor_(factor), total_iters_(total_iters) {
  TORCH_CHECK(factor >= 0 && factor <= 1.0, who(""), ": factor is ", factor,
              "; Python's error: \"Constant multiplicative factor expected to be between 0 and 1.\"");
  start();
}

PERF_INLINE std::vector<double> ConstantLR::get_lr() {
  if (last_epoch_ == 0) return detail::scaled(group_lrs(), factor_);
  if (last_epoch_ != total_iters_) return group_lrs();
  TORCH_CHECK(!perf::detail::same_value(factor_, 0.0), who("step"),
              ": factor 0 cannot be undone at total_iters (Python's raises "
              "ZeroDivisionError here)");
  return detail::scaled(group_lrs(), 1.0 / factor_);
}

PERF_INLINE std::optional<std::vector<double>> ConstantLR::closed_form_lr() const {
  return detail::scaled(base_lrs_, factor_ + (last_epoch_ >= total_iters_ ? 1 - factor_ : 0.0));
}

PERF_INLINE void ConstantLR::write_state(c10::impl::GenericDict& state) const {
  state.insert("factor", factor_);
  state.insert("total_iters", total_iters_);
}

PERF_INLINE std::function<void()> ConstantLR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  const double factor = perf::optim::detail::python_number(state, "factor", w, "");
  const int64_t total_iters = detail::state_int(state, "total_iters", w);
  return [this, factor, total_iters] {
    factor_ = factor;
    total_iters_ = total_iters;
  };
}

PERF_INLINE LinearLR::LinearLR(torch::optim::Optimizer& optimizer, double start_factor, double end_factor,
                               int64_t total_iters)
    : LRScheduler(optimizer), start_factor_(start_factor), end_factor_(end_factor), total_iters_(total_iters) {
  TORCH_CHECK(start_factor > 0 && start_factor <= 1.0, who(""), ": start_factor is ", start_factor,
              "; Python's error: \"Starting multiplicative factor expected to be greater than 0 and less or "
              "equal to 1.\"");
  TORCH_CHECK(end_factor >= 0 && end_factor <= 1.0, who(""), ": end_factor is ", end_factor,
              "; Python's error: \"Ending multiplicative factor expected to be between 0 and 1.\"");
  TORCH_CHECK(total_iters > 0, who(""), ": total_iters is ", total_iters, "; it must be a positive number of epochs");
  start();
}

PERF_INLINE std::vector<double> LinearLR::get_lr() {
  if (last_epoch_ == 0) return detail::scaled(group_lrs(), start_factor_);
  if (is_initial_ || last_epoch_ > total_iters_) return group_lrs();
  const double span = end_factor_ - start_factor_;
  return detail::scaled(group_lrs(), 1.0 + span / (static_cast<double>(total_iters_) * start_factor_ +
                                                   static_cast<double>(last_epoch_ - 1) * span));
}

PERF_INLINE std::optional<std::vector<double>> LinearLR::closed_form_lr() const {
  const double done = static_cast<double>(std::min(total_iters_, last_epoch_));
  return detail::scaled(base_lrs_,
                        start_factor_ + (end_factor_ - start_factor_) * done / static_cast<double>(total_iters_));
}

PERF_INLINE void LinearLR::write_state(c10::impl::GenericDict& state) const {
  state.insert("start_factor", start_factor_);
  state.insert("end_factor", end_factor_);
  state.insert("total_iters", total_iters_);
}

PERF_INLINE std::function<void()> LinearLR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  const double start_factor = perf::optim::detail::python_number(state, "start_factor", w, "");
  const double end_factor = perf::optim::detail::python_number(state, "end_factor", w, "");
  const int64_t total_iters = detail::state_int(state, "total_iters", w);
  TORCH_CHECK(total_iters > 0, w, ": total_iters is ", total_iters, "; it must be positive");
  return [this, start_factor, end_factor, total_iters] {
    start_factor_ = start_factor;
    end_factor_ = end_factor;
    total_iters_ = total_iters;
  };
}

PERF_INLINE ExponentialLR::ExponentialLR(torch::optim::Optimizer& optimizer, double gamma)
    : LRScheduler(optimizer), gamma_(gamma) {
  start();
}

PERF_INLINE std::vector<double> ExponentialLR::get_lr() {
  if (is_initial_) return group_lrs();
  return detail::scaled(group_lrs(), gamma_);
}

PERF_INLINE std::optional<std::vector<double>> ExponentialLR::closed_form_lr() const {
  return detail::scaled(base_lrs_, std::pow(gamma_, static_cast<double>(last_epoch_)));
}

PERF_INLINE void ExponentialLR::write_state(c10::impl::GenericDict& state) const { state.insert("gamma", gamma_); }

PERF_INLINE std::function<void()> ExponentialLR::read_state(const c10::impl::GenericDict& state) {
  const double gamma = perf::optim::detail::python_number(state, "gamma", who("load_state_dict"), "");
  return [this, gamma] { gamma_ = gamma; };
}

PERF_INLINE PolynomialLR::PolynomialLR(torch::optim::Optimizer& optimizer, int64_t total_iters, double power)
    : LRScheduler(optimizer), total_iters_(total_iters), power_(power) {
  TORCH_CHECK(total_iters > 0, who(""), ": total_iters is ", total_iters, "; it must be a positive number of epochs");
  start();
}

PERF_INLINE std::vector<double> PolynomialLR::get_lr() {
  if (is_initial_ || last_epoch_ > total_iters_) return group_lrs();
  const double total = static_cast<double>(total_iters_);
  const double decay = std::pow(
      (1.0 - static_cast<double>(last_epoch_) / total) / (1.0 - static_cast<double>(last_epoch_ - 1) / total), power_);
  return detail::scaled(group_lrs(), decay);
}

PERF_INLINE std::optional<std::vector<double>> PolynomialLR::closed_form_lr() const {
  const double total = static_cast<double>(total_iters_);
  return detail::scaled(base_lrs_,
                        std::pow(1.0 - static_cast<double>(std::min(total_iters_, last_epoch_)) / total, power_));
}

PERF_INLINE void PolynomialLR::write_state(c10::impl::GenericDict& state) const {
  state.insert("total_iters", total_iters_);
  state.insert("power", power_);
}

PERF_INLINE std::function<void()> PolynomialLR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  const int64_t total_iters = detail::state_int(state, "total_iters", w);
  TORCH_CHECK(total_iters > 0, w, ": total_iters is ", total_iters, "; it must be positive");
  const double power = perf::optim::detail::python_number(state, "power", w, "");
  return [this, total_iters, power] {
    total_iters_ = total_iters;
    power_ = power;
  };
}

// ---- CosineAnnealingLR, CosineAnnealingWarmRestarts ----------------------------------------------------------

PERF_INLINE CosineAnnealingLR::CosineAnnealingLR(torch::optim::Optimizer& optimizer, int64_t T_max, double eta_min)
    : LRScheduler(optimizer), T_max_(T_max), eta_min_(eta_min) {
  TORCH_CHECK(T_max > 0, who(""), ": T_max is ", T_max, "; it must be a positive number of epochs");
  start();
}

PERF_INLINE std::vector<double> CosineAnnealingLR::get_lr() {
  if (is_initial_) return group_lrs();
  const double t_max = static_cast<double>(T_max_);
  const double epoch = static_cast<double>(last_epoch_);
  std::vector<double> out = group_lrs();
  if (step_count_ == 1 && last_epoch_ > 0) {
    check_groups(base_lrs_.size(), "base_lrs");
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = eta_min_ + (base_lrs_[i] - eta_min_) * (1 + std::cos(epoch * detail::kPi / t_max)) / 2;
  } else if ((last_epoch_ - 1 - T_max_) % (2 * T_max_) == 0) {  // zero in Python's modulo iff zero in C++'s
    check_groups(base_lrs_.size(), "base_lrs");
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = out[i] + (base_lrs_[i] - eta_min_) * (1 - std::cos(detail::kPi / t_max)) / 2;
  } else {
    for (double& lr : out)
      lr = (1 + std::cos(detail::kPi * epoch / t_max)) / (1 + std::cos(detail::kPi * (epoch - 1) / t_max)) *
               (lr - eta_min_) +
           eta_min_;
  }
  return out;
}

PERF_INLINE std::optional<std::vector<double>> CosineAnnealingLR::closed_form_lr() const {
  std::vector<double> out;
  for (double base : base_lrs_)
    out.push_back(eta_min_ +
                  (base - eta_min_) *
                      (1 + std::cos(detail::kPi * static_cast<double>(last_epoch_) / static_cast<double>(T_max_))) / 2);
  return out;
}

PERF_INLINE void CosineAnnealingLR::write_state(c10::impl::GenericDict& state) const {
  state.insert("T_max", T_max_);
  state.insert("eta_min", eta_min_);
}

PERF_INLINE std::function<void()> CosineAnnealingLR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  const int64_t T_max = detail::state_int(state, "T_max", w);
  TORCH_CHECK(T_max > 0, w, ": T_max is ", T_max, "; it must be positive");
  const double eta_min = perf::optim::detail::python_number(state, "eta_min", w, "");
  return [this, T_max, eta_min] {
    T_max_ = T_max;
    eta_min_ = eta_min;
  };
}

PERF_INLINE CosineAnnealingWarmRestarts::CosineAnnealingWarmRestarts(torch::optim::Optimizer& optimizer, int64_t T_0,
                                                                     int64_t T_mult, double eta_min)
    : LRScheduler(optimizer), T_0_(T_0), T_i_(T_0), T_mult_(T_mult), eta_min_(eta_min), T_cur_(-1) {
  TORCH_CHECK(T_0 > 0, who(""), ": T_0 is ", T_0, "; Python's error: \"Expected positive integer T_0\"");
  TORCH_CHECK(T_mult >= 1, who(""), ": T_mult is ", T_mult, "; Python's error: \"Expected integer T_mult >= 1\"");
  start();
}

PERF_INLINE std::vector<double> CosineAnnealingWarmRestarts::get_lr() {
  check_groups(base_lrs_.size(), "base_lrs");
  std::vector<double> out;
  for (double base : base_lrs_)
    out.push_back(eta_min_ + (base - eta_min_) * (1 + std::cos(detail::kPi * T_cur_ / static_cast<double>(T_i_))) / 2);
  return out;
}

PERF_INLINE void CosineAnnealingWarmRestarts::set_lrs_from_t_cur() {
  set_lrs(get_lr());
  last_lr_ = group_lrs();
}

PERF_INLINE void CosineAnnealingWarmRestarts::step() {
  if (last_epoch_ < 0) {  // Python: the first step is step(0)
    T_i_ = T_0_;
    T_cur_ = 0;
    last_epoch_ = 0;
  } else {
    last_epoch_ = last_epoch_ + 1;
    T_cur_ = T_cur_ + 1;
    if (T_cur_ >= static_cast<double>(T_i_)) {
      T_cur_ = std::fmod(T_cur_, static_cast<double>(T_i_));
      T_i_ = T_i_ * T_mult_;
    }
  }
  set_lrs_from_t_cur();
}

PERF_INLINE void CosineAnnealingWarmRestarts::step(double epoch) {
  TORCH_CHECK(epoch >= 0, who("step"), ": epoch is ", epoch, "; Python's error: \"Expected non-negative epoch\"");
  const double t0 = static_cast<double>(T_0_);
  if (epoch >= t0) {
    if (T_mult_ == 1) {
      T_cur_ = std::fmod(epoch, t0);  // Python's % of non-negative numbers
    } else {
      const double mult = static_cast<double>(T_mult_);
      const auto n = static_cast<int64_t>(std::log(epoch / t0 * (mult - 1) + 1) / std::log(mult));
      int64_t mult_n = 1;
      for (int64_t i = 0; i < n; ++i) mult_n *= T_mult_;
      T_cur_ = epoch - t0 * static_cast<double>(mult_n - 1) / static_cast<double>(T_mult_ - 1);
      T_i_ = T_0_ * mult_n;
    }
  } else {
    T_i_ = T_0_;
    T_cur_ = epoch;
  }
  fractional_ =
      !perf::detail::same_value(epoch, std::floor(epoch)) || (epoch >= t0 && T_mult_ != 1);  // Python's T_cur a float
  last_epoch_ = static_cast<int64_t>(std::floor(epoch));
  set_lrs_from_t_cur();
}

PERF_INLINE void CosineAnnealingWarmRestarts::write_state(c10::impl::GenericDict& state) const {
  state.insert("T_0", T_0_);
  state.insert("T_i", T_i_);
  state.insert("T_mult", T_mult_);
  state.insert("eta_min", eta_min_);
  state.insert("T_cur", fractional_ ? c10::IValue(T_cur_) : c10::IValue(static_cast<int64_t>(T_cur_)));
}

PERF_INLINE std::function<void()> CosineAnnealingWarmRestarts::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  const int64_t T_0 = detail::state_int(state, "T_0", w);
  const int64_t T_mult = detail::state_int(state, "T_mult", w);
  const double T_i = perf::optim::detail::python_number(state, "T_i", w, "");  // a float after step(epoch)
  TORCH_CHECK(T_0 > 0 && T_mult >= 1 && T_i > 0, w, ": T_0 ", T_0, ", T_mult ", T_mult, ", T_i ", T_i,
              "; T_0 and T_i must be positive and T_mult at least 1");
  const double eta_min = perf::optim::detail::python_number(state, "eta_min", w, "");
  const double T_cur = perf::optim::detail::python_number(state, "T_cur", w, "");
  const bool fractional = !state.at("T_cur").isInt();
  return [this, T_0, T_mult, T_i, eta_min, T_cur, fractional] {
    T_0_ = T_0;
    T_mult_ = T_mult;
    T_i_ = static_cast<int64_t>(T_i);
    eta_min_ = eta_min;
    T_cur_ = T_cur;
    fractional_ = fractional;
  };
}

// ---- CyclicLR ------------------------------------------------------------------------------------------------

PERF_INLINE CyclicLR::CyclicLR(torch::optim::Optimizer& optimizer, const CyclicLROptions& options)
    : LRScheduler(optimizer) {
  const std::string w = who("");
  // Everything checked before the optimizer changes (Python sets the rates first).
  const auto base_lrs = detail::per_group(options.base_lr(), optimizer, w, "base_lr");
  max_lrs_ = detail::per_group(options.max_lr(), optimizer, w, "max_lr");
  TORCH_CHECK(options.step_size_up() > 0 && options.step_size_down().value_or(1) > 0, w,
              ": step_size_up and step_size_down must be positive numbers of steps");
  const double up = static_cast<double>(options.step_size_up());
  const double down = options.step_size_down() ? static_cast<double>(*options.step_size_down()) : up;
  total_size_ = up + down;
  step_ratio_ = up / total_size_;
  mode_ = options.mode();
  gamma_ = options.gamma();
  scale_fn_ = options.scale_fn();
  scale_mode_ = options.scale_mode();
  TORCH_CHECK(scale_fn_ || mode_ == "triangular" || mode_ == "triangular2" || mode_ == "exp_range", w, ": mode is \"",
              mode_, "\"; valid: \"triangular\", \"triangular2\", \"exp_range\" (or a scale_fn)");
  TORCH_CHECK(scale_mode_ == "cycle" || scale_mode_ == "iterations", w, ": scale_mode is \"", scale_mode_,
              "\"; valid: \"cycle\", \"iterations\"");
  if (!scale_fn_) scale_mode_ = mode_ == "exp_range" ? "iterations" : "cycle";  // Python's _init_scale_fn
  cycle_momentum_ = options.cycle_momentum();
  if (cycle_momentum_) {
    use_beta1_ = detail::check_momentum(optimizer, w) == detail::MomentumKind::beta1;
    base_momentums_ = detail::per_group(options.base_momentum(), optimizer, w, "base_momentum");
    max_momentums_ = detail::per_group(options.max_momentum(), optimizer, w, "max_momentum");
  }
  set_lrs(base_lrs);
  if (cycle_momentum_) {
    for (std::size_t i = 0; i < max_momentums_.size(); ++i)
      detail::set_momentum(optimizer.param_groups()[i].options(), max_momentums_[i]);
    set_group_values("max_momentum", max_momentums_);
    set_group_values("base_momentum", base_momentums_);
  }
  start();
  base_lrs_ = base_lrs;
}

PERF_INLINE double CyclicLR::scale(double x) const {
  if (scale_fn_) return scale_fn_(x);
  if (mode_ == "triangular") return 1.0;
  if (mode_ == "triangular2") return 1 / std::pow(2.0, x - 1);
  return std::pow(gamma_, x);  // exp_range
}

PERF_INLINE std::vector<double> CyclicLR::get_lr() {
  const double epoch = static_cast<double>(last_epoch_);
  const double cycle = std::floor(1 + epoch / total_size_);
  const double x = 1.0 + epoch / total_size_ - cycle;
  const double scale_factor = x <= step_ratio_ ? x / step_ratio_ : (x - 1) / (step_ratio_ - 1);
  const double s = scale(scale_mode_ == "cycle" ? cycle : epoch);
  check_groups(base_lrs_.size(), "base_lrs");
  check_groups(max_lrs_.size(), "max_lrs");
  std::vector<double> lrs;
  for (std::size_t i = 0; i < base_lrs_.size(); ++i)
    lrs.push_back(base_lrs_[i] + (max_lrs_[i] - base_lrs_[i]) * scale_factor * s);
  if (cycle_momentum_) {
    check_groups(max_momentums_.size(), "momentums");
    for (std::size_t i = 0; i < max_momentums_.size(); ++i)
      detail::set_momentum(optimizer_.param_groups()[i].options(),
                           max_momentums_[i] - (max_momentums_[i] - base_momentums_[i]) * scale_factor * s);
  }
  return lrs;
}

PERF_INLINE void CyclicLR::write_state(c10::impl::GenericDict& state) const {
  state.insert("max_lrs", detail::numbers_value(max_lrs_));
  state.insert("total_size", total_size_);
  state.insert("step_ratio", step_ratio_);
  state.insert("mode", mode_);
  state.insert("gamma", gamma_);
  state.insert("scale_mode", scale_mode_);
  state.insert("cycle_momentum", cycle_momentum_);
  if (cycle_momentum_) {
    state.insert("use_beta1", use_beta1_);
    state.insert("base_momentums", detail::numbers_value(base_momentums_));
    state.insert("max_momentums", detail::numbers_value(max_momentums_));
  }
  state.insert("_scale_fn_custom", c10::IValue());
}

PERF_INLINE std::function<void()> CyclicLR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  auto max_lrs = detail::state_numbers(state, "max_lrs", w);
  const double total_size = perf::optim::detail::python_number(state, "total_size", w, "");
  const double step_ratio = perf::optim::detail::python_number(state, "step_ratio", w, "");
  const std::string mode = detail::state_string(state, "mode", w);
  TORCH_CHECK(scale_fn_ || mode == "triangular" || mode == "triangular2" || mode == "exp_range", w, ": mode is \"",
              mode, "\"; valid: \"triangular\", \"triangular2\", \"exp_range\"");
  const double gamma = perf::optim::detail::python_number(state, "gamma", w, "");
  std::string scale_mode = detail::state_string(state, "scale_mode", w);
  if (!scale_fn_) scale_mode = mode == "exp_range" ? "iterations" : "cycle";
  const bool cycle_momentum = perf::optim::detail::python_bool(state, "cycle_momentum", std::nullopt, w, "");
  TORCH_CHECK(!cycle_momentum || detail::momentum_kind(optimizer_.defaults()), w,
              ": the state cycles momentum and this optimizer has neither momentum nor betas");
  std::vector<double> base_m, max_m;
  bool use_beta1 = false;
  if (cycle_momentum) {
    base_m = detail::state_numbers(state, "base_momentums", w);
    max_m = detail::state_numbers(state, "max_momentums", w);
    use_beta1 = perf::optim::detail::python_bool(state, "use_beta1", std::nullopt, w, "");
  }
  const std::size_t groups = optimizer_.param_groups().size();
  TORCH_CHECK(max_lrs.size() == groups && (!cycle_momentum || (base_m.size() == groups && max_m.size() == groups)), w,
              ": the state's per-group lists do not have ", groups, " entries (one per param group)");
  TORCH_CHECK(total_size > 0 && step_ratio > 0 && step_ratio <= 1, w, ": total_size ", total_size, ", step_ratio ",
              step_ratio, " are not a cycle's");
  return [this, max_lrs = std::move(max_lrs), total_size, step_ratio, mode, gamma, scale_mode, cycle_momentum,
          use_beta1, base_m = std::move(base_m), max_m = std::move(max_m)] {
    max_lrs_ = max_lrs;
    total_size_ = total_size;
    step_ratio_ = step_ratio;
    mode_ = mode;
    gamma_ = gamma;
    scale_mode_ = scale_mode;
    cycle_momentum_ = cycle_momentum;
    use_beta1_ = use_beta1;
    base_momentums_ = base_m;
    max_momentums_ = max_m;
  };
}

// ---- OneCycleLR ----------------------------------------------------------------------------------------------

PERF_INLINE OneCycleLR::OneCycleLR(torch::optim::Optimizer& optimizer, const OneCycleLROptions& options)
    : LRScheduler(optimizer) {
  const std::string w = who("");
  if (options.total_steps()) {  // Python's order: total_steps first, then epochs and steps_per_epoch
    total_steps_ = *options.total_steps();
    TORCH_CHECK(total_steps_ > 0, w, ": total_steps is ", total_steps_,
                "; Python's error: \"Expected positive integer total_steps, but got ", total_steps_, "\"");
  } else {
    TORCH_CHECK(options.epochs() && options.steps_per_epoch(), w,
                ": Python's error: \"You must define either total_steps OR (epochs AND steps_per_epoch)\"");
    const int64_t epochs = *options.epochs(), per_epoch = *options.steps_per_epoch();
    TORCH_CHECK(epochs > 0, w, ": epochs is ", epochs, "; Python's error: \"Expected positive integer epochs, but got ",
                epochs, "\"");
    TORCH_CHECK(per_epoch > 0, w, ": steps_per_epoch is ", per_epoch,
                "; Python's error: \"Expected positive integer steps_per_epoch, but got ", per_epoch, "\"");
    total_steps_ = epochs * per_epoch;
  }
  const double pct = options.pct_start();
  TORCH_CHECK(pct >= 0 && pct <= 1, w, ": pct_start is ", pct,
              "; Python's error: \"Expected float between 0 and 1 "
              "pct_start\"");
  anneal_strategy_ = options.anneal_strategy();
  TORCH_CHECK(anneal_strategy_ == "cos" || anneal_strategy_ == "linear", w, ": anneal_strategy is \"", anneal_strategy_,
              "\"; valid: \"cos\", \"linear\"");
  const double total = static_cast<double>(total_steps_);
  if (options.three_phase()) {
    phases_ = {{pct * total - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
               {2 * pct * total - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"},
               {total - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"}};
  } else {
    phases_ = {{pct * total - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
               {total - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"}};
  }
  max_lrs_ = detail::per_group(options.max_lr(), optimizer, w, "max_lr");
  for (double m : max_lrs_) {
    initial_lrs_.push_back(m / options.div_factor());
    min_lrs_.push_back(initial_lrs_.back() / options.final_div_factor());
  }
  cycle_momentum_ = options.cycle_momentum();
  if (cycle_momentum_) {
    use_beta1_ = detail::check_momentum(optimizer, w) == detail::MomentumKind::beta1;
    max_momentums_ = detail::per_group(options.max_momentum(), optimizer, w, "max_momentum");
    base_momentums_ = detail::per_group(options.base_momentum(), optimizer, w, "base_momentum");
    for (std::size_t i = 0; i < max_momentums_.size(); ++i)
      detail::set_momentum(optimizer.param_groups()[i].options(), max_momentums_[i]);
  }
  set_group_values("initial_lr", initial_lrs_);
  set_group_values("max_lr", max_lrs_);
  set_group_values("min_lr", min_lrs_);
  if (cycle_momentum_) {
    set_group_values("max_momentum", max_momentums_);
    set_group_values("base_momentum", base_momentums_);
  }
  start();
}

PERF_INLINE double OneCycleLR::group_value(const std::string& key, std::size_t group) const {
  if (key == "initial_lr") return initial_lrs_.at(group);
  if (key == "max_lr") return max_lrs_.at(group);
  if (key == "min_lr") return min_lrs_.at(group);
  if (key == "max_momentum") return max_momentums_.at(group);
  if (key == "base_momentum") return base_momentums_.at(group);
  TORCH_CHECK(false, who("step"), ": a phase names \"", key,
              "\"; valid: initial_lr, max_lr, min_lr, max_momentum, base_momentum");
  return 0;
}

PERF_INLINE double OneCycleLR::anneal(double start, double end, double pct) const {
  if (anneal_strategy_ == "cos") {
    const double cos_out = std::cos(detail::kPi * pct) + 1;
    return end + (start - end) / 2.0 * cos_out;
  }
  return (end - start) * pct + start;
}

PERF_INLINE std::vector<double> OneCycleLR::get_lr() {
  const int64_t step_num = last_epoch_;
  TORCH_CHECK(step_num <= total_steps_, who("step"), ": Tried to step ", step_num,
              " times. The specified number of total steps is ", total_steps_,
              " (Python's error; make it with total_steps = epochs * steps_per_epoch of the whole run)");
  check_groups(initial_lrs_.size(), "max_lrs");
  std::vector<double> lrs;
  for (std::size_t g = 0; g < initial_lrs_.size(); ++g) {
    double start_step = 0.0;
    for (std::size_t i = 0; i < phases_.size(); ++i) {
      const Phase& phase = phases_[i];
      if (static_cast<double>(step_num) <= phase.end_step || i + 1 == phases_.size()) {
        const double pct = (static_cast<double>(step_num) - start_step) / (phase.end_step - start_step);
        lrs.push_back(anneal(group_value(phase.start_lr, g), group_value(phase.end_lr, g), pct));
        if (cycle_momentum_)
          detail::set_momentum(optimizer_.param_groups()[g].options(),
                               anneal(group_value(phase.start_momentum, g), group_value(phase.end_momentum, g), pct));
        break;
      }
      start_step = phase.end_step;
    }
  }
  return lrs;
}

PERF_INLINE void OneCycleLR::write_state(c10::impl::GenericDict& state) const {
  state.insert("total_steps", total_steps_);
  c10::impl::GenericList phases(c10::AnyType::get());
  for (std::size_t i = 0; i < phases_.size(); ++i) {
    auto p = perf::optim::detail::python_dict();
    // Python's last end_step is the int total_steps - 1, the others floats.
    p.insert("end_step", i + 1 == phases_.size() ? c10::IValue(static_cast<int64_t>(phases_[i].end_step))
                                                 : c10::IValue(phases_[i].end_step));
    p.insert("start_lr", phases_[i].start_lr);
    p.insert("end_lr", phases_[i].end_lr);
    p.insert("start_momentum", phases_[i].start_momentum);
    p.insert("end_momentum", phases_[i].end_momentum);
    phases.push_back(p);
  }
  state.insert("_schedule_phases", phases);
  state.insert("_anneal_func_type", anneal_strategy_);
  state.insert("cycle_momentum", cycle_momentum_);
  if (cycle_momentum_) state.insert("use_beta1", use_beta1_);
}

PERF_INLINE std::function<void()> OneCycleLR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  const int64_t total_steps = detail::state_int(state, "total_steps", w);
  TORCH_CHECK(total_steps > 0, w, ": total_steps is ", total_steps, "; it must be positive");
  TORCH_CHECK(state.contains("_schedule_phases") && state.at("_schedule_phases").isList(), w,
              ": the state has no \"_schedule_phases\" list");
  std::vector<Phase> phases;
  for (const c10::IValue& p : state.at("_schedule_phases").toListRef()) {
    TORCH_CHECK(p.isGenericDict(), w, ": a phase of \"_schedule_phases\" is not a dict");
    const auto d = p.toGenericDict();
    Phase phase{perf::optim::detail::python_number(d, "end_step", w, " in a phase"),
                detail::state_string(d, "start_lr", w), detail::state_string(d, "end_lr", w),
                detail::state_string(d, "start_momentum", w), detail::state_string(d, "end_momentum", w)};
    for (const std::string* key : {&phase.start_lr, &phase.end_lr})
      TORCH_CHECK(*key == "initial_lr" || *key == "max_lr" || *key == "min_lr", w, ": a phase's rate is \"", *key,
                  "\"; valid: initial_lr, max_lr, min_lr");
    for (const std::string* key : {&phase.start_momentum, &phase.end_momentum})
      TORCH_CHECK(*key == "max_momentum" || *key == "base_momentum", w, ": a phase's momentum is \"", *key,
                  "\"; valid: max_momentum, base_momentum");
    phases.push_back(std::move(phase));
  }
  TORCH_CHECK(!phases.empty(), w, ": \"_schedule_phases\" is empty");
  const std::string anneal = detail::state_string(state, "_anneal_func_type", w);
  TORCH_CHECK(anneal == "cos" || anneal == "linear", w, ": \"_anneal_func_type\" is \"", anneal,
              "\"; valid: \"cos\", \"linear\"");
  const bool cycle_momentum = perf::optim::detail::python_bool(state, "cycle_momentum", std::nullopt, w, "");
  TORCH_CHECK(cycle_momentum == cycle_momentum_, w, ": the state ", cycle_momentum ? "cycles" : "does not cycle",
              " momentum and this scheduler was made with cycle_momentum(", cycle_momentum_ ? "true" : "false",
              "), which decides the momenta it keeps; make it as the state's was");
  return [this, total_steps, phases = std::move(phases), anneal] {
    total_steps_ = total_steps;
    phases_ = phases;
    anneal_strategy_ = anneal;
  };
}

// ---- ReduceLROnPlateau ---------------------------------------------------------------------------------------

namespace detail {
PERF_INLINE void check_plateau_modes(const std::string& mode, const std::string& threshold_mode,
                                     const std::string& who) {
  TORCH_CHECK(mode == "min" || mode == "max", who, ": mode is \"", mode, "\"; valid: \"min\", \"max\"");
  TORCH_CHECK(threshold_mode == "rel" || threshold_mode == "abs", who, ": threshold_mode is \"", threshold_mode,
              "\"; valid: \"rel\", \"abs\"");
}
PERF_INLINE double mode_worse(const std::string& mode) {
  return mode == "min" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
}
}  // namespace detail

PERF_INLINE ReduceLROnPlateau::ReduceLROnPlateau(torch::optim::Optimizer& optimizer,
                                                 const ReduceLROnPlateauOptions& options)
    : LRScheduler(optimizer),
      factor_(options.factor()),
      patience_(options.patience()),
      cooldown_(options.cooldown()),
      eps_(options.eps()),
      mode_(options.mode()),
      threshold_mode_(options.threshold_mode()),
      threshold_(options.threshold()),
      best_(detail::mode_worse(options.mode())) {
  const std::string w = who("");
  TORCH_CHECK(factor_ < 1.0, w, ": factor is ", factor_, "; Python's error: \"Factor should be < 1.0.\"");
  detail::check_plateau_modes(mode_, threshold_mode_, w);
  const std::size_t groups = optimizer.param_groups().size();
  if (options.min_lr().one_for_all) {
    default_min_lr_ = options.min_lr().values.at(0);
    min_lrs_.assign(groups, *default_min_lr_);
  } else {
    TORCH_CHECK(options.min_lr().values.size() == groups, w, ": expected ", groups, " min_lrs, got ",
                options.min_lr().values.size(), " (one per param group, or one number)");
    min_lrs_ = options.min_lr().values;
  }
  last_epoch_ = 0;  // Python's: no initial step, no initial_lr
  last_lr_ = group_lrs();
}

PERF_INLINE void ReduceLROnPlateau::step() {
  TORCH_CHECK(false, who("step"), ": takes the metric, step(metric) (Python's step(metrics))");
}

PERF_INLINE bool ReduceLROnPlateau::is_better(double a) const {
  if (mode_ == "min" && threshold_mode_ == "rel") return a < best_ * (1.0 - threshold_);
  if (mode_ == "min") return a < best_ - threshold_;
  if (threshold_mode_ == "rel") return a > best_ * (threshold_ + 1.0);
  return a > best_ + threshold_;
}

PERF_INLINE void ReduceLROnPlateau::step(double metric) {
  auto& groups = optimizer_.param_groups();
  TORCH_CHECK(groups.size() == min_lrs_.size() || default_min_lr_, who("step"), ": the optimizer has ", groups.size(),
              " param groups and min_lr was given for ", min_lrs_.size(),
              " (a group added after the scheduler was made; Python's error too): give min_lr as one number, "
              "or make the scheduler after add_param_group");
  last_epoch_ = last_epoch_ + 1;
  if (is_better(metric)) {
    best_ = metric;
    num_bad_epochs_ = 0;
  } else {
    ++num_bad_epochs_;
  }
  if (cooldown_counter_ > 0) {
    --cooldown_counter_;
    num_bad_epochs_ = 0;
  }
  if (num_bad_epochs_ > patience_) {
    if (groups.size() != min_lrs_.size()) min_lrs_.assign(groups.size(), *default_min_lr_);
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const double old_lr = groups[i].options().get_lr();
      const double new_lr = std::max(old_lr * factor_, min_lrs_[i]);
      if (old_lr - new_lr > eps_) groups[i].options().set_lr(new_lr);
    }
    cooldown_counter_ = cooldown_;
    num_bad_epochs_ = 0;
  }
  last_lr_ = group_lrs();
}

PERF_INLINE c10::impl::GenericDict ReduceLROnPlateau::state_dict() const {
  auto d = perf::optim::detail::python_dict();
  d.insert("factor", factor_);
  d.insert("default_min_lr", default_min_lr_ ? c10::IValue(*default_min_lr_) : c10::IValue());
  d.insert("min_lrs", detail::numbers_value(min_lrs_));
  d.insert("patience", patience_);
  d.insert("cooldown", cooldown_);
  d.insert("eps", eps_);
  d.insert("last_epoch", last_epoch_);
  d.insert("_last_lr", detail::numbers_value(last_lr_));
  d.insert("mode_worse", detail::mode_worse(mode_));
  d.insert("mode", mode_);
  d.insert("threshold", threshold_);
  d.insert("threshold_mode", threshold_mode_);
  d.insert("best", best_);
  d.insert("cooldown_counter", cooldown_counter_);
  d.insert("num_bad_epochs", num_bad_epochs_);
  return d;
}

PERF_INLINE std::function<void()> ReduceLROnPlateau::prepare_load(const c10::IValue& state) {
  const std::string w = who("load_state_dict");
  TORCH_CHECK(state.isGenericDict(), w, ": the state is a ", state.tagKind(), ", not a dict");
  const auto d = state.toGenericDict();
  const double factor = perf::optim::detail::python_number(d, "factor", w, "");
  TORCH_CHECK(d.contains("default_min_lr"), w, ": the state has no \"default_min_lr\"");
  std::optional<double> default_min_lr;
  if (!d.at("default_min_lr").isNone()) default_min_lr = perf::optim::detail::python_number(d, "default_min_lr", w, "");
  auto min_lrs = detail::state_numbers(d, "min_lrs", w);
  const int64_t patience = detail::state_int(d, "patience", w);
  const int64_t cooldown = detail::state_int(d, "cooldown", w);
  const double eps = perf::optim::detail::python_number(d, "eps", w, "");
  const int64_t last_epoch = detail::state_int(d, "last_epoch", w);
  auto last_lr = detail::state_numbers(d, "_last_lr", w);
  const std::string mode = detail::state_string(d, "mode", w);
  const std::string threshold_mode = detail::state_string(d, "threshold_mode", w);
  detail::check_plateau_modes(mode, threshold_mode, w);
  const double threshold = perf::optim::detail::python_number(d, "threshold", w, "");
  const double best = perf::optim::detail::python_number(d, "best", w, "");
  const int64_t cooldown_counter = detail::state_int(d, "cooldown_counter", w);
  const int64_t num_bad_epochs = detail::state_int(d, "num_bad_epochs", w);
  return [this, factor, default_min_lr, min_lrs = std::move(min_lrs), patience, cooldown, eps, last_epoch,
          last_lr = std::move(last_lr), mode, threshold_mode, threshold, best, cooldown_counter, num_bad_epochs] {
    factor_ = factor;
    default_min_lr_ = default_min_lr;
    min_lrs_ = min_lrs;
    patience_ = patience;
    cooldown_ = cooldown;
    eps_ = eps;
    last_epoch_ = last_epoch;
    last_lr_ = last_lr;
    mode_ = mode;
    threshold_mode_ = threshold_mode;
    threshold_ = threshold;
    best_ = best;
    cooldown_counter_ = cooldown_counter;
    num_bad_epochs_ = num_bad_epochs;
  };
}

// ---- SequentialLR, ChainedScheduler --------------------------------------------------------------------------

namespace detail {
PERF_INLINE void check_children(const std::vector<std::shared_ptr<LRScheduler>>& schedulers,
                                const torch::optim::Optimizer& optimizer, const std::string& who) {
  TORCH_CHECK(!schedulers.empty(), who, ": expects at least one scheduler, but got no scheduler");
  for (std::size_t i = 0; i < schedulers.size(); ++i) {
    TORCH_CHECK(schedulers[i], who, ": scheduler ", i, " is null");
    TORCH_CHECK(!dynamic_cast<const ReduceLROnPlateau*>(schedulers[i].get()), who,
                ": does not support ReduceLROnPlateau (scheduler ", i,
                "), which steps on a metric (Python's refuses it too); step it on its own");
    TORCH_CHECK(&schedulers[i]->optimizer() == &optimizer, who,
                ": expects all schedulers to belong to the same optimizer, but scheduler ", i, " (",
                schedulers[i]->name(), ") was made on another");
  }
}
// ChainedScheduler's optimizer: its first scheduler's (Python: optimizer or schedulers[0].optimizer).
PERF_INLINE torch::optim::Optimizer& first_optimizer(const std::vector<std::shared_ptr<LRScheduler>>& schedulers) {
  TORCH_CHECK(!schedulers.empty() && schedulers[0],
              "perf::optim::ChainedScheduler: expects at least one scheduler "
              "to be chained, but got ",
              schedulers.empty() ? "no scheduler" : "a null one first");
  return schedulers[0]->optimizer();
}
// The children's part of a composite's state: each child's prepared load, in order.
PERF_INLINE std::vector<std::function<void()>> prepare_children(
    const c10::impl::GenericDict& d, const std::vector<std::shared_ptr<LRScheduler>>& s, const std::string& who,
    const std::function<std::function<void()>(LRScheduler&, const c10::IValue&)>& prepare) {
  TORCH_CHECK(d.contains("_schedulers") && d.at("_schedulers").isList(), who,
              ": the state has no \"_schedulers\" list");
  const auto list = d.at("_schedulers").toListRef();
  TORCH_CHECK(list.size() == s.size(), who, ": the state has ", list.size(), " schedulers and this one ", s.size());
  std::vector<std::function<void()>> out;
  for (std::size_t i = 0; i < s.size(); ++i) out.push_back(prepare(*s[i], list[i]));
  return out;
}
}  // namespace detail

PERF_INLINE SequentialLR::SequentialLR(torch::optim::Optimizer& optimizer,
                                       std::vector<std::shared_ptr<LRScheduler>> schedulers,
                                       std::vector<int64_t> milestones)
    : LRScheduler(optimizer), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  const std::string w = who("");
  detail::check_children(schedulers_, optimizer, w);
  TORCH_CHECK(milestones_.size() + 1 == schedulers_.size(), w,
              ": Sequential Schedulers expects number of schedulers provided to be one more than the number of "
              "milestone points, but got number of schedulers ",
              schedulers_.size(), " and the number of milestones to be equal to ", milestones_.size());
  TORCH_CHECK(std::is_sorted(milestones_.begin(), milestones_.end()), w,
              ": milestones must be in increasing order (Python's bisect assumes it)");
  std::vector<double> initial;
  {
    std::lock_guard<std::mutex> lock(detail::scheduler_group_values_mutex());
    auto& registry = detail::scheduler_group_values();
    const auto it = registry.find(&optimizer);
    if (it != registry.end() && it->second.find("initial_lr")) initial = *it->second.find("initial_lr");
  }
  TORCH_CHECK(initial.size() >= optimizer.param_groups().size(), w,
              ": a param group has no initial rate (added after the schedulers were made); make them after it");
  last_epoch_ = 0;
  initial.resize(optimizer.param_groups().size());
  set_lrs(initial);
  for (auto& s : schedulers_) s->undo_epoch();
  schedulers_[0]->initial_step();
  last_lr_ = schedulers_[0]->get_last_lr();
}

PERF_INLINE void SequentialLR::step() {
  ++last_epoch_;
  const auto idx = static_cast<std::size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) -
                                            milestones_.begin());
  LRScheduler& scheduler = *schedulers_[idx];
  if (idx > 0 && milestones_[idx - 1] == last_epoch_) {
    scheduler.update_lr(0);
  } else {
    scheduler.step();
  }
  last_lr_ = scheduler.get_last_lr();
}

PERF_INLINE void SequentialLR::undo_epoch() {
  for (auto& s : schedulers_) s->undo_epoch();
}

PERF_INLINE c10::impl::GenericDict SequentialLR::state_dict() const {
  auto d = perf::optim::detail::python_dict();
  d.insert("_milestones", c10::List<int64_t>(milestones_));
  d.insert("last_epoch", last_epoch_);
  d.insert("_last_lr", detail::numbers_value(last_lr_));
  c10::impl::GenericList children(c10::AnyType::get());
  for (const auto& s : schedulers_) children.push_back(s->state_dict());
  d.insert("_schedulers", children);
  return d;
}

PERF_INLINE std::function<void()> SequentialLR::prepare_load(const c10::IValue& state) {
  const std::string w = who("load_state_dict");
  TORCH_CHECK(state.isGenericDict(), w, ": the state is a ", state.tagKind(), ", not a dict");
  const auto d = state.toGenericDict();
  TORCH_CHECK(d.contains("_milestones") && d.at("_milestones").isList(), w, ": the state has no \"_milestones\"");
  std::vector<int64_t> milestones;
  for (const c10::IValue& m : d.at("_milestones").toListRef()) {
    TORCH_CHECK(m.isInt(), w, ": \"_milestones\" holds a ", m.tagKind(), ", not an epoch");
    milestones.push_back(m.toInt());
  }
  TORCH_CHECK(milestones.size() + 1 == schedulers_.size() && std::is_sorted(milestones.begin(), milestones.end()), w,
              ": the state's ", milestones.size(), " milestones do not fit ", schedulers_.size(),
              " schedulers in increasing order");
  const int64_t last_epoch = detail::state_int(d, "last_epoch", w);
  auto last_lr = detail::state_numbers(d, "_last_lr", w);
  auto children = detail::prepare_children(d, schedulers_, w,
                                           [](LRScheduler& s, const c10::IValue& v) { return s.prepare_load(v); });
  return [this, milestones = std::move(milestones), last_epoch, last_lr = std::move(last_lr),
          children = std::move(children)] {
    for (const auto& apply : children) apply();
    milestones_ = milestones;
    last_epoch_ = last_epoch;
    last_lr_ = last_lr;
  };
}

PERF_INLINE ChainedScheduler::ChainedScheduler(std::vector<std::shared_ptr<LRScheduler>> schedulers)
    : LRScheduler(detail::first_optimizer(schedulers)), schedulers_(std::move(schedulers)) {
  detail::check_children(schedulers_, optimizer_, who(""));
  last_lr_ = group_lrs();
}

PERF_INLINE void ChainedScheduler::step() {
  for (auto& s : schedulers_) s->step();
  last_lr_ = group_lrs();
}

PERF_INLINE void ChainedScheduler::undo_epoch() {
  for (auto& s : schedulers_) s->undo_epoch();
}

PERF_INLINE c10::impl::GenericDict ChainedScheduler::state_dict() const {
  auto d = perf::optim::detail::python_dict();
  d.insert("_last_lr", detail::numbers_value(last_lr_));
  c10::impl::GenericList children(c10::AnyType::get());
  for (const auto& s : schedulers_) children.push_back(s->state_dict());
  d.insert("_schedulers", children);
  return d;
}

PERF_INLINE std::function<void()> ChainedScheduler::prepare_load(const c10::IValue& state) {
  const std::string w = who("load_state_dict");
  TORCH_CHECK(state.isGenericDict(), w, ": the state is a ", state.tagKind(), ", not a dict");
  const auto d = state.toGenericDict();
  auto last_lr = detail::state_numbers(d, "_last_lr", w);
  auto children = detail::prepare_children(d, schedulers_, w,
                                           [](LRScheduler& s, const c10::IValue& v) { return s.prepare_load(v); });
  return [this, last_lr = std::move(last_lr), children = std::move(children)] {
    for (const auto& apply : children) apply();
    last_lr_ = last_lr;
  };
}

}  // namespace perf::optim
