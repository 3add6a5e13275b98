// perf/impl/environment-inl.h — the out-of-line definitions of perf/environment.h.
// Included by perf/environment.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/environment.h>

// CUDA's headers only here, where the definitions use them: a perf::perf_static user's
// translation unit does not compile them (docs/compile-time.md).
#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <cuda_runtime_api.h>
#endif

namespace perf {

PERF_INLINE Environment environment() {
  Environment e;
  e.hardware_threads = std::thread::hardware_concurrency();
  e.physical_cores = detail::physical_cores();
  e.intraop_threads = at::get_num_threads();
  e.interop_threads = static_cast<int64_t>(at::get_num_interop_threads());
  e.job_processes = std::max(1, detail::job_processes_here().load());
  e.thread_variables = detail::thread_variables();
  e.cpu_autocast = detail::cpu_bf16().autocast_choice();
#if PERF_WITH_CUDA
  int v = 0;
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) e.cuda_runtime_version = v;
  v = 0;
  if (cudaDriverGetVersion(&v) == cudaSuccess) e.cuda_driver_version = v;
  try {
    e.cudnn_version = at::detail::getCUDAHooks().versionCuDNN();
  } catch (const c10::Error&) {
    e.cudnn_version = 0;
  }
  for (int d = 0; d < detail::cuda_device_count(); ++d) {
    const auto* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(d));
    e.devices.push_back(
        {d, p->name, p->major, p->minor, static_cast<int64_t>(p->totalGlobalMem), p->multiProcessorCount});
  }
#endif
  {
    std::lock_guard<std::mutex> lock(detail::settings_mutex());
    e.flags = detail::read_flags();
  }
  return e;
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const Environment& e) {
  auto version = [](int64_t v) {
    if (v == 0) return std::string("n/a");
    return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  };
  os << "perf " << e.perf_version << " on LibTorch " << e.torch_version << "\n";
  os << "  CUDA support compiled: " << (e.cuda_compiled ? "yes" : "no") << "\n";
  os << "  CUDA runtime: " << version(e.cuda_runtime_version) << ", driver: " << version(e.cuda_driver_version)
     << ", cuDNN: " << (e.cudnn_version ? std::to_string(e.cudnn_version) : "n/a") << "\n";
  os << "  CPU: " << e.hardware_threads << " hardware threads, "
     << (e.physical_cores > 0 ? std::to_string(e.physical_cores) : std::string("unknown"))
     << " physical cores; intra-op " << e.intraop_threads << ", inter-op " << e.interop_threads << "; autocast default "
     << e.cpu_autocast << "\n";
  os << "  thread variables:";
  if (e.thread_variables.empty()) os << " none (OMP_NUM_THREADS, MKL_NUM_THREADS, OMP_WAIT_POLICY unset)";
  for (const auto& [name, value] : e.thread_variables) os << " " << name << "=" << value;
  os << "\n";
  if (e.job_processes > 1)
    os << "  distributed job: " << e.job_processes
       << " processes on this machine share its cores (counted by perf::init_process_group)\n";
  if (e.devices.empty()) os << "  CUDA devices: none\n";
  for (const auto& d : e.devices) {
    os << "  cuda:" << d.index << " " << d.name << ", sm_" << d.major << d.minor << ", " << std::fixed
       << std::setprecision(1) << static_cast<double>(d.total_memory) / (1ull << 30) << " GiB, " << d.multiprocessors
       << " SMs\n";
    os.unsetf(std::ios_base::floatfield);
  }
  size_t w = 0;
  for (const auto& [k, v] : e.flags) w = std::max(w, k.size());
  os << "  flags:\n";
  for (const auto& [k, v] : e.flags) os << "    " << detail::pad(k, w) << "  " << v << "\n";
  return os;
}

}  // namespace perf
