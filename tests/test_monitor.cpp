// perf::Progress, perf::GpuMonitor (a scripted fake NVML here, the real one on a
// GPU machine against nvidia-smi) and perf::advise (each finding provoked, and a
// clean loop without findings).
#include <ATen/autocast_mode.h>
#include <perf/attention.h>
#include <perf/data.h>
#include <perf/memory_format.h>
#include <perf/monitor.h>
#include <perf/profile.h>
#include <torch/torch.h>

#include <thread>

#include "test_util.h"

namespace {

std::vector<std::string> lines_of(const std::string& text) { return test_util::lines(text); }

// PERF_FAKE_NVML (environment) overrides the build's path when the binary runs elsewhere.
std::string fake_nvml() { return test_util::fake_nvml_library(); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

struct ScopedThreads {
  explicit ScopedThreads(int n) : saved_(at::get_num_threads()) { at::set_num_threads(n); }
  ~ScopedThreads() { at::set_num_threads(saved_); }
  int saved_;
};

using test_util::ScopedCpuBf16;

using perf::detail::physical_cores;

// A small CNN step (forward + backward + SGD), optionally channels-last and bf16 autocast.
struct CnnStep {
  explicit CnnStep(bool channels_last, bool autocast) : autocast_(autocast) {
    torch::manual_seed(0);
    net = torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)), torch::nn::ReLU(),
                                torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).padding(1)),
                                torch::nn::AdaptiveAvgPool2d(1), torch::nn::Flatten(), torch::nn::Linear(16, 10));
    x = torch::randn({8, 3, 16, 16});
    if (channels_last) {
      perf::to_channels_last(*net);
      x = x.contiguous(torch::MemoryFormat::ChannelsLast);
    }
    y = torch::randint(0, 10, {8});
    opt = std::make_unique<torch::optim::SGD>(net->parameters(), 0.01);
  }
  void operator()() {
    opt->zero_grad();
    torch::Tensor loss;
    {
      if (autocast_) {
        at::autocast::set_autocast_enabled(at::kCPU, true);
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      }
      loss = torch::nn::functional::cross_entropy(net->forward(x).to(torch::kFloat), y);
      if (autocast_) {
        at::autocast::set_autocast_enabled(at::kCPU, false);
        at::autocast::clear_cache();
      }
    }
    loss.backward();
    opt->step();
  }
  bool autocast_;
  torch::nn::Sequential net{nullptr};
  torch::Tensor x, y;
  std::unique_ptr<torch::optim::SGD> opt;
};

}  // namespace

// --------------------------------------------------------------------------- Progress

TEST(Progress, LinesShowCountPercentRateEtaValuesAndMemory) {
  std::ostringstream out;
  {
    perf::Progress bar(100, perf::ProgressOptions()
                                .unit("img")
                                .every(std::chrono::milliseconds(0))
                                .stream(&out)
                                .style(perf::ProgressStyle::lines)
                                .description("train"));
    for (int i = 0; i < 10; ++i) bar.update(10, {{"loss", torch::tensor(0.5 + i)}, {"lr", 0.01}});
    EXPECT_EQ(bar.lines_drawn(), 10);
    EXPECT_EQ(bar.values_read(), 10) << "one read of the loss per drawn line";
  }
  const auto lines = lines_of(out.str());
  ASSERT_EQ(lines.size(), 11u) << out.str();
  EXPECT_TRUE(contains(lines[4], "train: 50/100  50% img")) << lines[4];
  EXPECT_TRUE(contains(lines[4], "img/s (avg ")) << lines[4];
  EXPECT_TRUE(contains(lines[4], "| ETA ")) << lines[4];
  EXPECT_TRUE(contains(lines[4], "| loss 4.5000 | lr 0.0100")) << lines[4];
  EXPECT_TRUE(contains(lines[4], "| rss ")) << lines[4];
  EXPECT_TRUE(contains(lines.back(), "100/100 100% img")) << lines.back();
  EXPECT_TRUE(contains(lines.back(), "| took ")) << lines.back();
  EXPECT_FALSE(contains(lines.back(), "ETA")) << lines.back();
  EXPECT_TRUE(contains(lines.back(), "| loss 9.5000")) << lines.back();
}

TEST(Progress, UpdatesReadNoTensorUntilALineIsDrawn) {
  std::ostringstream out;
  perf::Progress bar(0, perf::ProgressOptions().every(std::chrono::hours(1)).stream(&out).show_memory(false));
  const auto loss = torch::ones({4}, torch::requires_grad()) * 2;
  for (int i = 0; i < 1000; ++i) bar.update(3, {{"loss", loss}});
  EXPECT_EQ(bar.values_read(), 0) << "1000 updates, no line: no tensor read (no device sync on CUDA)";
  EXPECT_EQ(bar.lines_drawn(), 0);
  EXPECT_TRUE(out.str().empty());
  bar.close();
  EXPECT_EQ(bar.values_read(), 1);
  EXPECT_EQ(bar.done(), 3000);
  EXPECT_TRUE(contains(bar.last_line(), "3000 it |")) << bar.last_line();
  EXPECT_TRUE(contains(bar.last_line(), "| loss 2.0000")) << bar.last_line();
  EXPECT_FALSE(contains(bar.last_line(), "%")) << "no total, no percentage: " << bar.last_line();
  bar.update(5);
  EXPECT_EQ(bar.done(), 3000) << "updates after close are ignored";
}

TEST(Progress, RedrawsInPlaceOnATerminal) {
  std::ostringstream out;
  {
    perf::Progress bar(
        4,
        perf::ProgressOptions().every(std::chrono::milliseconds(0)).stream(&out).style(perf::ProgressStyle::terminal));
    for (int i = 0; i < 4; ++i) bar.update();
  }
  const auto text = out.str();
  EXPECT_EQ(std::count(text.begin(), text.end(), '\r'), 5);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << "one newline, after the final line";
  EXPECT_TRUE(contains(text, "\x1b[K"));
  EXPECT_EQ(text.back(), '\n');
}

TEST(Progress, RateFollowsTheItemsCounted) {
  std::ostringstream out;
  perf::Progress bar(0, perf::ProgressOptions().every(std::chrono::hours(1)).stream(&out).show_memory(false));
  bar.update(100);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  bar.update(100);
  bar.close();
  // 200 items in >= 0.2 s: at most 1000/s, and (this process is not that slow) at least 100/s.
  const auto line = bar.last_line();
  const auto bar_pos = line.find("| ");
  ASSERT_NE(bar_pos, std::string::npos) << line;
  const double rate = std::stod(line.substr(bar_pos + 2));
  EXPECT_LE(rate, 1000.0) << line;
  EXPECT_GE(rate, 100.0) << line;
}

TEST(Progress, UpdatesFromManyThreadsAreAllCounted) {
  std::ostringstream out;
  perf::Progress bar(4000, perf::ProgressOptions().every(std::chrono::milliseconds(1)).stream(&out).show_memory(false));
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) bar.update(1, {{"t", static_cast<double>(t)}});
    });
  }
  for (auto& th : threads) th.join();
  bar.close();
  EXPECT_EQ(bar.done(), 4000);
  EXPECT_TRUE(contains(bar.last_line(), "4000/4000 100%")) << bar.last_line();
}

TEST(Progress, BadArgumentsAreRefused) {
  PERF_EXPECT_THROW_MSG(perf::Progress(-1), "total must be >= 0 (0 = unknown), got -1");
  PERF_EXPECT_THROW_MSG(perf::Progress(1, perf::ProgressOptions().stream(nullptr)), "stream must not be null");
  std::ostringstream sink;
  perf::Progress bar(1, perf::ProgressOptions().show_memory(false).every(std::chrono::hours(1)).stream(&sink));
  PERF_EXPECT_THROW_MSG(bar.update(-2), "items must be >= 0, got -2");
  EXPECT_EQ(bar.done(), 0);
}

// --------------------------------------------------------------------------- GpuMonitor

TEST(GpuMonitor, WithoutNvmlItIsUnavailableAndSaysWhy) {
  perf::GpuMonitor missing(perf::GpuMonitorOptions().library("libnvidia-ml-perf-test-missing.so.1"));
  EXPECT_FALSE(missing.available());
  EXPECT_TRUE(contains(missing.reason(), "cannot load libnvidia-ml-perf-test-missing.so.1")) << missing.reason();
  EXPECT_TRUE(missing.samples().empty());
  EXPECT_TRUE(missing.read_now().empty());
  EXPECT_TRUE(contains(missing.summary().to_string(), "GPU monitor: unavailable: cannot load"));
  perf::GpuMonitor not_nvml(perf::GpuMonitorOptions().library("libc.so.6"));
  EXPECT_FALSE(not_nvml.available());
  EXPECT_TRUE(contains(not_nvml.reason(), "lacks nvmlInit_v2")) << not_nvml.reason();
  PERF_EXPECT_THROW_MSG(perf::GpuMonitor(perf::GpuMonitorOptions().interval(std::chrono::milliseconds(0))),
                        "interval must be > 0 ms, got 0");
  PERF_EXPECT_THROW_MSG(perf::GpuMonitor(perf::GpuMonitorOptions().max_samples(0)),
                        "perf::GpuMonitorOptions::max_samples must be >= 1, got 0");
}

TEST(GpuMonitor, SamplesEveryDeviceAndSummarises) {
  perf::GpuMonitor mon(perf::GpuMonitorOptions().library(fake_nvml()).interval(std::chrono::milliseconds(5)));
  ASSERT_TRUE(mon.available()) << mon.reason();
  EXPECT_EQ(mon.names(), (std::vector<std::string>{"Fake GPU 0", "Fake GPU 1"}));
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  mon.stop();
  const auto samples = mon.samples();
  ASSERT_EQ(samples.size(), 2u);
  const auto summary = mon.summary();
  for (size_t d = 0; d < 2; ++d) {
    ASSERT_GE(samples[d].size(), 5u) << "150 ms at 5 ms intervals";
    double mean = 0;
    for (const auto& s : samples[d]) mean += s.sm_util;
    mean /= static_cast<double>(samples[d].size());
    const auto& g = summary.devices[d];
    EXPECT_EQ(g.samples, samples[d].size());
    EXPECT_DOUBLE_EQ(g.mean_sm_util, mean);
    EXPECT_EQ(g.max_sm_util, 80.0);
    EXPECT_EQ(g.mem_total, 80ull << 30);
    EXPECT_EQ(g.max_mem_used, (d + 1) << 30);
    EXPECT_DOUBLE_EQ(g.mean_sm_clock_mhz, 1980.0);
    EXPECT_DOUBLE_EQ(g.max_power_w, 300.5);
    EXPECT_EQ(g.max_temperature_c, 40u + d);
    EXPECT_LT(samples[d].front().time_s, samples[d].back().time_s);
  }
  const auto n = samples[0].size();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(mon.samples()[0].size(), n) << "no samples after stop()";
  const auto text = summary.to_string();
  EXPECT_TRUE(contains(text, "gpu 1 Fake GPU 1:")) << text;
  EXPECT_TRUE(contains(text, "memory max 2.00 GiB of 80.00 GiB")) << text;
  EXPECT_TRUE(contains(text, "power mean 300.5 W")) << text;
}

TEST(GpuMonitor, ChosenDevicesOnlyAndOutOfRangeRefused) {
  perf::GpuMonitor one(perf::GpuMonitorOptions().library(fake_nvml()).devices({1}));
  ASSERT_TRUE(one.available());
  EXPECT_EQ(one.names(), std::vector<std::string>{"Fake GPU 1"});
  const auto now = one.read_now();
  ASSERT_EQ(now.size(), 1u);
  EXPECT_EQ(now[0].mem_used, 2ull << 30);
  PERF_EXPECT_THROW_MSG(perf::GpuMonitor(perf::GpuMonitorOptions().library(fake_nvml()).devices({0, 2})),
                        "devices: 2 is out of range, NVML sees 2 GPU(s) (0..1)");
}

TEST(GpuMonitor, OnGpuReadingsMatchNvidiaSmi) {
  perf::GpuMonitor mon(perf::GpuMonitorOptions().interval(std::chrono::milliseconds(20)));
  if (!mon.available()) GTEST_SKIP() << "skipped: " << mon.reason();
#if PERF_WITH_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: NVML works but CUDA sees no device";
  // nvidia-smi's view of GPU 0: name and total memory (MiB).
  const std::string smi =
      test_util::output_of("nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits -i 0");
  const auto comma = smi.find(',');
  ASSERT_NE(comma, std::string::npos) << smi;
  EXPECT_EQ(mon.names()[0], smi.substr(0, comma));
  const double smi_total_mib = std::stod(smi.substr(comma + 1));
  // Keep the GPU busy for a second: the monitor must see it.
  auto a = torch::randn({4096, 4096}, torch::kCUDA);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 10; ++i) a = torch::tanh(a.mm(a) * 1e-3);
    torch::cuda::synchronize();
  }
  mon.stop();
  const auto s = mon.summary();
  EXPECT_NEAR(static_cast<double>(s.devices[0].mem_total) / (1 << 20), smi_total_mib, 1.0);
  EXPECT_GT(s.devices[0].max_sm_util, 50.0) << s;
  EXPECT_GT(s.devices[0].max_mem_used, 256ull << 20) << "this process holds CUDA memory: " << s;
  EXPECT_GT(s.devices[0].mean_sm_clock_mhz, 0.0) << s;
  EXPECT_GT(s.devices[0].max_power_w, 0.0) << s;
  std::cout << s;
#endif
}

// --------------------------------------------------------------------------- advise

TEST(Advise, CleanCpuLoopHasNoFindings) {
  const auto cores = physical_cores();
  ScopedThreads threads(static_cast<int>(std::max<int64_t>(cores, 1)));
  const bool bf16 = perf::detail::cpu_bf16().native();
  CnnStep step(/*channels_last=*/true, /*autocast=*/bf16);
  const auto advice = perf::advise(std::ref(step), perf::AdviseOptions().steps(5).warmup(1));
  EXPECT_TRUE(advice.findings.empty()) << advice;
  EXPECT_EQ(advice.steps, 5);
  EXPECT_GT(advice.median_step_ms, 0.0);
  EXPECT_TRUE(contains(advice.to_string(), "no findings")) << advice;
}

TEST(Advise, NchwConvolutionsAreFound) {
  CnnStep step(/*channels_last=*/false, /*autocast=*/false);
  const auto advice = perf::advise(std::ref(step), perf::AdviseOptions().steps(3).warmup(1));
  ASSERT_TRUE(advice.has("convolutions on NCHW inputs")) << advice;
  EXPECT_TRUE(contains(advice.to_string(), "2 of 2 convolutions per step take contiguous (NCHW) inputs")) << advice;
  EXPECT_TRUE(contains(advice.to_string(), "perf::optimize(model)")) << advice;
}

TEST(Advise, AttentionWrittenOutIsFoundAndScaledDotProductAttentionIsNot) {
  const auto options = torch::nn::TransformerEncoderLayerOptions(32, 4).dim_feedforward(64).dropout(0.0);
  torch::nn::TransformerEncoderLayer stock(options);
  perf::TransformerEncoderLayer fast(options);
  const auto x = torch::randn({24, 2, 32});
  const auto mask = torch::nn::TransformerImpl::generate_square_subsequent_mask(24);
  const auto few = perf::AdviseOptions().steps(2).warmup(1);
  const auto stock_advice = perf::advise(
      [&] {
        stock->zero_grad();
        stock(x, mask).sum().backward();
      },
      few);
  ASSERT_TRUE(stock_advice.has("attention written out")) << stock_advice;
  EXPECT_TRUE(contains(stock_advice.to_string(), "1 softmax calls per step over matmul scores of shape [8, 24, 24]"))
      << stock_advice;
  EXPECT_TRUE(contains(stock_advice.to_string(), "perf/attention.h: perf::TransformerEncoderLayer")) << stock_advice;
  const auto fast_advice = perf::advise(
      [&] {
        fast->zero_grad();
        fast(x, mask, torch::Tensor(), true).sum().backward();
      },
      few);
  EXPECT_FALSE(fast_advice.has("attention written out")) << fast_advice;
  // Attention by hand: written out through matmul it is found (4-d scores of a folded bmm), through
  // scaled_dot_product_attention it is not, and a softmax over a linear layer's logits is no attention.
  const auto q = torch::randn({2, 4, 24, 8}), k = torch::randn({2, 4, 24, 8}), v = torch::randn({2, 4, 24, 8});
  const auto by_hand = perf::advise([&] { torch::softmax(torch::matmul(q, k.transpose(-2, -1)), -1).matmul(v); }, few);
  EXPECT_TRUE(contains(by_hand.to_string(), "over matmul scores of shape [2, 4, 24, 24]")) << by_hand;
  EXPECT_FALSE(perf::advise([&] { at::scaled_dot_product_attention(q, k, v); }, few).has("attention written out"));
  torch::nn::Linear head(32, 50);
  EXPECT_FALSE(perf::advise([&] { torch::softmax(head(x), -1); }, few).has("attention written out"));
}

TEST(Advise, FewerThreadsThanCoresIsFound) {
  const auto cores = physical_cores();
  if (cores < 2) GTEST_SKIP() << "skipped: this machine has " << cores << " physical core(s); the finding needs 2+";
  CnnStep step(true, perf::detail::cpu_bf16().native());
  {
    ScopedThreads one(1);
    const auto advice = perf::advise(std::ref(step), perf::AdviseOptions().steps(2).warmup(1));
    ASSERT_TRUE(advice.has("intra-op threads below the physical cores")) << advice;
    EXPECT_TRUE(contains(advice.to_string(), "1 intra-op threads on " + std::to_string(cores) + " physical cores"));
    EXPECT_TRUE(contains(advice.to_string(), "perf::Settings().num_threads(" + std::to_string(cores) + ")")) << advice;
  }
  ScopedThreads all(static_cast<int>(cores));
  EXPECT_FALSE(perf::advise(std::ref(step), perf::AdviseOptions().steps(2).warmup(1)).has("intra-op"));
}

// Where perf::init_process_group counted several of the job's processes on this
// machine, the threads are judged against this process's share of the cores.
TEST(Advise, ThreadsAreJudgedAgainstThisProcessShareOfTheCores) {
  const auto cores = physical_cores();
  if (cores < 2) GTEST_SKIP() << "skipped: this machine has " << cores << " physical core(s); two processes need 2+";
  const int share = static_cast<int>(cores / 2);
  CnnStep step(true, perf::detail::cpu_bf16().native());
  test_util::ScopedJobThreads two_processes(2);
  {
    ScopedThreads half_the_cores(share);
    const auto advice = perf::advise(std::ref(step), perf::AdviseOptions().steps(2).warmup(1));
    EXPECT_FALSE(advice.has("intra-op threads below the physical cores")) << advice;
    EXPECT_FALSE(advice.has("intra-op threads over this process's share of the cores")) << advice;
  }
  ScopedThreads all(static_cast<int>(cores));
  const auto advice = perf::advise(std::ref(step), perf::AdviseOptions().steps(2).warmup(1));
  ASSERT_TRUE(advice.has("intra-op threads over this process's share of the cores")) << advice;
  EXPECT_TRUE(contains(advice.to_string(), std::to_string(cores) + " intra-op threads on " + std::to_string(cores) +
                                               " physical cores shared by 2 processes of this job"))
      << advice;
  EXPECT_TRUE(contains(advice.to_string(), "perf::Settings().num_threads(" + std::to_string(share) + ")")) << advice;
}

TEST(Advise, Fp32OnANativeBf16CpuIsFoundAndOnlyThere) {
  ScopedThreads threads(static_cast<int>(std::max<int64_t>(physical_cores(), 1)));
  CnnStep fp32(true, false);
  {
    ScopedCpuBf16 native(true);
    const auto advice = perf::advise(std::ref(fp32), perf::AdviseOptions().steps(2).warmup(1));
    ASSERT_TRUE(advice.has("bf16 autocast off on a CPU with native bf16")) << advice;
    EXPECT_TRUE(contains(advice.to_string(), "avx512_bf16=yes")) << advice;
    CnnStep bf16(true, true);
    EXPECT_FALSE(perf::advise(std::ref(bf16), perf::AdviseOptions().steps(2).warmup(1)).has("bf16")) << "autocast on";
  }
  ScopedCpuBf16 emulated(false);
  EXPECT_FALSE(perf::advise(std::ref(fp32), perf::AdviseOptions().steps(2).warmup(1)).has("bf16"))
      << "no finding where bf16 is emulated (fp32 is faster there)";
}

namespace {
struct SlowDataset : torch::data::datasets::Dataset<SlowDataset> {
  torch::data::Example<> get(size_t i) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    return {torch::full({4}, static_cast<double>(i)), torch::tensor(static_cast<int64_t>(i))};
  }
  std::optional<size_t> size() const override { return 100000; }
};
}  // namespace

TEST(Advise, WaitingOnDataIsFoundInPrefetchAndInDataRanges) {
  ScopedThreads threads(static_cast<int>(std::max<int64_t>(physical_cores(), 1)));
  // perf::prefetch over a loader whose samples take 3 ms each: 4 per batch.
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      SlowDataset().map(torch::data::transforms::Stack<>()), perf::loader_options(4, perf::LoaderTuning().workers(0)));
  auto batches = perf::prefetch(*loader, torch::kCPU);
  auto it = batches.begin();
  auto w = torch::randn({4, 4});
  int64_t seen = 0;
  auto step = [&] {
    auto& b = *it;
    seen += b.data.size(0);
    w = w + b.data.sum() * 1e-6;
    ++it;
  };
  const auto advice = perf::advise(step, perf::AdviseOptions().steps(5).warmup(1));
  EXPECT_EQ(seen, 4 * 6);
  ASSERT_TRUE(advice.has("the loop waits on data")) << advice;
  EXPECT_TRUE(contains(advice.to_string(), "perf::prefetch(loader, device)")) << advice;
  // The user's own loading, labelled with perf::Range("data").
  auto labelled = [] {
    {
      perf::Range r("data");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    torch::mm(torch::ones({8, 8}), torch::ones({8, 8}));
  };
  EXPECT_TRUE(perf::advise(labelled, perf::AdviseOptions().steps(3).warmup(0)).has("waits on data"));
  // The same time spent outside a data scope is not a data wait.
  auto unlabelled = [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    torch::mm(torch::ones({8, 8}), torch::ones({8, 8}));
  };
  EXPECT_FALSE(perf::advise(unlabelled, perf::AdviseOptions().steps(3).warmup(0)).has("waits on data"));
}

TEST(Advise, BadOptionsAndAThrowingStepLeaveNothingBehind) {
  PERF_EXPECT_THROW_MSG(perf::advise([] {}, perf::AdviseOptions().steps(0)), "steps must be >= 1, got 0");
  PERF_EXPECT_THROW_MSG(perf::advise([] {}, perf::AdviseOptions().data_wait_share(1.5)),
                        "data_wait_share must be in (0, 1), got 1.5");
  int calls = 0;
  auto throwing = [&] {
    if (++calls == 3) TORCH_CHECK(false, "user step failed");
  };
  PERF_EXPECT_THROW_MSG(perf::advise(throwing, perf::AdviseOptions().steps(5).warmup(1)), "user step failed");
  // The observer is gone: a second advise runs normally.
  CnnStep step(false, false);
  EXPECT_TRUE(perf::advise(std::ref(step), perf::AdviseOptions().steps(2).warmup(0)).has("NCHW"));
}

// The device under study is the one the step's operators run on: a CPU loop
// is studied as one on a machine with a GPU too (where it was once reported as
// "steps on cuda" with CUDA findings and without its CPU ones).
TEST(Advise, TheDeviceIsTheOneTheStepRunsOn) {
  CnnStep step(true, false);
  for (int warmup : {0, 1}) {
    const auto advice = perf::advise(std::ref(step), perf::AdviseOptions().steps(2).warmup(warmup));
    EXPECT_EQ(advice.device, c10::Device(c10::kCPU)) << advice;
    EXPECT_TRUE(contains(advice.to_string(), "steps on cpu")) << advice;
  }
  EXPECT_EQ(perf::advise(std::ref(step), perf::AdviseOptions().steps(1).device(c10::Device(c10::kCPU))).device,
            c10::Device(c10::kCPU));
#if PERF_WITH_CUDA
  if (!torch::cuda::is_available()) {
    PERF_EXPECT_THROW_MSG(perf::advise(std::ref(step), perf::AdviseOptions().device(c10::Device(c10::kCUDA))),
                          "AdviseOptions().device(cuda) but this process sees no CUDA device");
  }
#else
  PERF_EXPECT_THROW_MSG(perf::advise(std::ref(step), perf::AdviseOptions().device(c10::Device(c10::kCUDA))),
                        "device cuda needs perf built with CUDA");
#endif
}

// "Static shapes" (the cuDNN autotuning finding) means every step calls the
// same convolutions on the same input shapes, in order.
TEST(Advise, StaticShapesMeanTheSameConvolutionShapesInEveryStep) {
  perf::detail::AdviseCounters c;
  for (int step = 0; step < 3; ++step) {
    c.conv_shapes = {{8, 3, 32, 32}, {8, 16, 32, 32}, {8, 32, 16, 16}};  // three convolutions, three shapes
    c.end_step();
  }
  EXPECT_FALSE(c.conv_shapes_vary) << "three shapes in one step are static when every step repeats them";
  c.conv_shapes = {{4, 3, 32, 32}, {4, 16, 32, 32}, {4, 32, 16, 16}};  // a smaller batch
  c.end_step();
  EXPECT_TRUE(c.conv_shapes_vary);
}

TEST(Advise, OnGpuFindsSyncsPageableCopiesPrecisionAndLaunchBoundSteps) {
#if PERF_WITH_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const auto cuda = torch::Device(torch::kCUDA);
  // A tiny MLP: many small kernels, an .item() per step, a pageable input copy, fp32 without autocast.
  torch::nn::Sequential mlp;
  for (int i = 0; i < 8; ++i) {
    mlp->push_back(torch::nn::Linear(64, 64));
    mlp->push_back(torch::nn::ReLU());
  }
  mlp->to(cuda);
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  const auto host_x = torch::randn({32, 64});  // pageable
  double last = 0;
  auto noisy = [&] {
    opt.zero_grad();
    auto loss = mlp->forward(host_x.to(cuda)).pow(2).mean();
    loss.backward();
    opt.step();
    last = loss.item<double>();
  };
  // The pageable copy makes the observer ask is_pinned(), an operator of its
  // own: once a deadlock (the observer re-entered itself holding its lock).
  const auto advice = perf::advise(noisy, perf::AdviseOptions().steps(10).warmup(2));
  std::cout << advice;
  EXPECT_TRUE(advice.device.is_cuda()) << advice;
  EXPECT_TRUE(advice.has("host-device syncs")) << advice;
  EXPECT_TRUE(contains(advice.to_string(), "aten::item")) << advice;
  EXPECT_TRUE(advice.has("pageable host-to-device copies")) << advice;
  EXPECT_TRUE(advice.has("fp32 matmuls/convolutions")) << advice;
  EXPECT_TRUE(advice.has("launch-bound step")) << advice;
  EXPECT_NE(last, 0.0);
  // cuDNN autotuning off with static shapes.
  {
    const bool saved = at::globalContext().benchmarkCuDNN();
    at::globalContext().setBenchmarkCuDNN(false);
    CnnStep conv(true, false);
    conv.net->to(cuda);
    conv.x = conv.x.to(cuda);
    conv.y = conv.y.to(cuda);
    conv.opt = std::make_unique<torch::optim::SGD>(conv.net->parameters(), 0.01);
    const auto a = perf::advise(std::ref(conv), perf::AdviseOptions().steps(3).warmup(1));
    EXPECT_TRUE(a.has("cuDNN autotuning off")) << a;
    EXPECT_TRUE(contains(a.to_string(),
                         "2 convolutions per step, each with the same input shape in every one of 3 "
                         "steps; cudnn_benchmark off"))
        << a;
    // Batches of alternating sizes are not static: no such finding.
    const auto full = conv.x, full_y = conv.y;
    int k = 0;
    auto varying = [&] {
      conv.x = (k % 2) ? full.narrow(0, 0, full.size(0) / 2) : full;
      conv.y = (k++ % 2) ? full_y.narrow(0, 0, full_y.size(0) / 2) : full_y;
      conv();
    };
    EXPECT_FALSE(perf::advise(varying, perf::AdviseOptions().steps(4).warmup(1)).has("cuDNN autotuning off"));
    conv.x = full;
    conv.y = full_y;
    at::globalContext().setBenchmarkCuDNN(saved);
  }
  // A clean large step: pinned prefetch-style input, bf16 autocast, no syncs. Its GPU work (5 bf16 matmuls
  // of 1.1 TFLOP each: at least 5.6 ms at an H100's or H200's bf16 peak) must outlast the host's launching even
  // on a host that ctest -j16 loads: with matmuls 8x smaller, an H200 under ctest -j16 found this step
  // launch-bound (the host launching for 93% of a 4.83 ms step).
  {
    const bool saved = at::globalContext().benchmarkCuDNN();
    at::globalContext().setBenchmarkCuDNN(true);
    torch::nn::Sequential big(torch::nn::Linear(4096, 8192), torch::nn::ReLU(), torch::nn::Linear(8192, 4096));
    big->to(cuda);
    torch::optim::SGD o(big->parameters(), 0.01);
    const auto x = torch::randn({16384, 4096}, cuda);
    auto clean = [&] {
      o.zero_grad();
      torch::Tensor loss;
      {
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        loss = big->forward(x).to(torch::kFloat).pow(2).mean();
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
      }
      loss.backward();
      o.step();
    };
    const auto a = perf::advise(clean, perf::AdviseOptions().steps(5).warmup(2));
    at::globalContext().setBenchmarkCuDNN(saved);
    EXPECT_TRUE(a.findings.empty()) << a;
  }
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}
