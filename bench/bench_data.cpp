// Data loading: LibTorch's default DataLoaderOptions vs perf::loader_options on
// a dataset with decode-like CPU work per sample, alternating epochs in one run;
// on CUDA also plain .to(device) vs perf::prefetch in a training loop (overlap)
// and pinned vs pageable host-to-device bandwidth.
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iomanip>
#include <iostream>

#include "program.h"

namespace {

// "Decodes" a 3 x 64 x 64 uint8 image per sample: ~`work_us` of CPU work.
struct DecodeDataset : torch::data::datasets::Dataset<DecodeDataset> {
  DecodeDataset(size_t n, int work_us) : n_(n), work_us_(work_us) {}
  torch::data::Example<> get(size_t i) override {
    auto img = torch::empty({3, 64, 64}, torch::kUInt8);
    auto* p = img.data_ptr<uint8_t>();
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u + 1;
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(work_us_);
    int64_t k = 0;
    do {  // an LCG stands in for entropy decoding
      for (int r = 0; r < 256; ++r, ++k) {
        x = x * 1664525u + 1013904223u;
        p[k % img.numel()] = static_cast<uint8_t>(x >> 24);
      }
    } while (std::chrono::steady_clock::now() < until);
    return {img, torch::tensor(static_cast<int64_t>(i % 10))};
  }
  std::optional<size_t> size() const override { return n_; }
  size_t n_;
  int work_us_;
};

// Decoded images already in memory (uint8 3 x size x size): loading costs only
// the collation, so the GPU figures isolate the host-to-device copy.
struct ImageBank : torch::data::datasets::Dataset<ImageBank> {
  ImageBank(int64_t n, int64_t size) : images_(torch::randint(0, 256, {n, 3, size, size}, torch::kUInt8)) {}
  torch::data::Example<> get(size_t i) override {
    return {images_[static_cast<int64_t>(i)], torch::tensor(static_cast<int64_t>(i % 10))};
  }
  std::optional<size_t> size() const override { return static_cast<size_t>(images_.size(0)); }
  torch::Tensor images_;
};

}  // namespace

static int bench_data_main(int argc, char** argv) {
  CLI::App app{"data loading: default LibTorch options vs perf::loader_options / perf::prefetch"};
  std::string device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  int samples = 1024, batch = 32, work_us = 200, epochs = 5, gpu_batch = 128, gpu_image = 224, gpu_batches = 64;
  app.add_option("--device", device_name, "cpu or cuda");
  app.add_option("--samples", samples)->check(CLI::PositiveNumber);
  app.add_option("--batch", batch)->check(CLI::PositiveNumber);
  app.add_option("--work-us", work_us, "CPU work per sample, microseconds")->check(CLI::NonNegativeNumber);
  app.add_option("--epochs", epochs, "timed epochs per configuration")->check(CLI::PositiveNumber);
  app.add_option("--gpu-batch", gpu_batch, "batch of the GPU training loop")->check(CLI::PositiveNumber);
  app.add_option("--gpu-image", gpu_image, "image side of the GPU training loop")->check(CLI::PositiveNumber);
  app.add_option("--gpu-batches", gpu_batches, "batches per epoch of the GPU training loop")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const torch::Device device(device_name);
  const size_t bs = static_cast<size_t>(batch);
  auto dataset = [&] {
    return DecodeDataset(static_cast<size_t>(samples), work_us).map(torch::data::transforms::Stack<>());
  };

  const auto stock_opts = torch::data::DataLoaderOptions(bs);
  const auto perf_opts = perf::loader_options(bs);
  std::cout << "dataset: " << samples << " samples, " << work_us << " us decode-like work each, batch " << batch
            << "\nstock: " << perf::describe(stock_opts) << "\nperf:  " << perf::describe(perf_opts) << "\n\n";
  auto stock = torch::data::make_data_loader(dataset(), stock_opts);
  auto tuned = torch::data::make_data_loader(dataset(), perf_opts);
  const double batches_per_epoch = static_cast<double>(samples / batch);
  auto epoch = [](auto& loader, auto&& consume) {
    for (auto& b : loader) consume(b);
  };
  const auto opts = perf::BenchOptions().warmup(1).iters(epochs).items_per_call(batches_per_epoch).device(torch::kCPU);

  // 1) Loading alone: batches/s.
  auto nothing = [](auto&) {};
  std::cout << "loading only (items/s = batches/s)\n"
            << perf::compare(
                   "default options", [&] { epoch(*stock, nothing); }, "perf::loader_options",
                   [&] { epoch(*tuned, nothing); }, opts)
            << "\n";
  // 2) Loading while the main thread computes (a stand-in training step of
  //    about the same cost as loading one batch), as in training.
  const auto a = torch::randn({256, 256});
  const int threads = at::get_num_threads();
  auto compute = [&](auto&) {
    at::set_num_threads(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(work_us * batch);
    while (std::chrono::steady_clock::now() < until) (void)torch::mm(a, a);
  };
  std::cout << "loading + a training step of equal cost on the main thread (items/s = batches/s)\n"
            << perf::compare(
                   "default options", [&] { epoch(*stock, compute); }, "perf::loader_options",
                   [&] { epoch(*tuned, compute); }, opts)
            << "\n";

  at::set_num_threads(threads);
  if (!device.is_cuda()) {
    std::cout << "(no CUDA device: the prefetch overlap and pinned-memory figures need a GPU)\n";
    return 0;
  }
  // 3) GPU: a training loop fed by plain .to(device) vs perf::prefetch, against
  //    the same loop with the batch already resident. Images sit decoded in
  //    memory, so the gap between plain and resident is the copy (and collation).
  auto model =
      torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 64, 3).padding(1)), torch::nn::ReLU(),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 64, 3).padding(1)),
                            torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions(1)), torch::nn::Flatten(),
                            torch::nn::Linear(64, 10));
  model->to(device);
  perf::optim::SGD opt(model->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9));
  auto step = [&](const torch::Tensor& x, const torch::Tensor& y) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x.to(torch::kFloat).div_(255)), y).backward();
    opt.step();
  };
  const auto gbs = static_cast<size_t>(gpu_batch);
  auto gpu_loader = torch::data::make_data_loader(
      ImageBank(int64_t{gpu_batch} * gpu_batches, gpu_image).map(torch::data::transforms::Stack<>()),
      perf::loader_options(gbs));
  torch::Tensor rx, ry;
  for (auto& b : *gpu_loader) {
    rx = b.data.to(device);
    ry = b.target.to(device);
  }
  std::cout << "training loop on " << device << ": batch " << gpu_batch << " of uint8 3x" << gpu_image << "x"
            << gpu_image << " (" << std::fixed << std::setprecision(1) << static_cast<double>(rx.nbytes()) / 1e6
            << " MB), " << gpu_batches << " batches per epoch, 2 convolutions + SGD (items/s = batches/s)\n";
  const auto gopts =
      perf::BenchOptions().warmup(1).iters(epochs).items_per_call(static_cast<double>(gpu_batches)).device(device);
  const auto resident = perf::benchmark(
      [&] {
        for (int i = 0; i < gpu_batches; ++i) step(rx, ry);
      },
      perf::BenchOptions(gopts).name("data resident"));
  const auto cmp = perf::compare(
      "plain .to(device)",
      [&] {
        for (auto& b : *gpu_loader) step(b.data.to(device), b.target.to(device));
      },
      "perf::prefetch",
      [&] {
        for (auto& b : perf::prefetch(*gpu_loader, device)) step(b.data, b.target);
      },
      gopts);
  std::cout << cmp << perf::Stats::header() << resident;
  const double hidden = 1.0 - (cmp.b.median_ms - resident.median_ms) / (cmp.a.median_ms - resident.median_ms);
  std::cout << std::setprecision(1) << "loading + copy time hidden by prefetch: " << 100.0 * hidden
            << "% ; prefetch epoch within " << 100.0 * (cmp.b.median_ms / resident.median_ms - 1.0)
            << "% of data-resident\n\n";
  // 4) Host-to-device bandwidth, pageable vs pinned (256 MiB).
  auto pageable = torch::empty({64 << 20}, torch::kFloat);
  auto pinned = pageable.pin_memory();
  auto dst = torch::empty({64 << 20}, torch::TensorOptions().device(device));
  const auto h2d = perf::compare(
      "pageable H2D", [&] { dst.copy_(pageable); }, "pinned H2D", [&] { dst.copy_(pinned, /*non_blocking=*/true); },
      perf::BenchOptions().warmup(2).iters(10).device(device));
  std::cout << h2d << std::setprecision(1) << "pageable "
            << static_cast<double>(pageable.nbytes()) / (h2d.a.median_ms * 1e6) << " GB/s, pinned "
            << static_cast<double>(pinned.nbytes()) / (h2d.b.median_ms * 1e6) << " GB/s\n";
  return 0;
}

int main(int argc, char** argv) { return perf_bench::run_program("bench_data", bench_data_main, argc, argv); }
