// Training step of a ResNet-style CNN: stock fp32 NCHW vs perf's channels-last +
// autocast (bf16; on CUDA also fp16 with perf::GradScaler), measured
// alternately in one run with perf::compare. On the CPU, attention under
// autocast (bf16, fp32 inside, perf's per-shape pick). Also activation
// checkpointing's effect on peak memory. LibTorch's TransformerEncoderLayer against
// perf::TransformerEncoderLayer (perf/attention.h).
#include <malloc.h>
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <array>
#include <iomanip>
#include <iostream>

#include "program.h"
#include "resnet.h"

static int bench_amp_main(int argc, char** argv) {
  CLI::App app{"AMP + channels-last training step vs stock fp32 NCHW"};
  std::string device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  // 0 = the device's default: a CPU-sized job (width 32, batch 32, 64x64), or on a
  // GPU ResNet-18 at ImageNet size (width 64, batch 128, 224x224) so the step is
  // bound by the GPU's arithmetic, not by kernel launches.
  int batch = 0, image = 0, width = 0, iters = 10, warmup = 3;
  app.add_option("--device", device_name, "cpu or cuda");
  app.add_option("--batch", batch, "default 32 on cpu, 128 on cuda")->check(CLI::NonNegativeNumber);
  app.add_option("--image", image, "default 64 on cpu, 224 on cuda")->check(CLI::NonNegativeNumber);
  app.add_option("--width", width, "first stage's channels; default 32 on cpu, 64 on cuda")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--iters", iters)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  const torch::Device device(device_name);
  if (batch == 0) batch = device.is_cuda() ? 128 : 32;
  if (image == 0) image = device.is_cuda() ? 224 : 64;
  if (width == 0) width = device.is_cuda() ? 64 : 32;
  std::cout << perf::setup();

  torch::manual_seed(0);
  const auto x = torch::randn({batch, 3, image, image}, device);
  const auto y = torch::randint(0, 10, {batch}, torch::TensorOptions().device(device).dtype(torch::kLong));
  auto loss_of = [&](torch::Tensor out) { return torch::nn::functional::cross_entropy(out.to(torch::kFloat), y); };

  // Stock: fp32, NCHW, torch::optim::SGD.
  perf_bench::ResNet stock(width);
  stock->to(device);
  torch::optim::SGD stock_opt(stock->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto stock_step = [&] {
    stock_opt.zero_grad();
    loss_of(stock->forward(x)).backward();
    stock_opt.step();
  };

  auto amp_step_for = [&](c10::ScalarType dtype, bool scaled) {
    auto model = perf::optimize(perf_bench::ResNet(width), perf::ModelOptions().device(device).autocast_dtype(dtype));
    auto opt = std::make_shared<perf::optim::SGD>(model->parameters(), perf::optim::SGDOptions(0.01).momentum(0.9));
    auto scaler = std::make_shared<perf::GradScaler>(perf::GradScalerOptions().enabled(scaled));
    return [model, opt, scaler, &x, &loss_of]() mutable {
      opt->zero_grad();
      scaler->scale(loss_of(model(x))).backward();
      scaler->step(*opt);
      scaler->update();
    };
  };

  const auto opts = perf::BenchOptions().warmup(warmup).iters(iters).items_per_call(batch).device(device);
  std::cout << "\nResNet-style CNN (width " << width << ", 8 blocks), batch " << batch << ", " << image << "x" << image
            << ", on " << device << "; items/s = images/s\n\n";
  std::cout << perf::compare("fp32 NCHW (stock)", stock_step, "bf16 + channels-last",
                             amp_step_for(torch::kBFloat16, false), opts)
            << "\n";
  if (device.is_cuda()) {
    std::cout << perf::compare("fp32 NCHW (stock)", stock_step, "fp16 + CL + GradScaler",
                               amp_step_for(torch::kHalf, true), opts)
              << "\n";
  }

  // Attention under CPU autocast: LibTorch's bf16 policy, fp32 inside, and perf's
  // default (the faster of the two, measured once per shape), forward + backward.
  if (device.is_cpu()) {
    const std::vector<std::array<int64_t, 4>> shapes = {{16, 4, 64, 32}, {4, 8, 512, 64}};
    for (const auto& [b, h, t, d] : shapes) {
      auto q = torch::randn({b, h, t, d}, torch::requires_grad()),
           k = torch::randn({b, h, t, d}, torch::requires_grad()),
           v = torch::randn({b, h, t, d}, torch::requires_grad());
      auto step_in = [&](const std::string& mode) {
        return [&, mode] {
          perf::Autocast::set_cpu_attention(mode);
          perf::Autocast ac(torch::kCPU, torch::kBFloat16);
          at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true).sum().backward();
        };
      };
      std::cout << "causal scaled_dot_product_attention, forward + backward, batch " << b << ", " << h << " heads, "
                << t << " tokens, head size " << d << ", under perf::Autocast(kCPU, kBFloat16)\n"
                << perf::Stats::header() << "\n";
      const auto stats = perf::compare(
          {{"bf16 (LibTorch's autocast)", step_in("autocast")},
           {"fp32 inside", step_in("float32")},
           {"perf default (fastest)", step_in("fastest")}},
          perf::BenchOptions().warmup(warmup).iters(iters * 2).items_per_call(static_cast<double>(b * h)));
      for (const auto& st : stats) std::cout << st << "\n";
      std::cout << std::fixed << std::setprecision(2)
                << "perf default vs LibTorch's autocast: " << stats[0].median_ms / stats[2].median_ms << "x\n\n";
    }
    perf::Autocast::set_cpu_attention("fastest");
    for (const auto& line : perf::Autocast::cpu_attention_choices()) std::cout << "  measured: " << line << "\n";
    std::cout << "\n";
  }

  // LibTorch's TransformerEncoderLayer (attention written out: the (N * heads, L, L) weights in memory) against
  // perf::TransformerEncoderLayer (one scaled_dot_product_attention), the same weights, causal; training step and
  // inference. On CUDA in bf16, a larger layer.
  {
    const bool cuda = device.is_cuda();
    const int64_t d_model = cuda ? 1024 : 512, heads = cuda ? 16 : 8;
    const auto dtype = cuda ? torch::kBFloat16 : torch::kFloat;
    const std::vector<std::pair<int64_t, int64_t>> shapes =
        cuda ? std::vector<std::pair<int64_t, int64_t>>{{512, 32}, {2048, 8}, {4096, 4}}
             : std::vector<std::pair<int64_t, int64_t>>{{128, 16}, {512, 4}, {1024, 2}};
    std::cout << "TransformerEncoderLayer(" << d_model << ", " << heads << " heads, feed-forward " << 4 * d_model
              << "), " << (cuda ? "bf16" : "fp32") << ", causal: LibTorch's vs perf::TransformerEncoderLayer\n";
    for (const auto& [len, n] : shapes) {
      const auto options =
          torch::nn::TransformerEncoderLayerOptions(d_model, heads).dim_feedforward(4 * d_model).dropout(0.0);
      torch::nn::TransformerEncoderLayer stock_layer(options);
      perf::TransformerEncoderLayer fast(options);
      perf::load_state_dict(fast, perf::state_dict(stock_layer));
      stock_layer->to(device, dtype);
      fast->to(device, dtype);
      const auto tokens = torch::randn({len, n, d_model}, torch::TensorOptions().device(device).dtype(dtype));
      const auto mask = torch::nn::TransformerImpl::generate_square_subsequent_mask(len).to(device, dtype);
      const auto bench = perf::BenchOptions().warmup(warmup).iters(iters).items_per_call(static_cast<double>(n));
      const auto train = perf::compare(
          "LibTorch's", [&] { stock_layer(tokens, mask).sum().backward(); }, "perf's",
          [&] { fast(tokens, mask, torch::Tensor(), /*is_causal=*/true).sum().backward(); }, bench);
      stock_layer->eval();
      fast->eval();
      torch::NoGradGuard no_grad;
      const auto infer = perf::compare(
          "LibTorch's", [&] { stock_layer(tokens, mask); }, "perf's",
          [&] { fast(tokens, mask, torch::Tensor(), true); }, bench);
      std::cout << std::fixed << std::setprecision(2) << "  " << len << " tokens, batch " << n
                << ": forward + backward " << train.ratio << "x (" << train.a.median_ms << " -> " << train.b.median_ms
                << " ms), inference " << infer.ratio << "x (" << infer.a.median_ms << " -> " << infer.b.median_ms
                << " ms)\n";
    }
    std::cout << "\n";
  }

  // Activation checkpointing: peak memory of one training step of 8 wide layers.
  // (Fixed mmap threshold: glibc returns large blocks on free, so RSS follows live memory.)
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  std::vector<torch::nn::Linear> layers;
  for (int i = 0; i < 8; ++i) {
    layers.emplace_back(1024, 1024);
    layers.back()->to(device);
  }
  const auto h0 = torch::randn({4096, 1024}, torch::TensorOptions().device(device).requires_grad(true));
  auto peak = [&](bool ckpt) -> double {
    torch::Tensor h = h0;
    perf::reset_peak_memory(device);
    const auto s0 = perf::memory_stats(device);
    const int64_t base = device.is_cuda() ? *s0.allocated : *s0.rss;
    for (auto& l : layers) {
      auto f = [&](const std::vector<torch::Tensor>& in) { return torch::tanh(l(in[0])) * torch::sigmoid(in[0]); };
      h = ckpt ? perf::checkpoint(f, {h}) : f({h});
    }
    h.sum().backward();
    const auto s1 = perf::memory_stats(device);
    return static_cast<double>((device.is_cuda() ? *s1.peak_allocated : *s1.peak_rss) - base) / (1 << 20);
  };
  peak(false);
  const double plain = peak(false), ckpt = peak(true);
  std::cout << std::fixed << std::setprecision(0) << "activation checkpointing, 8 layers of 4096x1024: peak "
            << (device.is_cuda() ? "allocated" : "RSS") << " growth " << plain << " MiB plain vs " << ckpt
            << " MiB checkpointed (" << std::setprecision(2) << plain / ckpt << "x less)\n";
  return 0;
}

int main(int argc, char** argv) { return perf_bench::run_program("bench_amp", bench_amp_main, argc, argv); }
