// perf demo: a small CNN trained on synthetic data, stock LibTorch vs perf,
// measured side by side in one run (alternating rounds, medians compared).
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <vector>

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

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

// Images per second over `steps` training steps.
double train_round(Net& net, torch::optim::Optimizer& opt, const torch::Tensor& x, const torch::Tensor& y, int steps,
                   const torch::Device& device) {
  sync(device);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    opt.step();
  }
  sync(device);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(steps * x.size(0)) / s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
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
  train_round(net, opt, x, y, 2, device);  // warm-up: allocator, kernels, threads

  std::vector<double> stock, tuned;
  perf::Report report;
  for (int r = 0; r < rounds; ++r) {
    stock.push_back(train_round(net, opt, x, y, steps, device));
    perf::ScopedSettings perf_on;  // perf::setup() defaults, undone at scope exit
    if (r == 0) report = perf_on.report();
    if (r == 0) train_round(net, opt, x, y, 1, device);  // cuDNN benchmark picks algorithms
    tuned.push_back(train_round(net, opt, x, y, steps, device));
  }
  const double a = median(stock), b = median(tuned);
  std::cout << std::fixed << std::setprecision(1) << "stock LibTorch : " << a << " images/s\n"
            << "perf::setup()  : " << b << " images/s\n"
            << std::setprecision(2) << "ratio          : " << b / a << "x\n\n"
            << report;
  return 0;
}
