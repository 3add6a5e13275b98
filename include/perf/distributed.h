// perf/distributed.h — a c10d process group from torchrun's environment.
//
//   auto pg = perf::init_process_group();     // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK picks the GPU)
//   pg->allreduce(tensors)->wait();            // c10d's own collectives (Gloo on CPU, NCCL on CUDA)
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

#include <c10/util/Exception.h>
#include <perf/config.h>
#include <torch/arg.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if defined(USE_C10D_GLOO) && defined(__has_include)
#if __has_include(<gloo/config.h>)
#define PERF_WITH_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#endif
#ifndef PERF_WITH_GLOO
#define PERF_WITH_GLOO 0
#endif

#if PERF_WITH_CUDA && defined(USE_C10D_NCCL) && defined(__has_include)
#if __has_include(<nccl.h>)
#define PERF_WITH_NCCL 1
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#endif
#ifndef PERF_WITH_NCCL
#define PERF_WITH_NCCL 0
#endif

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

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
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& options = ProcessGroupOptions());

// ---------------------------------------------------------------------------
namespace detail {

// An int from the option or from the environment, range-checked; errors name
// both the option and the variable.
inline int dist_int(const std::optional<int>& given, const char* option, const char* var, int lo, int hi) {
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

inline std::string resolve_backend(const std::string& b) {
  TORCH_CHECK(b == "auto" || b == "gloo" || b == "nccl", "perf::ProcessGroupOptions::backend: invalid value \"", b,
              "\"; valid values: \"auto\", \"gloo\", \"nccl\"");
  if (b != "auto") return b;
#if PERF_WITH_NCCL
  if (c10::cuda::device_count() > 0) return "nccl";
#endif
  return "gloo";
}

}  // namespace detail

// ---------------------------------------------------------------------------

inline c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& o) {
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

}  // namespace perf
