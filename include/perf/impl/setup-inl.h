// perf/impl/setup-inl.h — the out-of-line definitions of perf/setup.h.
// Included by perf/setup.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/setup.h>

// CUDA's headers only here, where the definitions use them: a perf::perf_static user's
// translation unit does not compile them (docs/compile-time.md).
#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#if defined(__GLIBC__)
#include <malloc.h>
#endif

// A sanitizer brings its own malloc: glibc's thresholds then change nothing.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define PERF_DETAIL_OWN_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define PERF_DETAIL_OWN_MALLOC 1
#endif
#endif

namespace perf {

PERF_INLINE const char* to_string(Status s) {
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

namespace detail {

PERF_INLINE std::mutex& settings_mutex() {
  static std::mutex m;
  return m;
}

PERF_INLINE bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) != "" && std::string(v) != "0";
}

PERF_INLINE std::string bool_str(bool b) { return b ? "true" : "false"; }

PERF_INLINE int cuda_device_count() {
#if PERF_WITH_CUDA
  return static_cast<int>(c10::cuda::device_count());
#else
  return 0;
#endif
}

PERF_INLINE std::string no_cuda_reason() {
#if PERF_WITH_CUDA
  return "no CUDA device";
#else
  return "no CUDA device (perf built without CUDA)";
#endif
}

PERF_INLINE int compute_capability([[maybe_unused]] int device) {
#if PERF_WITH_CUDA
  if (device >= 0 && device < cuda_device_count()) {
    const auto* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
    return p->major * 10 + p->minor;
  }
#endif
  return 0;
}

// LibTorch's own names ("none", "ieee", "tf32", "bf16"; later versions add more, e.g. 2.15's "bfx9"), so that a
// precision a newer LibTorch adds prints as Python's torch.backends prints it.
PERF_INLINE std::string precision_name(at::Float32Precision p) {
  try {
    return at::precision2str(p);
  } catch (const c10::Error&) {  // a value LibTorch keeps internal (2.15's DEFAULT, which its getters resolve)
    return "internal value " + std::to_string(static_cast<int>(p));
  }
}

PERF_INLINE std::string matmul_precision_name(at::Float32MatmulPrecision p) {
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

PERF_INLINE std::optional<at::Float32MatmulPrecision> legacy_matmul_precision() {
  try {
    return at::globalContext().float32MatmulPrecision();
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

PERF_INLINE std::optional<bool> legacy_cudnn_tf32() {
  try {
    return at::globalContext().allowTF32CuDNN();
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

PERF_INLINE at::Float32Precision fp32(at::Float32Backend b, at::Float32Op op) {
  return at::globalContext().float32Precision(b, op);
}

PERF_INLINE std::optional<bool> flush_denormal_state() {
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned csr = _mm_getcsr();
  return (csr & 0x8000u) != 0 && (csr & 0x0040u) != 0;
#else
  return std::nullopt;
#endif
}

PERF_INLINE std::string reduction_name(at::CuBLASReductionOption o) {
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

PERF_INLINE void set_reduction(bool fp16, at::CuBLASReductionOption o) {
  const bool allow = o == at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
  const bool splitk = o != at::CuBLASReductionOption::DisallowReducedPrecisionDisallowSplitK;
  if (fp16) {
    at::globalContext().setAllowFP16ReductionCuBLAS(allow, splitk);
  } else {
    at::globalContext().setAllowBF16ReductionCuBLAS(allow, splitk);
  }
}

PERF_INLINE std::string number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

PERF_INLINE std::string malloc_cache_unavailable() {
#if !defined(__GLIBC__)
  return "needs glibc's malloc (this C library has no mallopt thresholds)";
#elif defined(PERF_DETAIL_OWN_MALLOC)
  return "a sanitizer replaces malloc in this build";
#else
  const char* preload = std::getenv("LD_PRELOAD");
  if (preload != nullptr && std::string(preload).find("malloc") != std::string::npos)
    return std::string("LD_PRELOAD=") + preload + " replaces malloc";
  return "";
#endif
}

PERF_INLINE std::string malloc_tuned_by_environment() {
  for (const char* v : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"})
    if (std::getenv(v) != nullptr) return v;
  if (const char* t = std::getenv("GLIBC_TUNABLES")) {
    const std::string tunables(t);
    for (const char* key : {"malloc.mmap_", "malloc.trim_threshold", "malloc.top_pad"})
      if (tunables.find(key) != std::string::npos) return "GLIBC_TUNABLES";
  }
  return "";
}

PERF_INLINE std::atomic<bool>& malloc_cache_on() {
  static std::atomic<bool> on{false};
  return on;
}

PERF_INLINE Plan make_plan(const Settings& s) {
  Plan p{s};
  const int n = cuda_device_count();
  p.cuda = n > 0;
  if (s.memory_fraction_device()) {
    const int d = *s.memory_fraction_device();
    TORCH_CHECK(d >= 0 && (!p.cuda || d < n), "perf::Settings::memory_fraction_device: no CUDA device ", d,
                "; valid values: 0..", std::max(n - 1, 0), " (", n, " visible)");
  }
#if PERF_WITH_CUDA
  if (p.cuda) p.device = s.memory_fraction_device().value_or(static_cast<int>(c10::cuda::current_device()));
#endif
  p.cc = compute_capability(p.device);
  auto& ctx = at::globalContext();
  p.det_before = ctx.deterministicAlgorithms() || ctx.deterministicCuDNN();
  return p;
}

PERF_INLINE std::optional<std::string> opt_text(const std::optional<bool>& b) {
  return b ? std::optional<std::string>(bool_str(*b)) : std::nullopt;
}

PERF_INLINE std::optional<std::string> opt_text(const std::optional<int>& i) {
  return i ? std::optional<std::string>(std::to_string(*i)) : std::nullopt;
}

PERF_INLINE std::string resolved_matmul_precision(const Settings& s) {
  return s.matmul_precision().value_or(s.tf32() ? "high" : "highest");
}

// cudnn_benchmark as setup() leaves it: as set; off for deterministic(true); as the program left it where the
// default yields to determinism it turned on earlier; on otherwise.
PERF_INLINE bool cudnn_benchmark_after(const Plan& p) {
  if (p.s.cudnn_benchmark()) return *p.s.cudnn_benchmark();
  if (p.s.deterministic().value_or(false)) return false;
  return p.determinism() ? at::globalContext().benchmarkCuDNN() : true;
}

PERF_INLINE std::string tf32_note(const Plan& p) {
  return p.cc > 0 && p.cc < 80 ? "no effect on sm_" + std::to_string(p.cc) + " (TF32 needs sm_80+)" : "";
}

PERF_INLINE bool valid_cublas_workspace(const char* v) {
  return v != nullptr && (std::string(v) == ":4096:8" || std::string(v) == ":16:8");
}

PERF_INLINE int64_t cuda_reserved_bytes() {
  int64_t total = 0;
#if PERF_WITH_CUDA
  if (cuda_device_count() > 0) init_cuda();
  for (int d = 0; d < cuda_device_count(); ++d) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(d));
    total += stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
#endif
  return total;
}

PERF_INLINE Restore save_allocator() {
  const std::string conf = c10::CachingAllocator::getAllocatorSettings();
  const bool expandable = c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
  return [conf, expandable] {
    c10::CachingAllocator::setAllocatorSettings(std::string("expandable_segments:") + (expandable ? "True" : "False"));
    c10::CachingAllocator::setAllocatorSettings(conf);
  };
}

PERF_INLINE void parse_allocator(const std::string& conf) {
  try {
    c10::CachingAllocator::setAllocatorSettings(conf);
  } catch (const c10::Error& e) {
    const bool backend = conf.find("backend") != std::string::npos;
    TORCH_CHECK(false, "perf::Settings::allocator: LibTorch ", TORCH_VERSION, " rejected \"", conf,
                "\": ", e.what_without_backtrace(), ". Expected \"key:value[,key:value...]\" with the keys of ",
                "PYTORCH_ALLOC_CONF (e.g. expandable_segments:True, max_split_size_mb:128)",
                backend ? "; the allocator backend is chosen when CUDA starts: set PYTORCH_ALLOC_CONF=backend:... in "
                          "the environment before the program starts instead"
                        : "");
  }
}

PERF_INLINE Restore save_fp32(bool matmul, std::pair<at::Float32Backend, at::Float32Op> a,
                              std::pair<at::Float32Backend, at::Float32Op> b) {
  const auto legacy_matmul = legacy_matmul_precision();
  const auto legacy_cudnn = legacy_cudnn_tf32();
  const auto pa = fp32(a.first, a.second), pb = fp32(b.first, b.second);
  return [matmul, legacy_matmul, legacy_cudnn, a, b, pa, pb] {
    auto& ctx = at::globalContext();
    if (matmul && legacy_matmul) ctx.setFloat32MatmulPrecision(matmul_precision_name(*legacy_matmul));
    if (!matmul && legacy_cudnn) ctx.setAllowTF32CuDNN(*legacy_cudnn);
    ctx.setFloat32Precision(a.first, a.second, pa);
    ctx.setFloat32Precision(b.first, b.second, pb);
  };
}

PERF_INLINE Restore save_bool(bool (at::Context::*get)() const, void (at::Context::*set)(bool)) {
  auto& ctx = at::globalContext();
  const bool v = (ctx.*get)();
  return [&ctx, set, v] { (ctx.*set)(v); };
}

PERF_INLINE void validate_sdpa(const Settings& s) {
  auto& ctx = at::globalContext();
  const bool any = s.sdpa_flash().value_or(ctx.userEnabledFlashSDP()) ||
                   s.sdpa_mem_efficient().value_or(ctx.userEnabledMemEfficientSDP()) ||
                   s.sdpa_math().value_or(ctx.userEnabledMathSDP()) ||
                   s.sdpa_cudnn().value_or(ctx.userEnabledCuDNNSDP());
  TORCH_CHECK(any,
              "perf::Settings::sdpa_*: at least one of sdpa_flash, sdpa_mem_efficient, sdpa_math, sdpa_cudnn must "
              "stay enabled, or scaled_dot_product_attention has no kernel");
}

PERF_INLINE const std::vector<Entry>& entries() {
  using B = at::Float32Backend;
  using O = at::Float32Op;
  static const std::vector<Entry> table = {
      {"tf32", true, nullptr, false, nullptr,
       [](const Plan& p) {
         return Request{bool_str(p.s.tf32()), "", tf32_note(p)};
       },
       [](const Plan& p) {
         at::globalContext().setAllowTF32CuDNN(p.s.tf32());
         return std::string();
       },
       [](const Plan&) {
         const auto conv = fp32(B::CUDA, O::CONV), rnn = fp32(B::CUDA, O::RNN);
         return conv == rnn ? bool_str(conv == at::Float32Precision::TF32)
                            : "conv=" + precision_name(conv) + " rnn=" + precision_name(rnn);
       },
       [](const Plan&) {
         return save_fp32(false, {B::CUDA, O::CONV}, {B::CUDA, O::RNN});
       }},

      {"matmul_precision", false, nullptr, false,
       [](const Settings& s) {
         if (!s.matmul_precision()) return;
         const auto& v = *s.matmul_precision();
         TORCH_CHECK(v == "highest" || v == "high" || v == "medium",
                     "perf::Settings::matmul_precision: invalid value \"", v,
                     "\"; valid values: \"highest\", \"high\", \"medium\"");
       },
       [](const Plan& p) {
         const auto note = tf32_note(p);
         return Request{resolved_matmul_precision(p.s), "",
                        p.s.matmul_precision() ? note : (note.empty() ? "from tf32" : "from tf32; " + note)};
       },
       [](const Plan& p) {
         // The legacy setter keeps the legacy and per-backend views consistent.
         at::globalContext().setFloat32MatmulPrecision(resolved_matmul_precision(p.s));
         return std::string();
       },
       [](const Plan&) {
         if (const auto legacy = legacy_matmul_precision()) return matmul_precision_name(*legacy);
         return "inconsistent (cuda.matmul=" + precision_name(fp32(B::CUDA, O::MATMUL)) +
                " mkldnn.matmul=" + precision_name(fp32(B::MKLDNN, O::MATMUL)) + ")";
       },
       [](const Plan&) {
         return save_fp32(true, {B::CUDA, O::MATMUL}, {B::MKLDNN, O::MATMUL});
       }},

      {"cudnn_benchmark", true, nullptr, false, nullptr,
       [](const Plan& p) {
         const auto& s = p.s;
         if (s.cudnn_benchmark()) {
           return Request{bool_str(*s.cudnn_benchmark()), "",
                          *s.cudnn_benchmark() && p.determinism()
                              ? "explicit: with deterministic algorithms cuDNN picks among deterministic ones, but "
                                "the pick may differ between runs"
                              : ""};
         }
         if (s.deterministic().value_or(false)) return Request{"false", "", "off because deterministic(true)"};
         if (p.determinism()) {
           return Request{"true",
                          "yields: deterministic algorithms are on (set earlier by the program); "
                          "cudnn_benchmark(true) overrides",
                          ""};
         }
         return Request{"true", "", ""};
       },
       [](const Plan& p) {
         at::globalContext().setBenchmarkCuDNN(cudnn_benchmark_after(p));
         return std::string();
       },
       [](const Plan&) { return bool_str(at::globalContext().benchmarkCuDNN()); },
       [](const Plan&) { return save_bool(&at::Context::benchmarkCuDNN, &at::Context::setBenchmarkCuDNN); }},

      {"cudnn_benchmark_limit", true, nullptr, false,
       [](const Settings& s) {
         if (s.cudnn_benchmark_limit()) {
           TORCH_CHECK(*s.cudnn_benchmark_limit() >= 0,
                       "perf::Settings::cudnn_benchmark_limit: must be >= 0 (0 times every algorithm cuDNN offers), "
                       "got ",
                       *s.cudnn_benchmark_limit());
         }
       },
       [](const Plan& p) {
         return Request{opt_text(p.s.cudnn_benchmark_limit()), "",
                        cudnn_benchmark_after(p) ? "" : "no effect while cudnn_benchmark is off"};
       },
       [](const Plan& p) {
         at::globalContext().setBenchmarkLimitCuDNN(*p.s.cudnn_benchmark_limit());
         return std::string();
       },
       [](const Plan&) { return std::to_string(at::globalContext().benchmarkLimitCuDNN()); },
       [](const Plan&) -> Restore {
         const int n = at::globalContext().benchmarkLimitCuDNN();
         return [n] { at::globalContext().setBenchmarkLimitCuDNN(n); };
       }},

      {"deterministic", false, nullptr, false, nullptr,
       [](const Plan& p) {
         return Request{opt_text(p.s.deterministic()), "", ""};
       },
       [](const Plan& p) {
         auto& ctx = at::globalContext();
         ctx.setDeterministicCuDNN(*p.s.deterministic());
         ctx.setDeterministicAlgorithms(*p.s.deterministic(), /*warn_only=*/false);
         return std::string();
       },
       [](const Plan&) {
         auto& ctx = at::globalContext();
         const bool da = ctx.deterministicAlgorithms(), dc = ctx.deterministicCuDNN();
         return da == dc ? bool_str(da) : "algorithms=" + bool_str(da) + " cudnn=" + bool_str(dc);
       },
       [](const Plan&) -> Restore {
         auto& ctx = at::globalContext();
         const bool dc = ctx.deterministicCuDNN(), da = ctx.deterministicAlgorithms(),
                    warn = ctx.deterministicAlgorithmsWarnOnly();
         return [&ctx, dc, da, warn] {
           ctx.setDeterministicCuDNN(dc);
           ctx.setDeterministicAlgorithms(da, warn);
         };
       }},

      // Read only: cuBLAS reads it when it starts, so only the environment the
      // program starts with counts (see Settings::deterministic).
      {"cublas_workspace_config", true, nullptr, false, nullptr,
       [](const Plan& p) {
         if (!p.determinism()) return Request{};
         const char* v = std::getenv("CUBLAS_WORKSPACE_CONFIG");
         if (valid_cublas_workspace(v)) return Request{std::string(v), "", "set in the environment"};
         return Request{":4096:8",
                        (v ? "\"" + std::string(v) + "\" is not deterministic" : std::string("not set")) +
                            ": not effective; deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) "
                            "in the environment before the program starts (perf does not call setenv)",
                        ""};
       },
       [](const Plan&) { return std::string(); },
       [](const Plan&) {
         const char* v = std::getenv("CUBLAS_WORKSPACE_CONFIG");
         return std::string(v ? v : "(unset)");
       },
       nullptr},

      {"fp16_reduced_precision_reduction", true, nullptr, false, nullptr,
       [](const Plan& p) {
         return Request{opt_text(p.s.fp16_reduced_precision_reduction()), "", ""};
       },
       [](const Plan& p) {
         at::globalContext().setAllowFP16ReductionCuBLAS(*p.s.fp16_reduced_precision_reduction());
         return std::string();
       },
       [](const Plan&) { return reduction_name(at::globalContext().allowFP16ReductionCuBLAS()); },
       [](const Plan&) -> Restore {
         const auto o = at::globalContext().allowFP16ReductionCuBLAS();
         return [o] { set_reduction(true, o); };
       }},

      {"bf16_reduced_precision_reduction", true, nullptr, false, nullptr,
       [](const Plan& p) {
         return Request{opt_text(p.s.bf16_reduced_precision_reduction()), "", ""};
       },
       [](const Plan& p) {
         at::globalContext().setAllowBF16ReductionCuBLAS(*p.s.bf16_reduced_precision_reduction());
         return std::string();
       },
       [](const Plan&) { return reduction_name(at::globalContext().allowBF16ReductionCuBLAS()); },
       [](const Plan&) -> Restore {
         const auto o = at::globalContext().allowBF16ReductionCuBLAS();
         return [o] { set_reduction(false, o); };
       }},

      context_bool<&Settings::sdpa_flash, &at::Context::userEnabledFlashSDP, &at::Context::setSDPUseFlash>("sdpa_flash",
                                                                                                           false),
      context_bool<&Settings::sdpa_mem_efficient, &at::Context::userEnabledMemEfficientSDP,
                   &at::Context::setSDPUseMemEfficient>("sdpa_mem_efficient", false),
      context_bool<&Settings::sdpa_math, &at::Context::userEnabledMathSDP, &at::Context::setSDPUseMath>("sdpa_math",
                                                                                                        false),
      context_bool<&Settings::sdpa_cudnn, &at::Context::userEnabledCuDNNSDP, &at::Context::setSDPUseCuDNN>(
          "sdpa_cudnn", false, validate_sdpa),

      // LibTorch's parser is the validator: a trial parse, then the previous
      // settings back, on every machine (so a bad string fails on a laptop too).
      {"allocator", true,
       "allocator settings shape memory already reserved and cannot be restored; set them with "
       "perf::setup()",
       true,
       [](const Settings& s) {
         if (!s.allocator()) return;
         const auto restore = save_allocator();
         try {
           parse_allocator(*s.allocator());
         } catch (...) {
           restore();
           throw;
         }
         restore();
       },
       [](const Plan& p) {
         return Request{p.s.allocator(), "", ""};
       },
       [](const Plan& p) {
         const int64_t reserved = cuda_reserved_bytes();
         parse_allocator(*p.s.allocator());
         if (reserved == 0) return std::string("before the first CUDA allocation: full effect");
         return "too late for full effect: " + std::to_string(reserved >> 20) +
                " MiB already reserved; only new segments follow it. Set it before the first CUDA allocation (or "
                "PYTORCH_ALLOC_CONF)";
       },
       [](const Plan&) {
         const auto conf = c10::CachingAllocator::getAllocatorSettings();
         return conf.empty() ? std::string("(default)") : conf;
       },
       [](const Plan&) { return save_allocator(); }},

      {"memory_fraction", true, nullptr, false,
       [](const Settings& s) {
         if (!s.memory_fraction()) return;
         const double f = *s.memory_fraction();
         TORCH_CHECK(f > 0.0 && f <= 1.0, "perf::Settings::memory_fraction: must be in (0, 1], got ", f);
       },
       [](const Plan& p) {
         if (!p.s.memory_fraction()) return Request{};
         return Request{number(*p.s.memory_fraction()), "", "cuda:" + std::to_string(p.device)};
       },
       []([[maybe_unused]] const Plan& p) {
#if PERF_WITH_CUDA
         init_cuda();
         c10::cuda::CUDACachingAllocator::setMemoryFraction(*p.s.memory_fraction(),
                                                            static_cast<c10::DeviceIndex>(p.device));
#endif
         return std::string();
       },
       []([[maybe_unused]] const Plan& p) {
#if PERF_WITH_CUDA
         if (p.device >= 0) {
           init_cuda();
           return number(c10::cuda::CUDACachingAllocator::getMemoryFraction(static_cast<c10::DeviceIndex>(p.device)));
         }
#endif
         return std::string("n/a");
       },
       []([[maybe_unused]] const Plan& p) -> Restore {
#if PERF_WITH_CUDA
         if (p.device >= 0) {
           init_cuda();
           const auto d = static_cast<c10::DeviceIndex>(p.device);
           const double f = c10::cuda::CUDACachingAllocator::getMemoryFraction(d);
           return [d, f] { c10::cuda::CUDACachingAllocator::setMemoryFraction(f, d); };
         }
#endif
         return nullptr;
       }},

      {"sync_debug", true, nullptr, false,
       [](const Settings& s) {
         if (!s.sync_debug()) return;
         const auto& m = *s.sync_debug();
         TORCH_CHECK(m == "off" || m == "warn" || m == "error", "perf::Settings::sync_debug: invalid value \"", m,
                     "\"; valid values: \"off\", \"warn\", \"error\"");
       },
       [](const Plan& p) {
         return Request{p.s.sync_debug(), "", ""};
       },
       []([[maybe_unused]] const Plan& p) {
#if PERF_WITH_CUDA
         const auto& m = *p.s.sync_debug();
         c10::cuda::warning_state().set_sync_debug_mode(m == "off"    ? c10::cuda::SyncDebugMode::L_DISABLED
                                                        : m == "warn" ? c10::cuda::SyncDebugMode::L_WARN
                                                                      : c10::cuda::SyncDebugMode::L_ERROR);
#endif
         return std::string();
       },
       [](const Plan&) {
#if PERF_WITH_CUDA
         const auto mode = c10::cuda::warning_state().get_sync_debug_mode();
         return std::string(mode == c10::cuda::SyncDebugMode::L_DISABLED ? "off"
                            : mode == c10::cuda::SyncDebugMode::L_WARN   ? "warn"
                                                                         : "error");
#else
         return std::string("n/a");
#endif
       },
       [](const Plan&) -> Restore {
#if PERF_WITH_CUDA
         const auto mode = c10::cuda::warning_state().get_sync_debug_mode();
         return [mode] { c10::cuda::warning_state().set_sync_debug_mode(mode); };
#else
         return nullptr;
#endif
       }},

      {"num_threads", false, nullptr, false,
       [](const Settings& s) {
         if (s.num_threads()) {
           TORCH_CHECK(*s.num_threads() >= 1, "perf::Settings::num_threads: must be >= 1, got ", *s.num_threads());
         }
       },
       [](const Plan& p) {
         return Request{opt_text(p.s.num_threads()), "", ""};
       },
       [](const Plan& p) {
         if (at::get_num_threads() != *p.s.num_threads()) at::set_num_threads(*p.s.num_threads());
         return std::string();
       },
       [](const Plan&) { return std::to_string(at::get_num_threads()); },
       [](const Plan&) -> Restore {
         const int n = at::get_num_threads();
         return [n] {
           if (at::get_num_threads() != n) at::set_num_threads(n);
         };
       }},

      {"num_interop_threads", false,
       "num_interop_threads can be set once per process and cannot be restored; set it with perf::setup()", true,
       [](const Settings& s) {
         if (s.num_interop_threads()) {
           TORCH_CHECK(*s.num_interop_threads() >= 1, "perf::Settings::num_interop_threads: must be >= 1, got ",
                       *s.num_interop_threads());
         }
       },
       [](const Plan& p) {
         return Request{opt_text(p.s.num_interop_threads()), "", ""};
       },
       [](const Plan& p) {
         const int n = *p.s.num_interop_threads();
         if (static_cast<int64_t>(at::get_num_interop_threads()) == n) return std::string();
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
         return std::string();
       },
       [](const Plan&) { return std::to_string(at::get_num_interop_threads()); }, nullptr},

      {"flush_denormal", false, nullptr, false, nullptr,
       [](const Plan& p) {
         if (!p.s.flush_denormal()) return Request{};
         return Request{bool_str(*p.s.flush_denormal()), flush_denormal_state() ? "" : "needs x86-64 FTZ/DAZ",
                        "calling thread only"};
       },
       [](const Plan& p) {
         return at::globalContext().setFlushDenormal(*p.s.flush_denormal())
                    ? std::string()
                    : std::string("CPU does not support FTZ/DAZ");
       },
       [](const Plan&) {
         const auto fd = flush_denormal_state();
         return fd ? bool_str(*fd) : std::string("n/a (not x86-64)");
       },
       [](const Plan&) -> Restore {
         const auto fd = flush_denormal_state();
         return [fd] {
           if (fd && flush_denormal_state() != fd) at::globalContext().setFlushDenormal(*fd);
         };
       }},

      // glibc returns a freed block of 128 KiB or more to the kernel (munmap,
      // or a heap trim), so every training step faults in zeroed pages for its
      // tensors again: kept, bench/e2e's CPU CNN step ran 1.36x faster compiled
      // and 1.03x eager (docs/benchmarks.md). glibc's largest mmap threshold is
      // HEAP_MAX_SIZE / 2 (32 MiB on 64-bit: halved until accepted elsewhere).
      {"cpu_malloc_cache", false,
       "cpu_malloc_cache changes how glibc's malloc keeps memory for the rest of the process and cannot be "
       "restored; set it with perf::setup()",
       false, nullptr,
       [](const Plan& p) {
         const auto& want = p.s.cpu_malloc_cache();
         if (!want && p.scoped) return Request{};
         Request r{bool_str(want.value_or(true)), malloc_cache_unavailable(), ""};
         if (!want && r.skip.empty()) {
           const auto env = malloc_tuned_by_environment();
           if (!env.empty()) r.skip = env + " tunes malloc already (cpu_malloc_cache(true) overrides it)";
         }
         return r;
       },
       []([[maybe_unused]] const Plan& p) {
         std::string note;
#if defined(__GLIBC__)
         const bool on = p.s.cpu_malloc_cache().value_or(true);
         if (on && malloc_cache_on()) return note;  // applied by an earlier setup()
         if (on) {
           int threshold = 32 << 20;
           while (threshold > (1 << 20) && mallopt(M_MMAP_THRESHOLD, threshold) != 1) threshold /= 2;
           mallopt(M_TRIM_THRESHOLD, -1);  // -1: never trim (mallopt(3))
           note = "blocks up to " + std::to_string(threshold >> 20) +
                  " MiB reused, heap never trimmed: freed CPU memory stays in the process (RSS keeps its peak)";
         } else if (malloc_cache_on()) {
           mallopt(M_MMAP_THRESHOLD, 128 * 1024);
           mallopt(M_TRIM_THRESHOLD, 128 * 1024);
           malloc_trim(0);  // what the cache holds goes back to the kernel now
           note =
               "glibc's initial thresholds back (fixed: its dynamic mmap threshold does not return); the memory "
               "kept so far returned";
         }
         malloc_cache_on() = on;
#endif
         return note;
       },
       [](const Plan&) {
         return malloc_cache_unavailable().empty() ? bool_str(malloc_cache_on()) : std::string("n/a");
       },
       nullptr},
  };
  return table;
}

PERF_INLINE void validate(const Settings& s) {
  for (const auto& e : entries())
    if (e.validate) e.validate(s);
}

PERF_INLINE std::vector<std::string> read_values(const Plan& p) {
  std::vector<std::string> v;
  for (const auto& e : entries()) v.push_back(e.read(p));
  return v;
}

PERF_INLINE std::vector<std::pair<std::string, std::string>> read_flags() {
  const Settings s;
  const auto values = read_values(make_plan(s));
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(values.size());
  for (size_t i = 0; i < values.size(); ++i) out.emplace_back(entries()[i].name, values[i]);
  return out;
}

PERF_INLINE Request request(const Entry& e, const Plan& p) {
  Request r = e.request(p);
  if (r.value && e.cuda_only && !p.cuda) r.skip = no_cuda_reason();
  return r;
}

PERF_INLINE bool wanted(const Request& r) { return r.value && r.skip.empty(); }

PERF_INLINE void apply(const Plan& p, std::vector<Request>& req) {
  const auto& table = entries();
  std::vector<Restore> undo;
  try {
    for (size_t i = 0; i < table.size(); ++i) {
      if (!table[i].fallible || !wanted(req[i])) continue;
      Restore restore = table[i].save ? table[i].save(p) : nullptr;
      if (auto note = table[i].apply(p); !note.empty()) req[i].note = std::move(note);
      if (restore) undo.push_back(std::move(restore));
    }
  } catch (...) {
    for (auto it = undo.rbegin(); it != undo.rend(); ++it) (*it)();
    throw;
  }
  for (size_t i = 0; i < table.size(); ++i) {
    if (table[i].fallible || !wanted(req[i])) continue;
    if (auto note = table[i].apply(p); !note.empty()) req[i].note = std::move(note);
  }
}

PERF_INLINE Report make_report(const std::vector<Request>& req, const std::vector<std::string>& before,
                               const std::vector<std::string>& after, const std::string& disabled) {
  Report rep;
  rep.disabled = !disabled.empty();
  rep.cpu_autocast = cpu_bf16().autocast_choice();
  const auto& table = entries();
  for (size_t i = 0; i < table.size(); ++i) {
    const Request& r = req[i];
    ReportRow row{table[i].name, r.value.value_or("-"), after[i], Status::unchanged, ""};
    if (!disabled.empty()) {
      row.status = Status::skipped;
      row.reason = disabled;
    } else if (!r.value) {
      row.reason = "not requested";
    } else if (!r.skip.empty()) {
      row.status = Status::skipped;
      row.reason = r.skip;
    } else {
      row.status = before[i] == after[i] ? Status::unchanged : Status::applied;
      row.reason = r.note;
    }
    rep.rows.push_back(std::move(row));
  }
  return rep;
}

PERF_INLINE Report setup_locked(const Plan& p) {
  std::vector<Request> req;
  for (const auto& e : entries()) req.push_back(request(e, p));
  const auto before = read_values(p);
  if (env_flag("PERF_DISABLE")) return make_report(req, before, before, "PERF_DISABLE=1");
  apply(p, req);
  return make_report(req, before, read_values(p), "");
}

PERF_INLINE void maybe_print(const Report& r) {
  if (env_flag("PERF_VERBOSE")) std::cerr << r.to_string(true);
}

PERF_INLINE std::string pad(const std::string& s, size_t w) {
  return s.size() >= w ? s : s + std::string(w - s.size(), ' ');
}

}  // namespace detail

PERF_INLINE const ReportRow& Report::at(const std::string& setting) const {
  const auto it = std::find_if(rows.begin(), rows.end(), [&](const ReportRow& r) { return r.setting == setting; });
  TORCH_CHECK(it != rows.end(), "perf::Report::at: no row named \"", setting, "\"");
  return *it;
}

PERF_INLINE std::string Report::to_string(bool all) const {
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
  if (!cpu_autocast.empty()) os << "CPU autocast default: " << cpu_autocast << "\n";
  return os.str();
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const Report& r) { return os << r.to_string(); }

PERF_INLINE Report setup(const Settings& settings) {
  Report r;
  {
    std::lock_guard<std::mutex> lock(detail::settings_mutex());
    detail::validate(settings);
    r = detail::setup_locked(detail::make_plan(settings));
  }
  detail::maybe_print(r);
  return r;
}

PERF_INLINE ScopedSettings::ScopedSettings(const Settings& settings) {
  std::lock_guard<std::mutex> lock(detail::settings_mutex());
  auto p = detail::make_plan(settings);
  p.scoped = true;
  for (const auto& e : detail::entries()) {
    TORCH_CHECK(!e.one_way || !e.request(p).value, "perf::ScopedSettings: ", e.one_way);
  }
  detail::validate(settings);
  for (const auto& e : detail::entries())
    if (e.save && !e.one_way)
      if (auto r = e.save(p)) restore_.push_back(std::move(r));
  report_ = detail::setup_locked(p);
  detail::maybe_print(report_);
}

PERF_INLINE ScopedSettings::~ScopedSettings() {
  std::lock_guard<std::mutex> lock(detail::settings_mutex());
  for (auto it = restore_.rbegin(); it != restore_.rend(); ++it) (*it)();
}

}  // namespace perf
