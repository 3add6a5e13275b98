// perf demo: a small CNN trained on synthetic data, stock LibTorch vs perf's
// recipe (setup flags, channels-last, autocast, fused optimizer),
// measured side by side in one run with perf::compare (alternating rounds,
// ratio of medians).
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    features = register_module(
        "features",
        torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 32, 3).padding(1).bias(false)),
                              torch::nn::BatchNorm2d(32), torch::nn::ReLU(),
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1).stride(2).bias(false)),
                              torch::nn::BatchNorm2d(64), torch::nn::ReLU(),
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 128, 3).padding(1).stride(2).bias(false)),
                              torch::nn::BatchNorm2d(128), torch::nn::ReLU(),
                              torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions({1, 1}))));
    head = register_module("head", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(features->forward(x).flatten(1)); }
  torch::nn::Sequential features{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

// One training step: forward, loss, backward, optimizer.
template <typename Model>
void train_step(Model& model, torch::optim::Optimizer& opt, const torch::Tensor& x, const torch::Tensor& y) {
  opt.zero_grad();
  auto loss = torch::nn::functional::cross_entropy(model(x).to(torch::kFloat), y);
  loss.backward();
  opt.step();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"perf demo: stock LibTorch vs perf on a small CNN (synthetic data)"};
  int batch = 64, steps = 10, rounds = 5, image = 32;
  std::string device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  app.add_option("--batch", batch, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "training steps per round")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "alternating rounds per configuration")->check(CLI::PositiveNumber);
  app.add_option("--image", image, "image side in pixels")->check(CLI::PositiveNumber);
  app.add_option("--device", device_name, "cpu or cuda[:N]");
  CLI11_PARSE(app, argc, argv);

  const torch::Device device(device_name);
  const auto x = torch::randn({batch, 3, image, image}, device);
  const auto y = torch::randint(0, 10, {batch}, torch::TensorOptions().device(device).dtype(torch::kLong));

  // Stock LibTorch: fp32, NCHW, torch::optim::SGD, default backend flags.
  torch::manual_seed(0);
  Net stock;
  stock->to(device);
  torch::optim::SGD stock_opt(stock->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));

  // perf: setup() flags, channels-last + autocast (bf16 where supported), fused SGD.
  torch::manual_seed(0);
  auto fast = perf::optimize(Net(), perf::ModelOptions().device(device));
  perf::optim::SGD fast_opt(fast->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9));

  std::cout << "perf demo on " << device << ": small CNN, batch " << batch << ", " << image << "x" << image << ", "
            << steps << " steps x " << rounds << " rounds per configuration\n";
  // One call = `steps` training steps. The two configurations alternate
  // (A B A B ...), so drift and warm-up affect both alike; perf's backend
  // flags are applied only around its own rounds.
  const perf::Report report = perf::ScopedSettings().report();
  const auto result = perf::compare(
      "stock LibTorch",
      [&] {
        for (int i = 0; i < steps; ++i) train_step(stock, stock_opt, x, y);
      },
      "perf",
      [&] {
        perf::ScopedSettings perf_on;  // perf::setup() defaults, undone at scope exit (~7 us)
        for (int i = 0; i < steps; ++i) train_step(fast, fast_opt, x, y);
      },
      perf::BenchOptions().warmup(1).iters(rounds).items_per_call(steps * batch).device(device));
  std::cout << result << "\n"
            << "perf = perf::setup() + perf::optimize (channels-last, "
            << c10::toString(perf::Autocast::default_dtype(device)) << " autocast) + perf::optim::SGD (fused)\n\n"
            << report;
  return 0;
}
