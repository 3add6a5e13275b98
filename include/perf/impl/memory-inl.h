// perf/impl/memory-inl.h — the out-of-line definitions of perf/memory.h.
// Included by perf/memory.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/memory.h>

namespace perf {

namespace detail {

PERF_INLINE std::optional<int64_t> proc_status_bytes(const std::string& key) {
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

PERF_INLINE std::string bytes_str(int64_t b) {
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

PERF_INLINE void free_cached_memory() {
#if PERF_WITH_CUDA
  if (c10::cuda::device_count() > 0) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

}  // namespace detail

PERF_INLINE MemoryStats memory_stats(c10::Device device) {
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

PERF_INLINE bool reset_peak_memory(c10::Device device) {
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

PERF_INLINE std::string MemoryStats::to_string() const {
  std::ostringstream os;
  os << *this;
  return os.str();
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const MemoryStats& s) {
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

PERF_INLINE int64_t find_max_batch_size(const std::function<void(int64_t)>& try_fn, int64_t lo, int64_t hi,
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
