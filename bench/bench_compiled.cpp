// Inference latency: LibTorch eager (fp32; perf's recipe) vs the AOTInductor
// package of the same ResNet-style CNN (bench/resnet.h, bench/resnet.py), side
// by side, batch 1 and 32. On CUDA also perf::graph of the eager recipe.
// scripts/bench-compiled.sh exports the package and runs this.
#include <perf/bench.h>
#include <perf/compiled.h>
#include <perf/cuda_graph.h>
#include <perf/model.h>
#include <perf/setup.h>

#include <CLI/CLI.hpp>
#include <iomanip>
#include <iostream>

#include "resnet.h"

int main(int argc, char** argv) {
  CLI::App app("eager vs AOTInductor package, inference");
  std::vector<std::string> packages;
  std::string device_name = "cpu";
  int64_t width = 32, image = 64;
  std::vector<int64_t> batches = {1, 32};
  int iters = 30;
  app.add_option("--package", packages, "packages of bench/resnet.py (scripts/bench-compiled.sh writes them)")
      ->required();
  app.add_option("--device", device_name, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--width", width, "ResNet width (as exported)");
  app.add_option("--image", image, "image side (as exported)");
  app.add_option("--batches", batches, "batch sizes");
  app.add_option("--iters", iters, "timed calls per configuration");
  CLI11_PARSE(app, argc, argv);

  perf::setup();
  const c10::Device device(device_name);
  std::vector<std::unique_ptr<perf::CompiledModel>> compiled;
  for (const auto& p : packages) {
    compiled.push_back(std::make_unique<perf::CompiledModel>(p));
    std::cout << *compiled.back();
  }
  perf_bench::ResNet plain(width);
  plain->to(device);
  plain->eval();
  // perf's recipe: channels-last + autocast (bf16 where the device computes it natively), inference mode.
  auto recipe = perf::optimize(perf_bench::ResNet(width), perf::ModelOptions().device(device));
  const auto opts = perf::BenchOptions().warmup(5).iters(iters).device(device);
  for (int64_t batch : batches) {
    const auto x = torch::randn({batch, 3, image, image}, torch::TensorOptions().device(device));
    std::vector<std::pair<std::string, std::function<void()>>> configs = {
        {"eager fp32",
         [&] {
           c10::InferenceMode guard;
           plain->forward(x);
         }},
        {"eager + perf recipe", [&] { recipe.infer(x); }},
    };
    for (auto& c : compiled) {
      const auto& in = c->inputs().at(0);
      const std::string label = std::string("package ") +
                                (in.dtype == torch::kFloat ? "fp32" : c10::toString(in.dtype)) +
                                (in.format == at::MemoryFormat::ChannelsLast ? " NHWC" : "");
      configs.emplace_back(label, [&c, &x, dtype = in.dtype] {
        c10::InferenceMode guard;
        (*c)(x.to(dtype));  // a no-op for fp32; the bf16 package's cast is part of its cost
      });
    }
    using Fn = std::function<torch::Tensor(const torch::Tensor&)>;
    std::vector<decltype(perf::graph(Fn(), x))> graphs;
    if (device.is_cuda()) {
      // The package itself cannot be captured (perf/compiled.h says why).
      graphs.push_back(perf::graph(Fn([&](const torch::Tensor& in) { return recipe.infer(in); }), x));
      configs.emplace_back("perf::graph(eager recipe)", [&] { graphs[0](x); });
    }
    const auto stats = perf::compare(configs, opts);
    std::cout << "\n"
              << device << " batch " << batch << ", " << image << "x" << image << ", width " << width << "\n"
              <<
        [] {
          auto h = perf::Stats::header();
          return h.substr(0, h.size() - 1);
        }() << "  vs fp32\n";
    for (const auto& s : stats) {
      auto line = s.to_string();
      while (!line.empty() && line.back() == '\n') line.pop_back();
      std::cout << line << std::fixed << std::setprecision(2) << std::setw(10) << stats[0].median_ms / s.median_ms
                << "x\n";
    }
  }
  return 0;
}
