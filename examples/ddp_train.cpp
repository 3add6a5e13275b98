// Data-parallel training with perf::DistributedDataParallel.
//
//   torchrun --no-python --nproc-per-node 2 ./ddp_train           # with PyTorch's launcher
//   RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ./ddp_train &
//   RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ./ddp_train  # without Python
//
// Each rank reads its own shard of the dataset (DistributedRandomSampler), loads
// it with perf::loader_options and perf::prefetch, and trains a replica whose
// gradients are averaged across ranks during backward.
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>

namespace {

// Synthetic classification data: 3x32x32 images, 10 classes.
struct Synthetic : torch::data::datasets::Dataset<Synthetic> {
  explicit Synthetic(size_t n) : n_(n) {}
  torch::data::Example<> get(size_t i) override {
    auto g = at::make_generator<at::CPUGeneratorImpl>(i);
    return {torch::randn({3, 32, 32}, g), torch::tensor(static_cast<int64_t>(i % 10))};
  }
  std::optional<size_t> size() const override { return n_; }
  size_t n_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"perf::DistributedDataParallel example (launch with torchrun or RANK/WORLD_SIZE/MASTER_*)"};
  int epochs = 2, batch = 32, samples = 2048;
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "per-rank batch")->check(CLI::PositiveNumber);
  app.add_option("--samples", samples)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  perf::setup();
  auto pg = perf::init_process_group();  // NCCL when this process has a GPU, else Gloo
  const int rank = pg->getRank(), world = pg->getSize();
  const torch::Device device = torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);

  torch::nn::Sequential model(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 32, 3).padding(1)), torch::nn::ReLU(),
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 32, 3).padding(1).stride(2)),
                              torch::nn::ReLU(), torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions(1)),
                              torch::nn::Flatten(), torch::nn::Linear(32, 10));
  model->to(device);
  perf::DistributedDataParallel ddp(model, pg);  // rank 0's weights everywhere
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));

  for (int epoch = 0; epoch < epochs; ++epoch) {
    // A new shuffle per epoch, the same on every rank, each rank its own shard.
    torch::data::samplers::DistributedRandomSampler sampler(static_cast<size_t>(samples), static_cast<size_t>(world),
                                                            static_cast<size_t>(rank));
    sampler.set_epoch(static_cast<size_t>(epoch));
    auto loader =
        torch::data::make_data_loader(Synthetic(static_cast<size_t>(samples)).map(torch::data::transforms::Stack<>()),
                                      std::move(sampler), perf::loader_options(static_cast<size_t>(batch)));
    // Rank 0 shows progress; the loss stays on the device (read once per drawn line, no per-step sync).
    std::optional<perf::Progress> bar;
    if (rank == 0)
      bar.emplace(samples / world, perf::ProgressOptions().unit("img").description("epoch " + std::to_string(epoch)));
    auto total = torch::zeros({}, device);
    int64_t steps = 0;
    for (auto& b : perf::prefetch(*loader, device)) {
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(ddp(b.data), b.target);
      loss.backward();  // all-reduce in buckets while backward runs
      opt.step();
      total += loss.detach();
      ++steps;
      if (bar) bar->update(b.data.size(0), {{"loss", loss.detach()}});
    }
    if (bar) bar->close();
    if (rank == 0)
      std::cout << "epoch " << epoch << ": mean loss " << total.item<double>() / static_cast<double>(steps) << " over "
                << steps << " steps per rank, " << world << " ranks\n";
  }
  perf::destroy_process_group(pg);  // as torch.distributed.destroy_process_group()
  return 0;
}
