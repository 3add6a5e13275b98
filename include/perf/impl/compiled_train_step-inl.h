// perf/impl/compiled_train_step-inl.h — the out-of-line definitions of perf/compiled_train_step.h.
// Included by perf/compiled_train_step.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/compiled_train_step.h>
#include <perf/impl/compiled_model-inl.h>  // detail::Package

namespace perf {

namespace detail {

PERF_INLINE bool same_layout(c10::IntArrayRef sizes, c10::IntArrayRef a, c10::IntArrayRef b) {
  if (a.size() != sizes.size() || b.size() != sizes.size()) return false;
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] > 1 && a[d] != b[d]) return false;
  return true;
}

}  // namespace detail

PERF_INLINE CompiledTrainStep::CompiledTrainStep(const std::string& path, ModuleRef module, Optimizers optimizers,
                                                 const CompiledTrainOptions& options)
    : module_(std::move(module)), opts_(std::move(optimizers)), options_(options) {
  // Single-threaded: the container entry point that CUDA graph capture allows.
  package_ =
      std::make_unique<detail::Package>(path, CompiledOptions().model_name(options.model_name()).single_threaded(true),
                                        "train", "perf::CompiledTrainStep");
  TORCH_CHECK(options_.accumulation_steps() >= 1, "perf::CompiledTrainOptions::accumulation_steps: must be >= 1, got ",
              options_.accumulation_steps());
  detail::check_step_optimizers(package_->who(), opts_.list());  // here, not at the first step()
  bind_state();
  // As DistributedDataParallel: every rank's model checked alike and given rank 0's state now, not at the first step().
  if (const auto& dp = options_.data_parallel()) dp->start(*module_, package_->who().c_str());
  detail::warn_if_emulated_bf16(*package_);
}

// Out of line: detail::Package is complete only in the definitions (impl/compiled_model-inl.h).
PERF_INLINE CompiledTrainStep::~CompiledTrainStep() = default;

PERF_INLINE c10::Device CompiledTrainStep::device() const noexcept { return package_->device(); }

PERF_INLINE std::string CompiledTrainStep::amp() const { return package_->meta("perf.train.amp"); }

PERF_INLINE bool CompiledTrainStep::channels_last() const { return package_->meta("perf.train.channels_last") == "1"; }

PERF_INLINE const std::string& CompiledTrainStep::path() const noexcept { return package_->path(); }

PERF_INLINE const std::unordered_map<std::string, std::string>& CompiledTrainStep::metadata() const noexcept {
  return package_->metadata();
}

PERF_INLINE const std::vector<CompiledInput>& CompiledTrainStep::inputs() const noexcept { return package_->inputs(); }

PERF_INLINE std::string CompiledTrainStep::layout_hint() const {
  return channels_last() ? " The package was exported with --channels-last: call perf::to_channels_last(model) "
                           "before constructing the step."
                         : " The package was exported for contiguous parameters: export with --channels-last for "
                           "a channels-last model, or construct the step before converting the model.";
}

// Matches the module's named parameters and buffers to the package's state, by name.
PERF_INLINE void CompiledTrainStep::bind_state() {
  const std::string& who = package_->who();
  std::unordered_map<std::string, std::pair<at::Tensor, bool>> own;  // name -> (tensor, is parameter)
  for (const auto& p : module_->named_parameters()) own[p.key()] = {p.value(), true};
  for (const auto& b : module_->named_buffers())
    if (b.value().defined()) own[b.key()] = {b.value(), false};
  const auto n = static_cast<size_t>(detail::to_int(package_->meta("perf.train.state"), "perf.train.state"));
  std::unordered_set<std::string> named;
  for (size_t i = 0; i < n; ++i) {
    const std::string key = "perf.train.state." + std::to_string(i);
    auto kv = detail::key_values(package_->meta(key));
    State s;
    s.name = kv["name"];
    s.param = kv["kind"] == "param";
    s.grad = kv["grad"] == "1";
    s.dtype = detail::dtype_from_name(kv["dtype"]);
    s.sizes = detail::int_list(kv["sizes"], key + " sizes");
    s.strides = detail::int_list(kv["strides"], key + " strides");
    const char* what = s.param ? "parameter" : "buffer";
    const auto it = own.find(s.name);
    TORCH_CHECK(it != own.end(), who, ": the package trains ", what, " '", s.name,
                "', which the module does not have (the package was exported from another model, or the C++ "
                "module names its members differently from the Python one)");
    TORCH_CHECK(it->second.second == s.param, who, ": '", s.name, "' is a ", what, " in the package and a ",
                it->second.second ? "parameter" : "buffer", " in the module");
    s.live = it->second.first;
    named.insert(s.name);
    TORCH_CHECK(s.live.scalar_type() == s.dtype && s.live.sizes() == c10::IntArrayRef(s.sizes), who, ": ", what, " '",
                s.name, "' is ", s.live.scalar_type(), " ", s.live.sizes(), " in the module, ", s.dtype, " ",
                detail::sizes_string(s.sizes), " in the package (export the package from this model again)");
    state_.push_back(std::move(s));
  }
  // A tensor the module registers under a second name (weights tied by registering one tensor twice) is bound
  // through the name the package has: Python's export names a shared tensor once.
  std::unordered_set<const void*> bound;
  for (const auto& s : state_) bound.insert(s.live.unsafeGetTensorImpl());
  for (const auto& entry : own) {
    if (!named.count(entry.first) && bound.count(entry.second.first.unsafeGetTensorImpl())) continue;
    TORCH_CHECK(named.count(entry.first), who, ": the module's ", entry.second.second ? "parameter" : "buffer", " '",
                entry.first,
                "' is not in the package, so the compiled step would never update it (the package was "
                "exported from another model)");
  }
  for (const auto& i : detail::int_list(package_->meta("perf.train.mutated"), "perf.train.mutated")) {
    TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < n, who, ": malformed metadata perf.train.mutated");
    mutated_.push_back(static_cast<size_t>(i));
  }
  for (const auto& i : detail::int_list(package_->meta("perf.train.grads"), "perf.train.grads")) {
    TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < n && state_[static_cast<size_t>(i)].grad, who,
                ": malformed metadata perf.train.grads");
    grads_.push_back(static_cast<size_t>(i));
  }
  for (const auto& m : module_->named_modules("", /*include_self=*/false)) submodules_.emplace_back(m.key(), m.value());
  check_state();
}

// Cheap enough for every step: the generated code trusts these.
PERF_INLINE void CompiledTrainStep::check_state() const {
  const std::string& who = package_->who();
  const c10::Device device = package_->device();
  // tools/export_compiled.py --train exports the whole model in train() mode.
  auto check_mode = [&](bool training, const std::string& what) {
    TORCH_CHECK(training, who, ": ", what,
                " is in eval() mode, but the package computes the step in train() mode, as exported (batch "
                "statistics, dropout), and cannot follow a mode change: call model->train() before step() (eval() "
                "is for evaluating between steps), or train this configuration with perf::TrainStep");
  };
  check_mode(module_->is_training(), "the model");
  for (const auto& [name, m] : submodules_) check_mode(m->is_training(), "module '" + name + "'");
  for (const auto& s : state_) {
    const char* what = s.param ? "parameter" : "buffer";
    TORCH_CHECK(s.live.device().type() == device.type() && (!device.is_cuda() || s.live.device() == device), who, ": ",
                what, " '", s.name, "' is on ", s.live.device(), ", the package runs on ", device,
                " (move the model there: model->to(", device, "))");
    TORCH_CHECK(s.live.scalar_type() == s.dtype, who, ": ", what, " '", s.name, "' became ", s.live.scalar_type(),
                "; the package was exported for ", s.dtype);
    TORCH_CHECK(detail::same_layout(s.live.sizes(), s.live.strides(), s.strides), who, ": ", what, " '", s.name,
                "' has strides ", s.live.strides(), ", the package was exported for strides ",
                c10::IntArrayRef(s.strides), ".", layout_hint());
    if (s.param) {
      TORCH_CHECK(s.live.requires_grad() == s.grad, who, ": parameter '", s.name,
                  "' has requires_grad=", s.live.requires_grad() ? "true" : "false",
                  ", but the package was exported with it ", s.grad ? "trainable" : "frozen",
                  " (requires_grad changed after export): export the training step again with the parameters "
                  "frozen as they are now");
    }
  }
}

PERF_INLINE at::Tensor CompiledTrainStep::micro(const std::vector<at::Tensor>& batch, double divisor) {
  at::NoGradGuard no_grad;
  const c10::Device device = package_->device();
  std::vector<at::Tensor> in;
  in.reserve(state_.size() + 1 + batch.size());
  std::unordered_set<const void*> inputs_storage;
  for (const auto& s : state_) {
    in.push_back(s.live);
    inputs_storage.insert(s.live.storage().data());
  }
  at::Tensor scale = at::full({}, 1.0 / divisor, at::TensorOptions().dtype(at::kFloat).device(device));
  if (auto* scaler = options_.scaler()) scale = scaler->scale(scale);
  in.push_back(scale);
  for (const auto& t : batch) {  // in the exported layout already (step())
    in.push_back(t);
    inputs_storage.insert(t.storage().data());
  }
  std::vector<at::Tensor> out = package_->run(in);
  const size_t m = mutated_.size();
  TORCH_CHECK(out.size() == m + 1 + grads_.size(), package_->who(), " returned ", out.size(), " outputs, its metadata ",
              "describes ", m + 1 + grads_.size(), " (", m, " buffers, the loss, ", grads_.size(), " gradients)");
  for (size_t i = 0; i < m; ++i) state_[mutated_[i]].live.copy_(out[i]);
  for (size_t j = 0; j < grads_.size(); ++j) {
    at::Tensor g = out[m + 1 + j];
    at::Tensor& p = state_[grads_[j]].live;
    // Handed over without a copy unless it shares memory with an input or
    // another gradient (in-place unscaling or clipping would then corrupt it),
    // or is laid out unlike its parameter: autograd's gradient layout contract
    // (AccumulateGrad), which the fused optimizers require (on CUDA, Inductor
    // may return a channels-last convolution's weight gradient contiguous).
    const bool shared = !inputs_storage.insert(g.storage().data()).second;
    const bool dense = p.is_non_overlapping_and_dense();
    const bool laid_out = dense ? detail::same_layout(p.sizes(), g.strides(), p.strides()) : g.is_contiguous();
    if (shared || !laid_out || g.scalar_type() != p.scalar_type()) {
      g = (dense ? at::empty_strided(p.sizes(), p.strides(), p.options()) : at::empty(p.sizes(), p.options())).copy_(g);
    }
    if (p.grad().defined()) {
      p.mutable_grad().add_(g);
    } else {
      p.mutable_grad() = g;
    }
  }
  const at::Tensor& loss = out[m];
  return !detail::same_value(divisor, 1.0) ? loss / divisor : loss;
}

PERF_INLINE at::Tensor CompiledTrainStep::step(const std::vector<at::Tensor>& batch) {
  check_state();
  const auto& specs = package_->inputs();
  const int64_t k = options_.accumulation_steps();
  // In the exported layout once (channels-last images), then the package sees
  // TrainStep's micro-batches: check the largest (first) and, where they
  // differ, the smallest (last), with the hint for a static package.
  std::vector<at::Tensor> prepared;
  for (size_t i = 0; i < batch.size(); ++i) {
    const at::Tensor& t = batch[i];
    TORCH_CHECK(t.defined(), package_->who(), ": batch tensor ", i, " is undefined");
    TORCH_CHECK(k == 1 || (t.dim() >= 1 && t.size(0) >= 1), package_->who(), ": accumulation_steps(", k,
                ") splits every batch tensor's dim 0, got shape ", t.sizes());
    const auto fmt = i < specs.size() && t.dim() == 4 ? specs[i].format : at::MemoryFormat::Contiguous;
    prepared.push_back(t.is_contiguous(fmt) ? t : t.contiguous(fmt));
  }
  const auto micros = detail::micro_batches(prepared, k);
  auto check_micro_batch = [&](const std::vector<at::Tensor>& chunk) {
    for (size_t i = 0; i < chunk.size() && i < specs.size(); ++i) {
      const auto& want = specs[i];
      const bool static_batch = !want.sizes.empty() && want.sizes[0] >= 0;
      TORCH_CHECK(!static_batch || chunk[i].dim() == 0 || chunk[i].size(0) == want.sizes[0], package_->who(),
                  ": batch tensor ", i, " has ", chunk[i].size(0), " rows", (k > 1 ? " per micro-batch" : ""),
                  ", the package was exported for a static batch of ", want.sizes[0],
                  ". Export it with --dynamic-batch MIN:MAX to train other batch sizes (an epoch's last batch), or "
                  "drop that batch (perf::LoaderTuning().drop_last(true)).");
    }
    detail::check_inputs(package_->who(), specs, package_->device(), chunk, specs.size());
  };
  check_micro_batch(micros.front());
  if (micros.size() > 1 && micros.back().front().size(0) != micros.front().front().size(0)) {
    check_micro_batch(micros.back());
  }
  if (!inner_) {
    TrainStepOptions o;
    o.graph(options_.graph())
        .warmup(options_.warmup())
        .scaler(options_.scaler())
        .max_grad_norm(options_.max_grad_norm())
        .accumulation_steps(k)
        .pool(options_.pool())
        .eager_fallback(options_.eager_fallback())
        .capture_error_mode(options_.capture_error_mode())
        .check_syncs(options_.check_syncs())
        .data_parallel(options_.data_parallel());
    inner_.reset(new TrainStep(  // private to TrainStep: not make_unique
        "perf::CompiledTrainStep", "perf::CompiledTrainOptions", module_,
        [this](const std::vector<at::Tensor>& micro_batch, double divisor) { return micro(micro_batch, divisor); },
        opts_, prepared, o));
  }
  return inner_->step(prepared);
}

PERF_INLINE const at::Tensor& CompiledTrainStep::static_loss() const {
  TORCH_CHECK(inner_, package_->who(), ": static_loss() before the first step()");
  return inner_->static_loss();
}

PERF_INLINE at::Tensor CompiledTrainStep::grad_norm() const {
  TORCH_CHECK(options_.max_grad_norm(), package_->who(),
              "::grad_norm: the step computes the gradient norm only where it clips; set "
              "perf::CompiledTrainOptions().max_grad_norm(x) (infinity measures it without clipping)");
  TORCH_CHECK(inner_, package_->who(), ": grad_norm() before the first step()");
  return inner_->grad_norm();
}

PERF_INLINE std::ostream& operator<<(std::ostream& out, const CompiledTrainStep& step) {
  out << "perf::CompiledTrainStep '" << step.path() << "' on " << step.device() << ", autocast " << step.amp()
      << (step.channels_last() ? ", channels-last" : "") << ", "
      << (step.graphed() ? "one CUDA graph per step" : "eager steps");
  if (step.eager_steps() > 0) out << " (" << step.eager_steps() << " uncaptured)";
  if (const auto& dp = step.options().data_parallel()) {
    out << ", data-parallel: rank " << dp->rank() << " of " << dp->world_size() << " (" << dp->backend() << ")";
  }
  out << "\n";
  const auto& meta = step.metadata();
  out << detail::inductor_options_line(meta);
  for (size_t i = 0; i < step.inputs().size(); ++i) out << "  batch " << i << ": " << step.inputs()[i] << "\n";
  const auto ops = meta.find("perf.train.attention.ops"), choices = meta.find("perf.train.attention.choices");
  if (ops != meta.end() && !ops->second.empty()) {
    out << "  attention (" << step.attention() << "): computes in " << ops->second << "\n";
    if (choices != meta.end() && !choices->second.empty()) out << "    " << choices->second << "\n";
  }
  return out;
}

}  // namespace perf
