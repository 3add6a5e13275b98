// perf demo: a small CNN trained on synthetic data, stock LibTorch vs perf,
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

void train(Net& net, torch::optim::Optimizer& opt, const torch::Tensor& x, const torch::Tensor& y, int steps) {
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    opt.step();
  }
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
  torch::manual_seed(0);
  Net net;
  net->to(device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const auto x = torch::randn({batch, 3, image, image}, device);
  const auto y = torch::randint(0, 10, {batch}, torch::TensorOptions().device(device).dtype(torch::kLong));

  std::cout << "perf demo on " << device << ": small CNN, batch " << batch << ", " << image << "x" << image << ", "
            << steps << " steps x " << rounds << " rounds per configuration\n";
  // One call = `steps` training steps. Stock LibTorch and perf alternate
  // (A B A B ...), so drift and warm-up affect both alike.
  const perf::Report report = perf::ScopedSettings().report();
  const auto result = perf::compare(
      "stock LibTorch", [&] { train(net, opt, x, y, steps); }, "perf::setup()",
      [&] {
        perf::ScopedSettings perf_on;  // perf::setup() defaults, undone at scope exit (~7 us)
        train(net, opt, x, y, steps);
      },
      perf::BenchOptions().warmup(1).iters(rounds).items_per_call(steps * batch).device(device));
  std::cout << result << "\n" << report;
  return 0;
}
