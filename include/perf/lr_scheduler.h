// perf/lr_scheduler.h — Python's learning-rate schedulers (torch.optim.lr_scheduler) for any torch::optim optimizer.
//
//   perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));
//   // warm-up for 500 steps, then cosine decay: Python's SequentialLR([LinearLR, CosineAnnealingLR])
//   auto warmup = std::make_shared<perf::optim::LinearLR>(opt, /*start_factor=*/0.01, /*end_factor=*/1.0, 500);
//   auto decay = std::make_shared<perf::optim::CosineAnnealingLR>(opt, /*T_max=*/9500);
//   perf::optim::SequentialLR scheduler(opt, {warmup, decay}, /*milestones=*/{500});
//   for (...) { ...; opt.step(); scheduler.step(); }       // as in Python: after the optimizer's step
//   perf::save(scheduler.state_dict(), "sched.pt");  // Python: scheduler.load_state_dict(torch.load("sched.pt"))
//   perf::optim::ReduceLROnPlateau plateau(opt, perf::optim::ReduceLROnPlateauOptions().patience(5));
//   plateau.step(validation_loss);                    // once per epoch
//
// LibTorch has StepLR, and ReduceLROnPlateauScheduler in float, without
// get_last_lr() or a state to save. These are Python's: the same names, arguments, defaults and errors,
// the same learning rates step by step (Python's chainable formulas, in the
// same order of operations: equal to the last bit in the tests), and Python's
// state_dict() layout both ways. They work with every torch::optim optimizer
// through its options' get_lr()/set_lr(); OneCycleLR and CyclicLR also cycle
// momentum (SGD's and RMSprop's `momentum`, Adam's and AdamW's first beta).
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <perf/config.h>
#include <perf/optim.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace perf::optim {

/// A value per param group, as Python's schedulers take `max_lr=0.1` or
/// `max_lr=[0.1, 0.01]`: one value for every group, or one for each.
struct PerGroup {
  PerGroup(double value) : values{value}, one_for_all(true) {}               // NOLINT: implicit, as Python's float
  PerGroup(std::vector<double> per_group) : values(std::move(per_group)) {}  // NOLINT: and Python's list
  PerGroup(std::initializer_list<double> per_group) : values(per_group) {}   // NOLINT
  std::vector<double> values;
  bool one_for_all = false;  // given as one number (ReduceLROnPlateau's min_lr keeps it for groups added later)
};

/// The base of every scheduler: Python's `torch.optim.lr_scheduler.LRScheduler`.
/// A scheduler holds a reference to its optimizer, which must outlive it.
/// Made on an optimizer, the first scheduler records each group's learning rate
/// as that group's initial one (Python's `group["initial_lr"]`), and every
/// scheduler made on the optimizer while one lives starts from those, as in
/// Python: a CosineAnnealingLR made after a LinearLR warm-up (which has already
/// lowered the rate) decays from the rate the run started with. The record ends
/// with the optimizer's last scheduler.
class LRScheduler {
 public:
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;
  PERF_INLINE virtual ~LRScheduler();

  /// Python's `scheduler.step()`: the next epoch's (or step's) rates, set into
  /// the optimizer's param groups. Call it after `optimizer.step()`.
  PERF_INLINE virtual void step();
  /// Python's `get_last_lr()`: the rates the last step set, one per param group.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  /// Python's `last_epoch`: how many steps since the start (0 after construction).
  int64_t last_epoch() const { return last_epoch_; }
  /// Python's `base_lrs`: the rates the schedule is computed from.
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  torch::optim::Optimizer& optimizer() const { return optimizer_; }
  /// Python's class name: "CosineAnnealingLR".
  virtual const char* name() const = 0;

  /// Python's `scheduler.state_dict()`, with Python's keys and types: save it
  /// with `perf::save` (perf/state_dict.h), and Python's
  /// `scheduler.load_state_dict(torch.load(path))` resumes from it. The
  /// functions of LambdaLR and MultiplicativeLR are not in it (in Python
  /// neither, unless they are objects with attributes).
  PERF_INLINE virtual c10::impl::GenericDict state_dict() const;
  /// Python's `scheduler.load_state_dict(state)`: a state_dict() of the same
  /// scheduler class, from C++ or from Python (`perf::load` of its file). Like
  /// Python's, it sets the schedule's settings and position (as Python's, the
  /// optimizer's rates come from the optimizer's own state). Checked whole
  /// before anything changes.
  PERF_INLINE void load_state_dict(const c10::IValue& state);

 protected:
  explicit LRScheduler(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {}

  /// Python's `get_lr()`: the rates of epoch `last_epoch_`, from the current ones (chainable form).
  PERF_INLINE virtual std::vector<double> get_lr();
  /// Python's `_get_closed_form_lr()`, where the class has one (SequentialLR restarts a scheduler with it).
  virtual std::optional<std::vector<double>> closed_form_lr() const { return std::nullopt; }
  /// Python's `recursive_undo`, as SequentialLR applies it to the schedulers it is given.
  PERF_INLINE virtual void undo_epoch();
  /// The settings beyond the base's in Python's state_dict(), and a reader that checks them all and
  /// returns what applies them (nothing is applied before every part of a state is checked).
  virtual void write_state(c10::impl::GenericDict& state) const { (void)state; }
  PERF_INLINE virtual std::function<void()> read_state(const c10::impl::GenericDict& state);
  /// load_state_dict() without applying: checks `state` and returns what applies it.
  PERF_INLINE virtual std::function<void()> prepare_load(const c10::IValue& state);

  /// The end of Python's LRScheduler.__init__ (each class calls it last in its constructor): the
  /// optimizer's initial rates recorded where none are, base_lrs from them, and the first step.
  PERF_INLINE void start();
  /// Python's `_initial_step()`.
  PERF_INLINE void initial_step();
  /// Python's `_update_lr(epoch)`: the next epoch (none) or `epoch` (closed form where there is one).
  PERF_INLINE void update_lr(std::optional<int64_t> epoch = std::nullopt);
  /// Sets each param group's rate (as many values as groups, or an error naming both counts).
  PERF_INLINE void set_lrs(const std::vector<double>& lrs);
  PERF_INLINE std::vector<double> group_lrs() const;
  /// Python's zip(..., strict=True) over the param groups and something kept per group.
  PERF_INLINE void check_groups(std::size_t kept, const char* what) const;
  /// Python's group[key] = value for each group (OneCycleLR's "initial_lr", "max_lr", ...): written into
  /// perf::optim optimizers' state_dict(), where Python's schedulers read them after a resume.
  PERF_INLINE void set_group_values(const std::string& key, const std::vector<double>& values);
  /// "perf::optim::<name>::<what>", for errors.
  PERF_INLINE std::string who(const char* what) const;

  torch::optim::Optimizer& optimizer_;
  int64_t last_epoch_ = -1;
  int64_t step_count_ = 0;
  bool is_initial_ = false;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;

 private:
  // The optimizer's record of Python's group values (perf::optim::detail::scheduler_group_values), which
  // this scheduler is counted in once registered_; the lock is held by the caller.
  PERF_INLINE detail::SchedulerGroupValues& record();
  bool registered_ = false;
  friend class SequentialLR;
  friend class ChainedScheduler;
};

namespace detail {
/// What LambdaLR and MultiplicativeLR share: a function of the epoch per param group, which their
/// state_dict() holds as None (Python writes only a callable object's attributes there).
class LambdaScheduler : public LRScheduler {
 public:
  using Lambda = std::function<double(int64_t)>;

 protected:
  /// `name`: the class's, for errors (name() is not yet the derived class's here).
  PERF_INLINE LambdaScheduler(torch::optim::Optimizer& optimizer, std::vector<Lambda> lr_lambdas, const char* name);
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  std::vector<Lambda> lr_lambdas_;
};
}  // namespace detail

/// Python's LambdaLR: rate = base rate * lr_lambda(epoch); one function, or one per param group.
class LambdaLR final : public detail::LambdaScheduler {
 public:
  PERF_INLINE LambdaLR(torch::optim::Optimizer& optimizer, Lambda lr_lambda);
  PERF_INLINE LambdaLR(torch::optim::Optimizer& optimizer, std::vector<Lambda> lr_lambdas);
  const char* name() const override { return "LambdaLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
};

/// Python's MultiplicativeLR: rate *= lr_lambda(epoch) at each step after the first.
class MultiplicativeLR final : public detail::LambdaScheduler {
 public:
  PERF_INLINE MultiplicativeLR(torch::optim::Optimizer& optimizer, Lambda lr_lambda);
  PERF_INLINE MultiplicativeLR(torch::optim::Optimizer& optimizer, std::vector<Lambda> lr_lambdas);
  const char* name() const override { return "MultiplicativeLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
};

/// Python's StepLR: rate *= gamma every `step_size` epochs.
class StepLR final : public LRScheduler {
 public:
  PERF_INLINE StepLR(torch::optim::Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
  const char* name() const override { return "StepLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE std::optional<std::vector<double>> closed_form_lr() const override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  int64_t step_size_;
  double gamma_;
};

/// Python's MultiStepLR: rate *= gamma at each milestone (a milestone given twice: gamma squared).
class MultiStepLR final : public LRScheduler {
 public:
  PERF_INLINE MultiStepLR(torch::optim::Optimizer& optimizer, std::vector<int64_t> milestones, double gamma = 0.1);
  const char* name() const override { return "MultiStepLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE std::optional<std::vector<double>> closed_form_lr() const override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  std::vector<int64_t> milestones_;  // sorted, with repeats (Python's Counter)
  double gamma_;
};

/// Python's ConstantLR: rate * factor until epoch `total_iters`, then the base rate.
class ConstantLR final : public LRScheduler {
 public:
  PERF_INLINE explicit ConstantLR(torch::optim::Optimizer& optimizer, double factor = 1.0 / 3, int64_t total_iters = 5);
  const char* name() const override { return "ConstantLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE std::optional<std::vector<double>> closed_form_lr() const override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  double factor_;
  int64_t total_iters_;
};

/// Python's LinearLR: the factor goes linearly from start_factor to end_factor over `total_iters` epochs (warm-up).
class LinearLR final : public LRScheduler {
 public:
  PERF_INLINE explicit LinearLR(torch::optim::Optimizer& optimizer, double start_factor = 1.0 / 3,
                                double end_factor = 1.0, int64_t total_iters = 5);
  const char* name() const override { return "LinearLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE std::optional<std::vector<double>> closed_form_lr() const override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  double start_factor_;
  double end_factor_;
  int64_t total_iters_;
};

/// Python's ExponentialLR: rate *= gamma every epoch.
class ExponentialLR final : public LRScheduler {
 public:
  PERF_INLINE ExponentialLR(torch::optim::Optimizer& optimizer, double gamma);
  const char* name() const override { return "ExponentialLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE std::optional<std::vector<double>> closed_form_lr() const override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  double gamma_;
};

/// Python's PolynomialLR: rate = base * (1 - epoch / total_iters) ** power, then 0.
class PolynomialLR final : public LRScheduler {
 public:
  PERF_INLINE explicit PolynomialLR(torch::optim::Optimizer& optimizer, int64_t total_iters = 5, double power = 1.0);
  const char* name() const override { return "PolynomialLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE std::optional<std::vector<double>> closed_form_lr() const override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  int64_t total_iters_;
  double power_;
};

/// Python's CosineAnnealingLR: half a cosine from the base rate to eta_min over
/// T_max epochs (and back up over the next T_max, as Python's).
class CosineAnnealingLR final : public LRScheduler {
 public:
  PERF_INLINE CosineAnnealingLR(torch::optim::Optimizer& optimizer, int64_t T_max, double eta_min = 0.0);
  const char* name() const override { return "CosineAnnealingLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE std::optional<std::vector<double>> closed_form_lr() const override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  int64_t T_max_;
  double eta_min_;
};

/// Python's CosineAnnealingWarmRestarts (SGDR): cosine from the base rate to
/// eta_min over T_0 epochs, restarting with periods T_0 * T_mult^i.
class CosineAnnealingWarmRestarts final : public LRScheduler {
 public:
  PERF_INLINE CosineAnnealingWarmRestarts(torch::optim::Optimizer& optimizer, int64_t T_0, int64_t T_mult = 1,
                                          double eta_min = 0.0);
  const char* name() const override { return "CosineAnnealingWarmRestarts"; }
  PERF_INLINE void step() override;
  /// Python's `step(epoch)`, which this class keeps: a fractional epoch for
  /// per-batch updates, `scheduler.step(epoch + i / double(iters))`.
  PERF_INLINE void step(double epoch);

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  PERF_INLINE void set_lrs_from_t_cur();
  int64_t T_0_;
  int64_t T_i_;
  int64_t T_mult_;
  double eta_min_;
  double T_cur_;
  bool fractional_ = false;  // T_cur written as a Python float (a fractional epoch was given), else an int
};

/// Python's CyclicLR arguments. `mode`: "triangular", "triangular2" or
/// "exp_range", unless `scale_fn` is given (with `scale_mode` "cycle" or
/// "iterations").
struct CyclicLROptions {
  CyclicLROptions(PerGroup base_lr, PerGroup max_lr) : base_lr_(std::move(base_lr)), max_lr_(std::move(max_lr)) {}
  TORCH_ARG(PerGroup, base_lr);
  TORCH_ARG(PerGroup, max_lr);
  TORCH_ARG(int64_t, step_size_up) = 2000;
  TORCH_ARG(std::optional<int64_t>, step_size_down);  // unset: step_size_up
  TORCH_ARG(std::string, mode) = "triangular";
  TORCH_ARG(double, gamma) = 1.0;
  TORCH_ARG(std::function<double(double)>, scale_fn);
  TORCH_ARG(std::string, scale_mode) = "cycle";
  TORCH_ARG(bool, cycle_momentum) = true;
  TORCH_ARG(PerGroup, base_momentum) = 0.8;
  TORCH_ARG(PerGroup, max_momentum) = 0.9;
};

/// Python's CyclicLR: the rate cycles between base_lr and max_lr (and momentum
/// between max_momentum and base_momentum, inversely), changed at every step.
class CyclicLR final : public LRScheduler {
 public:
  PERF_INLINE CyclicLR(torch::optim::Optimizer& optimizer, const CyclicLROptions& options);
  const char* name() const override { return "CyclicLR"; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  PERF_INLINE double scale(double x) const;
  std::vector<double> max_lrs_;
  double total_size_;
  double step_ratio_;
  std::string mode_;
  double gamma_;
  std::function<double(double)> scale_fn_;
  std::string scale_mode_;
  bool cycle_momentum_;
  bool use_beta1_ = false;
  std::vector<double> base_momentums_;
  std::vector<double> max_momentums_;
};

/// Python's OneCycleLR arguments: `total_steps` (Python's alternative,
/// epochs and steps_per_epoch, is their product); `anneal_strategy` "cos" or "linear".
struct OneCycleLROptions {
  /// Python's OneCycleLR(optimizer, max_lr, total_steps): the steps of the cycle, or (none here) epochs and
  /// steps_per_epoch below, as Python's `epochs=10, steps_per_epoch=len(loader)`.
  explicit OneCycleLROptions(PerGroup max_lr, std::optional<int64_t> total_steps = std::nullopt)
      : max_lr_(std::move(max_lr)), total_steps_(total_steps) {}
  TORCH_ARG(PerGroup, max_lr);
  TORCH_ARG(std::optional<int64_t>, total_steps);
  /// Where total_steps is not given: the cycle is epochs * steps_per_epoch steps (Python's).
  TORCH_ARG(std::optional<int64_t>, epochs) = std::nullopt;
  TORCH_ARG(std::optional<int64_t>, steps_per_epoch) = std::nullopt;
  TORCH_ARG(double, pct_start) = 0.3;
  TORCH_ARG(std::string, anneal_strategy) = "cos";
  TORCH_ARG(bool, cycle_momentum) = true;
  TORCH_ARG(PerGroup, base_momentum) = 0.85;
  TORCH_ARG(PerGroup, max_momentum) = 0.95;
  TORCH_ARG(double, div_factor) = 25.0;
  TORCH_ARG(double, final_div_factor) = 1e4;
  TORCH_ARG(bool, three_phase) = false;
};

/// Python's OneCycleLR (the 1cycle policy): the rate rises from max_lr /
/// div_factor to max_lr over pct_start of the steps and anneals to
/// initial / final_div_factor, momentum the other way. Stepped once per batch,
/// `total_steps` times at most.
class OneCycleLR final : public LRScheduler {
 public:
  PERF_INLINE OneCycleLR(torch::optim::Optimizer& optimizer, const OneCycleLROptions& options);
  const char* name() const override { return "OneCycleLR"; }

 private:
  struct Phase {
    double end_step;
    std::string start_lr, end_lr, start_momentum, end_momentum;  // Python's names of the group values
  };
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  PERF_INLINE double group_value(const std::string& key, std::size_t group) const;
  PERF_INLINE double anneal(double start, double end, double pct) const;
  int64_t total_steps_ = 0;
  std::vector<Phase> phases_;
  std::string anneal_strategy_;
  bool cycle_momentum_;
  bool use_beta1_ = false;
  std::vector<double> initial_lrs_, max_lrs_, min_lrs_, max_momentums_, base_momentums_;
};

/// Python's ReduceLROnPlateau arguments. `mode`: "min" or "max";
/// `threshold_mode`: "rel" or "abs"; `min_lr`: one number, or one per group.
struct ReduceLROnPlateauOptions {
  TORCH_ARG(std::string, mode) = "min";
  TORCH_ARG(double, factor) = 0.1;
  TORCH_ARG(int64_t, patience) = 10;
  TORCH_ARG(double, threshold) = 1e-4;
  TORCH_ARG(std::string, threshold_mode) = "rel";
  TORCH_ARG(int64_t, cooldown) = 0;
  TORCH_ARG(PerGroup, min_lr) = 0.0;
  TORCH_ARG(double, eps) = 1e-8;
};

/// Python's ReduceLROnPlateau: the rates times `factor` when the metric given
/// to step(metric) has not improved for more than `patience` steps. Unlike
/// LibTorch's ReduceLROnPlateauScheduler (float factor and metric), in
/// doubles as Python's, with get_last_lr() and Python's state_dict().
class ReduceLROnPlateau final : public LRScheduler {
 public:
  PERF_INLINE explicit ReduceLROnPlateau(torch::optim::Optimizer& optimizer,
                                         const ReduceLROnPlateauOptions& options = {});
  const char* name() const override { return "ReduceLROnPlateau"; }
  /// Refused: this scheduler steps on a metric, step(metric).
  PERF_INLINE void step() override;
  /// Python's `scheduler.step(metric)`: the validation loss (mode "min") or accuracy ("max") of this epoch.
  PERF_INLINE void step(double metric);
  /// The best metric so far, and the steps since it (Python's `best`, `num_bad_epochs`).
  double best() const { return best_; }
  int64_t num_bad_epochs() const { return num_bad_epochs_; }
  PERF_INLINE c10::impl::GenericDict state_dict() const override;

 private:
  PERF_INLINE std::function<void()> prepare_load(const c10::IValue& state) override;
  PERF_INLINE bool is_better(double a) const;
  double factor_;
  std::optional<double> default_min_lr_;  // Python's: None where min_lr was a list
  std::vector<double> min_lrs_;
  int64_t patience_, cooldown_;
  double eps_;
  std::string mode_, threshold_mode_;
  double threshold_;
  double best_;
  int64_t cooldown_counter_ = 0, num_bad_epochs_ = 0;
};

/// Python's SequentialLR: `schedulers[i]` runs from milestones[i - 1] on
/// (each made on `optimizer`, before this; a later one restarts at its
/// milestone, as Python's does).
class SequentialLR final : public LRScheduler {
 public:
  PERF_INLINE SequentialLR(torch::optim::Optimizer& optimizer, std::vector<std::shared_ptr<LRScheduler>> schedulers,
                           std::vector<int64_t> milestones);
  const char* name() const override { return "SequentialLR"; }
  PERF_INLINE void step() override;
  PERF_INLINE c10::impl::GenericDict state_dict() const override;
  const std::vector<std::shared_ptr<LRScheduler>>& schedulers() const { return schedulers_; }

 private:
  PERF_INLINE void undo_epoch() override;
  PERF_INLINE std::function<void()> prepare_load(const c10::IValue& state) override;
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<int64_t> milestones_;
};

/// Python's ChainedScheduler: every scheduler steps at each step, their factors multiplied.
class ChainedScheduler final : public LRScheduler {
 public:
  PERF_INLINE explicit ChainedScheduler(std::vector<std::shared_ptr<LRScheduler>> schedulers);
  const char* name() const override { return "ChainedScheduler"; }
  PERF_INLINE void step() override;
  PERF_INLINE c10::impl::GenericDict state_dict() const override;
  const std::vector<std::shared_ptr<LRScheduler>>& schedulers() const { return schedulers_; }

 private:
  PERF_INLINE void undo_epoch() override;
  PERF_INLINE std::function<void()> prepare_load(const c10::IValue& state) override;
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
};

}  // namespace perf::optim

#ifdef PERF_HEADER_ONLY
#include <perf/impl/lr_scheduler-inl.h>
#endif
