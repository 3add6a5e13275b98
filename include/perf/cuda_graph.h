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
//   // data-parallel: TrainStepOptions().data_parallel(pg) (perf/distributed.h), gradients averaged in the graph
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
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <perf/amp.h>
#include <perf/config.h>
#include <perf/detail/data_parallel.h>
#include <perf/detail/float.h>
#include <perf/module.h>
#include <perf/optim.h>
#include <torch/arg.h>
#include <torch/data/example.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#if PERF_WITH_CUDA
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
#if PERF_WITH_CUDA
class SafeCUDAGraph;
#endif
}  // namespace detail

/// A callable replaying CUDA graphs of `fn` (Out: at::Tensor or std::vector<at::Tensor>).
template <typename Out>
class Graphed {
  static_assert(std::is_same_v<Out, at::Tensor> || std::is_same_v<Out, std::vector<at::Tensor>>,
                "perf::Graphed<Out>: Out is at::Tensor or std::vector<at::Tensor>");

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
  Graphed(Graphed&&) noexcept;
  Graphed& operator=(Graphed&&) noexcept;
  ~Graphed();

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

#ifdef PERF_SEPARATE_COMPILATION
// The two graphs perf::graph builds are compiled once, in perf::perf_static, with the capture code
// (perf/impl/cuda_graph-inl.h) and the CUDA headers it needs.
extern template class Graphed<at::Tensor>;
extern template class Graphed<std::vector<at::Tensor>>;
#endif

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

 public:  // after TORCH_ARG, which leaves its field private
  /// Data-parallel training over `process_group` (perf::init_process_group; define
  /// it by including perf/distributed.h): every rank builds the step alike on its
  /// share of each batch. At construction rank 0's parameters and buffers are
  /// broadcast; each step averages the gradients across the ranks after its
  /// backward (and accumulation), before clipping and the update, inside the
  /// CUDA graph with the rest of the step. Instead of perf::DistributedDataParallel,
  /// whose autograd hooks a graph cannot capture.
  TrainStepOptions& data_parallel(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
                                  const DataParallelOptions& options = DataParallelOptions()) {
    return data_parallel(detail::make_data_parallel(process_group, options));
  }
  /// The group another step's options hold (CompiledTrainOptions passes its own on).
  TrainStepOptions& data_parallel(detail::DataParallelPtr group) {
    data_parallel_ = std::move(group);
    return *this;
  }
  /// Null unless data_parallel(...) was set.
  const detail::DataParallelPtr& data_parallel() const noexcept { return data_parallel_; }

 private:
  detail::DataParallelPtr data_parallel_;
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
  TrainStep(TrainStep&&) noexcept;
  TrainStep& operator=(TrainStep&&) noexcept;
  ~TrainStep();

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
  void average_gradients(const detail::DataParallel& dp);
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
  std::unique_ptr<detail::SafeCUDAGraph> graph_;
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

}  // namespace detail

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
