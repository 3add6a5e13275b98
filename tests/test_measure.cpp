// Tests for perf/bench.h, perf/memory.h and perf/profile.h.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <perf/bench.h>
#include <perf/memory.h>
#include <perf/profile.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <thread>

#include "test_util.h"

#if PERF_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using test_util::perf_has_cuda;

void sleep_ms(double ms) { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms)); }

}  // namespace

TEST(Timer, MeasuresAKnownSleepOnCpu) {
  perf::Timer t;
  t.start();
  sleep_ms(50);
  t.stop();
  EXPECT_GE(t.elapsed_ms(), 50.0);
  EXPECT_LT(t.elapsed_ms(), 500.0);
}

TEST(Timer, MisuseIsAnError) {
  perf::Timer t;
  PERF_EXPECT_THROW_MSG(t.stop(), "start() was not called");
  t.start();
  PERF_EXPECT_THROW_MSG(t.elapsed_ms(), "call start() and stop() first");
  if (!perf_has_cuda()) PERF_EXPECT_THROW_MSG(perf::Timer(c10::Device(c10::kCUDA)), "cuda");
}

// No timing race: under load (ctest -j16) the host may take any time, so the
// checks are the ones load cannot break. The stream is still busy right after
// stop() (start/stop did not wait for the GPU); the GPU time lies inside the
// host's wall time of the same run; and it is at least what 200M cycles take at
// 5 GHz, faster than any GPU clock (40 ms).
TEST(Timer, MeasuresKnownGpuWorkWithoutHostSync) {
  if (!perf_has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
#if PERF_WITH_CUDA
  const int64_t cycles = 200'000'000;
  at::cuda::sleep(1000);  // the sleep kernel loaded before anything is timed
  c10::cuda::device_synchronize();
  perf::Timer t(c10::Device(c10::kCUDA, 0));
  const auto h0 = std::chrono::steady_clock::now();
  t.start();
  at::cuda::sleep(cycles);
  t.stop();
  const auto busy = cudaStreamQuery(c10::cuda::getCurrentCUDAStream().stream());
  EXPECT_EQ(busy, cudaErrorNotReady) << "start/stop must not wait for the GPU";
  const double gpu_ms = t.elapsed_ms();  // waits for the stop event
  const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
  EXPECT_LE(gpu_ms, host_ms + 0.01) << "GPU time measured between the host's own marks";
  EXPECT_GE(gpu_ms, 200e6 / 5e9 * 1e3);
#endif
}

TEST(Stats, MatchNumpyOnSyntheticDurations) {
  const std::vector<double> d = {5, 1, 4, 2, 3, 10, 7, 6, 9, 8, 0.5, 12.25};
  const auto s = perf::Stats::from(d, "synthetic", 32);
  std::string list;
  for (double x : d) list += std::to_string(x) + ",";
  const std::string ref = test_util::python(
      "import numpy as np; d=np.array([" + list +
      "]); print(' '.join(repr(float(v)) for v in [d.min(), np.median(d), d.mean(), np.percentile(d, 90), d.max()]))");
  std::istringstream in(ref);
  double mn, med, mean, p90, mx;
  in >> mn >> med >> mean >> p90 >> mx;
  EXPECT_DOUBLE_EQ(s.min_ms, mn);
  EXPECT_DOUBLE_EQ(s.median_ms, med);
  EXPECT_NEAR(s.mean_ms, mean, 1e-12);
  EXPECT_NEAR(s.p90_ms, p90, 1e-12);
  EXPECT_DOUBLE_EQ(s.max_ms, mx);
  EXPECT_EQ(s.iterations, 12);
  EXPECT_DOUBLE_EQ(s.items_per_second, 32 * 1000.0 / s.median_ms);
  const std::string row = s.to_string();
  EXPECT_EQ(row.rfind("synthetic", 0), 0u);
  EXPECT_NE(row.find("12"), std::string::npos);
  PERF_EXPECT_THROW_MSG(perf::Stats::from({}), "no durations");
}

TEST(Benchmark, CountsWarmupAndTimedCalls) {
  int calls = 0;
  const auto s = perf::benchmark([&] { ++calls; }, perf::BenchOptions().warmup(3).iters(7).name("count"));
  EXPECT_EQ(calls, 10);
  EXPECT_EQ(s.iterations, 7);
  EXPECT_EQ(s.name, "count");
  EXPECT_LE(s.min_ms, s.median_ms);
  EXPECT_LE(s.median_ms, s.p90_ms);
  EXPECT_LE(s.p90_ms, s.max_ms);
}

TEST(Benchmark, MinTimeExtendsTheRun) {
  // Host work, so the host clock: unset, device() is the GPU where there is one,
  // and CUDA events around a host sleep measured 9.89 ms for 10 on an H100.
  const auto s =
      perf::benchmark([] { sleep_ms(10); }, perf::BenchOptions().warmup(0).iters(1).min_time(0.06).device(c10::kCPU));
  // Sleeps overshoot on a loaded machine, so count time, not calls: timing went on
  // past iters(1) until 60 ms were measured, and stopped once they were.
  const double total_ms = s.mean_ms * static_cast<double>(s.iterations);
  EXPECT_GE(s.iterations, 2);
  EXPECT_GE(s.min_ms, 10.0);
  EXPECT_GE(total_ms, 59.0);  // the wall clock also counts the loop between timers
  EXPECT_LT(total_ms - s.max_ms, 60.0) << "one call more than needed";
}

TEST(Benchmark, InvalidOptionsNameTheOption) {
  auto f = [] {};
  PERF_EXPECT_THROW_MSG(perf::benchmark(f, perf::BenchOptions().iters(0)), "iters");
  PERF_EXPECT_THROW_MSG(perf::benchmark(f, perf::BenchOptions().warmup(-1)), "warmup");
  PERF_EXPECT_THROW_MSG(perf::benchmark(f, perf::BenchOptions().min_time(-1)), "min_time");
  PERF_EXPECT_THROW_MSG(perf::benchmark(f, perf::BenchOptions().items_per_call(-64)),
                        "perf::BenchOptions::items_per_call: must be >= 0 (0: items/s not reported), got -64");
}

TEST(Compare, AlternatesAndReportsTheRatioOfMedians) {
  std::string order;
  const auto c = perf::compare(
      "slow",
      [&] {
        order += 'A';
        sleep_ms(6);
      },
      "fast",
      [&] {
        order += 'B';
        sleep_ms(2);
      },
      perf::BenchOptions().warmup(1).iters(5).device(c10::kCPU));
  EXPECT_EQ(order, "ABABABABABAB");
  EXPECT_EQ(c.a.iterations, 5);
  EXPECT_EQ(c.b.iterations, 5);
  EXPECT_DOUBLE_EQ(c.ratio, c.a.median_ms / c.b.median_ms);
  EXPECT_GT(c.ratio, 1.5);
  const std::string text = c.to_string();
  EXPECT_NE(text.find("fast vs slow"), std::string::npos);
  EXPECT_NE(text.find("ratio of medians"), std::string::npos);
}

TEST(Compare, SeveralConfigurationsRoundRobin) {
  std::string order;
  const auto stats = perf::compare({{"a", [&] { order += 'A'; }},
                                    {"b",
                                     [&] {
                                       order += 'B';
                                       sleep_ms(3);
                                     }},
                                    {"c", [&] { order += 'C'; }}},
                                   perf::BenchOptions().warmup(1).iters(3).items_per_call(10).device(c10::kCPU));
  EXPECT_EQ(order, "ABCABCABCABC");
  ASSERT_EQ(stats.size(), 3u);
  EXPECT_EQ(stats[1].name, "b");
  for (const auto& st : stats) EXPECT_EQ(st.iterations, 3);
  EXPECT_GT(stats[1].median_ms, stats[0].median_ms);
  EXPECT_GT(stats[0].items_per_second, stats[1].items_per_second);
  PERF_EXPECT_THROW_MSG(perf::compare({}), "no configurations");
  PERF_EXPECT_THROW_MSG(perf::compare({{"empty", std::function<void()>()}}), "\"empty\" has no function");
}

// An event times the GPU's timeline. Round-robin without a sync, a host-bound call ("host": 5 ms on the host,
// then one tiny kernel) right after a GPU-heavy one ("gpu": a 20-ms-plus sleep kernel, launched at once) would
// have its start event wait behind that kernel while the host slept, and measure the tiny kernel alone. Each timed
// call now starts from an idle GPU, after an untimed call of its own, as in a loop of it (always: ranks that call
// collectives must call alike). Lower bounds only (load can only lengthen a sleep), so the test holds under
// ctest -j16.
TEST(Compare, OnGpuEachTimedCallStartsFromAnIdleGpu) {
  if (!perf_has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
#if PERF_WITH_CUDA
  at::cuda::sleep(1000);  // the sleep kernel loaded before anything is timed
  c10::cuda::device_synchronize();
  const int64_t cycles = 100'000'000;  // at least 20 ms: no GPU clocks 5 GHz
  std::string order;
  const auto stats = perf::compare({{"gpu",
                                     [&] {
                                       order += 'G';
                                       at::cuda::sleep(cycles);
                                     }},
                                    {"host",
                                     [&] {
                                       order += 'H';
                                       sleep_ms(5);
                                       at::cuda::sleep(1000);
                                     }}},
                                   perf::BenchOptions().warmup(1).iters(3).device(c10::Device(c10::kCUDA, 0)));
  EXPECT_EQ(order, "GH" + std::string("GGHH") + "GGHH" + "GGHH")
      << "warm-up, then each timed call after an untimed one";
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_GE(stats[0].min_ms, 100e6 / 5e9 * 1e3) << "the sleep kernel, timed on the GPU";
  EXPECT_GE(stats[1].min_ms, 4.5) << "the host's 5 ms count (less an event's latency): no earlier kernel hides them";
  // One function alone keeps back-to-back calls (a loop's timing): no sync, no extra call.
  int calls = 0;
  perf::benchmark([&] { ++calls; }, perf::BenchOptions().warmup(1).iters(4).device(c10::Device(c10::kCUDA, 0)));
  EXPECT_EQ(calls, 5);
#endif
}

TEST(Memory, CpuReportsRssAndSaysWhatIsMissing) {
  const auto before = perf::memory_stats();
  ASSERT_TRUE(before.rss && before.peak_rss);
  EXPECT_GT(*before.rss, 0);
  EXPECT_GE(*before.peak_rss, *before.rss);
  EXPECT_FALSE(before.allocated.has_value());
  ASSERT_FALSE(before.unavailable.empty());
  EXPECT_NE(before.unavailable.back().find("CPU allocator keeps no statistics"), std::string::npos);
  int64_t grown = 0;
  {
    auto t = at::ones({64, 1024, 1024});  // 256 MiB, touched
    grown = *perf::memory_stats().rss - *before.rss;
  }
  EXPECT_GT(grown, int64_t{200} << 20);
  const auto after = perf::memory_stats();
  EXPECT_LT(*after.rss, *before.rss + (int64_t{100} << 20)) << "freed memory goes back";
  EXPECT_GE(*after.peak_rss, *before.rss + (int64_t{200} << 20));
  if (perf::reset_peak_memory()) {
    EXPECT_LT(*perf::memory_stats().peak_rss, *after.peak_rss);
  }
  const std::string text = after.to_string();
  EXPECT_NE(text.find("process rss"), std::string::npos);
  EXPECT_NE(text.find("not available"), std::string::npos);
}

TEST(Memory, OnGpuStatsRiseAndFallBeforeAndAfterTheFirstCudaTensor) {
  if (!perf_has_cuda()) {
    PERF_EXPECT_THROW_MSG(perf::memory_stats(c10::Device(c10::kCUDA)), "cuda");
    GTEST_SKIP() << "skipped: no CUDA device on this machine";
  }
  const c10::Device cuda(c10::kCUDA, 0);
  perf::reset_peak_memory(cuda);
  const auto s0 = perf::memory_stats(cuda);
  int64_t during = 0;
  {
    auto t = at::empty({64 << 20}, at::device(cuda).dtype(at::kFloat));  // 256 MiB
    during = *perf::memory_stats(cuda).allocated;
  }
  const auto s1 = perf::memory_stats(cuda);
  EXPECT_EQ(during - *s0.allocated, int64_t{256} << 20);
  EXPECT_EQ(*s1.allocated, *s0.allocated);
  EXPECT_GE(*s1.peak_allocated, *s0.allocated + (int64_t{256} << 20));
  EXPECT_GE(*s1.reserved, int64_t{256} << 20) << "the caching allocator keeps the block";
  perf::reset_peak_memory(cuda);
  EXPECT_EQ(*perf::memory_stats(cuda).peak_allocated, *s1.allocated);
}

namespace {

// A try_fn that "runs out of memory" above `limit`, like a real OOM would.
struct FakeOom {
  int64_t limit;
  std::vector<int64_t> tried;
  void operator()(int64_t b) {
    tried.push_back(b);
    TORCH_CHECK_WITH(OutOfMemoryError, b <= limit, "CUDA out of memory (fake) at batch ", b);
  }
};

}  // namespace

TEST(FindMaxBatchSize, ExactAtEveryBoundary) {
  for (int64_t limit : {1, 2, 3, 7, 63, 64, 65, 100, 999, 1000, 5000}) {
    FakeOom oom{limit, {}};
    const int64_t got = perf::find_max_batch_size(std::ref(oom), 1, 1000, perf::FindBatchOptions().log(nullptr));
    EXPECT_EQ(got, std::min<int64_t>(limit, 1000)) << "limit " << limit;
    EXPECT_LE(oom.tried.size(), 22u) << "doubling + binary search stays logarithmic";
  }
  FakeOom at_lo{5, {}};
  EXPECT_EQ(perf::find_max_batch_size(std::ref(at_lo), 5, 9, perf::FindBatchOptions().log(nullptr)), 5);
}

TEST(FindMaxBatchSize, ReportsProgressAndResult) {
  FakeOom oom{40, {}};
  std::ostringstream log;
  EXPECT_EQ(perf::find_max_batch_size(std::ref(oom), 8, 256, perf::FindBatchOptions().log(&log)), 40);
  const std::string text = log.str();
  EXPECT_NE(text.find("try 8: fits"), std::string::npos) << text;
  EXPECT_NE(text.find("try 64: out of memory"), std::string::npos) << text;
  EXPECT_NE(text.find("largest batch that fits in [8, 256]: 40"), std::string::npos) << text;
}

TEST(FindMaxBatchSize, ErrorsAndOtherExceptions) {
  FakeOom none{3, {}};
  PERF_EXPECT_THROW_MSG(perf::find_max_batch_size(std::ref(none), 4, 64, perf::FindBatchOptions().log(nullptr)),
                        "even the smallest batch size (lo=4)");
  PERF_EXPECT_THROW_MSG(perf::find_max_batch_size([](int64_t) {}, 0, 8), "1 <= lo <= hi");
  PERF_EXPECT_THROW_MSG(perf::find_max_batch_size([](int64_t) {}, 9, 8), "1 <= lo <= hi");
  // A bug in try_fn is not an OOM: it propagates unchanged, at once.
  int calls = 0;
  auto buggy = [&](int64_t b) {
    ++calls;
    if (b > 2) throw std::invalid_argument("shape mismatch at batch " + std::to_string(b));
  };
  try {
    perf::find_max_batch_size(buggy, 1, 64, perf::FindBatchOptions().log(nullptr));
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "shape mismatch at batch 4");
  }
  EXPECT_EQ(calls, 3);
  auto c10_bug = [](int64_t) { TORCH_CHECK(false, "index out of range"); };
  PERF_EXPECT_THROW_MSG(perf::find_max_batch_size(c10_bug, 1, 8, perf::FindBatchOptions().log(nullptr)),
                        "index out of range");
}

// On a GPU the profile has the device's work too: each kernel and copy is a
// "cuda" row of the summary and a "kernel" / "gpu_memcpy" event of the trace
// (what bench/e2e/trace_table.py reads for run.py --profile-steps).
TEST(Profile, OnGpuSummarizesKernelsAndCopies) {
#if PERF_WITH_CUDA
  if (!perf_has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const auto path = std::filesystem::temp_directory_path() / ("perf_gpu_trace_" + std::to_string(::getpid()) + ".json");
  std::filesystem::remove(path);
  auto a = at::randn({256, 256}, at::kCUDA) / 16;
  c10::cuda::device_synchronize();
  perf::ProfileSummary summary;
  {
    perf::Profile p(path.string(), perf::ProfileOptions().out(nullptr));
    for (int i = 0; i < 5; ++i) a = at::mm(a, a).tanh();
    EXPECT_TRUE(a.cpu().isfinite().all().item<bool>());  // one copy to the host, after the kernels
    summary = p.stop();
  }
  int64_t kernels = 0, copies = 0;
  for (const auto& o : summary.ops) {
    if (o.device != "cuda") continue;
    EXPECT_GT(o.total_us, 0.0) << o.name;
    (o.name.rfind("Memcpy DtoH", 0) == 0 ? copies : kernels) += o.calls;
  }
  EXPECT_GE(kernels, 10) << "5 matrix products and 5 tanh:\n" << summary.table(20);
  EXPECT_EQ(copies, 1) << summary.table(20);
  const std::string py = test_util::python("import json; d=json.load(open('" + path.string() +
                                           "')); c=[e.get('cat') for e in d['traceEvents']]; "
                                           "print(c.count('kernel') >= 10, c.count('gpu_memcpy'))");
  EXPECT_EQ(py, "True 1");
  std::filesystem::remove(path);
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

// A schedule on CUDA: the kernels of the recorded steps only (Kineto's CUDA tracing prepared at the warm-up step,
// enabled for the active ones), one host copy per step.
TEST(Profile, OnGpuAScheduleTracesTheKernelsOfTheRecordedStepsOnly) {
#if PERF_WITH_CUDA
  if (!perf_has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const auto path =
      (std::filesystem::temp_directory_path() / ("perf_gpu_sched_" + std::to_string(::getpid()) + ".json")).string();
  std::filesystem::remove(path);
  auto a = at::randn({256, 256}, at::kCUDA) / 16;
  c10::cuda::device_synchronize();
  perf::ProfileSummary summary;
  {
    perf::Profile p(path, perf::ProfileOptions().out(nullptr).schedule(
                              perf::ProfileSchedule().wait(2).warmup(1).active(2).repeat(1)));
    for (int step = 0; step < 8; ++step) {
      a = at::mm(a, a).tanh();
      EXPECT_TRUE(a.cpu().isfinite().all().item<bool>());
      p.step();
    }
    summary = p.stop();
    ASSERT_EQ(p.traces(), std::vector<std::string>{path});
  }
  int64_t mm = 0, copies = 0;
  for (const auto& o : summary.ops) {
    if (o.name == "aten::mm") mm += o.calls;
    if (o.device == "cuda" && o.name.rfind("Memcpy DtoH", 0) == 0) copies += o.calls;
  }
  EXPECT_EQ(mm, 2) << "steps 3 and 4:\n" << summary.table(20);
  EXPECT_EQ(copies, 2) << summary.table(20);
  const std::string py = test_util::python("import json; d=json.load(open('" + path +
                                           "')); c=[e.get('cat') for e in d['traceEvents']]; "
                                           "print(c.count('kernel') >= 4, c.count('gpu_memcpy'))");
  EXPECT_EQ(py, "True 2");
  std::filesystem::remove(path);
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

// torch.profiler.schedule's arithmetic and transitions: steps skipped, waited, warmed up (profiled, discarded) and
// recorded, one trace per cycle; a cycle cut short by the end is written too.
TEST(Profile, AScheduleRecordsTheStepsItSelectsOneTracePerCycle) {
  const auto stem = (std::filesystem::temp_directory_path() / ("perf_sched_" + std::to_string(::getpid()))).string();
  const auto labels = [](const std::string& trace) {
    return test_util::python("import json; d=json.load(open('" + trace +
                             "')); n=sorted({e.get('name','') for e in d['traceEvents']}); "
                             "print(' '.join(x for x in n if x.startswith(('work', 'ProfilerStep#'))))");
  };
  PERF_EXPECT_THROW_MSG(
      perf::Profile(stem + ".json", perf::ProfileOptions().schedule(perf::ProfileSchedule().active(0))),
      "perf::ProfileSchedule::active: must be >= 1 (steps recorded a cycle), got 0");
  PERF_EXPECT_THROW_MSG(
      perf::Profile(stem + ".json", perf::ProfileOptions().schedule(perf::ProfileSchedule().wait(-1))),
      "perf::ProfileSchedule::wait: must be >= 0, got -1");
  // Kineto would log its failure to open the file at the end and drop the trace.
  PERF_EXPECT_THROW_MSG(perf::Profile(stem + "-missing/trace.json"),
                        "perf::Profile: the trace's directory '" + stem + "-missing' does not exist; create it first");
  const auto run = [](perf::Profile& p, int from, int to) {
    auto a = at::randn({16, 16});
    for (int k = from; k < to; ++k) {
      {
        perf::Range r("work" + std::to_string(k));
        a = at::mm(a, a).tanh();
      }
      p.step();
    }
  };
  std::ostringstream table;
  {
    perf::Profile p(stem + ".json", perf::ProfileOptions().out(&table).schedule(
                                        perf::ProfileSchedule().skip_first(1).wait(1).warmup(1).active(2).repeat(2)));
    PERF_EXPECT_THROW_MSG(perf::Profile(stem + "-x.json"), "another perf::Profile is running in this process");
    run(p, 0, 12);
    EXPECT_EQ(p.step_num(), 12);
    ASSERT_EQ(p.traces(), (std::vector<std::string>{stem + "-1.json", stem + "-2.json"}));
  }
  // Step 0 skipped, 1 waited, 2 warmed up, 3 and 4 recorded; 5 waited, 6 warmed up, 7 and 8 recorded; then none.
  EXPECT_EQ(labels(stem + "-1.json"), "ProfilerStep#3 ProfilerStep#4 work3 work4");
  EXPECT_EQ(labels(stem + "-2.json"), "ProfilerStep#7 ProfilerStep#8 work7 work8");
  EXPECT_FALSE(std::filesystem::exists(stem + "-3.json"));
  EXPECT_NE(table.str().find("trace written to " + stem + "-2.json"), std::string::npos) << table.str();
  {
    // One cycle (repeat 1) writes `path` itself; the end of the profile cuts it short and writes what it has.
    perf::Profile p(stem + ".json",
                    perf::ProfileOptions().top(0).schedule(perf::ProfileSchedule().warmup(1).active(3).repeat(1)));
    run(p, 0, 3);
    EXPECT_TRUE(p.traces().empty()) << "the cycle has a step to go";
    p.stop();
    ASSERT_EQ(p.traces(), std::vector<std::string>{stem + ".json"});
    PERF_EXPECT_THROW_MSG(p.step(), "perf::Profile::step: the profile has stopped");
  }
  // As in Python, the step under way when the profile stops (3, begun by the last step()) is in the trace too.
  EXPECT_EQ(labels(stem + ".json"), "ProfilerStep#1 ProfilerStep#2 ProfilerStep#3 work1 work2");
  {
    // Ended while warming up: nothing written, and the profiler is free again.
    perf::Profile p(stem + "-w.json",
                    perf::ProfileOptions().top(0).schedule(perf::ProfileSchedule().wait(1).warmup(2)));
    run(p, 0, 2);
  }
  EXPECT_FALSE(std::filesystem::exists(stem + "-w.json"));
  EXPECT_FALSE(torch::autograd::profiler::isProfilerEnabledInMainThread());
  {
    // Without a schedule every step is recorded, each labelled.
    perf::Profile p(stem + ".json", perf::ProfileOptions().top(0));
    run(p, 0, 2);
  }
  EXPECT_EQ(labels(stem + ".json"), "ProfilerStep#0 ProfilerStep#1 ProfilerStep#2 work0 work1");
  for (const auto& f : {stem + ".json", stem + "-1.json", stem + "-2.json"}) std::filesystem::remove(f);
}

TEST(Profile, WritesAChromeTraceWithRangesAndOperators) {
  const auto path = (std::filesystem::temp_directory_path() / ("perf_trace_" + std::to_string(::getpid()) + ".json"));
  std::filesystem::remove(path);
  std::ostringstream table;
  perf::ProfileSummary summary;
  // Refused before the profiler starts: the profile below starts as if it never was.
  PERF_EXPECT_THROW_MSG(perf::Profile(path.string(), perf::ProfileOptions().top(-1)),
                        "perf::ProfileOptions::top: must be >= 0 (0: no table), got -1");
  {
    perf::Profile p(path.string(), perf::ProfileOptions().record_shapes(true).out(&table).top(10));
    PERF_EXPECT_THROW_MSG(perf::Profile(path.string() + ".2"), "already running");
    auto a = at::randn({128, 128});
    for (int i = 0; i < 5; ++i) {
      perf::Range r("my_region");
      a = at::mm(a, a).tanh();
    }
    summary = p.stop();
    EXPECT_EQ(&p.stop(), &p.stop()) << "stop() is idempotent";
  }
  ASSERT_TRUE(std::filesystem::exists(path));
  const std::string py = test_util::python(
      "import json; d=json.load(open('" + path.string() +
      "')); n=[e.get('name') for e in d['traceEvents']]; print(n.count('my_region'), n.count('aten::mm'))");
  EXPECT_EQ(py, "5 5");
  const perf::OpStat* mm = nullptr;
  const perf::OpStat* region = nullptr;
  for (const auto& o : summary.ops) {
    if (o.name == "aten::mm") mm = &o;
    if (o.name == "my_region") region = &o;
  }
  ASSERT_TRUE(mm && region);
  EXPECT_EQ(mm->calls, 5);
  EXPECT_EQ(region->calls, 5);
  EXPECT_LE(mm->self_us, mm->total_us + 1e-9);
  EXPECT_LT(region->self_us, region->total_us) << "mm and tanh are nested in the region";
  EXPECT_GE(region->total_us, mm->total_us);
  for (size_t i = 1; i < summary.ops.size(); ++i) EXPECT_GE(summary.ops[i - 1].self_us, summary.ops[i].self_us);
  EXPECT_NE(table.str().find("trace written to"), std::string::npos);
  EXPECT_NE(table.str().find("aten::mm"), std::string::npos);
  std::filesystem::remove(path);
}
