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
inline std::optional<int64_t> proc_status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream is(line.substr(key.size() + 1));
      int64_t kb = 0;
      if (is >> kb) return kb * 1024;
    }
  }
  return std::nullopt;
}

inline std::string bytes_str(int64_t b) {
  std::ostringstream os;
  const double v = static_cast<double>(b);
  if (b >= (int64_t{1} << 30)) {
    os << std::fixed << std::setprecision(2) << v / (1 << 30) << " GiB";
  } else if (b >= (int64_t{1} << 20)) {
    os << std::fixed << std::setprecision(1) << v / (1 << 20) << " MiB";
  } else {
    os << b << " B";
  }
  return os.str();
}

inline void free_cached_memory() {
#if PERF_WITH_CUDA
  if (c10::cuda::device_count() > 0) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

}  // namespace detail

// ---------------------------------------------------------------------------

inline MemoryStats memory_stats(c10::Device device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "perf::memory_stats: device must be cpu or cuda, got ", device);
  MemoryStats s;
  s.device = device;
  s.rss = detail::proc_status_bytes("VmRSS");
  s.peak_rss = detail::proc_status_bytes("VmHWM");
  if (!s.rss) s.unavailable.push_back("rss, peak rss (no /proc/self/status)");
  if (device.is_cpu()) {
    s.unavailable.push_back(
        "allocated, reserved, active, peak allocated/reserved, alloc retries, OOMs (LibTorch's CPU allocator keeps "
        "no statistics; see rss)");
    return s;
  }
#if PERF_WITH_CUDA
  TORCH_CHECK(c10::cuda::device_count() > 0, "perf::memory_stats: ", device,
              " requested but no CUDA device is available");
  detail::init_cuda();
  const auto idx = device.has_index() ? device.index() : c10::cuda::current_device();
  const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(idx);
  constexpr auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  s.device = c10::Device(c10::kCUDA, idx);
  s.allocated = st.allocated_bytes[agg].current;
  s.reserved = st.reserved_bytes[agg].current;
  s.active = st.active_bytes[agg].current;
  s.peak_allocated = st.allocated_bytes[agg].peak;
  s.peak_reserved = st.reserved_bytes[agg].peak;
  s.alloc_retries = st.num_alloc_retries;
  s.ooms = st.num_ooms;
#else
  TORCH_CHECK(false, "perf::memory_stats: ", device, " requested but perf was built without CUDA (PERF_WITH_CUDA=0)");
#endif
  return s;
}

inline bool reset_peak_memory(c10::Device device) {
  if (device.is_cuda()) {
#if PERF_WITH_CUDA
    TORCH_CHECK(c10::cuda::device_count() > 0, "perf::reset_peak_memory: ", device,
                " requested but no CUDA device is available");
    detail::init_cuda();
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : c10::cuda::current_device());
    return true;
#else
    TORCH_CHECK(false, "perf::reset_peak_memory: ", device, " requested but perf was built without CUDA");
#endif
  }
  TORCH_CHECK(device.is_cpu(), "perf::reset_peak_memory: device must be cpu or cuda, got ", device);
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";  // resets VmHWM to the current RSS (Linux >= 4.0)
  clear.flush();
  return static_cast<bool>(clear);
}

inline std::string MemoryStats::to_string() const {
  std::ostringstream os;
  os << *this;
  return os.str();
}

inline std::ostream& operator<<(std::ostream& os, const MemoryStats& s) {
  os << "memory on " << s.device << "\n";
  auto row = [&](const char* name, const std::optional<int64_t>& v, bool bytes = true) {
    if (v)
      os << "  " << std::left << std::setw(16) << name << (bytes ? detail::bytes_str(*v) : std::to_string(*v)) << "\n";
  };
  row("allocated", s.allocated);
  row("reserved", s.reserved);
  row("active", s.active);
  row("peak allocated", s.peak_allocated);
  row("peak reserved", s.peak_reserved);
  row("alloc retries", s.alloc_retries, false);
  row("OOMs", s.ooms, false);
  row("process rss", s.rss);
  row("peak rss", s.peak_rss);
  for (const auto& u : s.unavailable) os << "  not available: " << u << "\n";
  return os;
}

inline int64_t find_max_batch_size(const std::function<void(int64_t)>& try_fn, int64_t lo, int64_t hi,
                                   const FindBatchOptions& options) {
  TORCH_CHECK(lo >= 1 && lo <= hi, "perf::find_max_batch_size: need 1 <= lo <= hi, got lo=", lo, " hi=", hi);
  std::ostream* log = options.log();
  auto fits = [&](int64_t b) {
    bool ok = true;
    try {
      try_fn(b);
    } catch (const c10::OutOfMemoryError&) {
      ok = false;
    }
    if (options.empty_cache()) detail::free_cached_memory();
    if (log) *log << "find_max_batch_size: try " << b << ": " << (ok ? "fits" : "out of memory") << std::endl;
    return ok;
  };
  int64_t good = 0, bad = 0;
  for (int64_t b = lo;; b = std::min(b * 2, hi)) {
    if (!fits(b)) {
      bad = b;
      break;
    }
    good = b;
    if (b == hi) break;
  }
  TORCH_CHECK(good > 0, "perf::find_max_batch_size: even the smallest batch size (lo=", lo, ") runs out of memory");
  while (bad > good + 1) {
    const int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  if (log)
    *log << "find_max_batch_size: largest batch that fits in [" << lo << ", " << hi << "]: " << good << std::endl;
  return good;
}

}  // namespace perf
