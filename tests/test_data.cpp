// Tests for perf/data.h: loader options, the prefetcher, the worker autotuner.
#include <gtest/gtest.h>
#include <perf/data.h>
#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include "test_util.h"

namespace {

// Sample i: data = [i, i, i] (float), target = i; throws for `bad_index`.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  explicit IndexDataset(size_t n, int64_t bad_index = -1, int spin_us = 0)
      : n_(n), bad_(bad_index), spin_us_(spin_us) {}
  torch::data::Example<> get(size_t i) override {
    if (static_cast<int64_t>(i) == bad_) throw std::runtime_error("bad sample " + std::to_string(i));
    if (spin_us_ > 0) {  // decode-like CPU work
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      while (std::chrono::steady_clock::now() < until) {
      }
    }
    const auto v = static_cast<float>(i);
    return {torch::full({3}, v), torch::tensor(static_cast<int64_t>(i))};
  }
  std::optional<size_t> size() const override { return n_; }
  size_t n_;
  int64_t bad_;
  int spin_us_;
};

// uint8 "images" 3 x 4 x 5 with a per-sample pattern.
struct ImageDataset : torch::data::datasets::Dataset<ImageDataset> {
  torch::data::Example<> get(size_t i) override {
    auto img = (torch::arange(60, torch::kInt64).reshape({3, 4, 5}) * 3 + static_cast<int64_t>(i) * 7) % 256;
    return {img.to(torch::kUInt8), torch::tensor(static_cast<int64_t>(i))};
  }
  std::optional<size_t> size() const override { return 10; }
};

template <typename Loader>
std::vector<int64_t> targets_of_epoch(Loader& loader, c10::Device device = c10::kCPU) {
  std::vector<int64_t> seen;
  for (auto& batch : perf::prefetch(loader, device)) {
    const torch::Tensor t = batch.target.to(torch::kCPU);
    const torch::Tensor d = batch.data.to(torch::kCPU);
    EXPECT_EQ(batch.data.device().type(), device.type());
    for (int64_t k = 0; k < t.numel(); ++k) {
      seen.push_back(t[k].template item<int64_t>());
      EXPECT_EQ(d[k][0].template item<float>(), static_cast<float>(seen.back())) << "data and target stay paired";
    }
  }
  return seen;
}

using test_util::has_cuda;

}  // namespace

// --------------------------------------------------------------------------- loader_options

TEST(LoaderOptions, DefaultsAndOverrides) {
  const auto o = perf::loader_options(64);
  const size_t expect_workers = std::clamp<size_t>(std::thread::hardware_concurrency() / 2, 1, 8);
  EXPECT_EQ(o.batch_size(), 64u);
  EXPECT_EQ(o.workers(), expect_workers);
  ASSERT_TRUE(o.max_jobs().has_value());
  EXPECT_EQ(*o.max_jobs(), expect_workers * 2);
  EXPECT_FALSE(o.drop_last()) << "PyTorch's default: every sample, every epoch";
  EXPECT_TRUE(o.enforce_ordering());
  const auto c = perf::loader_options(
      8, perf::LoaderTuning().workers(3).prefetch_factor(4).drop_last(false).enforce_ordering(false).timeout(
             std::chrono::milliseconds(500)));
  EXPECT_EQ(c.workers(), 3u);
  EXPECT_EQ(*c.max_jobs(), 12u);
  EXPECT_FALSE(c.drop_last());
  EXPECT_EQ(perf::describe(c),
            "batch_size=8 workers=3 max_jobs=12 drop_last=false enforce_ordering=false timeout=500ms");
  EXPECT_FALSE(perf::loader_options(8, perf::LoaderTuning().workers(0)).max_jobs().has_value());
  PERF_EXPECT_THROW_MSG(perf::loader_options(0), "batch_size must be >= 1");
  const int64_t negative = -1;  // a negative count, as a program computing a batch size may give
  PERF_EXPECT_THROW_MSG(perf::loader_options(static_cast<size_t>(negative)),
                        "batch_size must be >= 1, got -1 (a negative value, converted to size_t)");
  PERF_EXPECT_THROW_MSG(perf::loader_options(8, perf::LoaderTuning().workers(static_cast<size_t>(negative))),
                        "perf::LoaderTuning::workers must be >= 0, got -1 (a negative value, converted to size_t)");
  PERF_EXPECT_THROW_MSG(perf::loader_options(torch::data::DataLoaderOptions(8),
                                             perf::LoaderTuning().prefetch_factor(static_cast<size_t>(negative))),
                        "perf::LoaderTuning::prefetch_factor must be >= 1, got -1");
  PERF_EXPECT_THROW_MSG(perf::loader_options(4, perf::LoaderTuning().prefetch_factor(0)), "prefetch_factor");
}

// --------------------------------------------------------------------------- sample accounting

TEST(Prefetch, EverySampleExactlyOncePerEpochInOrder) {
  const size_t n = 103;
  for (size_t workers : {0u, 1u, 2u, 3u}) {
    auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        IndexDataset(n).map(torch::data::transforms::Stack<>()),
        perf::loader_options(8, perf::LoaderTuning().workers(workers).drop_last(false)));
    for (int epoch = 0; epoch < 3; ++epoch) {
      const auto seen = targets_of_epoch(*loader);
      std::vector<int64_t> expect(n);
      std::iota(expect.begin(), expect.end(), 0);
      EXPECT_EQ(seen, expect) << "workers=" << workers << " epoch=" << epoch;
    }
  }
}

TEST(Prefetch, RandomSamplerEpochsArePermutations) {
  const size_t n = 50;
  auto loader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
      IndexDataset(n).map(torch::data::transforms::Stack<>()),
      perf::loader_options(7, perf::LoaderTuning().workers(2).drop_last(false)));
  std::vector<std::vector<int64_t>> epochs;
  for (int e = 0; e < 3; ++e) {
    auto seen = targets_of_epoch(*loader);
    epochs.push_back(seen);
    std::sort(seen.begin(), seen.end());
    std::vector<int64_t> expect(n);
    std::iota(expect.begin(), expect.end(), 0);
    EXPECT_EQ(seen, expect) << "epoch " << e;
  }
  EXPECT_NE(epochs[0], epochs[1]);
}

TEST(Prefetch, DropLastAndTinyDatasets) {
  auto count = [](size_t n, size_t batch, bool drop_last) {
    auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        IndexDataset(n).map(torch::data::transforms::Stack<>()),
        perf::loader_options(batch, perf::LoaderTuning().workers(2).drop_last(drop_last)));
    std::vector<int64_t> sizes;
    for (auto& b : perf::prefetch(*loader, torch::kCPU)) sizes.push_back(b.data.size(0));
    return sizes;
  };
  EXPECT_EQ(count(103, 8, true), std::vector<int64_t>(12, 8));
  auto no_drop = count(103, 8, false);
  EXPECT_EQ(no_drop.size(), 13u);
  EXPECT_EQ(no_drop.back(), 7);
  EXPECT_TRUE(count(5, 8, true).empty()) << "batch larger than the dataset, drop_last";
  EXPECT_EQ(count(5, 8, false), std::vector<int64_t>{5});
  EXPECT_TRUE(count(0, 4, false).empty()) << "empty dataset ends at once";
  EXPECT_EQ(count(1, 1, true), std::vector<int64_t>{1});
}

TEST(Prefetch, DatasetExceptionReachesTheConsumer) {
  for (size_t workers : {0u, 2u}) {
    auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        IndexDataset(40, /*bad_index=*/13).map(torch::data::transforms::Stack<>()),
        perf::loader_options(4, perf::LoaderTuning().workers(workers)));
    try {
      for (auto& b : perf::prefetch(*loader, torch::kCPU)) (void)b;
      ADD_FAILURE() << "no exception";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("bad sample 13"), std::string::npos) << e.what();
    }
  }
}

// --------------------------------------------------------------------------- conversions

TEST(Prefetch, ConversionsEqualDoingItByHand) {
  const std::vector<double> mean = {100, 120, 140}, stdv = {50, 60, 70};
  auto by_hand = [&](const torch::Tensor& x) {
    auto m = torch::tensor(mean).to(torch::kFloat).view({1, 3, 1, 1});
    auto s = torch::tensor(stdv).to(torch::kFloat).view({1, 3, 1, 1});
    return ((x.to(torch::kFloat) - m) / s).contiguous(torch::MemoryFormat::ChannelsLast);
  };
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      ImageDataset().map(torch::data::transforms::Stack<>()),
      perf::loader_options(4, perf::LoaderTuning().workers(1).drop_last(true)));
  const auto opts = perf::PrefetchOptions().dtype(torch::kFloat).mean(mean).std(stdv).channels_last(true);
  int batches = 0;
  std::vector<torch::Tensor> raw;
  for (auto& b : *loader) raw.push_back(b.data.clone());
  for (auto& b : perf::prefetch(*loader, torch::kCPU, opts)) {
    EXPECT_EQ(b.data.scalar_type(), torch::kFloat);
    EXPECT_TRUE(b.data.is_contiguous(torch::MemoryFormat::ChannelsLast));
    EXPECT_TRUE(torch::allclose(b.data, by_hand(raw.at(static_cast<size_t>(batches))), 1e-6, 1e-6));
    EXPECT_EQ(b.target.scalar_type(), torch::kLong) << "targets are not converted";
    ++batches;
  }
  EXPECT_EQ(batches, 2);
  // Into bf16 and fp16 with ImageNet's statistics (not exact in bf16): (x - mean) / std computed in float32 and
  // rounded once, as by hand (computed in bf16 itself, 337 of these 480 values differ, by up to 0.016).
  const std::vector<double> imagenet_mean = {123.7, 116.3, 103.5}, imagenet_std = {58.4, 57.1, 57.4};
  const auto m = torch::tensor(imagenet_mean).to(torch::kFloat).view({1, 3, 1, 1});
  const auto s = torch::tensor(imagenet_std).to(torch::kFloat).view({1, 3, 1, 1});
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto low = perf::PrefetchOptions().dtype(dtype).mean(imagenet_mean).std(imagenet_std).channels_last(true);
    batches = 0;
    for (auto& b : perf::prefetch(*loader, torch::kCPU, low)) {
      EXPECT_EQ(b.data.scalar_type(), dtype);
      EXPECT_TRUE(b.data.is_contiguous(torch::MemoryFormat::ChannelsLast));
      const auto want = ((raw.at(static_cast<size_t>(batches)).to(torch::kFloat) - m) / s).to(dtype);
      EXPECT_TRUE(torch::equal(b.data, want)) << (b.data.to(torch::kFloat) - want.to(torch::kFloat)).abs().max();
      ++batches;
    }
    EXPECT_EQ(batches, 2);
  }
}

TEST(Prefetch, VectorOfExamplesBeforeStacking) {
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      ImageDataset(), perf::loader_options(3, perf::LoaderTuning().workers(1).drop_last(true)));
  size_t samples = 0;
  for (auto& batch : perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().mean({10, 20, 30}).std({2, 4, 8}))) {
    for (auto& ex : batch) {
      const auto expect = (ImageDataset().get(static_cast<size_t>(ex.target.item<int64_t>())).data.to(torch::kFloat) -
                           torch::tensor({10.f, 20.f, 30.f}).view({3, 1, 1})) /
                          torch::tensor({2.f, 4.f, 8.f}).view({3, 1, 1});
      EXPECT_TRUE(torch::allclose(ex.data, expect)) << "per-sample CHW: channel dim 0";
      ++samples;
    }
  }
  EXPECT_EQ(samples, 9u) << "drop_last: 3 batches of 3";
}

namespace {

struct MyBatch {
  torch::Tensor image, label;
  int64_t first_index = -1;
};

struct MyBatchDataset : torch::data::datasets::BatchDataset<MyBatchDataset, MyBatch> {
  MyBatch get_batch(c10::ArrayRef<size_t> idx) override {
    MyBatch b;
    b.image = torch::ones({static_cast<int64_t>(idx.size()), 2, 3, 3}, torch::kUInt8) * 10;
    b.label = torch::zeros({static_cast<int64_t>(idx.size())}, torch::kLong);
    b.first_index = static_cast<int64_t>(idx[0]);
    return b;
  }
  std::optional<size_t> size() const override { return 12; }
};

}  // namespace

template <>
struct perf::BatchTraits<MyBatch> {
  template <typename F>
  static MyBatch map(MyBatch b, F&& f) {
    b.image = f(b.image, true);
    b.label = f(b.label, false);
    return b;
  }
};

TEST(Prefetch, UserBatchTypesThroughBatchTraits) {
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      MyBatchDataset(), perf::loader_options(4, perf::LoaderTuning().workers(0)));
  std::vector<int64_t> firsts;
  for (auto& b :
       perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().dtype(torch::kHalf).mean({4, 4}).std({2, 2}))) {
    EXPECT_EQ(b.image.scalar_type(), torch::kHalf);
    EXPECT_TRUE(torch::all(b.image == 3).item<bool>());  // (10 - 4) / 2
    EXPECT_EQ(b.label.scalar_type(), torch::kLong);
    firsts.push_back(b.first_index);
  }
  EXPECT_EQ(firsts, (std::vector<int64_t>{0, 4, 8}));
}

TEST(Prefetch, BadOptionsAndMismatchedChannels) {
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      ImageDataset().map(torch::data::transforms::Stack<>()), perf::loader_options(4, perf::LoaderTuning().workers(0)));
  PERF_EXPECT_THROW_MSG(perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().depth(0)),
                        "perf::PrefetchOptions::depth must be >= 1, got 0");
  const int64_t negative = -1;
  PERF_EXPECT_THROW_MSG(
      perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().depth(static_cast<size_t>(negative))),
      "perf::PrefetchOptions::depth must be >= 1, got -1 (a negative value, converted to size_t)");
  PERF_EXPECT_THROW_MSG(perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().mean({1, 2}).std({1})),
                        "mean has 2 values but std has 1");
  PERF_EXPECT_THROW_MSG(perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().mean({1}).std({0})),
                        "std: values must be > 0");
  PERF_EXPECT_THROW_MSG(perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().dtype(torch::kInt)),
                        "must be a floating type");
  if (!has_cuda()) PERF_EXPECT_THROW_MSG(perf::prefetch(*loader, torch::kCUDA), "cuda");
  try {
    for (auto& b : perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().mean({1, 2}).std({1, 1}))) (void)b;
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("mean/std have 2 channels"), std::string::npos);
  }
}

TEST(Prefetch, CpuIsAPassThrough) {
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      IndexDataset(9).map(torch::data::transforms::Stack<>()),
      perf::loader_options(3, perf::LoaderTuning().workers(0)));
  auto p = perf::prefetch(*loader, torch::kCPU);
  EXPECT_FALSE(p.asynchronous());
  for (auto& b : p) EXPECT_FALSE(b.data.is_pinned()) << "no pinning for a CPU target";
  // pin(true) for a CPU target: a warning and no pinning (as Python's DataLoader without an accelerator), not an
  // error from the pin at the first batch on a machine without CUDA.
  test_util::CollectWarnings warnings;
  auto pinned = perf::prefetch(*loader, torch::kCPU, perf::PrefetchOptions().pin(true));
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("pin(true) has no effect for a cpu target"), std::string::npos)
      << warnings.messages[0];
  size_t batches = 0;
  for (auto& b : pinned) {
    EXPECT_FALSE(b.data.is_pinned());
    ++batches;
  }
  EXPECT_EQ(batches, 3u);
}

TEST(Prefetch, OnGpuArrivesOnTheDeviceInOrder) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const size_t n = 203;
  for (size_t workers : {0u, 2u}) {
    auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        IndexDataset(n).map(torch::data::transforms::Stack<>()),
        perf::loader_options(16, perf::LoaderTuning().workers(workers).drop_last(false)));
    auto p = perf::prefetch(*loader, torch::kCUDA);
    EXPECT_TRUE(p.asynchronous());
    for (int epoch = 0; epoch < 2; ++epoch) {
      const auto seen = targets_of_epoch(*loader, torch::kCUDA);
      std::vector<int64_t> expect(n);
      std::iota(expect.begin(), expect.end(), 0);
      EXPECT_EQ(seen, expect);
    }
  }
  // Conversions on the device equal the CPU path.
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      ImageDataset().map(torch::data::transforms::Stack<>()), perf::loader_options(5, perf::LoaderTuning().workers(1)));
  const auto opts = perf::PrefetchOptions().dtype(torch::kFloat).mean({1, 2, 3}).std({4, 5, 6}).channels_last(true);
  std::vector<torch::Tensor> cpu, gpu;
  for (auto& b : perf::prefetch(*loader, torch::kCPU, opts)) cpu.push_back(b.data);
  for (auto& b : perf::prefetch(*loader, torch::kCUDA, opts)) {
    EXPECT_TRUE(b.data.is_contiguous(torch::MemoryFormat::ChannelsLast));
    gpu.push_back(b.data.cpu());
  }
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) EXPECT_TRUE(torch::allclose(cpu[i], gpu[i], 1e-6, 1e-6));
  // An exception in the dataset reaches the consumer across the producer thread.
  auto bad = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      IndexDataset(40, 21).map(torch::data::transforms::Stack<>()),
      perf::loader_options(4, perf::LoaderTuning().workers(1)));
  // LibTorch's DataLoader wraps it in its WorkerException (a std::exception, not a c10::Error).
  try {
    for (auto& b : perf::prefetch(*bad, torch::kCUDA)) (void)b;
    ADD_FAILURE() << "no exception";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("bad sample 21"), std::string::npos) << e.what();
  }
}

// --------------------------------------------------------------------------- tune_workers

TEST(TuneWorkers, MeasuresEachCandidateAndReturnsTheBest) {
  auto make = [](size_t workers) {
    return torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        IndexDataset(64, -1, /*spin_us=*/300).map(torch::data::transforms::Stack<>()),
        perf::loader_options(4, perf::LoaderTuning().workers(workers)));
  };
  std::ostringstream log;
  const size_t best = perf::tune_workers(make, {0, 1, 2}, std::chrono::milliseconds(1500), &log);
  const std::string text = log.str();
  EXPECT_TRUE(best == 0 || best == 1 || best == 2);
  for (const char* line : {"[1/3] workers=0", "[2/3] workers=1", "[3/3] workers=2", "batches/s", "<- best"})
    EXPECT_NE(text.find(line), std::string::npos) << line << " missing in:\n" << text;
  // A spent budget skips the remaining candidates and says so.
  std::ostringstream short_log;
  perf::tune_workers(make, {0, 1, 2}, std::chrono::milliseconds(1), &short_log);  // one batch takes 1.2 ms
  EXPECT_NE(short_log.str().find("budget spent, skipping workers=2"), std::string::npos) << short_log.str();
  PERF_EXPECT_THROW_MSG(perf::tune_workers(make, {1}, std::chrono::seconds(0), nullptr), "budget must be > 0");
}
