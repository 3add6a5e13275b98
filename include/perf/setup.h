// perf/setup.h — one call for the backend settings Python users get from folklore.
//
//   perf::Report r = perf::setup();                       // the fast defaults
//   perf::setup(perf::Settings().tf32(false).num_threads(8));
//   std::cout << r;                                       // what was asked, read back, applied
//   { perf::ScopedSettings guard(perf::Settings().deterministic(true)); ... }  // restored here
//   std::cout << perf::environment();                     // versions, devices, every flag
//
// Environment variables: PERF_DISABLE=1 makes setup() a reported no-op (A/B runs
// without recompiling); PERF_VERBOSE=1 prints each report to stderr.
#pragma once

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <torch/arg.h>
#include <torch/version.h>

#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace perf {

/// What perf::setup() applies. Every setter returns *this (LibTorch options
/// style). Settings left unset are not touched and are reported as they are.
struct Settings {
  /// TF32 tensor cores for cuDNN convolutions and RNNs; also picks the default
  /// matmul_precision ("high" when on, "highest" when off). Effect on sm_80+.
  TORCH_ARG(bool, tf32) = true;
  /// fp32 matmul precision: "highest", "high" (TF32 on cuBLAS) or "medium"
  /// (also bf16 on oneDNN). Unset: follows tf32.
  TORCH_ARG(std::optional<std::string>, matmul_precision);
  /// cuDNN autotuner: picks the fastest convolution algorithm per shape.
  TORCH_ARG(bool, cudnn_benchmark) = true;
  /// Deterministic algorithms + deterministic cuDNN + benchmark off; sets
  /// CUBLAS_WORKSPACE_CONFIG=:4096:8 when it is unset.
  TORCH_ARG(bool, deterministic) = false;
  /// cuBLAS may reduce fp16 / bf16 GEMMs in reduced precision (PyTorch default: true).
  TORCH_ARG(std::optional<bool>, fp16_reduced_precision_reduction);
  TORCH_ARG(std::optional<bool>, bf16_reduced_precision_reduction);
  /// Intra-op CPU threads (at::set_num_threads), >= 1.
  TORCH_ARG(std::optional<int>, num_threads);
  /// Inter-op CPU threads, >= 1; LibTorch accepts this once per process, before
  /// any inter-op work.
  TORCH_ARG(std::optional<int>, num_interop_threads);
  /// Flush denormals to zero on the CPU (FTZ/DAZ). Affects the calling thread.
  TORCH_ARG(std::optional<bool>, flush_denormal);
  /// CUDA sync debug mode: "off", "warn" or "error" on host-device syncs.
  TORCH_ARG(std::optional<std::string>, sync_debug);
  /// Cap of the CUDA caching allocator per device, in (0, 1].
  TORCH_ARG(std::optional<double>, memory_fraction);
  /// Caching-allocator settings in PYTORCH_ALLOC_CONF syntax, e.g.
  /// "expandable_segments:True,max_split_size_mb:128". Full effect only
  /// before the first CUDA allocation.
  TORCH_ARG(std::optional<std::string>, allocator);
  /// Scaled-dot-product-attention backends.
  TORCH_ARG(std::optional<bool>, sdpa_flash);
  TORCH_ARG(std::optional<bool>, sdpa_mem_efficient);
  TORCH_ARG(std::optional<bool>, sdpa_math);
  TORCH_ARG(std::optional<bool>, sdpa_cudnn);
};

/// Outcome of one setting.
enum class Status { applied, unchanged, skipped };

inline const char* to_string(Status s) {
  switch (s) {
    case Status::applied:
      return "applied";
    case Status::unchanged:
      return "unchanged";
    case Status::skipped:
      return "skipped";
  }
  return "?";
}

/// One row of a Report: the setting as named in perf::Settings.
struct ReportRow {
  std::string setting;
  std::string requested;  // "-" when the setting was left unset
  std::string read_back;  // the value LibTorch reports after setup()
  Status status = Status::unchanged;
  std::string reason;
};

/// What setup() did: one row per setting, in a fixed order.
struct Report {
  std::vector<ReportRow> rows;
  /// True when PERF_DISABLE=1 turned setup() into a no-op.
  bool disabled = false;
  /// The row of `setting`; throws if there is none.
  const ReportRow& at(const std::string& setting) const;
  /// The rows that were applied or skipped, with reasons, and a count of the
  /// unchanged rest; every row when `all` (or PERF_VERBOSE=1). operator<<
  /// prints the same.
  std::string to_string(bool all = false) const;
};

std::ostream& operator<<(std::ostream& os, const Report& r);

/// Applies `settings` (validated first: a bad value throws c10::Error naming
/// the setting and its valid values, and nothing is applied). Idempotent and
/// safe to call from several threads.
Report setup(const Settings& settings = Settings());

/// Applies settings on construction and restores every value it may touch,
/// exactly, on destruction. num_interop_threads and allocator are process-wide
/// one-way settings and are rejected here; use setup() for them.
class ScopedSettings {
 public:
  explicit ScopedSettings(const Settings& settings = Settings());
  ~ScopedSettings();
  ScopedSettings(const ScopedSettings&) = delete;
  ScopedSettings& operator=(const ScopedSettings&) = delete;
  const Report& report() const noexcept { return report_; }

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
  Report report_;
};

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
  int intraop_threads = 0;
  int64_t interop_threads = 0;
  std::vector<std::pair<std::string, std::string>> flags;  // setting -> current value
};

Environment environment();
std::ostream& operator<<(std::ostream& os, const Environment& e);

// ---------------------------------------------------------------------------
namespace detail {

inline std::mutex& settings_mutex() {
  static std::mutex m;
  return m;
}

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) != "" && std::string(v) != "0";
}

inline std::string bool_str(bool b) { return b ? "true" : "false"; }

inline int cuda_device_count() {
#if PERF_WITH_CUDA
  return static_cast<int>(c10::cuda::device_count());
#else
  return 0;
#endif
}

inline std::string no_cuda_reason() {
#if PERF_WITH_CUDA
  return "no CUDA device";
#else
  return "no CUDA device (perf built without CUDA)";
#endif
}

// Lowest compute capability among visible devices, as major*10+minor; 0 if none.
inline int min_compute_capability() {
  int cc = 0;
#if PERF_WITH_CUDA
  for (int d = 0; d < cuda_device_count(); ++d) {
    const auto* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(d));
    const int this_cc = p->major * 10 + p->minor;
    cc = cc == 0 ? this_cc : std::min(cc, this_cc);
  }
#endif
  return cc;
}

inline std::string precision_name(at::Float32Precision p) {
  switch (p) {
    case at::Float32Precision::NONE:
      return "none";
    case at::Float32Precision::IEEE:
      return "ieee";
    case at::Float32Precision::TF32:
      return "tf32";
    case at::Float32Precision::BF16:
      return "bf16";
  }
  return "?";
}

inline std::string matmul_precision_name(at::Float32MatmulPrecision p) {
  switch (p) {
    case at::Float32MatmulPrecision::HIGHEST:
      return "highest";
    case at::Float32MatmulPrecision::HIGH:
      return "high";
    case at::Float32MatmulPrecision::MEDIUM:
      return "medium";
  }
  return "?";
}

// The legacy getter throws when the per-backend API left an unrepresentable state.
inline std::optional<at::Float32MatmulPrecision> legacy_matmul_precision() {
  try {
    return at::globalContext().float32MatmulPrecision();
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

inline std::optional<bool> legacy_cudnn_tf32() {
  try {
    return at::globalContext().allowTF32CuDNN();
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

inline at::Float32Precision fp32(at::Float32Backend b, at::Float32Op op) {
  return at::globalContext().float32Precision(b, op);
}

// MXCSR holds FTZ (bit 15) and DAZ (bit 6) for the calling thread.
inline std::optional<bool> flush_denormal_state() {
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned csr = _mm_getcsr();
  return (csr & 0x8000u) != 0 && (csr & 0x0040u) != 0;
#else
  return std::nullopt;
#endif
}

inline std::string reduction_name(at::CuBLASReductionOption o) {
  switch (o) {
    case at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK:
      return "true";
    case at::CuBLASReductionOption::DisallowReducedPrecisionAllowSplitK:
      return "false";
    case at::CuBLASReductionOption::DisallowReducedPrecisionDisallowSplitK:
      return "false (no split-K)";
  }
  return "?";
}

inline void set_reduction(bool fp16, at::CuBLASReductionOption o) {
  const bool allow = o == at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
  const bool splitk = o != at::CuBLASReductionOption::DisallowReducedPrecisionDisallowSplitK;
  if (fp16) {
    at::globalContext().setAllowFP16ReductionCuBLAS(allow, splitk);
  } else {
    at::globalContext().setAllowBF16ReductionCuBLAS(allow, splitk);
  }
}

inline const std::vector<std::string>& allocator_keys() {
  static const std::vector<std::string> keys = {"expandable_segments",
                                                "max_split_size_mb",
                                                "max_non_split_rounding_mb",
                                                "large_segment_size_mb",
                                                "garbage_collection_threshold",
                                                "roundup_power2_divisions",
                                                "release_lock_on_cudamalloc",
                                                "pinned_use_cuda_host_register",
                                                "pinned_num_register_threads",
                                                "pinned_use_background_threads",
                                                "pinned_reserve_segment_size_mb",
                                                "graph_capture_record_stream_reuse",
                                                "per_process_memory_fraction"};
  return keys;
}

inline std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

inline bool is_uint(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

inline bool is_fraction(const std::string& s) {
  try {
    size_t used = 0;
    const double v = std::stod(s, &used);
    return used == s.size() && v > 0.0 && v < 1.0;
  } catch (const std::exception&) {
    return false;
  }
}

// Checks a PYTORCH_ALLOC_CONF-style string without applying it: "key:value"
// entries separated by commas (commas inside [...] belong to the value).
inline void validate_allocator(const std::string& conf) {
  const std::string valid = "valid keys: " + join(allocator_keys());
  TORCH_CHECK(!conf.empty(), "perf::Settings::allocator: empty string; expected \"key:value[,key:value...]\", ", valid);
  std::vector<std::string> entries;
  std::string cur;
  int depth = 0;
  for (char c : conf) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    TORCH_CHECK(depth >= 0, "perf::Settings::allocator: unbalanced ']' in \"", conf, "\"");
    if (c == ',' && depth == 0) {
      entries.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  TORCH_CHECK(depth == 0, "perf::Settings::allocator: unbalanced '[' in \"", conf, "\"");
  entries.push_back(cur);
  for (const auto& e : entries) {
    const auto colon = e.find(':');
    TORCH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < e.size(),
                "perf::Settings::allocator: malformed entry \"", e, "\" in \"", conf, "\"; expected key:value, ",
                valid);
    const std::string key = e.substr(0, colon);
    const std::string value = e.substr(colon + 1);
    TORCH_CHECK(key != "backend",
                "perf::Settings::allocator: the allocator backend is chosen when CUDA starts; set "
                "PYTORCH_ALLOC_CONF=backend:",
                value, " in the environment before the program starts instead");
    const auto& keys = allocator_keys();
    TORCH_CHECK(std::find(keys.begin(), keys.end(), key) != keys.end(), "perf::Settings::allocator: unknown key \"",
                key, "\"; ", valid);
    const bool boolean = key == "expandable_segments" || key == "release_lock_on_cudamalloc" ||
                         key == "pinned_use_cuda_host_register" || key == "pinned_use_background_threads" ||
                         key == "graph_capture_record_stream_reuse";
    if (boolean) {
      TORCH_CHECK(value == "True" || value == "False", "perf::Settings::allocator: ", key,
                  " must be True or False, got \"", value, "\"");
    } else if (key == "garbage_collection_threshold" || key == "per_process_memory_fraction") {
      TORCH_CHECK(is_fraction(value), "perf::Settings::allocator: ", key, " must be a number in (0, 1), got \"", value,
                  "\"");
    } else if (key == "roundup_power2_divisions") {
      TORCH_CHECK(is_uint(value) || (value.front() == '[' && value.back() == ']'), "perf::Settings::allocator: ", key,
                  " must be an integer or a list like [256:1,512:2], got \"", value, "\"");
    } else {
      TORCH_CHECK(is_uint(value) && std::stoll(value) > 0, "perf::Settings::allocator: ", key,
                  " must be a positive integer, got \"", value, "\"");
    }
  }
}

inline std::string resolved_matmul_precision(const Settings& s) {
  return s.matmul_precision().value_or(s.tf32() ? "high" : "highest");
}

inline void validate(const Settings& s) {
  if (s.matmul_precision()) {
    const auto& p = *s.matmul_precision();
    TORCH_CHECK(p == "highest" || p == "high" || p == "medium", "perf::Settings::matmul_precision: invalid value \"", p,
                "\"; valid values: \"highest\", \"high\", \"medium\"");
  }
  if (s.num_threads()) {
    TORCH_CHECK(*s.num_threads() >= 1, "perf::Settings::num_threads: must be >= 1, got ", *s.num_threads());
  }
  if (s.num_interop_threads()) {
    TORCH_CHECK(*s.num_interop_threads() >= 1, "perf::Settings::num_interop_threads: must be >= 1, got ",
                *s.num_interop_threads());
  }
  if (s.sync_debug()) {
    const auto& m = *s.sync_debug();
    TORCH_CHECK(m == "off" || m == "warn" || m == "error", "perf::Settings::sync_debug: invalid value \"", m,
                "\"; valid values: \"off\", \"warn\", \"error\"");
  }
  if (s.memory_fraction()) {
    const double f = *s.memory_fraction();
    TORCH_CHECK(f > 0.0 && f <= 1.0, "perf::Settings::memory_fraction: must be in (0, 1], got ", f);
  }
  if (s.allocator()) validate_allocator(*s.allocator());
  auto& ctx = at::globalContext();
  const bool any_sdpa = s.sdpa_flash().value_or(ctx.userEnabledFlashSDP()) ||
                        s.sdpa_mem_efficient().value_or(ctx.userEnabledMemEfficientSDP()) ||
                        s.sdpa_math().value_or(ctx.userEnabledMathSDP()) ||
                        s.sdpa_cudnn().value_or(ctx.userEnabledCuDNNSDP());
  TORCH_CHECK(any_sdpa,
              "perf::Settings::sdpa_*: at least one of sdpa_flash, sdpa_mem_efficient, sdpa_math, sdpa_cudnn must "
              "stay enabled, or scaled_dot_product_attention has no kernel");
}

// Current value of every setting, as text, in report order.
inline std::vector<std::pair<std::string, std::string>> read_flags() {
  using B = at::Float32Backend;
  using O = at::Float32Op;
  auto& ctx = at::globalContext();
  std::vector<std::pair<std::string, std::string>> f;
  const auto conv = fp32(B::CUDA, O::CONV);
  const auto rnn = fp32(B::CUDA, O::RNN);
  f.emplace_back("tf32", conv == rnn ? bool_str(conv == at::Float32Precision::TF32)
                                     : "conv=" + precision_name(conv) + " rnn=" + precision_name(rnn));
  const auto legacy = legacy_matmul_precision();
  f.emplace_back("matmul_precision", legacy ? matmul_precision_name(*legacy)
                                            : "inconsistent (cuda.matmul=" + precision_name(fp32(B::CUDA, O::MATMUL)) +
                                                  " mkldnn.matmul=" + precision_name(fp32(B::MKLDNN, O::MATMUL)) + ")");
  f.emplace_back("cudnn_benchmark", bool_str(ctx.benchmarkCuDNN()));
  const bool da = ctx.deterministicAlgorithms();
  const bool dc = ctx.deterministicCuDNN();
  f.emplace_back("deterministic", da == dc ? bool_str(da) : "algorithms=" + bool_str(da) + " cudnn=" + bool_str(dc));
  const char* ws = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  f.emplace_back("cublas_workspace_config", ws ? ws : "(unset)");
  f.emplace_back("fp16_reduced_precision_reduction", reduction_name(ctx.allowFP16ReductionCuBLAS()));
  f.emplace_back("bf16_reduced_precision_reduction", reduction_name(ctx.allowBF16ReductionCuBLAS()));
  f.emplace_back("num_threads", std::to_string(at::get_num_threads()));
  f.emplace_back("num_interop_threads", std::to_string(at::get_num_interop_threads()));
  const auto fd = flush_denormal_state();
  f.emplace_back("flush_denormal", fd ? bool_str(*fd) : "n/a (not x86-64)");
#if PERF_WITH_CUDA
  const auto mode = c10::cuda::warning_state().get_sync_debug_mode();
  f.emplace_back("sync_debug", mode == c10::cuda::SyncDebugMode::L_DISABLED ? "off"
                               : mode == c10::cuda::SyncDebugMode::L_WARN   ? "warn"
                                                                            : "error");
  std::string fractions;
  for (int d = 0; d < cuda_device_count(); ++d) {
    std::ostringstream os;
    os << c10::cuda::CUDACachingAllocator::getMemoryFraction(static_cast<c10::DeviceIndex>(d));
    fractions += (d ? "," : "") + os.str();
  }
  f.emplace_back("memory_fraction", fractions.empty() ? "n/a" : fractions);
#else
  f.emplace_back("sync_debug", "n/a");
  f.emplace_back("memory_fraction", "n/a");
#endif
  const auto conf = c10::CachingAllocator::getAllocatorSettings();
  f.emplace_back("allocator", conf.empty() ? "(default)" : conf);
  f.emplace_back("sdpa_flash", bool_str(ctx.userEnabledFlashSDP()));
  f.emplace_back("sdpa_mem_efficient", bool_str(ctx.userEnabledMemEfficientSDP()));
  f.emplace_back("sdpa_math", bool_str(ctx.userEnabledMathSDP()));
  f.emplace_back("sdpa_cudnn", bool_str(ctx.userEnabledCuDNNSDP()));
  return f;
}

// What a Settings asks of each row: requested text (nullopt = not requested)
// and, when the row cannot apply here, why.
struct Request {
  std::optional<std::string> value;
  std::string skip;
  std::string note;
};

inline std::vector<std::pair<std::string, Request>> requests(const Settings& s) {
  const bool cuda = cuda_device_count() > 0;
  const std::string no_cuda = cuda ? "" : no_cuda_reason();
  auto opt_bool = [](const std::optional<bool>& b) {
    return b ? std::optional<std::string>(bool_str(*b)) : std::nullopt;
  };
  auto opt_int = [](const std::optional<int>& i) {
    return i ? std::optional<std::string>(std::to_string(*i)) : std::nullopt;
  };
  std::vector<std::pair<std::string, Request>> r;
  std::string tf32_note;
  const int cc = min_compute_capability();
  if (cc > 0 && cc < 80) tf32_note = "no effect on sm_" + std::to_string(cc) + " (TF32 needs sm_80+)";
  r.push_back({"tf32", {bool_str(s.tf32()), no_cuda, tf32_note}});
  r.push_back({"matmul_precision",
               {resolved_matmul_precision(s), "",
                s.matmul_precision() ? tf32_note : (tf32_note.empty() ? "from tf32" : "from tf32; " + tf32_note)}});
  const bool bench = s.cudnn_benchmark() && !s.deterministic();
  r.push_back({"cudnn_benchmark",
               {bool_str(bench), no_cuda, s.cudnn_benchmark() && !bench ? "off because deterministic(true)" : ""}});
  r.push_back({"deterministic", {bool_str(s.deterministic()), "", ""}});
  Request ws;
  if (s.deterministic()) {
    const char* cur = std::getenv("CUBLAS_WORKSPACE_CONFIG");
    ws.value = cur ? std::string(cur) : std::string(":4096:8");
    ws.skip = no_cuda;
    ws.note = cur ? "kept the user's value" : "must be set before the first cuBLAS call";
  }
  r.push_back({"cublas_workspace_config", ws});
  r.push_back({"fp16_reduced_precision_reduction", {opt_bool(s.fp16_reduced_precision_reduction()), no_cuda, ""}});
  r.push_back({"bf16_reduced_precision_reduction", {opt_bool(s.bf16_reduced_precision_reduction()), no_cuda, ""}});
  r.push_back({"num_threads", {opt_int(s.num_threads()), "", ""}});
  r.push_back({"num_interop_threads", {opt_int(s.num_interop_threads()), "", ""}});
  r.push_back({"flush_denormal",
               {opt_bool(s.flush_denormal()), flush_denormal_state() ? "" : "needs x86-64 FTZ/DAZ",
                s.flush_denormal() ? "calling thread only" : ""}});
  r.push_back({"sync_debug", {s.sync_debug(), no_cuda, ""}});
  std::optional<std::string> frac;
  if (s.memory_fraction()) {
    std::ostringstream os;
    os << *s.memory_fraction();
    frac = os.str();
  }
  r.push_back({"memory_fraction", {frac, no_cuda, ""}});
  r.push_back({"allocator", {s.allocator(), no_cuda, ""}});
  r.push_back({"sdpa_flash", {opt_bool(s.sdpa_flash()), "", ""}});
  r.push_back({"sdpa_mem_efficient", {opt_bool(s.sdpa_mem_efficient()), "", ""}});
  r.push_back({"sdpa_math", {opt_bool(s.sdpa_math()), "", ""}});
  r.push_back({"sdpa_cudnn", {opt_bool(s.sdpa_cudnn()), "", ""}});
  return r;
}

inline int64_t cuda_reserved_bytes() {
  int64_t total = 0;
#if PERF_WITH_CUDA
  for (int d = 0; d < cuda_device_count(); ++d) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(d));
    total += stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
#endif
  return total;
}

// Applies the rows of `req` that are requested and not skipped. Rows that can
// fail (interop threads) go first, so a failure leaves nothing applied.
inline void apply(const Settings& s, std::vector<std::pair<std::string, Request>>& req) {
  auto& ctx = at::globalContext();
  auto wants = [&](const char* name) -> Request* {
    for (auto& [n, r] : req)
      if (n == name && r.value && r.skip.empty()) return &r;
    return nullptr;
  };
  if (wants("num_interop_threads")) {
    const int n = *s.num_interop_threads();
    if (static_cast<int64_t>(at::get_num_interop_threads()) != n) {
      try {
        at::set_num_interop_threads(n);
      } catch (const c10::Error&) {
        TORCH_CHECK(false,
                    "perf::Settings::num_interop_threads: LibTorch accepts it once per process, before any "
                    "inter-op work; it is already fixed at ",
                    at::get_num_interop_threads(),
                    ". Call perf::setup() with num_interop_threads first thing in main(), or leave it unset. "
                    "Nothing was applied.");
      }
    }
  }
  // Legacy setters keep the legacy and per-backend TF32 views consistent.
  ctx.setFloat32MatmulPrecision(resolved_matmul_precision(s));
  if (wants("tf32")) ctx.setAllowTF32CuDNN(s.tf32());
  if (wants("cudnn_benchmark")) ctx.setBenchmarkCuDNN(s.cudnn_benchmark() && !s.deterministic());
  ctx.setDeterministicCuDNN(s.deterministic());
  ctx.setDeterministicAlgorithms(s.deterministic(), /*warn_only=*/false);
  if (wants("cublas_workspace_config") && std::getenv("CUBLAS_WORKSPACE_CONFIG") == nullptr) {
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 1);
  }
  if (wants("fp16_reduced_precision_reduction")) ctx.setAllowFP16ReductionCuBLAS(*s.fp16_reduced_precision_reduction());
  if (wants("bf16_reduced_precision_reduction")) ctx.setAllowBF16ReductionCuBLAS(*s.bf16_reduced_precision_reduction());
  if (wants("num_threads")) at::set_num_threads(*s.num_threads());
  if (auto* r = wants("flush_denormal")) {
    if (!at::globalContext().setFlushDenormal(*s.flush_denormal())) r->note = "CPU does not support FTZ/DAZ";
  }
#if PERF_WITH_CUDA
  if (wants("sync_debug")) {
    const auto& m = *s.sync_debug();
    c10::cuda::warning_state().set_sync_debug_mode(m == "off"    ? c10::cuda::SyncDebugMode::L_DISABLED
                                                   : m == "warn" ? c10::cuda::SyncDebugMode::L_WARN
                                                                 : c10::cuda::SyncDebugMode::L_ERROR);
  }
  if (wants("memory_fraction")) {
    for (int d = 0; d < cuda_device_count(); ++d)
      c10::cuda::CUDACachingAllocator::setMemoryFraction(*s.memory_fraction(), static_cast<c10::DeviceIndex>(d));
  }
  if (auto* r = wants("allocator")) {
    const int64_t reserved = cuda_reserved_bytes();
    c10::CachingAllocator::setAllocatorSettings(*s.allocator());
    if (reserved > 0) {
      r->note = "too late for full effect: " + std::to_string(reserved >> 20) +
                " MiB already reserved; only new segments follow it. Set it before the first CUDA allocation "
                "(or PYTORCH_ALLOC_CONF)";
    } else {
      r->note = "before the first CUDA allocation: full effect";
    }
  }
#endif
  if (wants("sdpa_flash")) ctx.setSDPUseFlash(*s.sdpa_flash());
  if (wants("sdpa_mem_efficient")) ctx.setSDPUseMemEfficient(*s.sdpa_mem_efficient());
  if (wants("sdpa_math")) ctx.setSDPUseMath(*s.sdpa_math());
  if (wants("sdpa_cudnn")) ctx.setSDPUseCuDNN(*s.sdpa_cudnn());
}

inline Report make_report(const std::vector<std::pair<std::string, Request>>& req,
                          const std::vector<std::pair<std::string, std::string>>& before,
                          const std::vector<std::pair<std::string, std::string>>& after, const std::string& disabled) {
  Report rep;
  rep.disabled = !disabled.empty();
  for (size_t i = 0; i < req.size(); ++i) {
    const auto& [name, r] = req[i];
    ReportRow row;
    row.setting = name;
    row.requested = r.value.value_or("-");
    row.read_back = after[i].second;
    if (!disabled.empty()) {
      row.status = Status::skipped;
      row.reason = disabled;
    } else if (!r.value) {
      row.status = Status::unchanged;
      row.reason = "not requested";
    } else if (!r.skip.empty()) {
      row.status = Status::skipped;
      row.reason = r.skip;
    } else {
      row.status = before[i].second == after[i].second ? Status::unchanged : Status::applied;
      row.reason = r.note;
    }
    rep.rows.push_back(std::move(row));
  }
  return rep;
}

inline std::string pad(const std::string& s, size_t w) {
  return s.size() >= w ? s : s + std::string(w - s.size(), ' ');
}

// Everything perf may change, captured so that ScopedSettings can put it back.
struct Snapshot {
  std::optional<at::Float32MatmulPrecision> matmul_legacy;
  std::optional<bool> cudnn_legacy;
  at::Float32Precision cuda_matmul{}, mkldnn_matmul{}, cuda_conv{}, cuda_rnn{};
  bool benchmark = false, det_cudnn = false, det_algorithms = false, det_warn_only = false;
  at::CuBLASReductionOption fp16{}, bf16{};
  int num_threads = 1;
  std::optional<bool> flush_denormal;
  std::optional<std::string> cublas_workspace;
  bool sdpa_flash = true, sdpa_mem_efficient = true, sdpa_math = true, sdpa_cudnn = true;
#if PERF_WITH_CUDA
  c10::cuda::SyncDebugMode sync_debug = c10::cuda::SyncDebugMode::L_DISABLED;
  std::vector<double> fractions;
#endif

  static Snapshot capture() {
    using B = at::Float32Backend;
    using O = at::Float32Op;
    auto& ctx = at::globalContext();
    Snapshot s;
    s.matmul_legacy = legacy_matmul_precision();
    s.cudnn_legacy = legacy_cudnn_tf32();
    s.cuda_matmul = fp32(B::CUDA, O::MATMUL);
    s.mkldnn_matmul = fp32(B::MKLDNN, O::MATMUL);
    s.cuda_conv = fp32(B::CUDA, O::CONV);
    s.cuda_rnn = fp32(B::CUDA, O::RNN);
    s.benchmark = ctx.benchmarkCuDNN();
    s.det_cudnn = ctx.deterministicCuDNN();
    s.det_algorithms = ctx.deterministicAlgorithms();
    s.det_warn_only = ctx.deterministicAlgorithmsWarnOnly();
    s.fp16 = ctx.allowFP16ReductionCuBLAS();
    s.bf16 = ctx.allowBF16ReductionCuBLAS();
    s.num_threads = at::get_num_threads();
    s.flush_denormal = flush_denormal_state();
    if (const char* ws = std::getenv("CUBLAS_WORKSPACE_CONFIG")) s.cublas_workspace = ws;
    s.sdpa_flash = ctx.userEnabledFlashSDP();
    s.sdpa_mem_efficient = ctx.userEnabledMemEfficientSDP();
    s.sdpa_math = ctx.userEnabledMathSDP();
    s.sdpa_cudnn = ctx.userEnabledCuDNNSDP();
#if PERF_WITH_CUDA
    s.sync_debug = c10::cuda::warning_state().get_sync_debug_mode();
    for (int d = 0; d < cuda_device_count(); ++d)
      s.fractions.push_back(c10::cuda::CUDACachingAllocator::getMemoryFraction(static_cast<c10::DeviceIndex>(d)));
#endif
    return s;
  }

  void restore() const {
    using B = at::Float32Backend;
    using O = at::Float32Op;
    auto& ctx = at::globalContext();
    // Legacy fields first (they also write the per-backend entries), then the
    // per-backend entries exactly as they read before.
    if (matmul_legacy) ctx.setFloat32MatmulPrecision(matmul_precision_name(*matmul_legacy));
    if (cudnn_legacy) ctx.setAllowTF32CuDNN(*cudnn_legacy);
    ctx.setFloat32Precision(B::CUDA, O::MATMUL, cuda_matmul);
    ctx.setFloat32Precision(B::MKLDNN, O::MATMUL, mkldnn_matmul);
    ctx.setFloat32Precision(B::CUDA, O::CONV, cuda_conv);
    ctx.setFloat32Precision(B::CUDA, O::RNN, cuda_rnn);
    ctx.setBenchmarkCuDNN(benchmark);
    ctx.setDeterministicCuDNN(det_cudnn);
    ctx.setDeterministicAlgorithms(det_algorithms, det_warn_only);
    set_reduction(true, fp16);
    set_reduction(false, bf16);
    if (at::get_num_threads() != num_threads) at::set_num_threads(num_threads);
    if (flush_denormal && flush_denormal_state() != flush_denormal) ctx.setFlushDenormal(*flush_denormal);
    if (cublas_workspace) {
      ::setenv("CUBLAS_WORKSPACE_CONFIG", cublas_workspace->c_str(), 1);
    } else {
      ::unsetenv("CUBLAS_WORKSPACE_CONFIG");
    }
    ctx.setSDPUseFlash(sdpa_flash);
    ctx.setSDPUseMemEfficient(sdpa_mem_efficient);
    ctx.setSDPUseMath(sdpa_math);
    ctx.setSDPUseCuDNN(sdpa_cudnn);
#if PERF_WITH_CUDA
    c10::cuda::warning_state().set_sync_debug_mode(sync_debug);
    for (size_t d = 0; d < fractions.size(); ++d)
      c10::cuda::CUDACachingAllocator::setMemoryFraction(fractions[d], static_cast<c10::DeviceIndex>(d));
#endif
  }
};

// setup() without the lock, for ScopedSettings which holds it across capture.
inline Report setup_locked(const Settings& settings) {
  validate(settings);
  auto req = requests(settings);
  auto before = read_flags();
  if (env_flag("PERF_DISABLE")) return make_report(req, before, before, "PERF_DISABLE=1");
  apply(settings, req);
  return make_report(req, before, read_flags(), "");
}

inline void maybe_print(const Report& r) {
  if (env_flag("PERF_VERBOSE")) std::cerr << r.to_string(true);
}

}  // namespace detail

// ---------------------------------------------------------------------------

inline const ReportRow& Report::at(const std::string& setting) const {
  const auto it = std::find_if(rows.begin(), rows.end(), [&](const ReportRow& r) { return r.setting == setting; });
  TORCH_CHECK(it != rows.end(), "perf::Report::at: no row named \"", setting, "\"");
  return *it;
}

inline std::string Report::to_string(bool all) const {
  all = all || detail::env_flag("PERF_VERBOSE") || disabled;
  std::vector<const ReportRow*> shown;
  for (const auto& row : rows)
    if (all || row.status != Status::unchanged) shown.push_back(&row);
  size_t w0 = 7, w1 = 9, w2 = 9, w3 = 6;
  for (const auto* row : shown) {
    w0 = std::max(w0, row->setting.size());
    w1 = std::max(w1, row->requested.size());
    w2 = std::max(w2, row->read_back.size());
    w3 = std::max(w3, std::string(perf::to_string(row->status)).size());
  }
  using detail::pad;
  std::ostringstream os;
  os << "perf::setup" << (disabled ? " (disabled by PERF_DISABLE=1)" : "") << "\n";
  os << pad("setting", w0) << "  " << pad("requested", w1) << "  " << pad("read back", w2) << "  " << pad("status", w3)
     << "  reason\n";
  for (const auto* row : shown) {
    os << pad(row->setting, w0) << "  " << pad(row->requested, w1) << "  " << pad(row->read_back, w2) << "  "
       << pad(perf::to_string(row->status), w3) << "  " << row->reason << "\n";
  }
  if (shown.size() < rows.size()) {
    os << "(" << rows.size() - shown.size()
       << " more settings unchanged; report.to_string(true) or PERF_VERBOSE=1 shows every row)\n";
  }
  return os.str();
}

inline std::ostream& operator<<(std::ostream& os, const Report& r) { return os << r.to_string(); }

inline Report setup(const Settings& settings) {
  Report r;
  {
    std::lock_guard<std::mutex> lock(detail::settings_mutex());
    r = detail::setup_locked(settings);
  }
  detail::maybe_print(r);
  return r;
}

struct ScopedSettings::Saved {
  detail::Snapshot snapshot;
};

inline ScopedSettings::ScopedSettings(const Settings& settings) {
  TORCH_CHECK(!settings.num_interop_threads(),
              "perf::ScopedSettings: num_interop_threads can be set once per process and cannot be restored; set "
              "it with perf::setup()");
  TORCH_CHECK(!settings.allocator(),
              "perf::ScopedSettings: allocator settings shape memory already reserved and cannot be restored; set "
              "them with perf::setup()");
  std::lock_guard<std::mutex> lock(detail::settings_mutex());
  detail::validate(settings);
  saved_ = std::make_unique<Saved>(Saved{detail::Snapshot::capture()});
  report_ = detail::setup_locked(settings);
  detail::maybe_print(report_);
}

inline ScopedSettings::~ScopedSettings() {
  std::lock_guard<std::mutex> lock(detail::settings_mutex());
  saved_->snapshot.restore();
}

inline Environment environment() {
  Environment e;
  e.hardware_threads = std::thread::hardware_concurrency();
  e.intraop_threads = at::get_num_threads();
  e.interop_threads = static_cast<int64_t>(at::get_num_interop_threads());
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

inline std::ostream& operator<<(std::ostream& os, const Environment& e) {
  auto version = [](int64_t v) {
    if (v == 0) return std::string("n/a");
    return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  };
  os << "perf " << e.perf_version << " on LibTorch " << e.torch_version << "\n";
  os << "  CUDA support compiled: " << (e.cuda_compiled ? "yes" : "no") << "\n";
  os << "  CUDA runtime: " << version(e.cuda_runtime_version) << ", driver: " << version(e.cuda_driver_version)
     << ", cuDNN: " << (e.cudnn_version ? std::to_string(e.cudnn_version) : "n/a") << "\n";
  os << "  CPU: " << e.hardware_threads << " hardware threads; intra-op " << e.intraop_threads << ", inter-op "
     << e.interop_threads << "\n";
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
