// perf/impl/cuda_graph-inl.h — the out-of-line definitions of perf/cuda_graph.h.
// Included by perf/cuda_graph.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <ATen/autocast_mode.h>
#include <perf/cuda_graph.h>
#include <perf/detail/cuda.h>
#include <perf/detail/ddp_registry.h>
#include <perf/detail/rng.h>

#if PERF_WITH_CUDA
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace perf {

namespace detail {

template <typename Out>
std::vector<at::Tensor> to_vec(Out out) {
  if constexpr (std::is_same_v<Out, at::Tensor>) {
    return {std::move(out)};
  } else {
    return out;
  }
}

template <typename Out>
Out from_vec(std::vector<at::Tensor> v) {
  if constexpr (std::is_same_v<Out, at::Tensor>) {
    return std::move(v.front());
  } else {
    return v;
  }
}

// Turns the autocast weight cache off for a scope (and empties it): cached
// low-precision copies made during capture would be baked into the graph.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : prev_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::clear_cache();
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(prev_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool prev_;
};

// Keeps an optimizer's updates skipped on the device for a scope.
class SkipUpdates {
 public:
  explicit SkipUpdates(std::vector<optim::FusedOptimizer*> opts) : opts_(std::move(opts)) {
    for (auto* opt : opts_)
      if (opt) opt->skip_updates(true);
  }
  ~SkipUpdates() {
    for (auto* opt : opts_)
      if (opt) opt->skip_updates(false);
  }
  SkipUpdates(const SkipUpdates&) = delete;
  SkipUpdates& operator=(const SkipUpdates&) = delete;

 private:
  std::vector<optim::FusedOptimizer*> opts_;
};

// What a forward pass mutates outside the parameters: buffers (BatchNorm
// running statistics, counters) and the default generators. Small next to a
// copy of the parameters and optimizer state.
class ForwardSnapshot {
 public:
  ForwardSnapshot(torch::nn::Module& module, const std::vector<at::Tensor>& on_devices) {
    at::NoGradGuard no_grad;
    for (auto& b : module.buffers()) {
      if (!b.defined()) continue;
      live_.push_back(b);
      saved_.push_back(b.detach().clone());
    }
    rng_ = current_rng(on_devices);
  }
  void restore() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < live_.size(); ++i) live_[i].detach().copy_(saved_[i]);
    swap_rng(rng_);
  }

 private:
  std::vector<at::Tensor> live_, saved_;
  RngStates rng_;
};

#if PERF_WITH_CUDA
// `waiter` waits for the work queued so far on `on`, without a host sync.
PERF_INLINE void stream_wait(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& on);

PERF_INLINE cudaStreamCaptureMode to_cuda(CaptureErrorMode m);

// at::cuda::CUDAGraph that can abandon a failed capture. In LibTorch 2.11,
// capture_end() throws at cudaStreamEndCapture before it ends the allocator's
// routing to the graph's pool and the generator's capture, which leaves every
// later RNG op failing ("Offset increment outside graph capture") and the
// caching allocator deferring cross-stream frees forever. abandon() finishes
// those steps from the state the base class keeps (protected members).
class SafeCUDAGraph : public at::cuda::CUDAGraph {
 public:
  // Call once after capture_begin() succeeded and the body or capture_end() threw.
  // Returns false when CUDA is left in a state perf cannot repair.
  bool abandon() noexcept {
    if (capture_ended_) return true;  // failed after a complete capture: ~CUDAGraph cleans up
    bool healthy = true;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(capture_stream_.stream(), &status) == cudaSuccess &&
        status != cudaStreamCaptureStatusNone) {
      cudaGraph_t partial = nullptr;
      (void)cudaStreamEndCapture(capture_stream_.stream(), &partial);  // ends an invalidated capture too
      if (partial != nullptr) (void)cudaGraphDestroy(partial);
    }
    (void)cudaGetLastError();  // capture errors are not sticky; clear the last one
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12
    // What CUDAGeneratorState::capture_epilogue() does (it is not exported):
    // the generator leaves capture mode; the graph's offset increment is moot.
    for (auto& entry : captured_generator_states_) entry.first->capturing_ = false;
#else
    // LibTorch 2.12+ keeps a generator's capture state per capture: what
    // CUDAGeneratorState::remove_capture_state() (not exported) does for it.
    for (auto& entry : captured_generator_states_) {
      std::lock_guard<std::mutex> lock(entry.first->capture_states_mutex_);
      entry.first->capture_states_.erase(capture_id_);
    }
#endif
    try {  // throws if capture_end() already stopped the routing
      c10::cuda::CUDACachingAllocator::endAllocateToPool(capture_dev_, mempool_id_);
    } catch (const std::exception&) {
    }
    try {
      c10::cuda::CUDACachingAllocator::releasePool(capture_dev_, mempool_id_);  // capture_begin's reference
    } catch (const std::exception&) {
      healthy = false;
    }
    try {  // pinned-memory pool: release only if the capture was still routing to it
      auto* host = at::getHostAllocator(at::kCUDA);
      host->end_allocate_to_pool(mempool_id_);
      host->release_pool(mempool_id_);
    } catch (const std::exception&) {
    }
    status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(capture_stream_.stream(), &status) != cudaSuccess ||
        status != cudaStreamCaptureStatusNone)
      healthy = false;
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12
    for (auto& entry : captured_generator_states_) healthy = healthy && !entry.first->capturing_;
#endif
    return healthy;
  }
};

// How a capture ended: captured, or failed in a way eager_fallback may cover.
enum class CaptureResult { captured, fell_back };

// Warm-up calls of `warm` on a side stream (the last one with host syncs
// reported as errors), then `after_warmup` (if any, outside any capture), then
// captures `body` into `graph`. `who` names the
// caller in errors. Errors in warm-up are the function's own and always
// propagate; a host sync found in warm-up, or a failed capture, propagates
// unless `eager_fallback`, in which case it warns and returns fell_back.
PERF_INLINE CaptureResult capture_on_side_stream(SafeCUDAGraph& graph, const c10::Device& device, int warmup,
                                                 bool check_syncs, CaptureErrorMode mode,
                                                 const std::optional<c10::MempoolId_t>& pool, bool eager_fallback,
                                                 const std::string& who, const std::function<void()>& warm,
                                                 const std::function<void()>& body,
                                                 const std::function<void()>& after_warmup = nullptr);
#endif

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
                    "capture that. Give the step the process group instead of the DDP wrapper (its options' "
                    ".data_parallel(pg): the step averages the gradients itself), or train with an eager step: "
                    "loss_fn(ddp(x), y).backward(); opt.step()");
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

PERF_INLINE TrainStep::TrainStep(TrainStep&&) noexcept = default;
PERF_INLINE TrainStep& TrainStep::operator=(TrainStep&&) noexcept = default;
PERF_INLINE TrainStep::~TrainStep() = default;

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
  // A compiled step started its group at its own construction.
  if (const auto& dp = options_.data_parallel(); dp && !micro_) dp->start(*module_, who_.c_str());
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
  const auto& dp = options_.data_parallel();
  if (dp) dp->sync_buffers(*module_);
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
  if (dp) average_gradients(*dp);
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

// The optimizers' gradients averaged across the ranks, as DDP leaves them after backward: still scaled (a scaler
// unscales them next), a flat optimizer's buffer as one tensor.
PERF_INLINE void TrainStep::average_gradients(const detail::DataParallel& dp) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (auto* opt : opts_) {
    for (auto& g : opt->param_groups()) {
      for (auto& p : g.params()) {
        if (!p.requires_grad()) continue;
        TORCH_CHECK(p.grad().defined(), who_, ": data_parallel: a parameter of shape ", detail::shape_str(p),
                    " got no gradient in this step on rank ", dp.rank(),
                    "; every rank averages the gradients of all the optimizers' trainable parameters, so each must "
                    "get one in every step (as Python's DDP requires without find_unused_parameters): freeze it "
                    "(requires_grad(false)) on every rank before the step is built, or leave it out of the optimizer");
        grads.push_back(p.grad());
      }
    }
  }
  dp.average(optim::detail::coalesce_flat(grads));
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

// --------------------------------------------------------------------------- graph

template <typename Out>
struct Graphed<Out>::Bucket {
  int64_t batch = -1;
  std::vector<at::Tensor> in, out;
#if PERF_WITH_CUDA
  std::unique_ptr<detail::SafeCUDAGraph> graph;
#endif
};

template <typename Out>
Graphed<Out>::Graphed(Graphed&&) noexcept = default;
template <typename Out>
Graphed<Out>& Graphed<Out>::operator=(Graphed&&) noexcept = default;
template <typename Out>
Graphed<Out>::~Graphed() = default;

template <typename Out>
Graphed<Out>::Graphed(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options,
                      std::optional<ModuleRef> module)
    : fn_(std::move(fn)), options_(options), examples_(std::move(examples)), module_(std::move(module)) {
  TORCH_CHECK(fn_, "perf::graph: empty function");
  TORCH_CHECK(!examples_.empty(), "perf::graph: needs at least one example input");
  TORCH_CHECK(options_.warmup() >= 0, "perf::GraphOptions::warmup: must be >= 0, got ", options_.warmup());
  const auto device = examples_[0].device();
  for (size_t i = 0; i < examples_.size(); ++i) {
    TORCH_CHECK(examples_[i].defined(), "perf::graph: example input ", i, " is undefined");
    TORCH_CHECK(examples_[i].device() == device, "perf::graph: example input ", i, " is on ", examples_[i].device(),
                " but input 0 is on ", device, "; a CUDA graph needs every input on its device");
  }
  std::vector<int64_t> sizes = options_.batch_sizes();
  bucketed_ = !sizes.empty();
  if (bucketed_) {
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    TORCH_CHECK(sizes.front() >= 1, "perf::GraphOptions::batch_sizes: must be >= 1, got ", sizes.front());
    for (size_t i = 0; i < examples_.size(); ++i) {
      TORCH_CHECK(examples_[i].dim() >= 1 && examples_[i].size(0) == examples_[0].size(0),
                  "perf::graph: with batch_sizes every example input needs the same batch size in dim 0 (input ", i,
                  " has shape ", detail::shape_str(examples_[i]), ")");
    }
  } else {
    sizes = {-1};
  }
  bool cuda = device.is_cuda();
#if !PERF_WITH_CUDA
  TORCH_CHECK(!cuda, "perf::graph: CUDA inputs but perf was built without CUDA (PERF_WITH_CUDA=0)");
#endif
  for (int64_t b : sizes) {
    auto bucket = std::make_unique<Bucket>();
    bucket->batch = b;
    for (const auto& e : examples_) {
      if (b < 0) {
        bucket->in.push_back(e.clone());
        continue;
      }
      auto shape = e.sizes().vec();
      shape[0] = b;
      auto t = at::zeros(shape, e.options());
      const int64_t rows = std::min<int64_t>(b, e.size(0));
      t.narrow(0, 0, rows).copy_(e.narrow(0, 0, rows));
      bucket->in.push_back(t);
    }
    buckets_.push_back(std::move(bucket));
  }
  capture_all(cuda, options_.pool() ? *options_.pool() : graph_pool_handle());
}

template <typename Out>
void Graphed<Out>::capture_all(bool cuda, const c10::MempoolId_t& pool) {
  std::optional<detail::ForwardSnapshot> snapshot;
  if (module_) {
    if (bucketed_) detail::check_padding_allowed(**module_);
    // Warm-up and capture run the forward: a train()-mode module (BatchNorm
    // statistics, dropout's generator) is left as it was before them.
    snapshot.emplace(**module_, examples_);
  }
  try {
    capture_buckets(cuda, pool);
  } catch (const std::exception&) {
    if (snapshot) snapshot->restore();
    throw;
  }
  if (snapshot) snapshot->restore();
  if (graphed_) {
    ++captures_;
    if (module_)
      captured_ = std::make_unique<detail::CapturedState>(**module_, std::vector<torch::optim::Optimizer*>(),
                                                          /*training_modes=*/true);
  }
}

template <typename Out>
void Graphed<Out>::capture_buckets(bool cuda, const c10::MempoolId_t& pool) {
  // Capture the largest bucket first; the smaller ones reuse its pool memory.
  graphed_ = cuda;
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
    if (graphed_ && !capture(**it, pool)) {
      graphed_ = false;  // eager_fallback: every bucket runs eagerly
#if PERF_WITH_CUDA
      for (auto& b : buckets_) b->graph.reset();
#endif
    }
    if (!graphed_) {
      at::NoGradGuard no_grad;
      detail::AutocastCacheOff no_cache;
      try {
        (*it)->out = detail::to_vec<Out>(fn_((*it)->in));
      } catch (const std::exception&) {
        detail::rethrow_with_context("perf::graph: the function failed on the example inputs");
      }
    }
    if (bucketed_) {
      for (size_t k = 0; k < (*it)->out.size(); ++k) {
        const auto& o = (*it)->out[k];
        TORCH_CHECK(o.dim() >= 1 && o.size(0) == (*it)->batch, "perf::graph: output ", k, " has shape ",
                    detail::shape_str(o), ", not batch ", (*it)->batch,
                    " in dim 0; padded batches would change it. Capture exact shapes (no batch_sizes) instead.");
      }
    }
  }
}

template <typename Out>
bool Graphed<Out>::capture(Bucket& b, const c10::MempoolId_t& pool) {
#if PERF_WITH_CUDA
  at::NoGradGuard no_grad;
  b.graph = std::make_unique<detail::SafeCUDAGraph>();
  const auto result = detail::capture_on_side_stream(
      *b.graph, b.in[0].device(), options_.warmup(), options_.check_syncs(), options_.capture_error_mode(), pool,
      options_.eager_fallback(), "perf::graph", [&] { fn_(b.in); }, [&] { b.out = detail::to_vec<Out>(fn_(b.in)); });
  if (result == detail::CaptureResult::captured) return true;
  b.graph.reset();
  return false;
#else
  (void)b;
  (void)pool;
  return false;
#endif
}

template <typename Out>
std::vector<int64_t> Graphed<Out>::buckets() const {
  std::vector<int64_t> out;
  if (!bucketed_) return out;
  for (const auto& b : buckets_) out.push_back(b->batch);
  return out;
}

template <typename Out>
Out Graphed<Out>::call_eager(const std::vector<at::Tensor>& inputs) {
  at::NoGradGuard no_grad;
  ++eager_calls_;
  return fn_(inputs);
}

template <typename Out>
Out Graphed<Out>::operator()(const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(inputs.size() == examples_.size(), "perf::graph: expected ", examples_.size(), " inputs, got ",
              inputs.size());
  int64_t batch = -1;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& x = inputs[i];
    const auto& e = examples_[i];
    TORCH_CHECK(x.defined() && x.device() == e.device() && x.scalar_type() == e.scalar_type() && x.dim() == e.dim(),
                "perf::graph: input ", i, " must be a ", e.dim(), "-D ", e.scalar_type(), " tensor on ", e.device(),
                " like its example, got ", x.defined() ? detail::shape_str(x) : "undefined");
    if (bucketed_) {
      TORCH_CHECK(x.sizes().slice(1) == e.sizes().slice(1), "perf::graph: input ", i, " has shape ",
                  detail::shape_str(x), "; only dim 0 (the batch) may differ from the example ", detail::shape_str(e));
      TORCH_CHECK(batch < 0 || x.size(0) == batch, "perf::graph: inputs have different batch sizes (", batch, " and ",
                  x.size(0), ")");
      batch = x.size(0);
    } else {
      TORCH_CHECK(x.sizes() == e.sizes(), "perf::graph: input ", i, " has shape ", detail::shape_str(x),
                  " but the graph was captured for ", detail::shape_str(e),
                  "; use GraphOptions().batch_sizes(...) for varying batch sizes");
    }
  }
  TORCH_CHECK(calls_ != nullptr, "perf::graph: called after it was moved from");
  // One call at a time: two would copy into the same static inputs and read the same static outputs (and
  // replay graphs that share one pool), each getting the other's result.
  std::lock_guard<std::mutex> one_call(*calls_);
#if PERF_WITH_CUDA
  if (examples_[0].is_cuda()) {
    // The last call's replay and output copies may still run on its stream: this call's copies into the same
    // static inputs wait for them there, without a host sync. Calls from one stream are in order already.
    const auto stream = c10::cuda::getCurrentCUDAStream(examples_[0].device().index());
    if (last_stream_ && *last_stream_ != stream) detail::stream_wait(stream, *last_stream_);
    last_stream_ = stream;
  }
#endif
  // Eager calls pad too (graphed: a mode change captures again, which checks).
  if (bucketed_ && module_ && !graphed_) detail::check_padding_allowed(**module_);
#if PERF_WITH_CUDA
  if (graphed_ && captured_) {
    if (const auto why = captured_->changed(**module_, {}); !why.empty()) {
      TORCH_WARN("perf::graph: ", why, " since the graph was captured, which its replays would ignore: capturing ",
                 "it again");
      c10::cuda::device_synchronize();  // the last replay has finished with the graphs and their pool
      for (auto& b : buckets_) b->graph.reset();
      captured_.reset();
      capture_all(true, options_.pool() ? *options_.pool() : graph_pool_handle());
    }
  }
#endif
  Bucket* bucket = buckets_.front().get();
  if (bucketed_) {
    auto it = std::find_if(buckets_.begin(), buckets_.end(), [&](const auto& b) { return b->batch >= batch; });
    if (it == buckets_.end()) {
      TORCH_CHECK(options_.out_of_bucket() == OutOfBucket::eager, "perf::graph: batch size ", batch,
                  " is larger than every captured bucket (largest ", buckets_.back()->batch,
                  "); add it to batch_sizes or choose OutOfBucket::eager");
      return call_eager(inputs);
    }
    TORCH_CHECK(batch >= 1, "perf::graph: empty batch");
    bucket = it->get();
  }
  const int64_t full = bucket->batch;
  // Without autograd: an input that requires grad (an evaluation inside a training loop) would otherwise leave
  // its history in the static input, keeping the caller's graph alive until the next call.
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (full < 0 || batch == full) {
      bucket->in[i].copy_(inputs[i], /*non_blocking=*/true);
    } else {
      bucket->in[i].narrow(0, 0, batch).copy_(inputs[i], /*non_blocking=*/true);
      bucket->in[i].narrow(0, batch, full - batch).zero_();  // deterministic padding rows
    }
  }
#if PERF_WITH_CUDA
  if (graphed_) bucket->graph->replay();
#endif
  if (!graphed_) {  // eager on the same static buffers, into the same static outputs
    auto fresh = detail::to_vec<Out>(fn_(bucket->in));
    for (size_t k = 0; k < fresh.size(); ++k) bucket->out[k].copy_(fresh[k]);
  }
  std::vector<at::Tensor> outs;
  for (const auto& o : bucket->out) {
    at::Tensor v = (full >= 0 && batch < full) ? o.narrow(0, 0, batch) : o;
    outs.push_back(options_.clone_outputs() ? v.clone() : v);
  }
  return detail::from_vec<Out>(std::move(outs));
}

#ifdef PERF_SEPARATE_COMPILATION
// perf::perf_static's copies of the two graphs perf::graph builds (cuda_graph.h declares them extern there).
template class Graphed<at::Tensor>;
template class Graphed<std::vector<at::Tensor>>;
#endif

}  // namespace perf
