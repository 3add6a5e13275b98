// Tests for perf/data.h (loader options, the prefetcher, the worker autotuner) and perf/state_dict.h
// (weights and checkpoints to and from Python's torch.save files).
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <perf/data.h>
#include <perf/state_dict.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
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

// ---------------------------------------------------------------------------
// perf/state_dict.h

namespace {

// A module with parameters and buffers of its own beside its children's, and its Python twin (TWIN_PY).
struct TwinNetImpl : torch::nn::Module {
  TwinNetImpl() {
    scale = register_parameter("scale", torch::ones({1}));
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    steps = register_buffer("steps", torch::zeros({}, torch::kLong));
    head = register_module("head", torch::nn::Linear(64, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return head(torch::relu(bn(conv(x))).flatten(1)) * scale; }
  at::Tensor scale, steps;
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TwinNet);

const char* const TWIN_PY =
    "import torch, torch.nn as nn\n"
    "class TwinNet(nn.Module):\n"
    "    def __init__(s):\n"
    "        super().__init__()\n"
    "        s.scale = nn.Parameter(torch.ones(1))\n"
    "        s.conv = nn.Conv2d(3, 4, 3, bias=False)\n"
    "        s.bn = nn.BatchNorm2d(4)\n"
    "        s.register_buffer('steps', torch.zeros((), dtype=torch.long))\n"
    "        s.head = nn.Linear(64, 5)\n"
    "    def forward(s, x):\n"
    "        return s.head(torch.relu(s.bn(s.conv(x))).flatten(1)) * s.scale\n"
    "x = torch.linspace(-1, 1, 2 * 3 * 6 * 6).reshape(2, 3, 6, 6)\n";

at::Tensor twin_input() { return torch::linspace(-1, 1, 2 * 3 * 6 * 6).reshape({2, 3, 6, 6}); }

at::Tensor eval_output(TwinNet& net) {
  torch::NoGradGuard no_grad;
  net->eval();
  return net->forward(twin_input());
}

// A zip archive as torch.save lays it out, with this pickle and these storage records.
void write_archive(const std::string& path, const std::string& pickle,
                   const std::vector<std::pair<std::string, std::string>>& records = {}) {
  caffe2::serialize::PyTorchStreamWriter w(path);
  w.writeRecord("data.pkl", pickle.data(), pickle.size());
  for (const auto& r : records) w.writeRecord(r.first, r.second.data(), r.second.size());
  w.writeEndOfFile();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string data_pkl(const std::string& path) {
  caffe2::serialize::PyTorchStreamReader r(path);
  auto [ptr, n] = r.getRecord("data.pkl");
  return std::string(static_cast<const char*>(ptr.get()), n);
}

// Writes `bytes` to `path` and reads it with `read`: whether it was refused. A refusal must be a c10::Error whose
// message starts with `prefix` (the reader naming itself), never a crash or another exception.
template <class Read>
bool refused_when_read(const std::string& path, const std::string& bytes, Read&& read, const std::string& prefix) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  try {
    read(path);
    return false;
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()).rfind(prefix, 0), 0u) << e.what_without_backtrace();
    return true;
  }
}

}  // namespace

TEST(StateDict, APythonStateDictLoadsIntoTheLibTorchTwinAndBack) {
  test_util::TempDir dir;
  const auto from_python = dir / "from_python.pt", from_cpp = dir / "from_cpp.pt";
  // Python trains BatchNorm's statistics one step, saves the state_dict (an OrderedDict, which LibTorch's
  // own torch::pickle_load cannot read), and prints its keys and its eval() output.
  const auto out = test_util::lines(
      test_util::python(std::string(TWIN_PY) +
                        "torch.manual_seed(5)\nm = TwinNet()\nm(x * 3 + 1)\nm.steps.fill_(7)\n"
                        "torch.save(m.state_dict(), '" +
                        from_python +
                        "')\n"
                        "print(' '.join(m.state_dict().keys()))\nm.eval()\nprint(*m(x).flatten().tolist())\n"));
  ASSERT_EQ(out.size(), 2u) << test_util::python(std::string(TWIN_PY));
  TwinNet net;
  std::string keys;
  for (const auto& kv : perf::state_dict(net)) keys += (keys.empty() ? "" : " ") + kv.key();
  EXPECT_EQ(keys, out[0]) << "perf::state_dict's names and order are Python's";

  const auto loaded = perf::load_state_dict(net, perf::load(from_python));
  EXPECT_TRUE(loaded.missing_keys.empty() && loaded.unexpected_keys.empty()) << loaded;
  const auto want = torch::tensor(test_util::parse_numbers(out[1])).reshape({2, 5});
  EXPECT_LE(test_util::max_diff(eval_output(net), want), 1e-6);
  EXPECT_EQ(net->steps.item<int64_t>(), 7);
  EXPECT_EQ(net->bn->num_batches_tracked.item<int64_t>(), 1);

  // Changed in C++, saved, and loaded by Python's torch.load with its defaults (weights_only) and with mmap.
  {
    torch::NoGradGuard no_grad;
    net->scale.mul_(2);
    net->head->bias.add_(0.5);
  }
  perf::save(perf::state_dict(net), from_cpp);
  const auto cpp_out = eval_output(net);
  const auto back = test_util::lines(
      test_util::python(std::string(TWIN_PY) + "m = TwinNet()\nprint(m.load_state_dict(torch.load('" + from_cpp +
                        "')))\nm.eval()\nprint(*m(x).flatten().tolist())\n"
                        "sd = torch.load('" +
                        from_cpp +
                        "', mmap=True)\n"
                        "print(all(torch.equal(v, m.state_dict()[k]) for k, v in sd.items()), sd['steps'].dtype)\n"));
  ASSERT_EQ(back.size(), 3u);
  EXPECT_EQ(back[0], "<All keys matched successfully>");
  EXPECT_LE(test_util::max_diff(cpp_out, torch::tensor(test_util::parse_numbers(back[1])).reshape({2, 5})), 1e-6);
  EXPECT_EQ(back[2], "True torch.int64");

  // A checkpoint of several things, as the README writes one.
  auto ckpt = perf::dict();
  ckpt.insert("model", perf::state_dict(net));
  ckpt.insert("epoch", 4);
  perf::save(ckpt, dir / "ckpt.pt");
  EXPECT_EQ(test_util::python(std::string(TWIN_PY) + "c = torch.load('" + dir / "ckpt.pt" +
                              "')\nprint(TwinNet().load_state_dict(c['model']), c['epoch'])\n"),
            "<All keys matched successfully> 4");
}

// What lets a C++ model and its Python twin share a file: LibTorch's layers register their parameters and
// buffers under PyTorch's names, in its order and shapes. Checked over the layers a twin is made of.
TEST(StateDict, LibTorchsLayersHavePythonsNamesOrderAndShapes) {
  namespace nn = torch::nn;
  nn::Sequential m(nn::Embedding(10, 8), nn::LSTM(nn::LSTMOptions(8, 8).num_layers(2)),
                   nn::TransformerEncoderLayer(nn::TransformerEncoderLayerOptions(8, 2)), nn::MultiheadAttention(8, 2),
                   nn::GRU(8, 4), nn::Conv2d(3, 4, 3), nn::BatchNorm2d(4), nn::LayerNorm(nn::LayerNormOptions({8})),
                   nn::GroupNorm(2, 4), nn::InstanceNorm2d(nn::InstanceNorm2dOptions(4).track_running_stats(true)),
                   nn::ConvTranspose2d(4, 3, 3), nn::PReLU(), nn::Bilinear(3, 4, 5));
  std::string cpp;
  for (const auto& kv : perf::state_dict(m)) {
    cpp += kv.key() + " [";
    for (const auto d : kv.value().sizes()) cpp += (cpp.back() == '[' ? "" : ", ") + std::to_string(d);
    cpp += "]\n";
  }
  const auto python = test_util::python(
      "import torch.nn as nn\n"
      "m = nn.Sequential(nn.Embedding(10, 8), nn.LSTM(8, 8, num_layers=2), nn.TransformerEncoderLayer(8, 2),\n"
      "                  nn.MultiheadAttention(8, 2), nn.GRU(8, 4), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),\n"
      "                  nn.LayerNorm(8), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4, track_running_stats=True),\n"
      "                  nn.ConvTranspose2d(4, 3, 3), nn.PReLU(), nn.Bilinear(3, 4, 5))\n"
      "for k, v in m.state_dict().items():\n"
      "    print(k, list(v.shape))\n");
  EXPECT_EQ(cpp, python + "\n");
}

TEST(StateDict, ACheckpointOfEveryKindReadsAsPythonWroteItAndBack) {
  test_util::TempDir dir;
  const auto py_file = dir / "ckpt.pt", cpp_file = dir / "again.pt";
  const std::string make =
      "import torch, collections\n"
      "base = torch.arange(10.)\n"
      "def tag(t, **attrs):\n"  // Python attributes: torch.save writes these with _rebuild_from_type_v2
      "    t.__dict__.update(attrs)\n"
      "    return t\n"
      "def ckpt():\n"
      "    return {'epoch': 3, 'lr': 0.1, 'name': 'r\\u00e9sum\\u00e9', 'flags': [True, False, None],\n"
      "            'ints': (2**40, -5, -2**63, 255, 65535, 65536, -1), 'size': torch.Size([2, 3]),\n"
      "            'device': torch.device('cpu'), 'dtype': torch.bfloat16,\n"
      "            'half': torch.tensor([1.5, -2.0], dtype=torch.half), 'bf16': torch.tensor([3.0], "
      "dtype=torch.bfloat16),\n"
      "            'i8': torch.tensor([-3, 4], dtype=torch.int8), 'mask': torch.tensor([True, False]),\n"
      "            'cplx': torch.tensor([1 + 2j]), 'f8': torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn),\n"
      "            'u16': torch.tensor([7, 65535], dtype=torch.uint16), 'scalar': torch.tensor(2.5, "
      "dtype=torch.float64),\n"
      "            'base': base, 'view': base[2:8:2], 'tposed': torch.arange(6.).reshape(2, 3).t(),\n"
      "            'param': torch.nn.Parameter(torch.ones(2)),\n"
      "            'nested': collections.OrderedDict([('a', {'b': [torch.zeros(1)], 'c': {}})]),\n"
      "            'blob': b'\\x00\\xff\\x80ab', 'text_bytes': b'abc', 'ba': bytearray(b'\\x01\\xfe'), 'z': 1.5 - 2j,\n"
      "            'tags': {7}, 'counts': collections.Counter({'a': 2}),\n"
      "            'tagged': tag(torch.tensor([1.5, 2.5]), note='ema', step=3), 'tagged_view': tag(base[1:4], "
      "part=1),\n"
      "            'tagged_grad': tag(torch.ones(2, requires_grad=True), n=[1, 2]),\n"
      "            'buffer': torch.nn.Buffer(torch.full((3,), 4.0), persistent=False), 'empty': []}\n"
      "def same(a, b):\n"
      "    if isinstance(a, torch.Tensor):\n"
      "        f = lambda t: t.float() if t.dtype == torch.float8_e4m3fn else t\n"
      "        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape\n"
      "                and a.stride() == b.stride() and torch.equal(f(a), f(b)))\n"
      "    if isinstance(a, dict):\n"
      "        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)\n"
      "    if isinstance(a, (list, tuple)):\n"
      "        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))\n"
      "    return a == b\n";
  test_util::python(make + "torch.save(ckpt(), '" + py_file + "')\n");
  const auto c = perf::load(py_file);
  ASSERT_TRUE(c.isGenericDict());
  const auto d = c.toGenericDict();
  std::vector<std::string> keys;
  for (const auto& kv : d) keys.push_back(kv.key().toStringRef());
  EXPECT_EQ(keys.front(), "epoch");
  EXPECT_EQ(keys.back(), "empty");
  EXPECT_EQ(d.at("epoch").toInt(), 3);
  EXPECT_EQ(d.at("lr").toDouble(), 0.1);
  EXPECT_EQ(d.at("name").toStringRef(), "r\xc3\xa9sum\xc3\xa9");
  const auto flags = d.at("flags").toListRef();
  ASSERT_EQ(flags.size(), 3u);
  EXPECT_TRUE(flags[0].toBool());
  EXPECT_FALSE(flags[1].toBool());
  EXPECT_TRUE(flags[2].isNone());
  std::vector<int64_t> ints;
  const c10::IValue ints_value = d.at("ints");  // held: g++ 13's -Wdangling-reference on a temporary's elements
  for (const auto& v : ints_value.toTupleRef().elements()) ints.push_back(v.toInt());
  EXPECT_EQ(ints, (std::vector<int64_t>{int64_t{1} << 40, -5, INT64_MIN, 255, 65535, 65536, -1}));
  EXPECT_EQ(d.at("size").toTupleRef().elements().size(), 2u);
  EXPECT_EQ(d.at("device").toDevice(), c10::Device(c10::kCPU));
  EXPECT_EQ(d.at("dtype").toScalarType(), c10::kBFloat16);
  const auto t = [&](const char* k) { return d.at(k).toTensor(); };
  EXPECT_TRUE(t("half").equal(torch::tensor({1.5, -2.0}, torch::kHalf)));
  EXPECT_EQ(t("bf16").scalar_type(), c10::kBFloat16);
  EXPECT_TRUE(t("i8").equal(torch::tensor({-3, 4}, torch::kInt8)));
  EXPECT_TRUE(t("mask").equal(torch::tensor({true, false})));
  EXPECT_EQ(t("cplx").scalar_type(), c10::kComplexFloat);
  EXPECT_EQ(t("f8").scalar_type(), c10::kFloat8_e4m3fn);
  EXPECT_TRUE(t("f8").to(torch::kFloat).equal(torch::tensor({0.5f, 2.0f})));
  EXPECT_EQ(t("u16").scalar_type(), c10::kUInt16);
  EXPECT_EQ(t("scalar").dim(), 0);
  EXPECT_EQ(t("scalar").item<double>(), 2.5);
  EXPECT_TRUE(t("view").equal(torch::tensor({2.f, 4.f, 6.f})));
  EXPECT_EQ(t("view").storage().unsafeGetStorageImpl(), t("base").storage().unsafeGetStorageImpl())
      << "a view shares its base's storage, as in Python";
  EXPECT_EQ(t("tposed").strides(), (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(t("param").requires_grad());
  EXPECT_FALSE(t("base").requires_grad());
  EXPECT_EQ(d.at("nested").toGenericDict().at("a").toGenericDict().at("b").toListRef().size(), 1u);
  EXPECT_TRUE(d.at("empty").toListRef().empty());
  // What Python's default loader also accepts: bytes (and bytearray) as a string of the bytes, a complex number,
  // a set as a list of its items, a Counter as a dict.
  EXPECT_EQ(d.at("blob").toStringRef(), std::string("\x00\xff\x80"
                                                    "ab",
                                                    5));
  EXPECT_EQ(d.at("text_bytes").toStringRef(), "abc");
  EXPECT_EQ(d.at("ba").toStringRef(), std::string("\x01\xfe"));
  EXPECT_EQ(d.at("z").toComplexDouble(), c10::complex<double>(1.5, -2.0));
  ASSERT_EQ(d.at("tags").toListRef().size(), 1u);
  EXPECT_EQ(d.at("tags").toListRef()[0].toInt(), 7);
  EXPECT_EQ(d.at("counts").toGenericDict().at("a").toInt(), 2);
  // Tensors with Python attributes (what Python's weights_only loader reads as tensors with their __dict__): the
  // tensors, the attributes dropped; a view still shares its base's storage.
  EXPECT_TRUE(t("tagged").equal(torch::tensor({1.5f, 2.5f})));
  EXPECT_FALSE(t("tagged").requires_grad());
  EXPECT_TRUE(t("tagged_view").equal(torch::tensor({1.f, 2.f, 3.f})));
  EXPECT_EQ(t("tagged_view").storage().unsafeGetStorageImpl(), t("base").storage().unsafeGetStorageImpl());
  EXPECT_EQ(t("tagged_view").storage_offset(), 1);
  EXPECT_TRUE(t("tagged_grad").requires_grad());
  EXPECT_TRUE(t("tagged_grad").equal(torch::ones({2})));
  EXPECT_TRUE(t("buffer").equal(torch::full({3}, 4.f)));

  // Written back by perf::save, read by Python (weights_only): the same values, the view still shares its storage.
  perf::save(c, cpp_file);
  const auto back = test_util::lines(
      test_util::python(make + "a, b = ckpt(), torch.load('" + cpp_file +
                        "')\n"
                        "print([k for k in a if not same(a[k], b[k])], b['dtype'] == " +
                        std::to_string(static_cast<int>(c10::kBFloat16)) +
                        ")\n"
                        "print(b['view'].untyped_storage().data_ptr() == b['base'].untyped_storage().data_ptr(), "
                        "b['param'].requires_grad)\n"));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0], "['dtype', 'text_bytes', 'tags'] True")
      << "a dtype reads back as its number (c10::ScalarType), bytes that are UTF-8 text as a str, a set as a list; "
         "the rest as written (bytes that are not text as bytes)";
  EXPECT_EQ(back[1], "True True");

  // A conjugate view is written as its values (the conjugate bit is not in torch.save's format).
  auto conj = perf::dict();
  const auto z = torch::complex(torch::ones({2}), torch::arange(2.f));
  conj.insert("z", z.conj());
  perf::save(conj, cpp_file);
  EXPECT_TRUE(perf::load(cpp_file).toGenericDict().at("z").toTensor().equal(z.conj().resolve_conj()));
}

// torch.save's format before PyTorch 1.6 (pickles, then the storages' bytes), which Python's torch.load still
// reads by default: torchvision's older pretrained weights are such files.
TEST(StateDict, AFileOfTheFormatBeforePyTorch16ReadsAsTheZipFileOfTheSameValue) {
  test_util::TempDir dir;
  const auto zip = dir / "zip.pt", old2 = dir / "old2.pt", old4 = dir / "old4.pt", v1 = dir / "v1.pt";
  test_util::python(
      std::string(TWIN_PY) +
      "import collections, warnings\n"
      "warnings.simplefilter('ignore')\n"
      "torch.manual_seed(5)\nm = TwinNet()\nm(x * 3 + 1)\n"
      "base = torch.arange(12.).reshape(3, 4)\n"
      "c = {'model': m.state_dict(), 'base': base, 'view': base[1:, 1:3], 'half': base.half(), 'epoch': 3,\n"
      "     'param': nn.Parameter(torch.ones(2)), 'i8': torch.tensor([-1, 7], dtype=torch.int8),\n"
      "     'empty': torch.empty(0, 3), 'buffer': nn.Buffer(torch.ones(3))}\n"
      "c['tagged'] = base[2]\n"
      "c['tagged'].note = 'x'\n"
      "torch.save(c, '" +
      zip +
      "')\n"
      "torch.save(c, '" +
      old2 +
      "', _use_new_zipfile_serialization=False)\n"
      "torch.save(c, '" +
      old4 +
      "', _use_new_zipfile_serialization=False, pickle_protocol=4)\n"
      // PyTorch 0.3 rebuilt tensors with _rebuild_tensor(storage, offset, size, stride)
      "class V1:\n"
      "    def __init__(s, t): s.t = t\n"
      "    def __reduce__(s): return (torch._utils._rebuild_tensor, (s.t.storage(), s.t.storage_offset(),\n"
      "                                                          tuple(s.t.size()), s.t.stride()))\n"
      "torch.save(collections.OrderedDict(w=V1(base), v=V1(base[1:, 1:3])), '" +
      v1 +
      "', _use_new_zipfile_serialization=False)\n"
      "print(torch.load('" +
      v1 + "')['v'].tolist())\n");
  const auto want = perf::load(zip).toGenericDict();
  for (const auto& file : {old2, old4}) {
    SCOPED_TRACE(file);
    const auto got = perf::load(file).toGenericDict();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& kv : want) {
      const auto& g = got.at(kv.key());
      if (!kv.value().isTensor()) continue;
      const auto a = kv.value().toTensor(), b = g.toTensor();
      EXPECT_TRUE(a.scalar_type() == b.scalar_type() && a.strides() == b.strides() && a.equal(b)) << kv.key();
      EXPECT_EQ(a.requires_grad(), b.requires_grad()) << kv.key();
    }
    EXPECT_EQ(got.at("epoch").toInt(), 3);
    EXPECT_EQ(got.at("view").toTensor().storage().unsafeGetStorageImpl(),
              got.at("base").toTensor().storage().unsafeGetStorageImpl())
        << "a view shares its base's storage";
    EXPECT_EQ(got.at("tagged").toTensor().storage().unsafeGetStorageImpl(),
              got.at("base").toTensor().storage().unsafeGetStorageImpl())
        << "a view with Python attributes too";
    TwinNet net, twin;
    perf::load_state_dict(net, got.at("model"));
    perf::load_state_dict(twin, want.at("model"));
    EXPECT_TRUE(eval_output(net).equal(eval_output(twin)));
  }
  const auto old = perf::load(v1).toGenericDict();
  EXPECT_TRUE(old.at("v").toTensor().equal(torch::tensor({{5.f, 6.f}, {9.f, 10.f}})));
  EXPECT_TRUE(old.at("w").toTensor().equal(torch::arange(12.f).reshape({3, 4})));

  // Every truncation and every third byte changed: an answer or an error naming the file, never a crash.
  const std::string bytes = read_bytes(old2);
  const auto damaged = dir / "damaged.pt";
  size_t refused = 0;
  const auto attempt = [&](const std::string& b) {
    refused += refused_when_read(
        damaged, b, [](const std::string& p) { perf::load(p); }, "perf::load: ");
  };
  for (size_t n = 0; n < bytes.size(); n += (n < 600 ? 1 : 97)) attempt(bytes.substr(0, n));
  EXPECT_GT(refused, 600u) << "every truncation is refused";
  for (size_t i = 0; i < bytes.size(); i += 3) {
    std::string b = bytes;
    b[i] = static_cast<char>(b[i] ^ 0x5a);
    attempt(b);
  }
  // A file that is neither format.
  std::ofstream(damaged, std::ios::binary | std::ios::trunc) << "epoch = 3\n";
  PERF_EXPECT_THROW_MSG(perf::load(damaged), "is not a torch.save file (neither the zip archive");
}

TEST(StateDict, AStateThatDoesNotFitIsRefusedWholeAndStrictFalseLoadsWhatFits) {
  torch::manual_seed(1);
  TwinNet source, net;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : source->parameters()) p.add_(1);  // every value differs from net's
  }
  const auto before = perf::state_dict(net);
  const auto unchanged = [&] {
    for (const auto& kv : perf::state_dict(net)) {
      if (!kv.value().equal(before.at(kv.key()))) return kv.key() + " changed";
    }
    return std::string("unchanged");
  };
  // Copies: perf::state_dict's tensors are the module's own (detached), and the cases below edit the dict.
  const auto state = [&] {
    c10::Dict<std::string, at::Tensor> s;
    for (const auto& kv : perf::state_dict(source)) s.insert(kv.key(), kv.value().clone());
    return s;
  };

  auto missing_and_extra = state();
  EXPECT_EQ(missing_and_extra.erase("scale"), 1u);
  missing_and_extra.insert("extra", torch::ones({1}));
  PERF_EXPECT_THROW_MSG(perf::load_state_dict(net, missing_and_extra), "Missing key(s) in state_dict: \"scale\"");
  PERF_EXPECT_THROW_MSG(perf::load_state_dict(net, missing_and_extra), "Unexpected key(s) in state_dict: \"extra\"");
  PERF_EXPECT_THROW_MSG(perf::load_state_dict(net, missing_and_extra), "nothing loaded");
  EXPECT_EQ(unchanged(), "unchanged");

  // Python's strict=False: the names both have are loaded, the others returned.
  const auto keys = perf::load_state_dict(net, missing_and_extra, /*strict=*/false);
  EXPECT_EQ(keys.missing_keys, std::vector<std::string>{"scale"});
  EXPECT_EQ(keys.unexpected_keys, std::vector<std::string>{"extra"});
  EXPECT_TRUE(net->head->weight.equal(source->head->weight));
  EXPECT_FALSE(net->scale.equal(source->scale));
  std::ostringstream os;
  os << keys;
  EXPECT_EQ(os.str(), "missing keys: [\"scale\"], unexpected keys: [\"extra\"]");

  // A shape or a value that cannot be copied is refused, strict or not, and nothing of the rest is loaded
  // (Python copies the tensors before the bad one, then raises).
  TwinNet fresh;
  const auto fresh_before = perf::state_dict(fresh);
  auto wrong_shape = state();
  wrong_shape.insert_or_assign("head.weight", torch::zeros({5, 63}));
  PERF_EXPECT_THROW_MSG(perf::load_state_dict(fresh, wrong_shape, /*strict=*/false),
                        "size mismatch for head.weight: copying a param with shape [5, 63] from checkpoint, the "
                        "shape in current model is [5, 64]");
  for (const auto& kv : perf::state_dict(fresh)) EXPECT_TRUE(kv.value().equal(fresh_before.at(kv.key()))) << kv.key();
  c10::impl::GenericDict not_a_tensor(c10::StringType::get(), c10::AnyType::get());
  for (const auto& kv : state()) not_a_tensor.insert(kv.key(), kv.value());
  not_a_tensor.insert_or_assign("conv.weight", int64_t{3});
  PERF_EXPECT_THROW_MSG(perf::load_state_dict(fresh, not_a_tensor),
                        "\"conv.weight\" is a Int in the state, not a tensor");
  PERF_EXPECT_THROW_MSG(perf::load_state_dict(fresh, c10::IValue(int64_t{3})), "not a dict of name -> tensor");

  // Another dtype is converted into the module's, as Python's copy_ does.
  auto doubles = state();
  for (const auto& kv : state()) {
    if (kv.value().is_floating_point()) doubles.insert_or_assign(kv.key(), kv.value().to(torch::kDouble));
  }
  perf::load_state_dict(fresh, doubles);
  EXPECT_EQ(fresh->head->weight.scalar_type(), torch::kFloat);
  EXPECT_TRUE(fresh->head->weight.equal(source->head->weight));
}

TEST(StateDict, FilesItCannotReadAreRefusedByNameAndDamagedOnesNeverCrash) {
  test_util::TempDir dir;
  const auto namespace_file = dir / "namespace.pt", good = dir / "good.pt";
  test_util::python("import torch, argparse\ntorch.save({'args': argparse.Namespace(lr=1)}, '" + namespace_file +
                    "')\n");
  PERF_EXPECT_THROW_MSG(perf::load(namespace_file), "a Python object of class argparse.Namespace");
  PERF_EXPECT_THROW_MSG(perf::load(namespace_file), "Python's torch.load refuses it too");
  // Tensors Python's default loader reads and perf does not: refused as such, not as objects Python refuses.
  test_util::python(
      "import torch\ntorch.save({'q': torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)}, '" +
      (dir / "quantized.pt") + "')\n");
  PERF_EXPECT_THROW_MSG(perf::load(dir / "quantized.pt"),
                        "holds torch._utils._rebuild_qtensor: a quantized, sparse, nested or meta tensor, which "
                        "Python's torch.load reads and perf::load does not");
  // A subclass of torch.Tensor: refused by its class, as Python's default loader refuses it.
  test_util::python(
      "import sys, types, torch\n"
      "lib = sys.modules['lib'] = types.ModuleType('lib')\n"  // a class pickle can find by name
      "class Sub(torch.Tensor): pass\n"
      "Sub.__module__, lib.Sub = 'lib', Sub\n"
      "torch.save({'s': torch.ones(2).as_subclass(Sub)}, '" +
      (dir / "subclass.pt") + "')\n");
  PERF_EXPECT_THROW_MSG(perf::load(dir / "subclass.pt"), "holds a Python object of class lib.Sub");
  PERF_EXPECT_THROW_MSG(perf::load(dir / "none.pt"), "is not a file");
  // LibTorch's own archive of a module (torch::save) is not a torch.save file.
  TwinNet net;
  torch::save(net, dir / "libtorch.pt");
  PERF_EXPECT_THROW_MSG(perf::load(dir / "libtorch.pt"), "an archive of LibTorch's torch::save");

  // A view reaching past its storage, as a damaged file might say: refused before any memory is read.
  using namespace std::string_literals;  // the pickle has NUL bytes
  const std::string past_end = "\x80\x02"s + "ctorch._utils\n_rebuild_tensor_v2\n(" +
                               "(X\x07\0\0\0storagectorch\nFloatStorage\nX\x01\0\0\0"s + "0X\x03\0\0\0cpuK\x04tQ"s +
                               "K\x00(K\x64tK\x01\x85\x89"s + "ccollections\nOrderedDict\n)Rt" + "R.";
  write_archive(dir / "past_end.pt", past_end, {{"data/0", std::string(16, '\0')}});
  PERF_EXPECT_THROW_MSG(perf::load(dir / "past_end.pt"), "a view past the end of its storage (element 99 of 4)");
  write_archive(dir / "short.pt", past_end, {{"data/0", std::string(15, '\0')}});
  PERF_EXPECT_THROW_MSG(perf::load(dir / "short.pt"), "holds 4 elements of Float, but its record has 15 bytes");

  // Every truncation and every one-byte change of a real state_dict's pickle: an answer or a c10::Error,
  // never a crash (the sanitizer builds run this too).
  perf::save(perf::state_dict(net), good);
  const std::string pkl = data_pkl(good);
  std::vector<std::pair<std::string, std::string>> storages;
  {
    caffe2::serialize::PyTorchStreamReader r(good);
    for (const auto& name : r.getAllRecords()) {
      if (name.rfind("data/", 0) == 0) {
        auto [ptr, n] = r.getRecord(name);
        storages.emplace_back(name, std::string(static_cast<const char*>(ptr.get()), n));
      }
    }
  }
  ASSERT_EQ(storages.size(), perf::state_dict(net).size());
  size_t refused = 0, read = 0;
  const auto damaged = dir / "damaged.pt";
  const auto attempt = [&](const std::string& bytes) {
    write_archive(damaged, bytes, storages);
    try {
      perf::load(damaged);
      ++read;
    } catch (const c10::Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what_without_backtrace()).find("perf::load: "), std::string::npos)
          << e.what_without_backtrace();
    }
  };
  for (size_t n = 0; n < pkl.size(); ++n) attempt(pkl.substr(0, n));
  EXPECT_EQ(refused, pkl.size()) << "every truncation is refused";
  for (size_t i = 0; i < pkl.size(); i += 3) {
    std::string bytes = pkl;
    bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
    attempt(bytes);
  }
  EXPECT_GT(refused, pkl.size());
  EXPECT_EQ(perf::load(good).toGenericDict().size(), perf::state_dict(net).size());
}

TEST(StateDict, AFailedSaveLeavesTheEarlierFile) {
  test_util::TempDir dir;
  const auto path = dir / "ckpt.pt";
  TwinNet net;
  perf::save(perf::state_dict(net), path);
  const auto first = read_bytes(path);
  c10::impl::GenericDict bad(c10::StringType::get(), c10::AnyType::get());
  bad.insert("model", perf::state_dict(net));
  bad.insert("stream", c10::IValue(c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU))));
  PERF_EXPECT_THROW_MSG(perf::save(bad, path), "perf::save: 'stream' is a Stream");
  EXPECT_EQ(read_bytes(path), first);
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) files += e.is_regular_file() ? 1u : 0u;
  EXPECT_EQ(files, 1u) << "nothing left beside it";
  PERF_EXPECT_THROW_MSG(perf::save(perf::state_dict(net), dir / "no/such/dir/ckpt.pt"),
                        "the directory of '" + dir.path + "/no/such/dir/ckpt.pt' does not exist");
}

namespace {

// Every dtype Python's safetensors reads for torch, with values that use their range, and a name with a dot.
const char* const SAFETENSORS_PY =
    "import torch\n"
    "from safetensors.torch import save_file, load_file\n"
    "from safetensors import safe_open\n"
    "def tensors():\n"
    "    g = torch.Generator().manual_seed(1)\n"
    "    r = lambda *s: torch.randn(*s, generator=g)\n"
    "    return {'f64': r(3, 2).double(), 'f32': r(4), 'f16': r(2, 3).half(), 'bf16': r(5).bfloat16(),\n"
    "            'i64': torch.tensor([-2**63, 2**62, -1]), 'i32': torch.tensor([-7, 2**31 - 1], dtype=torch.int32),\n"
    "            'i16': torch.tensor([-3, 300], dtype=torch.int16), 'i8': torch.tensor([-128, 127], "
    "dtype=torch.int8),\n"
    "            'u8': torch.tensor([0, 255], dtype=torch.uint8), 'u16': torch.tensor([65535], dtype=torch.uint16),\n"
    "            'u32': torch.tensor([-1], dtype=torch.int32).view(torch.uint32),\n"
    "            'u64': torch.tensor([-5], dtype=torch.int64).view(torch.uint64),\n"
    "            'bool': torch.tensor([True, False, True]), 'c64': torch.complex(r(2), r(2)),\n"
    "            'f8_e4m3': r(3).to(torch.float8_e4m3fn), 'f8_e5m2': r(3).to(torch.float8_e5m2),\n"
    "            'f8_e4m3fnuz': r(2).to(torch.float8_e4m3fnuz), 'f8_e5m2fnuz': r(2).to(torch.float8_e5m2fnuz),\n"
    "            'f8_e8m0': r(3).abs().to(torch.float8_e8m0fnu),\n"
    "            'f4': torch.tensor([[0x12, 0xf0], [0x7e, 0x01]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2),\n"
    "            'scalar': torch.tensor(2.5), 'empty': torch.zeros(0, 3), 'layer.0.weight': r(2, 2)}\n"
    "meta = {'format': 'pt', 'note': 'r\\u00e9sum\\u00e9 ' + chr(34) + 'q' + chr(34) + chr(92) + chr(9) + '!'}\n"
    "def same(a, b):\n"
    "    f = lambda t: t.contiguous().flatten().view(torch.uint8)\n"
    "    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(f(a), f(b))\n";

const std::map<std::string, std::string> kSafetensorsMeta = {{"format", "pt"},
                                                             {"note", "r\xc3\xa9sum\xc3\xa9 \"q\"\\\t!"}};

// A tensor's bytes, for an exact comparison of any dtype (float8 and float4 have no equal()).
at::Tensor bytes_of(const at::Tensor& t) { return t.contiguous().reshape({-1}).view(torch::kUInt8); }

bool python_has_safetensors() {
  return test_util::python("import importlib.util\nprint(importlib.util.find_spec('safetensors') is not None)") ==
         "True";
}

// `w` and a tensor of each kind perf's own round trips cover: half, a 0-dim integer, an empty one, packed float4, bool.
c10::Dict<std::string, at::Tensor> safetensors_sample(const at::Tensor& w) {
  auto tensors = c10::Dict<std::string, at::Tensor>();
  tensors.insert("w", w);
  tensors.insert("half", torch::randn({4}).to(torch::kHalf));
  tensors.insert("count", torch::tensor(7));
  tensors.insert("empty", torch::zeros({0, 2}));
  tensors.insert("f4", torch::tensor({0x12, 0x34}, torch::kUInt8).view(c10::kFloat4_e2m1fn_x2).reshape({1, 2}));
  tensors.insert("mask", torch::tensor({true, false}));
  return tensors;
}

// A .safetensors file of this header text and these data bytes.
void write_safetensors(const std::string& path, const std::string& header, const std::string& data) {
  std::string len(8, '\0');
  for (size_t k = 0; k < 8; ++k) len[k] = static_cast<char>((header.size() >> (8 * k)) & 0xff);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << len << header << data;
}

}  // namespace

TEST(StateDict, ASafetensorsFileReadsAsPythonsSafetensorsReadsItAndBack) {
  if (!python_has_safetensors()) {
    GTEST_SKIP() << "skipped: the reference Python has no safetensors package (scripts/bootstrap.sh installs it)";
  }
  test_util::TempDir dir;
  const auto py_file = dir / "py.safetensors", pt_file = dir / "py.pt", cpp_file = dir / "cpp.safetensors";
  const auto order = test_util::python(std::string(SAFETENSORS_PY) + "save_file(tensors(), '" + py_file +
                                       "', metadata=meta)\ntorch.save(tensors(), '" + pt_file +
                                       "')\nprint(*load_file('" + py_file + "'))\n");
  const auto loaded = perf::load_safetensors(py_file);
  const auto want = perf::load(pt_file).toGenericDict();  // the same tensors through torch.save (tested above)
  std::string names;
  for (const auto& kv : loaded) names += (names.empty() ? "" : " ") + kv.key();
  EXPECT_EQ(names, order) << "the file's order, as Python's load_file";
  ASSERT_EQ(loaded.size(), want.size());
  for (const auto& kv : want) {
    const auto a = kv.value().toTensor(), b = loaded.at(kv.key().toStringRef());
    EXPECT_EQ(a.scalar_type(), b.scalar_type()) << kv.key();
    EXPECT_EQ(a.sizes(), b.sizes()) << kv.key();
    EXPECT_TRUE(bytes_of(a).equal(bytes_of(b))) << kv.key();
  }
  EXPECT_EQ(perf::safetensors_metadata(py_file), kSafetensorsMeta);
  // Opened as Python's safe_open opens it: the names in both of its orders, a slice, a dtype and the metadata.
  {
    const perf::SafetensorsFile f(py_file);
    const auto py = test_util::lines(
        test_util::python(std::string(SAFETENSORS_PY) + "with safe_open('" + py_file +
                          "', 'pt') as f:\n"
                          "    print(*f.keys())\n    print(*f.offset_keys())\n    s = f.get_slice('f64')\n"
                          "    print(*s[1:, 1].tolist())\n    print(*s.get_shape(), s.get_dtype())\n"));
    ASSERT_EQ(py.size(), 4u);
    const auto joined = [](const std::vector<std::string>& list) {
      std::string out;
      for (const auto& n : list) out += (out.empty() ? "" : " ") + n;
      return out;
    };
    EXPECT_EQ(joined(f.keys()), py[0]);
    EXPECT_EQ(joined(f.offset_keys()), py[1]);
    using namespace torch::indexing;
    const auto s = f.get_slice("f64", {Slice(1, None), 1});
    EXPECT_EQ(test_util::max_diff(s, torch::tensor(test_util::parse_numbers(py[2]), torch::kDouble)), 0.0);
    EXPECT_EQ(py[3], "3 2 F64");
    EXPECT_EQ(f.shape("f64"), (std::vector<int64_t>{3, 2}));
    EXPECT_EQ(f.dtype("f64"), torch::kDouble);
    EXPECT_EQ(f.metadata(), kSafetensorsMeta);
  }
  // perf::load reads it too (a dict of the same tensors), so one call loads either kind of file.
  const auto generic = perf::load(py_file).toGenericDict();
  ASSERT_EQ(generic.size(), loaded.size());
  EXPECT_TRUE(generic.at("f32").toTensor().equal(loaded.at("f32")));

  // Written by perf, read by Python's safetensors: the same tensors and metadata, from a dict Python's save_file
  // refuses (a transpose, a slice, two names for one tensor).
  auto out = loaded.copy();
  const auto base = torch::arange(12.f).reshape({3, 4});
  out.insert("tposed", base.t());
  out.insert("slice", base.select(1, 2));
  out.insert("tied", loaded.at("f32"));
  perf::save_safetensors(out, cpp_file, kSafetensorsMeta);
  const auto back = test_util::lines(test_util::python(
      std::string(SAFETENSORS_PY) + "a, b = tensors(), load_file('" + cpp_file +
      "')\n"
      "a.update(tposed=torch.arange(12.).reshape(3, 4).t(), slice=torch.arange(12.).reshape(3, 4)[:, 2], "
      "tied=a['f32'])\n"
      "print(sorted(a) == sorted(b), [k for k in a if not same(a[k], b[k])])\n"
      "with safe_open('" +
      cpp_file + "', 'pt') as f:\n    print(f.metadata() == meta)\n"));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0], "True []");
  EXPECT_EQ(back[1], "True");
  // Sharded, read by Python through the index as transformers reads it: the same tensors.
  const auto files = perf::save_safetensors_sharded(out, dir.path, 64);
  EXPECT_GT(files.size(), 3u);
  EXPECT_EQ(
      test_util::python(
          std::string(SAFETENSORS_PY) + "import json, os\nidx = json.load(open('" + files.back() +
          "'))\n"
          "b = {}\n"
          "for f in sorted(set(idx['weight_map'].values())): b.update(load_file(os.path.join('" +
          dir.path +
          "', f)))\n"
          "a = tensors()\n"
          "print(sorted(b) == sorted(idx['weight_map']), [k for k in a if not same(a[k], b[k])], "
          "idx['metadata']['total_size'] == sum(t.nbytes for k, t in b.items() if k not in ('tied', 'slice')))\n"),
      "True [] True");
  // The data starts 8-byte aligned, as Python's writer pads the header.
  const auto file = read_bytes(cpp_file);
  uint64_t header_len = 0;
  for (int k = 7; k >= 0; --k)
    header_len = (header_len << 8) | static_cast<unsigned char>(file[static_cast<size_t>(k)]);
  EXPECT_EQ((8 + header_len) % 8, 0u);

  // A model's weights saved by Python's safetensors load into the LibTorch twin and give Python's output.
  const auto twin = test_util::lines(
      test_util::python(std::string(TWIN_PY) +
                        "from safetensors.torch import save_file\ntorch.manual_seed(5)\nm = TwinNet()\n"
                        "m(x * 3 + 1)\nsave_file(m.state_dict(), '" +
                        dir / "twin.safetensors" + "')\nm.eval()\nprint(*m(x).flatten().tolist())\n"));
  ASSERT_EQ(twin.size(), 1u);
  TwinNet net;
  perf::load_state_dict(net, perf::load_safetensors(dir / "twin.safetensors"));
  EXPECT_LE(test_util::max_diff(eval_output(net), torch::tensor(test_util::parse_numbers(twin[0])).reshape({2, 5})),
            1e-6);
}

TEST(StateDict, SafetensorsFilesThatBreakTheFormatAreRefusedByWhatIsWrongAndNeverCrash) {
  test_util::TempDir dir;
  // perf's own round trip (no Python needed): every dtype the format names, metadata, an empty and a 0-dim tensor.
  const auto tensors = safetensors_sample(torch::randn({3, 2}));
  const auto good = dir / "good.safetensors";
  perf::save_safetensors(tensors, good, {{"format", "pt"}});
  const auto read = perf::load_safetensors(good);
  ASSERT_EQ(read.size(), tensors.size());
  for (const auto& kv : tensors) {
    EXPECT_EQ(read.at(kv.key()).scalar_type(), kv.value().scalar_type()) << kv.key();
    EXPECT_EQ(read.at(kv.key()).sizes(), kv.value().sizes()) << kv.key();
    EXPECT_TRUE(bytes_of(read.at(kv.key())).equal(bytes_of(kv.value()))) << kv.key();
  }
  EXPECT_EQ(perf::safetensors_metadata(good), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ(read_bytes(good).find("\"f4\":{\"dtype\":\"F4\",\"shape\":[1,4]") != std::string::npos, true)
      << "the header counts F4 values, two a byte: " << read_bytes(good).substr(8, 200);

  // Headers that break the format, each refused naming what is wrong.
  const auto bad = dir / "bad.safetensors";
  const auto refused = [&](const std::string& header, const std::string& data, const std::string& message) {
    write_safetensors(bad, header, data);
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(bad), message);
  };
  const std::string f32 = R"("dtype":"F32","shape":[1])";
  refused("[1]", "", "the header does not start with '{' (not a .safetensors file)");
  refused(R"({"a":})", "", "its header is not valid JSON: a value expected at byte 13 of the file");
  refused(R"({"a":{)" + f32 + R"(,"data_offsets":[0,4]},})", std::string(4, '\0'), "a string expected");
  refused(R"({"a":"\x"})", "", "an unknown escape \\x");
  refused("{\"a\":" + std::string(100, '[') + std::string(100, ']') + "}", "", "nested more than 64 deep");
  refused(R"({"a":{"dtype":"F6_E2M3","shape":[1],"data_offsets":[0,1]}})", "x",
          "\"a\" has dtype F6_E2M3, which perf does not read; it reads F64, F32, F16, BF16");
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", std::string(4, '\0'),
          "\"a\" has data_offsets [0, 4], but its dtype and shape take 8 bytes");
  refused(R"({"a":{)" + f32 + R"(,"data_offsets":[0,4]},"b":{)" + f32 + R"(,"data_offsets":[8,12]}})",
          std::string(12, '\0'), "\"b\" starts at byte 8 of the data, where a gap follows the tensor before it");
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{)" + f32 + R"(,"data_offsets":[4,8]}})",
          std::string(8, '\0'),
          "\"b\" starts at byte 4 of the data, where an earlier tensor's bytes are (they overlap)");
  refused(R"({"a":{)" + f32 + R"(,"data_offsets":[0,4]}})", std::string(6, '\0'),
          "the tensors take 4 bytes of data and the file holds 6 after its header (bytes left over)");
  refused(R"({"a":{)" + f32 + R"(,"data_offsets":[0,4]},"a":{)" + f32 + R"(,"data_offsets":[4,8]}})",
          std::string(8, '\0'), "the header names \"a\" twice");
  refused(R"({"__metadata__":{"n":1}})", "", "holds \"n\" as a value that is not text");
  refused(R"({"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}})", "xyz",
          "\"a\" is F4 with an odd last dimension");
  refused(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "xxxx",
          "a dimension of \"a\" is -1; a non-negative integer is expected");
  refused(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}})", "xxxx",
          "\"a\"'s shape is too large for its dtype");
  refused(R"({"a":{"dtype":"F32","shape":[1]}})", "xxxx", "\"a\" lacks one of dtype, shape and data_offsets");
  {
    std::ofstream(bad, std::ios::binary | std::ios::trunc) << std::string(8, '\xff') << "{}";
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(bad), "is over the format's limit of 100000000");
    std::ofstream(bad, std::ios::binary | std::ios::trunc) << std::string("\x40\0\0\0\0\0\0\0{}", 10);
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(bad), "runs past the end of the file (10 bytes): a truncated file");
  }
  // An empty header with unknown fields beside the known ones, and "__metadata__": null, are the format's.
  write_safetensors(bad, R"({"__metadata__":null,"a":{"dtype":"F32","shape":[],"data_offsets":[0,4],"x":[1,{}]}})",
                    std::string("\0\0\x80\x3f", 4));
  EXPECT_EQ(perf::load_safetensors(bad).at("a").item<float>(), 1.0f);
  // perf::load names itself.
  write_safetensors(bad, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", std::string(4, '\0'));
  PERF_EXPECT_THROW_MSG(perf::load(bad), "perf::load: " + bad + ": \"a\" has data_offsets [0, 4]");
  PERF_EXPECT_THROW_MSG(perf::load_safetensors(dir / "none"),
                        "perf::load_safetensors: " + dir / "none" + ": not a file");
  if (!test_util::has_cuda()) {
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(good, torch::kCUDA),
                          "perf::load_safetensors: " + good + ": cannot put tensors on cuda: ");
  }

  // A sharded checkpoint (transformers' model.safetensors.index.json beside its shards), read through its index.
  {
    const auto shard = [&](const std::string& name, std::vector<std::string> keys) {
      c10::Dict<std::string, at::Tensor> part;
      for (const auto& k : keys) part.insert(k, tensors.at(k));
      perf::save_safetensors(part, dir / name);
    };
    shard("model-00001-of-00002.safetensors", {"w", "half", "count"});
    shard("model-00002-of-00002.safetensors", {"empty", "f4", "mask"});
    const auto index = dir / "model.safetensors.index.json";
    const auto write_index = [&](const std::string& map) {
      std::ofstream(index, std::ios::trunc) << "{\n  \"metadata\": {\n    \"total_size\": 60\n  },\n"
                                            << "  \"weight_map\": {\n"
                                            << map << "\n  }\n}\n";
    };
    const std::string one = "model-00001-of-00002.safetensors", two = "model-00002-of-00002.safetensors";
    const auto entry = [](const std::string& name, const std::string& file) {
      return "    \"" + name + "\": \"" + file + "\"";
    };
    const std::string map = entry("count", one) + ",\n" + entry("empty", two) + ",\n" + entry("f4", two) + ",\n" +
                            entry("half", one) + ",\n" + entry("mask", two) + ",\n" + entry("w", one);
    write_index(map);
    const auto sharded = perf::load_safetensors(index);
    ASSERT_EQ(sharded.size(), tensors.size());
    for (const auto& kv : tensors) {
      EXPECT_TRUE(bytes_of(sharded.at(kv.key())).equal(bytes_of(kv.value()))) << kv.key();
    }
    write_index(map + ",\n" + entry("gone", two));
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(index),
                          "the index puts \"gone\" in shard " + two + ", which does not hold it");
    write_index(entry("count", one) + ",\n" + entry("empty", two) + ",\n" + entry("f4", two) + ",\n" +
                entry("half", one) + ",\n" + entry("mask", two) + ",\n" + entry("w", two));
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(index),
                          "shard " + one + " holds \"w\", which the index puts in shard " + two);
    write_index(entry("count", one) + ",\n" + entry("w", one));
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(index),
                          "shard " + one + " holds \"half\", which the index does not name");
    write_index(map + ",\n" + entry("x", "model-00003-of-00003.safetensors"));
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(index),
                          "perf::load_safetensors: " + dir / "model-00003-of-00003.safetensors" + ": not a file");
    std::ofstream(index, std::ios::trunc) << "{\"metadata\": {}}";
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(index), "the index has no \"weight_map\" object");
    std::ofstream(index, std::ios::trunc) << "{\"weight_map\": {\"a\": 1,}}";
    PERF_EXPECT_THROW_MSG(perf::load_safetensors(index), "the index is not valid JSON: a string expected at byte 23");
  }

  // Written sharded, as huggingface_hub splits a state_dict: in order, a new shard where the next would pass the limit.
  {
    test_util::TempDir out;
    auto tied = tensors.copy();
    tied.insert("w_tied", tensors.at("w"));  // shares w's storage: in w's shard, counted once
    const auto files = perf::save_safetensors_sharded(tied, out.path, 25, {{"source", "perf"}});
    ASSERT_EQ(files, (std::vector<std::string>{out / "model-00001-of-00002.safetensors",
                                               out / "model-00002-of-00002.safetensors",
                                               out / "model.safetensors.index.json"}));
    EXPECT_EQ(perf::load_safetensors(files[0]).size(), 2u) << "w (24 bytes) and its tie: the next would pass 25";
    EXPECT_EQ(perf::safetensors_metadata(files[1]),
              (std::map<std::string, std::string>{{"format", "pt"}, {"source", "perf"}}));
    const auto back = perf::load_safetensors(files[2]);
    ASSERT_EQ(back.size(), tied.size());
    for (const auto& kv : tied) EXPECT_TRUE(bytes_of(back.at(kv.key())).equal(bytes_of(kv.value()))) << kv.key();
    EXPECT_NE(read_bytes(files[2]).find("\"total_size\": 44"), std::string::npos) << read_bytes(files[2]);
    // A tensor over the limit goes alone into a shard of its own, and the shard being filled goes on after it.
    test_util::TempDir big;
    auto order = c10::Dict<std::string, at::Tensor>();
    for (const char* k : {"half", "w", "count"}) order.insert(k, tensors.at(k));
    const auto big_files = perf::save_safetensors_sharded(order, big.path, 20);
    ASSERT_EQ(big_files.size(), 3u);
    EXPECT_EQ(perf::load_safetensors(big_files[0]).size(), 1u) << "w (24 bytes > 20) first, alone";
    EXPECT_EQ(perf::load_safetensors(big_files[1]).size(), 2u) << "half and count (16 bytes)";
    test_util::TempDir one;
    EXPECT_EQ(perf::save_safetensors_sharded(tensors, one.path), (std::vector<std::string>{one / "model.safetensors"}))
        << "one shard: model.safetensors, no index";
    test_util::TempDir none;
    auto last_bad = tensors.copy();
    last_bad.insert("z", torch::ones({2}, torch::kComplexDouble));
    PERF_EXPECT_THROW_MSG(perf::save_safetensors_sharded(last_bad, none.path, 25),
                          "perf::save_safetensors_sharded: \"z\" is ComplexDouble");
    EXPECT_TRUE(std::filesystem::is_empty(none.path)) << "refused before the first shard is written";
    PERF_EXPECT_THROW_MSG(perf::save_safetensors_sharded(tensors, none.path, 0), "max_shard_bytes is 0");
    PERF_EXPECT_THROW_MSG(perf::save_safetensors_sharded(tensors, none / "missing"), "is not a directory");
  }

  // Every truncation and every one-byte change of a real file: an answer or an error naming the reader.
  const std::string bytes = read_bytes(good);
  size_t errors = 0;
  const auto attempt = [&](const std::string& b) {
    errors += refused_when_read(
        bad, b, [](const std::string& p) { perf::load_safetensors(p); }, "perf::load_safetensors: ");
  };
  for (size_t n = 0; n < bytes.size(); ++n) attempt(bytes.substr(0, n));
  EXPECT_EQ(errors, bytes.size()) << "every truncation is refused";
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string b = bytes;
    b[i] = static_cast<char>(b[i] ^ 0x5a);
    attempt(b);
  }

  // What the format cannot hold is refused before anything is written; the earlier file stays.
  const auto before = read_bytes(good);
  PERF_EXPECT_THROW_MSG(perf::save_safetensors(torch::ones(2), good), "the tensors are a Tensor, not a dict");
  auto cplx = tensors.copy();  // c10::Dict copies share their items
  cplx.insert("z", torch::ones({2}, torch::kComplexDouble));
  PERF_EXPECT_THROW_MSG(perf::save_safetensors(cplx, good),
                        "\"z\" is ComplexDouble, which the format has no name for; it holds F64, F32");
  auto sparse = tensors.copy();
  sparse.insert("s", torch::eye(3).to_sparse());
  PERF_EXPECT_THROW_MSG(perf::save_safetensors(sparse, good), "\"s\" is a Sparse tensor; the format holds dense ones");
  auto f4_scalar = tensors.copy();
  f4_scalar.insert("s4", torch::tensor(0x12, torch::kUInt8).view(c10::kFloat4_e2m1fn_x2));
  PERF_EXPECT_THROW_MSG(perf::save_safetensors(f4_scalar, good), "\"s4\" is a 0-dim float4_e2m1fn_x2");
  auto meta_name = tensors.copy();
  meta_name.insert("__metadata__", torch::ones(1));
  PERF_EXPECT_THROW_MSG(perf::save_safetensors(meta_name, good), "\"__metadata__\" is the header's metadata");
  auto generic = perf::dict();
  generic.insert("epoch", 3);
  PERF_EXPECT_THROW_MSG(perf::save_safetensors(generic, good), "\"epoch\" is a Int, not a tensor");
  PERF_EXPECT_THROW_MSG(perf::save_safetensors(tensors, good, {{"bad", std::string("\xff", 1)}}),
                        "the metadata \"bad\" is not UTF-8 text");
  EXPECT_EQ(read_bytes(good), before);
  PERF_EXPECT_THROW_MSG(
      perf::save_safetensors(tensors, dir / "no/such/dir/w.safetensors"),
      "perf::save_safetensors: the directory of '" + dir.path + "/no/such/dir/w.safetensors' does not exist");
}

namespace {

// The lines of /proc/self/maps that map `path`: how a test sees that a file is mapped, and how.
std::vector<std::string> mappings_of(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> out;
  for (std::string line; std::getline(maps, line);) {
    if (line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0) {
      out.push_back(line);
    }
  }
  return out;
}

}  // namespace

// perf::SafetensorsFile (Python's safe_open): the header read once, each tensor the file's own bytes, mapped
// copy-on-write; slices; names refused by what the file holds; a sharded checkpoint through its index.
TEST(StateDict, ASafetensorsFileMapsTheFileAndGivesItsTensorsByNameAsSafeOpen) {
  test_util::TempDir dir;
  const auto tensors = safetensors_sample(torch::arange(24.f).reshape({6, 4}));
  const auto good = dir / "good.safetensors";
  perf::save_safetensors(tensors, good, {{"format", "pt"}});
  const std::string before = read_bytes(good);
  {
    const perf::SafetensorsFile f(good);
    EXPECT_EQ(f.path(), good);
    EXPECT_TRUE(f.device().is_cpu());
    EXPECT_EQ(f.keys(), (std::vector<std::string>{"count", "empty", "f4", "half", "mask", "w"}));
    // perf's writer orders them as Python's: the widest elements first, then by name.
    EXPECT_EQ(f.offset_keys(), (std::vector<std::string>{"count", "empty", "w", "half", "f4", "mask"}));
    EXPECT_TRUE(f.contains("w"));
    EXPECT_FALSE(f.contains("W"));
    EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
    for (const auto& kv : tensors) {
      const at::Tensor t = f.get_tensor(kv.key());
      EXPECT_EQ(t.scalar_type(), kv.value().scalar_type()) << kv.key();
      EXPECT_EQ(f.dtype(kv.key()), kv.value().scalar_type()) << kv.key();
      EXPECT_EQ(t.sizes(), kv.value().sizes()) << kv.key();
      EXPECT_EQ(f.shape(kv.key()), kv.value().sizes().vec()) << kv.key();
      EXPECT_TRUE(bytes_of(t).equal(bytes_of(kv.value()))) << kv.key();
    }
    // The file mapped once, private and writable, as Python's safe_open maps it; each call for a name gives the same
    // memory, and a write to it reaches neither the file nor another mapping of it.
    const auto maps = mappings_of(good);
    ASSERT_EQ(maps.size(), 1u);
    EXPECT_NE(maps[0].find(" rw-p "), std::string::npos) << maps[0];
    at::Tensor w = f.get_tensor("w");
    EXPECT_EQ(w.data_ptr(), f.get_tensor("w").data_ptr());
    w[0][0] = 42;
    EXPECT_EQ(f.get_tensor("w")[0][0].item<float>(), 42.f);
    EXPECT_EQ(read_bytes(good), before);
    EXPECT_EQ(perf::SafetensorsFile(good).get_tensor("w")[0][0].item<float>(), 0.f);
    EXPECT_EQ(perf::load_safetensors(good).at("w")[0][0].item<float>(), 0.f);
    // Slices, as Python's get_slice(name)[...]: rows of a row-major tensor are its bytes in the file, no copy.
    using namespace torch::indexing;
    const at::Tensor rows = f.get_slice("w", {Slice(2, 4), Slice()});
    EXPECT_TRUE(rows.equal(torch::arange(8.f, 16.f).reshape({2, 4})));
    EXPECT_EQ(static_cast<const char*>(rows.data_ptr()), static_cast<const char*>(w.data_ptr()) + 2 * 4 * 4);
    const at::Tensor column = f.get_slice("w", {Slice(), 1});
    EXPECT_TRUE(column.is_contiguous());
    EXPECT_TRUE(column.equal(torch::tensor({1.f, 5.f, 9.f, 13.f, 17.f, 21.f})));
    EXPECT_TRUE(
        f.get_slice("w", {Slice(None, None, 2), Slice(-1, None)}).equal(torch::tensor({{3.f}, {11.f}, {19.f}})));
    PERF_EXPECT_THROW_MSG(f.get_slice("w", {10}), "perf::SafetensorsFile::get_slice: \"w\" (shape [6, 4]): ");
    PERF_EXPECT_THROW_MSG(f.get_tensor("nope"), "perf::SafetensorsFile::get_tensor: " + good +
                                                    " holds no tensor \"nope\" (it holds 6: \"count\", \"empty\", "
                                                    "\"f4\", \"half\", \"mask\", ...)");
    PERF_EXPECT_THROW_MSG(f.shape("nope"), "perf::SafetensorsFile::shape: ");
    PERF_EXPECT_THROW_MSG(f.get_slice("nope", {0}), "perf::SafetensorsFile::get_slice: ");
    const auto all = f.get_tensors();
    std::vector<std::string> order;
    for (const auto& kv : all) order.push_back(kv.key());
    EXPECT_EQ(order, f.offset_keys());
    EXPECT_EQ(all.at("w").data_ptr(), w.data_ptr()) << "get_tensors() maps too";
  }
  // A tensor keeps the mapping after the file object is gone; the last one unmaps it.
  at::Tensor kept;
  {
    const perf::SafetensorsFile f(good);
    kept = f.get_tensor("w");
  }
  EXPECT_EQ(mappings_of(good).size(), 1u);
  EXPECT_TRUE(kept.equal(torch::arange(24.f).reshape({6, 4})));
  kept.reset();
  EXPECT_TRUE(mappings_of(good).empty()) << "unmapped with its last tensor";
  // perf::load_safetensors (Python's load_file) maps the file too.
  {
    const auto loaded = perf::load_safetensors(good);
    EXPECT_EQ(mappings_of(good).size(), 1u);
    EXPECT_TRUE(loaded.at("w").equal(tensors.at("w")));
  }
  EXPECT_TRUE(mappings_of(good).empty());

  // Bytes that do not start at a multiple of their element size (the format allows it; Python's writer and perf's
  // never make it) are copied instead of mapped.
  const auto odd = dir / "odd.safetensors";
  std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const float b_values[2] = {1.5f, -2.f};
  write_safetensors(odd, header, std::string("\x07", 1) + std::string(reinterpret_cast<const char*>(b_values), 8));
  {
    const perf::SafetensorsFile f(odd);
    const at::Tensor b = f.get_tensor("b");
    EXPECT_TRUE(b.equal(torch::tensor({1.5f, -2.f})));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data_ptr()) % 4, 0u);
    EXPECT_NE(b.data_ptr(), f.get_tensor("b").data_ptr()) << "a copy each time";
    EXPECT_EQ(f.get_tensor("a").item<uint8_t>(), 7);
    EXPECT_EQ(f.get_tensor("a").data_ptr(), f.get_tensor("a").data_ptr()) << "mapped";
  }

  // A sharded checkpoint, opened through its index: every name, each from its shard; the index's metadata.
  {
    test_util::TempDir out;
    const auto files = perf::save_safetensors_sharded(tensors, out.path, 40, {{"source", "perf"}});
    ASSERT_GT(files.size(), 2u);
    const perf::SafetensorsFile f(files.back());
    EXPECT_EQ(f.keys(), (std::vector<std::string>{"count", "empty", "f4", "half", "mask", "w"}));
    EXPECT_EQ(f.offset_keys().size(), 6u);
    for (const auto& kv : tensors)
      EXPECT_TRUE(bytes_of(f.get_tensor(kv.key())).equal(bytes_of(kv.value()))) << kv.key();
    EXPECT_EQ(f.metadata().at("source"), "perf");
    EXPECT_EQ(f.metadata().at("total_size"), std::to_string(96 + 8 + 0 + 8 + 2 + 2));
    EXPECT_EQ(mappings_of(files[0]).size(), 1u) << "every shard mapped";
    EXPECT_EQ(mappings_of(files[1]).size(), 1u);
  }

  // Refused: a missing file, a damaged one (the same checks as load_safetensors), a device this process lacks.
  PERF_EXPECT_THROW_MSG(perf::SafetensorsFile(dir / "none"), "perf::SafetensorsFile: " + dir / "none" + ": not a file");
  const auto bad = dir / "bad.safetensors";
  write_safetensors(bad, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", std::string(4, '\0'));
  PERF_EXPECT_THROW_MSG(perf::SafetensorsFile{bad},
                        "perf::SafetensorsFile: " + bad + ": \"a\" has data_offsets [0, 4], but its dtype");
  if (!test_util::has_cuda()) {
    PERF_EXPECT_THROW_MSG(perf::SafetensorsFile(good, torch::kCUDA),
                          "perf::SafetensorsFile: " + good + ": cannot put tensors on cuda: ");
  }
}

TEST(StateDict, OnGpuACudaModelSavesItsDeviceAndLoadsBackIntoOneOnTheGpu) {
  if (!test_util::has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  test_util::TempDir dir;
  const auto path = dir / "cuda.pt";
  torch::manual_seed(2);
  TwinNet net;
  net->to(torch::kCUDA);
  perf::save(perf::state_dict(net), path);
  // Python's torch.load puts them back on the GPU, as for its own file of a CUDA model.
  const auto out = test_util::python(std::string(TWIN_PY) + "sd = torch.load('" + path +
                                     "')\n"
                                     "print(sorted({str(v.device) for v in sd.values()}))\n");
  EXPECT_EQ(out, "['cuda:0']");
  const auto loaded = perf::load(path).toGenericDict();
  EXPECT_TRUE(loaded.at("head.weight").toTensor().device().is_cpu()) << "perf::load reads onto the CPU";
  TwinNet again;
  again->to(torch::kCUDA);
  perf::load_state_dict(again, loaded);
  EXPECT_TRUE(again->head->weight.is_cuda());
  for (const auto& kv : perf::state_dict(net)) {
    EXPECT_TRUE(kv.value().equal(perf::state_dict(again).at(kv.key()))) << kv.key();
  }
  // And as .safetensors: written from the GPU, read straight onto it.
  perf::save_safetensors(perf::state_dict(net), dir / "cuda.safetensors");
  const auto on_gpu = perf::load_safetensors(dir / "cuda.safetensors", torch::kCUDA);
  for (const auto& kv : perf::state_dict(net)) {
    EXPECT_TRUE(on_gpu.at(kv.key()).is_cuda()) << kv.key();
    EXPECT_TRUE(on_gpu.at(kv.key()).equal(kv.value())) << kv.key();
  }
  // Opened lazily onto the GPU (Python's safe_open(..., device="cuda")): a tensor, and a slice of one, copied there.
  const perf::SafetensorsFile f(dir / "cuda.safetensors", torch::kCUDA);
  const at::Tensor weight = perf::state_dict(net).at("head.weight");
  EXPECT_TRUE(f.get_tensor("head.weight").is_cuda());
  EXPECT_TRUE(f.get_tensor("head.weight").equal(weight));
  using namespace torch::indexing;
  const at::Tensor column = f.get_slice("head.weight", {Slice(), 1});
  EXPECT_TRUE(column.is_cuda() && column.is_contiguous());
  EXPECT_TRUE(column.equal(weight.index({Slice(), 1})));
}
