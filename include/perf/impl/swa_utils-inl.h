// perf/impl/swa_utils-inl.h — the out-of-line definitions of perf/swa_utils.h.
// Included by perf/swa_utils.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
//
// Each average is Python's (torch/optim/swa_utils.py in 2.11), operation for operation.
#pragma once

#include <c10/util/Exception.h>
#include <perf/impl/lr_scheduler-inl.h>
#include <perf/impl/optim-inl.h>  // detail::plain_view
#include <perf/swa_utils.h>
#include <torch/nn/modules/batchnorm.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <tuple>

namespace perf::optim {

namespace detail {

// Python's get_ema_multi_avg_fn and get_swa_multi_avg_fn over one (device, dtype); `weight` is the lerp
// weight (1 - decay, or 1 / (n + 1) in float as Python's tensor division gives it) and `n` the count, for the
// integer formula (a host number: no copy to the device).
PERF_INLINE void builtin_multi_avg(const std::optional<double>& ema_decay, const std::vector<at::Tensor>& averaged,
                                   const std::vector<at::Tensor>& current, double weight, int64_t n) {
  if (averaged.empty()) return;
  if (at::isFloatingType(averaged[0].scalar_type()) || at::isComplexType(averaged[0].scalar_type())) {
    at::_foreach_lerp_(averaged, current, weight);
    return;
  }
  for (std::size_t i = 0; i < averaged.size(); ++i) {
    if (ema_decay) {
      averaged[i].copy_(averaged[i] * *ema_decay + current[i] * (1 - *ema_decay));
    } else {  // Python's per-tensor SWA formula (what its CPU path runs for every dtype)
      averaged[i].copy_(averaged[i] + (current[i] - averaged[i]) / at::Scalar(n + 1));
    }
  }
}

PERF_INLINE double swa_weight(int64_t n) {  // Python's 1 / (n_averaged + 1): a long tensor's reciprocal, in float
  return static_cast<double>(1.0f / static_cast<float>(n + 1));
}

// Whether `ts` lie in one storage without overlapping, each dense: the span [base, base + len) holds them all.
PERF_INLINE bool packed_span(const std::vector<at::Tensor>& ts, int64_t& base, int64_t& len) {
  const void* storage = nullptr;
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& t : ts) {
    if (t.numel() == 0) continue;
    if (!t.has_storage() || !t.is_non_overlapping_and_dense()) return false;
    const void* s = t.storage().unsafeGetStorageImpl();
    if (storage && s != storage) return false;
    storage = s;
    spans.emplace_back(t.storage_offset(), t.storage_offset() + t.numel());
  }
  if (spans.empty()) return false;
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) return false;
  base = spans.front().first;
  len = spans.back().second - base;  // sorted and disjoint: the last ends last
  return true;
}

template <typename F>
bool with_batch_norm(torch::nn::Module& m, F&& f) {
  if (auto* b1 = dynamic_cast<torch::nn::BatchNorm1dImpl*>(&m)) return f(*b1), true;
  if (auto* b2 = dynamic_cast<torch::nn::BatchNorm2dImpl*>(&m)) return f(*b2), true;
  if (auto* b3 = dynamic_cast<torch::nn::BatchNorm3dImpl*>(&m)) return f(*b3), true;
  return false;
}

PERF_INLINE std::string describe(const std::string& name, const at::Tensor& t) {
  std::ostringstream os;
  os << "\"" << name << "\" (" << t.sizes() << ", " << t.scalar_type() << ")";
  return os.str();
}

// The averaged copy's tensors and the model's, paired in order; every pair checked (shape; count) first.
PERF_INLINE void pair_tensors(const torch::OrderedDict<std::string, at::Tensor>& mine,
                              const torch::OrderedDict<std::string, at::Tensor>& theirs, const char* what,
                              const std::string& who, std::vector<at::Tensor>& out_mine,
                              std::vector<at::Tensor>& out_theirs) {
  TORCH_CHECK(mine.size() == theirs.size(), who, ": the averaged copy has ", mine.size(), " ", what, "s and the model ",
              theirs.size(), "; the model must be of the averaged copy's architecture");
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const auto& m = mine[i].value();
    const auto& t = theirs[i].value();
    TORCH_CHECK(m.sizes() == t.sizes(), who, ": ", what, " ", i, " of the averaged copy is ",
                describe(mine[i].key(), m), " and the model's is ", describe(theirs[i].key(), t),
                "; the model must be of the averaged copy's architecture");
    out_mine.push_back(m);
    out_theirs.push_back(t);
  }
}

}  // namespace detail

// ---- the averaging functions ----------------------------------------------------------------------------------

PERF_INLINE void MultiAvgFn::operator()(const std::vector<at::Tensor>& averaged, const std::vector<at::Tensor>& current,
                                        const at::Tensor& num_averaged) const {
  TORCH_CHECK(static_cast<bool>(*this), "perf::optim::MultiAvgFn: called empty");
  TORCH_CHECK(averaged.size() == current.size(), "perf::optim::MultiAvgFn: ", averaged.size(), " averaged tensors and ",
              current.size(), " current ones");
  if (kind_ == Kind::custom) {
    fn_(averaged, current, num_averaged);
    return;
  }
  at::NoGradGuard no_grad;
  const int64_t n = kind_ == Kind::swa ? num_averaged.item<int64_t>() : 0;  // Python's SWA reads it too
  detail::builtin_multi_avg(ema_decay(), averaged, current, kind_ == Kind::ema ? 1 - decay_ : detail::swa_weight(n), n);
}

PERF_INLINE MultiAvgFn get_ema_multi_avg_fn(double decay) {
  TORCH_CHECK(decay >= 0.0 && decay <= 1.0, "perf::optim::get_ema_multi_avg_fn: decay is ", decay,
              "; Python's error: \"Invalid decay value ", decay, " provided. Please provide a value in [0,1] range.\"");
  MultiAvgFn f;
  f.kind_ = MultiAvgFn::Kind::ema;
  f.decay_ = decay;
  return f;
}

PERF_INLINE MultiAvgFn get_swa_multi_avg_fn() {
  MultiAvgFn f;
  f.kind_ = MultiAvgFn::Kind::swa;
  return f;
}

PERF_INLINE AvgFn get_ema_avg_fn(double decay) {
  TORCH_CHECK(decay >= 0.0 && decay <= 1.0, "perf::optim::get_ema_avg_fn: decay is ", decay,
              "; Python's error: \"Invalid decay value ", decay, " provided. Please provide a value in [0,1] range.\"");
  return [decay](const at::Tensor& averaged, const at::Tensor& current, const at::Tensor&) {
    return decay * averaged + (1 - decay) * current;
  };
}

PERF_INLINE AvgFn get_swa_avg_fn() {
  return [](const at::Tensor& averaged, const at::Tensor& current, const at::Tensor& num_averaged) {
    return averaged + (current - averaged) / (num_averaged + 1);
  };
}

// ---- AveragedModel -------------------------------------------------------------------------------------------

namespace detail {

PERF_INLINE std::shared_ptr<torch::nn::Module> clone_module(const torch::nn::Module& model,
                                                            const std::optional<c10::Device>& device) {
  try {
    return model.clone(device);
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("clone() has not been implemented") == std::string::npos) throw;
  }
  TORCH_CHECK(false, "perf::optim::AveragedModel: ", model.name(),
              " cannot be copied (Python deepcopies the model): it derives from torch::nn::Module, not from "
              "torch::nn::Cloneable<",
              model.name(),
              ">. Derive it from Cloneable (and define reset()), or pass a second instance for the weights to be "
              "copied into: perf::optim::AveragedModel(model, Net(...the same arguments...), options)");
  return nullptr;
}

}  // namespace detail

PERF_INLINE detail::AveragedModelBase::AveragedModelBase(const std::shared_ptr<torch::nn::Module>& copy,
                                                         const std::shared_ptr<torch::nn::Module>& model_ptr,
                                                         bool copy_values, AveragedModelOptions options)
    : copy_(copy), options_(std::move(options)) {
  const std::string w = "perf::optim::AveragedModel";
  TORCH_CHECK(copy_ && model_ptr, w, ": the model or its copy is null");
  const torch::nn::Module& model = *model_ptr;
  TORCH_CHECK(!(options_.avg_fn() && options_.multi_avg_fn()), w,
              ": avg_fn and multi_avg_fn are both set; Python's error: \"Only one of avg_fn and multi_avg_fn "
              "should be provided\"");
  if (copy_values) {  // the given second instance takes the model's values, devices and dtypes (deepcopy's)
    std::vector<at::Tensor> mine, theirs;
    detail::pair_tensors(copy_->named_parameters(), model.named_parameters(), "parameter", w, mine, theirs);
    const std::size_t params = mine.size();
    detail::pair_tensors(copy_->named_buffers(), model.named_buffers(), "buffer", w, mine, theirs);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> values;
    for (std::size_t i = 0; i < mine.size(); ++i)
      values.push_back(theirs[i].detach().to(options_.device().value_or(theirs[i].device()), theirs[i].scalar_type(),
                                             /*non_blocking=*/false, /*copy=*/true));
    for (std::size_t i = 0; i < mine.size(); ++i) {
      mine[i].set_data(values[i]);
      if (i < params) mine[i].set_requires_grad(theirs[i].requires_grad());
    }
  }
  register_module("module", copy_);
  n_averaged_ = register_buffer(
      "n_averaged", at::zeros({}, at::TensorOptions().dtype(at::kLong).device(options_.device().value_or(c10::kCPU))));
  n_version_ = n_averaged_._version();  // 0, known without reading it back
  n_storage_ = n_averaged_.storage().unsafeGetStorageImpl();
}

PERF_INLINE int64_t detail::AveragedModelBase::n_averaged() const {
  const void* storage = n_averaged_.storage().unsafeGetStorageImpl();
  if (n_averaged_._version() != n_version_ || storage != n_storage_) {  // loaded or written from outside
    n_host_ = n_averaged_.item<int64_t>();
    n_version_ = n_averaged_._version();
    n_storage_ = storage;
  }
  return n_host_;
}

PERF_INLINE void detail::AveragedModelBase::update_parameters(ModuleRef model_ref) {
  const torch::nn::Module& model = model_ref.get();
  const std::string w = "perf::optim::AveragedModel::update_parameters";
  TORCH_CHECK(&model != copy_.get() && &model != this, w, ": the model is the averaged copy itself");
  TORCH_CHECK(!detail::capturing_cuda_graph(), w,
              ": cannot run while a CUDA graph is being captured (the count of averaged models is kept on the "
              "host, so a replay would not advance it); call it after the graphed step");
  at::NoGradGuard no_grad;
  // Everything checked before anything changes.
  std::vector<at::Tensor> mine, theirs;
  detail::pair_tensors(copy_->named_parameters(), model.named_parameters(), "parameter", w, mine, theirs);
  std::vector<at::Tensor> mine_buffers, their_buffers;
  detail::pair_tensors(copy_->named_buffers(), model.named_buffers(), "buffer", w, mine_buffers, their_buffers);
  if (options_.use_buffers()) {
    mine.insert(mine.end(), mine_buffers.begin(), mine_buffers.end());
    theirs.insert(theirs.end(), their_buffers.begin(), their_buffers.end());
  }
  // Python's p_model.detach().to(p_averaged.device); and the averaged copy's dtype, so that an fp32 average
  // of a bf16 model works (Python's refuses the lerp of two dtypes after the first update).
  std::vector<at::Tensor> current;
  for (std::size_t i = 0; i < mine.size(); ++i)
    current.push_back(theirs[i].detach().to(mine[i].device(), mine[i].scalar_type()));
  const int64_t n = n_averaged();
  packed_spans_ = 0;
  if (n == 0) {
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i].copy_(current[i]);
  } else {
    average(mine, current, n);
  }
  if (!options_.use_buffers()) {
    for (std::size_t i = 0; i < mine_buffers.size(); ++i)
      mine_buffers[i].copy_(their_buffers[i].detach().to(mine_buffers[i].device()));
  }
  n_averaged_.add_(1);
  n_host_ = n + 1;
  n_version_ = n_averaged_._version();
  n_storage_ = n_averaged_.storage().unsafeGetStorageImpl();
}

PERF_INLINE void detail::AveragedModelBase::average(const std::vector<at::Tensor>& mine,
                                                    const std::vector<at::Tensor>& current, int64_t n) {
  if (options_.avg_fn()) {  // Python's per-tensor path
    for (std::size_t i = 0; i < mine.size(); ++i)
      mine[i].copy_(options_.avg_fn()(mine[i], current[i], n_averaged_.to(mine[i].device())));
    return;
  }
  // Python's _group_tensors_by_device_and_dtype, in the order of first appearance.
  std::vector<std::tuple<c10::Device, c10::ScalarType, std::vector<at::Tensor>, std::vector<at::Tensor>>> groups;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return std::get<0>(g) == mine[i].device() && std::get<1>(g) == mine[i].scalar_type();
    });
    if (it == groups.end()) it = groups.insert(groups.end(), {mine[i].device(), mine[i].scalar_type(), {}, {}});
    std::get<2>(*it).push_back(mine[i]);
    std::get<3>(*it).push_back(current[i]);
  }
  const MultiAvgFn& f = options_.multi_avg_fn();
  const bool custom = static_cast<bool>(f) && !f.ema_decay() && !f.is_swa();
  const std::optional<double> decay = f.ema_decay();
  const double weight = decay ? 1 - *decay : detail::swa_weight(n);
  for (auto& [device, dtype, gm, gc] : groups) {
    if (custom) {
      f(gm, gc, n_averaged_.to(device));
      continue;
    }
    if (at::isFloatingType(dtype) || at::isComplexType(dtype)) {
      const auto rest = lerp_packed(gm, gc, weight);  // what lies packed: one lerp per span; the rest:
      std::vector<at::Tensor> rest_mine, rest_current;
      for (std::size_t i : rest) {
        rest_mine.push_back(gm[i]);
        rest_current.push_back(gc[i]);
      }
      detail::builtin_multi_avg(decay, rest_mine, rest_current, weight, n);
    } else {
      detail::builtin_multi_avg(decay, gm, gc, weight, n);
    }
  }
}

// Where two or more of the model's tensors lie packed in one buffer (perf::optim's flat(true) buffers, cuDNN's
// flat LSTM weights), one lerp over their span; the averaged copy's tensors are moved, the first time, into a
// buffer of their own with the same layout. Returns the indices of the tensors left for the multi-tensor lerp.
PERF_INLINE std::vector<std::size_t> detail::AveragedModelBase::lerp_packed(const std::vector<at::Tensor>& mine,
                                                                            const std::vector<at::Tensor>& current,
                                                                            double weight) {
  std::vector<std::size_t> rest;
  std::vector<std::pair<const void*, std::vector<std::size_t>>> by_storage;  // in order of first appearance
  for (std::size_t i = 0; i < current.size(); ++i) {
    if (current[i].numel() == 0 || !current[i].has_storage()) {
      rest.push_back(i);
      continue;
    }
    const void* s = current[i].storage().unsafeGetStorageImpl();
    auto it = std::find_if(by_storage.begin(), by_storage.end(), [s](const auto& e) { return e.first == s; });
    if (it == by_storage.end()) it = by_storage.insert(by_storage.end(), {s, {}});
    it->second.push_back(i);
  }
  for (const auto& [storage, index] : by_storage) {
    std::vector<at::Tensor> cur, my;
    for (std::size_t i : index) {
      cur.push_back(current[i]);
      my.push_back(mine[i]);
    }
    int64_t base = 0, len = 0;
    if (index.size() < 2 || !detail::packed_span(cur, base, len)) {
      rest.insert(rest.end(), index.begin(), index.end());
      continue;
    }
    int64_t my_base = 0, my_len = 0;
    bool same = detail::packed_span(my, my_base, my_len) && my_len == len &&
                my[0].storage().nbytes() == static_cast<std::size_t>(len * my[0].element_size());
    for (std::size_t k = 0; same && k < my.size(); ++k)
      same = my[k].storage_offset() - my_base == cur[k].storage_offset() - base && my[k].strides() == cur[k].strides();
    if (!same) {  // the model's layout, in a buffer of the averaged copy's own
      at::Tensor buffer = at::zeros({len}, my[0].options());
      for (std::size_t k = 0; k < my.size(); ++k) {
        at::Tensor view = detail::plain_view(buffer, cur[k].storage_offset() - base, my[k].sizes(), cur[k].strides());
        view.copy_(my[k]);
        my[k].set_data(view);
      }
      my_base = 0;
    }
    detail::plain_view(my[0], my_base, {len}, {1}).lerp_(detail::plain_view(cur[0], base, {len}, {1}), weight);
    ++packed_spans_;
  }
  std::sort(rest.begin(), rest.end());
  return rest;
}

// ---- SWALR ---------------------------------------------------------------------------------------------------

PERF_INLINE SWALR::SWALR(torch::optim::Optimizer& optimizer, PerGroup swa_lr, int64_t anneal_epochs,
                         const std::string& anneal_strategy)
    : LRScheduler(optimizer), anneal_epochs_(anneal_epochs), anneal_strategy_(anneal_strategy) {
  swa_lrs_ = detail::per_group(swa_lr, optimizer, who(""), "swa_lr");
  TORCH_CHECK(anneal_strategy == "cos" || anneal_strategy == "linear", who(""), ": anneal_strategy is \"",
              anneal_strategy, "\"; Python's error: \"anneal_strategy must by one of 'cos' or 'linear', instead got ",
              anneal_strategy, "\"");
  TORCH_CHECK(anneal_epochs >= 0, who(""), ": anneal_epochs is ", anneal_epochs,
              "; Python's error: \"anneal_epochs must be equal or greater than 0, got ", anneal_epochs, "\"");
  set_group_values("swa_lr", swa_lrs_);
  start();
}

PERF_INLINE double SWALR::anneal(double t) const {
  return anneal_strategy_ == "cos" ? (1 - std::cos(detail::kPi * t)) / 2 : t;
}

PERF_INLINE std::vector<double> SWALR::get_lr() {
  check_groups(swa_lrs_.size(), "swa_lrs");
  int64_t step = step_count_ - 1;
  if (anneal_epochs_ == 0) step = std::max<int64_t>(1, step);
  const auto epochs = static_cast<double>(std::max<int64_t>(1, anneal_epochs_));
  const double prev_alpha = anneal(std::max(0.0, std::min(1.0, static_cast<double>(step - 1) / epochs)));
  const double alpha = anneal(std::max(0.0, std::min(1.0, static_cast<double>(step) / epochs)));
  std::vector<double> out = group_lrs();
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double swa = swa_lrs_[i];
    const double prev =
        perf::detail::same_value(prev_alpha, 1.0) ? swa : (out[i] - prev_alpha * swa) / (1 - prev_alpha);
    out[i] = swa * alpha + prev * (1 - alpha);
  }
  return out;
}

PERF_INLINE void SWALR::write_state(c10::impl::GenericDict& state) const {
  state.insert("_anneal_strategy", anneal_strategy_);
  state.insert("anneal_epochs", anneal_epochs_);
}

PERF_INLINE std::function<void()> SWALR::read_state(const c10::impl::GenericDict& state) {
  const std::string w = who("load_state_dict");
  std::string strategy = detail::state_string(state, "_anneal_strategy", w);
  TORCH_CHECK(strategy == "cos" || strategy == "linear", w, ": \"_anneal_strategy\" is \"", strategy,
              "\"; it must be \"cos\" or \"linear\"");
  const int64_t epochs = detail::state_int(state, "anneal_epochs", w);
  TORCH_CHECK(epochs >= 0, w, ": \"anneal_epochs\" is ", epochs, "; it must be 0 or more");
  return [this, strategy = std::move(strategy), epochs] {
    anneal_strategy_ = strategy;
    anneal_epochs_ = epochs;
  };
}

// ---- update_bn -----------------------------------------------------------------------------------------------

namespace detail {

PERF_INLINE BatchNormPass::BatchNormPass(torch::nn::Module& model) : model_(model), was_training_(model.is_training()) {
  auto visit = [this](torch::nn::Module& m) {
    with_batch_norm(m, [&](auto& bn) {
      bn.reset_running_stats();
      momenta_.emplace_back(&m, bn.options.momentum());
    });
  };
  visit(model);
  for (const auto& m : model.modules(/*include_self=*/false)) visit(*m);
  if (momenta_.empty()) return;
  model.train(true);
  for (const auto& entry : momenta_) with_batch_norm(*entry.first, [](auto& bn) { bn.options.momentum(std::nullopt); });
}

PERF_INLINE BatchNormPass::~BatchNormPass() {
  if (momenta_.empty()) return;
  for (const auto& entry : momenta_) {
    const std::optional<double>& momentum = entry.second;
    with_batch_norm(*entry.first, [&momentum](auto& bn) { bn.options.momentum(momentum); });
  }
  model_.train(was_training_);
}

}  // namespace detail

}  // namespace perf::optim
