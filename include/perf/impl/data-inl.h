// perf/impl/data-inl.h — the out-of-line definitions of perf/data.h.
// Included by perf/data.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/data.h>

namespace perf {

namespace detail {

PERF_INLINE size_t default_workers() {
  const size_t hw = std::max(1u, std::thread::hardware_concurrency());
  return std::clamp<size_t>(hw / 2, 1, 8);
}

}  // namespace detail

PERF_INLINE torch::data::DataLoaderOptions loader_options(size_t batch_size, const LoaderTuning& tuning) {
  detail::check_count(batch_size, 1, "perf::loader_options: batch_size");
  detail::check_count(tuning.prefetch_factor(), 1, "perf::LoaderTuning::prefetch_factor");
  if (tuning.workers()) detail::check_count(*tuning.workers(), 0, "perf::LoaderTuning::workers");
  const size_t workers = tuning.workers().value_or(detail::default_workers());
  auto o = torch::data::DataLoaderOptions(batch_size)
               .workers(workers)
               .drop_last(tuning.drop_last())
               .enforce_ordering(tuning.enforce_ordering())
               .timeout(tuning.timeout());
  if (workers > 0) o.max_jobs(workers * tuning.prefetch_factor());
  return o;
}

PERF_INLINE torch::data::DataLoaderOptions loader_options(const torch::data::DataLoaderOptions& existing,
                                                          const LoaderTuning& tuning) {
  detail::check_count(tuning.prefetch_factor(), 1, "perf::LoaderTuning::prefetch_factor");
  if (tuning.workers()) detail::check_count(*tuning.workers(), 0, "perf::LoaderTuning::workers");
  auto o = existing;
  if (tuning.workers()) {
    o.workers(*tuning.workers());
  } else if (existing.workers() == 0) {
    o.workers(detail::default_workers());
  }
  if (!existing.max_jobs() || tuning.workers()) {
    if (o.workers() > 0) o.max_jobs(o.workers() * tuning.prefetch_factor());
  }
  // drop_last, enforce_ordering, timeout: the program's choice unless tuning differs from its own default.
  if (tuning.drop_last()) o.drop_last(true);
  if (!tuning.enforce_ordering()) o.enforce_ordering(false);
  if (tuning.timeout()) o.timeout(tuning.timeout());
  return o;
}

PERF_INLINE std::string describe(const torch::data::DataLoaderOptions& o,
                                 const torch::data::DataLoaderOptions& before) {
  std::vector<std::string> changes;
  auto opt_str = [](const std::optional<size_t>& v) { return v ? std::to_string(*v) : std::string("default"); };
  auto ms_str = [](const std::optional<std::chrono::milliseconds>& v) {
    return v ? std::to_string(v->count()) + "ms" : std::string("none");
  };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  if (o.batch_size() != before.batch_size())
    changes.push_back("batch_size " + std::to_string(before.batch_size()) + " -> " + std::to_string(o.batch_size()));
  if (o.workers() != before.workers())
    changes.push_back("workers " + std::to_string(before.workers()) + " -> " + std::to_string(o.workers()));
  if (o.max_jobs() != before.max_jobs())
    changes.push_back("max_jobs " + opt_str(before.max_jobs()) + " -> " + opt_str(o.max_jobs()));
  if (o.drop_last() != before.drop_last())
    changes.push_back("drop_last " + b(before.drop_last()) + " -> " + b(o.drop_last()));
  if (o.enforce_ordering() != before.enforce_ordering())
    changes.push_back("enforce_ordering " + b(before.enforce_ordering()) + " -> " + b(o.enforce_ordering()));
  if (o.timeout() != before.timeout())
    changes.push_back("timeout " + ms_str(before.timeout()) + " -> " + ms_str(o.timeout()));
  if (changes.empty()) return "unchanged";
  std::string out;
  for (size_t i = 0; i < changes.size(); ++i) out += (i ? ", " : "") + changes[i];
  return out;
}

PERF_INLINE std::string describe(const torch::data::DataLoaderOptions& o) {
  std::ostringstream os;
  os << "batch_size=" << o.batch_size() << " workers=" << o.workers() << " max_jobs=";
  if (o.max_jobs()) {
    os << *o.max_jobs();
  } else {
    os << "default(" << 2 * o.workers() << ")";
  }
  os << " drop_last=" << (o.drop_last() ? "true" : "false")
     << " enforce_ordering=" << (o.enforce_ordering() ? "true" : "false") << " timeout=";
  if (o.timeout()) {
    os << o.timeout()->count() << "ms";
  } else {
    os << "none";
  }
  return os.str();
}

}  // namespace perf
