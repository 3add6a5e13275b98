// Data-parallel training step, 2+ processes: perf::DistributedDataParallel
// (bucketed all-reduce overlapped with backward, c10d::Reducer) vs the official
// LibTorch example's scheme (pytorch/examples cpp/distributed: one all-reduce
// per parameter after backward), and the same step without communication, all
// measured round-robin in one run. The share of communication hidden behind
// backward = (manual - ddp) / (manual - no communication). Also perf::TrainStep
// with data_parallel(pg), which averages after backward (in buckets; with a flat
// SGD its one gradient buffer in one all-reduce) and, on CUDA, replays the whole
// step with its all-reduce as one CUDA graph.
//
//   bash scripts/bench-ddp.sh [world]      # starts the ranks on 127.0.0.1
//   RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. bench_ddp [--device cuda]
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iomanip>
#include <iostream>

#include "program.h"
#include "resnet.h"

static int bench_ddp_main(int argc, char** argv) {
  CLI::App app{"DDP step: perf::DistributedDataParallel vs per-parameter all-reduce after backward"};
  std::string device_name = "cpu";
  int batch = 16, image = 32, width = 16, iters = 20, warmup = 3, threads = 0;
  app.add_option("--device", device_name, "cpu (Gloo) or cuda (NCCL)");
  app.add_option("--batch", batch, "per-rank batch")->check(CLI::PositiveNumber);
  app.add_option("--image", image)->check(CLI::PositiveNumber);
  app.add_option("--width", width)->check(CLI::PositiveNumber);
  app.add_option("--iters", iters)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads,
                 "intra-op threads per rank (0: perf::init_process_group's share of the cores, physical cores / ranks "
                 "on this machine)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  const torch::Device device(device_name);

  auto pg = perf::init_process_group(perf::ProcessGroupOptions().backend(device.is_cuda() ? "nccl" : "gloo"));
  const int rank = pg->getRank(), world = pg->getSize();
  if (device.is_cpu() && threads > 0) at::set_num_threads(threads);
  torch::manual_seed(0);
  const auto x = torch::randn({batch, 3, image, image}, device);
  const auto y = torch::randint(0, 10, {batch}, torch::TensorOptions().device(device).dtype(torch::kLong));

  perf_bench::ResNet a(width), b(width), c(width), sa(width), sb(width);
  for (auto* m : {&a, &b, &c, &sa, &sb}) (*m)->to(device);
  perf::DistributedDataParallel ddp(a, pg);
  perf::optim::SGD opt_a(a->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9));
  perf::optim::SGD opt_b(b->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9));
  perf::optim::SGD opt_c(c->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9));
  perf::optim::SGD opt_d(sa->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9));
  perf::optim::SGD opt_e(sb->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9).flat(true));
  auto loss_of = [](perf_bench::ResNet& m) {
    return [&m](const at::Tensor& in, const at::Tensor& t) {
      return torch::nn::functional::cross_entropy(m->forward(in), t);
    };
  };
  perf::TrainStep step_d(sa, loss_of(sa), opt_d, x, y, perf::TrainStepOptions().data_parallel(pg));
  perf::TrainStep step_e(sb, loss_of(sb), opt_e, x, y, perf::TrainStepOptions().data_parallel(pg));
  int64_t numel = 0;
  for (const auto& p : a->parameters()) numel += p.numel();

  auto ddp_step = [&] {
    opt_a.zero_grad();
    torch::nn::functional::cross_entropy(ddp(x), y).backward();
    opt_a.step();
  };
  auto manual_step = [&] {  // the official example: all-reduce each gradient after backward
    opt_b.zero_grad();
    torch::nn::functional::cross_entropy(b->forward(x), y).backward();
    for (auto& p : b->parameters()) {
      std::vector<at::Tensor> t = {p.grad()};
      pg->allreduce(t)->wait();
      p.mutable_grad().div_(world);
    }
    opt_b.step();
  };
  auto local_step = [&] {  // same step, no communication
    opt_c.zero_grad();
    torch::nn::functional::cross_entropy(c->forward(x), y).backward();
    opt_c.step();
  };
  const auto opts = perf::BenchOptions().warmup(warmup).iters(iters).items_per_call(batch * world).device(device);
  const auto s = perf::compare({{"per-param all-reduce", manual_step},
                                {"perf DDP", ddp_step},
                                {"no communication", local_step},
                                {"TrainStep dp", [&] { step_d.step(x, y); }},
                                {"TrainStep dp, flat", [&] { step_e.step(x, y); }}},
                               opts);
  if (rank == 0) {
    std::cout << "ResNet-style CNN (width " << width << "), " << numel << " parameters (" << std::fixed
              << std::setprecision(1) << static_cast<double>(numel * 4) / 1e6 << " MB of gradients), batch " << batch
              << " per rank, " << image << "x" << image << ", " << world << " ranks on " << device << " ("
              << pg->getBackendName() << "), " << at::get_num_threads() << " threads per rank; items/s = images/s "
              << "across ranks; " << ddp.buckets().size() << " DDP buckets\n\n"
              << perf::Stats::header();
    for (const auto& st : s) std::cout << st;
    const double manual = s[0].median_ms, d = s[1].median_ms, local = s[2].median_ms;
    std::cout << std::setprecision(2) << "perf::DistributedDataParallel vs per-parameter all-reduce: " << manual / d
              << "x (ratio of medians, measured round-robin)\n"
              << std::setprecision(0)
              << "communication hidden behind backward: " << 100.0 * (manual - d) / std::max(1e-9, manual - local)
              << "% (communication cost " << std::setprecision(1) << manual - local
              << " ms exposed per step without overlap, " << d - local << " ms with DDP)\n"
              << std::setprecision(2)
              << "perf::TrainStep with data_parallel vs perf::DistributedDataParallel: " << d / s[3].median_ms
              << "x, with a flat SGD " << d / s[4].median_ms << "x"
              << (step_d.graphed() ? " (each step one CUDA graph replay)" : " (eager steps)") << "\n";
  }
  perf::destroy_process_group(pg);
  return 0;
}

int main(int argc, char** argv) { return perf_bench::run_program("bench_ddp", bench_ddp_main, argc, argv); }
