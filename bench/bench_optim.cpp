// Optimizer step time on a ResNet-50-shaped parameter set (161 tensors, 25.6M
// parameters): torch::optim::AdamW vs perf::optim::AdamW (fused and _foreach_),
// and torch::optim::SGD vs perf::optim::SGD, measured alternately in one run.
// Also the achieved memory traffic against a device copy's bandwidth.
#include <perf/bench.h>
#include <perf/optim.h>
#include <perf/setup.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iomanip>
#include <iostream>

namespace {

// torchvision's resnet50() parameter shapes, in order.
std::vector<std::vector<int64_t>> resnet50_shapes() {
  std::vector<std::vector<int64_t>> s = {{64, 3, 7, 7}, {64}, {64}};
  auto conv_bn = [&](int64_t out, int64_t in, int64_t k) {
    s.push_back({out, in, k, k});
    s.push_back({out});
    s.push_back({out});
  };
  int64_t in = 64;
  const int64_t blocks[] = {3, 4, 6, 3};
  for (int layer = 0; layer < 4; ++layer) {
    const int64_t width = 64 << layer, out = width * 4;
    for (int64_t b = 0; b < blocks[layer]; ++b) {
      conv_bn(width, in, 1);
      conv_bn(width, width, 3);
      conv_bn(out, width, 1);
      if (b == 0) conv_bn(out, in, 1);  // downsample
      in = out;
    }
  }
  s.push_back({1000, 2048});
  s.push_back({1000});
  return s;
}

std::vector<torch::Tensor> make_params(const torch::Device& device) {
  std::vector<torch::Tensor> ps;
  for (const auto& shape : resnet50_shapes()) {
    auto p = torch::randn(shape, device).requires_grad_(true);
    p.mutable_grad() = torch::randn(shape, device);
    ps.push_back(p);
  }
  return ps;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"optimizer step: torch::optim vs perf::optim on a ResNet-50 parameter set"};
  std::string device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  int iters = 20, warmup = 3;
  app.add_option("--device", device_name, "cpu or cuda");
  app.add_option("--iters", iters, "timed steps per optimizer")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  const torch::Device device(device_name);
  perf::setup();
  torch::NoGradGuard no_grad;

  torch::manual_seed(0);
  auto p_ref = make_params(device), p_fused = make_params(device), p_foreach = make_params(device);
  int64_t numel = 0;
  for (auto& p : p_ref) numel += p.numel();
  std::cout << "ResNet-50 parameter set: " << p_ref.size() << " tensors, " << numel << " parameters, on " << device
            << "\n\n";

  const auto opts = perf::BenchOptions().warmup(warmup).iters(iters).device(device);
  torch::optim::AdamW ref(p_ref, torch::optim::AdamWOptions(1e-3));
  perf::optim::AdamW fused(p_fused, perf::optim::AdamWOptions(1e-3));
  perf::optim::AdamW foreach (p_foreach, perf::optim::AdamWOptions(1e-3).fused(false));
  const auto adamw = perf::compare(
      "torch::optim::AdamW", [&] { ref.step(); }, "perf AdamW (fused)", [&] { fused.step(); }, opts);
  std::cout << adamw << "\n";
  const auto adamw_fe = perf::compare(
      "torch::optim::AdamW", [&] { ref.step(); }, "perf AdamW (foreach)",
      [&] {
        foreach
          .step();
      },
      opts);
  std::cout << adamw_fe << "\n";

  torch::optim::Adam adam_ref(p_ref, torch::optim::AdamOptions(1e-3));
  perf::optim::Adam adam_fused(p_fused, perf::optim::AdamOptions(1e-3));
  const auto adam = perf::compare(
      "torch::optim::Adam", [&] { adam_ref.step(); }, "perf Adam (fused)", [&] { adam_fused.step(); }, opts);
  std::cout << adam << "\n";

  torch::optim::SGD sgd_ref(p_ref, torch::optim::SGDOptions(0.1).momentum(0.9));
  perf::optim::SGD sgd_fused(p_fused, perf::optim::SGDOptions(0.1).momentum(0.9));
  const auto sgd = perf::compare(
      "torch::optim::SGD", [&] { sgd_ref.step(); }, "perf SGD (fused)", [&] { sgd_fused.step(); }, opts);
  std::cout << sgd << "\n";

  // Memory traffic per parameter: Adam(W) reads param, grad, exp_avg, exp_avg_sq and
  // writes param, exp_avg, exp_avg_sq (7 x 4 bytes); SGD with momentum reads param,
  // grad, momentum buffer and writes param, buffer (5 x 4 bytes). Ceiling: a plain copy.
  auto src = torch::empty({256 << 20}, torch::TensorOptions().device(device).dtype(torch::kFloat));  // 1 GiB
  auto dst = torch::empty_like(src);
  const auto copy = perf::benchmark([&] { dst.copy_(src); }, perf::BenchOptions().warmup(2).iters(10).device(device));
  const double copy_gbs = 2.0 * static_cast<double>(src.nbytes()) / (copy.median_ms * 1e6);
  std::cout << std::fixed << std::setprecision(1) << "copy bandwidth (1 GiB copy_, read+write): " << copy_gbs
            << " GB/s\n";
  const std::pair<const perf::Comparison*, double> rows[] = {{&adamw, 7.0}, {&adam, 7.0}, {&sgd, 5.0}};
  for (const auto& [cmp, words] : rows) {
    const double gbs = words * 4.0 * static_cast<double>(numel) / (cmp->b.median_ms * 1e6);
    std::cout << std::setprecision(1) << cmp->b.name << " achieved: " << gbs << " GB/s = " << std::setprecision(0)
              << 100.0 * gbs / copy_gbs << "% of copy bandwidth\n";
  }
  return 0;
}
