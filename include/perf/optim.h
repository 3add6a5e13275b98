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
//   torch::Tensor norm = perf::clip_grad_norm_(model->parameters(), 1.0);  // device tensor, no host sync
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
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

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
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
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
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

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};

struct SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};

/// Common base: a torch::optim::Optimizer whose step can take GradScaler's
/// device-side scale and inf flag.
/// Clears the gradients of `optimizer`'s parameters as Python's
/// Optimizer.zero_grad does: a gradient that is a view (DDP's
/// gradient_as_bucket_view) is zeroed or dropped without LibTorch's in-place
/// detach_, which refuses views. The perf::optim optimizers' zero_grad() is this.
inline void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none = true) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      auto& g = p.mutable_grad();
      if (!g.defined()) continue;
      if (g.grad_fn()) {
        g = g.detach();
      } else {
        g.requires_grad_(false);
      }
      if (set_to_none) {
        g.reset();
      } else {
        g.zero_();
      }
    }
  }
}

class FusedOptimizer : public torch::optim::Optimizer {
 public:
  using torch::optim::Optimizer::Optimizer;

  /// As torch::optim::Optimizer::zero_grad, and also for gradients that are
  /// views (perf::DistributedDataParallel's gradient_as_bucket_view).
  void zero_grad(bool set_to_none = true) { perf::optim::zero_grad(*this, set_to_none); }

  /// As torch::optim::Optimizer::step: the closure (if any) runs with grad
  /// enabled, the update without.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// The update with gradients scaled by `grad_scale` (unscaled inside the
  /// kernel), skipped on the device where `found_inf` is nonzero. No host sync
  /// on the fused path; the _foreach_ fallback reads found_inf (one sync).
  /// grad_scale unset: the gradients were already unscaled (GradScaler::unscale_).
  void step_scaled(const std::optional<torch::Tensor>& grad_scale, const torch::Tensor& found_inf);

  /// One line per (device, dtype) group of the last step: "cpu Float: fused" or
  /// "cpu Float: foreach".
  const std::vector<std::string>& kernels() const noexcept { return kernels_; }

  /// Copies each group's lr option into its CUDA lr tensor where it changed
  /// (one small kernel, no sync). step() does it itself, except while a CUDA
  /// graph is being captured; perf::TrainStep calls it before each replay.
  void sync_lr();

  /// While set, every update is skipped on the device as if found_inf were 1
  /// (state is created, nothing moves): how TrainStep warms up without training.
  void skip_updates(bool skip) noexcept { skip_updates_ = skip; }
  bool skipping_updates() const noexcept { return skip_updates_; }

 protected:
  virtual void update(const std::optional<torch::Tensor>& grad_scale,
                      const std::optional<torch::Tensor>& found_inf) = 0;
  // The lr of group `g` as a 0-dim float tensor on `device` (CUDA kernels).
  const torch::Tensor& lr_tensor(size_t g, const c10::Device& device, double lr);
  // found_inf to hand to a fused kernel: the caller's, or 1 while skipping.
  std::optional<torch::Tensor> effective_found_inf(const std::optional<torch::Tensor>& found_inf,
                                                   const c10::Device& device);

  std::vector<std::string> kernels_;
  bool skip_updates_ = false;

 private:
  struct LrSlot {
    torch::Tensor value;
    double host = std::numeric_limits<double>::quiet_NaN();
  };
  std::map<std::pair<size_t, std::string>, LrSlot> lr_tensors_;  // (group, device)
  std::map<std::string, torch::Tensor> ones_;                    // device -> 1.0f
};

/// A FusedOptimizer whose state and options serialize as ParamState / Options,
/// in LibTorch's format (torch::save / torch::load).
template <typename ParamState, typename Options>
class SerializableFusedOptimizer : public FusedOptimizer {
 public:
  using FusedOptimizer::FusedOptimizer;
  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<ParamState, Options>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<ParamState, Options>(archive, *this);
  }
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
  void update(const std::optional<torch::Tensor>& grad_scale, const std::optional<torch::Tensor>& found_inf) override;
};

// ---------------------------------------------------------------------------
namespace detail {

template <bool Decoupled>
constexpr const char* adam_name() {
  return Decoupled ? "perf::optim::AdamW" : "perf::optim::Adam";
}

// Tensors of one (device, dtype) group, in parameter order.
struct Bucket {
  c10::Device device;
  c10::ScalarType dtype;
  bool first = false;  // SGD: momentum buffers not yet created
  std::vector<at::Tensor> params, grads, a, b, c, steps;
};

inline Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p, bool first = false) {
  for (auto& b : buckets)
    if (b.device == p.device() && b.dtype == p.scalar_type() && b.first == first) return b;
  buckets.push_back(Bucket{p.device(), p.scalar_type(), first, {}, {}, {}, {}, {}, {}});
  return buckets.back();
}

inline bool fused_available(const Bucket& b) {
  const bool dtype_ok =
      b.dtype == at::kFloat || b.dtype == at::kDouble || b.dtype == at::kHalf || b.dtype == at::kBFloat16;
  return dtype_ok && (b.device.is_cpu() || b.device.is_cuda());
}

// Whether this bucket runs fused; throws if fused(true) cannot be honoured.
inline bool use_fused(const std::optional<bool>& fused, const Bucket& b, const char* name) {
  const bool available = fused_available(b);
  if (fused.has_value() && *fused) {
    TORCH_CHECK(available, name, ": fused(true) but no fused kernel for ", b.device, " ", b.dtype,
                " (fused kernels: cpu or cuda, float/double/half/bfloat16); use fused(false) or leave it unset");
  }
  return fused.value_or(true) && available;
}

inline std::string kernel_line(const Bucket& b, bool fused) {
  return b.device.str() + " " + c10::toString(b.dtype) + ": " + (fused ? "fused" : "foreach");
}

// Checks shared by the constructors: floating parameters, one device per group.
inline void check_params(const std::vector<torch::optim::OptimizerParamGroup>& groups, const char* name) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(params[i].defined(), name, ": parameter ", i, " of group ", g, " is undefined");
      TORCH_CHECK(at::isFloatingType(params[i].scalar_type()), name, ": parameter ", i, " of group ", g, " has dtype ",
                  params[i].scalar_type(), "; optimizers need floating-point parameters");
      TORCH_CHECK(params[i].device() == params[0].device(), name, ": parameters of group ", g,
                  " are on different devices (", params[0].device(), " and ", params[i].device(), " at index ", i,
                  "); put each device's parameters in its own group");
    }
  }
}

inline void check_grad(const at::Tensor& p, size_t g, const char* name) {
  TORCH_CHECK(!p.grad().is_sparse(), name, " does not support sparse gradients (parameter in group ", g,
              "); use a dense embedding (sparse=false) or torch::optim::SGD");
}

// Moves loaded state to the parameter's device (checkpoints may come from elsewhere).
inline void to_param_device(at::Tensor& t, const at::Tensor& p) {
  if (t.defined() && t.device() != p.device()) t = t.to(p.device());
}

// found_inf / grad_scale for this device (one copy per device and step).
inline std::optional<at::Tensor> on_device(const std::optional<at::Tensor>& t, const c10::Device& d) {
  if (!t) return std::nullopt;
  return t->device() == d ? *t : t->to(d, /*non_blocking=*/true);
}

// Fallback path with a scaler: unscale, then skip on inf (the one host sync).
inline bool foreach_prepare_scaled(std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& grad_scale,
                                   const std::optional<at::Tensor>& found_inf) {
  if (found_inf && found_inf->item<float>() != 0.0f) return false;
  if (grad_scale) grads = at::_foreach_div(grads, *grad_scale);
  return true;
}

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
// Options torch::optim does not write (maximize, fused) keep their defaults.
inline void read_bool_if_present(torch::serialize::InputArchive& archive, const char* key, bool& out) {
  c10::IValue v;
  if (archive.try_read(key, v)) out = v.toBool();
}
}  // namespace detail

template <bool D>
void AdamOptionsT<D>::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  detail::read_bool_if_present(archive, "maximize", maximize_);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG_OPTIONAL(bool, fused);
}

// `step` is written as torch::optim::AdamParamState writes it (an integer; one
// host read per parameter at save time) and read in either form, so
// checkpoints move between perf::optim and torch::optim both ways.
inline void AdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  if (step().defined()) archive.write("step", c10::IValue(static_cast<int64_t>(step().item<double>())));
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
}

inline void AdamParamState::serialize(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("step", v)) {
    TORCH_CHECK(v.isInt() || v.isTensor() || v.isDouble(),
                "perf::optim::Adam: checkpoint entry \"step\" must be an integer or a tensor, got ", v.tagKind());
    step(v.isTensor() ? v.toTensor().detach().to(at::kFloat).reshape({})
                      : at::scalar_tensor(v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble(), at::kFloat));
  }
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, max_exp_avg_sq);
}

inline void SGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(fused);
}

inline void SGDOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  detail::read_bool_if_present(archive, "maximize", maximize_);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG_OPTIONAL(bool, fused);
}

inline void SGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
}

inline void SGDParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, momentum_buffer);
}

// --------------------------------------------------------------------------- FusedOptimizer

inline torch::Tensor FusedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  update(std::nullopt, std::nullopt);
  return loss;
}

inline void FusedOptimizer::step_scaled(const std::optional<torch::Tensor>& grad_scale,
                                        const torch::Tensor& found_inf) {
  at::NoGradGuard no_grad;
  update(grad_scale, found_inf);
}

namespace detail {
inline bool capturing_cuda_graph() {
#if PERF_WITH_CUDA
  if (!at::hasCUDA()) return false;
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}
}  // namespace detail

inline const torch::Tensor& FusedOptimizer::lr_tensor(size_t g, const c10::Device& device, double lr) {
  auto& slot = lr_tensors_[{g, device.str()}];
  if (!slot.value.defined()) {
    TORCH_CHECK(!detail::capturing_cuda_graph(),
                "perf::optim: the first step of an optimizer cannot be captured in a CUDA graph (its state and lr "
                "tensors must exist first); run one eager step (perf::TrainStep warms up for you)");
    slot.value = at::full({}, lr, at::device(device).dtype(at::kFloat));
    slot.host = lr;
  } else if (slot.host != lr && !detail::capturing_cuda_graph()) {
    slot.value.fill_(lr);  // outside capture only: a captured fill would freeze this value
    slot.host = lr;
  }
  return slot.value;
}

inline void FusedOptimizer::sync_lr() {
  at::NoGradGuard no_grad;
  for (auto& [key, slot] : lr_tensors_) {
    const double lr = param_groups_.at(key.first).options().get_lr();
    if (slot.host != lr) {
      slot.value.fill_(lr);
      slot.host = lr;
    }
  }
}

inline std::optional<torch::Tensor> FusedOptimizer::effective_found_inf(const std::optional<torch::Tensor>& found_inf,
                                                                        const c10::Device& device) {
  if (!skip_updates_) {
    if (!found_inf) return std::nullopt;
    // The fused kernels skip only when found_inf == 1 exactly; a sum over
    // several devices can be 2.
    return found_inf->clamp_max(1.0f);
  }
  auto& one = ones_[device.str()];
  if (!one.defined()) one = at::ones({}, at::device(device).dtype(at::kFloat));
  return one;
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
            detail::check_params(param_groups, detail::adam_name<D>());
            return param_groups;
          }(),
          std::make_unique<Options>(defaults)) {
  for (size_t g = 0; g < this->param_groups_.size(); ++g)
    detail::check_adam_options(static_cast<const Options&>(this->param_groups_[g].options()),
                               " in param group " + std::to_string(g));
}

template <bool D>
void AdamT<D>::update(const std::optional<torch::Tensor>& grad_scale, const std::optional<torch::Tensor>& found_inf) {
  const char* name = detail::adam_name<D>();
  this->kernels_.clear();
  for (size_t g = 0; g < this->param_groups_.size(); ++g) {
    auto& group = this->param_groups_[g];
    const auto& o = static_cast<const Options&>(group.options());
    detail::check_adam_options(o, " in param group " + std::to_string(g));
    std::vector<detail::Bucket> buckets;
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
      if (o.amsgrad() && !s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
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
    const auto [beta1, beta2] = o.betas();
    for (auto& b : buckets) {
      const bool fused = detail::use_fused(o.fused(), b, name);
      this->kernels_.push_back(detail::kernel_line(b, fused));
      const auto gs = detail::on_device(grad_scale, b.device);
      const auto fi = this->effective_found_inf(detail::on_device(found_inf, b.device), b.device);
      if (fused) {
        at::_foreach_add_(b.steps, 1);
        if (b.device.is_cuda()) {  // lr as a device tensor: replayed graphs see the scheduler's value
          const auto& lr = this->lr_tensor(g, b.device, o.lr());
          if constexpr (D) {
            at::_fused_adamw_(b.params, b.grads, b.a, b.b, b.c, b.steps, lr, beta1, beta2, o.weight_decay(), o.eps(),
                              o.amsgrad(), o.maximize(), gs, fi);
          } else {
            at::_fused_adam_(b.params, b.grads, b.a, b.b, b.c, b.steps, lr, beta1, beta2, o.weight_decay(), o.eps(),
                             o.amsgrad(), o.maximize(), gs, fi);
          }
        } else if constexpr (D) {
          at::_fused_adamw_(b.params, b.grads, b.a, b.b, b.c, b.steps, o.lr(), beta1, beta2, o.weight_decay(), o.eps(),
                            o.amsgrad(), o.maximize(), gs, fi);
        } else {
          at::_fused_adam_(b.params, b.grads, b.a, b.b, b.c, b.steps, o.lr(), beta1, beta2, o.weight_decay(), o.eps(),
                           o.amsgrad(), o.maximize(), gs, fi);
        }
        // The kernel leaves params alone on inf; undo the step count too (as Python does).
        if (fi) at::_foreach_sub_(b.steps, std::vector<at::Tensor>(b.steps.size(), *fi));
        continue;
      }
      // _foreach_ path: Python's capturable multi-tensor Adam (no host sync).
      if (this->skip_updates_ || !detail::foreach_prepare_scaled(b.grads, gs, fi)) continue;
      at::_foreach_add_(b.steps, 1);
      auto grads = o.maximize() ? at::_foreach_neg(b.grads) : b.grads;
      if (o.weight_decay() != 0) {
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

// --------------------------------------------------------------------------- SGD

namespace detail {
inline void check_sgd_options(const SGDOptions& o, const std::string& where) {
  const char* name = "perf::optim::SGD";
  TORCH_CHECK(o.lr() >= 0, name, ": invalid lr ", o.lr(), where, " (must be >= 0)");
  TORCH_CHECK(o.momentum() >= 0, name, ": invalid momentum ", o.momentum(), where, " (must be >= 0)");
  TORCH_CHECK(o.weight_decay() >= 0, name, ": invalid weight_decay ", o.weight_decay(), where, " (must be >= 0)");
  TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0), name,
              ": nesterov requires momentum > 0 and dampening == 0", where, " (got momentum ", o.momentum(),
              ", dampening ", o.dampening(), ")");
}
}  // namespace detail

inline SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults)
    : SerializableFusedOptimizer<SGDParamState, SGDOptions>(
          [&] {
            detail::check_sgd_options(defaults, "");
            detail::check_params(param_groups, "perf::optim::SGD");
            return param_groups;
          }(),
          std::make_unique<SGDOptions>(defaults)) {
  for (size_t g = 0; g < param_groups_.size(); ++g)
    detail::check_sgd_options(static_cast<const SGDOptions&>(param_groups_[g].options()),
                              " in param group " + std::to_string(g));
}

inline void SGD::update(const std::optional<torch::Tensor>& grad_scale, const std::optional<torch::Tensor>& found_inf) {
  const char* name = "perf::optim::SGD";
  kernels_.clear();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& group = param_groups_[g];
    const auto& o = static_cast<const SGDOptions&>(group.options());
    detail::check_sgd_options(o, " in param group " + std::to_string(g));
    const bool momentum = o.momentum() != 0;
    std::vector<detail::Bucket> buckets;
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      detail::check_grad(p, g, name);
      SGDParamState* s = nullptr;
      if (momentum) {
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) slot = std::make_unique<SGDParamState>();
        s = static_cast<SGDParamState*>(slot.get());
        detail::to_param_device(s->momentum_buffer(), p);
      }
      const bool first = momentum && !s->momentum_buffer().defined();
      auto& b = detail::bucket_for(buckets, p, first);
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      if (momentum) {
        // Zeros, not empty: a first step skipped on inf (found_inf) returns before
        // the kernel writes the buffer, and must leave it as if never called.
        if (first) s->momentum_buffer(at::zeros_like(p.grad()));
        b.a.push_back(s->momentum_buffer());
      }
    }
    for (auto& b : buckets) {
      const bool fused = detail::use_fused(o.fused(), b, name);
      kernels_.push_back(detail::kernel_line(b, fused));
      const auto gs = detail::on_device(grad_scale, b.device);
      const auto fi = effective_found_inf(detail::on_device(found_inf, b.device), b.device);
      if (fused) {
        if (b.device.is_cuda()) {
          at::_fused_sgd_(b.params, b.grads, b.a, o.weight_decay(), o.momentum(), lr_tensor(g, b.device, o.lr()),
                          o.dampening(), o.nesterov(), o.maximize(), b.first, gs, fi);
        } else {
          at::_fused_sgd_(b.params, b.grads, b.a, o.weight_decay(), o.momentum(), o.lr(), o.dampening(), o.nesterov(),
                          o.maximize(), b.first, gs, fi);
        }
        continue;
      }
      // _foreach_ path: Python's multi-tensor SGD.
      if (skip_updates_ || !detail::foreach_prepare_scaled(b.grads, gs, fi)) continue;
      auto grads = o.maximize() ? at::_foreach_neg(b.grads) : b.grads;
      if (o.weight_decay() != 0) grads = at::_foreach_add(grads, b.params, o.weight_decay());
      if (momentum) {
        if (b.first) {
          for (size_t i = 0; i < b.a.size(); ++i) b.a[i].copy_(grads[i]);
        } else {
          at::_foreach_mul_(b.a, o.momentum());
          at::_foreach_add_(b.a, grads, 1 - o.dampening());
        }
        grads = o.nesterov() ? at::_foreach_add(grads, b.a, o.momentum()) : b.a;
      }
      at::_foreach_add_(b.params, grads, -o.lr());
    }
  }
}

}  // namespace perf::optim

namespace perf {

/// Clips the gradient norm of `parameters` in place, like
/// torch.nn.utils.clip_grad_norm_ (foreach implementation), and returns the
/// total norm as a 0-dim float tensor on the first gradient's device. No host
/// sync (LibTorch's torch::nn::utils::clip_grad_norm_ returns a double, which
/// syncs), so it runs inside perf::TrainStep's captured step and after
/// GradScaler::unscale_. norm_type: p > 0 or infinity. Parameters without a
/// gradient are ignored; none at all returns 0.
torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double norm_type = 2.0);

inline torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double norm_type) {
  TORCH_CHECK(max_norm >= 0, "perf::clip_grad_norm_: max_norm must be >= 0, got ", max_norm);
  TORCH_CHECK(norm_type > 0, "perf::clip_grad_norm_: norm_type must be > 0 (or infinity), got ", norm_type);
  at::NoGradGuard no_grad;
  std::map<std::pair<std::string, c10::ScalarType>, std::vector<at::Tensor>> groups;
  std::optional<c10::Device> first;
  for (const auto& p : parameters) {
    if (!p.defined() || !p.grad().defined()) continue;
    const auto& g = p.grad();
    TORCH_CHECK(!g.is_sparse(), "perf::clip_grad_norm_: sparse gradients are not supported");
    if (!first) first = g.device();
    groups[{g.device().str(), g.scalar_type()}].push_back(g);
  }
  if (!first) return at::zeros({}, at::kFloat);
  const bool inf = std::isinf(norm_type);
  std::vector<at::Tensor> norms;
  for (auto& [key, grads] : groups) {
    for (auto& n : at::_foreach_norm(grads, norm_type, at::kFloat))
      norms.push_back(n.to(*first, /*non_blocking=*/true));
  }
  const auto stacked = at::stack(norms);
  const auto total = inf ? stacked.max() : at::linalg_vector_norm(stacked, norm_type);
  const auto coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
  for (auto& [key, grads] : groups) {
    const auto c = coef.to(grads.front().device(), /*non_blocking=*/true);
    at::_foreach_mul_(grads, c);
  }
  return total;
}

}  // namespace perf
