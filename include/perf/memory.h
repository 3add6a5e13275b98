// perf/memory.h — memory statistics and the largest batch that fits.
//
//   std::cout << perf::memory_stats(torch::kCUDA);     // allocated, reserved, peaks, retries, OOMs
//   perf::reset_peak_memory(torch::kCUDA);
//   int64_t b = perf::find_max_batch_size([&](int64_t n) { train_step(n); }, 1, 4096);
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/detail/cuda.h>
#include <torch/arg.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cstdint>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace perf {

/// Memory of one device. Fields a device cannot report are empty, and
/// `unavailable` says which and why.
struct MemoryStats {
  c10::Device device = c10::Device(c10::kCPU);
  // CUDA caching allocator (bytes, counts).
  std::optional<int64_t> allocated, reserved, active, peak_allocated, peak_reserved, alloc_retries, ooms;
  // This process on the host (bytes), from /proc/self/status.
  std::optional<int64_t> rss, peak_rss;
  std::vector<std::string> unavailable;
  std::string to_string() const;
};
std::ostream& operator<<(std::ostream& os, const MemoryStats& s);

MemoryStats memory_stats(c10::Device device = c10::Device(c10::kCPU));

/// Starts a new peak. CUDA: the allocator's peak counters. CPU: the process's
/// peak RSS (Linux /proc/self/clear_refs); returns false where that is refused.
bool reset_peak_memory(c10::Device device = c10::Device(c10::kCPU));

struct FindBatchOptions {
  /// Progress lines ("try 64: fits") and the result go here; nullptr = silent.
  TORCH_ARG(OstreamPtr, log) = &std::cerr;
  /// Frees cached CUDA blocks between tries so each try starts from the same state.
  TORCH_ARG(bool, empty_cache) = true;
};

/// Largest batch size in [lo, hi] for which `try_fn(batch)` returns without
/// c10::OutOfMemoryError: doubling from lo, then binary search. Other
/// exceptions propagate unchanged. Throws if even `lo` does not fit.
int64_t find_max_batch_size(const std::function<void(int64_t)>& try_fn, int64_t lo, int64_t hi,
                            const FindBatchOptions& options = FindBatchOptions());

// ---------------------------------------------------------------------------
namespace detail {

// "VmRSS:   12345 kB" -> bytes.
PERF_INLINE std::optional<int64_t> proc_status_bytes(const std::string& key);

PERF_INLINE std::string bytes_str(int64_t b);

PERF_INLINE void free_cached_memory();

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/memory-inl.h>
#endif
