// perf demo: a small CNN trained on synthetic data, stock LibTorch against
// perf's recipe, and each ingredient of the recipe on its own, so that the
// numbers explain themselves. All configurations run round-robin in one
// process (A B C D E A B C D E ...), each with its own identically initialised
// model; ratios are of medians.
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iomanip>
#include <iostream>

namespace {

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
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
TORCH_MODULE(ConvNet);

// One training step: forward, loss, backward, optimizer.
template <typename Model>
void train_step(Model& model, torch::optim::Optimizer& opt, const torch::Tensor& x, const torch::Tensor& y) {
  opt.zero_grad();
  auto loss = torch::nn::functional::cross_entropy(model(x).to(torch::kFloat), y);
  loss.backward();
  opt.step();
}

std::string ratio(double r) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << r << "x";
  return os.str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"perf demo: stock LibTorch vs perf on a small CNN (synthetic data), ingredient by ingredient"};
  int batch = 64, steps = 5, rounds = 9, image = 32;
  std::string device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  app.add_option("--batch", batch, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "training steps per timed call")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "timed rounds per configuration (round-robin)")->check(CLI::PositiveNumber);
  app.add_option("--image", image, "image side in pixels")->check(CLI::PositiveNumber);
  app.add_option("--device", device_name, "cpu or cuda[:N]");
  CLI11_PARSE(app, argc, argv);

  const torch::Device device(device_name);
  const auto x = torch::randn({batch, 3, image, image}, device);
  const auto y = torch::randint(0, 10, {batch}, torch::TensorOptions().device(device).dtype(torch::kLong));
  const bool amp_default = perf::Autocast::default_enabled(device);

  // Stock LibTorch: fp32, NCHW, torch::optim::SGD, default backend flags.
  torch::manual_seed(0);
  ConvNet stock;
  torch::manual_seed(0);
  ConvNet with_setup;
  stock->to(device);
  with_setup->to(device);
  const auto sgd = torch::optim::SGDOptions(0.01).momentum(0.9);
  torch::optim::SGD stock_opt(stock->parameters(), sgd), setup_opt(with_setup->parameters(), sgd);
  // Ingredients added one at a time, then perf's whole recipe.
  torch::manual_seed(0);
  auto cl = perf::optimize(ConvNet(), perf::ModelOptions().device(device).autocast(false));
  torch::optim::SGD cl_opt(cl->parameters(), sgd);
  torch::manual_seed(0);
  auto amp =
      perf::optimize(ConvNet(), perf::ModelOptions().device(device).autocast_dtype(
                                    device.is_cuda() ? perf::Autocast::default_dtype(device) : torch::kBFloat16));
  torch::optim::SGD amp_opt(amp->parameters(), sgd);
  torch::manual_seed(0);
  auto fast = perf::optimize(ConvNet(), perf::ModelOptions().device(device));  // perf's defaults for this device
  perf::optim::SGD fast_opt(fast->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9));

  std::cout << "perf demo on " << device << ": small CNN, batch " << batch << ", " << image << "x" << image << ", "
            << steps << " steps per call, " << rounds << " rounds, configurations round-robin\n";
  if (device.is_cpu()) {
    std::cout << "CPU bf16: " << perf::detail::cpu_bf16().features() << " -> perf's CPU autocast default is "
              << (amp_default ? "bf16 (native bf16 arithmetic)" : "off: fp32 (bf16 would be emulated, slower)") << "\n";
  }
  // perf's flags are switched on only around its own calls (ScopedSettings,
  // a few microseconds), so the stock configuration runs with LibTorch's defaults.
  const perf::Report report = perf::ScopedSettings().report();
  // Progress over every call of the comparison (stderr; a line every 500 ms, no per-step cost).
  const int warmup = 2, configurations = 5;
  perf::Progress bar(int64_t{warmup + rounds} * configurations * steps * batch,
                     perf::ProgressOptions().unit("img").description("training"));
  auto with_perf_flags = [&](auto& model, torch::optim::Optimizer& opt) {
    perf::ScopedSettings on;
    for (int i = 0; i < steps; ++i) train_step(model, opt, x, y);
    bar.update(steps * batch);
  };
  const std::string amp_name = std::string("+ ") + (device.is_cuda() ? "autocast" : "bf16 autocast") +
                               (amp_default ? "" : " (not perf's default here)");
  const auto stats =
      perf::compare({{"stock LibTorch",
                      [&] {
                        for (int i = 0; i < steps; ++i) train_step(stock, stock_opt, x, y);
                        bar.update(steps * batch);
                      }},
                     {"+ setup() flags", [&] { with_perf_flags(with_setup, setup_opt); }},
                     {"+ channels-last", [&] { with_perf_flags(cl, cl_opt); }},
                     {amp_name, [&] { with_perf_flags(amp, amp_opt); }},
                     {"perf: all + fused SGD", [&] { with_perf_flags(fast, fast_opt); }}},
                    perf::BenchOptions().warmup(warmup).iters(rounds).items_per_call(steps * batch).device(device));

  bar.close();
  std::cout << perf::Stats::header();
  for (const auto& s : stats) std::cout << s;
  std::cout << "\nspeed-up over stock LibTorch (ratio of medians; p90/median of stock = " << std::setprecision(3)
            << stats[0].p90_ms / stats[0].median_ms << ", so differences within " << std::setprecision(2)
            << 100.0 * (stats[0].p90_ms / stats[0].median_ms - 1.0) << "% are noise):\n";
  for (size_t k = 1; k < stats.size(); ++k)
    std::cout << "  " << std::left << std::setw(44) << stats[k].name << std::right
              << ratio(stats[0].median_ms / stats[k].median_ms) << "\n";
  std::cout << "\nwhat the numbers say:\n"
            << "  - setup() flags matter on CUDA (TF32, cuDNN autotuner); on a CPU they change little.\n"
            << "  - channels-last lets oneDNN/cuDNN use NHWC kernels; it pays most with autocast and on GPUs.\n";
  if (device.is_cpu()) {
    std::cout << "  - bf16 autocast on the CPU: "
              << (amp_default ? "this CPU has native bf16, so perf turns it on by default.\n"
                              : "this CPU has no native bf16; emulated bf16 is slower than fp32, so perf leaves "
                                "it off (the row above shows what it would cost).\n");
  } else {
    std::cout << "  - autocast runs matmuls and convolutions in "
              << c10::toString(perf::Autocast::default_dtype(device)) << " on tensor cores.\n";
  }
  std::cout << "  - perf's full recipe = setup() + perf::optimize (channels-last" << (amp_default ? ", autocast" : "")
            << ") + perf::optim::SGD (one fused kernel for all parameters).\n\n"
            << report;
  // What perf::advise says about each loop: the stock one, and perf's recipe.
  const auto advise_options = perf::AdviseOptions().steps(5).warmup(1).device(device);
  std::cout << "\nstock LibTorch loop, " << perf::advise([&] { train_step(stock, stock_opt, x, y); }, advise_options)
            << "\nperf's loop, "
            << perf::advise(
                   [&] {
                     perf::ScopedSettings on;
                     train_step(fast, fast_opt, x, y);
                   },
                   advise_options);
  return 0;
}
