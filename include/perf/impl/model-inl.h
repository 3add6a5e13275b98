// perf/impl/model-inl.h — the out-of-line definitions of perf/model.h.
// Included by perf/model.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <ATen/core/ivalue.h>
#include <perf/detail/rng.h>
#include <perf/model.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include <iomanip>

namespace perf {

namespace detail {

// The CPU and CUDA autocast settings of this thread, and its weight cache's.
struct AutocastState {
  bool cpu = false, cuda = false;
  c10::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  bool cache = true;
  static AutocastState current() {
    return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA),
            at::autocast::is_autocast_cache_enabled()};
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
    at::autocast::set_autocast_cache_enabled(cache);
  }
};

// An autocast region with a given state, as torch.autocast opens one: on
// leaving the outermost region the weight cache is emptied. Its entries are
// keyed on the fp32 weight and blind to in-place updates, so casts kept past
// the region would feed the next forward the weights before optimizer.step().
class AutocastStateGuard {
 public:
  explicit AutocastStateGuard(const AutocastState& s) : prev_(AutocastState::current()) {
    s.apply();
    at::autocast::increment_nesting();
  }
  ~AutocastStateGuard() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    prev_.apply();
  }
  AutocastStateGuard(const AutocastStateGuard&) = delete;
  AutocastStateGuard& operator=(const AutocastStateGuard&) = delete;

 private:
  AutocastState prev_;
};

struct CheckpointState : torch::CustomClassHolder {
  CheckpointFn fn;
  bool preserve_rng = true;
  size_t num_inputs = 0;        // fn's inputs, the first of the Function's tensors
  bool recording_leaf = false;  // the Function's last tensor only makes it record (perf::checkpoint)
  RngStates rng;
  AutocastState autocast;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const c10::intrusive_ptr<CheckpointState>& st,
                                                at::TensorList input_list) {
    const std::vector<at::Tensor> inputs(input_list.begin(),
                                         input_list.begin() + static_cast<std::ptrdiff_t>(st->num_inputs));
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
    // The recomputation runs its own backward, which accumulates into .grad()
    // where grad() or backward(inputs) would not look (Python's reentrant
    // checkpoint refuses them the same way).
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "perf::checkpoint is incompatible with torch::autograd::grad() and with backward() given `inputs`: "
                "its backward recomputes the block and accumulates the gradients into .grad() (reentrant, like "
                "Python's checkpoint(use_reentrant=True)); call backward() without `inputs` and read .grad()");
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
    if (st->recording_leaf) grads.emplace_back();
    return grads;
  }
};

PERF_INLINE void relayout(torch::nn::Module& module, bool channels_last) {
  if (channels_last) {
    convert_to_channels_last(module);
    return;
  }
  at::NoGradGuard no_grad;
  auto convert = [](at::Tensor& t) {
    if (t.defined() && (t.dim() == 4 || t.dim() == 5) && !t.is_contiguous()) t.set_data(t.contiguous());
  };
  for (auto& p : module.parameters()) convert(p);
  for (auto& b : module.buffers()) convert(b);
}

PERF_INLINE size_t fastest(const std::vector<double>& ms, size_t n) {
  TORCH_CHECK(n >= 1 && n <= ms.size(), "perf::optimize: fastest of ", n, " of ", ms.size(), " times");
  size_t best = 0;
  for (size_t k = 1; k < n; ++k)
    if (ms[k] < ms[best] * 0.98) best = k;
  return best;
}

PERF_INLINE bool has_image_tensors(torch::nn::Module& module, const at::Tensor& example) {
  if (example.dim() == 4 || example.dim() == 5) return true;
  for (const auto& p : module.parameters())
    if (p.dim() == 4 || p.dim() == 5) return true;
  return false;
}

}  // namespace detail

PERF_INLINE std::string Recipe::name() const {
  std::string n = channels_last() ? "channels-last" : "NCHW";
  n += autocast() ? std::string(" + ") +
                        (*autocast() == at::kBFloat16 ? "bf16"
                         : *autocast() == at::kHalf   ? "fp16"
                                                      : c10::toString(*autocast())) +
                        " autocast"
                  : " fp32";
  if (graph()) n += " + CUDA graph";
  return n;
}

PERF_INLINE std::string RecipeChoice::to_string() const {
  std::ostringstream s;
  s << *this;
  return s.str();
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const RecipeChoice& c) {
  os << "perf::optimize: " << c.recipe.name() << " (" << c.reason << ")\n";
  if (c.measured_ms.empty()) return os;
  const double base = c.measured_ms.front().second;
  for (const auto& [recipe, ms] : c.measured_ms) {
    os << "  " << (recipe == c.recipe ? "* " : "  ") << std::left << std::setw(44) << recipe.name() << std::right
       << std::fixed << std::setprecision(3) << std::setw(9) << ms << " ms  " << std::setprecision(2) << std::setw(5)
       << base / ms << "x\n";
  }
  // First calls: lazy set-up and, on CUDA in cuDNN's benchmark mode, its autotuning (RecipeChoice).
  os << "  decided in " << std::fixed << std::setprecision(2) << c.seconds << " s (first calls " << c.first_call_seconds
     << " s, ";
  if (c.capture_seconds > 0) os << "CUDA graph captures " << c.capture_seconds << " s, ";
  os << "measured calls " << std::max(0.0, c.seconds - c.first_call_seconds - c.capture_seconds) << " s)\n";
  return os;
}

PERF_INLINE torch::nn::Conv2d fuse_conv_bn(const torch::nn::Conv2d& conv, const torch::nn::BatchNorm2d& bn) {
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

PERF_INLINE torch::nn::Sequential fuse_conv_bn(const torch::nn::Sequential& seq) {
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

PERF_INLINE at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                                  bool preserve_rng_state) {
  TORCH_CHECK(fn, "perf::checkpoint: empty function");
  auto st = c10::make_intrusive<detail::CheckpointState>();
  st->fn = fn;
  st->preserve_rng = preserve_rng_state;
  // A custom Function records itself only when an input requires grad: with
  // none (the first block sees the data), fn's parameters would get no
  // gradients. A 0-dim leaf that requires grad makes it record; its gradient
  // is never computed.
  const bool any =
      std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  st->num_inputs = inputs.size();
  std::vector<at::Tensor> list = inputs;
  st->recording_leaf = !any && at::GradMode::is_enabled();
  if (st->recording_leaf) list.push_back(at::zeros({}).requires_grad_(true));
  // As a TensorList: LibTorch's custom Function tracks the tensors of a TensorList, not of a std::vector.
  return detail::CheckpointFunction::apply(st, at::TensorList(list))[0];
}

}  // namespace perf
