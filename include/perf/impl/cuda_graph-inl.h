// perf/impl/cuda_graph-inl.h — the out-of-line definitions of perf/cuda_graph.h.
// Included by perf/cuda_graph.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/cuda_graph.h>

namespace perf {

namespace detail {

PERF_INLINE std::vector<optim::FusedOptimizer*> check_step_optimizers(
    const std::string& who, const std::vector<torch::optim::Optimizer*>& opts) {
  TORCH_CHECK(!opts.empty(), who, ": no optimizer given");
  std::vector<optim::FusedOptimizer*> fused;
  std::unordered_map<const c10::TensorImpl*, size_t> owner;  // parameter -> the optimizer that steps it
  for (size_t o = 0; o < opts.size(); ++o) {
    TORCH_CHECK(opts[o] != nullptr, who, ": optimizer ", o, " of ", opts.size(), " is null");
    for (size_t q = 0; q < o; ++q)
      TORCH_CHECK(opts[q] != opts[o], who, ": optimizer ", o, " is optimizer ", q, " again; give each once");
    fused.push_back(dynamic_cast<optim::FusedOptimizer*>(opts[o]));
    for (const auto& group : opts[o]->param_groups()) {
      for (const auto& p : group.params()) {
        const auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), o);
        TORCH_CHECK(fresh || it->second == o, who, ": a parameter of shape ", shape_str(p), " is in optimizer ",
                    it->second, " and in optimizer ", o,
                    ": each step would update it twice; give each parameter to one optimizer");
        TORCH_CHECK(!ddp_owns(p), who,
                    ": the optimizer's parameters are synchronised by a perf::DistributedDataParallel, "
                    "whose gradient all-reduce runs in autograd hooks on the process group; a CUDA graph cannot "
                    "capture that. Train with an eager step instead: loss_fn(ddp(x), y).backward(); opt.step()");
      }
    }
  }
  return fused;
}

PERF_INLINE std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

PERF_INLINE std::string first_line(const std::exception& e) {
  const auto* c10e = dynamic_cast<const c10::Error*>(&e);
  const std::string what = c10e ? c10e->what_without_backtrace() : e.what();
  return what.substr(0, what.find('\n'));
}

PERF_INLINE const char* capture_hint() {
  return "Likely causes: a host sync inside the captured code (.item(), .cpu(), printing or branching on a CUDA "
         "tensor), a CPU tensor or a host-to-device copy from pageable memory, an allocation outside the graph's "
         "memory pool, or shapes that change between calls. Set eager_fallback(true) to run eagerly with a warning "
         "instead.";
}

[[noreturn]] PERF_INLINE void rethrow_with_context(const std::string& context) {
  try {
    throw;
  } catch (c10::Error& e) {
    e.add_context(context);
    throw;
  } catch (const std::exception& e) {
    // Not LibTorch's (AOTInductor's runner throws std::runtime_error): a c10::Error that
    // says where, with the cause's own message.
    TORCH_CHECK(false, context, ": ", e.what());
  }
}

PERF_INLINE void check_padding_allowed(torch::nn::Module& module) {
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const auto& m = item.value();
    TORCH_CHECK(!m->is_training() || m->name().find("BatchNorm") == std::string::npos,
                "perf::graph: ", item.key().empty() ? std::string("the module") : "module '" + item.key() + "'", " (",
                m->name(),
                ") is in train() mode: with batch_sizes a call is padded with zero rows to its bucket, and those "
                "rows would enter its batch statistics. Call eval() first (perf::graph is for inference), or "
                "capture exact shapes (no batch_sizes)");
  }
}

PERF_INLINE std::vector<std::vector<at::Tensor>> micro_batches(const std::vector<at::Tensor>& batch, int64_t k) {
  if (k == 1) return {batch};
  for (const auto& t : batch) k = std::min(k, t.size(0));
  std::vector<std::vector<at::Tensor>> micro(static_cast<size_t>(k));
  for (const auto& t : batch) {
    auto pieces = t.tensor_split(k, 0);
    for (size_t i = 0; i < micro.size(); ++i) micro[i].push_back(std::move(pieces[i]));
  }
  return micro;
}

PERF_INLINE void check_step_outputs(const std::vector<at::Tensor>& result, int64_t k) {
  for (size_t i = 1; i < result.size(); ++i) {
    TORCH_CHECK(result[i].defined(), "perf::TrainStep: output ", i,
                " of the loss function (after the loss) is undefined");
    TORCH_CHECK(k == 1 || result[i].dim() >= 1, "perf::TrainStep: output ", i,
                " of the loss function (after the loss) is 0-dim, but with accumulation_steps(", k,
                ") the micro-batches' outputs are concatenated along dim 0: return per-sample values (e.g. "
                "(logits.argmax(1) == target) rather than its sum)");
  }
}

PERF_INLINE std::vector<at::Tensor> cat_step_outputs(const std::vector<std::vector<at::Tensor>>& per_micro) {
  std::vector<at::Tensor> out;
  const size_t n = per_micro.front().size();
  for (size_t i = 0; i < n; ++i) {
    std::vector<at::Tensor> parts;
    parts.reserve(per_micro.size());
    for (const auto& m : per_micro) {
      TORCH_CHECK(m.size() == n, "perf::TrainStep: the loss function returned ", m.size(),
                  " outputs for one micro-batch and ", n, " for another");
      parts.push_back(m[i]);
    }
    out.push_back(at::cat(parts, 0));
  }
  return out;
}

PERF_INLINE std::array<double, 3> scaler_settings(const GradScaler& s) {
  const auto& o = s.options();
  return {o.growth_factor(), o.backoff_factor(), static_cast<double>(o.growth_interval())};
}

PERF_INLINE CapturedState::CapturedState(torch::nn::Module& module,
                                         const std::vector<torch::optim::Optimizer*>& optimizers, bool training_modes,
                                         const GradScaler* scaler) {
  if (scaler != nullptr) scaler_ = scaler_settings(*scaler);
  if (training_modes) {  // the module itself may be a plain object (perf::ModuleRef), not in a shared_ptr
    training_ = module.is_training();
    for (auto& m : module.modules(/*include_self=*/false)) children_.emplace_back(m, m->is_training());
  }
  std::unordered_set<const at::TensorImpl*> seen;
  auto add = [&](const at::Tensor& t) {
    if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second)
      params_.push_back({t, t.data_ptr(), t.requires_grad()});
  };
  for (const auto& p : module.parameters()) add(p);
  for (const auto& b : module.buffers())
    if (b.defined()) buffers_.push_back({b, b.data_ptr(), false});
  for (auto* optimizer : optimizers)
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params()) add(p);
  groups_ = optimizer_groups(optimizers);
  std::tie(state_, constants_) = optimizer_state(optimizers);
}

PERF_INLINE std::vector<std::vector<const at::TensorImpl*>> CapturedState::optimizer_groups(
    const std::vector<torch::optim::Optimizer*>& optimizers) {
  std::vector<std::vector<const at::TensorImpl*>> groups;
  for (auto* optimizer : optimizers) {
    for (const auto& group : optimizer->param_groups()) {
      groups.emplace_back();
      for (const auto& p : group.params()) groups.back().push_back(p.unsafeGetTensorImpl());
    }
  }
  return groups;
}

PERF_INLINE std::pair<std::vector<const void*>, std::vector<optim::StepConstant>> CapturedState::optimizer_state(
    const std::vector<torch::optim::Optimizer*>& optimizers) {
  std::pair<std::vector<const void*>, std::vector<optim::StepConstant>> out;
  for (auto* optimizer : optimizers) {
    if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(optimizer)) {
      const auto state = fused->state_addresses();
      const auto constants = fused->step_constants();
      out.first.insert(out.first.end(), state.begin(), state.end());
      out.second.insert(out.second.end(), constants.begin(), constants.end());
    }
  }
  return out;
}

PERF_INLINE std::string CapturedState::changed(torch::nn::Module& module,
                                               const std::vector<torch::optim::Optimizer*>& optimizers,
                                               const GradScaler* scaler) const {
  auto module_name = [&](const torch::nn::Module* m) -> std::string {
    for (const auto& item : module.named_modules("", /*include_self=*/false))
      if (item.value().get() == m) return "module '" + item.key() + "'";
    return "a submodule";
  };
  auto tensor_name = [&](const at::Tensor& t, const char* what) -> std::string {
    for (const auto& item : (std::string(what) == "buffer" ? module.named_buffers() : module.named_parameters()))
      if (item.value().unsafeGetTensorImpl() == t.unsafeGetTensorImpl())
        return std::string(what) + " '" + item.key() + "'";
    return std::string("an optimizer ") + what + " outside the model";
  };
  auto switched = [](bool training) { return std::string(" was switched to ") + (training ? "eval()" : "train()"); };
  if (training_ && module.is_training() != *training_) return "the model" + switched(*training_) + " mode";
  for (const auto& [m, training] : children_) {
    if (m->is_training() != training) return module_name(m.get()) + switched(training) + " mode";
  }
  for (const auto& e : params_) {
    if (!optimizers.empty() && e.tensor.requires_grad() != e.requires_grad)
      return tensor_name(e.tensor, "parameter") + " now has requires_grad=" + (e.requires_grad ? "false" : "true");
    if (e.tensor.data_ptr() != e.data)
      return tensor_name(e.tensor, "parameter") + " was given new storage (torch::load, model->to, set_data)";
  }
  for (const auto& e : buffers_) {
    if (e.tensor.data_ptr() != e.data)
      return tensor_name(e.tensor, "buffer") + " was given new storage (torch::load, model->to)";
  }
  if (scaler != nullptr && scaler_ && scaler_settings(*scaler) != *scaler_)
    return "the GradScaler's growth_factor, backoff_factor or growth_interval changed (torch::load of the scaler)";
  if (optimizers.empty()) return "";
  if (optimizer_groups(optimizers) != groups_) return "the optimizer's param groups changed (add_param_group)";
  const auto [state, constants] = optimizer_state(optimizers);
  if (state != state_) return "the optimizer's state was replaced (torch::load of the optimizer)";
  for (size_t i = 0; i < constants.size() && i < constants_.size(); ++i) {
    if (!detail::same_value(constants[i].value, constants_[i].value)) {
      std::ostringstream os;
      os << "the optimizer's option " << constants[i].option << " of param group " << constants[i].group
         << " changed from " << constants_[i].value << " to " << constants[i].value
         << " (the kernels take it as a host value, which a replay would keep)";
      return os.str();
    }
  }
  return "";
}

#if PERF_WITH_CUDA

PERF_INLINE void stream_wait(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& on) {
  at::cuda::CUDAEvent e;
  e.record(on);
  e.block(waiter);
}

PERF_INLINE cudaStreamCaptureMode to_cuda(CaptureErrorMode m) {
  switch (m) {
    case CaptureErrorMode::global:
      return cudaStreamCaptureModeGlobal;
    case CaptureErrorMode::thread_local_:
      return cudaStreamCaptureModeThreadLocal;
    case CaptureErrorMode::relaxed:
      return cudaStreamCaptureModeRelaxed;
  }
  return cudaStreamCaptureModeThreadLocal;
}

PERF_INLINE CaptureResult capture_on_side_stream(SafeCUDAGraph& graph, const c10::Device& device, int warmup,
                                                 bool check_syncs, CaptureErrorMode mode,
                                                 const std::optional<c10::MempoolId_t>& pool, bool eager_fallback,
                                                 const std::string& who, const std::function<void()>& warm,
                                                 const std::function<void()>& body,
                                                 const std::function<void()>& after_warmup) {
  c10::cuda::CUDAGuard device_guard(device.index());
  const auto main = c10::cuda::getCurrentCUDAStream(device.index());
  const auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  AutocastCacheOff no_cache;
  auto fallback = [&](const std::string& what) {
    TORCH_WARN(who, ": ", what, "; running eagerly as eager_fallback(true) asks");
    return CaptureResult::fell_back;
  };
  stream_wait(side, main);
  {
    c10::cuda::CUDAStreamGuard g(side);
    for (int i = 0; i < warmup; ++i) {
      const bool checked = check_syncs && i + 1 == warmup;
      try {
        std::optional<SyncDebugGuard> sync_errors;
        if (checked) sync_errors.emplace(c10::cuda::SyncDebugMode::L_ERROR);
        warm();
      } catch (const std::exception& e) {
        const bool sync = checked && first_line(e).find("synchronizing CUDA operation") != std::string::npos;
        if (sync && eager_fallback) {
          stream_wait(main, side);
          return fallback("a host-device sync in the captured code (" + first_line(e) + ")");
        }
        rethrow_with_context(sync ? who +
                                        ": the code to capture makes a host-device sync, which a CUDA graph cannot "
                                        "contain (found in the last warm-up call, before capture, with sync-debug "
                                        "mode \"error\"). " +
                                        capture_hint()
                                  : who + ": failed in warm-up call " + std::to_string(i + 1) + " of " +
                                        std::to_string(warmup) + ", before capture (an error of the code itself)");
      }
    }
  }
  stream_wait(main, side);
  c10::cuda::device_synchronize();
  if (after_warmup) after_warmup();
  // As torch.cuda.graph does before it captures (torch/cuda/graphs.py, __enter__): give back
  // what the warm-up left cached. The capture allocates from its own pool, where those cached
  // blocks cannot serve it, and the allocator frees no cached block while a capture is under
  // way; kept, they would leave a step whose working set is over half the free memory out of
  // memory under capture. The pinned host cache likewise.
  c10::cuda::CUDACachingAllocator::emptyCache();
  at::getHostAllocator(at::kCUDA)->empty_cache();
  const c10::MempoolId_t pool_id = pool.value_or(at::cuda::graph_pool_handle());  // explicit: abandon() knows it
  {
    c10::cuda::CUDAStreamGuard g(side);
    // cuDNN's benchmark mode off while capturing, back on after. The warm-up has
    // autotuned every convolution and cached its plan (per thread, for these shapes);
    // a cached plan runs as it would with the mode on. But a convolution whose cached
    // plan cannot get its workspace under capture, or that finds none cached, would with
    // the mode on benchmark again (aten/src/ATen/native/cudnn/Conv_v8.cpp,
    // run_single_conv: timed runs and syncs, which a capture cannot contain) and fail
    // the capture inside the convolution; with it off, it takes the first heuristic
    // plan whose workspace fits.
    CudnnBenchmarkOff heuristic_plans;
    graph.capture_begin(pool_id, to_cuda(mode));
    try {
      body();
      graph.capture_end();
    } catch (const std::exception& e) {
      const std::string what = first_line(e);
      TORCH_CHECK(graph.abandon(), who, ": CUDA graph capture failed (", what,
                  ") and left CUDA in a state perf could not repair (stream still capturing or generator still in "
                  "capture); the process must restart before it uses CUDA again");
      if (eager_fallback) {
        stream_wait(main, side);
        return fallback("CUDA graph capture failed (" + what + ")");
      }
      rethrow_with_context(who + ": CUDA graph capture failed. " + capture_hint());
    }
  }
  stream_wait(main, side);
  return CaptureResult::captured;
}

#endif

}  // namespace detail

PERF_INLINE c10::MempoolId_t graph_pool_handle() {
#if PERF_WITH_CUDA
  if (c10::cuda::device_count() > 0) return at::cuda::graph_pool_handle();
#endif
  return {0, 0};
}

PERF_INLINE TrainStep::TrainStep(ModuleRef module, LossFn loss_fn, Optimizers optimizers,
                                 const at::Tensor& example_input, const at::Tensor& example_target,
                                 const TrainStepOptions& options)
    : module_(std::move(module)), opts_(optimizers.list()), options_(options) {
  TORCH_CHECK(loss_fn, "perf::TrainStep: empty loss function");
  TORCH_CHECK(example_input.defined() && example_target.defined(), "perf::TrainStep: undefined example tensors");
  loss_fn_ = [f = std::move(loss_fn)](const std::vector<at::Tensor>& b) {
    return std::vector<at::Tensor>{f(b[0], b[1])};
  };
  init({example_input, example_target});
}

PERF_INLINE TrainStep::TrainStep(ModuleRef module, LossFn loss_fn, Optimizers optimizers, const Example& first_batch,
                                 const TrainStepOptions& options)
    : TrainStep(std::move(module), std::move(loss_fn), std::move(optimizers), first_batch.data, first_batch.target,
                options) {}

PERF_INLINE TrainStep::TrainStep(ModuleRef module, BatchLossFn loss_fn, Optimizers optimizers,
                                 std::vector<at::Tensor> example_batch, const TrainStepOptions& options)
    : module_(std::move(module)), opts_(optimizers.list()), options_(options) {
  TORCH_CHECK(loss_fn, "perf::TrainStep: empty loss function");
  loss_fn_ = [f = std::move(loss_fn)](const std::vector<at::Tensor>& b) { return std::vector<at::Tensor>{f(b)}; };
  init(std::move(example_batch));
}

PERF_INLINE TrainStep::TrainStep(ModuleRef module, LossAndOutputsFn loss_fn, Optimizers optimizers,
                                 std::vector<at::Tensor> example_batch, const TrainStepOptions& options)
    : module_(std::move(module)), loss_fn_(std::move(loss_fn)), opts_(optimizers.list()), options_(options) {
  TORCH_CHECK(loss_fn_, "perf::TrainStep: empty loss function");
  init(std::move(example_batch));
}

PERF_INLINE TrainStep::TrainStep(const char* who, const char* options_name, ModuleRef module, MicroStep micro,
                                 Optimizers optimizers, std::vector<at::Tensor> example_batch,
                                 const TrainStepOptions& options)
    : who_(who),
      options_name_(options_name),
      module_(std::move(module)),
      micro_(std::move(micro)),
      opts_(optimizers.list()),
      options_(options) {
  init(std::move(example_batch));
}

PERF_INLINE void TrainStep::check_batch(const std::vector<at::Tensor>& batch, bool shapes) const {
  TORCH_CHECK(batch.size() == static_batch_.size(), who_, "::step: expected ", static_batch_.size(),
              " batch tensors like the example, got ", batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& x = batch[i];
    const auto& fixed = static_batch_[i];
    TORCH_CHECK(x.defined() && x.scalar_type() == fixed.scalar_type() && (!shapes || x.sizes() == fixed.sizes()) &&
                    (shapes || x.dim() == fixed.dim()),
                who_, "::step: batch tensor ", i, " must be ", fixed.scalar_type(), " ", detail::shape_str(fixed),
                " like the example (static shapes), got ",
                x.defined() ? std::string(c10::toString(x.scalar_type())) + " " + detail::shape_str(x)
                            : std::string("undefined"),
                shapes ? "; use step_eager() for a batch of another size (e.g. an epoch's last)" : "");
  }
}

PERF_INLINE bool TrainStep::is_partial_batch(const std::vector<at::Tensor>& batch) const {
  if (batch.size() != static_batch_.size()) return false;
  const int64_t full = static_batch_[0].dim() >= 1 ? static_batch_[0].size(0) : -1;
  const int64_t n = batch[0].defined() && batch[0].dim() >= 1 ? batch[0].size(0) : -1;
  if (full < 1 || n < 1 || n >= full) return false;
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& x = batch[i];
    const auto& e = static_batch_[i];
    if (!x.defined() || x.dim() != e.dim() || e.size(0) != full || x.size(0) != n ||
        x.sizes().slice(1) != e.sizes().slice(1) || x.scalar_type() != e.scalar_type())
      return false;
  }
  return true;
}

PERF_INLINE void TrainStep::init(std::vector<at::Tensor> example) {
  const std::string& opts = options_name_;
  TORCH_CHECK(!example.empty(), who_, ": the example batch is empty");
  TORCH_CHECK(options_.warmup() >= 1, opts,
              "::warmup: must be >= 1 (the optimizer state must exist before capture), got ", options_.warmup());
  const int64_t k = options_.accumulation_steps();
  TORCH_CHECK(k >= 1, opts, "::accumulation_steps: must be >= 1, got ", k);
  if (options_.max_grad_norm()) {
    TORCH_CHECK(*options_.max_grad_norm() > 0, opts, "::max_grad_norm: must be > 0, got ", *options_.max_grad_norm());
  }
  fused_ = detail::check_step_optimizers(who_, opts_);
  const auto device = example[0].device();
  for (size_t i = 0; i < example.size(); ++i) {
    TORCH_CHECK(example[i].defined(), who_, ": example batch tensor ", i, " is undefined");
    TORCH_CHECK(example[i].device() == device, who_, ": example batch tensor ", i, " is on ", example[i].device(),
                " but tensor 0 is on ", device);
    if (k > 1) {
      TORCH_CHECK(example[i].dim() >= 1 && example[i].size(0) % k == 0, who_, ": accumulation_steps(", k,
                  ") needs every batch tensor's dim 0 divisible by ", k, "; tensor ", i, " has shape ",
                  detail::shape_str(example[i]));
    }
    static_batch_.push_back(example[i].clone());
  }

  if (!device.is_cuda() || !options_.graph()) {
    if (!loss_fn_) return;  // a compiled step: its package checked the batch
    // Eager. Run the loss once now, so a wrong target dtype or shape fails here
    // rather than at the first step(); the forward's side effects are undone.
    detail::ForwardSnapshot snapshot(*module_, static_batch_);
    try {
      at::NoGradGuard no_grad;
      const auto result = loss_fn_(static_batch_);
      const at::Tensor loss = result.empty() ? at::Tensor() : result[0];
      TORCH_CHECK(loss.defined() && loss.numel() == 1 && at::isFloatingType(loss.scalar_type()),
                  "perf::TrainStep: the loss function must return a floating-point scalar, got ",
                  loss.defined() ? std::string(c10::toString(loss.scalar_type())) + " " + detail::shape_str(loss)
                                 : std::string("undefined"));
      detail::check_step_outputs(result, options_.accumulation_steps());
    } catch (const std::exception&) {
      snapshot.restore();
      detail::rethrow_with_context("perf::TrainStep: the loss function failed on the example batch");
    }
    snapshot.restore();
    return;
  }
#if PERF_WITH_CUDA
  if (std::find(fused_.begin(), fused_.end(), nullptr) != fused_.end()) {
    TORCH_CHECK(options_.eager_fallback(), who_,
                ": a torch::optim optimizer cannot be captured in a CUDA graph (it keeps the step count and bias "
                "corrections on the host, so every replay would repeat the captured step); use "
                "perf::optim::AdamW, Adam, SGD or Muon, graph(false), or eager_fallback(true) to run eagerly");
    TORCH_WARN(who_, ": torch::optim optimizer: running eagerly as eager_fallback(true) asks");
    return;
  }
  capture_graph();
#endif
}

PERF_INLINE void TrainStep::capture_graph() {
#if PERF_WITH_CUDA
  const auto device = static_batch_[0].device();
  // Warm-up with the update skipped on the device: optimizer state and lr
  // tensors are created, nothing trains. Then undo what the forward changed.
  detail::ForwardSnapshot snapshot(*module_, static_batch_);
  std::optional<std::pair<double, int64_t>> scaler_before;
  if (auto* s = options_.scaler()) scaler_before = std::make_pair(s->get_scale(), s->growth_tracker());
  auto restore = [&] {
    snapshot.restore();
    if (auto* s = options_.scaler(); s && scaler_before) s->restore_(scaler_before->first, scaler_before->second);
  };
  // The optimizer's parameters: the step sets their gradients to none (zeroes a flat buffer) first. The other
  // parameters the step accumulates into, as an eager backward does, and so does the warm-up: what they hold now
  // (a copy) comes back after the capture, whether it failed or not.
  std::unordered_set<const c10::TensorImpl*> seen;  // the optimizers', then each other once
  for (auto* opt : opts_)
    for (auto& g : opt->param_groups())
      for (auto& p : g.params()) seen.insert(p.unsafeGetTensorImpl());
  std::vector<std::pair<at::Tensor, at::Tensor>> others;  // (parameter, a copy of its gradient, or none)
  for (auto& p : (*module_).parameters(/*recurse=*/true)) {
    if ((p.requires_grad() || p.grad().defined()) && seen.insert(p.unsafeGetTensorImpl()).second)
      others.emplace_back(p, p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
  }
  // A capture that fails after its backward began leaves gradients allocated in the abandoned graph pool, whose
  // kernels never ran: uninitialized memory. Cleared as the step's zero_grad() clears them (a flat optimizer's
  // views zeroed in place), and the others given back what they held, so that a program that catches the error
  // and then trains eagerly adds nothing to garbage. After a capture that succeeded, the same: the gradients are
  // no step's until the first replay.
  auto clear_grads = [&]() noexcept {
    try {
      at::NoGradGuard no_grad;
      for (auto* fused : fused_) fused->zero_grad();
      for (auto& [p, before] : others) p.mutable_grad() = before;
    } catch (const std::exception&) {  // CUDA left broken: the capture's own error says so
    }
  };
  auto graph = std::make_unique<detail::SafeCUDAGraph>();
  detail::CaptureResult result{};
  try {
    result = detail::capture_on_side_stream(
        *graph, device, options_.warmup(), options_.check_syncs(), options_.capture_error_mode(), options_.pool(),
        options_.eager_fallback(), who_,
        [&] {
          detail::SkipUpdates skip(fused_);
          body(static_batch_);
        },
        [&] { static_loss_ = body(static_batch_); },  // capture records kernels, runs none
        restore);
  } catch (const std::exception&) {
    restore();
    clear_grads();
    extras_ = {};
    throw;
  }
  if (result == detail::CaptureResult::captured) {
    graph_ = std::move(graph);
    graphed_ = true;
    ++captures_;
    captured_ = std::make_unique<detail::CapturedState>(*module_, opts_, /*training_modes=*/!micro_, options_.scaler());
    // Every replay writes the gradients the capture allocated, whatever .grad() holds by then: kept, and put back
    // before each step (a zero_grad() between steps would otherwise leave .grad() undefined or stale, and free
    // blocks the graph still writes into its pool); one the replays accumulate into is given what .grad() holds
    // then (restore_static_grads).
    static_extras_ = extras_;
    static_grads_.clear();
    for (auto* opt : opts_)
      for (auto& g : opt->param_groups())
        for (auto& p : g.params())
          if (p.grad().defined()) static_grads_.push_back({p, p.grad(), /*accumulates=*/false});
    for (auto& [p, before] : others)
      if (p.grad().defined()) static_grads_.push_back({p, p.grad(), /*accumulates=*/true});
    clear_grads();
  } else {
    restore();  // fell back (maybe before warm-up finished): eager from the original state
    clear_grads();
  }
  extras_ = {};  // the warm-up's or the capture's: not a step's
#endif
}

PERF_INLINE at::Tensor TrainStep::backward_micro(const std::vector<at::Tensor>& micro, double divisor,
                                                 std::vector<at::Tensor>& outputs) {
  const auto result = loss_fn_(micro);
  TORCH_CHECK(!result.empty() && result[0].defined() && result[0].numel() == 1,
              "perf::TrainStep: the loss function must return a scalar");
  detail::check_step_outputs(result, options_.accumulation_steps());
  const at::Tensor& loss = result[0];
  at::Tensor part = !detail::same_value(divisor, 1.0) ? loss / divisor : loss;
  auto* scaler = options_.scaler();
  (scaler ? scaler->scale(part) : part).backward();
  for (size_t i = 1; i < result.size(); ++i) outputs.push_back(result[i].detach());
  return part.detach();
}

PERF_INLINE at::Tensor TrainStep::body(const std::vector<at::Tensor>& batch) {
  // Set to none: in a capture, the step allocates the static grads in the graph's
  // pool; a flat optimizer zeroes its gradient buffer in place instead.
  for (size_t o = 0; o < opts_.size(); ++o) {
    if (fused_[o]) {
      fused_[o]->zero_grad();
    } else {
      opts_[o]->zero_grad();
    }
  }
  // Each micro-batch's loss divided by its share of the rows (k for equal ones).
  const auto micro = detail::micro_batches(batch, options_.accumulation_steps());
  auto* scaler = options_.scaler();
  at::Tensor total;
  std::vector<std::vector<at::Tensor>> outputs(micro.size());
  for (size_t i = 0; i < micro.size(); ++i) {
    const auto& m = micro[i];
    const double divisor =
        micro.size() == 1 ? 1.0 : static_cast<double>(batch.front().size(0)) / static_cast<double>(m.front().size(0));
    at::Tensor part = micro_ ? micro_(m, divisor) : backward_micro(m, divisor, outputs[i]);
    total = total.defined() ? total + part : part;
  }
  extras_.outputs = outputs.size() == 1 ? std::move(outputs[0]) : detail::cat_step_outputs(outputs);
  if (options_.max_grad_norm()) {
    std::vector<at::Tensor> params;
    for (auto* opt : opts_) {
      for (auto& g : opt->param_groups())
        for (auto& p : g.params()) params.push_back(p);
      if (scaler) scaler->unscale_(*opt);
    }
    extras_.grad_norm = clip_grad_norm_(params, *options_.max_grad_norm());
  }
  for (auto* opt : opts_) {
    if (scaler) {
      scaler->step(*opt);
    } else {
      opt->step();
    }
  }
  if (scaler) scaler->update();
  return total;
}

PERF_INLINE at::Tensor TrainStep::step(const std::vector<at::Tensor>& batch) {
  bool same = batch.size() == static_batch_.size();
  for (size_t i = 0; same && i < batch.size(); ++i)
    same = batch[i].defined() && batch[i].sizes() == static_batch_[i].sizes();
  if (!same && is_partial_batch(batch)) {  // an epoch's last batch: trained eagerly, counted
    ++eager_steps_;
    return step_eager(batch);
  }
  check_batch(batch, /*shapes=*/true);
#if PERF_WITH_CUDA
  if (graphed_) {
    if (const auto why = captured_->changed(*module_, opts_, options_.scaler()); !why.empty()) {
      TORCH_WARN(who_, ": ", why, " since the step was captured, which its replays would ignore: capturing it again");
      c10::cuda::device_synchronize();  // the last replay has finished with the graph and its pool
      static_grads_.clear();
      graph_.reset();  // its memory goes back before the new capture takes some
      graphed_ = false;
      replayed_ = false;
      static_loss_ = at::Tensor();
      static_extras_ = {};
      captured_.reset();
      capture_graph();
    }
  }
#endif
  if (!graphed_) return step_eager(batch);
#if PERF_WITH_CUDA
  for (size_t i = 0; i < batch.size(); ++i) static_batch_[i].copy_(batch[i], /*non_blocking=*/true);
  restore_static_grads();
  for (auto* fused : fused_) fused->sync_lr();  // outside the graph: the schedulers' current lr
  graph_->replay();
  replayed_ = true;
#endif
  return static_loss_.clone();  // the caller's: the next replay overwrites static_loss_
}

PERF_INLINE at::Tensor TrainStep::step_eager(const std::vector<at::Tensor>& batch) {
  check_batch(batch, /*shapes=*/false);
  const int64_t k = options_.accumulation_steps();
  std::vector<at::Tensor> on_device;
  for (size_t i = 0; i < batch.size(); ++i) {
    TORCH_CHECK(k == 1 || (batch[i].dim() >= 1 && batch[i].size(0) >= 1), who_, "::step_eager: accumulation_steps(", k,
                ") splits dim 0; batch tensor ", i, " has shape ", detail::shape_str(batch[i]));
    on_device.push_back(batch[i].to(static_batch_[i].device(), /*non_blocking=*/true));
  }
  replayed_ = false;
  if (!graphed_) {
    static_loss_ = body(on_device);  // a fresh tensor each step: the caller's already
    return static_loss_;
  }
  restore_static_grads();  // flat: views again, zeroed in place rather than copied back after the backward
  return body(on_device);
}

PERF_INLINE at::Tensor TrainStep::grad_norm() const {
  TORCH_CHECK(options_.max_grad_norm(), who_,
              "::grad_norm: the step computes the gradient norm only where it clips; set ", options_name_,
              "().max_grad_norm(x) (infinity measures it without clipping)");
  const at::Tensor& norm = (replayed_ ? static_extras_ : extras_).grad_norm;
  TORCH_CHECK(norm.defined(), who_, ": grad_norm() before the first step()");
  return norm.clone();  // the caller's: the next replay overwrites the graph's
}

PERF_INLINE std::vector<at::Tensor> TrainStep::outputs() const {
  const auto& outs = (replayed_ ? static_extras_ : extras_).outputs;
  TORCH_CHECK(outs.has_value(), who_, ": outputs() before the first step()");
  if (!replayed_) return *outs;  // an eager step's: fresh tensors, the caller's already
  std::vector<at::Tensor> copies;
  copies.reserve(outs->size());
  for (const auto& t : *outs) copies.push_back(t.clone());  // the next replay overwrites the graph's
  return copies;
}

PERF_INLINE void TrainStep::restore_static_grads() {
  for (auto& e : static_grads_) {
    const at::Tensor& now = e.param.grad();
    if (now.unsafeGetTensorImpl() == e.grad.unsafeGetTensorImpl()) continue;
    if (e.accumulates) {  // the replay adds to it: what an eager backward would add to
      at::NoGradGuard no_grad;
      if (now.defined()) {
        e.grad.copy_(now);
      } else {
        e.grad.zero_();
      }
    }
    e.param.mutable_grad() = e.grad;
  }
}

}  // namespace perf
