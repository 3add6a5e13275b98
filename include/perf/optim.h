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
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
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
  inline void serialize(torch::serialize::OutputArchive& archive) const override;
  inline void serialize(torch::serialize::InputArchive& archive) override;
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
  inline void serialize(torch::serialize::OutputArchive& archive) const override;
  inline void serialize(torch::serialize::InputArchive& archive) override;
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
  inline void serialize(torch::serialize::OutputArchive& archive) const override;
  inline void serialize(torch::serialize::InputArchive& archive) override;
};

struct SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);

 public:
  inline void serialize(torch::serialize::OutputArchive& archive) const override;
  inline void serialize(torch::serialize::InputArchive& archive) override;
};

/// Common base: a torch::optim::Optimizer whose step can take GradScaler's
/// device-side scale and inf flag.
/// Clears the gradients of `optimizer`'s parameters as Python's
/// Optimizer.zero_grad does: a gradient that is a view (DDP's
/// gradient_as_bucket_view) is zeroed or dropped without LibTorch's in-place
/// detach_, which refuses views. The perf::optim optimizers' zero_grad() is this.
inline void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none = true);

namespace detail {
struct FlatStore;
struct Bucket;
}  // namespace detail

class FusedOptimizer : public torch::optim::Optimizer {
 public:
  using torch::optim::Optimizer::Optimizer;
  inline ~FusedOptimizer() override;
  inline FusedOptimizer(FusedOptimizer&&) noexcept;
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
  inline torch::Tensor step(LossClosure closure = nullptr) override;

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

  /// While set, every update is skipped on the device as if found_inf were 1
  /// (state is created, nothing moves): how TrainStep warms up without training.
  void skip_updates(bool skip) noexcept { skip_updates_ = skip; }
  bool skipping_updates() const noexcept { return skip_updates_; }

  /// Whether this optimizer holds its parameters, gradients and state flat
  /// (options .flat(true)). In flat mode:
  /// - each parameter's data and .grad() are views into one buffer per
  ///   (device, dtype), parameters of a param group adjacent; state tensors
  ///   are views too, laid out like their parameter (channels-last included);
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
  // Called by the subclass constructor once its options are checked.
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
    this->invalidate_flat();  // flat: the loaded state is copied into the buffers at the next step
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
  inline void update(const std::optional<torch::Tensor>& grad_scale,
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
};

// ---------------------------------------------------------------------------
namespace detail {

template <bool Decoupled>
constexpr const char* adam_name() {
  return Decoupled ? "perf::optim::AdamW" : "perf::optim::Adam";
}

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
};

inline Bucket& bucket_for(std::vector<Bucket>& buckets, const c10::Device& device, c10::ScalarType dtype,
                          bool first = false) {
  for (auto& b : buckets)
    if (b.device == device && b.dtype == dtype && b.first == first) return b;
  buckets.push_back(Bucket{device, dtype, first, {}, {}, {}, {}, {}, {}, {}, false, 0});
  return buckets.back();
}

inline Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p, bool first = false) {
  return bucket_for(buckets, p.device(), p.scalar_type(), first);
}

// Python's Optimizer.zero_grad for one gradient, views included (LibTorch's
// in-place detach_ refuses them).
inline void clear_grad(at::Tensor& g, bool set_to_none) {
  if (!g.defined()) return;
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

// ---- flat mode

// Where one parameter lives in its (device, dtype) buffers.
struct FlatSlot {
  at::Tensor param;  // the user's parameter (same TensorImpl)
  size_t group = 0, key = 0;
  size_t pos = 0;  // index among the key's slots: adjacent slots are adjacent in memory
  int64_t offset = 0;
  std::vector<int64_t> sizes, strides;
  at::Tensor grad;                                     // the gradient view
  std::array<at::Tensor, 3> state;                     // state views, made when first needed
  torch::optim::OptimizerParamState* owner = nullptr;  // the state_ entry they were handed to
};

struct FlatKey {
  c10::Device device;
  c10::ScalarType dtype;
  int64_t numel = 0;  // with alignment padding (zeros, never written)
  size_t slots = 0;
  at::Tensor params, grads;
  std::array<at::Tensor, 3> state;
};

struct FlatStore {
  std::vector<FlatKey> keys;
  std::vector<FlatSlot> slots;      // group order, then parameter order
  std::vector<size_t> group_begin;  // slots of group g: [group_begin[g], group_begin[g + 1])
  bool built = false;
};

// Each parameter starts at a 256-byte boundary (vectorised loads; the CUDA
// allocator's granularity).
inline int64_t flat_align(int64_t n, c10::ScalarType dtype) {
  const int64_t a = std::max<int64_t>(1, 256 / static_cast<int64_t>(c10::elementSize(dtype)));
  return (n + a - 1) / a * a;
}

// A tensor over `buffer`'s storage that is not an autograd view (LibTorch's
// zero_grad detach_()es gradients in place, which views refuse).
inline at::Tensor plain_view(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes, at::IntArrayRef strides) {
  return at::empty({0}, buffer.options()).set_(buffer.storage(), offset, sizes, strides);
}

inline at::Tensor slot_view(const at::Tensor& buffer, const FlatSlot& s) {
  return plain_view(buffer, s.offset, s.sizes, s.strides);
}

// A tensor alone in its storage (autograd's fresh gradient) rather than a view
// of a bigger buffer (a DDP bucket, another optimizer's flat buffer).
inline bool owns_storage(const at::Tensor& t) {
  return t.layout() == at::kStrided && t.storage_offset() == 0 && t.storage().nbytes() == t.nbytes();
}

inline bool same_storage(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.layout() == at::kStrided && b.layout() == at::kStrided &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

// Flat gradient buffers alive: storage -> number of parameters in it, so that
// clip_grad_norm_ and GradScaler can treat a complete set as one tensor.
inline std::mutex& flat_registry_mutex() {
  static std::mutex m;
  return m;
}
inline std::unordered_map<const void*, size_t>& flat_registry() {
  static std::unordered_map<const void*, size_t> r;
  return r;
}
inline void flat_register(const FlatStore& f, bool add) {
  std::lock_guard<std::mutex> lock(flat_registry_mutex());
  for (const auto& k : f.keys) {
    if (!k.grads.defined()) continue;
    const void* impl = k.grads.storage().unsafeGetStorageImpl();
    if (add) {
      flat_registry()[impl] = k.slots;
    } else {
      flat_registry().erase(impl);
    }
  }
}

/// `grads` with every complete set of a flat optimizer's gradients replaced
/// by its whole buffer (padding is zeros): one tensor instead of many for
/// norms, unscaling and scaling. Order otherwise kept.
inline std::vector<at::Tensor> coalesce_flat(const std::vector<at::Tensor>& grads) {
  std::unordered_map<const void*, std::unordered_set<const void*>> seen;  // storage -> grads
  {
    std::lock_guard<std::mutex> lock(flat_registry_mutex());
    if (flat_registry().empty()) return grads;
    for (const auto& g : grads) {
      if (!g.defined() || g.is_sparse()) continue;
      const void* st = g.storage().unsafeGetStorageImpl();
      auto it = flat_registry().find(st);
      if (it != flat_registry().end()) seen[st].insert(g.unsafeGetTensorImpl());
    }
    for (auto it = seen.begin(); it != seen.end();) {
      it = it->second.size() == flat_registry().at(it->first) ? std::next(it) : seen.erase(it);
    }
  }
  if (seen.empty()) return grads;
  std::vector<at::Tensor> out;
  std::unordered_set<const void*> done;
  for (const auto& g : grads) {
    if (!g.defined() || g.is_sparse()) {
      out.push_back(g);
      continue;
    }
    const void* st = g.storage().unsafeGetStorageImpl();
    if (!seen.count(st)) {
      out.push_back(g);
    } else if (done.insert(st).second) {
      const auto n = static_cast<int64_t>(g.storage().nbytes() / g.element_size());
      out.push_back(plain_view(g, 0, {n}, {1}));
    }
  }
  return out;
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
  std::string line = b.device.str() + " " + c10::toString(b.dtype) + ": " + (fused ? "fused" : "foreach");
  if (b.flat) {
    line += ", flat (" + std::to_string(b.params.size()) + (b.params.size() == 1 ? " tensor" : " tensors") + " for " +
            std::to_string(b.parameters) + (b.parameters == 1 ? " parameter)" : " parameters)");
  }
  return line;
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

// --------------------------------------------------------------------------- flat mode

inline FusedOptimizer::FusedOptimizer(FusedOptimizer&&) noexcept = default;

inline FusedOptimizer::~FusedOptimizer() {
  if (flat_ && flat_->built) detail::flat_register(*flat_, false);
}

inline void FusedOptimizer::init_flat(bool flat, const char* name) {
  name_ = name;
  for (size_t g = 0; g < param_groups_.size(); ++g) check_group_flat(g, flat);
  if (!flat) return;
  flat_ = std::make_unique<detail::FlatStore>();
  flatten();
}

inline void FusedOptimizer::check_group_flat(size_t g, bool flat) const {
  const auto f = flat_option(param_groups_[g].options());
  TORCH_CHECK(!f || *f == flat, name_, ": param group ", g, " has flat(", *f ? "true" : "false",
              ") but the optimizer's defaults have flat(", flat ? "true" : "false",
              "); flat is one setting for the whole optimizer: set it on the defaults and leave the groups' unset");
}

inline void FusedOptimizer::invalidate_flat() noexcept {
  if (flat_) flat_->built = false;
}

inline void FusedOptimizer::ensure_flat() {
  if (flat_ && flat_stale()) flatten();
}

// Cheap per-step check (pointer compares): same groups and parameters, each
// parameter still backed by its slot, state still the views handed out.
inline bool FusedOptimizer::flat_stale() const {
  const auto& f = *flat_;
  if (!f.built || f.group_begin.size() != param_groups_.size() + 1) return true;
  size_t i = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    if (f.group_begin[g + 1] - f.group_begin[g] != params.size()) return true;
    for (const auto& p : params) {
      const auto& s = f.slots[i++];
      const auto& k = f.keys[s.key];
      if (p.unsafeGetTensorImpl() != s.param.unsafeGetTensorImpl() || !detail::same_storage(p, k.params) ||
          p.storage_offset() != s.offset || p.strides() != at::IntArrayRef(s.strides) ||
          p.sizes() != at::IntArrayRef(s.sizes))
        return true;
      auto it = state_.find(p.unsafeGetTensorImpl());
      auto* owner = it == state_.end() ? nullptr : it->second.get();
      if (owner != s.owner) return true;
      if (owner) {
        auto ts = state_tensors(*owner);
        for (size_t j = 0; j < 3; ++j) {
          if (ts[j] && ts[j]->defined() && ts[j]->unsafeGetTensorImpl() != s.state[j].unsafeGetTensorImpl())
            return true;
        }
      }
    }
  }
  return false;
}

// (Re)builds the buffers from the parameters', gradients' and state's current
// values; the previous buffers (if any) are released once copied from.
inline void FusedOptimizer::flatten() {
  const char* name = name_;
  TORCH_CHECK(!detail::capturing_cuda_graph(), name,
              ": flat(true) must (re)build its buffers (first use, add_param_group, torch::load, or a parameter "
              "moved by model->to or perf::to_channels_last), which cannot happen while a CUDA graph is being "
              "captured; run one step eagerly first");
  at::NoGradGuard no_grad;
  // Checks and allocations first: a failure leaves everything as it was.
  const detail::FlatStore* old = flat_.get();
  auto f = std::make_unique<detail::FlatStore>();
  // Layout: per (device, dtype), groups in order, parameters in order.
  std::unordered_map<const void*, std::pair<size_t, size_t>> seen_params, seen_storage;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    check_group_flat(g, true);  // a group added since construction
    f->group_begin.push_back(f->slots.size());
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      TORCH_CHECK(p.layout() == at::kStrided, name, ": flat(true): parameter ", i, " of group ", g,
                  " is not a dense (strided) tensor");
      auto [it, fresh] = seen_params.emplace(p.unsafeGetTensorImpl(), std::make_pair(g, i));
      TORCH_CHECK(fresh, name, ": flat(true): parameter ", i, " of group ", g, " is the same tensor as parameter ",
                  it->second.second, " of group ", it->second.first, "; pass each parameter once");
      const bool in_old = old && std::any_of(old->keys.begin(), old->keys.end(), [&](const detail::FlatKey& k) {
                            return detail::same_storage(p, k.params);
                          });
      if (!in_old) {
        auto [st, alone] = seen_storage.emplace(p.storage().unsafeGetStorageImpl(), std::make_pair(g, i));
        TORCH_CHECK(alone, name, ": flat(true): parameter ", i, " of group ", g, " shares memory with parameter ",
                    st->second.second, " of group ", st->second.first,
                    " (one is a view of the other, e.g. tied weights); flat mode gives each parameter its own place "
                    "in the buffer, which would untie them: pass the shared tensor once");
      }
      size_t key = 0;
      while (key < f->keys.size() && (f->keys[key].device != p.device() || f->keys[key].dtype != p.scalar_type()))
        ++key;
      if (key == f->keys.size()) f->keys.push_back(detail::FlatKey{p.device(), p.scalar_type(), 0, 0, {}, {}, {}});
      auto& k = f->keys[key];
      detail::FlatSlot s;
      s.param = p;
      s.group = g;
      s.key = key;
      s.pos = k.slots++;
      s.offset = detail::flat_align(k.numel, k.dtype);
      s.sizes = p.sizes().vec();
      s.strides = p.is_non_overlapping_and_dense() ? p.strides().vec()
                                                   : at::IntArrayRef(c10::contiguous_strides(p.sizes())).vec();
      k.numel = s.offset + p.numel();
      f->slots.push_back(std::move(s));
    }
  }
  f->group_begin.push_back(f->slots.size());
  std::vector<std::array<bool, 3>> needs(f->keys.size(), {false, false, false});  // state buffers in use
  for (auto& s : f->slots) {
    auto it = state_.find(s.param.unsafeGetTensorImpl());
    if (it == state_.end()) continue;
    auto ts = state_tensors(*it->second);
    for (size_t j = 0; j < 3; ++j) needs[s.key][j] = needs[s.key][j] || (ts[j] && ts[j]->defined());
  }
  for (size_t key = 0; key < f->keys.size(); ++key) {
    auto& k = f->keys[key];
    const auto opts = at::TensorOptions().device(k.device).dtype(k.dtype);
    k.params = at::zeros({k.numel}, opts);
    k.grads = at::zeros({k.numel}, opts);
    for (size_t j = 0; j < 3; ++j) {
      if (needs[key][j]) k.state[j] = at::zeros({k.numel}, opts);
    }
  }
  // Values: parameters, gradients (unless another buffer owns them), state.
  std::vector<at::Tensor> steps;  // a counter per slot with state, for merging
  std::vector<size_t> step_slots;
  for (auto& s : f->slots) {
    auto& k = f->keys[s.key];
    auto& p = s.param;
    auto pv = detail::slot_view(k.params, s);
    pv.copy_(p);
    p.set_data(pv);
    s.grad = detail::slot_view(k.grads, s);
    auto& grad = p.mutable_grad();
    const bool ours_before =
        grad.defined() && old && std::any_of(old->keys.begin(), old->keys.end(), [&](const detail::FlatKey& ok) {
          return detail::same_storage(grad, ok.grads);
        });
    if (!grad.defined()) {
      grad = s.grad;
    } else if (ours_before || detail::owns_storage(grad)) {  // a sparse gradient is neither: refused at step()
      s.grad.copy_(grad);
      grad = s.grad;
    }
    auto it = state_.find(p.unsafeGetTensorImpl());
    if (it == state_.end()) continue;
    s.owner = it->second.get();
    auto ts = state_tensors(*s.owner);
    for (size_t j = 0; j < 3; ++j) {
      if (!ts[j] || !ts[j]->defined()) continue;
      s.state[j] = detail::slot_view(k.state[j], s);
      s.state[j].copy_(*ts[j]);
      *ts[j] = s.state[j];
    }
    if (auto* step = state_step(*s.owner); step && step->defined()) {
      steps.push_back(step->detach().to(at::kCPU, at::kFloat).reshape({}));  // devices may differ
      step_slots.push_back(&s - f->slots.data());
    }
  }
  // Step counters: one tensor per (group, key, value), so that runs stay long.
  if (!steps.empty()) {
    const auto values = at::stack(steps).to(at::kDouble);  // host values, read at rebuild only
    const auto* v = values.const_data_ptr<double>();
    std::map<std::tuple<size_t, size_t, double>, at::Tensor> shared;
    for (size_t n = 0; n < step_slots.size(); ++n) {
      auto& s = f->slots[step_slots[n]];
      auto& t = shared[{s.group, s.key, v[n]}];
      if (!t.defined()) t = at::full({}, v[n], at::TensorOptions().device(s.param.device()).dtype(at::kFloat));
      *state_step(*s.owner) = t;
    }
  }
  if (old && old->built) detail::flat_register(*old, false);
  f->built = true;
  detail::flat_register(*f, true);
  flat_ = std::move(f);
}

inline std::vector<detail::Bucket> FusedOptimizer::flat_buckets(size_t g, std::array<bool, 3> kinds, bool split_first) {
  auto& f = *flat_;
  const bool any_state = kinds[0] || kinds[1] || kinds[2];
  struct Part {
    size_t slot;
    bool ours, first;
    const void* step;
  };
  std::vector<Part> parts;
  std::map<size_t, at::Tensor> newcomer_steps;  // key -> counter of parameters stepped for the first time
  for (size_t i = f.group_begin[g]; i < f.group_begin[g + 1]; ++i) {
    auto& s = f.slots[i];
    auto& p = s.param;
    if (!p.requires_grad() || !p.grad().defined()) continue;  // frozen, or no gradient
    detail::check_grad(p, g, name_);
    auto& grad = p.mutable_grad();
    bool ours = grad.unsafeGetTensorImpl() == s.grad.unsafeGetTensorImpl();
    if (!ours && detail::owns_storage(grad)) {  // a fresh gradient: back into the buffer
      s.grad.copy_(grad);
      grad = s.grad;
      ours = true;
    }
    bool first = false;
    const void* step = nullptr;
    if (any_state) {
      auto& slot = state_[p.unsafeGetTensorImpl()];
      const bool created = !slot;
      if (created) slot = make_state();
      s.owner = slot.get();
      auto ts = state_tensors(*slot);
      auto& k = f.keys[s.key];
      for (size_t j = 0; j < 3; ++j) {
        if (!kinds[j] || ts[j]->defined()) continue;
        if (!k.state[j].defined()) k.state[j] = at::zeros({k.numel}, k.params.options());
        if (!s.state[j].defined()) s.state[j] = detail::slot_view(k.state[j], s);
        s.state[j].zero_();  // a parameter's first step: no history
        *ts[j] = s.state[j];
        if (j == 0) first = split_first;
      }
      if (auto* st = state_step(*slot)) {
        if (created || !st->defined()) {
          auto& t = newcomer_steps[s.key];
          if (!t.defined()) t = at::zeros({}, at::TensorOptions().device(p.device()).dtype(at::kFloat));
          *st = t;
        }
        step = st->unsafeGetTensorImpl();
      }
    }
    parts.push_back({i, ours, first, step});
  }
  // A counter shared with parameters not stepped now (frozen, no gradient)
  // forks: they keep a copy, so each counts only its own steps.
  if (!parts.empty() && parts.front().step) {
    std::unordered_map<const void*, size_t> stepping;
    for (const auto& pt : parts) ++stepping[pt.step];
    std::unordered_map<const void*, at::Tensor> forks;
    size_t pi = 0;
    for (size_t i = f.group_begin[g]; i < f.group_begin[g + 1]; ++i) {
      if (pi < parts.size() && parts[pi].slot == i) {
        ++pi;
        continue;
      }
      auto& s = f.slots[i];
      if (!s.owner) continue;
      auto* st = state_step(*s.owner);
      if (!st || !st->defined() || !stepping.count(st->unsafeGetTensorImpl())) continue;
      auto& fork = forks[st->unsafeGetTensorImpl()];
      if (!fork.defined()) fork = st->clone();
      *st = fork;
    }
  }
  // Runs: adjacent slots of one key with the same counter (and first flag).
  std::vector<detail::Bucket> buckets;
  size_t run_begin = 0, run_end = 0;  // indices into parts, [begin, end)
  auto flush = [&] {
    if (run_begin == run_end) return;
    const auto& s0 = f.slots[parts[run_begin].slot];
    const auto& s1 = f.slots[parts[run_end - 1].slot];
    auto& k = f.keys[s0.key];
    auto& b = detail::bucket_for(buckets, k.device, k.dtype, parts[run_begin].first);
    b.flat = true;
    b.parameters += static_cast<int64_t>(run_end - run_begin);
    const bool single = run_end - run_begin == 1;
    const int64_t begin = s0.offset, len = s1.offset + s1.param.numel() - s0.offset;
    auto range = [&](const at::Tensor& buffer, const at::Tensor& view) {
      return single ? view : buffer.narrow(0, begin, len);
    };
    b.params.push_back(range(k.params, s0.param));
    b.grads.push_back(parts[run_begin].ours ? range(k.grads, s0.grad) : s0.param.grad());
    if (kinds[0]) b.a.push_back(range(k.state[0], s0.state[0]));
    if (kinds[1]) b.b.push_back(range(k.state[1], s0.state[1]));
    if (kinds[2]) b.c.push_back(range(k.state[2], s0.state[2]));
    if (parts[run_begin].step) {
      const auto& step = *state_step(*s0.owner);
      b.steps.push_back(step);
      if (std::none_of(b.unique_steps.begin(), b.unique_steps.end(),
                       [&](const at::Tensor& t) { return t.is_same(step); }))
        b.unique_steps.push_back(step);
    }
    run_begin = run_end;
  };
  for (size_t n = 0; n < parts.size(); ++n) {
    if (n > run_begin) {
      const auto& prev = parts[n - 1];
      const auto& cur = parts[n];
      const auto& ps = f.slots[prev.slot];
      const auto& cs = f.slots[cur.slot];
      const bool extend = prev.ours && cur.ours && cs.key == ps.key && cs.pos == ps.pos + 1 && cur.step == prev.step &&
                          cur.first == prev.first;
      if (!extend) flush();
    }
    run_end = n + 1;
  }
  flush();
  return buckets;
}

inline void FusedOptimizer::zero_grad(bool set_to_none) {
  if (!flat_) return perf::optim::zero_grad(*this, set_to_none);
  ensure_flat();
  at::NoGradGuard no_grad;
  for (auto& k : flat_->keys) k.grads.zero_();
  for (auto& s : flat_->slots) {
    auto& grad = s.param.mutable_grad();
    if (grad.unsafeGetTensorImpl() == s.grad.unsafeGetTensorImpl()) continue;
    if (!grad.defined() || detail::owns_storage(grad)) {
      grad = s.grad;  // back into the buffer
      continue;
    }
    detail::clear_grad(grad, set_to_none);  // someone else's view (DDP's bucket): as without flat
  }
}

inline void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) detail::clear_grad(p.mutable_grad(), set_to_none);
  }
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
  this->init_flat(defaults.flat().value_or(false), detail::adam_name<D>());
}

template <bool D>
void AdamT<D>::update(const std::optional<torch::Tensor>& grad_scale, const std::optional<torch::Tensor>& found_inf) {
  const char* name = detail::adam_name<D>();
  this->kernels_.clear();
  this->ensure_flat();
  for (size_t g = 0; g < this->param_groups_.size(); ++g) {
    auto& group = this->param_groups_[g];
    const auto& o = static_cast<const Options&>(group.options());
    detail::check_adam_options(o, " in param group " + std::to_string(g));
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
    const auto [beta1, beta2] = o.betas();
    for (auto& b : buckets) {
      const bool fused = detail::use_fused(o.fused(), b, name);
      this->kernels_.push_back(detail::kernel_line(b, fused));
      const auto gs = detail::on_device(grad_scale, b.device);
      const auto fi = this->effective_found_inf(detail::on_device(found_inf, b.device), b.device);
      if (fused) {
        at::_foreach_add_(b.unique_steps, 1);
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
        if (fi) at::_foreach_sub_(b.unique_steps, std::vector<at::Tensor>(b.unique_steps.size(), *fi));
        continue;
      }
      // _foreach_ path: Python's capturable multi-tensor Adam (no host sync).
      if (this->skip_updates_ || !detail::foreach_prepare_scaled(b.grads, gs, fi)) continue;
      at::_foreach_add_(b.unique_steps, 1);
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
  init_flat(defaults.flat().value_or(false), "perf::optim::SGD");
}

inline void SGD::update(const std::optional<torch::Tensor>& grad_scale, const std::optional<torch::Tensor>& found_inf) {
  const char* name = "perf::optim::SGD";
  kernels_.clear();
  ensure_flat();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& group = param_groups_[g];
    const auto& o = static_cast<const SGDOptions&>(group.options());
    detail::check_sgd_options(o, " in param group " + std::to_string(g));
    const bool momentum = o.momentum() != 0;
    std::vector<detail::Bucket> buckets;
    if (flat()) {
      buckets = flat_buckets(g, {momentum, false, false}, /*split_first=*/true);
    } else {
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
/// gradient are ignored; none at all returns 0. The gradients of a flat
/// optimizer (all of them) are one tensor: one norm kernel, one scale kernel.
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
  for (auto& [key, grads] : groups) grads = optim::detail::coalesce_flat(grads);  // flat: one tensor
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
