// perf/impl/distributed-inl.h — the out-of-line definitions of perf/distributed.h.
// Included by perf/distributed.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/distributed.h>

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
    TORCH_CHECK(false,
                "perf::init_process_group: backend \"gloo\" needs Gloo's headers, which the LibTorch wheel does "
                "not ship: install them (Debian/Ubuntu: libgloo-dev) and rebuild, or use backend \"nccl\" on CUDA");
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
  return pg;
}

PERF_INLINE void destroy_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group) {
  TORCH_CHECK(process_group, "perf::destroy_process_group: the process group is empty");
  process_group->shutdown();
}

}  // namespace perf
