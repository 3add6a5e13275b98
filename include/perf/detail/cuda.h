// perf/detail/cuda.h — CUDA initialisation shared by the headers. Internal to perf.
#pragma once

#include <ATen/Context.h>
#include <perf/config.h>

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

}  // namespace perf::detail
