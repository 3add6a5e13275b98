// Launch-bound models, eager vs CUDA-graphed with perf::graph / perf::TrainStep:
// a 6-layer MLP at batch 32 and a small transformer block, inference and
// training, measured alternately in one run. GPU only: CUDA graphs do not exist
// on the CPU (perf runs them eagerly there, so there is nothing to compare).
// The Python peer (torch.compile mode="reduce-overhead") is bench/peer_graph.py.
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "program.h"

static int bench_graph_main(int argc, char** argv) {
  CLI::App app{"eager vs CUDA graphs on launch-bound models"};
  int iters = 200, batch = 32, width = 512;
  app.add_option("--iters", iters)->check(CLI::PositiveNumber);
  app.add_option("--batch", batch)->check(CLI::PositiveNumber);
  app.add_option("--width", width)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (!torch::cuda::is_available()) {
    std::cout << "bench_graph: no CUDA device; CUDA graphs need a GPU (perf::graph runs eagerly here)\n";
    return 0;
  }
  const torch::Device cuda(torch::kCUDA);
  std::cout << perf::environment() << "\n" << perf::setup() << "\n";
  const auto opts = perf::BenchOptions().warmup(20).iters(iters).items_per_call(batch).device(cuda);

  // 6-layer MLP.
  torch::manual_seed(0);
  torch::nn::Sequential mlp;
  mlp->push_back(torch::nn::Linear(width, width));
  for (int i = 0; i < 5; ++i) {
    mlp->push_back(torch::nn::ReLU());
    mlp->push_back(torch::nn::Linear(width, width));
  }
  mlp->to(cuda);
  const auto x = torch::randn({batch, width}, cuda);
  {
    mlp->eval();
    torch::NoGradGuard ng;
    auto g = perf::graph(mlp, x);
    std::cout << "MLP inference (6 x Linear " << width << ", batch " << batch << ")\n"
              << perf::compare(
                     "eager", [&] { mlp->forward(x); }, "perf::graph", [&] { g(x); }, opts)
              << "\n";
  }
  {
    mlp->train();
    const auto t = torch::randint(0, width, {batch}, torch::TensorOptions().device(cuda).dtype(torch::kLong));
    perf::optim::AdamW opt_e(mlp->parameters(), perf::optim::AdamWOptions(1e-4));
    auto loss_fn = [&](const torch::Tensor& in, const torch::Tensor& tg) {
      return torch::nn::functional::cross_entropy(mlp->forward(in), tg);
    };
    auto eager = [&] {
      opt_e.zero_grad();
      loss_fn(x, t).backward();
      opt_e.step();
    };
    perf::TrainStep step(*mlp, loss_fn, opt_e, x, t);
    std::cout << "MLP training step (forward + backward + fused AdamW)\n"
              << perf::compare(
                     "eager", eager, "perf::TrainStep", [&] { step.step(x, t); }, opts)
              << "\n";
  }
  // A small transformer encoder block.
  torch::nn::TransformerEncoderLayer block(torch::nn::TransformerEncoderLayerOptions(256, 4).dim_feedforward(1024));
  block->to(cuda);
  block->eval();
  const auto seq = torch::randn({64, batch, 256}, cuda);  // (S, N, E)
  {
    torch::NoGradGuard ng;
    auto g = perf::graph([&](const torch::Tensor& s) { return block->forward(s); }, seq);
    std::cout << "Transformer encoder block inference (d=256, 4 heads, seq 64, batch " << batch << ")\n"
              << perf::compare(
                     "eager", [&] { block->forward(seq); }, "perf::graph", [&] { g(seq); }, opts)
              << "\n";
  }
  return 0;
}

int main(int argc, char** argv) { return perf_bench::run_program("bench_graph", bench_graph_main, argc, argv); }
