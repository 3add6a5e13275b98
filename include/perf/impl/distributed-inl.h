// perf/impl/distributed-inl.h — the out-of-line definitions of perf/distributed.h.
// Included by perf/distributed.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/distributed.h>

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

}  // namespace perf
