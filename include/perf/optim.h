// perf/optim.h — fused, capturable optimizers: drop-in torch::optim::Optimizers.
//
//   perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).weight_decay(0.01));
//   perf::optim::Adam  opt(params, perf::optim::AdamOptions(1e-3).amsgrad(true));
//   perf::optim::SGD   opt(params, perf::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
//   loss.backward(); opt.step(); opt.zero_grad();         // as with torch::optim
//   torch::save(opt, "opt.pt"); torch::load(opt, "opt.pt");
//
// step() runs ATen's fused kernels (at::_fused_adamw_, _fused_adam_, _fused_sgd_)
// once per (device, dtype) group instead of ~10 small kernels per parameter, on
// CPU and CUDA; elsewhere (or with .fused(false)) it runs _foreach_ kernels.
// kernels() says which ran. Step counters are 0-dim device tensors and step()
// makes no host sync, so a whole training step can be captured in a CUDA graph.
// step_scaled(grad_scale, found_inf) hands perf::GradScaler's device tensors to
// the fused kernels: unscale and skip-on-inf happen on the device.
//
// On CUDA the learning rate reaches the kernels as a 0-dim device tensor per
// param group, refreshed from the options outside any graph capture (sync_lr()),
// so schedulers keep working when a step is replayed from a CUDA graph.
// Checkpoints are interchangeable with torch::optim's Adam/AdamW/SGD in both
// directions (torch::save with one, torch::load with the other).
//
// .flat(true): parameters, gradients and optimizer state each live in one
// contiguous buffer per (device, dtype); every parameter and its .grad() are
// views into them, so a step is one kernel call per param group over millions
// of contiguous elements instead of a walk over many small tensors.
//
//   perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).flat(true));
//
//   torch::Tensor norm = perf::clip_grad_norm_(model->parameters(), 1.0);  // device tensor, no host sync
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <perf/config.h>
#include <perf/detail/float.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace perf::optim {

/// Adam / AdamW options: the names of torch::optim::AdamOptions / AdamWOptions,
/// plus maximize and fused. AdamW decouples weight decay (default 1e-2).
template <bool Decoupled>
struct AdamOptionsT : public torch::optim::OptimizerCloneableOptions<AdamOptionsT<Decoupled>> {
  AdamOptionsT(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit like torch's
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = Decoupled ? 1e-2 : 0.0;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
  /// true: fused kernels or an error; false: _foreach_ kernels; unset: fused where available.
  TORCH_ARG(std::optional<bool>, fused);
  /// true: one contiguous buffer per (device, dtype) for parameters, gradients
  /// and state (see FusedOptimizer::flat()). Set on the defaults: it is one
  /// setting for the whole optimizer; a param group may leave it unset or repeat
  /// it. Not written to checkpoints (it is how memory is held, not training state).
  TORCH_ARG(std::optional<bool>, flat);

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  PERF_INLINE void serialize(torch::serialize::OutputArchive& archive) const override;
  PERF_INLINE void serialize(torch::serialize::InputArchive& archive) override;
};
using AdamOptions = AdamOptionsT<false>;
using AdamWOptions = AdamOptionsT<true>;

/// Per-parameter Adam state. `step` is a 0-dim float32 tensor on the
/// parameter's device (capturable), as in Python's fused Adam.
struct AdamParamState : public torch::optim::OptimizerCloneableParamState<AdamParamState> {
  TORCH_ARG(torch::Tensor, step);
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);
  TORCH_ARG(torch::Tensor, max_exp_avg_sq);

 public:
  PERF_INLINE void serialize(torch::serialize::OutputArchive& archive) const override;
  PERF_INLINE void serialize(torch::serialize::InputArchive& archive) override;
};

/// SGD options: the names of torch::optim::SGDOptions, plus maximize and fused.
struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  SGDOptions(double lr) : lr_(lr) {}  // NOLINT: implicit like torch's
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(std::optional<bool>, fused);
  /// As AdamOptions::flat.
  TORCH_ARG(std::optional<bool>, flat);

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  PERF_INLINE void serialize(torch::serialize::OutputArchive& archive) const override;
  PERF_INLINE void serialize(torch::serialize::InputArchive& archive) override;
};

struct SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);

 public:
  PERF_INLINE void serialize(torch::serialize::OutputArchive& archive) const override;
  PERF_INLINE void serialize(torch::serialize::InputArchive& archive) override;
};

/// Common base: a torch::optim::Optimizer whose step can take GradScaler's
/// device-side scale and inf flag.
/// Clears the gradients of `optimizer`'s parameters as Python's
/// Optimizer.zero_grad does: a gradient that is a view (DDP's
/// gradient_as_bucket_view) is zeroed or dropped without LibTorch's in-place
/// detach_, which refuses views. The perf::optim optimizers' zero_grad() is this.
PERF_INLINE void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none = true);

struct MuonOptions;  // perf/muon.h

namespace detail {
struct FlatStore;
struct Bucket;
struct SideStream;
}  // namespace detail

/// One option of one param group that step() hands its kernels as a host value
/// (see FusedOptimizer::step_constants).
struct StepConstant {
  size_t group;
  const char* option;  // "weight_decay", "betas[0]", ...
  double value;        // booleans as 0 or 1
};

class FusedOptimizer : public torch::optim::Optimizer {
 public:
  using torch::optim::Optimizer::Optimizer;
  PERF_INLINE ~FusedOptimizer() override;
  PERF_INLINE FusedOptimizer(FusedOptimizer&&) noexcept;
  FusedOptimizer& operator=(FusedOptimizer&&) = delete;

  /// As torch::optim::Optimizer::zero_grad, and also for gradients that are
  /// views (perf::DistributedDataParallel's gradient_as_bucket_view).
  /// Flat mode: the gradient buffer is zeroed in place (one fill per buffer)
  /// whatever set_to_none says, since the gradients must stay views into it;
  /// a gradient that is someone else's view (DDP's buckets) is treated as
  /// without flat.
  void zero_grad(bool set_to_none = true);

  /// As torch::optim::Optimizer::step: the closure (if any) runs with grad
  /// enabled, the update without.
  PERF_INLINE torch::Tensor step(LossClosure closure = nullptr) override;

  /// As torch::optim::Optimizer::add_param_group, with the group's options
  /// combined with the optimizer's defaults as the LibTorch perf is built with
  /// combines them for its own optimizers: LibTorch 2.11 takes the group's
  /// options as they are; 2.12 and later take each option the group left at
  /// its options class's default from the optimizer's defaults instead (as
  /// Python's param-group dicts inherit missing keys). Since 2.12,
  /// torch::optim::Optimizer's own add_param_group (what a call through a
  /// torch::optim::Optimizer& reaches) replaces options of any type but its
  /// own optimizers' with a copy of the defaults.
  PERF_INLINE void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  /// The update with gradients scaled by `grad_scale` (unscaled inside the
  /// kernel), skipped on the device where `found_inf` is nonzero. No host sync
  /// on the fused path; the _foreach_ fallback reads found_inf (one sync).
  /// grad_scale unset: the gradients were already unscaled (GradScaler::unscale_).
  void step_scaled(const std::optional<torch::Tensor>& grad_scale, const torch::Tensor& found_inf);

  /// One line per (device, dtype) group of the last step: "cpu Float: fused",
  /// "cpu Float: foreach", or in flat mode "cpu Float: fused, flat (1 tensor for
  /// 161 parameters)".
  const std::vector<std::string>& kernels() const noexcept { return kernels_; }

  /// Copies each group's lr option into its CUDA lr tensor where it changed
  /// (one small kernel, no sync). step() does it itself, except while a CUDA
  /// graph is being captured; perf::TrainStep calls it before each replay.
  void sync_lr();

  /// Where each parameter's state lives (moments, momentum buffers, step
  /// counters; nullptr where not created), parameter by parameter in group
  /// order. A CUDA graph keeps the addresses it captured, and torch::load of
  /// the optimizer replaces the state: perf::TrainStep compares these before
  /// each replay.
  std::vector<const void*> state_addresses();

  /// Each param group's options that step() passes to its kernels as host
  /// values: all but lr, which the CUDA kernels read from a device tensor
  /// (weight decay, betas, eps, momentum, ...). A CUDA graph keeps the values
  /// it captured, so perf::TrainStep compares these before each replay.
  std::vector<StepConstant> step_constants() const;

  /// While set, every update is skipped on the device as if found_inf were 1
  /// (state is created, nothing moves): how TrainStep warms up without training.
  void skip_updates(bool skip) noexcept { skip_updates_ = skip; }
  bool skipping_updates() const noexcept { return skip_updates_; }

  /// Whether this optimizer holds its parameters, gradients and state flat
  /// (options .flat(true)). In flat mode:
  /// - each parameter's data and .grad() are views into one buffer per
  ///   (device, dtype), parameters of a param group adjacent; state tensors
  ///   are views too, laid out like their parameter (channels-last included);
  ///   parameters that already share one storage as a gap-free range (an
  ///   LSTM's weights in cuDNN's buffer on CUDA) stay there, their gradients
  ///   and state in the optimizer's buffers; overlapping ones (tied) are refused;
  /// - the buffers are rebuilt (values kept) at the next step or zero_grad
  ///   after add_param_group, torch::load, model->to(device or dtype) or
  ///   perf::to_channels_last; never while a CUDA graph is being captured;
  /// - a parameter with requires_grad false (frozen) or without a gradient is
  ///   skipped, as torch::optim skips one without a gradient; since zero_grad
  ///   zeroes in place, a parameter that took no part in a backward is stepped
  ///   with a zero gradient (torch::optim's zero_grad(false) behaviour);
  /// - a gradient replaced by a fresh tensor (model->zero_grad(), assigning
  ///   .grad()) is copied back into the buffer at the next step; one that is a
  ///   view of another buffer (perf::DistributedDataParallel's
  ///   gradient_as_bucket_view) stays where it is and that parameter is
  ///   stepped on its own, as without flat;
  /// - perf::clip_grad_norm_ and GradScaler work on the whole gradient buffer
  ///   (one kernel) when given all of its parameters.
  bool flat() const noexcept { return flat_ != nullptr; }

 protected:
  virtual void update(const std::optional<torch::Tensor>& grad_scale,
                      const std::optional<torch::Tensor>& found_inf) = 0;
  // The lr of group `g` as a 0-dim float tensor on `device` (CUDA kernels).
  const torch::Tensor& lr_tensor(size_t g, const c10::Device& device, double lr);
  // found_inf to hand to a fused kernel: the caller's, or 1 while skipping.
  std::optional<torch::Tensor> effective_found_inf(const std::optional<torch::Tensor>& found_inf,
                                                   const c10::Device& device);

  // Flat mode. A subclass names its per-parameter state tensors (up to three
  // kinds, plus Adam's step counter) so that FusedOptimizer can lay them out.
  virtual std::unique_ptr<torch::optim::OptimizerParamState> make_state() const = 0;
  virtual std::array<torch::Tensor*, 3> state_tensors(torch::optim::OptimizerParamState& s) const = 0;
  virtual torch::Tensor* state_step(torch::optim::OptimizerParamState&) const { return nullptr; }
  virtual std::optional<bool> flat_option(const torch::optim::OptimizerOptions& o) const = 0;
  // The options a param group given options `given` keeps (see add_param_group); of another type than the
  // optimizer's, `given` as it is, so that check_options names the type.
  virtual std::unique_ptr<torch::optim::OptimizerOptions> kept_options(
      const torch::optim::OptimizerOptions& given) const = 0;
  // After torch::optim::Optimizer's constructor: the groups' own options back in place (see add_param_group).
  void keep_group_options(const std::vector<torch::optim::OptimizerParamGroup>& given);
  // For torch::load, before anything changes: group g's parameter i is entry at[g][i] of the checkpoint's group
  // g (`saved_keys`: each group's keys as written). A key written twice (a torch::optim optimizer over a list
  // with a tied weight listed twice) is one parameter. A checkpoint whose groups do not match is refused.
  std::vector<std::vector<size_t>> match_saved_groups(const std::vector<std::vector<std::string>>& saved_keys) const;
  // For torch::load, before anything changes: the checkpoint's state `s` for parameter i of group g has tensors of
  // the parameter's shape (a checkpoint of another model would otherwise fail at the next step, in the kernel).
  void check_loaded_state(torch::optim::OptimizerParamState& s, const at::Tensor& p, size_t g, size_t i) const;
  // Loaded state as Python's load_state_dict leaves it: on the parameter's device, in its dtype (a checkpoint of
  // the model in float32 resumed in bfloat16), the step counter in float32.
  void fit_loaded_state(torch::optim::OptimizerParamState& s, const at::Tensor& p) const;
  // Checks group g's options: their type (a group built with torch::optim's
  // options class would be misread) and values. Before anything moves.
  virtual void check_options(const torch::optim::OptimizerOptions& o, size_t g) const = 0;
  void check_groups() const;
  const char* optimizer_name() const noexcept { return name_; }
  // Appends group g's step constants (options `o`, checked) to `out`.
  virtual void add_step_constants(const torch::optim::OptimizerOptions& o, size_t g,
                                  std::vector<StepConstant>& out) const = 0;
  // Called at the end of the subclass constructor: checks every group's
  // options, then lays the parameters out flat if asked.
  void init_flat(bool flat, const char* name);
  // The (device, dtype) buckets of group g in flat mode, each entry a run of
  // adjacent parameters: kinds[k] says which state tensors this group uses
  // (created where missing); split_first: momentum buffers created now go in
  // their own bucket (SGD's first step).
  std::vector<detail::Bucket> flat_buckets(size_t g, std::array<bool, 3> kinds, bool split_first);
  // Rebuilds the buffers if anything moved since they were built.
  void ensure_flat();
  // Flat: the next step or zero_grad rebuilds (state was replaced by torch::load).
  void invalidate_flat() noexcept;
  // Flat mode on CUDA: the side stream for a bucket whose calls of `per_call`
  // elements are to alternate between two streams (detail::flat_cuda_streams());
  // nullptr where they all run on the current stream.
  detail::SideStream* side_stream(const detail::Bucket& b, int64_t per_call);

  std::vector<std::string> kernels_;
  bool skip_updates_ = false;

 private:
  struct LrSlot {
    torch::Tensor value;
    double host = std::numeric_limits<double>::quiet_NaN();
  };
  bool flat_stale() const;
  void flatten();
  void check_group_flat(size_t g, bool flat) const;
  std::map<std::pair<size_t, std::string>, LrSlot> lr_tensors_;  // (group, device)
  std::map<std::string, torch::Tensor> ones_;                    // device -> 1.0f
  std::unique_ptr<detail::FlatStore> flat_;
  const char* name_ = "perf::optim";
  mutable size_t groups_kept_ = 0;  // groups whose options this class put in place (see check_groups)
};

/// A FusedOptimizer whose state and options serialize as ParamState / Options,
/// in LibTorch's format (torch::save / torch::load), either way with
/// torch::optim's optimizers of the same kind. Unlike LibTorch's loader, a
/// checkpoint that does not match is refused before anything changes, a
/// parameter whose key the checkpoint lists twice (a torch::optim optimizer
/// over a model with tied weights) is read once, state of another shape than
/// its parameter is refused, and, as Python's load_state_dict, the loaded state
/// replaces the optimizer's (a parameter without state in the checkpoint starts
/// afresh) and takes its parameter's device and dtype.
template <typename ParamState, typename Options>
class SerializableFusedOptimizer : public FusedOptimizer {
 public:
  using FusedOptimizer::FusedOptimizer;
  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<ParamState, Options>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override;

  /// Python's `optimizer.state_dict()`, laid out as torch.optim writes it:
  /// {"state": {index: {"exp_avg": ..., "step": ...}}, "param_groups": [{"lr":
  /// ..., "params": [index, ...]}]}, the parameters numbered in group order, the
  /// step counters on the CPU. `perf::save(opt.state_dict(), path)`
  /// (perf/state_dict.h) writes a file that Python's
  /// `optimizer.load_state_dict(torch.load(path))` takes, to resume the run there.
  /// While a perf/lr_scheduler.h scheduler made on this optimizer lives, each
  /// group also has what Python's schedulers keep there (`initial_lr`, ...).
  c10::impl::GenericDict state_dict() const;
  /// Python's `optimizer.load_state_dict(state)`: a torch.optim optimizer's
  /// state of the same kind (Adam, AdamW, SGD; `perf::load` of its file), the
  /// parameters matched by position, as Python matches them. Checked as load():
  /// before anything changes (groups and their sizes, options, state shapes);
  /// the state replaces this optimizer's and takes each parameter's device and
  /// dtype. How memory is held stays this optimizer's (`fused`, `flat`; Python's
  /// `foreach`, `capturable`, `differentiable` are not read); keys Python's LR
  /// schedulers add (`initial_lr`) are ignored, as Python's optimizers ignore them.
  void load_state_dict(const c10::IValue& state);

 private:
  // Both loads, once everything is checked: each parameter's state replaced by `state_for(g, i)` (none: erased, as
  // Python), each group's options by `options_for(g)`; flat buffers rebuilt at the next step.
  template <typename StateFor, typename OptionsFor>
  void replace_state(StateFor&& state_for, OptionsFor&& options_for);
};

/// Adam (Decoupled=false) and AdamW (Decoupled=true).
template <bool Decoupled>
class AdamT : public SerializableFusedOptimizer<AdamParamState, AdamOptionsT<Decoupled>> {
 public:
  using Options = AdamOptionsT<Decoupled>;
  explicit AdamT(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults = {});
  explicit AdamT(std::vector<torch::Tensor> params, Options defaults = {})
      : AdamT({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  void update(const std::optional<torch::Tensor>& grad_scale, const std::optional<torch::Tensor>& found_inf) override;
  std::unique_ptr<torch::optim::OptimizerParamState> make_state() const override {
    return std::make_unique<AdamParamState>();
  }
  std::array<torch::Tensor*, 3> state_tensors(torch::optim::OptimizerParamState& s) const override {
    auto& a = static_cast<AdamParamState&>(s);
    return {&a.exp_avg(), &a.exp_avg_sq(), &a.max_exp_avg_sq()};
  }
  torch::Tensor* state_step(torch::optim::OptimizerParamState& s) const override {
    return &static_cast<AdamParamState&>(s).step();
  }
  std::optional<bool> flat_option(const torch::optim::OptimizerOptions& o) const override {
    return static_cast<const Options&>(o).flat();
  }
  std::unique_ptr<torch::optim::OptimizerOptions> kept_options(
      const torch::optim::OptimizerOptions& given) const override;
  void check_options(const torch::optim::OptimizerOptions& o, size_t g) const override;
  void add_step_constants(const torch::optim::OptimizerOptions& options, size_t g,
                          std::vector<StepConstant>& out) const override {
    const auto& o = static_cast<const Options&>(options);
    out.insert(out.end(), {{g, "betas[0]", std::get<0>(o.betas())},
                           {g, "betas[1]", std::get<1>(o.betas())},
                           {g, "eps", o.eps()},
                           {g, "weight_decay", o.weight_decay()},
                           {g, "amsgrad", o.amsgrad() ? 1.0 : 0.0},
                           {g, "maximize", o.maximize() ? 1.0 : 0.0}});
  }
};
using Adam = AdamT<false>;
using AdamW = AdamT<true>;

/// SGD with momentum, dampening, Nesterov, weight decay, maximize.
class SGD : public SerializableFusedOptimizer<SGDParamState, SGDOptions> {
 public:
  explicit SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults);
  explicit SGD(std::vector<torch::Tensor> params, SGDOptions defaults)
      : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  PERF_INLINE void update(const std::optional<torch::Tensor>& grad_scale,
                          const std::optional<torch::Tensor>& found_inf) override;
  std::unique_ptr<torch::optim::OptimizerParamState> make_state() const override {
    return std::make_unique<SGDParamState>();
  }
  std::array<torch::Tensor*, 3> state_tensors(torch::optim::OptimizerParamState& s) const override {
    return {&static_cast<SGDParamState&>(s).momentum_buffer(), nullptr, nullptr};
  }
  std::optional<bool> flat_option(const torch::optim::OptimizerOptions& o) const override {
    return static_cast<const SGDOptions&>(o).flat();
  }
  PERF_INLINE std::unique_ptr<torch::optim::OptimizerOptions> kept_options(
      const torch::optim::OptimizerOptions& given) const override;
  PERF_INLINE void check_options(const torch::optim::OptimizerOptions& o, size_t g) const override;
  void add_step_constants(const torch::optim::OptimizerOptions& options, size_t g,
                          std::vector<StepConstant>& out) const override {
    const auto& o = static_cast<const SGDOptions&>(options);
    out.insert(out.end(), {{g, "momentum", o.momentum()},
                           {g, "dampening", o.dampening()},
                           {g, "weight_decay", o.weight_decay()},
                           {g, "nesterov", o.nesterov() ? 1.0 : 0.0},
                           {g, "maximize", o.maximize() ? 1.0 : 0.0}});
  }
};

// ---------------------------------------------------------------------------
namespace detail {

template <bool Decoupled>
constexpr const char* adam_name() {
  return Decoupled ? "perf::optim::AdamW" : "perf::optim::Adam";
}

// Python's optimizer state_dict() (torch/optim/adam.py, sgd.py in 2.11): each param group's keys and each
// parameter's state, to (python_*) and from (from_python_*) perf's options and state. `who` and `where` name
// the optimizer and the group or parameter in errors.
PERF_INLINE c10::impl::GenericDict python_dict();
// What Python's LR schedulers keep in an optimizer's param groups (group["initial_lr"], OneCycleLR's "max_lr",
// ...), for which LibTorch's groups have no room: perf/lr_scheduler.h records them per optimizer while a
// scheduler made on it lives (so the address is not reused meanwhile), and state_dict() writes them into each
// group, as Python's does (Python's OneCycleLR, resumed from the file, reads them there).
struct SchedulerGroupValues {
  std::size_t schedulers = 0;
  std::vector<std::pair<std::string, std::vector<double>>> values;  // in the order Python adds the keys
  PERF_INLINE std::vector<double>* find(const std::string& key);
  PERF_INLINE std::vector<double>& operator[](const std::string& key);  // added, empty, if new
};
PERF_INLINE std::mutex& scheduler_group_values_mutex();
PERF_INLINE std::unordered_map<const torch::optim::Optimizer*, SchedulerGroupValues>& scheduler_group_values();
PERF_INLINE double python_number(const c10::impl::GenericDict& d, const char* key, const std::string& who,
                                 const std::string& where);
PERF_INLINE bool python_bool(const c10::impl::GenericDict& d, const char* key, std::optional<bool> otherwise,
                             const std::string& who, const std::string& where);
PERF_INLINE at::Tensor python_tensor(const c10::impl::GenericDict& d, const char* key, bool required,
                                     const std::string& who, const std::string& where);
template <bool D>
c10::impl::GenericDict python_group(const AdamOptionsT<D>& o) {
  auto g = python_dict();
  g.insert("lr", o.lr());
  g.insert("betas",
           c10::ivalue::Tuple::create(std::vector<c10::IValue>{std::get<0>(o.betas()), std::get<1>(o.betas())}));
  g.insert("eps", o.eps());
  g.insert("weight_decay", o.weight_decay());
  g.insert("amsgrad", o.amsgrad());
  g.insert("maximize", o.maximize());
  g.insert("foreach", c10::IValue());
  g.insert("capturable", false);
  g.insert("differentiable", false);
  g.insert("fused", o.fused() ? c10::IValue(*o.fused()) : c10::IValue());
  g.insert("decoupled_weight_decay", D);
  return g;
}
template <bool D>
void from_python_group(const c10::impl::GenericDict& g, AdamOptionsT<D>& o, const std::string& who,
                       const std::string& where) {
  // AdamW is Adam with decoupled weight decay; a state without the key (PyTorch before 2.6) says nothing.
  if (g.contains("decoupled_weight_decay")) {
    const bool decoupled = python_bool(g, "decoupled_weight_decay", std::nullopt, who, where);
    TORCH_CHECK(decoupled == D, who, ": the state is ", decoupled ? "AdamW" : "Adam",
                "'s (decoupled_weight_decay=", decoupled ? "True" : "False", where,
                "); load it into perf::optim::", decoupled ? "AdamW" : "Adam");
  }
  o.lr(python_number(g, "lr", who, where));
  const auto betas = g.contains("betas") ? g.at("betas") : c10::IValue();
  TORCH_CHECK(betas.isTuple() && betas.toTupleRef().elements().size() == 2 &&
                  betas.toTupleRef().elements()[0].isScalar() && betas.toTupleRef().elements()[1].isScalar(),
              who, ": \"betas\"", where, " is not a pair of numbers");
  o.betas(
      {betas.toTupleRef().elements()[0].toScalar().toDouble(), betas.toTupleRef().elements()[1].toScalar().toDouble()});
  o.eps(python_number(g, "eps", who, where));
  o.weight_decay(python_number(g, "weight_decay", who, where));
  o.amsgrad(python_bool(g, "amsgrad", false, who, where));
  o.maximize(python_bool(g, "maximize", false, who, where));
}
PERF_INLINE c10::impl::GenericDict python_group(const SGDOptions& o);
PERF_INLINE void from_python_group(const c10::impl::GenericDict& g, SGDOptions& o, const std::string& who,
                                   const std::string& where);
PERF_INLINE c10::impl::GenericDict python_state(const AdamParamState& s);
PERF_INLINE void from_python_state(const c10::impl::GenericDict& d, AdamParamState& s, const std::string& who,
                                   const std::string& where);
PERF_INLINE c10::impl::GenericDict python_state(const SGDParamState& s);
PERF_INLINE void from_python_state(const c10::impl::GenericDict& d, SGDParamState& s, const std::string& who,
                                   const std::string& where);
// perf/muon.h's, defined in perf/impl/muon-inl.h (its state is SGD's). Declared here: SerializableFusedOptimizer's
// qualified calls see only the overloads declared before its definition.
PERF_INLINE c10::impl::GenericDict python_group(const MuonOptions& o);
PERF_INLINE void from_python_group(const c10::impl::GenericDict& g, MuonOptions& o, const std::string& who,
                                   const std::string& where);

// Tensors of one (device, dtype) group, in parameter order; in flat mode each
// entry is a run of adjacent parameters.
struct Bucket {
  c10::Device device;
  c10::ScalarType dtype;
  bool first = false;  // SGD: momentum buffers not yet created
  std::vector<at::Tensor> params, grads, a, b, c, steps;
  std::vector<at::Tensor> unique_steps;  // each counter once (runs may share one)
  bool flat = false;
  int64_t parameters = 0;  // flat: parameters covered by the entries
  int64_t in_place = 0;    // flat: of them, parameters left in a buffer they share (FlatKey::in_place)
};

PERF_INLINE Bucket& bucket_for(std::vector<Bucket>& buckets, const c10::Device& device, c10::ScalarType dtype,
                               bool first = false);

PERF_INLINE Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p, bool first = false);

// How many elements one fused kernel call over a flat CUDA bucket should cover;
// 0: the bucket in one call (CPU, not flat). ATen's multi_tensor_apply runs
// chunks of 65536 elements, one block each, at most 320 blocks per launch
// (ATen/native/cuda/MultiTensorApply.cuh): one call over ResNet-50's 25.6M
// parameters launches 320 blocks, 2 or 3 per SM of an H100's 132, then a tail of
// 71. Calls of k x (SM count) chunks, k = 320 / SMs, load every SM alike
// (bench_optim's launch probe, H100 AdamW: 83% of copy bandwidth in one call,
// 89% in calls of 132 chunks, 91% of 264).
PERF_INLINE int64_t elements_per_call(const Bucket& b);

// Calls `call(slice)` for consecutive slices of `b` of at most `elements`
// elements each (all of `b` at once when elements is 0 or b fits). An entry is
// cut where its tensors are dense with one layout (then a memory-order range of
// each is the same elements); another entry goes whole into a slice. Each
// slice keeps its entries' step counters, so counters are stepped once, by the
// caller. Returns the number of calls.
template <class Call>
size_t for_each_slice(const Bucket& b, int64_t elements, Call&& call);

// Python's Optimizer.zero_grad for one gradient, views included (LibTorch's
// in-place detach_ refuses them).
PERF_INLINE void clear_grad(at::Tensor& g, bool set_to_none);

// ---- flat mode's CUDA calls on two streams

// Flat mode on CUDA issues its calls (elements_per_call) on 1 or 2 streams.
// With 2, every second call runs on a side stream forked from the current one
// and joined back before step() returns (a CUDA graph captures both branches),
// so that one call's blocks can share the SMs with the next call's: one stream
// runs at most 320 blocks at a time, 2 per SM of an H100 or H200. The same
// kernels on the same slices, so the same values either way. Process-wide and
// internal, default 1: bench_optim and the tests compare the two until a GPU
// run settles the default (docs/benchmarks.md, "What the split calls leave").
PERF_INLINE int flat_cuda_streams() noexcept;
PERF_INLINE void set_flat_cuda_streams(int streams);  // 1 or 2

// One device's side stream (from the pool) and its fork and join events.
struct SideStream {
  explicit SideStream(c10::Stream s) : stream(s), fork(s.device_type()), join(s.device_type()) {}
  c10::Stream stream;
  c10::Event fork, join;
};

// Runs a bucket's calls alternately on the current stream of its device and on
// `side` (every call on the current stream where side is nullptr or is that
// stream). The side stream waits for what the current stream had queued before
// the first call; join() makes the current stream wait for the side's calls.
// The destructor joins if join() did not run (an exception on its way), so that
// a capture never ends with work left on the side stream.
class StreamAlternation {
 public:
  PERF_INLINE StreamAlternation(SideStream* side, const c10::Device& device);
  PERF_INLINE ~StreamAlternation();
  StreamAlternation(const StreamAlternation&) = delete;
  StreamAlternation& operator=(const StreamAlternation&) = delete;

  template <class F>
  void run(F&& f) {
    if (side_ == nullptr || calls_++ % 2 == 0) {
      f();
      return;
    }
    if (!forked_) {
      side_->fork.block(side_->stream);
      forked_ = true;
    }
    const c10::StreamGuard on_side(side_->stream);
    f();
  }
  PERF_INLINE void join();
  // ", N calls" (N > 1), with " on 2 streams" where the side stream ran some.
  PERF_INLINE std::string note(size_t calls) const;

 private:
  SideStream* side_ = nullptr;
  std::optional<c10::Stream> current_;
  size_t calls_ = 0;
  bool forked_ = false, joined_ = false;
};

// ---- flat mode

// Where one parameter lives in its (device, dtype) buffers.
struct FlatSlot {
  at::Tensor param;  // the user's parameter (same TensorImpl)
  size_t group = 0, key = 0;
  size_t pos = 0;      // index among the key's slots: adjacent slots are adjacent in memory
  int64_t offset = 0;  // in the key's buffers (in_place: the parameter's storage offset - base)
  std::vector<int64_t> sizes, strides;
  at::Tensor grad;                                     // the gradient view
  std::array<at::Tensor, 3> state;                     // state views, made when first needed
  torch::optim::OptimizerParamState* owner = nullptr;  // the state_ entry they were handed to
};

// One buffer per (device, dtype) that the optimizer allocates, plus one per
// storage whose parameters stay where they are (in_place; which ones:
// in_place_storages), so that cuDNN's RNN weight buffer, which LibTorch's
// LSTM/GRU/RNN make on CUDA, keeps serving cuDNN directly. The gradient and
// state buffers are always the optimizer's, laid out alike.
struct FlatKey {
  c10::Device device;
  c10::ScalarType dtype;
  int64_t numel = 0;  // with alignment padding (zeros, never written)
  size_t slots = 0;
  at::Tensor params, grads;  // in_place: params is a view of the shared storage from `base` on
  std::array<at::Tensor, 3> state;
  bool in_place = false;
  int64_t base = 0;  // in_place: storage offset of the first parameter (slot offsets count from it)
};

struct FlatStore {
  std::vector<FlatKey> keys;
  std::vector<FlatSlot> slots;      // group order, then parameter order
  std::vector<size_t> group_begin;  // slots of group g: [group_begin[g], group_begin[g + 1])
  bool built = false;
  std::map<c10::DeviceIndex, SideStream> sides;  // made by an eager step that needs one (FusedOptimizer::side_stream)
};

// Each parameter starts at a 256-byte boundary (vectorised loads; the CUDA
// allocator's granularity).
PERF_INLINE int64_t flat_align(int64_t n, c10::ScalarType dtype);

// A tensor over `buffer`'s storage that is not an autograd view (LibTorch's
// zero_grad detach_()es gradients in place, which views refuse).
PERF_INLINE at::Tensor plain_view(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes,
                                  at::IntArrayRef strides);

PERF_INLINE at::Tensor slot_view(const at::Tensor& buffer, const FlatSlot& s);

// A tensor alone in its storage (autograd's fresh gradient) rather than a view
// of a bigger buffer (a DDP bucket, another optimizer's flat buffer).
PERF_INLINE bool owns_storage(const at::Tensor& t);

PERF_INLINE bool same_storage(const at::Tensor& a, const at::Tensor& b);

// A storage that parameters share and that stays where it is (FlatKey::in_place), in elements.
struct InPlaceRange {
  int64_t base = 0, numel = 0;
};

// The storages whose parameters stay in place: those that several parameters
// (or one that does not own its storage) cover as one gap-free range of dense
// tensors of one dtype, as cuDNN's RNN weight buffer is. Others are copied
// into the optimizer's buffer: storages in `own` (its previous buffers) and
// any with gaps (the buffer of an earlier flat optimizer, or a checkpoint
// saved from one, with its alignment padding). Parameters whose memory
// overlaps (tied weights) are refused, naming both.
PERF_INLINE std::unordered_map<const void*, InPlaceRange> in_place_storages(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const std::unordered_set<const void*>& own,
    const char* name);

// Flat gradient buffers alive: storage -> number of parameters in it, so that
// clip_grad_norm_ and GradScaler can treat a complete set as one tensor.
PERF_INLINE std::mutex& flat_registry_mutex();
PERF_INLINE std::unordered_map<const void*, size_t>& flat_registry();
PERF_INLINE void flat_register(const FlatStore& f, bool add);

/// `grads` with every complete set of a flat optimizer's gradients replaced
/// by its whole buffer (padding is zeros): one tensor instead of many for
/// norms, unscaling and scaling. Order otherwise kept.
PERF_INLINE std::vector<at::Tensor> coalesce_flat(const std::vector<at::Tensor>& grads);

PERF_INLINE bool fused_available(const Bucket& b);

// Whether this bucket runs fused; throws if fused(true) cannot be honoured.
PERF_INLINE bool use_fused(const std::optional<bool>& fused, const Bucket& b, const char* name);

PERF_INLINE std::string kernel_line(const Bucket& b, bool fused);

// Whether LibTorch's Optimizer::add_param_group merges a group's options into the defaults (2.12 and later:
// torch/csrc/api/src/optim/optimizer.cpp, OptimizerCloneableOptions::_merge_by_comparison), which perf's
// optimizers then do for theirs (FusedOptimizer::add_param_group).
constexpr bool torch_merges_group_options = TORCH_VERSION_MAJOR > 2 ||
                                            (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12);

// A param group's options as `Options`, or a clear error naming both types.
template <typename Options>
const Options& group_options(const torch::optim::OptimizerOptions& o, size_t g, const char* name,
                             const char* options_name) {
  const auto* typed = dynamic_cast<const Options*>(&o);
  TORCH_CHECK(typed != nullptr, name, ": param group ", g, " has options of type ", c10::demangle(typeid(o).name()),
              ", not ", options_name, ": build the group with ", options_name,
              " (torch::optim's option names, plus maximize, fused and flat)");
  return *typed;
}

// Checks shared by the constructors: floating parameters, one device per group, no tensor in two groups (as
// Python's optimizers refuse). Returns the groups with a tensor listed twice in one group kept once: LibTorch's
// Module::parameters() lists a tensor registered under two names (tied weights) once per name, where Python's
// module.parameters() lists it once, and updating it twice a step is never what is meant.
PERF_INLINE std::vector<torch::optim::OptimizerParamGroup> checked_params(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const char* name);

PERF_INLINE void check_grad(const at::Tensor& p, size_t g, const char* name);

// Moves loaded state to the parameter's device (checkpoints may come from elsewhere).
PERF_INLINE void to_param_device(at::Tensor& t, const at::Tensor& p);

// found_inf / grad_scale for this device (one copy per device and step).
PERF_INLINE std::optional<at::Tensor> on_device(const std::optional<at::Tensor>& t, const c10::Device& d);

// Fallback path with a scaler: unscale, then skip on inf (the one host sync).
PERF_INLINE bool foreach_prepare_scaled(std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& grad_scale,
                                        const std::optional<at::Tensor>& found_inf);

}  // namespace detail

// --------------------------------------------------------------------------- options

template <bool D>
void AdamOptionsT<D>::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(fused);
}

namespace detail {
// An option torch::optim always writes (LibTorch's _TORCH_OPTIM_DESERIALIZE_TORCH_ARG
// without its bare internal assert, which also trips clang's -Wpedantic in a user's TU).
PERF_INLINE c10::IValue read_option(torch::serialize::InputArchive& archive, const char* key, const char* who);
// Options torch::optim does not write (maximize, fused) keep their defaults.
PERF_INLINE void read_bool_if_present(torch::serialize::InputArchive& archive, const char* key, bool& out);
// State tensors: absent means undefined (e.g. max_exp_avg_sq without amsgrad).
PERF_INLINE void read_tensor_if_present(torch::serialize::InputArchive& archive, const char* key, at::Tensor& out);
}  // namespace detail

template <bool D>
void AdamOptionsT<D>::serialize(torch::serialize::InputArchive& archive) {
  const char* who = D ? "perf::optim::AdamWOptions" : "perf::optim::AdamOptions";
  lr(detail::read_option(archive, "lr", who).toDouble());
  betas(detail::read_option(archive, "betas", who).to<betas_t>());
  eps(detail::read_option(archive, "eps", who).toDouble());
  weight_decay(detail::read_option(archive, "weight_decay", who).toDouble());
  amsgrad(detail::read_option(archive, "amsgrad", who).toBool());
  detail::read_bool_if_present(archive, "maximize", maximize_);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG_OPTIONAL(bool, fused);
}

// --------------------------------------------------------------------------- FusedOptimizer

namespace detail {
PERF_INLINE bool capturing_cuda_graph();
}  // namespace detail

// LibTorch's loader checks each group as it applies it, so a group that does not match is refused after those
// before it took their state and options; and it keeps the state of parameters the checkpoint has none for.
template <typename ParamState, typename Options>
void SerializableFusedOptimizer<ParamState, Options>::load(torch::serialize::InputArchive& archive) {
  c10::IValue version;
  torch::serialize::InputArchive state_archive, groups_archive;
  TORCH_CHECK(archive.try_read("pytorch_version", version) && version.isString() && version.toStringRef() == "1.5.0" &&
                  archive.try_read("state", state_archive) && archive.try_read("param_groups", groups_archive),
              this->optimizer_name(),
              ": not an optimizer checkpoint (torch::save of a torch::optim or perf::optim optimizer writes "
              "\"pytorch_version\" 1.5.0, \"state\" and \"param_groups\")");
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>> saved_state;
  torch::optim::detail::serialize<ParamState>(state_archive, saved_state);
  std::vector<std::pair<std::vector<std::string>, std::unique_ptr<torch::optim::OptimizerOptions>>> saved_groups;
  torch::optim::detail::serialize<Options>(groups_archive, saved_groups);
  std::vector<std::vector<std::string>> keys;
  keys.reserve(saved_groups.size());
  for (const auto& group : saved_groups) keys.push_back(group.first);
  const auto at = this->match_saved_groups(keys);  // refuses a mismatch before anything changes
  auto& groups = this->param_groups();
  std::unique_ptr<torch::optim::OptimizerParamState> none;
  const auto saved_for = [&](size_t g, size_t i) -> std::unique_ptr<torch::optim::OptimizerParamState>& {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): LibTorch's keys are the saving process's TensorImpl addresses
    const auto found = saved_state.find(reinterpret_cast<void*>(std::stoull(keys[g][at[g][i]])));
    return found == saved_state.end() ? none : found->second;
  };
  for (size_t g = 0; g < groups.size(); ++g) {
    this->check_options(groups[g].options(), g);  // its type: the cast below
    this->check_options(*saved_groups[g].second, g);
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      if (const auto& s = saved_for(g, i)) {
        this->check_loaded_state(*s, groups[g].params()[i], g, i);
        this->fit_loaded_state(*s, groups[g].params()[i]);  // the checkpoint's copy: a failed move changes nothing
      }
    }
  }
  replace_state(saved_for,
                [&](size_t g) -> const Options& { return static_cast<const Options&>(*saved_groups[g].second); });
}

template <typename ParamState, typename Options>
template <typename StateFor, typename OptionsFor>
void SerializableFusedOptimizer<ParamState, Options>::replace_state(StateFor&& state_for, OptionsFor&& options_for) {
  auto& groups = this->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      const auto& p = groups[g].params()[i];
      auto& s = state_for(g, i);
      if (s) {
        this->state()[p.unsafeGetTensorImpl()] = std::move(s);
      } else {
        this->state().erase(p.unsafeGetTensorImpl());
      }
    }
    static_cast<Options&>(groups[g].options()) = options_for(g);
  }
  this->invalidate_flat();  // flat: the loaded state is copied into the buffers at the next step
}

template <typename ParamState, typename Options>
c10::impl::GenericDict SerializableFusedOptimizer<ParamState, Options>::state_dict() const {
  auto state = detail::python_dict();
  c10::impl::GenericList groups(c10::AnyType::get());
  int64_t index = 0;
  std::vector<std::pair<std::string, std::vector<double>>> scheduler_values;
  {
    std::lock_guard<std::mutex> lock(detail::scheduler_group_values_mutex());
    const auto found = detail::scheduler_group_values().find(this);
    if (found != detail::scheduler_group_values().end()) scheduler_values = found->second.values;
  }
  for (const auto& group : this->param_groups()) {
    auto g = detail::python_group(static_cast<const Options&>(group.options()));
    const std::size_t group_index = groups.size();
    for (const auto& [key, values] : scheduler_values)
      if (group_index < values.size()) g.insert(key, values[group_index]);
    c10::impl::GenericList params(c10::AnyType::get());
    for (const auto& p : group.params()) {
      const auto found = this->state().find(p.unsafeGetTensorImpl());
      if (found != this->state().end() && found->second) {
        state.insert(index, detail::python_state(static_cast<const ParamState&>(*found->second)));
      }
      params.push_back(index++);
    }
    g.insert("params", params);
    groups.push_back(g);
  }
  auto out = detail::python_dict();
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

template <typename ParamState, typename Options>
void SerializableFusedOptimizer<ParamState, Options>::load_state_dict(const c10::IValue& state) {
  const std::string who = std::string(this->optimizer_name()) + "::load_state_dict";
  const bool layout = state.isGenericDict() && state.toGenericDict().contains("state") &&
                      state.toGenericDict().at("state").isGenericDict() &&
                      state.toGenericDict().contains("param_groups") &&
                      state.toGenericDict().at("param_groups").isList();
  TORCH_CHECK(layout, who,
              ": not Python's optimizer state_dict() (a dict of \"state\": {index: {...}} and \"param_groups\": "
              "[{..., \"params\": [index, ...]}]); a LibTorch archive of an optimizer is read by torch::load");
  const auto saved_state = state.toGenericDict().at("state").toGenericDict();
  const auto saved_groups = state.toGenericDict().at("param_groups").toList();
  auto& groups = this->param_groups();
  TORCH_CHECK(saved_groups.size() == groups.size(), who, ": the state has ", saved_groups.size(),
              " param group(s), this optimizer ", groups.size());
  std::vector<Options> options;
  std::vector<std::vector<std::unique_ptr<torch::optim::OptimizerParamState>>> states(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string where = " in param group " + std::to_string(g);
    const c10::IValue saved = saved_groups.get(g);
    TORCH_CHECK(saved.isGenericDict() && saved.toGenericDict().contains("params") &&
                    saved.toGenericDict().at("params").isList(),
                who, ": param group ", g, " of the state is not a dict with \"params\"");
    const auto group = saved.toGenericDict();
    const auto indices = group.at("params").toList();
    const auto& params = groups[g].params();
    TORCH_CHECK(indices.size() == params.size(), who, ": param group ", g, " has ", indices.size(),
                " parameters in the state and ", params.size(), " here");
    this->check_options(groups[g].options(), g);                   // its type: the cast below
    Options o = static_cast<const Options&>(groups[g].options());  // fused and flat stay this optimizer's
    detail::from_python_group(group, o, who, where);
    this->check_options(o, g);
    options.push_back(o);
    for (size_t i = 0; i < params.size(); ++i) {
      const c10::IValue index = indices.get(i);
      TORCH_CHECK(index.isInt(), who, ": param group ", g, " lists a parameter that is not an index");
      const auto found = saved_state.find(index);
      if (found == saved_state.end()) {
        states[g].emplace_back();
        continue;
      }
      const std::string at =
          where + ", parameter " + std::to_string(i) + " (state " + std::to_string(index.toInt()) + ")";
      TORCH_CHECK(found->value().isGenericDict(), who, ": the state", at, " is not a dict");
      auto s = std::make_unique<ParamState>();
      detail::from_python_state(found->value().toGenericDict(), *s, who, at);
      this->check_loaded_state(*s, params[i], g, i);
      this->fit_loaded_state(*s, params[i]);
      states[g].push_back(std::move(s));
    }
  }
  replace_state([&](size_t g, size_t i) -> std::unique_ptr<torch::optim::OptimizerParamState>& { return states[g][i]; },
                [&](size_t g) -> const Options& { return options[g]; });
}

// --------------------------------------------------------------------------- Adam / AdamW

namespace detail {
template <bool D>
void check_adam_options(const AdamOptionsT<D>& o, const std::string& where) {
  const char* name = adam_name<D>();
  TORCH_CHECK(o.lr() >= 0, name, ": invalid lr ", o.lr(), where, " (must be >= 0)");
  TORCH_CHECK(o.eps() >= 0, name, ": invalid eps ", o.eps(), where, " (must be >= 0)");
  const auto [b1, b2] = o.betas();
  TORCH_CHECK(b1 >= 0 && b1 < 1, name, ": invalid betas[0] ", b1, where, " (must be in [0, 1))");
  TORCH_CHECK(b2 >= 0 && b2 < 1, name, ": invalid betas[1] ", b2, where, " (must be in [0, 1))");
  TORCH_CHECK(o.weight_decay() >= 0, name, ": invalid weight_decay ", o.weight_decay(), where, " (must be >= 0)");
}
}  // namespace detail

template <bool D>
AdamT<D>::AdamT(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults)
    : SerializableFusedOptimizer<AdamParamState, Options>(
          [&] {
            detail::check_adam_options(defaults, "");
            return detail::checked_params(param_groups, detail::adam_name<D>());
          }(),
          std::make_unique<Options>(defaults)) {
  this->keep_group_options(param_groups);
  this->init_flat(defaults.flat().value_or(false), detail::adam_name<D>());  // checks every group's options first
}

template <bool D>
std::unique_ptr<torch::optim::OptimizerOptions> AdamT<D>::kept_options(
    const torch::optim::OptimizerOptions& given) const {
  const auto* o = dynamic_cast<const Options*>(&given);
  // Of another type (check_options names it), or LibTorch 2.11: the group's options as given.
  if (o == nullptr || !detail::torch_merges_group_options) return given.clone();
  const Options unset;  // what a group's option left alone reads as
  Options kept = static_cast<const Options&>(this->defaults());
  if (!perf::detail::same_value(o->lr(), unset.lr())) kept.lr(o->lr());
  if (o->betas() != unset.betas()) kept.betas(o->betas());
  if (!perf::detail::same_value(o->eps(), unset.eps())) kept.eps(o->eps());
  if (!perf::detail::same_value(o->weight_decay(), unset.weight_decay())) kept.weight_decay(o->weight_decay());
  if (o->amsgrad() != unset.amsgrad()) kept.amsgrad(o->amsgrad());
  if (o->maximize() != unset.maximize()) kept.maximize(o->maximize());
  if (o->fused()) kept.fused(o->fused());
  if (o->flat()) kept.flat(o->flat());
  return std::make_unique<Options>(kept);
}

template <bool D>
void AdamT<D>::check_options(const torch::optim::OptimizerOptions& o, size_t g) const {
  detail::check_adam_options(
      detail::group_options<Options>(o, g, detail::adam_name<D>(),
                                     D ? "perf::optim::AdamWOptions" : "perf::optim::AdamOptions"),
      " in param group " + std::to_string(g));
}

template <bool D>
void AdamT<D>::update(const std::optional<torch::Tensor>& grad_scale, const std::optional<torch::Tensor>& found_inf) {
  const char* name = detail::adam_name<D>();
  this->kernels_.clear();
  this->ensure_flat();
  for (size_t g = 0; g < this->param_groups_.size(); ++g) {
    auto& group = this->param_groups_[g];
    const auto& o = static_cast<const Options&>(group.options());  // checked by step()
    std::vector<detail::Bucket> buckets;
    if (this->flat()) {
      buckets = this->flat_buckets(g, {true, true, o.amsgrad()}, /*split_first=*/false);
    } else {
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;  // skipped, like PyTorch
        detail::check_grad(p, g, name);
        auto& slot = this->state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto s = std::make_unique<AdamParamState>();
          s->step(at::zeros({}, p.options().dtype(at::kFloat)));
          s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(s);
        }
        auto& s = static_cast<AdamParamState&>(*slot);
        if (o.amsgrad() && !s.max_exp_avg_sq().defined())
          s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        detail::to_param_device(s.step(), p);
        detail::to_param_device(s.exp_avg(), p);
        detail::to_param_device(s.exp_avg_sq(), p);
        detail::to_param_device(s.max_exp_avg_sq(), p);
        auto& b = detail::bucket_for(buckets, p);
        b.params.push_back(p);
        b.grads.push_back(p.grad());
        b.a.push_back(s.exp_avg());
        b.b.push_back(s.exp_avg_sq());
        if (o.amsgrad()) b.c.push_back(s.max_exp_avg_sq());
        b.steps.push_back(s.step());
      }
      for (auto& b : buckets) b.unique_steps = b.steps;
    }
    // Plain doubles, not a structured binding: clang < 16 cannot capture bindings in the lambda below.
    const double beta1 = std::get<0>(o.betas());
    const double beta2 = std::get<1>(o.betas());
    for (auto& b : buckets) {
      const bool fused = detail::use_fused(o.fused(), b, name);
      this->kernels_.push_back(detail::kernel_line(b, fused));
      const auto gs = detail::on_device(grad_scale, b.device);
      const auto fi = this->effective_found_inf(detail::on_device(found_inf, b.device), b.device);
      if (fused) {
        at::_foreach_add_(b.unique_steps, 1);
        if (b.device.is_cuda()) {  // lr as a device tensor: replayed graphs see the scheduler's value
          const auto& lr = this->lr_tensor(g, b.device, o.lr());
          const int64_t per_call = detail::elements_per_call(b);
          detail::StreamAlternation streams(this->side_stream(b, per_call), b.device);
          const size_t calls = detail::for_each_slice(b, per_call, [&](const detail::Bucket& s) {
            streams.run([&] {
              if constexpr (D) {
                at::_fused_adamw_(s.params, s.grads, s.a, s.b, s.c, s.steps, lr, beta1, beta2, o.weight_decay(),
                                  o.eps(), o.amsgrad(), o.maximize(), gs, fi);
              } else {
                at::_fused_adam_(s.params, s.grads, s.a, s.b, s.c, s.steps, lr, beta1, beta2, o.weight_decay(), o.eps(),
                                 o.amsgrad(), o.maximize(), gs, fi);
              }
            });
          });
          streams.join();
          this->kernels_.back() += streams.note(calls);
        } else if constexpr (D) {
          at::_fused_adamw_(b.params, b.grads, b.a, b.b, b.c, b.steps, o.lr(), beta1, beta2, o.weight_decay(), o.eps(),
                            o.amsgrad(), o.maximize(), gs, fi);
        } else {
          at::_fused_adam_(b.params, b.grads, b.a, b.b, b.c, b.steps, o.lr(), beta1, beta2, o.weight_decay(), o.eps(),
                           o.amsgrad(), o.maximize(), gs, fi);
        }
        // The kernel leaves params alone on inf; undo the step count too (as Python does).
        if (fi) at::_foreach_sub_(b.unique_steps, std::vector<at::Tensor>(b.unique_steps.size(), *fi));
        continue;
      }
      // _foreach_ path: Python's capturable multi-tensor Adam (no host sync).
      if (this->skip_updates_ || !detail::foreach_prepare_scaled(b.grads, gs, fi)) continue;
      at::_foreach_add_(b.unique_steps, 1);
      auto grads = o.maximize() ? at::_foreach_neg(b.grads) : b.grads;
      if (!perf::detail::same_value(o.weight_decay(), 0.0)) {
        if (D) {
          at::_foreach_mul_(b.params, 1 - o.lr() * o.weight_decay());
        } else {
          grads = at::_foreach_add(grads, b.params, o.weight_decay());
        }
      }
      at::_foreach_lerp_(b.a, grads, 1 - beta1);
      at::_foreach_mul_(b.b, beta2);
      at::_foreach_addcmul_(b.b, grads, grads, 1 - beta2);
      auto bc1 = at::_foreach_pow(beta1, b.steps);
      auto bc2 = at::_foreach_pow(beta2, b.steps);
      at::_foreach_sub_(bc1, 1);
      at::_foreach_sub_(bc2, 1);
      at::_foreach_neg_(bc2);
      at::_foreach_div_(bc1, o.lr());
      at::_foreach_reciprocal_(bc1);  // -step_size
      at::_foreach_sqrt_(bc2);
      if (o.amsgrad()) at::_foreach_maximum_(b.c, b.b);
      auto denom = at::_foreach_sqrt(o.amsgrad() ? b.c : b.b);
      at::_foreach_div_(denom, bc2);
      at::_foreach_add_(denom, o.eps());
      at::_foreach_div_(denom, bc1);
      at::_foreach_addcdiv_(b.params, b.a, denom);
    }
  }
}

namespace detail {

template <class Call>
size_t for_each_slice(const Bucket& b, int64_t elements, Call&& call) {
  int64_t total = 0;
  for (const auto& p : b.params) total += p.numel();
  if (elements <= 0 || total <= elements) {
    call(b);
    return 1;
  }
  Bucket slice{b.device, b.dtype, b.first, {}, {}, {}, {}, {}, {}, {}, b.flat, 0, 0};
  using List = std::pair<const std::vector<at::Tensor>*, std::vector<at::Tensor>*>;  // b's, the slice's
  std::vector<List> lists{{&b.params, &slice.params}, {&b.grads, &slice.grads}};
  for (const List& l : {List{&b.a, &slice.a}, List{&b.b, &slice.b}, List{&b.c, &slice.c}})
    if (!l.first->empty()) lists.push_back(l);
  int64_t filled = 0;
  size_t calls = 0;
  auto emit = [&] {
    if (slice.params.empty()) return;
    call(slice);
    ++calls;
    for (auto* list : {&slice.params, &slice.grads, &slice.a, &slice.b, &slice.c, &slice.steps}) list->clear();
    filled = 0;
  };
  for (size_t i = 0; i < b.params.size(); ++i) {
    const auto& p = b.params[i];
    const bool cuttable = std::all_of(lists.begin(), lists.end(), [&](const auto& l) {
      const auto& t = (*l.first)[i];
      return t.is_non_overlapping_and_dense() && t.sizes() == p.sizes() && t.strides() == p.strides();
    });
    const int64_t n = p.numel();
    for (int64_t begin = 0; begin < n;) {
      const int64_t len = cuttable ? std::min(n - begin, elements - filled) : n;
      for (auto& [from, to] : lists) {
        const auto& t = (*from)[i];
        to->push_back(cuttable ? t.as_strided({n}, {1}, t.storage_offset()).narrow(0, begin, len) : t);
      }
      if (!b.steps.empty()) slice.steps.push_back(b.steps[i]);
      begin += len;
      filled += len;
      if (filled >= elements) emit();
    }
  }
  emit();
  return calls;
}

}  // namespace detail

// --------------------------------------------------------------------------- SGD

namespace detail {
PERF_INLINE void check_sgd_options(const SGDOptions& o, const std::string& where);
}  // namespace detail

}  // namespace perf::optim

namespace perf {

/// Clips the gradient norm of `parameters` in place, like
/// torch.nn.utils.clip_grad_norm_ (foreach implementation), and returns the
/// total norm as a 0-dim tensor on the first gradient's device (float; double
/// when any gradient is float64, which is clipped in float64). No host
/// sync (LibTorch's torch::nn::utils::clip_grad_norm_ returns a double, which
/// syncs), so it runs inside perf::TrainStep's captured step and after
/// GradScaler::unscale_. norm_type: p > 0 or infinity. Parameters without a
/// gradient are ignored; none at all returns 0. The gradients of a flat
/// optimizer (all of them) are one tensor: one norm kernel, one scale kernel.
/// error_if_nonfinite (as LibTorch's and Python's): a NaN or infinite norm
/// throws before any gradient is scaled; it reads the norm on the host (one
/// sync), so it is refused inside a CUDA graph capture, where GradScaler's
/// on-device check of the step is the way.
torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double norm_type = 2.0,
                              bool error_if_nonfinite = false);

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/optim-inl.h>
#endif
