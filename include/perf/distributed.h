// perf/distributed.h — data-parallel training across processes on c10d.
//
//   auto pg = perf::init_process_group();     // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK picks the GPU)
//   perf::DistributedDataParallel ddp(model, pg);  // rank 0's parameters and buffers broadcast
//   loss_fn(ddp(x), y).backward();             // gradients averaged in buckets while backward runs
//   { auto guard = ddp.no_sync(); ... }        // accumulate locally, no communication
//
// Built on c10d from LibTorch itself (TCPStore, ProcessGroupGloo,
// ProcessGroupNCCL), as Python's torch.distributed is. Every wait is bounded by
// ProcessGroupOptions::timeout: a missing peer or an unreachable master is an
// error that names the variable and the fix, never a hang.
//
// Gloo's headers are not in the LibTorch wheel: the Gloo backend needs them on
// the include path (Debian/Ubuntu: libgloo-dev); without them "gloo" is a clear
// error and NCCL still works.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/detail/cpu.h>
#include <perf/detail/ddp_registry.h>
#include <perf/detail/float.h>
#include <torch/arg.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

// Which backends perf can form: their headers are found. Only init_process_group's
// body (impl/distributed-inl.h) includes c10d's ProcessGroupGloo.hpp and
// ProcessGroupNCCL.hpp, so a perf::perf_static user's translation units do not
// compile them (NCCL's alone takes GCC about 200 MB; docs/compile-time.md).
#if defined(USE_C10D_GLOO) && defined(__has_include)
#if __has_include(<gloo/config.h>)
#define PERF_WITH_GLOO 1
#endif
#endif
#ifndef PERF_WITH_GLOO
#define PERF_WITH_GLOO 0
#endif

#if PERF_WITH_CUDA && defined(USE_C10D_NCCL) && defined(__has_include)
#if __has_include(<nccl.h>)
#define PERF_WITH_NCCL 1
#endif
#endif
#ifndef PERF_WITH_NCCL
#define PERF_WITH_NCCL 0
#endif

#include <unistd.h>  // gethostname

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace perf {

/// How perf::init_process_group() joins the job. Unset fields come from
/// torchrun's environment variables (named on each).
struct ProcessGroupOptions {
  /// This process's rank, 0..world_size-1. Unset: RANK.
  TORCH_ARG(std::optional<int>, rank);
  /// Number of processes. Unset: WORLD_SIZE.
  TORCH_ARG(std::optional<int>, world_size);
  /// Address of rank 0's store. Unset: MASTER_ADDR.
  TORCH_ARG(std::optional<std::string>, master_addr);
  /// Port of rank 0's store, 1..65535. Unset: MASTER_PORT.
  TORCH_ARG(std::optional<int>, master_port);
  /// This process's GPU (NCCL). Unset: LOCAL_RANK, else 0.
  TORCH_ARG(std::optional<int>, local_rank);
  /// "gloo" (CPU tensors), "nccl" (CUDA tensors) or "auto": nccl when a CUDA
  /// device is visible and perf has NCCL, else gloo.
  TORCH_ARG(std::string, backend) = "auto";
  /// Bound on every rendezvous and collective wait.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(10);
};

/// Joins the process group: rank 0 hosts a c10d::TCPStore at master_addr:port,
/// every rank connects to it, and the backend (Gloo or NCCL) forms over it.
/// Returns the c10d::ProcessGroup whose collectives (allreduce, broadcast, ...)
/// the caller and perf::DistributedDataParallel use.
///
/// It also counts the job's processes on this machine (LOCAL_WORLD_SIZE where a
/// launcher set it, else through the store, by host name). Where several share
/// the machine and each still has LibTorch's default of one intra-op thread per
/// core (neither OMP_NUM_THREADS nor MKL_NUM_THREADS set, as when launched
/// without torchrun), each gets cores / processes threads (at least 1), with a
/// warning: oversubscribed, OpenMP's threads spin at every barrier waiting for
/// threads that have no core.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& options = ProcessGroupOptions());

/// Shuts the group's backends down (NCCL communicators finalised), as
/// torch.distributed.destroy_process_group() does: call it after the last
/// collective, before the program exits (without it NCCL may report errors
/// from its watchdog while the process tears down). The group is unusable after.
void destroy_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group);

namespace detail {
struct DDPSinkState;

// The intra-op threads each of `processes` processes sharing `cores` physical
// cores gets from init_process_group when each runs `threads`: cores / processes
// (at least 1) where each has LibTorch's default (threads >= cores); 0 (leave
// them) for one process, an unknown core count, or a count the program chose
// (`chosen`: OMP_NUM_THREADS or MKL_NUM_THREADS set, or fewer threads than cores).
int shared_core_threads(int processes, int64_t cores, int threads, bool chosen);
}  // namespace detail

/// perf::DistributedDataParallel's options, named and defaulted as Python's
/// torch.nn.parallel.DistributedDataParallel.
struct DDPOptions {
  /// Gradient bucket size in MiB: one all-reduce per bucket, started as soon as
  /// the bucket's gradients are ready during backward.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// The first bucket (the last layers' gradients, ready first) is smaller so
  /// that communication starts early. Unset: as Python, 1 MiB with the default
  /// bucket_cap_mb, else bucket_cap_mb.
  TORCH_ARG(std::optional<double>, first_bucket_cap_mb);
  /// Gradients are views into the all-reduce buckets: no copy, less memory.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Parameters that did not take part in this forward are marked ready (found
  /// by walking the autograd graph from the outputs: costs time every step).
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Broadcast rank 0's buffers (BatchNorm running stats) before each forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// The set of used parameters and their order never change: the Reducer
  /// learns them in the first iteration and skips the checks afterwards.
  TORCH_ARG(bool, static_graph) = false;
  /// Gradient compression: "none", "fp16" (c10d's built-in FP16_COMPRESS hook)
  /// or "bf16" (same scheme, bfloat16): halves the bytes sent.
  TORCH_ARG(std::string, compression) = "none";
};

/// Wraps a module for data-parallel training, as Python's DDP does, on the same
/// engine: c10d::Reducer buckets the gradients and all-reduces (averages) them
/// across the process group while backward runs. Every rank must construct it
/// with the same model (checked), call it the same number of times, and run
/// backward after each synchronised forward.
template <typename ModuleImpl>
class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<ModuleImpl> module, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                          DDPOptions options = DDPOptions());
  DistributedDataParallel(const torch::nn::ModuleHolder<ModuleImpl>& module,
                          c10::intrusive_ptr<c10d::ProcessGroup> process_group, DDPOptions options = DDPOptions())
      : DistributedDataParallel(module.ptr(), std::move(process_group), std::move(options)) {}
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Forwards to module->forward(args...), with the Reducer told about this
  /// iteration (and rank 0's buffers broadcast first, if asked).
  template <typename... Args>
  auto operator()(Args&&... args);

  /// While the guard lives, forward/backward accumulate gradients locally
  /// without communication; the first synchronised backward after it reduces
  /// the accumulated sum.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp), prev_(ddp.sync_) { ddp_.sync_ = false; }
    ~NoSyncGuard() { ddp_.sync_ = prev_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool prev_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  const std::shared_ptr<ModuleImpl>& module() const noexcept { return module_; }
  ModuleImpl* operator->() const noexcept { return module_.get(); }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const noexcept { return pg_; }
  const DDPOptions& options() const noexcept { return options_; }
  /// The parameters the Reducer synchronises (those requiring grad), in order.
  const std::vector<at::Tensor>& parameters() const noexcept { return params_; }
  /// Indices into parameters() per gradient bucket, in the order the Reducer
  /// reduces them (after the first iteration: the order gradients became ready).
  std::vector<std::vector<size_t>> buckets() const;
  c10d::Reducer& reducer() { return *reducer_; }

 private:
  void pre_forward();
  template <typename Out>
  Out post_forward(Out out);

  std::shared_ptr<ModuleImpl> module_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  DDPOptions options_;
  std::vector<at::Tensor> params_, buffers_;
  std::unique_ptr<c10d::Reducer> reducer_;
  bool sync_ = true;
  bool sync_buffers_next_ = true;                  // Python's require_forward_param_sync
  c10::intrusive_ptr<detail::DDPSinkState> sink_;  // what the outputs' DDPSink reaches in backward
};

template <typename ModuleImpl>
DistributedDataParallel(torch::nn::ModuleHolder<ModuleImpl>, c10::intrusive_ptr<c10d::ProcessGroup>)
    -> DistributedDataParallel<ModuleImpl>;
template <typename ModuleImpl>
DistributedDataParallel(torch::nn::ModuleHolder<ModuleImpl>, c10::intrusive_ptr<c10d::ProcessGroup>, DDPOptions)
    -> DistributedDataParallel<ModuleImpl>;

// ---------------------------------------------------------------------------
namespace detail {

// An int from the option or from the environment, range-checked; errors name
// both the option and the variable.
PERF_INLINE int dist_int(const std::optional<int>& given, const char* option, const char* var, int lo, int hi);

// Python's DDP broadcasts module state in 250 MiB buckets.
constexpr size_t kBroadcastBucketBytes = size_t{250} << 20;

// Visits every tensor of a forward's output: a Tensor, or std::vector,
// std::pair, std::tuple and the values of std::map and std::unordered_map of
// them, nested (Python's DDP flattens the output).
template <typename F>
void for_each_tensor(at::Tensor& t, F& f);
template <typename T, typename F>
void for_each_tensor(std::vector<T>& v, F& f);
template <typename A, typename B, typename F>
void for_each_tensor(std::pair<A, B>& p, F& f);
template <typename... T, typename F>
void for_each_tensor(std::tuple<T...>& t, F& f);
template <typename K, typename V, typename F>
void for_each_tensor(std::map<K, V>& m, F& f);
template <typename K, typename V, typename F>
void for_each_tensor(std::unordered_map<K, V>& m, F& f);
template <typename T, typename F>
void for_each_tensor(T& /*no tensors*/, F& /*f*/) {}
template <typename F>
void for_each_tensor(at::Tensor& t, F& f) {
  if (t.defined()) f(t);
}
template <typename T, typename F>
void for_each_tensor(std::vector<T>& v, F& f) {
  for (auto& x : v) for_each_tensor(x, f);
}
template <typename A, typename B, typename F>
void for_each_tensor(std::pair<A, B>& p, F& f) {
  for_each_tensor(p.first, f);
  for_each_tensor(p.second, f);
}
template <typename... T, typename F>
void for_each_tensor(std::tuple<T...>& t, F& f) {
  std::apply([&](auto&... x) { (for_each_tensor(x, f), ...); }, t);
}
template <typename K, typename V, typename F>
void for_each_tensor(std::map<K, V>& m, F& f) {
  for (auto& kv : m) for_each_tensor(kv.second, f);
}
template <typename K, typename V, typename F>
void for_each_tensor(std::unordered_map<K, V>& m, F& f) {
  for (auto& kv : m) for_each_tensor(kv.second, f);
}

// c10d's FP16_COMPRESS scheme in bfloat16: divide, compress, all-reduce, decompress.
class BF16CompressHook : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  explicit BF16CompressHook(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) : CppCommHookInterface(pg) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    auto compressed = bucket.getBufferRef().to(at::kBFloat16);
    compressed.div_(state_->getSize());
    std::vector<at::Tensor> tensors = {compressed};
    auto fut = state_->allreduce(tensors)->getFuture();
    at::Tensor out = bucket.getBufferRef();
    return fut->then(
        [out](c10::ivalue::Future& f) {
          out.copy_(f.value().toTensorVector().at(0));
          return c10::IValue(out);
        },
        c10::TensorType::get());
  }
};

// What DDPSink's backward reaches: the Reducer (null once the DDP is gone),
// and Python's _static_graph_delay_allreduce_enqueued. Shared with the autograd
// graph, which may outlive the DDP.
struct DDPSinkState : torch::CustomClassHolder {
  c10d::Reducer* reducer = nullptr;
  bool static_graph = false;
  bool delay_all_reduce_enqueued = false;
};

// Python's _DDPSink, through which the forward's outputs pass (those with a
// grad_fn). Its backward runs for every output once the loss's backward reaches
// it, handing the outputs left out of the loss an undefined gradient: their
// parameters' hooks then fire, so find_unused_parameters' Reducer (which found
// them from the outputs) finishes the iteration. Under static_graph, in the
// first iteration the Reducer only records which parameters are used; the
// callback it queues all-reduces everything at the end of that backward.
struct DDPSink : public torch::autograd::Function<DDPSink> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList outputs,
                                                const c10::intrusive_ptr<DDPSinkState>& state) {
    ctx->set_materialize_grads(false);  // an output left out of the loss keeps an undefined gradient
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    torch::autograd::variable_list out;
    for (const auto& t : outputs) out.push_back(t.clone());
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = c10::static_intrusive_pointer_cast<DDPSinkState>(ctx->saved_data["state"].toCapsule());
    TORCH_CHECK(s->reducer != nullptr,
                "perf::DistributedDataParallel: backward ran after the DistributedDataParallel that made its forward "
                "was destroyed; keep it alive until backward");
    if (s->static_graph && !s->delay_all_reduce_enqueued) {
      auto* reducer = s->reducer;
      torch::autograd::Engine::get_default_engine().queue_callback([reducer] { reducer->delay_all_reduce(); });
      s->delay_all_reduce_enqueued = true;
    }
    grads.emplace_back();  // for `state`
    return grads;
  }
};

PERF_INLINE std::string resolve_backend(const std::string& b);

}  // namespace detail

// ---------------------------------------------------------------------------

PERF_INLINE c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& o);

// ---------------------------------------------------------------------------

template <typename ModuleImpl>
DistributedDataParallel<ModuleImpl>::DistributedDataParallel(std::shared_ptr<ModuleImpl> module,
                                                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                                             DDPOptions options)
    : module_(std::move(module)), pg_(std::move(process_group)), options_(std::move(options)) {
  TORCH_CHECK(module_ != nullptr, "perf::DistributedDataParallel: the module is empty (nullptr)");
  TORCH_CHECK(pg_,
              "perf::DistributedDataParallel: the process group is empty; create it with "
              "perf::init_process_group()");
  TORCH_CHECK(options_.bucket_cap_mb() > 0, "perf::DDPOptions::bucket_cap_mb: must be > 0 MiB, got ",
              options_.bucket_cap_mb());
  TORCH_CHECK(!options_.first_bucket_cap_mb() || *options_.first_bucket_cap_mb() > 0,
              "perf::DDPOptions::first_bucket_cap_mb: must be > 0 MiB, got ",
              options_.first_bucket_cap_mb().value_or(0));
  const std::string& comp = options_.compression();
  TORCH_CHECK(comp == "none" || comp == "fp16" || comp == "bf16", "perf::DDPOptions::compression: invalid value \"",
              comp, "\"; valid values: \"none\", \"fp16\", \"bf16\"");
  TORCH_CHECK(!(options_.static_graph() && options_.find_unused_parameters()),
              "perf::DDPOptions: static_graph(true) already handles unused parameters; leave "
              "find_unused_parameters(false) (Python's DDP warns about the same combination)");

  std::unordered_map<size_t, std::string> names;
  std::vector<at::Tensor> state;
  // A tensor registered under two names (tied weights) is one parameter, as Python's DDP keeps a shared parameter
  // once: LibTorch's named_parameters() lists it once per name, and the Reducer would reduce it once per entry.
  std::unordered_set<const void*> seen;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    state.push_back(item.value());
    if (!item.value().requires_grad()) continue;
    names[params_.size()] = item.key();
    params_.push_back(item.value());
  }
  TORCH_CHECK(!params_.empty(),
              "perf::DistributedDataParallel: the module has no parameter that requires grad; nothing to synchronise");
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].device() == params_[0].device(), "perf::DistributedDataParallel: parameter '", names[i],
                "' is on ", params_[i].device(), " but '", names[0], "' is on ", params_[0].device(),
                "; put the whole model on one device (this process's GPU, or the CPU)");
    TORCH_CHECK(params_[i].layout() == at::kStrided, "perf::DistributedDataParallel: parameter '", names[i],
                "' is sparse; only dense parameters are supported");
  }
  for (const auto& b : module_->buffers(/*recurse=*/true)) {
    if (b.defined() && seen.insert(b.unsafeGetTensorImpl()).second) buffers_.push_back(b);
  }
  state.insert(state.end(), buffers_.begin(), buffers_.end());

  // The same model on every rank (count, shapes, dtypes: c10d's own check), then rank 0's values everywhere.
  c10d::verify_params_across_processes(pg_, params_, std::nullopt);
  if (pg_->getSize() > 1) {
    torch::NoGradGuard no_grad;
    c10d::broadcast_coalesced(pg_, state, detail::kBroadcastBucketBytes, 0);
  }

  // As Python's DDP: without find_unused_parameters the first iteration runs with
  // one bucket and the Reducer rebuilds them in the order gradients became ready
  // (first bucket first_bucket_cap_mb, then bucket_cap_mb); with it, the buckets
  // are sized now, in reverse parameter order.
  const auto mib = [](double m) { return static_cast<size_t>(m * 1024.0 * 1024.0); };
  const size_t cap = std::max<size_t>(1, mib(options_.bucket_cap_mb()));
  const double first_mb = options_.first_bucket_cap_mb().value_or(
      detail::same_value(options_.bucket_cap_mb(), 25.0) ? 1.0 : options_.bucket_cap_mb());
  const size_t first = std::max<size_t>(1, std::min(cap, mib(first_mb)));
  const std::vector<bool> sparse(params_.size(), false);
  const std::vector<size_t> limits_in = options_.static_graph() || !options_.find_unused_parameters()
                                            ? std::vector<size_t>{std::numeric_limits<size_t>::max()}
                                            : std::vector<size_t>{first, cap};
  auto indices = std::get<0>(c10d::compute_bucket_assignment_by_size(params_, limits_in, sparse));
  std::reverse(indices.begin(), indices.end());
  reducer_ = std::make_unique<c10d::Reducer>(
      params_, indices, pg_, sparse, static_cast<int64_t>(cap), options_.find_unused_parameters(),
      options_.gradient_as_bucket_view(), names, static_cast<int64_t>(first),
      /*skip_all_reduce_unused_params=*/false,
      /*use_python_reducer=*/false,
      /*bucket_bytes_cap_list=*/std::vector<int64_t>{});  // empty: rebuild with first/cap
  if (comp == "fp16") {
    reducer_->register_builtin_comm_hook(c10d::BuiltinCommHookType::FP16_COMPRESS);
  } else if (comp == "bf16") {
    reducer_->register_comm_hook(std::make_unique<detail::BF16CompressHook>(pg_));
  }
  if (options_.static_graph()) reducer_->set_static_graph();
  sink_ = c10::make_intrusive<detail::DDPSinkState>();
  sink_->reducer = reducer_.get();
  sink_->static_graph = options_.static_graph();
  detail::ddp_register(params_, +1);
}

template <typename ModuleImpl>
DistributedDataParallel<ModuleImpl>::~DistributedDataParallel() {
  if (sink_) sink_->reducer = nullptr;
  detail::ddp_register(params_, -1);
}

template <typename ModuleImpl>
std::vector<std::vector<size_t>> DistributedDataParallel<ModuleImpl>::buckets() const {
  std::unordered_map<const void*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].unsafeGetTensorImpl()] = i;
  std::vector<std::vector<size_t>> out;
  for (const auto& bucket : reducer_->get_grad_buckets(/*return_zero_tensors=*/false)) {
    out.emplace_back();
    for (const auto& p : bucket.getParameters()) out.back().push_back(index.at(p.unsafeGetTensorImpl()));
  }
  return out;
}

template <typename ModuleImpl>
template <typename... Args>
auto DistributedDataParallel<ModuleImpl>::operator()(Args&&... args) {
  pre_forward();
  return post_forward(module_->forward(std::forward<Args>(args)...));
}

template <typename ModuleImpl>
void DistributedDataParallel<ModuleImpl>::pre_forward() {
  const bool grad = at::GradMode::is_enabled();
  // The Reducer takes its first backward for the iteration that learns the graph.
  TORCH_CHECK(!(grad && !sync_ && options_.static_graph() && !sink_->delay_all_reduce_enqueued),
              "perf::DistributedDataParallel: static_graph(true) learns the graph in the first synchronised "
              "iteration, so no_sync() cannot come before it (Python's DDP fails an internal assert there); run the "
              "first iteration synchronised, then accumulate under no_sync()");
  if (grad && sync_) reducer_->prepare_for_forward();
  // Before the forward's activations exist: rebuilding allocates new buckets.
  if (grad) reducer_->rebuild_buckets();
  if (sync_buffers_next_ && options_.broadcast_buffers() && !buffers_.empty() && pg_->getSize() > 1) {
    torch::NoGradGuard no_grad;
    c10d::broadcast_coalesced(pg_, buffers_, detail::kBroadcastBucketBytes, 0);
  }
}

template <typename ModuleImpl>
template <typename Out>
Out DistributedDataParallel<ModuleImpl>::post_forward(Out out) {
  if (!(at::GradMode::is_enabled() && sync_)) {
    sync_buffers_next_ = false;
    return out;
  }
  sync_buffers_next_ = true;
  std::vector<at::Tensor*> found;
  auto find = [&found](at::Tensor& t) { found.push_back(&t); };
  detail::for_each_tensor(out, find);
  const bool find_unused = options_.find_unused_parameters() && !options_.static_graph();
  const bool sink = find_unused || (options_.static_graph() && !sink_->delay_all_reduce_enqueued);
  TORCH_CHECK(!sink || !found.empty(), "perf::DistributedDataParallel: ",
              find_unused ? "find_unused_parameters(true) walks the autograd graph from the forward's outputs"
                          : "static_graph(true) all-reduces the first iteration's gradients from the forward's outputs",
              ", but forward returned no tensor perf can find (supported: a Tensor, and std::vector, std::tuple, "
              "std::pair, std::map and std::unordered_map of them, nested)");
  std::vector<at::Tensor> outputs;
  if (find_unused) {
    for (auto* t : found) outputs.push_back(*t);
  }
  reducer_->prepare_for_backward(outputs);
  if (sink) {
    std::vector<at::Tensor> through;
    std::vector<at::Tensor*> where;
    for (auto* t : found) {
      if (!t->grad_fn()) continue;  // as Python: a tensor without grad_fn is left alone
      through.push_back(*t);
      where.push_back(t);
    }
    if (!through.empty()) {
      auto passed = detail::DDPSink::apply(at::TensorList(through), sink_);
      for (size_t i = 0; i < where.size(); ++i) *where[i] = std::move(passed[i]);
    }
  }
  return out;
}

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/distributed-inl.h>
#endif
