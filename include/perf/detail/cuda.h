// perf/detail/cuda.h — CUDA initialisation and sync-debug scope shared by the headers. Internal to perf.
#pragma once

#include <ATen/Context.h>
#include <perf/config.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace perf::detail {

// LibTorch creates the CUDA caching allocator's per-device state lazily, on the
// first CUDA tensor; its statistics, memory fraction and peak calls assert
// ("Allocator not initialized for device") before that. Python's
// torch.cuda.memory_stats and friends call torch.cuda._lazy_init() first; so do we.
inline void init_cuda() {
#if PERF_WITH_CUDA
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
#endif
}

#if PERF_WITH_CUDA
// CUDA's sync-debug mode (torch.cuda.set_sync_debug_mode) for one scope.
class SyncDebugGuard {
 public:
  explicit SyncDebugGuard(c10::cuda::SyncDebugMode mode) : prev_(c10::cuda::warning_state().get_sync_debug_mode()) {
    c10::cuda::warning_state().set_sync_debug_mode(mode);
  }
  ~SyncDebugGuard() { c10::cuda::warning_state().set_sync_debug_mode(prev_); }
  SyncDebugGuard(const SyncDebugGuard&) = delete;
  SyncDebugGuard& operator=(const SyncDebugGuard&) = delete;

 private:
  c10::cuda::SyncDebugMode prev_;
};
#endif

}  // namespace perf::detail
