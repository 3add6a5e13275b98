// perf/cuda_graph.h — CUDA graph capture and replay, for inference and whole
// training steps, with an eager path that keeps one program running everywhere.
//
//   auto g = perf::graph(model, x_example, perf::GraphOptions().batch_sizes({1, 2, 4, 8, 16, 32}));
//   torch::Tensor y = g(x);           // x copied into a static buffer (padded to a bucket), graph replayed,
//                                     // y the caller's copy (clone_outputs(false): a view, no copy)
//
//   perf::TrainStep step(model, [&](const torch::Tensor& x, const torch::Tensor& t) {
//     return torch::nn::functional::cross_entropy(model->forward(x), t);
//   }, optimizer, first_batch);                     // first_batch: a torch::data::Example (or input, target)
//   torch::Tensor loss = step.step(batch);          // forward + backward + update, one replay, no host sync
//                                                   // (the loss is the caller's: a 0-dim device copy)
//
// Without CUDA (or for CPU tensors) the same API runs eagerly on the same static
// buffers, so semantics (buckets, padding, views) are identical; graphed() says which.
//
// What makes a capture safe here:
//  - the last warm-up step runs with CUDA's sync-debug mode set to "error", so a
//    host sync (.item(), .cpu(), printing a CUDA tensor) is reported before any
//    capture begins (GraphOptions::check_syncs);
//  - captures use thread-local capture mode by default, so other threads (a
//    perf::prefetch producer pinning memory) keep working during a capture;
//  - the autocast weight cache is off during warm-up and capture (cached casts
//    would be baked into the graph);
//  - if a capture fails anyway, the CUDA generator and caching allocator are put
//    back as a successful capture would leave them (LibTorch 2.11's
//    CUDAGraph::capture_end throws before doing so), so RNG ops and memory
//    reuse keep working, and eager_fallback continues in a healthy process;
//  - errors keep their type (c10::OutOfMemoryError stays one) with perf's
//    context added; a TrainStep whose capture fails leaves no gradient that the
//    abandoned capture allocated.
//
// A graph's calls from several threads take turns (its static buffers serve one
// call at a time), and a call from another CUDA stream than the last call's
// waits for that call on the device.
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <perf/amp.h>
#include <perf/config.h>
#include <perf/detail/cuda.h>
#include <perf/detail/ddp_registry.h>
#include <perf/detail/float.h>
#include <perf/detail/rng.h>
#include <perf/module.h>
#include <perf/optim.h>
#include <torch/arg.h>
#include <torch/data/example.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#if PERF_WITH_CUDA
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>  // at::cuda::CUDAEvent without ATen's cuBLAS/cuSOLVER includes
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <array>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace perf {

/// What a call with a batch larger than every bucket does.
enum class OutOfBucket { eager, error };

/// Which CUDA calls other code may make while a capture is under way, as the
/// capture_error_mode of Python's torch.cuda.graph: global (no thread may make
/// unsafe calls), thread_local_ (only the capturing thread: the default here,
/// so a prefetching thread keeps pinning memory), relaxed (no checks).
enum class CaptureErrorMode { global, thread_local_, relaxed };

struct GraphOptions {
  /// Eager calls on a side stream before capture (autotuners, lazy init, allocator).
  TORCH_ARG(int, warmup) = 3;
  /// Return the caller's own copies of the outputs (one device copy each, no
  /// sync). false: views of the graph's static outputs, no copy, valid only
  /// until the next call of the same graph, whatever its bucket (the buckets
  /// share one memory pool, so replaying one may overwrite another's outputs):
  /// for a loop that consumes each output before the next call.
  TORCH_ARG(bool, clone_outputs) = true;
  /// One graph per batch size (dim 0 of every input), sharing one memory pool.
  /// A call is padded to the next bucket and its outputs sliced back. Empty:
  /// one graph for exactly the example shapes.
  TORCH_ARG(std::vector<int64_t>, batch_sizes);
  TORCH_ARG(OutOfBucket, out_of_bucket) = OutOfBucket::eager;
  /// Share a memory pool with other graphs (perf::graph_pool_handle()).
  TORCH_ARG(std::optional<c10::MempoolId_t>, pool);
  /// On a failed capture (or a host sync found before it): warn and run
  /// eagerly instead of throwing.
  TORCH_ARG(bool, eager_fallback) = false;
  TORCH_ARG(CaptureErrorMode, capture_error_mode) = CaptureErrorMode::thread_local_;
  /// Run the last warm-up call with CUDA sync-debug mode "error", so host syncs
  /// fail there, before capture, with a clear message. The mode is
  /// process-wide for that one call: turn this off if other threads
  /// legitimately sync at the same time.
  TORCH_ARG(bool, check_syncs) = true;
};

/// A fresh memory-pool handle to share among captures ({0, 0} without CUDA).
c10::MempoolId_t graph_pool_handle();

namespace detail {
class CapturedState;
}  // namespace detail

/// A callable replaying CUDA graphs of `fn` (Out: at::Tensor or std::vector<at::Tensor>).
template <typename Out>
class Graphed {
 public:
  using Fn = std::function<Out(const std::vector<at::Tensor>&)>;
  Graphed(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options)
      : Graphed(std::move(fn), std::move(examples), options, std::nullopt) {}
  /// `fn` runs `module`'s forward (what perf::graph(module, ...) builds): before
  /// each replay the module's train()/eval() mode and the storage of its
  /// parameters and buffers are checked, and every bucket is captured again,
  /// with a warning, where they changed (torch::load of the module after the
  /// capture sets new storage; the graph would read the old, freed one).
  Graphed(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options, ModuleRef module)
      : Graphed(std::move(fn), std::move(examples), options, std::optional<ModuleRef>(std::move(module))) {}

  /// Copies the inputs into the static ones, replays, returns the outputs. Safe to call from several threads:
  /// the calls take turns (the static buffers and the graphs' pool serve one at a time), and a call from another
  /// CUDA stream than the last call's waits on the device for that call's replay and output copies.
  Out operator()(const std::vector<at::Tensor>& inputs);
  Out operator()(const at::Tensor& input) { return (*this)(std::vector<at::Tensor>{input}); }
  /// True when calls replay CUDA graphs (false: eager, e.g. on the CPU).
  bool graphed() const noexcept { return graphed_; }
  /// Captured batch sizes, ascending (empty when capturing exact shapes).
  std::vector<int64_t> buckets() const;
  /// Calls that ran eagerly because their batch fit no bucket.
  int64_t eager_calls() const noexcept { return eager_calls_; }
  /// Times the buckets were captured: 1 once graphed, one more for each
  /// re-capture after the module changed (see the constructor with a module).
  int64_t captures() const noexcept { return captures_; }

 private:
  struct Bucket;
  Graphed(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options, std::optional<ModuleRef> module);
  Out call_eager(const std::vector<at::Tensor>& inputs);
  bool capture(Bucket& b, const c10::MempoolId_t& pool);
  void capture_all(bool cuda, const c10::MempoolId_t& pool);
  void capture_buckets(bool cuda, const c10::MempoolId_t& pool);

  Fn fn_;
  GraphOptions options_;
  std::vector<at::Tensor> examples_;
  std::vector<std::unique_ptr<Bucket>> buckets_;  // ascending batch size
  bool bucketed_ = false, graphed_ = false;
  int64_t eager_calls_ = 0, captures_ = 0;
  std::optional<ModuleRef> module_;
  std::unique_ptr<detail::CapturedState> captured_;
  std::unique_ptr<std::mutex> calls_ = std::make_unique<std::mutex>();  // held by the call running (movable)
#if PERF_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> last_stream_;  // the last call's, for the next call from another stream
#endif
};

/// Graphs `fn(inputs)` for the example inputs (any callable taking a
/// std::vector<at::Tensor>), or `fn(input)` for a single example tensor (any
/// callable taking a tensor, module holders, std::shared_ptr to a module and
/// plain modules, by reference, included). Inference: forward runs under
/// at::NoGradGuard; use TrainStep for training.
namespace detail {
// Module holders first: asking whether one is invocable with the wrong
// argument is a hard error inside LibTorch's ModuleHolder::operator().
template <typename Fn>
using is_holder = std::is_base_of<torch::detail::ModuleHolderIndicator, Fn>;
template <typename Fn>
constexpr bool takes_tensor_list_v =
    std::conjunction_v<std::negation<is_holder<Fn>>, std::is_invocable<Fn&, const std::vector<at::Tensor>&>>;
template <typename Fn>
constexpr bool takes_tensor_v = std::disjunction_v<is_holder<Fn>, std::is_invocable<Fn&, const at::Tensor&>>;
}  // namespace detail

template <typename Fn, std::enable_if_t<detail::takes_tensor_list_v<Fn>, int> = 0>
auto graph(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options = GraphOptions());
template <typename Fn, std::enable_if_t<detail::takes_tensor_v<Fn>, int> = 0>
auto graph(Fn fn, const at::Tensor& example, const GraphOptions& options = GraphOptions());
template <typename M, std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>, int> = 0>
auto graph(std::shared_ptr<M> module, const at::Tensor& example, const GraphOptions& options = GraphOptions());
template <typename M, std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>, int> = 0>
auto graph(M& module, const at::Tensor& example, const GraphOptions& options = GraphOptions());

using GradScalerPtr = GradScaler*;  // TORCH_ARG needs one token

struct TrainStepOptions {
  /// Capture the step into a CUDA graph on CUDA (false: every step eager, e.g.
  /// to compare or debug; CPU steps are always eager).
  TORCH_ARG(bool, graph) = true;
  /// Eager steps before capture, with the optimizer update skipped on the
  /// device (they do not train); buffers (BatchNorm statistics), RNG and the
  /// scaler are restored afterwards.
  TORCH_ARG(int, warmup) = 3;
  /// Optional loss scaling inside the captured step (device-side, no sync).
  TORCH_ARG(GradScalerPtr, scaler) = nullptr;
  /// Clip the total gradient norm before the update (perf::clip_grad_norm_;
  /// unscaled first when a scaler is set).
  TORCH_ARG(std::optional<double>, max_grad_norm);
  /// Gradient accumulation: every batch tensor is split in k chunks along dim
  /// 0, the gradients of loss/k accumulate, one update per step(). A batch
  /// that k does not divide (an epoch's last, run eagerly) is split in chunks
  /// of at most one row's difference (fewer when it has fewer than k rows),
  /// each loss weighted by its share of the rows, so a mean loss trains as
  /// on the whole batch.
  TORCH_ARG(int64_t, accumulation_steps) = 1;
  TORCH_ARG(std::optional<c10::MempoolId_t>, pool);
  /// On a failed capture, or an optimizer that cannot be captured (torch::optim),
  /// warn and run eagerly instead of throwing.
  TORCH_ARG(bool, eager_fallback) = false;
  TORCH_ARG(CaptureErrorMode, capture_error_mode) = CaptureErrorMode::thread_local_;
  TORCH_ARG(bool, check_syncs) = true;
};

/// The optimizers a TrainStep runs, in this order: one (`opt`), or several
/// (`{&muon, &adamw}`: Python's Muon for the hidden layers' matrices with AdamW
/// for the rest), each parameter in one of them.
class Optimizers {
 public:
  Optimizers(torch::optim::Optimizer& optimizer) : list_{&optimizer} {}  // NOLINT: implicit, one optimizer
  Optimizers(std::initializer_list<torch::optim::Optimizer*> optimizers) : list_(optimizers) {}
  explicit Optimizers(std::vector<torch::optim::Optimizer*> optimizers) : list_(std::move(optimizers)) {}
  const std::vector<torch::optim::Optimizer*>& list() const noexcept { return list_; }

 private:
  std::vector<torch::optim::Optimizer*> list_;
};

/// A whole training step — zero_grad, forward and loss (over k micro-batches),
/// backward, optional clipping, optimizer update (and GradScaler) — captured
/// once for static shapes and replayed per call, like PyTorch's whole-network
/// capture example. Warm-up skips the update on the device, so a resumed
/// checkpoint's parameters and optimizer state are exactly what the first
/// step() trains from. Learning-rate changes (schedulers) take effect at the
/// next step() through the optimizer's lr tensors. Eager on the CPU, and with a
/// torch::optim optimizer (CUDA: only with eager_fallback(true)). Several
/// optimizers (`{&muon, &adamw}`) run in the order given, as Python's loop calls
/// them: each zero_grad(), then each step() (with a scaler, scaler.step() of
/// each, one update()); clipping takes all of their parameters.
///
/// The batch is any number of tensors with fixed shapes. A smaller last batch
/// of an epoch (dim 0 only) is trained eagerly by step() and counted in
/// eager_steps(), so no sample is lost; drop_last(true) avoids it.
class CompiledTrainStep;

class TrainStep {
 public:
  using LossFn = std::function<at::Tensor(const at::Tensor& input, const at::Tensor& target)>;
  using BatchLossFn = std::function<at::Tensor(const std::vector<at::Tensor>& batch)>;
  /// A loss function that returns more than the loss: {loss, outputs...}, e.g.
  /// the logits or each sample's correctness for a training-accuracy log, which
  /// outputs() gives after each step without a second forward (Python's
  /// whole-network capture keeps its static_y_pred for the same).
  using LossAndOutputsFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& batch)>;
  using Example = torch::data::Example<at::Tensor, at::Tensor>;

  TrainStep(ModuleRef module, LossFn loss_fn, Optimizers optimizers, const at::Tensor& example_input,
            const at::Tensor& example_target, const TrainStepOptions& options = TrainStepOptions());
  /// The example is the first batch of the loader (its values do not train).
  TrainStep(ModuleRef module, LossFn loss_fn, Optimizers optimizers, const Example& first_batch,
            const TrainStepOptions& options = TrainStepOptions());
  TrainStep(ModuleRef module, BatchLossFn loss_fn, Optimizers optimizers, std::vector<at::Tensor> example_batch,
            const TrainStepOptions& options = TrainStepOptions());
  TrainStep(ModuleRef module, LossAndOutputsFn loss_fn, Optimizers optimizers, std::vector<at::Tensor> example_batch,
            const TrainStepOptions& options = TrainStepOptions());

  /// Runs one step; returns its loss, which the caller owns (0-dim, on the
  /// device: reading it is the only sync). Graphed, it is a device copy of
  /// the graph's static loss (one 0-dim copy kernel, no sync): keep as many as
  /// you like, e.g. one per step to read at the end of an epoch.
  /// Graphed, a step first checks what the capture baked in, and captures
  /// again (with a warning) where a replay would silently differ from an
  /// eager step: a module switched between train() and eval(), a parameter's
  /// requires_grad changed (freezing, unfreezing), a parameter, buffer or
  /// optimizer state given new storage (torch::load of the model or the
  /// optimizer after construction, model->to), param groups added.
  /// After step(), each parameter's .grad() holds that step's gradients, as
  /// after an eager backward (one the optimizer does not hold accumulates
  /// them over steps, as autograd does); graphed, they are the tensors the replays
  /// write, put back if a zero_grad() (the optimizer's or the model's) or an
  /// eager step replaced them. Before the first step() a graphed TrainStep
  /// leaves the optimizer's parameters' gradients as its zero_grad() does
  /// (none; zeros in flat mode) and any other's as it was before the capture:
  /// its warm-up's and capture's gradients are not a step's.
  at::Tensor step(const std::vector<at::Tensor>& batch);
  at::Tensor step(const at::Tensor& input, const at::Tensor& target) {
    return step(std::vector<at::Tensor>{input, target});
  }
  at::Tensor step(const Example& batch) { return step(batch.data, batch.target); }
  /// step({x, y, w}): a braced list is the batch vector (it would otherwise match Example too).
  at::Tensor step(std::initializer_list<at::Tensor> batch) { return step(std::vector<at::Tensor>(batch)); }
  /// The same step run eagerly, for batches of another shape (an epoch's last
  /// partial batch); same optimizer, scaler and options.
  at::Tensor step_eager(const std::vector<at::Tensor>& batch);
  at::Tensor step_eager(const Example& batch) { return step_eager(std::vector<at::Tensor>{batch.data, batch.target}); }
  at::Tensor step_eager(std::initializer_list<at::Tensor> batch) { return step_eager(std::vector<at::Tensor>(batch)); }
  /// The last step's loss without a copy. Graphed, this is the graph's
  /// static output: the next step() overwrites it in place, so a tensor kept
  /// from here reads as the newest loss. For a loop that reads the loss
  /// before the next step and cannot afford a 4-byte copy kernel.
  const at::Tensor& static_loss() const noexcept { return static_loss_; }
  /// The last step's total gradient norm before clipping (of the unscaled
  /// gradients with a scaler; inf or nan on a step the scaler skipped), as
  /// Python's clip_grad_norm_ returns it: a 0-dim device tensor the caller
  /// owns (a device copy, no sync), e.g. kept per step for a log. Computed
  /// only where the step clips: set max_grad_norm (infinity measures the norm
  /// without clipping).
  at::Tensor grad_norm() const;
  /// The last step's outputs after the loss, for a loss function that returns
  /// {loss, outputs...}: detached, and the caller's (graphed: device copies of
  /// the ones the replays write, no sync). With accumulation_steps(k) each is
  /// the k micro-batches' outputs concatenated along dim 0, so each must have
  /// one: per-sample values such as (logits.argmax(1) == target), not their
  /// sum. Empty for a loss function that returns only the loss.
  std::vector<at::Tensor> outputs() const;
  bool graphed() const noexcept { return graphed_; }
  /// Times the step was captured: 1 once graphed, one more for each re-capture
  /// (a change a replay would ignore: see step()).
  int64_t captures() const noexcept { return captures_; }
  /// Steps that ran eagerly because the batch was smaller than the example's
  /// (the last batch of an epoch without drop_last).
  int64_t eager_steps() const noexcept { return eager_steps_; }

 private:
  friend class CompiledTrainStep;
  // One micro-batch's share of a step: leaves the gradients of loss/divisor
  // (scaled by the scaler, if any) accumulated in the parameters' .grad and
  // returns loss/divisor, detached; divisor = batch rows / micro-batch rows
  // (k for equal chunks). Unset: backward_micro (loss_fn and backward()).
  using MicroStep = std::function<at::Tensor(const std::vector<at::Tensor>& micro, double divisor)>;
  TrainStep(const char* who, const char* options_name, ModuleRef module, MicroStep micro, Optimizers optimizers,
            std::vector<at::Tensor> example_batch, const TrainStepOptions& options);
  at::Tensor backward_micro(const std::vector<at::Tensor>& micro, double divisor, std::vector<at::Tensor>& outputs);
  void init(std::vector<at::Tensor> example);
  void capture_graph();
  void restore_static_grads();
  bool is_partial_batch(const std::vector<at::Tensor>& batch) const;
  at::Tensor body(const std::vector<at::Tensor>& batch);
  void check_batch(const std::vector<at::Tensor>& batch, bool shapes) const;

  std::string who_ = "perf::TrainStep", options_name_ = "perf::TrainStepOptions";
  ModuleRef module_;
  LossAndOutputsFn loss_fn_;
  MicroStep micro_;
  std::vector<torch::optim::Optimizer*> opts_;
  std::vector<optim::FusedOptimizer*> fused_;  // opts_[i] as a perf optimizer, or nullptr (torch::optim)
  TrainStepOptions options_;
  std::vector<at::Tensor> static_batch_;
  at::Tensor static_loss_;
  // What body() leaves besides the loss: the last one's (extras_) and the ones the replays write (static_extras_);
  // replayed_ says which is the last step's.
  struct StepExtras {
    at::Tensor grad_norm;                            // clip_grad_norm_'s result
    std::optional<std::vector<at::Tensor>> outputs;  // the loss function's after the loss; none before a step
  };
  StepExtras extras_, static_extras_;
  bool replayed_ = false;
  bool graphed_ = false;
  int64_t eager_steps_ = 0, captures_ = 0;
#if PERF_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
#endif
  std::unique_ptr<detail::CapturedState> captured_;
  struct StaticGrad {
    at::Tensor param, grad;  // the gradient the replays write
    bool accumulates;        // not the optimizer's: the replays add to it
  };
  std::vector<StaticGrad> static_grads_;
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

PERF_INLINE std::string shape_str(const at::Tensor& t);

// The optimizers of a training step, checked (none null, none twice, each parameter in one, none synchronised by
// perf::DistributedDataParallel); returns each as a perf optimizer, or nullptr (torch::optim).
PERF_INLINE std::vector<optim::FusedOptimizer*> check_step_optimizers(
    const std::string& who, const std::vector<torch::optim::Optimizer*>& opts);

PERF_INLINE std::string first_line(const std::exception& e);

PERF_INLINE const char* capture_hint();

// Adds perf's context to a c10::Error and rethrows the same object (its type,
// e.g. c10::OutOfMemoryError, is kept); another exception becomes a c10::Error
// with the context and its message.
[[noreturn]] PERF_INLINE void rethrow_with_context(const std::string& context);

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

// Turns cuDNN's benchmark mode off for a scope where `wanted` and the mode is on;
// the program's setting comes back at release() or at the scope's end.
class CudnnBenchmarkOff {
 public:
  explicit CudnnBenchmarkOff(bool wanted = true) : active_(wanted && at::globalContext().benchmarkCuDNN()) {
    if (active_) at::globalContext().setBenchmarkCuDNN(false);
  }
  ~CudnnBenchmarkOff() { release(); }
  CudnnBenchmarkOff(const CudnnBenchmarkOff&) = delete;
  CudnnBenchmarkOff& operator=(const CudnnBenchmarkOff&) = delete;
  /// Whether this scope turned the mode off (and has not given it back yet).
  bool active() const noexcept { return active_; }
  void release() {
    if (active_) at::globalContext().setBenchmarkCuDNN(true);
    active_ = false;
  }

 private:
  bool active_;
};

// perf::optimize's autotune_candidates(false): cuDNN's benchmark mode off for a scope, so the candidates run
// cuDNN's heuristic plans, and its deterministic mode on while it is (where the program's convolutions are not
// deterministic already). ATen caches each convolution's plan under a key that holds the deterministic flag
// (cuDNN's, or torch.use_deterministic_algorithms') but not the benchmark one, and looks there before it reads the
// benchmark flag (aten/src/ATen/native/cudnn/Conv_v8.cpp, run_single_conv): measured under the program's own key,
// a candidate's heuristic plan would stay its plan for the process, and the winner would never autotune. Under
// the deterministic key the heuristic plans are kept apart, and the winner's first calls after release()
// autotune. Deterministic plans compute the same function; the heuristics only choose among fewer.
class CudnnHeuristicPlans {
 public:
  explicit CudnnHeuristicPlans(bool wanted = true)
      : benchmark_off_(wanted),
        deterministic_on_(benchmark_off_.active() && !at::globalContext().deterministicCuDNN() &&
                          !at::globalContext().deterministicAlgorithms()) {
    if (deterministic_on_) at::globalContext().setDeterministicCuDNN(true);
  }
  ~CudnnHeuristicPlans() { release(); }
  CudnnHeuristicPlans(const CudnnHeuristicPlans&) = delete;
  CudnnHeuristicPlans& operator=(const CudnnHeuristicPlans&) = delete;
  /// Whether this scope turned benchmark mode off (and has not given it back yet).
  bool active() const noexcept { return benchmark_off_.active(); }
  /// Whether the candidates' plans are kept apart from the program's (false where its convolutions were
  /// deterministic already: cuDNN's deterministic mode or torch.use_deterministic_algorithms).
  bool plans_apart() const noexcept { return deterministic_on_; }
  void release() {
    if (deterministic_on_) at::globalContext().setDeterministicCuDNN(false);
    deterministic_on_ = false;
    benchmark_off_.release();
  }

 private:
  CudnnBenchmarkOff benchmark_off_;
  bool deterministic_on_;
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

// perf::graph with batch_sizes pads a call with zero rows to its bucket:
// refused while a BatchNorm of `module` (itself included; found by class
// name, so a user's own batch norm too) is in train() mode, since the padding
// would enter its batch statistics.
PERF_INLINE void check_padding_allowed(torch::nn::Module& module);

// The micro-batches of accumulation_steps(k): every batch tensor split along
// dim 0 by tensor_split, equal where k divides the rows, else at most one row
// apart, the larger first; fewer than k (none empty) when a tensor has fewer
// rows. k == 1: the batch itself. Shared by TrainStep and CompiledTrainStep,
// which checks the package takes them.
PERF_INLINE std::vector<std::vector<at::Tensor>> micro_batches(const std::vector<at::Tensor>& batch, int64_t k);
// A TrainStep loss function's {loss, outputs...}: every output defined, and with
// k > 1 micro-batches one with a dim 0 to concatenate them along.
PERF_INLINE void check_step_outputs(const std::vector<at::Tensor>& result, int64_t k);
// The micro-batches' outputs, each concatenated along dim 0.
PERF_INLINE std::vector<at::Tensor> cat_step_outputs(const std::vector<std::vector<at::Tensor>>& per_micro);

// What a capture of a module's forward (perf::graph, perf::TrainStep) baked
// in, besides its shapes: a CUDA graph replays the kernels, addresses and
// control flow of its capture. So a
// module's train()/eval() mode, the storage of its parameters and buffers
// (torch::load of a module sets new storage into the same tensors, as do
// model->to and set_data; the old storage, which the graph still reads, is
// freed), and for a training step (an optimizer given) each parameter's
// requires_grad and the optimizer's param groups and state. Checked before
// each replay by pointer comparisons (no device work).
class CapturedState {
 public:
  // training_modes: whether the graph runs the module's forward (not a
  // compiled step, whose package fixes the mode).
  // scaler: a GradScaler whose update() the step captures (its growth and
  // backoff settings are host values there; torch::load of it sets them).
  // optimizers: the ones the step runs, in order (none: a forward's graph).
  CapturedState(torch::nn::Module& module, const std::vector<torch::optim::Optimizer*>& optimizers, bool training_modes,
                const GradScaler* scaler = nullptr);
  // "" while a replay equals an eager call; else what changed, for a warning.
  std::string changed(torch::nn::Module& module, const std::vector<torch::optim::Optimizer*>& optimizers,
                      const GradScaler* scaler = nullptr) const;

 private:
  // Every optimizer's param groups, in order; the perf optimizers' state addresses and step constants.
  static std::vector<std::vector<const at::TensorImpl*>> optimizer_groups(
      const std::vector<torch::optim::Optimizer*>& optimizers);
  static std::pair<std::vector<const void*>, std::vector<optim::StepConstant>> optimizer_state(
      const std::vector<torch::optim::Optimizer*>& optimizers);
  struct Entry {
    at::Tensor tensor;
    const void* data;
    bool requires_grad;
  };
  std::optional<bool> training_;                                               // the module's own mode
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> children_;  // submodule, is_training
  std::vector<Entry> params_, buffers_;
  std::vector<std::vector<const at::TensorImpl*>> groups_;
  std::vector<const void*> state_;
  std::vector<optim::StepConstant> constants_;
  std::optional<std::array<double, 3>> scaler_;  // growth_factor, backoff_factor, growth_interval
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

}  // namespace detail

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

template <typename Fn, std::enable_if_t<detail::takes_tensor_list_v<Fn>, int>>
auto graph(Fn fn, std::vector<at::Tensor> examples, const GraphOptions& options) {
  using R = std::invoke_result_t<Fn&, const std::vector<at::Tensor>&>;
  using Out = detail::graph_out_t<R>;
  static_assert(std::is_convertible_v<R, Out>, "perf::graph: fn must return a tensor or a std::vector of tensors");
  return Graphed<Out>([f = std::move(fn)](const std::vector<at::Tensor>& in) mutable -> Out { return f(in); },
                      std::move(examples), options);
}

template <typename Fn, std::enable_if_t<detail::takes_tensor_v<Fn>, int>>
auto graph(Fn fn, const at::Tensor& example, const GraphOptions& options) {
  using R = decltype(detail::call_with_tensor(std::declval<Fn&>(), std::declval<const at::Tensor&>()));
  using Out = detail::graph_out_t<R>;
  static_assert(std::is_convertible_v<R, Out>, "perf::graph: fn must return a tensor or a std::vector of tensors");
  std::optional<ModuleRef> module;
  if constexpr (detail::is_holder<Fn>::value) module.emplace(fn);  // a module holder: checked before replays
  auto call = [f = std::move(fn)](const std::vector<at::Tensor>& in) mutable -> Out {
    return detail::call_with_tensor(f, in[0]);
  };
  if (module) return Graphed<Out>(std::move(call), std::vector<at::Tensor>{example}, options, *module);
  return Graphed<Out>(std::move(call), std::vector<at::Tensor>{example}, options);
}

template <typename M, std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>, int>>
auto graph(std::shared_ptr<M> module, const at::Tensor& example, const GraphOptions& options) {
  TORCH_CHECK(module, "perf::graph: null module");
  ModuleRef ref(module);
  using R = decltype(module->forward(example));
  using Out = detail::graph_out_t<R>;
  static_assert(std::is_convertible_v<R, Out>, "perf::graph: forward must return a tensor or a std::vector of tensors");
  return Graphed<Out>([m = std::move(module)](const std::vector<at::Tensor>& in) -> Out { return m->forward(in[0]); },
                      std::vector<at::Tensor>{example}, options, std::move(ref));
}

template <typename M, std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>, int>>
auto graph(M& module, const at::Tensor& example, const GraphOptions& options) {
  // By reference: the module must outlive the returned Graphed.
  using R = decltype(module.forward(example));
  using Out = detail::graph_out_t<R>;
  static_assert(std::is_convertible_v<R, Out>, "perf::graph: forward must return a tensor or a std::vector of tensors");
  return Graphed<Out>([m = &module](const std::vector<at::Tensor>& in) -> Out { return m->forward(in[0]); },
                      std::vector<at::Tensor>{example}, options, ModuleRef(module));
}

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/cuda_graph-inl.h>
#endif
