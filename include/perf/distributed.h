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
#include <perf/detail/data_parallel.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

// Only the process group here: c10d's Reducer, comm and store headers are the
// definitions' (impl/distributed-inl.h; docs/compile-time.md).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace c10d {
class Reducer;
}  // namespace c10d

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

namespace detail {

// What DistributedDataParallel does that does not depend on the module's type:
// the checks, rank 0's broadcast, the c10d::Reducer and the outputs' DDPSink.
// Defined in impl/distributed-inl.h, so that c10d's Reducer and comm headers
// are compiled there, not in every translation unit that includes this one.
class DDPCore {
 public:
  DDPCore(const std::shared_ptr<torch::nn::Module>& module, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
          DDPOptions options);
  ~DDPCore();
  DDPCore(const DDPCore&) = delete;
  DDPCore& operator=(const DDPCore&) = delete;

  void pre_forward();
  // Whether post_forward needs the forward's output tensors (a synchronised forward with grad).
  bool wants_outputs() const;
  // `outputs`: the tensors in the forward's result (empty unless wants_outputs());
  // those that pass the DDPSink are replaced by its outputs.
  void post_forward(const std::vector<at::Tensor*>& outputs);
  std::vector<std::vector<size_t>> buckets() const;
  c10d::Reducer& reducer();

  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const noexcept { return pg_; }
  const DDPOptions& options() const noexcept { return options_; }
  const std::vector<at::Tensor>& parameters() const noexcept { return params_; }
  bool sync = true;  // false under no_sync()

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  DDPOptions options_;
  std::vector<at::Tensor> params_, buffers_;
  std::unique_ptr<c10d::Reducer> reducer_;
  bool sync_buffers_next_ = true;          // Python's require_forward_param_sync
  c10::intrusive_ptr<DDPSinkState> sink_;  // what the outputs' DDPSink reaches in backward
};

}  // namespace detail

/// Wraps a module for data-parallel training, as Python's DDP does, on the same
/// engine: c10d::Reducer buckets the gradients and all-reduces (averages) them
/// across the process group while backward runs. Every rank must construct it
/// with the same model (checked), call it the same number of times, and run
/// backward after each synchronised forward.
template <typename ModuleImpl>
class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<ModuleImpl> module, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                          DDPOptions options = DDPOptions())
      : module_(std::move(module)), core_(module_, std::move(process_group), std::move(options)) {}
  DistributedDataParallel(const torch::nn::ModuleHolder<ModuleImpl>& module,
                          c10::intrusive_ptr<c10d::ProcessGroup> process_group, DDPOptions options = DDPOptions())
      : DistributedDataParallel(module.ptr(), std::move(process_group), std::move(options)) {}
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
    explicit NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp), prev_(ddp.core_.sync) { ddp_.core_.sync = false; }
    ~NoSyncGuard() { ddp_.core_.sync = prev_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool prev_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  const std::shared_ptr<ModuleImpl>& module() const noexcept { return module_; }
  ModuleImpl* operator->() const noexcept { return module_.get(); }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const noexcept { return core_.process_group(); }
  const DDPOptions& options() const noexcept { return core_.options(); }
  /// The parameters the Reducer synchronises (those requiring grad), in order.
  const std::vector<at::Tensor>& parameters() const noexcept { return core_.parameters(); }
  /// Indices into parameters() per gradient bucket, in the order the Reducer
  /// reduces them (after the first iteration: the order gradients became ready).
  std::vector<std::vector<size_t>> buckets() const { return core_.buckets(); }
  /// c10d's Reducer, for what perf does not wrap. perf::perf_static declares it only: include
  /// <torch/csrc/distributed/c10d/reducer.hpp> to call it.
  c10d::Reducer& reducer() { return core_.reducer(); }

 private:
  std::shared_ptr<ModuleImpl> module_;
  detail::DDPCore core_;
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

PERF_INLINE std::string resolve_backend(const std::string& b);

}  // namespace detail

// ---------------------------------------------------------------------------

PERF_INLINE c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& o);

// ---------------------------------------------------------------------------

template <typename ModuleImpl>
template <typename... Args>
auto DistributedDataParallel<ModuleImpl>::operator()(Args&&... args) {
  core_.pre_forward();
  auto out = module_->forward(std::forward<Args>(args)...);
  std::vector<at::Tensor*> found;
  if (core_.wants_outputs()) {
    auto find = [&found](at::Tensor& t) { found.push_back(&t); };
    detail::for_each_tensor(out, find);
  }
  core_.post_forward(found);
  return out;
}

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/distributed-inl.h>
#endif
