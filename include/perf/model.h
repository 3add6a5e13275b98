// perf/model.h — model-level helpers: a fast-forward wrapper, inference scope,
// Conv-BN fusion and activation checkpointing.
//
//   auto model = perf::optimize(Net(), perf::ModelOptions().device(torch::kCUDA));  // channels-last + autocast
//   auto y = model(x);                  // x moved to the device, NHWC, forward under autocast
//   auto z = model.infer(x);            // eval() + c10::InferenceMode, training mode restored after
//   model->parameters();                // the underlying module, unchanged
//
//   torch::nn::Sequential fast = perf::fuse_conv_bn(seq);   // every Conv2d -> BatchNorm2d pair, for inference
//   auto h = perf::checkpoint([&](const std::vector<torch::Tensor>& in) { return block->forward(in[0]); }, {x});
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <perf/amp.h>
#include <perf/config.h>
#include <perf/detail/rng.h>
#include <perf/memory_format.h>
#include <perf/module.h>
#include <torch/arg.h>
#include <torch/autograd.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace perf {

struct ModelOptions {
  /// Where the module and its inputs go. Unset: where the module's parameters are.
  TORCH_ARG(std::optional<c10::Device>, device);
  /// Convert 4-D/5-D parameters, buffers and inputs to channels-last.
  TORCH_ARG(bool, channels_last) = true;
  /// Run forward under perf::Autocast with its defaults (CUDA: on; CPU: on only
  /// where the CPU computes bf16 natively, see Autocast::default_enabled).
  TORCH_ARG(bool, autocast) = true;
  /// Autocast dtype. Unset: perf::Autocast's default for the device.
  TORCH_ARG(std::optional<c10::ScalarType>, autocast_dtype);
  /// Cast floating-point tensor outputs back to float32.
  TORCH_ARG(bool, float_outputs) = false;
};

namespace detail {
template <typename T>
struct is_shared_ptr : std::false_type {};
template <typename T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};
template <typename T>
constexpr bool is_shared_ptr_v = is_shared_ptr<T>::value;
}  // namespace detail

/// eval() + c10::InferenceMode for a scope; restores the training mode.
/// Takes a plain module, a module holder or a std::shared_ptr to a module.
class InferenceScope {
 public:
  explicit InferenceScope(ModuleRef module) : module_(std::move(module)), was_training_(module_->is_training()) {
    module_->eval();
  }
  ~InferenceScope() { module_->train(was_training_); }
  InferenceScope(const InferenceScope&) = delete;
  InferenceScope& operator=(const InferenceScope&) = delete;

 private:
  ModuleRef module_;
  bool was_training_;
  c10::InferenceMode inference_;
};

/// A module behind the options of ModelOptions. `Stored` is the holder type
/// (e.g. `Net` from TORCH_MODULE, `torch::nn::Sequential`) or a
/// std::shared_ptr to a plain module. The module stays reachable: `->`, module().
template <typename Stored>
class Optimized {
 public:
  using ModuleHolder = Stored;
  Optimized(Stored module, const ModelOptions& options);

  template <typename... Args>
  auto forward(Args&&... args);
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
  /// forward in eval mode under c10::InferenceMode.
  template <typename... Args>
  auto infer(Args&&... args) {
    InferenceScope scope(*module_);
    return forward(std::forward<Args>(args)...);
  }

  ModuleHolder& module() noexcept { return module_; }
  auto* operator->() noexcept { return module_.get(); }
  const ModelOptions& options() const noexcept { return options_; }
  c10::Device device() const noexcept { return device_; }

 private:
  at::Tensor prepare(const at::Tensor& t) const;
  template <typename T>
  decltype(auto) prepare_arg(T&& x) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return prepare(x);
    } else {
      return std::forward<T>(x);
    }
  }

  ModuleHolder module_;
  ModelOptions options_;
  c10::Device device_ = c10::Device(c10::kCPU);
};

/// Moves `module` to the device, converts it to channels-last, and wraps its
/// forward with input conversion and autocast, as ModelOptions says. `module`:
/// a module holder (kept by value, sharing the module), a std::shared_ptr to a
/// module, a plain module passed as a temporary (moved in) or by reference
/// (not owned: it must outlive the result).
template <typename M>
auto optimize(M&& module, const ModelOptions& options = ModelOptions()) {
  using D = std::decay_t<M>;
  if constexpr (std::is_base_of_v<torch::detail::ModuleHolderIndicator, D>) {
    return Optimized<D>(std::forward<M>(module), options);
  } else if constexpr (detail::is_shared_ptr_v<D>) {
    static_assert(std::is_base_of_v<torch::nn::Module, typename D::element_type>,
                  "perf::optimize: a std::shared_ptr to a torch::nn::Module");
    return Optimized<D>(std::forward<M>(module), options);
  } else {
    static_assert(std::is_base_of_v<torch::nn::Module, D>, "perf::optimize: needs a torch::nn::Module");
    if constexpr (std::is_lvalue_reference_v<M>) {
      return Optimized<std::shared_ptr<D>>(std::shared_ptr<D>(std::shared_ptr<D>(), &module), options);  // not owned
    } else {
      return Optimized<std::shared_ptr<D>>(std::make_shared<D>(std::move(module)), options);
    }
  }
}

/// A Conv2d computing conv followed by bn (both in eval mode) in one
/// convolution, as torch.nn.utils.fuse_conv_bn_eval does.
torch::nn::Conv2d fuse_conv_bn(const torch::nn::Conv2d& conv, const torch::nn::BatchNorm2d& bn);

/// A new Sequential (eval mode) with every Conv2d directly followed by a
/// BatchNorm2d fused into one Conv2d. The input
/// Sequential must be in eval mode and is left unchanged; other modules are shared.
torch::nn::Sequential fuse_conv_bn(const torch::nn::Sequential& seq);

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

/// Activation checkpointing: runs fn(inputs) without keeping its activations,
/// then recomputes it during backward, with the forward's RNG state (dropout
/// matches) and autocast state. Gradients equal the non-checkpointed ones.
at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs, bool preserve_rng_state = true);

// ---------------------------------------------------------------------------

template <typename M>
Optimized<M>::Optimized(M module, const ModelOptions& options) : module_(std::move(module)), options_(options) {
  if constexpr (detail::is_shared_ptr_v<M>) {
    TORCH_CHECK(module_ != nullptr, "perf::optimize: null std::shared_ptr to a module");
  } else {
    TORCH_CHECK(!module_.is_empty(), "perf::optimize: the module holder is empty");
  }
  if (options_.device()) {
    device_ = *options_.device();
    module_->to(device_);
  } else {
    const auto params = module_->parameters();
    if (!params.empty()) device_ = params.front().device();
  }
  if (options_.autocast()) Autocast::resolve_dtype(device_, options_.autocast_dtype());  // fail at construction
  if (options_.channels_last()) to_channels_last(*module_);
}

template <typename M>
at::Tensor Optimized<M>::prepare(const at::Tensor& t) const {
  if (!t.defined()) return t;
  at::Tensor out = t.device() == device_ ? t : t.to(device_, /*non_blocking=*/true);
  if (options_.channels_last() && (out.dim() == 4 || out.dim() == 5)) out = channels_last(out);
  return out;
}

template <typename M>
template <typename... Args>
auto Optimized<M>::forward(Args&&... args) {
  std::optional<Autocast> ac;
  if (options_.autocast()) ac.emplace(device_, options_.autocast_dtype());
  auto run = [&] { return module_->forward(prepare_arg(std::forward<Args>(args))...); };
  decltype(run()) out;
  if (!options_.channels_last()) {
    out = run();
  } else {
    try {
      out = run();
    } catch (c10::Error& e) {
      // .view() after a convolution needs NCHW-contiguous activations.
      if (std::string(e.what_without_backtrace()).find("view size is not compatible") != std::string::npos) {
        e.add_context(
            "perf::optimize: the model runs in channels-last, where activations are not NCHW-contiguous, and its "
            "forward calls .view(); use .reshape(...) or .flatten(1) there instead, or "
            "perf::ModelOptions().channels_last(false)");
      }
      throw;
    }
  }
  if constexpr (std::is_same_v<std::decay_t<decltype(out)>, at::Tensor>) {
    if (options_.float_outputs() && out.defined() && at::isFloatingType(out.scalar_type()) &&
        out.scalar_type() != at::kFloat) {
      out = out.to(at::kFloat);
    }
  }
  return out;
}

inline torch::nn::Conv2d fuse_conv_bn(const torch::nn::Conv2d& conv, const torch::nn::BatchNorm2d& bn) {
  TORCH_CHECK(!conv->is_training() && !bn->is_training(),
              "perf::fuse_conv_bn: fusion is for inference; call eval() on the convolution and the batch norm first");
  TORCH_CHECK(bn->options.track_running_stats() && bn->running_mean.defined(),
              "perf::fuse_conv_bn: the BatchNorm2d has no running statistics (track_running_stats(false))");
  TORCH_CHECK(conv->options.out_channels() == bn->options.num_features(), "perf::fuse_conv_bn: Conv2d has ",
              conv->options.out_channels(), " output channels but BatchNorm2d has ", bn->options.num_features(),
              " features");
  at::NoGradGuard no_grad;
  const auto& w = conv->weight;
  const auto& mean = bn->running_mean;
  const auto b = conv->bias.defined() ? conv->bias : at::zeros_like(mean);
  const auto gamma = bn->options.affine() ? bn->weight : at::ones_like(mean);
  const auto beta = bn->options.affine() ? bn->bias : at::zeros_like(mean);
  const auto scale = gamma * at::rsqrt(bn->running_var + bn->options.eps());
  const auto& o = conv->options;
  torch::nn::Conv2d fused(torch::nn::Conv2dOptions(o.in_channels(), o.out_channels(), o.kernel_size())
                              .stride(o.stride())
                              .padding(o.padding())
                              .dilation(o.dilation())
                              .groups(o.groups())
                              .padding_mode(o.padding_mode())
                              .bias(true));
  fused->to(w.device(), w.scalar_type());
  fused->weight.set_data((w * scale.reshape({-1, 1, 1, 1})).to(w.scalar_type()));
  fused->bias.set_data(((b - mean) * scale + beta).to(b.scalar_type()));
  fused->eval();
  return fused;
}

inline torch::nn::Sequential fuse_conv_bn(const torch::nn::Sequential& seq) {
  TORCH_CHECK(!seq->is_training(), "perf::fuse_conv_bn: fusion is for inference; call eval() on the Sequential first");
  torch::nn::Sequential out;
  const auto names = seq->named_children().keys();
  for (size_t i = 0; i < seq->size(); ++i) {
    const auto ptr = seq->ptr(i);
    if (auto conv = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(ptr); conv && i + 1 < seq->size()) {
      if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(seq->ptr(i + 1))) {
        out->push_back(names[i],
                       torch::nn::AnyModule(fuse_conv_bn(torch::nn::Conv2d(conv), torch::nn::BatchNorm2d(bn))));
        ++i;
        continue;
      }
    }
    out->push_back(names[i], *(seq->begin() + static_cast<std::ptrdiff_t>(i)));
  }
  out->eval();
  return out;
}

namespace detail {

// The CPU and CUDA autocast settings of this thread.
struct AutocastState {
  bool cpu = false, cuda = false;
  c10::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState current() {
    return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)};
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

// Applies an autocast state for a scope, then puts the previous one back.
class AutocastStateGuard {
 public:
  explicit AutocastStateGuard(const AutocastState& s) : prev_(AutocastState::current()) { s.apply(); }
  ~AutocastStateGuard() { prev_.apply(); }
  AutocastStateGuard(const AutocastStateGuard&) = delete;
  AutocastStateGuard& operator=(const AutocastStateGuard&) = delete;

 private:
  AutocastState prev_;
};

struct CheckpointState : torch::CustomClassHolder {
  CheckpointFn fn;
  bool preserve_rng = true;
  RngStates rng;
  AutocastState autocast;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CheckpointState> st, at::TensorList input_list) {
    const std::vector<at::Tensor> inputs = input_list.vec();
    if (st->preserve_rng) st->rng = current_rng(inputs);
    st->autocast = AutocastState::current();
    at::Tensor out;
    {
      at::NoGradGuard no_grad;
      out = st->fn(inputs);
    }
    ctx->save_for_backward(inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto st = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (const auto& x : saved) inputs.push_back(x.defined() ? x.detach().requires_grad_(x.requires_grad()) : x);
    at::Tensor out;
    {
      std::optional<RngFork> rng;
      if (st->preserve_rng) rng.emplace(st->rng);
      at::AutoGradMode grad_on(true);
      AutocastStateGuard autocast(st->autocast);  // recompute as the forward ran
      out = st->fn(inputs);
    }
    if (out.requires_grad() && grad_outputs[0].defined()) torch::autograd::backward({out}, {grad_outputs[0]});
    torch::autograd::variable_list grads = {at::Tensor()};  // for the state argument
    for (const auto& x : inputs) grads.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    return grads;
  }
};

}  // namespace detail

inline at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs, bool preserve_rng_state) {
  TORCH_CHECK(fn, "perf::checkpoint: empty function");
  auto st = c10::make_intrusive<detail::CheckpointState>();
  st->fn = fn;
  st->preserve_rng = preserve_rng_state;
  // As a TensorList: LibTorch's custom Function tracks the tensors of a TensorList, not of a std::vector.
  return detail::CheckpointFunction::apply(st, at::TensorList(inputs))[0];
}

}  // namespace perf
