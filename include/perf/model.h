// perf/model.h — model-level helpers: a fast-forward wrapper, inference scope,
// Conv-BN fusion and activation checkpointing.
//
//   auto model = perf::optimize(Net(), perf::ModelOptions().device(torch::kCUDA));  // channels-last + autocast
//   auto y = model(x);                  // x moved to the device, NHWC, forward under autocast
//   auto fast = perf::optimize(Net(), perf::ModelOptions().device(d).example(x));    // measures the recipes
//   std::cout << fast.choice();         // on x, keeps the fastest: never slower than the plain model
//   auto z = model.infer(x);            // eval() + c10::InferenceMode, training mode restored after
//   model->parameters();                // the underlying module, unchanged
//
//   torch::nn::Sequential fast = perf::fuse_conv_bn(seq);   // every Conv2d -> BatchNorm2d pair, for inference
//   auto h = perf::checkpoint([&](const std::vector<torch::Tensor>& in) { return block->forward(in[0]); }, {x});
#pragma once

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <perf/amp.h>
#include <perf/bench.h>
#include <perf/config.h>
#include <perf/cuda_graph.h>
#include <perf/memory_format.h>
#include <perf/module.h>
#include <torch/arg.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace perf {

/// One way to run a model's forward: memory layout, autocast, CUDA graph.
struct Recipe {
  /// 4-D/5-D parameters, buffers and inputs in channels-last.
  TORCH_ARG(bool, channels_last) = false;
  /// Forward under perf::Autocast with this dtype; unset: fp32.
  TORCH_ARG(std::optional<c10::ScalarType>, autocast);
  /// CUDA only: calls with the example's shape, without autograd, replay a
  /// CUDA graph of the forward (perf::graph); other calls run eagerly.
  TORCH_ARG(bool, graph) = false;

 public:  // TORCH_ARG leaves the members after it private
  /// "NCHW fp32", "channels-last + bf16 autocast + CUDA graph", ...
  std::string name() const;
  bool operator==(const Recipe& o) const {
    return channels_last() == o.channels_last() && autocast() == o.autocast() && graph() == o.graph();
  }
};

/// What perf::optimize decided, and why: the recipe, each candidate's median
/// forward time on the example, and how long deciding took.
struct RecipeChoice {
  Recipe recipe;
  std::vector<std::pair<Recipe, double>> measured_ms;  ///< empty unless an example was measured
  std::string reason;
  double seconds = 0;  ///< the whole decision, of which:
  /// each candidate's first call, kept out of the measured medians: lazy initialisation and, with cuDNN's benchmark
  /// mode on (perf::setup's default on CUDA), its autotuning of every convolution shape the candidate runs, which
  /// later calls reuse
  double first_call_seconds = 0;
  double capture_seconds = 0;  ///< the CUDA graph captures (their warm-up calls included)
  std::string to_string() const;
};
std::ostream& operator<<(std::ostream& os, const RecipeChoice& c);

struct ModelOptions {
  /// Where the module and its inputs go. Unset: where the module's parameters are.
  TORCH_ARG(std::optional<c10::Device>, device);
  /// Convert 4-D/5-D parameters, buffers and inputs to channels-last.
  TORCH_ARG(bool, channels_last) = true;
  /// Run forward under perf::Autocast with its defaults (CUDA: on; CPU: on only
  /// where the CPU computes bf16 natively, see Autocast::default_enabled).
  TORCH_ARG(bool, autocast) = true;
  /// Autocast dtype. Unset: perf::Autocast's default for the device.
  TORCH_ARG(std::optional<c10::ScalarType>, autocast_dtype);
  /// Cast floating-point tensor outputs back to float32.
  TORCH_ARG(bool, float_outputs) = false;
  /// An input (on the target device, or movable there) to measure the
  /// candidate recipes on — fp32 NCHW, channels-last, autocast, their
  /// combinations, on CUDA each of them also as a CUDA graph — keeping the fastest, so
  /// the result is never slower than the plain model beyond noise. The flags
  /// above say which candidates are allowed. Undefined: no measurement, the
  /// flags are the recipe.
  TORCH_ARG(at::Tensor, example);
  /// A recipe to use as is (from an earlier choice()), for reproducible runs.
  TORCH_ARG(std::optional<Recipe>, recipe);
  /// About how long measuring the example may take.
  TORCH_ARG(double, tune_seconds) = 1.5;
  /// CUDA, with cuDNN's benchmark mode on (perf::setup()'s default): whether each candidate autotunes its
  /// convolutions while it is measured. Autotuning every shape of every layout and precision is most of a
  /// decision's time on a GPU (on an H100, 2.7 of 3.8 s for bench_compiled's CNN at batch 32, in the candidates'
  /// first calls); false measures the candidates on cuDNN's heuristic algorithms (under cuDNN's deterministic mode,
  /// which keeps their plans out of the program's: ATen caches a plan whatever the benchmark flag) and turns
  /// benchmark mode back on before the winner is captured (or first called), so only the winner autotunes. The
  /// ranking may then differ where autotuning would change it. A program that runs with cuDNN's deterministic mode
  /// on (or torch::use_deterministic_algorithms) keeps the heuristic plans (choice().reason says so).
  TORCH_ARG(bool, autotune_candidates) = true;
};

namespace detail {
template <typename T>
struct is_shared_ptr : std::false_type {};
template <typename T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};
template <typename T>
constexpr bool is_shared_ptr_v = is_shared_ptr<T>::value;
}  // namespace detail

namespace detail {
// Whether `module` or a module under it is in train() mode. Reads only.
inline bool any_training(const torch::nn::Module& module) {
  bool training = false;
  module.apply([&](const torch::nn::Module& m) { training = training || m.is_training(); });
  return training;
}

// eval() for a scope, the training mode restored after. A model already in
// eval() is not written to, so scopes in several threads may share it.
class EvalScope {
 public:
  explicit EvalScope(ModuleRef module) : module_(std::move(module)), was_training_(module_->is_training()) {
    if (!any_training(*module_)) return;
    switched_ = true;
    for (auto& m : module_->modules(/*include_self=*/false)) children_.emplace_back(m, m->is_training());
    module_->eval();
  }
  // Each module's own mode back, not the root's for all: a model training with
  // a BatchNorm frozen in eval() keeps it frozen. train() is recursive, and
  // modules() lists parents before their children.
  ~EvalScope() {
    if (!switched_) return;
    module_->train(was_training_);
    for (auto& [m, training] : children_) m->train(training);
  }
  EvalScope(const EvalScope&) = delete;
  EvalScope& operator=(const EvalScope&) = delete;

 private:
  ModuleRef module_;
  bool was_training_, switched_ = false;
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> children_;
};
}  // namespace detail

/// eval() + c10::InferenceMode for a scope; restores each module's own mode.
/// Takes a plain module, a module holder or a std::shared_ptr to a module.
class InferenceScope {
 public:
  explicit InferenceScope(ModuleRef module) : eval_(std::move(module)) {}

 private:
  detail::EvalScope eval_;
  c10::InferenceMode inference_;
};

/// A module behind the options of ModelOptions. `Stored` is the holder type
/// (e.g. `Net` from TORCH_MODULE, `torch::nn::Sequential`) or a
/// std::shared_ptr to a plain module. The module stays reachable: `->`, module().
template <typename Stored>
class Optimized {
 public:
  using ModuleHolder = Stored;
  Optimized(Stored module, const ModelOptions& options);

  template <typename... Args>
  auto forward(Args&&... args);
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
  /// forward in eval mode under c10::InferenceMode. From several threads: on a model in eval() mode the calls
  /// run side by side; on one that each call must switch to eval() and back, one at a time, so that no call
  /// runs while another switches the modes back (call `model->eval()` once to serve from several threads).
  template <typename... Args>
  auto infer(Args&&... args) {
    std::shared_lock<std::shared_mutex> side_by_side(*modes_);
    std::unique_lock<std::shared_mutex> alone;
    if (detail::any_training(*module_)) {  // the scope below switches modes: no other call may run meanwhile
      side_by_side.unlock();
      alone = std::unique_lock<std::shared_mutex>(*modes_);
    }
    InferenceScope scope(*module_);
    return forward(std::forward<Args>(args)...);
  }

  ModuleHolder& module() noexcept { return module_; }
  auto* operator->() noexcept { return module_.get(); }
  const ModelOptions& options() const noexcept { return options_; }
  c10::Device device() const noexcept { return device_; }
  /// The recipe in use and why (measured on ModelOptions().example, pinned, or the flags).
  const RecipeChoice& choice() const noexcept { return choice_; }
  const Recipe& recipe() const noexcept { return choice_.recipe; }

 private:
  template <typename... Args>
  auto eager_forward(Args&&... args);
  void choose(const at::Tensor& example);
  void capture(const at::Tensor& example);
  at::Tensor prepare(const at::Tensor& t) const;
  template <typename T>
  decltype(auto) prepare_arg(T&& x) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return prepare(x);
    } else {
      return std::forward<T>(x);
    }
  }

  ModuleHolder module_;
  ModelOptions options_;
  c10::Device device_ = c10::Device(c10::kCPU);
  RecipeChoice choice_;
  std::shared_ptr<Graphed<at::Tensor>> graph_;  // recipe().graph(): replays for the example's shape
  std::vector<int64_t> graph_sizes_;
  std::shared_ptr<std::shared_mutex> modes_ = std::make_shared<std::shared_mutex>();  // infer(); copies share it
};

/// Moves `module` to the device, converts it to channels-last, and wraps its
/// forward with input conversion and autocast, as ModelOptions says. `module`:
/// a module holder (kept by value, sharing the module), a std::shared_ptr to a
/// module, a plain module passed as a temporary (moved in) or by reference
/// (not owned: it must outlive the result).
template <typename M>
auto optimize(M&& module, const ModelOptions& options = ModelOptions()) {
  using D = std::decay_t<M>;
  if constexpr (std::is_base_of_v<torch::detail::ModuleHolderIndicator, D>) {
    return Optimized<D>(std::forward<M>(module), options);
  } else if constexpr (detail::is_shared_ptr_v<D>) {
    static_assert(std::is_base_of_v<torch::nn::Module, typename D::element_type>,
                  "perf::optimize: a std::shared_ptr to a torch::nn::Module");
    return Optimized<D>(std::forward<M>(module), options);
  } else {
    static_assert(std::is_base_of_v<torch::nn::Module, D>, "perf::optimize: needs a torch::nn::Module");
    if constexpr (std::is_lvalue_reference_v<M>) {
      return Optimized<std::shared_ptr<D>>(std::shared_ptr<D>(std::shared_ptr<D>(), &module), options);  // not owned
    } else {
      return Optimized<std::shared_ptr<D>>(std::make_shared<D>(std::forward<M>(module)), options);
    }
  }
}

/// A Conv2d computing conv followed by bn (both in eval mode) in one
/// convolution, as torch.nn.utils.fuse_conv_bn_eval does.
torch::nn::Conv2d fuse_conv_bn(const torch::nn::Conv2d& conv, const torch::nn::BatchNorm2d& bn);

/// A new Sequential (eval mode) with every Conv2d directly followed by a
/// BatchNorm2d fused into one Conv2d. The input
/// Sequential must be in eval mode and is left unchanged; other modules are shared.
torch::nn::Sequential fuse_conv_bn(const torch::nn::Sequential& seq);

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

/// Activation checkpointing: runs fn(inputs) without keeping its activations,
/// then recomputes it during backward, with the forward's RNG state (dropout
/// matches) and autocast state (enabled, dtype, weight cache), in an autocast
/// region of its own: its cached casts end with the recomputation. Gradients
/// equal the non-checkpointed ones, the parameters' too when no input requires
/// grad (a block fed the data).
/// With grad mode on the output always requires grad, as fn's parameters are
/// unknown until the recomputation. Reentrant: backward() fills .grad();
/// torch::autograd::grad() and backward(inputs) are refused, as in Python.
at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs, bool preserve_rng_state = true);

// ---------------------------------------------------------------------------

namespace detail {

// A module's forward taking one tensor and returning one: what a CUDA graph recipe can replay.
template <typename Holder, typename = void>
struct graphable_forward : std::false_type {};
template <typename Holder>
struct graphable_forward<
    Holder,
    std::enable_if_t<std::is_same_v<
        std::decay_t<decltype(std::declval<Holder&>()->forward(std::declval<const at::Tensor&>()))>, at::Tensor>>>
    : std::true_type {};

// Every 4-D/5-D parameter and buffer channels-last (for its rank), or contiguous.
PERF_INLINE void relayout(torch::nn::Module& module, bool channels_last);

// The index of the fastest of the first n times, where a later (less simple)
// candidate must beat the fastest before it by 2% (noise) to take its place.
PERF_INLINE size_t fastest(const std::vector<double>& ms, size_t n);

PERF_INLINE bool has_image_tensors(torch::nn::Module& module, const at::Tensor& example);

}  // namespace detail

template <typename M>
Optimized<M>::Optimized(M module, const ModelOptions& options) : module_(std::move(module)), options_(options) {
  if constexpr (detail::is_shared_ptr_v<M>) {
    TORCH_CHECK(module_ != nullptr, "perf::optimize: null std::shared_ptr to a module");
  } else {
    TORCH_CHECK(!module_.is_empty(), "perf::optimize: the module holder is empty");
  }
  TORCH_CHECK(options_.tune_seconds() > 0, "perf::ModelOptions::tune_seconds must be > 0, got ",
              options_.tune_seconds());
  if (options_.device()) {
    device_ = *options_.device();
    module_->to(device_);
  } else {
    const auto params = module_->parameters();
    if (!params.empty()) device_ = params.front().device();
  }
  if (options_.autocast()) Autocast::resolve_dtype(device_, options_.autocast_dtype());  // fail at construction
  if (options_.recipe()) {
    const Recipe& r = *options_.recipe();
    TORCH_CHECK(!r.graph() || device_.is_cuda(),
                "perf::ModelOptions::recipe: graph(true) needs a CUDA device, the "
                "model is on ",
                device_);
    TORCH_CHECK(!r.graph() || options_.example().defined(),
                "perf::ModelOptions::recipe: graph(true) needs ModelOptions().example(x) to capture");
    if (r.autocast()) Autocast::resolve_dtype(device_, r.autocast());
    choice_.recipe = r;
    choice_.reason = "pinned by ModelOptions().recipe(...)";
  } else if (options_.example().defined()) {
    choose(options_.example());
  } else {
    choice_.recipe.channels_last(options_.channels_last());
    if (options_.autocast() && (options_.autocast_dtype() || Autocast::default_enabled(device_)))
      choice_.recipe.autocast(Autocast::resolve_dtype(device_, options_.autocast_dtype()));
    choice_.reason =
        "the flags of ModelOptions, not measured: ModelOptions().example(x) measures the recipes and "
        "keeps the fastest";
  }
  if (choice_.recipe.channels_last()) to_channels_last(*module_);
  if (choice_.recipe.graph() && !graph_) capture(options_.example());  // choose() captured its own
}

// Measures the allowed recipes on `example` (eval mode, inference), fastest
// wins; a candidate must beat a simpler one by 2% to be kept (noise). Layout
// candidates are measured in groups (converting parameters between them, each
// group twice where time allows), the calls of a group alternately (perf::compare).
// The module's values never change: eval mode mutates no buffers, and
// relayout keeps every value.
template <typename M>
void Optimized<M>::choose(const at::Tensor& example_in) {
  const auto started = std::chrono::steady_clock::now();
  const at::Tensor example = example_in.to(device_);
  std::vector<bool> layouts = {false};
  if (options_.channels_last() && detail::has_image_tensors(*module_, example)) layouts.push_back(true);
  std::vector<std::optional<c10::ScalarType>> precisions = {std::nullopt};
  if (options_.autocast() && (options_.autocast_dtype() || Autocast::default_enabled(device_)))
    precisions.push_back(Autocast::resolve_dtype(device_, options_.autocast_dtype()));
  // Each candidate's first call is timed apart (choice().first_call_seconds): tune_seconds bounds the measured
  // calls, not these (on an H100 a whole decision took 9.6 s against tune_seconds' 1.5 s), and the measured
  // calls would otherwise start with them.
  choice_.first_call_seconds = choice_.capture_seconds = 0;
  // autotune_candidates(false): cuDNN's heuristic algorithms while the candidates are measured, cached apart from
  // the program's plans (perf/cuda_graph.h), the program's flags back for the winner's capture below (and in any
  // case when this returns or throws).
  detail::CudnnHeuristicPlans heuristic_plans(device_.is_cuda() && !options_.autotune_candidates());
  const bool heuristics = heuristic_plans.active(), heuristics_apart = heuristic_plans.plans_apart();
  const auto first_call = [this](const std::function<void()>& call) {
    detail::idle(device_);  // so that no earlier queued kernel delays the start event (perf/bench.h)
    Timer timer(device_);
    timer.start();
    call();
    timer.stop();
    choice_.first_call_seconds += timer.elapsed_ms() / 1e3;
  };
  const auto timed_capture = [this](const at::Tensor& x) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto count = c10::make_scope_exit([&] {  // a failed capture's time is counted too
      choice_.capture_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
    capture(x);
  };
  // The plain model's first call, then one timed call: what a call costs, for the budget (and on a slow model
  // the plain recipe's first timed call, below).
  detail::relayout(*module_, false);
  double call_s = 0;
  {
    InferenceScope scope(*module_);
    choice_.recipe = Recipe();
    first_call([&] { eager_forward(example); });
    detail::idle(device_);
    Timer timer(device_);
    timer.start();
    eager_forward(example);
    timer.stop();
    call_s = timer.elapsed_ms() / 1e3;
  }
  const size_t candidates = layouts.size() * precisions.size();
  // On CUDA each candidate is measured as a CUDA graph as well (below), about as many calls again.
  const bool try_graphs = detail::graphable_forward<M>::value && device_.is_cuda();
  // Calls per candidate within tune_seconds (the plain model's cost standing
  // for all): two alternating passes where there is room, else one pass of
  // two timed calls after the first, so a slow model's decision stays near the budget.
  // On CUDA compare() runs each call once more, untimed, before each timed one (perf/bench.h).
  const double runs_per_timed_call = device_.is_cuda() ? 2.0 : 1.0;
  const double calls = options_.tune_seconds() / ((try_graphs ? 2.0 : 1.0) * runs_per_timed_call *
                                                  static_cast<double>(candidates) * std::max(call_s, 1e-5));
  const int passes = calls >= 10 ? 2 : 1;
  const int warmup = passes == 2 ? 2 : 1;
  const int iters = static_cast<int>(std::clamp<double>(calls / passes - warmup, 2.0, 25.0));
  std::vector<std::vector<double>> samples(candidates);
  std::vector<Recipe> recipes(candidates);
  for (int pass = 0; pass < passes; ++pass) {
    for (size_t l = 0; l < layouts.size(); ++l) {
      detail::relayout(*module_, layouts[l]);
      InferenceScope scope(*module_);
      std::vector<std::pair<std::string, std::function<void()>>> group;
      for (size_t p = 0; p < precisions.size(); ++p) {
        const size_t k = l * precisions.size() + p;
        recipes[k] = Recipe().channels_last(layouts[l]).autocast(precisions[p]);
        group.emplace_back(recipes[k].name(), [this, k, &recipes, &example] {
          choice_.recipe = recipes[k];
          eager_forward(example);
        });
        if (pass == 0 && k > 0) first_call(group.back().second);  // the plain model's (k = 0) was above
      }
      // Pass 0: every candidate's first call has just run (above) and is its first warm-up call; on a slow
      // model (one pass) one call in four fewer.
      const int group_warmup = pass == 0 ? warmup - 1 : warmup;
      if (passes == 1 && l == 0 && group.size() == 1) {
        // A slow model whose plain recipe is alone in its layout (no autocast candidate): the budget's timed
        // call (above) ran just before, the same way, with no warm-up left to do, so it is this group's first
        // timed call, and the group runs one call fewer.
        auto times =
            detail::time_round_robin({&group[0].second}, BenchOptions().warmup(0).iters(iters - 1).device(device_));
        times[0].push_back(call_s * 1e3);
        samples[0].push_back(Stats::from(std::move(times[0])).median_ms);
        continue;
      }
      const auto stats = compare(group, BenchOptions().warmup(group_warmup).iters(iters).device(device_));
      for (size_t p = 0; p < stats.size(); ++p) samples[l * precisions.size() + p].push_back(stats[p].median_ms);
    }
  }
  // CUDA: every candidate's forward replayed as a CUDA graph too (static shapes, inference). A graph takes the
  // host's launches out of the time, so the eager ranking does not carry over: a recipe with more kernels
  // (autocast's casts) can lose eagerly and win replayed. Each layout's graphs hold its parameters' addresses,
  // so they are captured, measured beside that layout's eager calls, and dropped before the next relayout.
  std::string graph_failed;
  if constexpr (detail::graphable_forward<M>::value) {
    if (try_graphs) {
      for (size_t l = 0; l < layouts.size() && graph_failed.empty(); ++l) {
        detail::relayout(*module_, layouts[l]);
        std::vector<std::shared_ptr<Graphed<at::Tensor>>> graphs;
        for (size_t p = 0; p < precisions.size(); ++p) {
          choice_.recipe = Recipe(recipes[l * precisions.size() + p]).graph(true);
          try {
            timed_capture(example);  // a forward that cannot be captured (a sync, a CPU op) stays eager, says why
          } catch (const std::exception& e) {
            graph_failed = detail::first_line(e);
            break;
          }
          graphs.push_back(std::move(graph_));
        }
        graph_.reset();
        if (!graph_failed.empty()) break;
        InferenceScope scope(*module_);  // as infer() replays it
        std::vector<std::pair<std::string, std::function<void()>>> group;
        for (size_t p = 0; p < precisions.size(); ++p) {
          const size_t k = l * precisions.size() + p;
          group.emplace_back(recipes[k].name(), [this, k, &recipes, &example] {
            choice_.recipe = recipes[k];
            eager_forward(example);
          });
          group.emplace_back(Recipe(recipes[k]).graph(true).name(), [g = graphs[p], &example] { (*g)(example); });
        }
        const auto stats = compare(group, BenchOptions().warmup(warmup).iters(iters).device(device_));
        for (size_t p = 0; p < precisions.size(); ++p) {
          const size_t k = l * precisions.size() + p;
          samples[k].push_back(stats[2 * p].median_ms);
          recipes.push_back(Recipe(recipes[k]).graph(true));
          samples.push_back({stats[2 * p + 1].median_ms});
        }
      }
    }
  }
  std::vector<double> ms(recipes.size());
  for (size_t k = 0; k < recipes.size(); ++k) ms[k] = *std::min_element(samples[k].begin(), samples[k].end());
  const size_t best = detail::fastest(ms, ms.size());  // eager recipes are listed before graphed ones
  for (size_t k = 0; k < recipes.size(); ++k) choice_.measured_ms.emplace_back(recipes[k], ms[k]);
  std::ostringstream why;
  why << "fastest of " << recipes.size() << " measured";
  if (recipes.size() > candidates)
    why << " (" << candidates << " eager, " << recipes.size() - candidates << " as CUDA graphs)";
  why << " on " << example.sizes() << " " << example.scalar_type() << " on " << device_;
  if (!graph_failed.empty()) why << "; not as a CUDA graph: capture failed (" << graph_failed << ")";
  if (heuristics) {
    why << "; measured on cuDNN's heuristic algorithms (autotune_candidates(false))";
    // ATen's plan cache ignores the benchmark flag: where the program's convolutions are deterministic already,
    // the candidates' key is the winner's, and it keeps their plans.
    if (!heuristics_apart) why << ", which the winner keeps: the program's convolutions are deterministic";
  }
  choice_.recipe = recipes[best];
  detail::relayout(*module_, choice_.recipe.channels_last());
  heuristic_plans.release();  // the winner autotunes in its capture's warm-up
  if (choice_.recipe.graph()) {
    try {
      timed_capture(example);  // measured above on this layout; captured again for the parameters' addresses now
    } catch (const std::exception& e) {
      graph_.reset();
      choice_.recipe = recipes[detail::fastest(ms, candidates)];
      detail::relayout(*module_, choice_.recipe.channels_last());
      why << "; " << recipes[best].name() << " was fastest, but capturing it again failed (" << detail::first_line(e)
          << "): eager";
    }
  }
  choice_.reason = why.str();
  choice_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

// Captures the recipe's eager forward in eval mode for the example's shape
// (perf::graph: warm-up on a side stream, forward under NoGradGuard). Not under
// InferenceMode: its static buffers would be inference tensors, which a call
// under NoGradGuard could not copy into.
template <typename M>
void Optimized<M>::capture(const at::Tensor& example) {
  if constexpr (detail::graphable_forward<M>::value) {
    const at::Tensor x = prepare(example.to(device_));
    graph_sizes_ = example.sizes().vec();
    detail::EvalScope eval(*module_);
    graph_ = std::make_shared<Graphed<at::Tensor>>(  // with the module: weights loaded later are seen
        [this](const std::vector<at::Tensor>& in) -> at::Tensor { return eager_forward(in[0]); },
        std::vector<at::Tensor>{x}, GraphOptions(), ModuleRef(module_));
  } else {
    TORCH_CHECK(false, "perf::Recipe::graph: the module's forward must take one tensor and return one");
  }
}

template <typename M>
at::Tensor Optimized<M>::prepare(const at::Tensor& t) const {
  if (!t.defined()) return t;
  at::Tensor out = t.device() == device_ ? t : t.to(device_, /*non_blocking=*/true);
  if (choice_.recipe.channels_last() && (out.dim() == 4 || out.dim() == 5)) out = channels_last(out);
  return out;
}

template <typename M>
template <typename... Args>
auto Optimized<M>::forward(Args&&... args) {
  // The CUDA graph: one input of the example's shape, eval mode, no autograd.
  if constexpr (sizeof...(Args) == 1 && (std::is_convertible_v<Args&&, const at::Tensor&> && ...) &&
                detail::graphable_forward<M>::value) {
    if (graph_ && !at::GradMode::is_enabled() && !module_->is_training()) {
      const at::Tensor& x = (args, ...);
      if (x.defined() && x.sizes() == c10::IntArrayRef(graph_sizes_)) {
        at::Tensor out = (*graph_)(x.device() == device_ ? x : x.to(device_, /*non_blocking=*/true));
        if (options_.float_outputs() && at::isFloatingType(out.scalar_type()) && out.scalar_type() != at::kFloat)
          out = out.to(at::kFloat);
        return out;
      }
    }
  }
  return eager_forward(std::forward<Args>(args)...);
}

template <typename M>
template <typename... Args>
auto Optimized<M>::eager_forward(Args&&... args) {
  std::optional<Autocast> ac;
  if (choice_.recipe.autocast()) ac.emplace(device_, choice_.recipe.autocast());
  auto run = [&] { return module_->forward(prepare_arg(std::forward<Args>(args))...); };
  decltype(run()) out;
  if (!choice_.recipe.channels_last()) {
    out = run();
  } else {
    try {
      out = run();
    } catch (c10::Error& e) {
      // .view() after a convolution needs NCHW-contiguous activations.
      if (std::string(e.what_without_backtrace()).find("view size is not compatible") != std::string::npos) {
        e.add_context(
            "perf::optimize: the model runs in channels-last, where activations are not NCHW-contiguous, and its "
            "forward calls .view(); use .reshape(...) or .flatten(1) there instead, or "
            "perf::ModelOptions().channels_last(false)");
      }
      throw;
    }
  }
  if constexpr (std::is_same_v<std::decay_t<decltype(out)>, at::Tensor>) {
    if (options_.float_outputs() && out.defined() && at::isFloatingType(out.scalar_type()) &&
        out.scalar_type() != at::kFloat) {
      out = out.to(at::kFloat);
    }
  }
  return out;
}

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/model-inl.h>
#endif
