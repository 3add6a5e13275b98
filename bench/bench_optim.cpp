// Optimizer step time on a ResNet-50-shaped parameter set (161 tensors, 25.6M
// parameters): torch::optim::AdamW vs perf::optim::AdamW (fused and _foreach_),
// and torch::optim::SGD vs perf::optim::SGD, measured alternately in one run;
// then perf's flat mode (.flat(true): one buffer per dtype) against the fused
// multi-tensor path, on ResNet-50 and on a transformer-shaped set (many small
// LayerNorm and bias vectors). Also the achieved memory traffic against a
// device copy's bandwidth, and a probe of the fused kernel's launch geometry
// over one flat buffer (see launch_probe); and an EMA of the weights
// (perf::optim::AveragedModel) over flat(true) buffers against separate
// tensors; and Muon (perf/muon.h) over a transformer's weight matrices, its
// Newton-Schulz iterations batched per shape against Python's one matrix at a
// time. --json appends one JSON line per
// configuration of each comparison (bench/report_optim.py's rows, beside
// bench/peer_optim.py's).
#include <perf/bench.h>
#include <perf/muon.h>
#include <perf/optim.h>
#include <perf/setup.h>
#include <perf/swa_utils.h>
#include <torch/torch.h>

#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <CLI/CLI.hpp>
#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iostream>

#include "program.h"

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

// A GPT-style decoder, 12 layers of width 256 (11.8M parameters in 148 tensors,
// 98 of them vectors): where per-tensor overhead shows.
std::vector<std::vector<int64_t>> transformer_shapes() {
  const int64_t d = 256;
  std::vector<std::vector<int64_t>> s = {{8192, d}, {1024, d}};  // token and position embeddings
  for (int layer = 0; layer < 12; ++layer) {
    for (const auto& shape : std::vector<std::vector<int64_t>>{{d},
                                                               {d},  // ln1
                                                               {3 * d, d},
                                                               {3 * d},  // qkv
                                                               {d, d},
                                                               {d},  // attention out
                                                               {d},
                                                               {d},  // ln2
                                                               {4 * d, d},
                                                               {4 * d},  // mlp in
                                                               {d, 4 * d},
                                                               {d}})  // mlp out
      s.push_back(shape);
  }
  s.push_back({d});
  s.push_back({d});  // final norm
  return s;
}

// The weight matrices of transformer_shapes()'s decoder at width d (48: four shapes, twelve of each), the
// parameters Muon is for (the embeddings, vectors and head go to AdamW).
std::vector<std::vector<int64_t>> transformer_matrices(int64_t d) {
  std::vector<std::vector<int64_t>> s;
  for (int layer = 0; layer < 12; ++layer)
    for (const auto& shape : std::vector<std::vector<int64_t>>{{3 * d, d}, {d, d}, {4 * d, d}, {d, 4 * d}})
      s.push_back(shape);
  return s;
}

// A module whose parameters are given tensors: what perf::optim::AveragedModel averages.
struct ParamsImpl : torch::nn::Module {
  explicit ParamsImpl(const std::vector<torch::Tensor>& ps) {
    for (size_t i = 0; i < ps.size(); ++i) register_parameter("p" + std::to_string(i), ps[i]);
  }
};

std::vector<torch::Tensor> make_params(const torch::Device& device,
                                       const std::vector<std::vector<int64_t>>& shapes = resnet50_shapes()) {
  std::vector<torch::Tensor> ps;
  for (const auto& shape : shapes) {
    auto p = torch::randn(shape, device).requires_grad_(true);
    p.mutable_grad() = torch::randn(shape, device);
    ps.push_back(p);
  }
  return ps;
}

// One at::_fused_adamw_ call over a whole flat buffer: ATen's multi_tensor_apply
// cuts it into chunks of 65536 elements, one 512-thread block each, and launches
// at most 320 blocks at a time (ATen/native/cuda/MultiTensorApply.cuh):
// ResNet-50's 25.6M parameters run as 320 + 71 blocks, which no SM count
// divides. This probe times that one call against the same update issued as
// several calls of k x (SM count) chunks each, so that every launch but the last
// spreads evenly over the SMs. Flat mode on CUDA issues its calls the second way
// (k = 320 / SMs: detail::elements_per_call); the probe keeps the evidence for
// that choice on each device. On the CPU it is a control (the CPU kernel has no
// such limit, and flat mode makes one call there). Those calls alternated
// between two streams are timed through the optimizer itself (main: "flat, 2
// streams").
std::vector<perf::Comparison> launch_probe(const torch::Device& device, int64_t numel, const perf::BenchOptions& opts,
                                           int64_t& units) {
  constexpr int64_t chunk = 65536;
  units = at::get_num_threads();
#if PERF_WITH_CUDA
  if (device.is_cuda())
    units = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->multiProcessorCount;
#endif
  const auto f = torch::TensorOptions().device(device).dtype(torch::kFloat);
  auto params = torch::randn({numel}, f), grads = torch::randn({numel}, f);
  auto exp_avg = torch::zeros({numel}, f), exp_avg_sq = torch::zeros({numel}, f);
  auto step = torch::ones({}, f), lr = torch::full({}, 1e-3, f);
  auto call = [&](int64_t begin, int64_t len) {
    const std::vector<at::Tensor> p{params.narrow(0, begin, len)}, g{grads.narrow(0, begin, len)},
        a{exp_avg.narrow(0, begin, len)}, b{exp_avg_sq.narrow(0, begin, len)}, st{step};
    if (device.is_cuda()) {
      at::_fused_adamw_(p, g, a, b, {}, st, lr, 0.9, 0.999, 0.01, 1e-8, false, false, std::nullopt, std::nullopt);
    } else {
      at::_fused_adamw_(p, g, a, b, {}, st, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false, std::nullopt, std::nullopt);
    }
  };
  auto run = [&](int64_t piece) {
    for (int64_t begin = 0; begin < numel; begin += piece) call(begin, std::min(piece, numel - begin));
  };
  std::vector<perf::Comparison> out;
  for (const int64_t k : {1, 2, 4}) {
    const int64_t piece = k * units * chunk;
    if (piece >= numel) break;
    out.push_back(perf::compare(
        "one call", [&] { run(numel); }, "calls of " + std::to_string(k * units) + " chunks", [&] { run(piece); },
        opts));
  }
  return out;
}

}  // namespace

static int bench_optim_main(int argc, char** argv) {
  CLI::App app{"optimizer step: torch::optim vs perf::optim on a ResNet-50 parameter set"};
  std::string device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  int iters = 20, warmup = 3;
  std::string json;
  app.add_option("--device", device_name, "cpu or cuda");
  app.add_option("--json", json, "file to append one JSON line per measured configuration to");
  app.add_option("--iters", iters, "timed steps per optimizer")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  std::ofstream json_out;  // opened first, so that a path it cannot write to fails before the measuring
  if (!json.empty()) {
    json_out.open(json, std::ios::app);
    TORCH_CHECK(json_out, "cannot open --json ", json, " to append to");
  }
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
  perf::optim::AdamW foreach(p_foreach, perf::optim::AdamWOptions(1e-3).fused(false));
  const auto adamw = perf::compare(
      "torch::optim::AdamW", [&] { ref.step(); }, "perf AdamW (fused)", [&] { fused.step(); }, opts);
  std::cout << adamw << "\n";
  const auto adamw_fe = perf::compare(
      "torch::optim::AdamW", [&] { ref.step(); }, "perf AdamW (foreach)", [&] { foreach.step(); }, opts);
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

  // Flat mode against the fused multi-tensor path, side by side.
  std::cout << std::setprecision(3) << "\nflat mode (.flat(true)) vs the fused multi-tensor path\n\n";
  auto p_flat = make_params(device);
  perf::optim::AdamW adamw_flat(p_flat, perf::optim::AdamWOptions(1e-3).flat(true));
  const auto flat_adamw = perf::compare(
      "perf AdamW (fused)", [&] { fused.step(); }, "perf AdamW (flat)", [&] { adamw_flat.step(); }, opts);
  std::cout << flat_adamw << "  [" << adamw_flat.kernels().at(0) << "]\n";
  // On a GPU, flat mode's calls alternated between two streams (an internal setting until a
  // run like this one settles its default): against the same calls on one stream, and against
  // the fused path, which the goals are judged by.
  std::vector<perf::Comparison> stream_pairs;
  if (device.is_cuda()) {
    auto p_two = make_params(device);
    perf::optim::AdamW adamw_two(p_two, perf::optim::AdamWOptions(1e-3).flat(true));
    const auto on_two_streams = [&] {
      perf::optim::detail::set_flat_cuda_streams(2);
      adamw_two.step();
      perf::optim::detail::set_flat_cuda_streams(1);
    };
    stream_pairs.push_back(perf::compare(
        "perf AdamW (flat)", [&] { adamw_flat.step(); }, "perf AdamW (flat, 2 streams)", on_two_streams, opts));
    std::cout << stream_pairs.back() << "  [" << adamw_two.kernels().at(0) << "]\n";
    stream_pairs.push_back(perf::compare(
        "perf AdamW (fused)", [&] { fused.step(); }, "perf AdamW (flat, 2 streams)", on_two_streams, opts));
    std::cout << stream_pairs.back() << "\n";
  }
  auto p_flat_adam = make_params(device);
  perf::optim::Adam adam_flat(p_flat_adam, perf::optim::AdamOptions(1e-3).flat(true));
  const auto flat_adam = perf::compare(
      "perf Adam (fused)", [&] { adam_fused.step(); }, "perf Adam (flat)", [&] { adam_flat.step(); }, opts);
  std::cout << flat_adam << "\n";
  auto p_flat_sgd = make_params(device);
  perf::optim::SGD sgd_flat(p_flat_sgd, perf::optim::SGDOptions(0.1).momentum(0.9).flat(true));
  const auto flat_sgd = perf::compare(
      "perf SGD (fused)", [&] { sgd_fused.step(); }, "perf SGD (flat)", [&] { sgd_flat.step(); }, opts);
  std::cout << flat_sgd << "\n";

  const auto tshapes = transformer_shapes();
  auto t_fused = make_params(device, tshapes), t_flat = make_params(device, tshapes);
  int64_t t_numel = 0, t_vectors = 0;
  for (auto& p : t_fused) {
    t_numel += p.numel();
    t_vectors += p.dim() == 1;
  }
  perf::optim::AdamW t_opt(t_fused, perf::optim::AdamWOptions(1e-3));
  perf::optim::AdamW t_opt_flat(t_flat, perf::optim::AdamWOptions(1e-3).flat(true));
  std::cout << "transformer parameter set: " << t_fused.size() << " tensors (" << t_vectors << " vectors), " << t_numel
            << " parameters\n";
  const auto flat_t = perf::compare(
      "perf AdamW (fused)", [&] { t_opt.step(); }, "perf AdamW (flat)", [&] { t_opt_flat.step(); }, opts);
  std::cout << flat_t << "\n";

  // EMA of the weights after each step (perf::optim::AveragedModel with Python's get_ema_multi_avg_fn(0.999)):
  // the multi-tensor lerp over tensors each in its own storage, against one lerp over the flat buffer that a
  // flat(true) optimizer keeps the parameters in. Reads averaged and current, writes averaged: 3 x 4 bytes.
  std::cout << "\nEMA update (perf::optim::AveragedModel, decay 0.999): model in flat(true) buffers vs not\n\n";
  auto ema_compare = [&](const std::vector<std::vector<int64_t>>& shapes) {
    auto plain = make_params(device, shapes), flat = make_params(device, shapes);
    perf::optim::SGD packer(flat, perf::optim::SGDOptions(0.0).flat(true));
    packer.step();  // the parameters become views into one buffer (lr 0: their values stay)
    auto plain_model = std::make_shared<ParamsImpl>(plain), flat_model = std::make_shared<ParamsImpl>(flat);
    const auto ema_options = perf::optim::AveragedModelOptions().multi_avg_fn(perf::optim::get_ema_multi_avg_fn(0.999));
    perf::optim::AveragedModel ema_plain(plain_model, std::make_shared<ParamsImpl>(make_params(device, shapes)),
                                         ema_options);
    perf::optim::AveragedModel ema_flat(flat_model, std::make_shared<ParamsImpl>(make_params(device, shapes)),
                                        ema_options);
    for (int k = 0; k < 2; ++k) {  // the first copies; the second moves the flat copy into the model's layout
      ema_plain->update_parameters(plain_model);
      ema_flat->update_parameters(flat_model);
    }
    TORCH_CHECK(ema_flat->packed_spans() == 1 && ema_plain->packed_spans() == 0,
                "bench_optim: the EMA of the flat model is not one span");
    return perf::compare(
        "perf EMA (multi-tensor)", [&] { ema_plain->update_parameters(plain_model); }, "perf EMA (flat)",
        [&] { ema_flat->update_parameters(flat_model); }, opts);
  };
  const auto ema_resnet = ema_compare(resnet50_shapes());
  std::cout << "ResNet-50:\n" << ema_resnet << "\n";
  const auto ema_t = ema_compare(tshapes);
  std::cout << "transformer:\n" << ema_t << "\n";

  // Muon over the transformer's 48 weight matrices: Python's loop (one matrix at a time, the same operations
  // as torch.optim.Muon's) against the batched step. Its bfloat16 products are compute, not memory traffic:
  // no bandwidth share (bytes 0). On a CPU at width 64 (at 256 this project's AVX2 CPU takes about 25-50 s a
  // step), at most 5 timed steps.
  const int64_t muon_width = device.is_cuda() ? 256 : 64;
  auto muon_loop_params = make_params(device, transformer_matrices(muon_width)),
       muon_batched_params = make_params(device, transformer_matrices(muon_width));
  int64_t muon_numel = 0;
  for (const auto& p : muon_loop_params) muon_numel += p.numel();
  perf::optim::Muon muon_loop(muon_loop_params, perf::optim::MuonOptions(0.02).foreach(false));
  perf::optim::Muon muon_batched(muon_batched_params, perf::optim::MuonOptions(0.02));
  const std::string muon_set = "transformer Muon (width " + std::to_string(muon_width) + ")";
  std::cout << "\nMuon over the " << muon_set << "'s 48 weight matrices, " << muon_numel << " parameters\n\n";
  const auto muon = perf::compare(
      "perf Muon (single-tensor)", [&] { muon_loop.step(); }, "perf Muon (foreach)", [&] { muon_batched.step(); },
      device.is_cuda() ? opts : perf::BenchOptions(opts).warmup(1).iters(std::min(iters, 5)));
  std::cout << muon << "  [" << muon_batched.kernels().at(0) << "]\n";

  struct Row {
    const perf::Comparison* cmp;
    const char* set;
    int64_t tensors;
    int64_t n;
    const char* optimizer;
    double words;
  };
  const auto tensors = static_cast<int64_t>(p_ref.size()), t_tensors = static_cast<int64_t>(t_fused.size());
  std::vector<Row> rows = {{&adamw, "ResNet-50", tensors, numel, "AdamW", 7.0},
                           {&adamw_fe, "ResNet-50", tensors, numel, "AdamW", 7.0},
                           {&adam, "ResNet-50", tensors, numel, "Adam", 7.0},
                           {&sgd, "ResNet-50", tensors, numel, "SGD", 5.0},
                           {&flat_adamw, "ResNet-50", tensors, numel, "AdamW", 7.0},
                           {&flat_adam, "ResNet-50", tensors, numel, "Adam", 7.0},
                           {&flat_sgd, "ResNet-50", tensors, numel, "SGD", 5.0},
                           {&flat_t, "transformer", t_tensors, t_numel, "AdamW", 7.0},
                           {&ema_resnet, "ResNet-50 EMA", tensors, numel, "EMA", 3.0},
                           {&ema_t, "transformer EMA", t_tensors, t_numel, "EMA", 3.0},
                           {&muon, muon_set.c_str(), 48, muon_numel, "Muon", 0.0}};
  for (const auto& c : stream_pairs) rows.push_back({&c, "ResNet-50", tensors, numel, "AdamW", 7.0});
  auto achieved = [&](const char* set, const perf::Stats& s, double words, int64_t n) {
    const double gbs = words * 4.0 * static_cast<double>(n) / (s.median_ms * 1e6);
    std::cout << std::setprecision(1) << set << ", " << s.name << " achieved: " << gbs
              << " GB/s = " << std::setprecision(0) << 100.0 * gbs / copy_gbs << "% of copy bandwidth\n";
  };
  for (const auto& r : rows) {
    if (r.cmp == &adamw_fe || r.words <= 0.0) continue;  // the foreach path's traffic, Muon's compute: not the question
    for (const perf::Stats* b : {&r.cmp->a, &r.cmp->b})
      if (b->name.rfind("perf", 0) == 0) achieved(r.set, *b, r.words, r.n);
  }

  int64_t units = 0;
  const auto probe = launch_probe(device, numel, opts, units);
  const char* unit = device.is_cuda() ? "SM" : "thread";
  std::cout << "\nlaunch geometry: AdamW over one flat buffer of " << numel << " parameters, one call against calls of "
            << "k x " << units << " chunks of 65536 (k per " << unit << ")\n\n";
  for (const auto& c : probe) std::cout << std::setprecision(3) << c << "\n";
  if (!probe.empty()) achieved("ResNet-50", probe.front().a, 7.0, numel);
  for (const auto& c : probe) achieved("ResNet-50", c.b, 7.0, numel);

  if (json_out.is_open()) {
    for (const auto& c : probe) rows.push_back({&c, "ResNet-50 in one flat buffer", 1, numel, "AdamW", 7.0});
    json_out << std::setprecision(6);
    for (size_t k = 0; k < rows.size(); ++k) {
      const auto& r = rows[k];
      for (const auto& [side, stats] : {std::pair<const char*, const perf::Stats*>{"a", &r.cmp->a}, {"b", &r.cmp->b}})
        json_out << "{\"lang\": \"cpp\", \"device\": \"" << device.type() << "\", \"set\": \"" << r.set
                 << "\", \"tensors\": " << r.tensors << ", \"params\": " << r.n << ", \"optimizer\": \"" << r.optimizer
                 << "\", \"config\": \"" << stats->name << "\", \"median_ms\": " << stats->median_ms
                 << ", \"bytes\": " << static_cast<int64_t>(r.words * 4.0) * r.n << ", \"copy_gbs\": " << copy_gbs
                 << ", \"compare\": " << k << ", \"side\": \"" << side << "\"}\n";
    }
  }
  return 0;
}

int main(int argc, char** argv) { return perf_bench::run_program("bench_optim", bench_optim_main, argc, argv); }
