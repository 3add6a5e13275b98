// perf/environment.h — what a bug report or a benchmark table needs to say
// about the machine: versions, devices, threads, and every perf setting as
// LibTorch reports it now.
//
//   std::cout << perf::environment();
#pragma once

#include <perf/config.h>
#include <perf/detail/cpu.h>
#include <perf/setup.h>
#include <torch/version.h>

#include <cstdint>
#include <iomanip>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace perf {

/// A CUDA device as perf::environment() describes it.
struct DeviceInfo {
  int index = 0;
  std::string name;
  int major = 0;
  int minor = 0;
  int64_t total_memory = 0;
  int multiprocessors = 0;
};

/// Versions, devices, threads and the current value of every perf setting.
struct Environment {
  std::string perf_version = PERF_VERSION_STRING;
  std::string torch_version = TORCH_VERSION;
  bool cuda_compiled = PERF_WITH_CUDA != 0;
  int cuda_runtime_version = 0;  // e.g. 13000; 0 when unavailable
  int cuda_driver_version = 0;   // 0 when no driver is installed
  int64_t cudnn_version = 0;     // 0 when unavailable
  std::vector<DeviceInfo> devices;
  unsigned hardware_threads = 0;
  int64_t physical_cores = 0;  // as ATen's cpuinfo counts them; 0 when unknown
  int intraop_threads = 0;
  int64_t interop_threads = 0;
  /// Processes of this program's distributed job on this machine, sharing its cores
  /// (counted by perf::init_process_group); 1 without a job.
  int job_processes = 1;
  /// OMP_NUM_THREADS, MKL_NUM_THREADS and OMP_WAIT_POLICY where the environment sets
  /// them: name -> value. They change what a CPU benchmark measures.
  std::vector<std::pair<std::string, std::string>> thread_variables;
  /// CPU bf16 features and perf's CPU autocast default, e.g. "off (fp32): avx512_bf16=no amx_bf16=no".
  std::string cpu_autocast;
  std::vector<std::pair<std::string, std::string>> flags;  // setting -> current value, in Report order
};

/// Reads everything without changing anything (no CUDA context is created).
Environment environment();
std::ostream& operator<<(std::ostream& os, const Environment& e);

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/environment-inl.h>
#endif
