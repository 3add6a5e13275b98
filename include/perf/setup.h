// perf/setup.h — one call for the backend settings Python users get from folklore.
//
//   perf::Report r = perf::setup();                       // the fast defaults
//   perf::setup(perf::Settings().tf32(false).num_threads(8));
//   std::cout << r;                                       // what was applied or skipped, and why
//   { perf::ScopedSettings guard(perf::Settings().deterministic(true)); ... }  // restored here
//
// A setting left unset never undoes the program's own earlier choice: tf32 and
// cudnn_benchmark are perf's fast defaults, but cudnn_benchmark yields when the
// program turned deterministic algorithms on; deterministic is untouched unless set.
// perf never sets environment variables (setenv races with getenv in other threads).
//
// Environment variables: PERF_DISABLE=1 makes setup() a reported no-op (A/B runs
// without recompiling); PERF_VERBOSE=1 prints each report to stderr.
// perf::environment() (versions, devices, every flag) is in perf/environment.h.
#pragma once

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/detail/cpu.h>
#include <perf/detail/cuda.h>
#include <torch/arg.h>
#include <torch/version.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace perf {

/// What perf::setup() applies. Every setter returns *this (LibTorch options
/// style). A setting left unset is not touched (tf32 and cudnn_benchmark have
/// fast defaults, see each).
struct Settings {
  /// TF32 tensor cores for cuDNN convolutions and RNNs; also picks the default
  /// matmul_precision ("high" when on, "highest" when off). Effect on sm_80+.
  TORCH_ARG(bool, tf32) = true;
  /// fp32 matmul precision: "highest", "high" (TF32 on cuBLAS) or "medium"
  /// (also bf16 on oneDNN). Unset: follows tf32.
  TORCH_ARG(std::optional<std::string>, matmul_precision);
  /// cuDNN autotuner: picks the fastest convolution algorithm per shape.
  /// Unset: on, unless deterministic algorithms are on (requested here or set
  /// earlier by the program), in which case it is left as it is.
  TORCH_ARG(std::optional<bool>, cudnn_benchmark);
  /// How many of cuDNN's candidate algorithms the autotuner times per
  /// convolution shape (torch.backends.cudnn.benchmark_limit), >= 0; 0 times
  /// every one cuDNN offers. Only with cudnn_benchmark on. Unset: untouched
  /// (LibTorch's default is 10, the first ten of cuDNN's heuristic order).
  TORCH_ARG(std::optional<int>, cudnn_benchmark_limit);
  /// Deterministic algorithms and deterministic cuDNN (and cudnn_benchmark off
  /// unless set explicitly). Unset: untouched. On CUDA, cuBLAS also needs
  /// CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before the program
  /// starts; the report says when it is missing.
  TORCH_ARG(std::optional<bool>, deterministic);
  /// cuBLAS may reduce fp16 / bf16 GEMMs in reduced precision (PyTorch default: true).
  TORCH_ARG(std::optional<bool>, fp16_reduced_precision_reduction);
  TORCH_ARG(std::optional<bool>, bf16_reduced_precision_reduction);
  /// Scaled-dot-product-attention backends.
  TORCH_ARG(std::optional<bool>, sdpa_flash);
  TORCH_ARG(std::optional<bool>, sdpa_mem_efficient);
  TORCH_ARG(std::optional<bool>, sdpa_math);
  TORCH_ARG(std::optional<bool>, sdpa_cudnn);
  /// Caching-allocator settings in PYTORCH_ALLOC_CONF syntax, e.g.
  /// "expandable_segments:True,max_split_size_mb:128", checked by LibTorch's
  /// own parser (the keys of the installed version). Full effect only before
  /// the first CUDA allocation.
  TORCH_ARG(std::optional<std::string>, allocator);
  /// Cap of the CUDA caching allocator, in (0, 1], on memory_fraction_device
  /// (unset: the current device) only: other GPUs get no CUDA context.
  TORCH_ARG(std::optional<double>, memory_fraction);
  TORCH_ARG(std::optional<int>, memory_fraction_device);
  /// CUDA sync debug mode: "off", "warn" or "error" on host-device syncs.
  TORCH_ARG(std::optional<std::string>, sync_debug);
  /// Intra-op CPU threads (at::set_num_threads), >= 1.
  TORCH_ARG(std::optional<int>, num_threads);
  /// Inter-op CPU threads, >= 1; LibTorch accepts this once per process, before
  /// any inter-op work.
  TORCH_ARG(std::optional<int>, num_interop_threads);
  /// Flush denormals to zero on the CPU (FTZ/DAZ). Affects the calling thread.
  TORCH_ARG(std::optional<bool>, flush_denormal);
  /// Keep freed CPU memory in the process for the next allocation (glibc's
  /// malloc: blocks up to 32 MiB from the heap instead of fresh mmap pages, and
  /// the heap never trimmed), so a step's tensors stop faulting in zeroed pages
  /// every step: the C++ form of the CPU tuning guide's "use jemalloc or
  /// tcmalloc". RSS then keeps its peak. Unset: on in setup() unless the
  /// environment tunes malloc already (MALLOC_*_, GLIBC_TUNABLES, an
  /// LD_PRELOAD'd allocator); untouched by ScopedSettings. false puts glibc's
  /// initial thresholds back. Process-wide and one-way (glibc has no getter).
  TORCH_ARG(std::optional<bool>, cpu_malloc_cache);
};

/// Outcome of one setting.
enum class Status { applied, unchanged, skipped };

PERF_INLINE const char* to_string(Status s);

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
  /// perf's CPU autocast default on this CPU and the features that decided it
  /// (perf::Autocast and perf::optimize on the CPU), e.g. "bf16: avx512_bf16=yes amx_bf16=no".
  std::string cpu_autocast;
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
/// exactly, on destruction. num_interop_threads, allocator and cpu_malloc_cache
/// are process-wide one-way settings and are rejected here (cpu_malloc_cache's
/// default is left alone); use setup() for them.
class ScopedSettings {
 public:
  explicit ScopedSettings(const Settings& settings = Settings());
  ~ScopedSettings();
  ScopedSettings(const ScopedSettings&) = delete;
  ScopedSettings& operator=(const ScopedSettings&) = delete;
  const Report& report() const noexcept { return report_; }

 private:
  std::vector<std::function<void()>> restore_;  // in reverse order of saving
  Report report_;
};

// ---------------------------------------------------------------------------
// One entry per setting: validation, the report, apply, ScopedSettings and
// perf::environment() all walk the same table, so a setting is written once.
namespace detail {

PERF_INLINE std::mutex& settings_mutex();

PERF_INLINE bool env_flag(const char* name);

PERF_INLINE std::string bool_str(bool b);

PERF_INLINE int cuda_device_count();

PERF_INLINE std::string no_cuda_reason();

// Compute capability of `device` as major*10+minor; 0 without CUDA.
PERF_INLINE int compute_capability([[maybe_unused]] int device);

PERF_INLINE std::string precision_name(at::Float32Precision p);

PERF_INLINE std::string matmul_precision_name(at::Float32MatmulPrecision p);

// The legacy getters throw when the per-backend API left an unrepresentable state.
PERF_INLINE std::optional<at::Float32MatmulPrecision> legacy_matmul_precision();

PERF_INLINE std::optional<bool> legacy_cudnn_tf32();

PERF_INLINE at::Float32Precision fp32(at::Float32Backend b, at::Float32Op op);

// MXCSR holds FTZ (bit 15) and DAZ (bit 6) for the calling thread.
PERF_INLINE std::optional<bool> flush_denormal_state();

PERF_INLINE std::string reduction_name(at::CuBLASReductionOption o);

PERF_INLINE void set_reduction(bool fp16, at::CuBLASReductionOption o);

PERF_INLINE std::string number(double v);

// glibc malloc's mmap and trim thresholds (cpu_malloc_cache). Why it cannot
// apply in this build or process ("" if it can), and whether perf turned it on.
PERF_INLINE std::string malloc_cache_unavailable();
PERF_INLINE std::string malloc_tuned_by_environment();
PERF_INLINE std::atomic<bool>& malloc_cache_on();

// What one setup() call works with: the settings and the machine as it is now.
struct Plan {
  const Settings& s;
  bool cuda = false;  // a CUDA device is visible
  int device = -1;    // memory_fraction's device; the current device by default
  int cc = 0;         // its compute capability (major*10+minor)
  bool det_before = false;
  bool scoped = false;  // for ScopedSettings: the one-way defaults stay untouched
  bool determinism() const { return s.deterministic().value_or(det_before); }
};

PERF_INLINE Plan make_plan(const Settings& s);

// What a Settings asks of one entry: the requested value as text (nullopt:
// untouched) and, when it cannot apply here, why.
struct Request {
  std::optional<std::string> value;
  std::string skip;
  std::string note;
};

using Restore = std::function<void()>;

struct Entry {
  const char* name;
  bool cuda_only;                     // skipped without a CUDA device
  const char* one_way;                // why ScopedSettings cannot restore it; nullptr if it can
  bool fallible;                      // apply may throw: applied first, rolled back if a later one throws
  void (*validate)(const Settings&);  // throws c10::Error naming the setting; may be null
  Request (*request)(const Plan&);
  std::string (*apply)(const Plan&);  // returns a note for the report ("" keeps the request's)
  std::string (*read)(const Plan&);   // the current value, as LibTorch reports it
  Restore (*save)(const Plan&);       // captures the current value; null: nothing to restore
};

PERF_INLINE std::optional<std::string> opt_text(const std::optional<bool>& b);
PERF_INLINE std::optional<std::string> opt_text(const std::optional<int>& i);

PERF_INLINE std::string resolved_matmul_precision(const Settings& s);

PERF_INLINE std::string tf32_note(const Plan& p);
PERF_INLINE bool cudnn_benchmark_after(const Plan& p);

PERF_INLINE bool valid_cublas_workspace(const char* v);

PERF_INLINE int64_t cuda_reserved_bytes();

// LibTorch's parser applies an allocator string key by key, resetting only some
// keys to their defaults first; putting back the previous string and the one
// sticky device key makes a rejected string leave no trace.
PERF_INLINE Restore save_allocator();

PERF_INLINE void parse_allocator(const std::string& conf);

// The legacy setter first (it also writes the per-backend entries), then the
// two per-backend entries exactly as they read before.
PERF_INLINE Restore save_fp32(bool matmul, std::pair<at::Float32Backend, at::Float32Op> a,
                              std::pair<at::Float32Backend, at::Float32Op> b);

PERF_INLINE Restore save_bool(bool (at::Context::*get)() const, void (at::Context::*set)(bool));

// An optional bool of Settings mapped to a bool getter/setter pair of at::Context.
using BoolArg = const std::optional<bool>& (Settings::*)() const noexcept;
template <BoolArg Arg, bool (at::Context::*Get)() const, void (at::Context::*Set)(bool)>
Entry context_bool(const char* name, bool cuda_only, void (*validate)(const Settings&) = nullptr) {
  return {name,
          cuda_only,
          nullptr,
          false,
          validate,
          [](const Plan& p) {
            return Request{opt_text((p.s.*Arg)()), "", ""};
          },
          [](const Plan& p) {
            (at::globalContext().*Set)(*(p.s.*Arg)());
            return std::string();
          },
          [](const Plan&) { return bool_str((at::globalContext().*Get)()); },
          [](const Plan&) { return save_bool(Get, Set); }};
}

PERF_INLINE void validate_sdpa(const Settings& s);

PERF_INLINE const std::vector<Entry>& entries();

PERF_INLINE void validate(const Settings& s);

// Current value of every setting, as text, in table order.
PERF_INLINE std::vector<std::string> read_values(const Plan& p);

PERF_INLINE std::vector<std::pair<std::string, std::string>> read_flags();

PERF_INLINE Request request(const Entry& e, const Plan& p);

PERF_INLINE bool wanted(const Request& r);

// Fallible entries first, each saved; if one throws, those already applied are
// put back, so a failed setup() applies nothing.
PERF_INLINE void apply(const Plan& p, std::vector<Request>& req);

PERF_INLINE Report make_report(const std::vector<Request>& req, const std::vector<std::string>& before,
                               const std::vector<std::string>& after, const std::string& disabled);

// setup() without the lock, for ScopedSettings which holds it across saving.
PERF_INLINE Report setup_locked(const Plan& p);

PERF_INLINE void maybe_print(const Report& r);

PERF_INLINE std::string pad(const std::string& s, size_t w);

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/setup-inl.h>
#endif
