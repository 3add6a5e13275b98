// Tests for perf/setup.h: every setting is read back from LibTorch itself.
#include <ATen/ATen.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <perf/environment.h>
#include <perf/memory.h>
#include <perf/setup.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <thread>

#include "sanitizers/hides_cuda.h"
#include "test_util.h"

namespace {

using B = at::Float32Backend;
using O = at::Float32Op;
using P = at::Float32Precision;

std::map<std::string, std::string> flags() {
  auto v = perf::detail::read_flags();
  return {v.begin(), v.end()};
}

// Every per-backend fp32 precision entry, as LibTorch's new API reads it.
std::vector<P> fp32_entries() {
  std::vector<P> out;
  for (auto b : {B::GENERIC, B::CUDA, B::MKLDNN})
    for (auto op : {O::ALL, O::CONV, O::RNN, O::MATMUL})
      if (b != B::GENERIC || op == O::ALL) out.push_back(at::globalContext().float32Precision(b, op));
  return out;
}

using test_util::perf_has_cuda;

// LibTorch's settings are process-wide, and these tests change them: each one
// starts with this guard, which puts back every value setup() may change (all
// but the two one-way settings), so that the suite passes in any order in one
// process (--gtest_shuffle), not only one test per process as ctest runs it.
class KeepSettings {
 public:
  KeepSettings() {
    const perf::Settings none;
    const auto plan = perf::detail::make_plan(none);
    for (const auto& e : perf::detail::entries())
      if (e.save && !e.one_way)
        if (auto r = e.save(plan)) restore_.push_back(std::move(r));
  }
  ~KeepSettings() {
    for (auto it = restore_.rbegin(); it != restore_.rend(); ++it) (*it)();
  }
  KeepSettings(const KeepSettings&) = delete;
  KeepSettings& operator=(const KeepSettings&) = delete;

 private:
  std::vector<perf::detail::Restore> restore_;
};

}  // namespace

TEST(Setup, DefaultsAreTheFastSettings) {
  const KeepSettings keep;
  auto& ctx = at::globalContext();
  const bool bench_before = ctx.benchmarkCuDNN();
  const perf::Report r = perf::setup();
  // Both TF32 views agree: legacy getter, per-backend getter, cuBLAS getter.
  EXPECT_EQ(ctx.float32MatmulPrecision(), at::Float32MatmulPrecision::HIGH);
  EXPECT_EQ(ctx.float32Precision(B::CUDA, O::MATMUL), P::TF32);
  EXPECT_TRUE(ctx.allowTF32CuBLAS());
  EXPECT_FALSE(ctx.deterministicAlgorithms());
  EXPECT_FALSE(ctx.deterministicCuDNN());
  EXPECT_EQ(r.at("matmul_precision").requested, "high");
  EXPECT_EQ(r.at("matmul_precision").read_back, "high");
  EXPECT_EQ(r.at("tf32").requested, "true");
  EXPECT_EQ(r.at("cudnn_benchmark").requested, "true");
  EXPECT_EQ(r.at("deterministic").read_back, "false");
  if (perf_has_cuda()) {
    EXPECT_TRUE(ctx.benchmarkCuDNN());
    EXPECT_TRUE(ctx.allowTF32CuDNN());
    EXPECT_EQ(ctx.float32Precision(B::CUDA, O::CONV), P::TF32);
    EXPECT_NE(r.at("cudnn_benchmark").status, perf::Status::skipped);
  } else {
    EXPECT_EQ(ctx.benchmarkCuDNN(), bench_before) << "a skipped setting must stay untouched";
    EXPECT_EQ(r.at("cudnn_benchmark").status, perf::Status::skipped);
  }
  EXPECT_FALSE(r.disabled);
}

TEST(Setup, ReportReadsBackWhatLibTorchSays) {
  const KeepSettings keep;
  const perf::Report r = perf::setup(perf::Settings().num_threads(1).sdpa_math(false).matmul_precision("medium"));
  const auto now = flags();
  for (const auto& row : r.rows) {
    ASSERT_TRUE(now.count(row.setting)) << row.setting;
    EXPECT_EQ(row.read_back, now.at(row.setting)) << row.setting;
    if (row.status == perf::Status::applied) {
      EXPECT_EQ(row.read_back, row.requested) << row.setting;
    }
  }
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_FALSE(at::globalContext().userEnabledMathSDP());
  EXPECT_EQ(at::globalContext().float32MatmulPrecision(), at::Float32MatmulPrecision::MEDIUM);
  EXPECT_EQ(at::globalContext().float32Precision(B::MKLDNN, O::MATMUL), P::BF16);
  EXPECT_EQ(r.at("sdpa_math").status, perf::Status::applied);
  EXPECT_EQ(r.at("sdpa_flash").requested, "-");
  EXPECT_EQ(r.at("sdpa_flash").reason, "not requested");
}

TEST(Setup, ExplicitCpuSettingsApply) {
  const KeepSettings keep;
  auto& ctx = at::globalContext();
  perf::setup(perf::Settings()
                  .tf32(false)
                  .deterministic(true)
                  .num_threads(2)
                  .flush_denormal(true)
                  .sdpa_flash(false)
                  .sdpa_mem_efficient(false)
                  .sdpa_cudnn(false)
                  .sdpa_math(true));
  EXPECT_EQ(ctx.float32MatmulPrecision(), at::Float32MatmulPrecision::HIGHEST);
  EXPECT_FALSE(ctx.allowTF32CuBLAS());
  EXPECT_TRUE(ctx.deterministicAlgorithms());
  EXPECT_FALSE(ctx.deterministicAlgorithmsWarnOnly());
  EXPECT_TRUE(ctx.deterministicCuDNN());
  EXPECT_FALSE(ctx.benchmarkCuDNN());
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_FALSE(ctx.userEnabledFlashSDP());
  EXPECT_FALSE(ctx.userEnabledMemEfficientSDP());
  EXPECT_FALSE(ctx.userEnabledCuDNNSDP());
  EXPECT_TRUE(ctx.userEnabledMathSDP());
  if (auto fd = perf::detail::flush_denormal_state()) {
    EXPECT_TRUE(*fd);
    // FTZ/DAZ really flush: the smallest denormal becomes zero.
    volatile float tiny = 1e-40f;
    EXPECT_EQ(tiny * 1.0f, 0.0f);
  }
  perf::setup(perf::Settings().flush_denormal(false).deterministic(false));
  if (auto fd = perf::detail::flush_denormal_state()) {
    EXPECT_FALSE(*fd);
  }
  EXPECT_FALSE(ctx.deterministicAlgorithms());
}

TEST(Setup, DeterministicTurnsBenchmarkOffAndSaysWhy) {
  const KeepSettings keep;
  const char* ws = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  const std::optional<std::string> ws_before = ws ? std::optional<std::string>(ws) : std::nullopt;
  const auto r = perf::setup(perf::Settings().deterministic(true));
  EXPECT_EQ(r.at("cudnn_benchmark").requested, "false");
  // perf never writes the environment: another thread may be reading it.
  const char* ws_after = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  EXPECT_EQ(ws_before.has_value(), ws_after != nullptr);
  if (ws_before && ws_after) {
    EXPECT_EQ(*ws_before, ws_after);
  }
  const auto& cublas = r.at("cublas_workspace_config");
  if (!perf_has_cuda()) {
    EXPECT_EQ(cublas.status, perf::Status::skipped);
    EXPECT_NE(cublas.reason.find("no CUDA device"), std::string::npos);
  } else if (!perf::detail::valid_cublas_workspace(ws_after)) {
    EXPECT_EQ(r.at("cudnn_benchmark").reason, "off because deterministic(true)");
    EXPECT_EQ(cublas.status, perf::Status::skipped);
    EXPECT_NE(cublas.reason.find("not effective"), std::string::npos) << cublas.reason;
    EXPECT_NE(cublas.reason.find("before the program starts"), std::string::npos) << cublas.reason;
  } else {
    EXPECT_EQ(cublas.reason, "set in the environment");
  }
  perf::setup(perf::Settings().deterministic(false));
}

// A setting the caller did not set never undoes the program's earlier choice.
TEST(Setup, DefaultsNeverUndoDeterminism) {
  const KeepSettings keep;
  auto& ctx = at::globalContext();
  ctx.setDeterministicAlgorithms(true, /*warn_only=*/false);
  ctx.setDeterministicCuDNN(true);
  ctx.setBenchmarkCuDNN(false);
  const auto r = perf::setup(perf::Settings().num_threads(1));
  EXPECT_TRUE(ctx.deterministicAlgorithms()) << "setup() without deterministic() must leave it on";
  EXPECT_TRUE(ctx.deterministicCuDNN());
  EXPECT_FALSE(ctx.benchmarkCuDNN()) << "the cudnn_benchmark default yields to determinism";
  EXPECT_EQ(r.at("deterministic").requested, "-");
  EXPECT_EQ(r.at("deterministic").read_back, "true");
  const auto& bench = r.at("cudnn_benchmark");
  EXPECT_EQ(bench.status, perf::Status::skipped);
  if (perf_has_cuda()) {
    EXPECT_NE(bench.reason.find("yields: deterministic algorithms are on"), std::string::npos) << bench.reason;
  }
  // The same decision where there is no CUDA device to hide it behind.
  const perf::Settings defaults;
  auto plan = perf::detail::make_plan(defaults);
  ASSERT_TRUE(plan.det_before);
  const auto& table = perf::detail::entries();
  const auto entry = std::find_if(table.begin(), table.end(), [](const perf::detail::Entry& e) {
    return std::string(e.name) == "cudnn_benchmark";
  });
  ASSERT_NE(entry, table.end());
  EXPECT_NE(entry->request(plan).skip.find("yields"), std::string::npos);
  const auto explicit_on = perf::Settings().cudnn_benchmark(true);
  const auto on = entry->request(perf::detail::make_plan(explicit_on));
  EXPECT_TRUE(on.skip.empty()) << "an explicit cudnn_benchmark(true) is honoured";
  EXPECT_NE(on.note.find("may differ between runs"), std::string::npos) << on.note;
  // deterministic(false), set explicitly, turns it off and the fast default returns.
  const auto off = perf::setup(perf::Settings().deterministic(false));
  EXPECT_FALSE(ctx.deterministicAlgorithms());
  EXPECT_FALSE(ctx.deterministicCuDNN());
  EXPECT_EQ(off.at("deterministic").status, perf::Status::applied);
  EXPECT_EQ(off.at("cudnn_benchmark").requested, "true");
}

// cudnn_benchmark_limit through its table entry, so that the CPU machines test
// what setup() skips there: the value LibTorch reads back, the restore, and
// the note when cudnn_benchmark is off as the same call leaves it.
TEST(Setup, CudnnBenchmarkLimitAppliesRestoresAndSaysWhenItHasNoEffect) {
  const KeepSettings keep;
  auto& ctx = at::globalContext();
  const auto& table = perf::detail::entries();
  const auto entry = std::find_if(table.begin(), table.end(), [](const perf::detail::Entry& e) {
    return std::string(e.name) == "cudnn_benchmark_limit";
  });
  ASSERT_NE(entry, table.end());
  EXPECT_TRUE(entry->cuda_only);
  EXPECT_EQ(entry->one_way, nullptr) << "ScopedSettings can restore it";
  ctx.setDeterministicAlgorithms(false, false);
  ctx.setDeterministicCuDNN(false);
  ctx.setBenchmarkLimitCuDNN(10);

  const auto all = perf::Settings().cudnn_benchmark_limit(0);
  const auto plan = perf::detail::make_plan(all);
  const auto req = entry->request(plan);
  ASSERT_TRUE(req.value.has_value());
  EXPECT_EQ(*req.value, "0");
  EXPECT_EQ(req.note, "") << "cudnn_benchmark is on by default";
  const auto restore = entry->save(plan);
  entry->apply(plan);
  EXPECT_EQ(ctx.benchmarkLimitCuDNN(), 0);
  EXPECT_EQ(entry->read(plan), "0");
  EXPECT_EQ(flags().at("cudnn_benchmark_limit"), "0");
  restore();
  EXPECT_EQ(ctx.benchmarkLimitCuDNN(), 10);
  EXPECT_FALSE(entry->request(perf::detail::make_plan(perf::Settings())).value.has_value()) << "unset: untouched";

  const std::string none = "no effect while cudnn_benchmark is off";
  EXPECT_EQ(entry->request(perf::detail::make_plan(perf::Settings(all).cudnn_benchmark(false))).note, none);
  EXPECT_EQ(entry->request(perf::detail::make_plan(perf::Settings(all).deterministic(true))).note, none);
  EXPECT_EQ(entry->request(perf::detail::make_plan(perf::Settings(all).deterministic(true).cudnn_benchmark(true))).note,
            "");
  // Deterministic algorithms set earlier: cudnn_benchmark yields, so it stays as the program left it.
  ctx.setDeterministicAlgorithms(true, false);
  ctx.setBenchmarkCuDNN(false);
  EXPECT_EQ(entry->request(perf::detail::make_plan(all)).note, none);
  ctx.setBenchmarkCuDNN(true);
  EXPECT_EQ(entry->request(perf::detail::make_plan(all)).note, "");
  EXPECT_EQ(entry->request(perf::detail::make_plan(perf::Settings(all).deterministic(false))).note, "");
}

TEST(Setup, SecondCallIsUnchanged) {
  const KeepSettings keep;
  const auto s = perf::Settings().num_threads(1).matmul_precision("medium").sdpa_cudnn(false);
  perf::setup(s);
  const auto before = flags();
  const auto r = perf::setup(s);
  EXPECT_EQ(flags(), before);
  for (const auto& row : r.rows) EXPECT_NE(row.status, perf::Status::applied) << row.setting;
}

TEST(Setup, ConcurrentCallsAreSafe) {
  const KeepSettings keep;
  const auto s = perf::Settings().num_threads(1).matmul_precision("high").sdpa_math(true);
  std::vector<std::thread> threads;
  threads.reserve(8);
  std::atomic<int> failures{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      for (int k = 0; k < 50; ++k) {
        try {
          const auto r = perf::setup(s);
          if (r.at("matmul_precision").read_back != "high") ++failures;
        } catch (...) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(at::globalContext().float32MatmulPrecision(), at::Float32MatmulPrecision::HIGH);
}

TEST(Setup, RepairsMixedLegacyAndNewTf32Api) {
  const KeepSettings keep;
  auto& ctx = at::globalContext();
  // The state the new per-backend API can leave: legacy getter refuses to answer.
  ctx.setFloat32MatmulPrecision("highest");
  ctx.setFloat32Precision(B::CUDA, O::MATMUL, P::TF32);
  EXPECT_THROW(ctx.float32MatmulPrecision(), c10::Error);
  EXPECT_NE(flags().at("matmul_precision").find("inconsistent"), std::string::npos);
  perf::setup();
  EXPECT_EQ(ctx.float32MatmulPrecision(), at::Float32MatmulPrecision::HIGH);
  EXPECT_TRUE(ctx.allowTF32CuBLAS());
  EXPECT_EQ(ctx.float32Precision(B::CUDA, O::MATMUL), P::TF32);
}

TEST(ScopedSettings, RestoresEveryValueExactly) {
  const KeepSettings keep;
  auto& ctx = at::globalContext();
  // A non-default starting point, including a per-backend-only state.
  ctx.setFloat32Precision(B::CUDA, O::CONV, P::TF32);
  ctx.setFloat32Precision(B::CUDA, O::RNN, P::IEEE);
  ctx.setAllowFP16ReductionCuBLAS(false, false);
  at::set_num_threads(1);
  const auto before = flags();
  const auto fp32_before = fp32_entries();
  const char* ws = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  const std::string ws_before = ws ? ws : "(unset)";
  {
    perf::ScopedSettings guard(perf::Settings()
                                   .matmul_precision("medium")
                                   .deterministic(true)
                                   .num_threads(2)
                                   .fp16_reduced_precision_reduction(true)
                                   .bf16_reduced_precision_reduction(false)
                                   .flush_denormal(true)
                                   .sdpa_flash(false)
                                   .sync_debug("warn")
                                   .memory_fraction(0.5));
    EXPECT_EQ(at::get_num_threads(), 2);
    EXPECT_TRUE(ctx.deterministicAlgorithms());
    EXPECT_EQ(ctx.float32MatmulPrecision(), at::Float32MatmulPrecision::MEDIUM);
    EXPECT_FALSE(ctx.userEnabledFlashSDP());
    EXPECT_NE(flags(), before);
    EXPECT_EQ(guard.report().at("num_threads").status, perf::Status::applied);
  }
  EXPECT_EQ(flags(), before);
  EXPECT_EQ(fp32_entries(), fp32_before);
  ws = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  EXPECT_EQ(ws_before, ws ? ws : "(unset)");
  EXPECT_EQ(ctx.allowFP16ReductionCuBLAS(), at::CuBLASReductionOption::DisallowReducedPrecisionDisallowSplitK);
}

TEST(ScopedSettings, NestsAndRestoresInOrder) {
  const KeepSettings keep;
  at::set_num_threads(1);
  {
    perf::ScopedSettings outer(perf::Settings().num_threads(2).matmul_precision("high"));
    {
      perf::ScopedSettings inner(perf::Settings().num_threads(3).matmul_precision("highest"));
      EXPECT_EQ(at::get_num_threads(), 3);
      EXPECT_EQ(at::globalContext().float32MatmulPrecision(), at::Float32MatmulPrecision::HIGHEST);
    }
    EXPECT_EQ(at::get_num_threads(), 2);
    EXPECT_EQ(at::globalContext().float32MatmulPrecision(), at::Float32MatmulPrecision::HIGH);
  }
  EXPECT_EQ(at::get_num_threads(), 1);
}

TEST(ScopedSettings, RejectsOneWaySettings) {
  const KeepSettings keep;
  PERF_EXPECT_THROW_MSG(perf::ScopedSettings(perf::Settings().num_interop_threads(2)), "num_interop_threads");
  PERF_EXPECT_THROW_MSG(perf::ScopedSettings(perf::Settings().allocator("expandable_segments:True")), "allocator");
}

// Each invalid value: the error names the setting and the valid values, and
// nothing in the same Settings was applied.
TEST(Setup, InvalidValuesThrowAndApplyNothing) {
  const KeepSettings keep;
  at::set_num_threads(1);
  const auto before = flags();
  const auto base = perf::Settings().num_threads(2).matmul_precision("medium").sdpa_flash(false);
  struct Case {
    perf::Settings settings;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {perf::Settings(base).memory_fraction(0.0), {"memory_fraction", "(0, 1]"}},
      {perf::Settings(base).memory_fraction(1.5), {"memory_fraction", "(0, 1]"}},
      {perf::Settings(base).memory_fraction(-0.1), {"memory_fraction", "(0, 1]"}},
      {perf::Settings(base).num_threads(0), {"num_threads", ">= 1"}},
      {perf::Settings(base).cudnn_benchmark_limit(-1), {"cudnn_benchmark_limit", ">= 0", "every algorithm"}},
      {perf::Settings(base).num_interop_threads(-3), {"num_interop_threads", ">= 1"}},
      {perf::Settings(base).matmul_precision("ultra"), {"matmul_precision", "\"highest\", \"high\", \"medium\""}},
      {perf::Settings(base).matmul_precision("High"), {"matmul_precision", "valid values"}},
      {perf::Settings(base).sync_debug("loud"), {"sync_debug", "\"off\", \"warn\", \"error\""}},
      {perf::Settings(base).memory_fraction_device(-1), {"memory_fraction_device", "valid values"}},
      // LibTorch's own parser judges allocator strings; perf names the setting.
      {perf::Settings(base).allocator("expandable_segments"), {"perf::Settings::allocator", "rejected", "key:value"}},
      {perf::Settings(base).allocator("foo:1"), {"perf::Settings::allocator", "foo"}},
      {perf::Settings(base).allocator("expandable_segments:True,foo:1"), {"perf::Settings::allocator", "foo"}},
      {perf::Settings(base).allocator("max_split_size_mb:128,expandable_segments:yes"),
       {"perf::Settings::allocator", "True", "False"}},
      {perf::Settings(base).allocator("garbage_collection_threshold:1.5"), {"allocator", "garbage_collect"}},
      {perf::Settings(base).allocator("roundup_power2_divisions:[256:1"), {"allocator", "rejected"}},
      {perf::Settings(base).allocator("backend:cudaMallocAsync"), {"allocator", "PYTORCH_ALLOC_CONF"}},
      {perf::Settings(base).sdpa_math(false).sdpa_mem_efficient(false).sdpa_cudnn(false), {"sdpa", "at least one"}},
  };
  const bool expandable = c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
  const size_t max_split = c10::CachingAllocator::AcceleratorAllocatorConfig::max_split_size();
  for (const auto& c : cases) {
    try {
      perf::setup(c.settings);
      ADD_FAILURE() << "no error for " << c.words.front();
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      for (const auto& w : c.words) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
    }
    EXPECT_EQ(flags(), before) << "half-applied after error about " << c.words.front();
    // Keys LibTorch parsed before it met the bad one are put back too.
    EXPECT_EQ(c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments(), expandable);
    EXPECT_EQ(c10::CachingAllocator::AcceleratorAllocatorConfig::max_split_size(), max_split);
  }
  // Valid allocator strings pass LibTorch's parser (applied only with a CUDA device).
  const auto restore = perf::detail::save_allocator();
  for (const char* ok : {"expandable_segments:True", "max_split_size_mb:128,garbage_collection_threshold:0.6",
                         "roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:False"}) {
    EXPECT_NO_THROW(perf::setup(perf::Settings().allocator(ok))) << ok;
    if (!perf_has_cuda()) {
      EXPECT_EQ(flags().at("allocator"), before.at("allocator")) << "skipped means untouched";
    }
  }
  restore();
}

// LibTorch fixes the inter-op thread count at the first inter-op work in the
// process, which any earlier test may have done: so this runs in a fresh one
// (gtest's threadsafe death-test style re-executes the binary for this test).
namespace {
void interop_threads_once_then_clear_error() {
  const auto r = perf::setup(perf::Settings().num_interop_threads(3));
  EXPECT_EQ(at::get_num_interop_threads(), 3u);
  EXPECT_EQ(r.at("num_interop_threads").read_back, "3");
  // The same value again is fine (idempotent) ...
  EXPECT_EQ(perf::setup(perf::Settings().num_interop_threads(3)).at("num_interop_threads").status,
            perf::Status::unchanged);
  // ... another one is refused, and nothing else in that call is applied.
  at::set_num_threads(1);
  const auto before = flags();
  PERF_EXPECT_THROW_MSG(perf::setup(perf::Settings().num_interop_threads(2).num_threads(2)),
                        "num_interop_threads: LibTorch accepts it once per process");
  EXPECT_EQ(flags(), before);
  EXPECT_EQ(at::get_num_interop_threads(), 3u);
}

// In the death-test child: runs `checks`, writes each failure to stderr (which
// EXPECT_EXIT shows) and exits 1 if there was one, 0 if not.
[[noreturn]] void exit_with_failures_of(void (*checks)()) {
  ::testing::TestPartResultArray failures;
  {
    const ::testing::ScopedFakeTestPartResultReporter capture(&failures);
    checks();
  }
  for (int i = 0; i < failures.size(); ++i) {
    const auto& f = failures.GetTestPartResult(i);
    std::fprintf(stderr, "%s:%d: %s\n", f.file_name() ? f.file_name() : "?", f.line_number(), f.message());
  }
  std::exit(failures.size() == 0 ? 0 : 1);
}
}  // namespace

TEST(Setup, InteropThreadsOnceThenClearError) {
  const KeepSettings keep;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with_failures_of(interop_threads_once_then_clear_error), ::testing::ExitedWithCode(0), "");
}

// A later setting that throws puts back the earlier ones of the same call
// (the allocator is applied, then rolled back, where there is a CUDA device).
TEST(Setup, AFailedCallRollsBackTheAllocator) {
  const KeepSettings keep;
  const int other = static_cast<int>(at::get_num_interop_threads()) + 1;
  at::parallel_for(0, 1, 1, [](int64_t, int64_t) {});
  at::launch([] {});  // inter-op pool started: the count is fixed now
  const auto before = flags();
  const size_t max_split = c10::CachingAllocator::AcceleratorAllocatorConfig::max_split_size();
  PERF_EXPECT_THROW_MSG(perf::setup(perf::Settings().allocator("max_split_size_mb:64").num_interop_threads(other)),
                        "num_interop_threads");
  EXPECT_EQ(flags(), before);
  EXPECT_EQ(c10::CachingAllocator::AcceleratorAllocatorConfig::max_split_size(), max_split);
}

TEST(Setup, PerfDisableMakesItAReportedNoOp) {
  const KeepSettings keep;
  at::set_num_threads(1);
  const auto before = flags();
  test_util::ScopedEnv env("PERF_DISABLE", "1");
  const auto r = perf::setup(perf::Settings().num_threads(2).matmul_precision("medium"));
  EXPECT_TRUE(r.disabled);
  EXPECT_EQ(flags(), before);
  for (const auto& row : r.rows) {
    EXPECT_EQ(row.status, perf::Status::skipped) << row.setting;
    EXPECT_EQ(row.reason, "PERF_DISABLE=1");
  }
  EXPECT_NE(r.to_string().find("disabled by PERF_DISABLE=1"), std::string::npos);
  // Invalid input is still an error: PERF_DISABLE hides no bug.
  EXPECT_THROW(perf::setup(perf::Settings().num_threads(0)), c10::Error);
}

TEST(Setup, PerfVerbosePrintsTheReportToStderr) {
  const KeepSettings keep;
  {
    testing::internal::CaptureStderr();
    perf::setup();
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  }
  test_util::ScopedEnv env("PERF_VERBOSE", "1");
  testing::internal::CaptureStderr();
  const auto r = perf::setup();
  EXPECT_EQ(testing::internal::GetCapturedStderr(), r.to_string());
}

TEST(Setup, DefaultReportShowsOnlyWhatChangedOrWasSkipped) {
  const KeepSettings keep;
  const auto r = perf::setup(perf::Settings().num_threads(1));
  const std::string text = r.to_string();
  size_t unchanged = 0;
  for (const auto& row : r.rows) {
    const bool listed = text.find("\n" + row.setting + " ") != std::string::npos;
    EXPECT_EQ(listed, row.status != perf::Status::unchanged) << row.setting << "\n" << text;
    unchanged += row.status == perf::Status::unchanged;
  }
  ASSERT_GT(unchanged, 0u);
  EXPECT_NE(text.find("(" + std::to_string(unchanged) + " more settings unchanged"), std::string::npos) << text;
  std::ostringstream os;
  os << r;
  EXPECT_EQ(os.str(), text);
  EXPECT_GT(r.to_string(true).size(), text.size());
}

TEST(Setup, ReportPrintsAnAlignedTable) {
  const KeepSettings keep;
  const auto r = perf::setup(perf::Settings().num_threads(1));
  const std::string text = r.to_string(/*all=*/true);
  std::istringstream in(text);
  std::string line;
  std::getline(in, line);  // title
  std::getline(in, line);  // header
  const auto status_col = line.find("status");
  ASSERT_NE(status_col, std::string::npos);
  size_t n = 0;
  while (std::getline(in, line)) {
    if (line.rfind("CPU autocast default: ", 0) == 0) {
      EXPECT_EQ(line, "CPU autocast default: " + perf::detail::cpu_bf16().autocast_choice());
      continue;
    }
    const auto& row = r.rows.at(n++);
    EXPECT_EQ(line.rfind(row.setting, 0), 0u) << line;
    EXPECT_EQ(line.substr(status_col, std::string(perf::to_string(row.status)).size()), perf::to_string(row.status))
        << line;
  }
  EXPECT_EQ(n, r.rows.size());
  // tf32, matmul_precision, cudnn_benchmark, cudnn_benchmark_limit, deterministic,
  // cublas_workspace_config, fp16/bf16 reduction, num_threads, num_interop_threads,
  // flush_denormal, sync_debug, memory_fraction, allocator, four sdpa backends,
  // cpu_malloc_cache.
  EXPECT_EQ(n, 19u);
  PERF_EXPECT_THROW_MSG(r.at("no_such_setting"), "no row named");
}

TEST(Setup, WithoutCudaTheCudaSettingsAreSkipped) {
  const KeepSettings keep;
  if (perf_has_cuda()) GTEST_SKIP() << "skipped: this machine has a CUDA device (covered by OnGpu tests)";
  const auto fp16_before = at::globalContext().allowFP16ReductionCuBLAS();
  const int limit_before = at::globalContext().benchmarkLimitCuDNN();
  const auto r = perf::setup(perf::Settings()
                                 .cudnn_benchmark_limit(limit_before + 1)
                                 .sync_debug("warn")
                                 .memory_fraction(0.5)
                                 .allocator("expandable_segments:True")
                                 .fp16_reduced_precision_reduction(false));
  for (const char* name : {"tf32", "cudnn_benchmark", "cudnn_benchmark_limit", "sync_debug", "memory_fraction",
                           "allocator", "fp16_reduced_precision_reduction"}) {
    EXPECT_EQ(r.at(name).status, perf::Status::skipped) << name;
    EXPECT_NE(r.at(name).reason.find("no CUDA device"), std::string::npos) << name;
  }
  EXPECT_EQ(at::globalContext().allowFP16ReductionCuBLAS(), fp16_before) << "skipped means untouched";
  EXPECT_EQ(at::globalContext().benchmarkLimitCuDNN(), limit_before) << "skipped means untouched";
  // CPU settings still apply in the same call.
  EXPECT_NE(r.at("matmul_precision").status, perf::Status::skipped);
}

TEST(Setup, OnGpuCudaSettingsApply) {
  const KeepSettings keep;
  if (!perf_has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
#if PERF_WITH_CUDA
  const auto r = perf::setup(perf::Settings()
                                 .sync_debug("warn")
                                 .memory_fraction(0.5)
                                 .fp16_reduced_precision_reduction(false)
                                 .allocator("expandable_segments:True")
                                 .cudnn_benchmark_limit(0));
  EXPECT_EQ(at::globalContext().benchmarkLimitCuDNN(), 0);
  EXPECT_EQ(r.at("cudnn_benchmark_limit").read_back, "0");
  EXPECT_NE(r.at("cudnn_benchmark_limit").status, perf::Status::skipped);
  EXPECT_EQ(c10::cuda::warning_state().get_sync_debug_mode(), c10::cuda::SyncDebugMode::L_WARN);
  const auto dev = c10::cuda::current_device();
  EXPECT_DOUBLE_EQ(c10::cuda::CUDACachingAllocator::getMemoryFraction(dev), 0.5);
  EXPECT_EQ(r.at("memory_fraction").reason, "cuda:" + std::to_string(dev));
  // Only that device: the others get no cap (and no CUDA context from perf).
  for (c10::DeviceIndex d = 0; d < perf::detail::cuda_device_count(); ++d) {
    if (d != dev) {
      EXPECT_DOUBLE_EQ(c10::cuda::CUDACachingAllocator::getMemoryFraction(d), 1.0) << static_cast<int>(d);
    }
  }
  EXPECT_EQ(at::globalContext().allowFP16ReductionCuBLAS(),
            at::CuBLASReductionOption::DisallowReducedPrecisionAllowSplitK);
  EXPECT_TRUE(c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments());
  EXPECT_EQ(r.at("allocator").status, perf::Status::applied);
  EXPECT_TRUE(at::globalContext().benchmarkCuDNN());
  EXPECT_TRUE(at::globalContext().allowTF32CuDNN());
  const int cc = perf::detail::compute_capability(dev);
  const bool note = r.at("tf32").reason.find("no effect on sm_") != std::string::npos;
  EXPECT_EQ(note, cc < 80) << "cc=" << cc << " reason=" << r.at("tf32").reason;
  // Too late: memory is reserved now, and the report says so.
  auto t = at::zeros({1 << 20}, at::device(at::kCUDA));
  const auto late = perf::setup(perf::Settings().allocator("expandable_segments:True"));
  EXPECT_NE(late.at("allocator").reason.find("too late"), std::string::npos);
  perf::setup(perf::Settings().sync_debug("off").memory_fraction(1.0));
#endif
}

// Every algorithm cuDNN offers is timed on a shape no other test used, and the
// one picked computes the same convolution as the CPU (fp32, TF32 off).
TEST(Setup, OnGpuCudnnBenchmarkLimitZeroTimesEveryAlgorithm) {
  const KeepSettings keep;
  if (!perf_has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  auto& ctx = at::globalContext();
  const int before = ctx.benchmarkLimitCuDNN();
  at::manual_seed(0);
  const auto x = at::randn({3, 5, 23, 19});
  const auto w = at::randn({7, 5, 3, 3});
  const auto ref = at::conv2d(x.to(at::kDouble), w.to(at::kDouble), {}, 1, 1);
  const auto [ref_dx, ref_dw] = [&] {
    auto xd = x.to(at::kDouble).requires_grad_(), wd = w.to(at::kDouble).requires_grad_();
    at::conv2d(xd, wd, {}, 1, 1).square().sum().backward();
    return std::make_pair(xd.grad(), wd.grad());
  }();
  {
    perf::ScopedSettings all(perf::Settings().tf32(false).cudnn_benchmark(true).cudnn_benchmark_limit(0));
    EXPECT_EQ(ctx.benchmarkLimitCuDNN(), 0);
    EXPECT_EQ(all.report().at("cudnn_benchmark_limit").status, perf::Status::applied);
    for (int i = 0; i < 3; ++i) {  // the first call finds, the others reuse
      auto xc = x.cuda().requires_grad_(), wc = w.cuda().requires_grad_();
      const auto y = at::conv2d(xc, wc, {}, 1, 1);
      y.square().sum().backward();
      // fp32 with every algorithm allowed (FFT and Winograd among them): 1e-3 relative; a wrong result is O(1).
      EXPECT_TRUE(at::allclose(y.cpu().to(at::kDouble), ref, 1e-3, 1e-3)) << i;
      EXPECT_TRUE(at::allclose(xc.grad().cpu().to(at::kDouble), ref_dx, 1e-3, 1e-2)) << i;
      EXPECT_TRUE(at::allclose(wc.grad().cpu().to(at::kDouble), ref_dw, 1e-3, 1e-2)) << i;
    }
  }
  EXPECT_EQ(ctx.benchmarkLimitCuDNN(), before) << "ScopedSettings puts the limit back";
}

TEST(Environment, DescribesVersionsDevicesAndFlags) {
  const KeepSettings keep;
  const test_util::ScopedJobThreads alone(1);
  const perf::Environment e = perf::environment();
  // The Python torch from the same wheel reports the same version.
  const std::string py = test_util::python("import torch; print(torch.__version__)");
  EXPECT_EQ(py.rfind(e.torch_version, 0), 0u) << py << " vs " << e.torch_version;
  EXPECT_EQ(e.cuda_compiled, PERF_WITH_CUDA != 0);
  EXPECT_EQ(static_cast<int>(e.devices.size()), perf::detail::cuda_device_count());
  EXPECT_EQ(e.hardware_threads, std::thread::hardware_concurrency());
  EXPECT_EQ(e.physical_cores, perf::detail::physical_cores());
  EXPECT_EQ(e.intraop_threads, at::get_num_threads());
  EXPECT_EQ(e.job_processes, 1) << "no distributed job";
  const auto names = perf::setup().rows;
  ASSERT_EQ(e.flags.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(e.flags[i].first, names[i].setting);
  std::ostringstream os;
  os << e;
  EXPECT_NE(os.str().find("LibTorch " + e.torch_version), std::string::npos);
  EXPECT_NE(os.str().find("matmul_precision"), std::string::npos);
  EXPECT_EQ(e.cpu_autocast, perf::detail::cpu_bf16().autocast_choice());
  EXPECT_NE(os.str().find("autocast default " + e.cpu_autocast), std::string::npos);
  EXPECT_EQ(os.str().find("distributed job:"), std::string::npos) << os.str();
  if (e.devices.empty()) {
    EXPECT_NE(os.str().find("CUDA devices: none"), std::string::npos);
  } else {
    EXPECT_NE(os.str().find(e.devices[0].name), std::string::npos);
    EXPECT_GT(e.devices[0].multiprocessors, 0);
  }
#if PERF_WITH_CUDA
  EXPECT_GE(e.cuda_runtime_version, 13000);
  const std::string py_cuda = test_util::python("import torch; print(torch.version.cuda)");
  EXPECT_EQ(py_cuda.rfind(std::to_string(e.cuda_runtime_version / 1000) + ".", 0), 0u) << py_cuda;
#endif
}

// What sets the CPU threads, read from the environment as it is now: the thread
// variables that are set (with their values, in a fixed order), and the processes of
// a distributed job that share the machine (perf::init_process_group's count).
TEST(Environment, SaysWhichThreadVariablesAreSetAndWhoSharesTheCores) {
  const test_util::ScopedEnv omp("OMP_NUM_THREADS", "3");
  const test_util::ScopedEnv mkl("MKL_NUM_THREADS", "");  // empty: not set
  const test_util::ScopedEnv wait("OMP_WAIT_POLICY", "PASSIVE");
  const test_util::ScopedJobThreads job(4);
  const perf::Environment e = perf::environment();
  using Variables = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(e.thread_variables, (Variables{{"OMP_NUM_THREADS", "3"}, {"OMP_WAIT_POLICY", "PASSIVE"}}));
  EXPECT_EQ(e.job_processes, 4);
  std::ostringstream os;
  os << e;
  EXPECT_NE(os.str().find("thread variables: OMP_NUM_THREADS=3 OMP_WAIT_POLICY=PASSIVE\n"), std::string::npos)
      << os.str();
  EXPECT_NE(os.str().find("distributed job: 4 processes on this machine"), std::string::npos) << os.str();
  EXPECT_TRUE(perf::detail::thread_count_set_by_environment());
  {
    const test_util::ScopedEnv no_omp("OMP_NUM_THREADS", "");
    EXPECT_FALSE(perf::detail::thread_count_set_by_environment()) << "OMP_WAIT_POLICY alone chooses no count";
    const test_util::ScopedEnv no_wait("OMP_WAIT_POLICY", "");
    std::ostringstream none;
    none << perf::environment();
    EXPECT_NE(none.str().find("thread variables: none (OMP_NUM_THREADS, MKL_NUM_THREADS, OMP_WAIT_POLICY unset)"),
              std::string::npos)
        << none.str();
  }
  const test_util::ScopedEnv mkl_set("MKL_NUM_THREADS", "2");
  EXPECT_TRUE(perf::detail::thread_count_set_by_environment());
}

// perf reads the CPU's bf16 features from ATen; on Linux they match /proc/cpuinfo.
TEST(Environment, CpuBf16FeaturesMatchTheKernel) {
  const KeepSettings keep;
  std::ifstream in("/proc/cpuinfo");
  if (!in) GTEST_SKIP() << "skipped: no /proc/cpuinfo on this system";
  std::string line, flags_line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      flags_line = line + " ";
      break;
    }
  if (flags_line.empty()) GTEST_SKIP() << "skipped: /proc/cpuinfo has no flags line (not x86)";
  const auto& c = perf::detail::cpu_bf16();
  EXPECT_EQ(c.avx512_bf16, flags_line.find(" avx512_bf16 ") != std::string::npos) << flags_line;
  EXPECT_EQ(c.amx_bf16, flags_line.find(" amx_bf16 ") != std::string::npos) << flags_line;
  EXPECT_EQ(perf::setup().cpu_autocast, c.autocast_choice());
  EXPECT_EQ(c.autocast_choice().rfind(c.native() ? "bf16: " : "off (fp32): ", 0), 0u);
}

namespace {

int64_t rss_mib() { return *perf::memory_stats().rss >> 20; }

// One "step" of CPU tensors: 8 blocks of 8 MiB allocated, written, freed.
// Returns how much the process's RSS rose while they were alive (MiB).
int64_t malloc_round() {
  const int64_t before = rss_mib();
  std::vector<at::Tensor> blocks;
  blocks.reserve(8);
  for (int i = 0; i < 8; ++i) blocks.push_back(at::ones({2 << 20}));
  return rss_mib() - before;
}

// A 30 MiB tensor, written and freed: how much of it went back to the kernel (MiB).
int64_t freed_block_returned() {
  auto t = at::ones({30 << 18});
  const int64_t alive = rss_mib();
  t = at::Tensor();
  return alive - rss_mib();
}

// In a fresh process (a death-test child), as glibc starts: a block that large
// is its own mapping, unmapped when freed.
void glibc_defaults_return_freed_blocks() {
  EXPECT_GE(freed_block_returned(), 24) << "MiB of a freed 30 MiB block given back with glibc's defaults";
}

// In a fresh process, after perf::setup(): freed blocks stay for the next
// step, which reuses them; cpu_malloc_cache(false) gives back what was kept.
void the_cache_keeps_freed_blocks() {
  const auto on = perf::setup();
  const auto& row = on.at("cpu_malloc_cache");
  EXPECT_EQ(row.requested, "true");
  EXPECT_EQ(row.read_back, "true");
  EXPECT_EQ(row.status, perf::Status::applied) << row.reason;
  EXPECT_LE(freed_block_returned(), 4) << "MiB of a freed 30 MiB block given back with the cache on";
  for (int i = 0; i < 12; ++i) malloc_round();  // the heap's layout settles
  int64_t grown = 0;
  for (int i = 0; i < 4; ++i) grown += malloc_round();
  EXPECT_LE(grown, 16) << "MiB newly faulted in over 4 settled rounds of 64 MiB with the cache on";
  const int64_t kept = rss_mib();
  const auto report = perf::setup(perf::Settings().cpu_malloc_cache(false));
  const auto& off = report.at("cpu_malloc_cache");
  EXPECT_EQ(off.status, perf::Status::applied);
  EXPECT_EQ(off.read_back, "false");
  EXPECT_NE(off.reason.find("initial thresholds back"), std::string::npos) << off.reason;
  EXPECT_GE(kept - rss_mib(), 32) << "MiB given back by cpu_malloc_cache(false) of the 64+ MiB kept";
}

}  // namespace

TEST(Setup, CpuMallocCacheKeepsFreedMemoryForTheNextStep) {
  const KeepSettings keep;
  const auto unavailable = perf::detail::malloc_cache_unavailable();
  if (!unavailable.empty()) {  // the sanitizer builds: reported, never silent, and nothing is done
    const auto r = perf::setup();
    EXPECT_EQ(r.at("cpu_malloc_cache").status, perf::Status::skipped);
    EXPECT_EQ(r.at("cpu_malloc_cache").reason, unavailable);
    EXPECT_EQ(r.at("cpu_malloc_cache").read_back, "n/a");
    GTEST_SKIP() << "skipped: " << unavailable << " (its report row was checked)";
  }
  if (!perf::memory_stats().rss) GTEST_SKIP() << "skipped: no RSS reading on this system (/proc/self/statm)";
  if (!perf::detail::malloc_tuned_by_environment().empty())
    GTEST_SKIP() << "skipped: " << perf::detail::malloc_tuned_by_environment() << " tunes malloc in this environment";
  // Each in a new process (threadsafe death tests re-execute the binary): glibc's
  // thresholds are process-wide and one-way.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with_failures_of(glibc_defaults_return_freed_blocks), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(exit_with_failures_of(the_cache_keeps_freed_blocks), ::testing::ExitedWithCode(0), "");
}

TEST(Setup, CpuMallocCacheIsOneWayAndDefersToTheEnvironment) {
  const KeepSettings keep;
  // Explicitly asked, ScopedSettings refuses it before applying anything; left
  // unset, ScopedSettings leaves it as it is.
  const auto before = flags();
  PERF_EXPECT_THROW_MSG(perf::ScopedSettings(perf::Settings().num_threads(1).cpu_malloc_cache(true)),
                        "cpu_malloc_cache changes how glibc's malloc keeps memory");
  EXPECT_EQ(flags(), before);
  {
    perf::ScopedSettings guard(perf::Settings().num_threads(1));
    EXPECT_EQ(guard.report().at("cpu_malloc_cache").requested, "-");
    EXPECT_EQ(flags().at("cpu_malloc_cache"), before.at("cpu_malloc_cache"));
  }
  if (!perf::detail::malloc_cache_unavailable().empty())
    GTEST_SKIP() << "skipped: " << perf::detail::malloc_cache_unavailable() << " (the rest needs glibc's malloc)";
  // malloc tuned by the environment: the default yields (the program's own
  // choice), an explicit request does not.
  for (const char* var : {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"}) {
    test_util::ScopedEnv env(var, "1048576");
    const auto r = perf::setup();
    EXPECT_EQ(r.at("cpu_malloc_cache").status, perf::Status::skipped);
    EXPECT_EQ(r.at("cpu_malloc_cache").reason,
              std::string(var) + " tunes malloc already (cpu_malloc_cache(true) overrides it)");
    EXPECT_NE(perf::setup(perf::Settings().cpu_malloc_cache(true)).at("cpu_malloc_cache").status,
              perf::Status::skipped);
  }
  {
    test_util::ScopedEnv env("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1048576");
    EXPECT_EQ(perf::setup().at("cpu_malloc_cache").reason,
              "GLIBC_TUNABLES tunes malloc already (cpu_malloc_cache(true) overrides it)");
  }
  {
    test_util::ScopedEnv env("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0");  // not a threshold
    EXPECT_NE(perf::setup().at("cpu_malloc_cache").status, perf::Status::skipped);
  }
  // Another allocator preloaded: glibc's thresholds would change nothing, asked or not.
  test_util::ScopedEnv preload("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
  for (const auto& s : {perf::Settings(), perf::Settings().cpu_malloc_cache(true)}) {
    const auto r = perf::setup(s);
    EXPECT_EQ(r.at("cpu_malloc_cache").status, perf::Status::skipped);
    EXPECT_EQ(r.at("cpu_malloc_cache").reason, "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 replaces malloc");
    EXPECT_EQ(r.at("cpu_malloc_cache").read_back, "n/a");
  }
}

// The harness that runs the tests' Python references: a stuck Python fails its test with its stack, and a
// process it leaves behind does not keep the test waiting.
TEST(TestHarness, StuckPythonFailsWithWhereItWasStuck) {
  test_util::ScopedEnv quick("PERF_TEST_PYTHON_TIMEOUT", "2");
  const auto start = std::chrono::steady_clock::now();
  try {
    test_util::python("import time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()");
    ADD_FAILURE() << "a Python stopped by its timeout returned";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("command failed (exit 1)"), std::string::npos) << what;
    EXPECT_NE(what.find("Timeout (0:00:02)"), std::string::npos) << what;
    EXPECT_NE(what.find("in waiting_here"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(TestHarness, ProcessLeftBehindDoesNotHoldTheTest) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(test_util::python("import subprocess\nsubprocess.Popen(['sleep', '40'])\nprint('done')"), "done");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

// test_util::python() runs snippets in children of one Python that imported torch (tests/python_server.py):
// each as `python -c` runs it in a Python of its own (PERF_TEST_PYTHON_SERVER=0), the same output, exit
// status and error, a fresh torch state each time; and they are that server's children.
TEST(TestHarness, PythonSnippetsRunInTheServerAsInAPythonOfTheirOwn) {
  const std::string looks =
      "import os, sys, threading, torch\n"
      "print(__name__, sys.argv, repr(sys.path[0]), os.getcwd())\n"
      "print(torch.initial_seed() != 1, threading.active_count())\n"
      "print(len('\\\\\\\\'), 'c\\nd')\n"  // the shell makes \\\\ two backslashes (Python's one); \n stays
      "torch.manual_seed(1)\n";
  auto failure = [](const std::string& code) {
    try {
      test_util::python(code);
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      return what.substr(0, what.find(':')) + what.substr(what.find("its stderr:"));
    }
    return std::string("no failure");
  };
  std::string own[3], served[3];
  for (const bool server : {false, true}) {
    const test_util::ScopedEnv mode("PERF_TEST_PYTHON_SERVER", server ? "1" : "0");
    std::string* out = server ? served : own;
    out[0] = test_util::python(looks);
    out[1] = failure("def f():\n    raise ValueError('bad value')\nf()");
    out[2] = failure("import sys\nprint('before')\nsys.exit(3)");
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(served[i], own[i]) << "snippet " << i;
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof cwd), nullptr);
  EXPECT_EQ(own[0], "__main__ ['-c'] '' " + std::string(cwd) + "\nTrue 1\n1 c\nd");
  EXPECT_NE(own[1].find("line 4, in f"), std::string::npos) << own[1];  // after python()'s two lines
  EXPECT_NE(own[1].find("ValueError: bad value"), std::string::npos) << own[1];
  EXPECT_EQ(own[2].substr(0, own[2].find('\n')), "command failed (exit 3)its stderr:") << own[2];

  const std::string ids = "import os, torch\nprint(os.getpid(), os.getppid(), torch.initial_seed())";
  const std::string first = test_util::python(ids), second = test_util::python(ids);
  EXPECT_NE(first.substr(0, first.find(' ')), second.substr(0, second.find(' '))) << "each snippet its own process";
  const auto words = [](const std::string& line) {
    std::istringstream in(line);
    return std::vector<std::string>(std::istream_iterator<std::string>(in), {});
  };
  const auto a = words(first), b = words(second);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_NE(a[0], b[0]) << "each snippet its own process";
  EXPECT_EQ(a[1], b[1]) << "both children of the one server";
  EXPECT_NE(a[1], std::to_string(::getpid())) << "the server's, not started by the test itself";
  EXPECT_NE(a[2], b[2]) << "torch seeded anew in each, as in a Python of its own";
}

// The ThreadSanitizer and AddressSanitizer builds hide CUDA's devices from their tests
// (tests/sanitizers/defaults.cpp: the driver is not instrumented).
TEST(TestHarness, TheSanitizerBuildsHideCudaDevices) {
#ifdef PERF_TEST_HIDES_CUDA
  constexpr bool sanitized = true;
#else
  constexpr bool sanitized = false;
#endif
  if (!sanitized) GTEST_SKIP() << "skipped: not a ThreadSanitizer or AddressSanitizer build";
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  ASSERT_NE(visible, nullptr);
  EXPECT_STREQ(visible, "");
  EXPECT_FALSE(at::hasCUDA() && at::getNumGPUs() > 0) << "a CUDA device is visible to a sanitizer build";
}
