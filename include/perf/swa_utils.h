// perf/swa_utils.h — Python's torch.optim.swa_utils: AveragedModel (SWA and EMA of the weights), SWALR, update_bn.
//
//   Net model;                                               // TORCH_MODULE(Net), a torch::nn::Cloneable<NetImpl>
//   perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).flat(true));
//   perf::optim::AveragedModel ema(model, perf::optim::AveragedModelOptions()
//                                             .multi_avg_fn(perf::optim::get_ema_multi_avg_fn(0.999))
//                                             .use_buffers(true));
//   for (...) { ...; opt.step(); ema->update_parameters(model); }
//   auto y = ema->forward(x);                                // or ema->module(): the averaged Net
//   perf::save(perf::state_dict(ema), "ema.pt");            // Python: AveragedModel(model).load_state_dict(...)
//
//   perf::optim::AveragedModel swa(model);                   // SWA: equal weights (Python's default)
//   perf::optim::SWALR swa_scheduler(opt, /*swa_lr=*/0.05);
//   ... swa->update_parameters(model); swa_scheduler.step(); ...
//   perf::optim::update_bn(*loader, swa);                   // BatchNorm statistics for the averaged weights
//
// Python's names, arguments, defaults, state_dict keys and numbers (the tests compare them with Python's
// AveragedModel step by step). What differs, for speed: an update never waits for the device (Python's
// reads n_averaged on the host or copies it to the device, which synchronises the stream), the built-in
// averages are one lerp per (device, dtype) on every device (Python's default on the CPU is a per-tensor
// formula: equal within float rounding), and where the model's tensors lie packed in one buffer
// (perf::optim's flat(true), cuDNN's flat LSTM weights) the averaged copy takes the same layout and each
// such buffer is one lerp over its span.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/lr_scheduler.h>
#include <perf/module.h>
#include <torch/arg.h>
#include <torch/data/example.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace perf::optim {

/// Python's `avg_fn`: the new average of one tensor, from (averaged, current, num_averaged).
using AvgFn =
    std::function<at::Tensor(const at::Tensor& averaged, const at::Tensor& current, const at::Tensor& num_averaged)>;

/// Python's `multi_avg_fn`: updates the averaged tensors of one (device, dtype) in place. A custom one is any
/// function of that signature; get_ema_multi_avg_fn() and get_swa_multi_avg_fn() give Python's two, which
/// AveragedModel runs on its fast paths.
class MultiAvgFn {
 public:
  using Fn = std::function<void(const std::vector<at::Tensor>& averaged, const std::vector<at::Tensor>& current,
                                const at::Tensor& num_averaged)>;
  MultiAvgFn() = default;
  /// A custom function: anything callable as Fn (implicit, as Python takes any callable).
  template <typename F,
            typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, MultiAvgFn> && std::is_constructible_v<Fn, F>>>
  MultiAvgFn(F&& fn) : fn_(std::forward<F>(fn)) {}  // NOLINT(google-explicit-constructor)
  explicit operator bool() const { return kind_ != Kind::custom || static_cast<bool>(fn_); }
  PERF_INLINE void operator()(const std::vector<at::Tensor>& averaged, const std::vector<at::Tensor>& current,
                              const at::Tensor& num_averaged) const;
  /// get_ema_multi_avg_fn's decay; none for the others.
  std::optional<double> ema_decay() const { return kind_ == Kind::ema ? std::optional<double>(decay_) : std::nullopt; }
  bool is_swa() const { return kind_ == Kind::swa; }

 private:
  enum class Kind { custom, ema, swa };
  friend MultiAvgFn get_ema_multi_avg_fn(double decay);  // PERF_INLINE in their declarations below
  friend MultiAvgFn get_swa_multi_avg_fn();
  Kind kind_ = Kind::custom;
  double decay_ = 0;
  Fn fn_;
};

/// Python's get_ema_multi_avg_fn: averaged = lerp(averaged, current, 1 - decay); decay in [0, 1].
PERF_INLINE MultiAvgFn get_ema_multi_avg_fn(double decay = 0.999);
/// Python's get_swa_multi_avg_fn: averaged = lerp(averaged, current, 1 / (num_averaged + 1)).
PERF_INLINE MultiAvgFn get_swa_multi_avg_fn();
/// Python's get_ema_avg_fn: decay * averaged + (1 - decay) * current.
PERF_INLINE AvgFn get_ema_avg_fn(double decay = 0.999);
/// Python's get_swa_avg_fn: averaged + (current - averaged) / (num_averaged + 1).
PERF_INLINE AvgFn get_swa_avg_fn();

/// Python's AveragedModel arguments after the model.
struct AveragedModelOptions {
  /// Where the averaged copy lives (Python's `device`); unset: where the model's tensors are.
  TORCH_ARG(std::optional<c10::Device>, device) = std::nullopt;
  /// A per-tensor average (Python's `avg_fn`); at most one of avg_fn and multi_avg_fn.
  TORCH_ARG(AvgFn, avg_fn) = nullptr;
  /// An in-place average over each (device, dtype) (Python's `multi_avg_fn`); neither set: SWA.
  TORCH_ARG(MultiAvgFn, multi_avg_fn) = {};
  /// Average the buffers (BatchNorm statistics) too; false: copy them from the model at each update.
  TORCH_ARG(bool, use_buffers) = false;
};

namespace detail {

/// What AveragedModelImpl<M> shares whatever the model's type: a torch::nn::Module with Python's state_dict
/// keys ("n_averaged", "module.<name>").
class AveragedModelBase : public torch::nn::Module {
 public:
  /// Python's update_parameters(model): the first call copies the model's weights, each later one averages
  /// them in; the buffers are averaged (use_buffers) or copied. `model` must have the averaged copy's
  /// parameters (and buffers) in the same order and shapes, checked before anything changes; where a dtype
  /// differs (an fp32 average of a bf16 model), the model's values are cast to the copy's.
  PERF_INLINE void update_parameters(ModuleRef model);
  /// Python's n_averaged, as a number: the models averaged so far (no device sync, except once after the
  /// n_averaged buffer was loaded or written from outside).
  PERF_INLINE int64_t n_averaged() const;
  const AveragedModelOptions& options() const { return options_; }
  /// How many spans the last update averaged with one lerp each (the packed fast path): one per buffer
  /// of the model's that holds two or more of the averaged tensors (perf::optim's flat(true) buffers).
  int64_t packed_spans() const { return packed_spans_; }

 protected:
  PERF_INLINE AveragedModelBase(const std::shared_ptr<torch::nn::Module>& copy,
                                const std::shared_ptr<torch::nn::Module>& model, bool copy_values,
                                AveragedModelOptions options);
  const std::shared_ptr<torch::nn::Module>& averaged_module() const { return copy_; }

 private:
  PERF_INLINE void average(const std::vector<at::Tensor>& mine, const std::vector<at::Tensor>& current, int64_t n);
  PERF_INLINE std::vector<std::size_t> lerp_packed(const std::vector<at::Tensor>& mine,
                                                   const std::vector<at::Tensor>& current, double weight);
  std::shared_ptr<torch::nn::Module> copy_;
  AveragedModelOptions options_;
  at::Tensor n_averaged_;
  mutable int64_t n_host_ = 0;  // n_averaged_'s value, while its version is n_version_
  mutable int64_t n_version_ = -1;
  mutable const void* n_storage_ = nullptr;
  int64_t packed_spans_ = 0;
};

template <typename M>
struct ModuleOf {  // a TORCH_MODULE holder (Net)
  using Impl = typename M::ContainedType;
  static std::shared_ptr<Impl> ptr(const M& m) { return m.ptr(); }
  static M wrap(std::shared_ptr<Impl> p) { return M(std::move(p)); }
};
template <typename I>
struct ModuleOf<std::shared_ptr<I>> {  // or a std::shared_ptr<NetImpl>
  using Impl = I;
  static std::shared_ptr<Impl> ptr(const std::shared_ptr<I>& m) { return m; }
  static std::shared_ptr<I> wrap(std::shared_ptr<Impl> p) { return p; }
};

PERF_INLINE std::shared_ptr<torch::nn::Module> clone_module(const torch::nn::Module& model,
                                                            const std::optional<c10::Device>& device);

}  // namespace detail

/// Python's AveragedModel: an averaged copy of `model` (a TORCH_MODULE holder such as `Net` or
/// `torch::nn::Sequential`, or a std::shared_ptr<NetImpl>). Use it through AveragedModel<M>, its holder.
template <typename ModuleType>
class AveragedModelImpl : public detail::AveragedModelBase {
  using Of = detail::ModuleOf<ModuleType>;

 public:
  /// Python's deepcopy of the model: its clone(), which needs NetImpl to derive from
  /// torch::nn::Cloneable<NetImpl> (otherwise use the constructor below).
  explicit AveragedModelImpl(const ModuleType& model, AveragedModelOptions options = {})
      : AveragedModelBase(cloned(model, options), Of::ptr(model), false, options) {
    typed_ = std::dynamic_pointer_cast<typename Of::Impl>(averaged_module());
  }
  /// For a module that is not Cloneable: `copy` is a second instance of the model's class (Net(...) with the
  /// same arguments); the model's weights and buffers are copied into it.
  AveragedModelImpl(const ModuleType& model, const ModuleType& copy, AveragedModelOptions options = {})
      : AveragedModelBase(checked(Of::ptr(model), Of::ptr(copy)), Of::ptr(model), true, options),
        typed_(Of::ptr(copy)) {}

  /// Python's `averaged.module`: the averaged copy.
  ModuleType module() const { return Of::wrap(typed_); }
  /// Python's forward: the averaged copy's.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    return typed_->forward(std::forward<Args>(args)...);
  }

 private:
  static std::shared_ptr<torch::nn::Module> cloned(const ModuleType& model, const AveragedModelOptions& options) {
    auto p = Of::ptr(model);
    TORCH_CHECK(p, "perf::optim::AveragedModel: the model is null");
    return detail::clone_module(*p, options.device());
  }
  static std::shared_ptr<torch::nn::Module> checked(const std::shared_ptr<typename Of::Impl>& model,
                                                    const std::shared_ptr<typename Of::Impl>& copy) {
    TORCH_CHECK(model && copy, "perf::optim::AveragedModel: the model or its copy is null");
    TORCH_CHECK(model != copy, "perf::optim::AveragedModel: the copy is the model itself; pass a second instance");
    return copy;
  }
  std::shared_ptr<typename Of::Impl> typed_;
};

/// The holder: `perf::optim::AveragedModel ema(model, options);` then `ema->update_parameters(model)`,
/// `ema->forward(x)`, `ema->module()`, `ema->n_averaged()`.
template <typename ModuleType>
class AveragedModel : public torch::nn::ModuleHolder<AveragedModelImpl<ModuleType>> {
 public:
  using torch::nn::ModuleHolder<AveragedModelImpl<ModuleType>>::ModuleHolder;
};
template <typename M>
AveragedModel(const M&) -> AveragedModel<M>;
template <typename M>
AveragedModel(const M&, AveragedModelOptions) -> AveragedModel<M>;
template <typename M>
AveragedModel(const M&, const M&) -> AveragedModel<M>;
template <typename M>
AveragedModel(const M&, const M&, AveragedModelOptions) -> AveragedModel<M>;

/// Python's SWALR: anneals each group's rate from its current one to `swa_lr` over `anneal_epochs` steps
/// ("cos" or "linear"), then holds it. Python's state_dict() both ways; "swa_lr" goes into perf::optim
/// optimizers' state_dict() groups, where Python's SWALR reads it after a resume.
class SWALR final : public LRScheduler {
 public:
  PERF_INLINE SWALR(torch::optim::Optimizer& optimizer, PerGroup swa_lr, int64_t anneal_epochs = 10,
                    const std::string& anneal_strategy = "cos");
  const char* name() const override { return "SWALR"; }
  const std::vector<double>& swa_lrs() const { return swa_lrs_; }

 private:
  PERF_INLINE std::vector<double> get_lr() override;
  PERF_INLINE void write_state(c10::impl::GenericDict& state) const override;
  PERF_INLINE std::function<void()> read_state(const c10::impl::GenericDict& state) override;
  PERF_INLINE double anneal(double t) const;
  std::vector<double> swa_lrs_;
  int64_t anneal_epochs_;
  std::string anneal_strategy_;
};

namespace detail {
/// Python's update_bn preparation, undone on destruction (also when the loader or forward throws, which
/// Python's does not): every BatchNorm's running statistics reset and momentum None (a cumulative
/// average), the model in train().
class BatchNormPass {
 public:
  PERF_INLINE explicit BatchNormPass(torch::nn::Module& model);
  PERF_INLINE ~BatchNormPass();
  BatchNormPass(const BatchNormPass&) = delete;
  BatchNormPass& operator=(const BatchNormPass&) = delete;
  bool any() const { return !momenta_.empty(); }

 private:
  torch::nn::Module& model_;
  bool was_training_;
  std::vector<std::pair<torch::nn::Module*, std::optional<double>>> momenta_;  // each BatchNorm's own
};
inline const at::Tensor& bn_input(const at::Tensor& batch) { return batch; }
template <typename Target>
const at::Tensor& bn_input(const torch::data::Example<at::Tensor, Target>& batch) {
  return batch.data;
}
inline const at::Tensor& bn_input(const std::vector<at::Tensor>& batch) {  // Python: a list's first element
  TORCH_CHECK(!batch.empty(), "perf::optim::update_bn: a batch is an empty list of tensors");
  return batch.front();
}
}  // namespace detail

/// Python's update_bn(loader, model, device): one pass over `loader` in train() mode that recomputes every
/// BatchNorm's running statistics as a plain average over the batches (for an AveragedModel's weights).
/// A batch is a tensor, a torch::data::Example (its data) or a std::vector<at::Tensor> (its first); each
/// goes to `device` if one is given. `model` is a holder (Net, an AveragedModel) or a shared_ptr; its
/// train()/eval() mode and BatchNorm momenta are restored afterwards. No BatchNorm: returns at once.
template <typename Loader, typename Model>
void update_bn(Loader&& loader, Model& model, std::optional<c10::Device> device = std::nullopt) {
  at::NoGradGuard no_grad;
  detail::BatchNormPass pass(ModuleRef(model).get());
  if (!pass.any()) return;
  for (auto&& batch : loader) {
    at::Tensor input = detail::bn_input(batch);
    if (device) input = input.to(*device);
    model->forward(input);
  }
}

}  // namespace perf::optim

#ifdef PERF_HEADER_ONLY
#include <perf/impl/swa_utils-inl.h>
#endif
