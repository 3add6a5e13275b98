// perf/impl/distributed-inl.h — the out-of-line definitions of perf/distributed.h.
// Included by perf/distributed.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/detail/ddp_registry.h>
#include <perf/detail/float.h>
#include <perf/distributed.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <unistd.h>  // gethostname

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#if PERF_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if PERF_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace perf {

namespace detail {

PERF_INLINE int dist_int(const std::optional<int>& given, const char* option, const char* var, int lo, int hi) {
  int v = 0;
  if (given) {
    v = *given;
  } else {
    const char* text = std::getenv(var);
    TORCH_CHECK(text != nullptr && *text != '\0', "perf::init_process_group: ", var,
                " is not set. Run the program under torchrun (which sets RANK, WORLD_SIZE, MASTER_ADDR, "
                "MASTER_PORT), or set perf::ProcessGroupOptions().",
                option, "(...)");
    try {
      size_t used = 0;
      v = std::stoi(text, &used);
      TORCH_CHECK(used == std::string(text).size(), "");
    } catch (const std::exception&) {
      TORCH_CHECK(false, "perf::init_process_group: ", var, "=\"", text, "\" is not an integer");
    }
  }
  TORCH_CHECK(v >= lo && v <= hi, "perf::init_process_group: ", option, " (", given ? "option" : var, ") is ", v,
              "; valid values: ", lo, "..", hi);
  return v;
}

PERF_INLINE std::string resolve_backend(const std::string& b) {
  TORCH_CHECK(b == "auto" || b == "gloo" || b == "nccl", "perf::ProcessGroupOptions::backend: invalid value \"", b,
              "\"; valid values: \"auto\", \"gloo\", \"nccl\"");
  if (b != "auto") return b;
#if PERF_WITH_NCCL
  if (c10::cuda::device_count() > 0) return "nccl";
#endif
  return "gloo";
}

PERF_INLINE int shared_core_threads(int processes, int64_t cores, int threads, bool chosen) {
  if (processes <= 1 || cores <= 0 || chosen || threads < cores) return 0;
  return static_cast<int>(std::max<int64_t>(1, cores / processes));
}

// How many of the job's processes run on this machine: LOCAL_WORLD_SIZE where a
// launcher set it (torchrun), else each rank adds itself to its host's key in the
// store and reads the count once every rank has.
PERF_INLINE int count_processes_here(c10d::Store& store, int rank, int world, std::chrono::milliseconds timeout) {
  if (const char* text = std::getenv("LOCAL_WORLD_SIZE")) {
    char* end = nullptr;
    const long n = std::strtol(text, &end, 10);
    if (end != text && *end == '\0' && n >= 1 && n <= world) return static_cast<int>(n);
  }
  if (world == 1) return 1;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string key = std::string("perf/processes_on/") + host;
  int64_t here = 0;
  try {
    store.add(key, 1);
    if (store.add("perf/processes_counted", 1) == world)
      store.set("perf/processes_all_counted", std::vector<uint8_t>{1});
    store.wait({"perf/processes_all_counted"}, timeout);
    here = store.add(key, 0);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "perf::init_process_group: rank ", rank, " of ", world,
                " did not see every rank count itself in the store within ", timeout.count(), " ms: ", e.what());
  }
  return static_cast<int>(here);
}

// Several processes on one machine, each with LibTorch's default of one intra-op
// thread per core, oversubscribe it: with libgomp's default the OpenMP threads
// spin at every barrier while the thread they wait for has no core (DDP on 2
// processes on 2 cores: 2.1-2.8x slower steps). torchrun sets OMP_NUM_THREADS=1
// for this; a job launched without it gets its share of the cores here.
PERF_INLINE void share_cores(int processes) {
  job_processes_here().store(processes);
  const int threads = at::get_num_threads();
  const int64_t cores = physical_cores();
  const int share = shared_core_threads(processes, cores, threads, thread_count_set_by_environment());
  if (share == 0) return;
  at::set_num_threads(share);
  TORCH_WARN("perf::init_process_group: ", processes, " processes of this job share this machine's ", cores,
             " physical cores, each with LibTorch's default of ", threads, " intra-op threads; each now has ", share,
             " (oversubscribed, OpenMP's threads spin waiting for threads that have no core: 2.1-2.8x slower DDP "
             "steps measured with 2 processes on 2 cores; torchrun sets OMP_NUM_THREADS=1 for this). To choose "
             "another count, set OMP_NUM_THREADS, or perf::Settings().num_threads(n) after this call.");
}

}  // namespace detail

PERF_INLINE c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& o) {
  const int world = detail::dist_int(o.world_size(), "world_size", "WORLD_SIZE", 1, 1 << 20);
  const int rank = detail::dist_int(o.rank(), "rank", "RANK", 0, world - 1);
  std::string addr;
  if (o.master_addr()) {
    addr = *o.master_addr();
  } else {
    const char* a = std::getenv("MASTER_ADDR");
    TORCH_CHECK(a != nullptr && *a != '\0',
                "perf::init_process_group: MASTER_ADDR is not set. Run the program under torchrun, or set "
                "perf::ProcessGroupOptions().master_addr(\"host\") (rank 0's address)");
    addr = a;
  }
  const int port = detail::dist_int(o.master_port(), "master_port", "MASTER_PORT", 1, 65535);
  TORCH_CHECK(o.timeout().count() > 0, "perf::ProcessGroupOptions::timeout: must be > 0 ms, got ", o.timeout().count());
  const std::string backend = detail::resolve_backend(o.backend());

  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = rank == 0;
  so.numWorkers = world;
  so.waitWorkers = true;
  so.timeout = o.timeout();
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(addr, so);
  } catch (const std::exception& e) {
    TORCH_CHECK(
        false, "perf::init_process_group: rank ", rank, " of ", world, " could not ",
        rank == 0 ? "host the store on port " : "reach the store at ", rank == 0 ? "" : addr + ":", port, " within ",
        o.timeout().count(),
        " ms (MASTER_ADDR/MASTER_PORT; every rank must start, and rank 0's port must be free). Cause: ", e.what());
  }
  // Backends rendezvous under their own prefix, as torch.distributed does.
  auto backend_store = c10::make_intrusive<c10d::PrefixStore>("default_pg/" + backend, store);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  if (backend == "gloo") {
#if PERF_WITH_GLOO
    auto opts = c10d::ProcessGroupGloo::Options::create(o.timeout());
    // A job on one machine talks over loopback; otherwise bind to this host's
    // own address, as torch.distributed's default device does.
    const bool loopback = addr == "localhost" || addr.rfind("127.", 0) == 0;
    opts->devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                     : c10d::ProcessGroupGloo::createDefaultDevice());
    c10::intrusive_ptr<c10d::Backend> gloo;
    try {
      gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(backend_store, rank, world, opts);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "perf::init_process_group: the Gloo backend could not connect rank ", rank, " of ", world,
                  " within ", o.timeout().count(), " ms: ", e.what());
    }
    pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
#else
#ifdef PERF_SEPARATE_COMPILATION  // this body is perf::perf_static's: its own build lacked them
    constexpr const char* rebuild = " (perf::perf_static: rebuild it with them on its include path)";
#else
    constexpr const char* rebuild = "";
#endif
    TORCH_CHECK(false,
                "perf::init_process_group: backend \"gloo\" needs Gloo's headers, which the LibTorch wheel does "
                "not ship: install them (Debian/Ubuntu: libgloo-dev) and rebuild, or use backend \"nccl\" on CUDA",
                rebuild);
#endif
  } else {
#if PERF_WITH_NCCL
    int local = 0;
    if (o.local_rank() || std::getenv("LOCAL_RANK")) {
      local = detail::dist_int(o.local_rank(), "local_rank", "LOCAL_RANK", 0,
                               std::max(0, static_cast<int>(c10::cuda::device_count()) - 1));
    }
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(local));
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = o.timeout();
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(backend_store, rank, world, opts);
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#else
    TORCH_CHECK(false, "perf::init_process_group: backend \"nccl\" needs CUDA and a LibTorch built with NCCL (perf ",
                PERF_WITH_CUDA ? "has CUDA but LibTorch has no NCCL" : "was built without CUDA",
                "); use backend \"gloo\" for CPU tensors");
#endif
  }
  detail::share_cores(detail::count_processes_here(*store, rank, world, o.timeout()));
  return pg;
}

PERF_INLINE void destroy_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group) {
  TORCH_CHECK(process_group, "perf::destroy_process_group: the process group is empty");
  process_group->shutdown();
  detail::job_processes_here().store(1);
}

// --------------------------------------------------------------------------- DistributedDataParallel

namespace detail {

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

PERF_INLINE DDPCore::DDPCore(const std::shared_ptr<torch::nn::Module>& module,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group, DDPOptions options)
    : pg_(std::move(process_group)), options_(std::move(options)) {
  TORCH_CHECK(module != nullptr, "perf::DistributedDataParallel: the module is empty (nullptr)");
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
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
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
  for (const auto& b : module->buffers(/*recurse=*/true)) {
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

PERF_INLINE DDPCore::~DDPCore() {
  if (sink_) sink_->reducer = nullptr;
  detail::ddp_register(params_, -1);
}

PERF_INLINE std::vector<std::vector<size_t>> DDPCore::buckets() const {
  std::unordered_map<const void*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].unsafeGetTensorImpl()] = i;
  std::vector<std::vector<size_t>> out;
  for (const auto& bucket : reducer_->get_grad_buckets(/*return_zero_tensors=*/false)) {
    out.emplace_back();
    for (const auto& p : bucket.getParameters()) out.back().push_back(index.at(p.unsafeGetTensorImpl()));
  }
  return out;
}

PERF_INLINE c10d::Reducer& DDPCore::reducer() { return *reducer_; }

PERF_INLINE bool DDPCore::wants_outputs() const { return at::GradMode::is_enabled() && sync; }

PERF_INLINE void DDPCore::pre_forward() {
  const bool grad = at::GradMode::is_enabled();
  // The Reducer takes its first backward for the iteration that learns the graph.
  TORCH_CHECK(!(grad && !sync && options_.static_graph() && !sink_->delay_all_reduce_enqueued),
              "perf::DistributedDataParallel: static_graph(true) learns the graph in the first synchronised "
              "iteration, so no_sync() cannot come before it (Python's DDP fails an internal assert there); run the "
              "first iteration synchronised, then accumulate under no_sync()");
  if (grad && sync) reducer_->prepare_for_forward();
  // Before the forward's activations exist: rebuilding allocates new buckets.
  if (grad) reducer_->rebuild_buckets();
  if (sync_buffers_next_ && options_.broadcast_buffers() && !buffers_.empty() && pg_->getSize() > 1) {
    torch::NoGradGuard no_grad;
    c10d::broadcast_coalesced(pg_, buffers_, detail::kBroadcastBucketBytes, 0);
  }
}

PERF_INLINE void DDPCore::post_forward(const std::vector<at::Tensor*>& found) {
  if (!wants_outputs()) {
    sync_buffers_next_ = false;
    return;
  }
  sync_buffers_next_ = true;
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
}

// perf::TrainStepOptions / CompiledTrainOptions::data_parallel: the step averages its gradients itself, after
// backward, with plain collectives a CUDA graph can capture (NCCL's kernels are recorded like any other; c10d keeps a
// captured collective off its watchdog), where DistributedDataParallel's Reducer starts them from autograd hooks.
class ProcessGroupDataParallel final : public DataParallel {
  // The module's buffers, each once (one registered under two names is one tensor).
  static std::vector<at::Tensor> distinct_buffers(torch::nn::Module& module) {
    std::vector<at::Tensor> out;
    std::unordered_set<const void*> seen;
    for (const auto& b : module.buffers(/*recurse=*/true))
      if (b.defined() && seen.insert(b.unsafeGetTensorImpl()).second) out.push_back(b);
    return out;
  }

 public:
  ProcessGroupDataParallel(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const DataParallelOptions& options)
      : pg_(std::move(process_group)), options_(options) {}
  int rank() const override { return pg_->getRank(); }
  int world_size() const override { return pg_->getSize(); }
  std::string backend() const override { return pg_->getBackendName(); }

  void start(torch::nn::Module& module, const char* who) const override {
    std::vector<at::Tensor> params, state;
    std::unordered_set<const void*> seen;  // a tensor registered twice (tied weights) once
    for (const auto& p : module.parameters(/*recurse=*/true)) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      state.push_back(p);
      if (p.requires_grad()) params.push_back(p);
    }
    TORCH_CHECK(!params.empty(), who,
                ": data_parallel: the model has no parameter that requires grad; nothing to "
                "average across the ranks");
    for (const auto& p : params) {
      TORCH_CHECK(p.device() == params[0].device(), who, ": data_parallel: a parameter of shape ", p.sizes(), " is on ",
                  p.device(), ", another on ", params[0].device(),
                  "; put the whole model on one device (this process's GPU, or the CPU)");
      TORCH_CHECK(p.layout() == at::kStrided, who, ": data_parallel: a parameter of shape ", p.sizes(),
                  " is sparse; only dense parameters are supported");
    }
    for (auto& b : distinct_buffers(module)) state.push_back(std::move(b));
    // The same trainable parameters on every rank (c10d's check: count, shapes, strides), then rank 0's values.
    c10d::verify_params_across_processes(pg_, params, std::nullopt);
    if (pg_->getSize() > 1) {
      torch::NoGradGuard no_grad;
      c10d::broadcast_coalesced(pg_, state, kBroadcastBucketBytes, 0);
    }
  }

  void sync_buffers(torch::nn::Module& module) const override {
    if (!options_.broadcast_buffers() || pg_->getSize() == 1) return;
    std::vector<at::Tensor> buffers = distinct_buffers(module);
    if (buffers.empty()) return;
    torch::NoGradGuard no_grad;
    c10d::broadcast_coalesced(pg_, buffers, kBroadcastBucketBytes, 0);
  }

  // As DDP's buckets: divided by the world size, then summed. The tensors of one (device, dtype) share buckets of up
  // to bucket_cap_mb in their order; a contiguous tensor at least that large is reduced where it lies. Every
  // all-reduce is started before the first wait. Compressed: what goes on the wire is a half-precision copy.
  void average(const std::vector<at::Tensor>& tensors) const override {
    const double world = static_cast<double>(pg_->getSize());
    const auto cap = static_cast<int64_t>(std::max(1.0, options_.bucket_cap_mb() * 1024.0 * 1024.0));
    const std::string& comp = options_.compression();
    const auto wire_dtype = comp == "fp16" ? at::kHalf : at::kBFloat16;
    struct Bucket {
      std::vector<at::Tensor> members;  // several tensors copied into `data`, or none: `data` is the tensor
      at::Tensor data;
      std::vector<at::Tensor> wire;  // `data`, or its compressed copy
      int64_t bytes = 0;
      c10::intrusive_ptr<c10d::Work> work;
    };
    std::vector<Bucket> started;
    std::vector<std::pair<std::pair<c10::Device, at::ScalarType>, Bucket>> open;
    auto launch = [&](Bucket b) {
      if (!b.data.defined()) {
        std::vector<at::Tensor> parts;
        for (const auto& m : b.members) parts.push_back(m.reshape(-1));
        b.data = at::cat(parts);
      }
      const bool compress =
          comp != "none" && (b.data.scalar_type() == at::kFloat || b.data.scalar_type() == at::kDouble);
      b.wire = {compress ? b.data.to(wire_dtype) : b.data};
      b.wire[0].div_(world);
      b.work = pg_->allreduce(b.wire);
      started.push_back(std::move(b));
    };
    for (const auto& t : tensors) {
      TORCH_CHECK(t.defined() && t.layout() == at::kStrided,
                  "perf: data_parallel: a sparse gradient cannot be averaged; only dense gradients are supported");
      const int64_t bytes = static_cast<int64_t>(t.nbytes());
      if (t.is_contiguous() && bytes >= cap) {
        Bucket alone;
        alone.data = t;  // reduced in place, nothing to copy back (unless compressed)
        launch(std::move(alone));
        continue;
      }
      const auto key = std::make_pair(t.device(), t.scalar_type());
      auto it = std::find_if(open.begin(), open.end(), [&](const auto& o) { return o.first == key; });
      if (it != open.end() && it->second.bytes + bytes > cap) {
        launch(std::move(it->second));
        open.erase(it);
        it = open.end();
      }
      if (it == open.end()) it = open.insert(open.end(), {key, Bucket()});
      it->second.members.push_back(t);
      it->second.bytes += bytes;
    }
    for (auto& o : open) launch(std::move(o.second));
    for (auto& b : started) {
      b.work->wait();
      if (!b.wire[0].is_same(b.data)) b.data.copy_(b.wire[0]);
      int64_t offset = 0;
      for (auto& m : b.members) {
        const int64_t n = m.numel();
        m.copy_(b.data.narrow(0, offset, n).view(m.sizes()));
        offset += n;
      }
    }
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  DataParallelOptions options_;
};

template <typename Group>
DataParallelPtr make_data_parallel(const c10::intrusive_ptr<Group>& process_group, const DataParallelOptions& options) {
  TORCH_CHECK(process_group,
              "perf: data_parallel: the process group is empty; create it with perf::init_process_group()");
  TORCH_CHECK(options.bucket_cap_mb() > 0, "perf::DataParallelOptions::bucket_cap_mb: must be > 0 MiB, got ",
              options.bucket_cap_mb());
  const std::string& comp = options.compression();
  TORCH_CHECK(comp == "none" || comp == "fp16" || comp == "bf16",
              "perf::DataParallelOptions::compression: invalid value \"", comp,
              "\"; valid values: \"none\", \"fp16\", \"bf16\"");
  return std::make_shared<const ProcessGroupDataParallel>(process_group, options);
}

#ifdef PERF_SEPARATE_COMPILATION
template DataParallelPtr make_data_parallel(const c10::intrusive_ptr<c10d::ProcessGroup>&, const DataParallelOptions&);
#endif

}  // namespace detail

}  // namespace perf
