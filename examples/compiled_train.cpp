// Compiled training: the forward, loss and backward of one step compiled ahead
// of time by Inductor (from the model's Python twin, examples/compiled_train.py),
// run from C++ with perf's fused AdamW; on CUDA the whole step is one CUDA graph.
//
//   python tools/export_compiled.py examples/compiled_train.py:make --train
//          --loss examples/compiled_train.py:loss --input 64,64 --input 64:int64 -o net_train.pt2
//   ./compiled_train net_train.pt2
//
// For the GPU, export with --device cuda and run with --device cuda (the
// recipe, e.g. --amp bf16, goes into the package: README, "Compiled
// training"). The batch size is the package's (it was exported for a
// static batch: the loader drops the last, smaller batch). At the end the model,
// trained by the package, answers held-out samples in plain C++ (eval mode);
// the program fails if it did not learn.
#include <perf/perf.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <iomanip>
#include <iostream>

namespace {

constexpr int64_t kFeatures = 64, kClasses = 10;

// The C++ twin of examples/compiled_train.py's Net: the same parameter names
// and shapes (the package checks them), the same forward (used for inference).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t hidden = 256, double dropout = 0.1)
      : fc1(register_module("fc1", torch::nn::Linear(kFeatures, hidden))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, kClasses))),
        p(dropout) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::dropout(torch::gelu(norm(fc1(x))), p, is_training()));
  }
  torch::nn::Linear fc1;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc2;
  double p;
};
TORCH_MODULE(Net);

// Synthetic classification with a rule to learn: the class of a Gaussian
// feature vector is the largest of 10 fixed random projections of it.
struct Teacher : torch::data::datasets::Dataset<Teacher> {
  Teacher(size_t n, size_t first = 0)
      : n_(n), first_(first), w_(torch::randn({kClasses, kFeatures}, at::make_generator<at::CPUGeneratorImpl>(1234))) {}
  torch::data::Example<> get(size_t i) override {
    auto x = torch::randn({kFeatures}, at::make_generator<at::CPUGeneratorImpl>(first_ + i));
    return {x, w_.matmul(x).argmax()};
  }
  std::optional<size_t> size() const override { return n_; }
  size_t n_, first_;
  torch::Tensor w_;
};

double accuracy(Net& model, const torch::Device device) {
  Teacher held_out(2048, /*first=*/1u << 30);  // samples no epoch draws
  std::vector<torch::Tensor> xs, ys;
  for (size_t i = 0; i < *held_out.size(); ++i) {
    auto e = held_out.get(i);
    xs.push_back(e.data);
    ys.push_back(e.target);
  }
  torch::NoGradGuard no_grad;
  model->eval();
  const auto predicted = model(torch::stack(xs).to(device)).argmax(1).cpu();
  model->train();
  return predicted.eq(torch::stack(ys)).to(torch::kDouble).mean().item<double>();
}

int train(const std::string& package, const torch::Device device, int epochs, int samples) {
  torch::manual_seed(0);  // the initial weights and the dropout masks
  Net model;
  model->to(device);
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(2e-3).weight_decay(0.01));
  // Checks the model against the package: names, shapes, dtypes, layouts, device.
  perf::CompiledTrainStep step(package, model, opt);
  const int64_t batch = step.inputs().at(0).sizes.at(0);  // -1: exported with --dynamic-batch
  const auto batch_size = static_cast<size_t>(batch > 0 ? batch : 64);
  const double before = accuracy(model, device);

  for (int epoch = 0; epoch < epochs; ++epoch) {
    auto loader = torch::data::make_data_loader(
        Teacher(static_cast<size_t>(samples)).map(torch::data::transforms::Stack<>()),
        perf::loader_options(batch_size, perf::LoaderTuning().drop_last(true)));  // a static batch, every step
    perf::Progress bar(samples, perf::ProgressOptions().unit("sample").description("epoch " + std::to_string(epoch)));
    auto total = torch::zeros({}, device);
    int64_t steps = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& b : perf::prefetch(*loader, device)) {
      torch::Tensor loss = step.step(b);  // the caller's: no sync until it is read
      total += loss;
      ++steps;
      bar.update(b.data.size(0), {{"loss", loss}});
    }
    const double mean = total.item<double>() / static_cast<double>(steps);  // waits for the epoch's last step
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    bar.close();
    std::cout << "epoch " << epoch << ": mean loss " << std::fixed << std::setprecision(4) << mean << ", "
              << std::setprecision(0) << static_cast<double>(steps) * static_cast<double>(batch_size) / seconds
              << " samples/s\n";
  }
  std::cout << step << "\n";

  const double after = accuracy(model, device);
  std::cout << std::setprecision(1) << "held-out accuracy: " << 100 * before << "% before training, " << 100 * after
            << "% after\n";
  if (after < 0.8) {
    std::cerr << "compiled_train: the model did not learn (held-out accuracy " << 100 * after
              << "%, expected >= 80%)\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"perf::CompiledTrainStep example: train with a step exported by tools/export_compiled.py --train"};
  std::string package, device_name = "cpu";
  int epochs = 3, samples = 16384;
  app.add_option("package", package, "the training package (tools/export_compiled.py --train)")->required();
  app.add_option("--device", device_name, "where to train: the device the package was exported for")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber);
  app.add_option("--samples", samples, "training samples per epoch")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (device_name == "cuda" && !torch::cuda::is_available()) {
    std::cerr << "compiled_train: --device cuda, but this process sees no CUDA device\n";
    return 2;
  }
  perf::setup();  // TF32, cuDNN autotuning, threads, allocator: what the step runs under
  try {
    return train(package, torch::Device(device_name), epochs, samples);
  } catch (const c10::Error& e) {  // e.g. a package exported for another model or device: perf says which
    std::cerr << "compiled_train: " << e.what_without_backtrace() << "\n";
    return 1;
  }
}
