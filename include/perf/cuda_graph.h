// perf/cuda_graph.h — CUDA graph capture and replay, for inference and whole
// training steps, with an eager path that keeps one program running everywhere.
//
//   auto g = perf::graph(model, x_example, perf::GraphOptions().batch_sizes({1, 2, 4, 8, 16, 32}));
//   torch::Tensor y = g(x);           // x copied into a static buffer (padded to a bucket), graph replayed
//
//   perf::TrainStep step(*model, [&](const torch::Tensor& x, const torch::Tensor& t) {
//     return torch::nn::functional::cross_entropy(model->forward(x), t);
//   }, optimizer, x_example, t_example);            // optimizer from perf/optim.h (capturable)
//   torch::Tensor loss = step.step(x, t);           // forward + backward + update, one replay, no host sync
//
// Without CUDA (or for CPU tensors) the same API runs eagerly on the same static
// buffers, so semantics (buckets, padding, views) are identical; graphed() says which.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <perf/amp.h>
#include <perf/config.h>
#include <perf/optim.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace perf {

/// What a call with a batch larger than every bucket does.
enum class OutOfBucket { eager, error };

struct GraphOptions {
  /// Eager calls on a side stream before capture (autotuners, lazy init, allocator).
  TORCH_ARG(int, warmup) = 3;
  /// Return copies instead of views of the static outputs (which the next call overwrites).
  TORCH_ARG(bool, clone_outputs) = false;
  /// One graph per batch size (dim 0 of every input), sharing one memory pool.
  /// A call is padded to the next bucket and its outputs sliced back. Empty:
  /// one graph for exactly the example shapes.
  TORCH_ARG(std::vector<int64_t>, batch_sizes);
  TORCH_ARG(OutOfBucket, out_of_bucket) = OutOfBucket::eager;
  /// Share a memory pool with other graphs (perf::graph_pool_handle()).
  TORCH_ARG(std::optional<c10::MempoolId_t>, pool);
  /// On a failed capture: warn and run eagerly instead of throwing.
  TORCH_ARG(bool, eager_fallback) = false;
};

/// A fresh memory-pool handle to share among captures ({0, 0} without CUDA).
c10::MempoolId_t graph_pool_handle();

/// A callable replaying CUDA graphs of `fn` (Out: at::Tensor or std::vector<at::Tensor>).
template <typename Out>
class Graphed {
 public:
  using Fn = std::function<Out(const std::vector<at::Tensor>&)>;
  Graphed(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options);

  Out operator()(const std::vector<at::Tensor>& inputs);
  Out operator()(const at::Tensor& input) { return (*this)(std::vector<at::Tensor>{input}); }
  /// True when calls replay CUDA graphs (false: eager, e.g. on the CPU).
  bool graphed() const noexcept { return graphed_; }
  /// Captured batch sizes, ascending (empty when capturing exact shapes).
  std::vector<int64_t> buckets() const;
  /// Calls that ran eagerly because their batch fit no bucket.
  int64_t eager_calls() const noexcept { return eager_calls_; }

 private:
  struct Bucket;
  Out call_eager(const std::vector<at::Tensor>& inputs);
  void capture(Bucket& b, const c10::MempoolId_t& pool);

  Fn fn_;
  GraphOptions options_;
  std::vector<at::Tensor> examples_;
  std::vector<std::unique_ptr<Bucket>> buckets_;  // ascending batch size
  bool bucketed_ = false, graphed_ = false;
  int64_t eager_calls_ = 0;
};

/// Graphs `fn(inputs)` for the example inputs (any callable taking a
/// std::vector<at::Tensor>), or `fn(input)` for a single example tensor (any
/// callable taking a tensor, torch::nn::Module holders included). Inference:
/// forward runs under at::NoGradGuard; use TrainStep for training.
template <typename Fn, std::enable_if_t<std::is_invocable_v<Fn&, const std::vector<at::Tensor>&>, int> = 0>
auto graph(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options = GraphOptions());
template <typename Fn, std::enable_if_t<std::is_invocable_v<Fn&, const at::Tensor&> ||
                                            std::is_base_of_v<torch::detail::ModuleHolderIndicator, Fn>,
                                        int> = 0>
auto graph(Fn fn, const at::Tensor& example, const GraphOptions& options = GraphOptions());

using GradScalerPtr = GradScaler*;  // TORCH_ARG needs one token

struct TrainStepOptions {
  /// Eager steps before capture (state is restored afterwards: they do not train).
  TORCH_ARG(int, warmup) = 3;
  /// Optional loss scaling inside the captured step (device-side, no sync).
  TORCH_ARG(GradScalerPtr, scaler) = nullptr;
  TORCH_ARG(std::optional<c10::MempoolId_t>, pool);
  TORCH_ARG(bool, eager_fallback) = false;
};

/// A whole training step — forward, loss, backward, optimizer update (and
/// GradScaler) — captured once for static shapes and replayed per call, like
/// PyTorch's whole-network capture example. The warm-up steps before capture
/// are undone (parameters, buffers, optimizer and scaler state), so training
/// matches the eager loop. Eager on the CPU.
class TrainStep {
 public:
  using LossFn = std::function<at::Tensor(const at::Tensor& input, const at::Tensor& target)>;
  TrainStep(torch::nn::Module& module, LossFn loss_fn, optim::FusedOptimizer& optimizer,
            const at::Tensor& example_input, const at::Tensor& example_target,
            const TrainStepOptions& options = TrainStepOptions());

  /// Runs one step on (input, target); returns the loss (0-dim, on the device;
  /// reading it is the only sync).
  at::Tensor step(const at::Tensor& input, const at::Tensor& target);
  bool graphed() const noexcept { return graphed_; }

 private:
  at::Tensor run_eager(const at::Tensor& input, const at::Tensor& target);
  // The body of a step after zero_grad: loss, (scaled) backward, update (and scaler update).
  at::Tensor loss_backward_update(const at::Tensor& input, const at::Tensor& target);

  torch::nn::Module& module_;
  LossFn loss_fn_;
  optim::FusedOptimizer& opt_;
  TrainStepOptions options_;
  at::Tensor static_input_, static_target_, static_loss_;
  bool graphed_ = false;
#if PERF_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
#endif
};

// ---------------------------------------------------------------------------
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

// Module holders are called through ->forward(): Sequential's forward is a
// template, which ModuleHolder::operator() cannot deduce a return type for.
template <typename Fn>
decltype(auto) call_with_tensor(Fn& f, const at::Tensor& x) {
  if constexpr (std::is_base_of_v<torch::detail::ModuleHolderIndicator, Fn>) {
    return f->forward(x);
  } else {
    return f(x);
  }
}

template <typename R>
using graph_out_t =
    std::conditional_t<std::is_same_v<std::decay_t<R>, at::Tensor>, at::Tensor, std::vector<at::Tensor>>;

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

inline const char* capture_hint() {
  return "Likely causes: a host sync inside the captured code (.item(), .cpu(), printing or branching on a CUDA "
         "tensor), a CPU tensor or a host-to-device copy from pageable memory, an allocation outside the graph's "
         "memory pool, or shapes that change between calls. Set eager_fallback(true) to run eagerly with a warning "
         "instead.";
}

#if PERF_WITH_CUDA
// `waiter` waits for the work queued so far on `on`, without a host sync.
inline void stream_wait(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& on) {
  at::cuda::CUDAEvent e;
  e.record(on);
  e.block(waiter);
}

// Captures `body` into `graph` on a side stream after `warmup` eager runs of
// `warm`. On failure the capture is ended and the error rethrown.
inline void capture_on_side_stream(at::cuda::CUDAGraph& graph, const c10::Device& device, int warmup,
                                   const std::function<void()>& warm, const std::function<void()>& body,
                                   const std::optional<c10::MempoolId_t>& pool) {
  c10::cuda::CUDAGuard device_guard(device.index());
  const auto main = c10::cuda::getCurrentCUDAStream(device.index());
  const auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  stream_wait(side, main);
  {
    c10::cuda::CUDAStreamGuard g(side);
    for (int i = 0; i < warmup; ++i) warm();
  }
  stream_wait(main, side);
  c10::cuda::device_synchronize();
  {
    c10::cuda::CUDAStreamGuard g(side);
    graph.capture_begin(pool.value_or(c10::MempoolId_t{0, 0}));
    try {
      body();
    } catch (...) {
      try {
        graph.capture_end();
      } catch (...) {
      }
      throw;
    }
    graph.capture_end();
  }
  stream_wait(main, side);
}
#endif

}  // namespace detail

// --------------------------------------------------------------------------- graph

template <typename Out>
struct Graphed<Out>::Bucket {
  int64_t batch = -1;
  std::vector<at::Tensor> in, out;
#if PERF_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

inline c10::MempoolId_t graph_pool_handle() {
#if PERF_WITH_CUDA
  if (c10::cuda::device_count() > 0) return at::cuda::graph_pool_handle();
#endif
  return {0, 0};
}

template <typename Out>
Graphed<Out>::Graphed(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options)
    : fn_(std::move(fn)), options_(options), examples_(std::move(examples)) {
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
  const auto pool = options_.pool() ? *options_.pool() : graph_pool_handle();
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
  // Capture the largest bucket first; the smaller ones reuse its pool memory.
  graphed_ = cuda;
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
    if (graphed_) {
      capture(**it, pool);
    } else {
      at::NoGradGuard no_grad;
      (*it)->out = detail::to_vec<Out>(fn_((*it)->in));
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
void Graphed<Out>::capture(Bucket& b, const c10::MempoolId_t& pool) {
#if PERF_WITH_CUDA
  at::NoGradGuard no_grad;
  b.graph = std::make_unique<at::cuda::CUDAGraph>();
  try {
    detail::capture_on_side_stream(
        *b.graph, b.in[0].device(), options_.warmup(), [&] { fn_(b.in); },
        [&] { b.out = detail::to_vec<Out>(fn_(b.in)); }, pool);
  } catch (const std::exception& e) {
    b.graph.reset();
    const std::string what = e.what();
    TORCH_CHECK(options_.eager_fallback(), "perf::graph: CUDA graph capture failed: ", what.substr(0, what.find('\n')),
                ". ", detail::capture_hint());
    TORCH_WARN("perf::graph: CUDA graph capture failed (", what.substr(0, what.find('\n')),
               "); running eagerly as GraphOptions().eager_fallback(true) asks");
    graphed_ = false;
    b.out = detail::to_vec<Out>(fn_(b.in));
  }
#else
  (void)b;
  (void)pool;
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
    at::NoGradGuard no_grad;
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

template <typename Fn, std::enable_if_t<std::is_invocable_v<Fn&, const std::vector<at::Tensor>&>, int>>
auto graph(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options) {
  using R = std::invoke_result_t<Fn&, const std::vector<at::Tensor>&>;
  using Out = detail::graph_out_t<R>;
  static_assert(std::is_convertible_v<R, Out>, "perf::graph: fn must return a tensor or a std::vector of tensors");
  return Graphed<Out>([f = std::move(fn)](const std::vector<at::Tensor>& in) mutable -> Out { return f(in); },
                      std::move(examples), options);
}

template <typename Fn, std::enable_if_t<std::is_invocable_v<Fn&, const at::Tensor&> ||
                                            std::is_base_of_v<torch::detail::ModuleHolderIndicator, Fn>,
                                        int>>
auto graph(Fn fn, const at::Tensor& example, const GraphOptions& options) {
  using R = decltype(detail::call_with_tensor(std::declval<Fn&>(), std::declval<const at::Tensor&>()));
  using Out = detail::graph_out_t<R>;
  static_assert(std::is_convertible_v<R, Out>, "perf::graph: fn must return a tensor or a std::vector of tensors");
  return Graphed<Out>(
      [f = std::move(fn)](const std::vector<at::Tensor>& in) mutable -> Out {
        return detail::call_with_tensor(f, in[0]);
      },
      std::vector<at::Tensor>{example}, options);
}

// --------------------------------------------------------------------------- TrainStep

namespace detail {

// Every tensor of the optimizer's per-parameter state, for undoing warm-up steps.
inline std::vector<at::Tensor> optimizer_state_tensors(optim::FusedOptimizer& opt) {
  std::vector<at::Tensor> out;
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) {
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      if (auto* a = dynamic_cast<optim::AdamParamState*>(it->second.get())) {
        for (auto* t : {&a->step(), &a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()})
          if (t->defined()) out.push_back(*t);
      } else if (auto* s = dynamic_cast<optim::SGDParamState*>(it->second.get())) {
        if (s->momentum_buffer().defined()) out.push_back(s->momentum_buffer());
      }
    }
  }
  return out;
}

}  // namespace detail

inline TrainStep::TrainStep(torch::nn::Module& module, LossFn loss_fn, optim::FusedOptimizer& optimizer,
                            const at::Tensor& example_input, const at::Tensor& example_target,
                            const TrainStepOptions& options)
    : module_(module), loss_fn_(std::move(loss_fn)), opt_(optimizer), options_(options) {
  TORCH_CHECK(loss_fn_, "perf::TrainStep: empty loss function");
  TORCH_CHECK(options_.warmup() >= 1,
              "perf::TrainStepOptions::warmup: must be >= 1 (the optimizer state must "
              "exist before capture), got ",
              options_.warmup());
  TORCH_CHECK(example_input.defined() && example_target.defined(), "perf::TrainStep: undefined example tensors");
  static_input_ = example_input.clone();
  static_target_ = example_target.clone();
  if (!example_input.is_cuda()) return;  // eager: nothing to capture
#if PERF_WITH_CUDA
  TORCH_CHECK(example_target.device() == example_input.device(), "perf::TrainStep: input is on ",
              example_input.device(), " but target is on ", example_target.device());
  // Snapshot what warm-up steps change, to undo them after capture.
  std::vector<at::Tensor> live, saved;
  for (auto& t : module_.parameters()) live.push_back(t);
  for (auto& t : module_.buffers()) live.push_back(t);
  const auto state_before = detail::optimizer_state_tensors(opt_);
  for (auto& t : state_before) live.push_back(t);
  for (auto& t : live) saved.push_back(t.detach().clone());
  std::optional<std::pair<double, int64_t>> scaler_before;
  if (auto* s = options_.scaler()) scaler_before = std::make_pair(s->get_scale(), s->growth_tracker());

  // Undo what the warm-up steps changed (capture itself records, it does not run).
  auto restore = [&] {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < saved.size(); ++i) live[i].detach().copy_(saved[i]);
    for (const auto& t : detail::optimizer_state_tensors(opt_)) {
      const bool existed =
          std::any_of(state_before.begin(), state_before.end(), [&](const at::Tensor& b) { return b.is_same(t); });
      if (!existed) t.detach().zero_();  // state created by the warm-up: as a fresh optimizer's
    }
    if (auto* s = options_.scaler(); s && scaler_before) s->restore_(scaler_before->first, scaler_before->second);
  };
  graph_ = std::make_unique<at::cuda::CUDAGraph>();
  try {
    detail::capture_on_side_stream(
        *graph_, example_input.device(), options_.warmup(), [&] { run_eager(static_input_, static_target_); },
        [&] {
          opt_.zero_grad();  // set to none: backward allocates the static grads in the graph's pool
          static_loss_ = loss_backward_update(static_input_, static_target_);
        },
        options_.pool());
    graphed_ = true;
  } catch (const std::exception& e) {
    graph_.reset();
    restore();
    const std::string what = e.what();
    TORCH_CHECK(options_.eager_fallback(),
                "perf::TrainStep: CUDA graph capture failed: ", what.substr(0, what.find('\n')), ". ",
                detail::capture_hint());
    TORCH_WARN("perf::TrainStep: CUDA graph capture failed (", what.substr(0, what.find('\n')),
               "); running eagerly as TrainStepOptions().eager_fallback(true) asks");
    return;
  }
  restore();
#endif
}

inline at::Tensor TrainStep::run_eager(const at::Tensor& input, const at::Tensor& target) {
  opt_.zero_grad();
  return loss_backward_update(input, target);
}

inline at::Tensor TrainStep::loss_backward_update(const at::Tensor& input, const at::Tensor& target) {
  at::Tensor loss = loss_fn_(input, target);
  if (auto* s = options_.scaler()) {
    s->scale(loss).backward();
    s->step(opt_);
    s->update();
  } else {
    loss.backward();
    opt_.step();
  }
  return loss.detach();
}

inline at::Tensor TrainStep::step(const at::Tensor& input, const at::Tensor& target) {
  auto check = [](const char* what, const at::Tensor& x, const at::Tensor& fixed) {
    TORCH_CHECK(x.sizes() == fixed.sizes() && x.scalar_type() == fixed.scalar_type(), "perf::TrainStep::step: ", what,
                " must be ", fixed.scalar_type(), " ", detail::shape_str(fixed),
                " like the example (static shapes), got ", x.scalar_type(), " ", detail::shape_str(x));
  };
  check("input", input, static_input_);
  check("target", target, static_target_);
  if (!graphed_) return run_eager(input.to(static_input_.device()), target.to(static_target_.device()));
#if PERF_WITH_CUDA
  static_input_.copy_(input, /*non_blocking=*/true);
  static_target_.copy_(target, /*non_blocking=*/true);
  graph_->replay();
#endif
  return static_loss_.clone();
}

}  // namespace perf
