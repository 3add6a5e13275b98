// Data-parallel training with perf::DistributedDataParallel, or with
// perf::TrainStep's data_parallel(pg) (--train-step).
//
//   torchrun --no-python --nproc-per-node 2 ./ddp_train           # with PyTorch's launcher
//   RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ./ddp_train &
//   RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ./ddp_train  # without Python
//
// Each rank reads its own shard of the dataset (DistributedRandomSampler), loads
// it with perf::loader_options and perf::prefetch, and trains a replica whose
// gradients are averaged across ranks during backward (DDP), or after it inside
// the step (--train-step: on a GPU each step is one CUDA graph replay, the
// all-reduce in it). Exits 1 if the last epoch's mean loss is not below the first's.
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <optional>
#include <vector>

namespace {

// Synthetic classification data: 3x32x32 images, 10 classes, each class's noise
// around its own mean brightness (learnable, so the loss falls).
struct Synthetic : torch::data::datasets::Dataset<Synthetic> {
  explicit Synthetic(size_t n) : n_(n) {}
  torch::data::Example<> get(size_t i) override {
    auto g = at::make_generator<at::CPUGeneratorImpl>(i);
    const auto label = static_cast<int64_t>(i % 10);
    return {torch::randn({3, 32, 32}, g) + 0.2 * static_cast<double>(label - 5), torch::tensor(label)};
  }
  std::optional<size_t> size() const override { return n_; }
  size_t n_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"perf::DistributedDataParallel example (launch with torchrun or RANK/WORLD_SIZE/MASTER_*)"};
  int epochs = 2, batch = 32, samples = 2048;
  bool train_step = false;
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber);
  app.add_flag("--train-step", train_step,
               "perf::TrainStep with TrainStepOptions().data_parallel(pg) instead of perf::DistributedDataParallel");
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
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));
  // Either way rank 0's weights everywhere, once the DDP or the step is made.
  std::optional<perf::DistributedDataParallel<torch::nn::SequentialImpl>> ddp;
  if (!train_step) ddp.emplace(model, pg);
  std::optional<perf::TrainStep> step;  // made from the first batch
  std::vector<double> epoch_losses;

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
      torch::Tensor loss;
      if (train_step) {
        if (!step) {
          step.emplace(
              model,
              [&](const torch::Tensor& x, const torch::Tensor& t) {
                return torch::nn::functional::cross_entropy(model->forward(x), t);
              },
              opt, b, perf::TrainStepOptions().data_parallel(pg));
        }
        loss = step->step(b);  // forward, backward, the gradients' all-reduce, the update
      } else {
        opt.zero_grad();
        loss = torch::nn::functional::cross_entropy((*ddp)(b.data), b.target);
        loss.backward();  // all-reduce in buckets while backward runs
        opt.step();
      }
      total += loss.detach();
      ++steps;
      if (bar) bar->update(b.data.size(0), {{"loss", loss.detach()}});
    }
    if (bar) bar->close();
    epoch_losses.push_back(total.item<double>() / static_cast<double>(steps));
    if (rank == 0)
      std::cout << "epoch " << epoch << ": mean loss " << epoch_losses.back() << " over " << steps
                << " steps per rank, " << world << " ranks, "
                << (train_step ? (step->graphed() ? "perf::TrainStep, one CUDA graph per step" : "perf::TrainStep")
                               : "perf::DistributedDataParallel")
                << "\n";
  }
  perf::destroy_process_group(pg);  // as torch.distributed.destroy_process_group()
  return epoch_losses.size() > 1 && !(epoch_losses.back() < epoch_losses.front()) ? 1 : 0;
}
