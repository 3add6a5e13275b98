// One end-to-end training run in C++ (one job, one configuration), appending one
// JSON line to --out; bench/e2e/train.py is the Python side, run.py drives both.
//
// Configurations:
//   stock           LibTorch as shipped: fp32, NCHW, torch::optim::AdamW, a plain
//                   DataLoader (no workers), default backend flags.
//   perf            perf::setup(), perf::optimize (channels-last + perf's autocast
//                   default for the device), perf::optim::AdamW (fused),
//                   perf::loader_options + perf::prefetch.
//   perf_trainstep  perf + perf::TrainStep (the whole step as one CUDA graph; CUDA only).
//   perf_compiled   perf's data and fused AdamW around perf::CompiledTrainStep: forward,
//                   loss and backward compiled by Inductor ahead of time (--package,
//                   written by run.py with tools/export_compiled.py --train), each step eager.
//   perf_compiled_graph  the same, the whole step captured as one CUDA graph (CUDA only).
//                   The model's layout follows the package's: channels-last where it
//                   was exported with --channels-last, else contiguous (run.py
//                   --compiled-layout contiguous: Inductor picks the layouts inside).
#include <perf/compiled.h>
#include <perf/cuda_graph.h>
#include <perf/data.h>
#include <perf/model.h>
#include <perf/optim.h>
#include <perf/profile.h>
#include <perf/setup.h>
#include <perf/state_dict.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include "models.h"

namespace {

// Files Python's torch.save wrote (run.py): the batches, and the initial weights, which must name every
// parameter and buffer of the C++ model (perf::load_state_dict, strict).
c10::impl::GenericDict load_dict(const std::string& path) { return perf::load(path).toGenericDict(); }

struct PairDataset : torch::data::datasets::Dataset<PairDataset> {
  PairDataset(at::Tensor inputs, at::Tensor targets) : x(std::move(inputs)), y(std::move(targets)) {}
  torch::data::Example<> get(size_t i) override {
    const auto k = static_cast<int64_t>(i);
    return {x[k], y[k]};
  }
  std::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
  at::Tensor x, y;
};

struct Args {
  std::string job, config, device = "cpu", data, init, out, package;
  double export_s = 0;
  std::map<std::string, int64_t> size;
  int warmup = 3, steps = 20, window = 5, threads = 0;
  int profile_steps = 0;  // more steps after the timed ones, traced by LibTorch's profiler into `profile`
  std::string profile;
  bool cpu_malloc_cache = true;  // perf configurations: perf::Settings::cpu_malloc_cache (run.py --malloc-ab)
  bool cudnn_benchmark = true;   // perf configurations: perf::Settings::cudnn_benchmark (run.py --cpp-cudnn-benchmark)
  bool check_syncs = true;  // CUDA-graph configurations: the last warm-up call's sync checks (run.py --cpp-check-syncs)
};

struct Result {
  std::vector<double> windows, losses;
  double first_step_s = 0;
  std::string amp = "off";
  std::string package_layout;   // perf_compiled*: the package's parameter layout
  std::string package_options;  // perf_compiled*: max-autotune and the Inductor options it was exported with
};

// `text` as a JSON string's contents.
std::string json_escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.to(at::kFloat).reshape({-1, out.size(-1)}), y.reshape({-1}));
}

std::string json_list(const std::vector<double>& v) {
  std::ostringstream s;
  s << std::setprecision(9) << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  return s.str() + "]";
}

// Appends the run's JSON line to --out (run.py reads it) and prints its summary.
void write_result(const Args& a, const Result& r) {
  std::ofstream out(a.out, std::ios::app);
  out << "{\"lang\": \"cpp\", \"job\": \"" << a.job << "\", \"config\": \"" << a.config << "\", \"device\": \""
      << a.device << "\", \"samples_per_s\": " << (r.windows.empty() ? 0.0 : r.windows[r.windows.size() / 2])
      << ", \"windows_samples_per_s\": " << json_list(r.windows) << ", \"losses\": " << json_list(r.losses)
      << ", \"first_step_s\": " << r.first_step_s << ", \"batch\": " << a.size.at("batch")
      << ", \"warmup\": " << a.warmup << ", \"steps\": " << a.steps << ", \"threads\": " << at::get_num_threads()
      << ", \"amp\": \"" << r.amp << "\", \"export_s\": " << a.export_s;
  if (!r.package_layout.empty()) out << ", \"package_layout\": \"" << r.package_layout << "\"";
  if (!r.package_options.empty()) out << ", \"package_options\": \"" << json_escaped(r.package_options) << "\"";
  out << "}\n";
  std::cout << "cpp " << a.job << " " << a.config << ": " << (r.windows.empty() ? 0.0 : r.windows[r.windows.size() / 2])
            << " samples/s, final loss " << r.losses.back() << ", first step " << r.first_step_s << " s" << std::endl;
}

// The training loop shared by every configuration: `step(x, y)` returns the loss.
// `r` describes the run (amp, package); its result is written (write_result)
// as soon as the timed steps end. After them, --profile-steps more run under LibTorch's (Kineto)
// profiler, in one "e2e_profiled_steps" range that ends after a sync; their
// trace goes to --profile (bench/e2e/trace_table.py reads it). They are not
// timed and their losses are not kept; a profiler that fails says so on
// stderr ("no profile") and costs the run nothing else.
template <typename Loader, typename Step>
void train(Loader&& batches_of_epoch, Step&& step, const Args& a, const c10::Device& device, Result r) {
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  const int total = a.warmup + a.steps, all = total + a.profile_steps;
  std::vector<at::Tensor> losses;
  std::vector<std::chrono::steady_clock::time_point> marks;
  std::optional<perf::Profile> profile;
  std::optional<perf::Range> profiled;
  const auto start = std::chrono::steady_clock::now();
  int done = 0;
  while (done < all) {
    batches_of_epoch([&](const at::Tensor& x, const at::Tensor& y) {
      if (done >= all) return false;
      if (done == total) {
        sync();
        try {
          profile.emplace(a.profile, perf::ProfileOptions().top(0).out(nullptr));
          profiled.emplace("e2e_profiled_steps");
        } catch (const std::exception& e) {
          std::cerr << "e2e: no profile: " << e.what() << "\n";
        }
      }
      auto loss = step(x, y).detach();
      if (done < total) losses.push_back(loss);
      ++done;
      if (done == 1) {
        sync();
        r.first_step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      if (done <= total && done >= a.warmup && (done - a.warmup) % a.window == 0) {
        sync();
        marks.push_back(std::chrono::steady_clock::now());
      }
      if (done == total) {
        const double batch = static_cast<double>(a.size.at("batch"));
        for (size_t i = 0; i + 1 < marks.size(); ++i)
          r.windows.push_back(a.window * batch / std::chrono::duration<double>(marks[i + 1] - marks[i]).count());
        std::sort(r.windows.begin(), r.windows.end());
        for (const auto& l : losses) r.losses.push_back(l.item<double>());
        write_result(a, r);  // before the profile: a profiler that fails cannot cost the timings
      }
      if (done == all && profile) {
        sync();
        profiled.reset();
        try {
          profile->stop();
        } catch (const std::exception& e) {
          std::cerr << "e2e: no profile: " << e.what() << "\n";
        }
      }
      return done < all;
    });
  }
}

template <typename Holder>
void run(Holder model, const Args& a, const at::Tensor& x, const at::Tensor& y) {
  const c10::Device device(a.device);
  perf::load_state_dict(*model, perf::load(a.init));
  const auto batch = static_cast<size_t>(a.size.at("batch"));
  auto dataset = PairDataset(x, y).map(torch::data::transforms::Stack<>());
  if (a.config == "stock") {
    model->to(device);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        dataset, torch::data::DataLoaderOptions(batch).drop_last(true));
    auto epoch = [&](auto&& each) {
      for (auto& b : *loader)
        if (!each(b.data.to(device), b.target.to(device))) return;
    };
    train(
        epoch,
        [&](const at::Tensor& xb, const at::Tensor& yb) {
          opt.zero_grad();
          auto loss = loss_of(model->forward(xb), yb);
          loss.backward();
          opt.step();
          return loss;
        },
        a, device, Result());
    return;
  }
  perf::Settings settings;  // perf's defaults; run.py --malloc-ab turns the malloc cache off for its A/B
  if (!a.cpu_malloc_cache) settings.cpu_malloc_cache(false);
  if (!a.cudnn_benchmark) settings.cudnn_benchmark(false);  // run.py --cpp-cudnn-benchmark off: a diagnosis
  perf::setup(settings);
  // A compiled step takes the parameters in the layout its package was exported for.
  bool channels_last = true;
  if (a.config == "perf_compiled" || a.config == "perf_compiled_graph") {
    TORCH_CHECK(!a.package.empty(), "e2e: ", a.config, " needs --package (a package from export_compiled.py --train)");
    const auto meta = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(a.package, "model");
    const auto it = meta.find("perf.train.channels_last");
    channels_last = it != meta.end() && it->second == "1";
  }
  auto fast = perf::optimize(model, perf::ModelOptions().device(device).channels_last(channels_last));
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).weight_decay(0.01));
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      dataset, perf::loader_options(batch, perf::LoaderTuning().drop_last(true)));
  auto epoch = [&](auto&& each) {
    for (auto& b : perf::prefetch(*loader, device))
      if (!each(b.data, b.target)) return;
  };
  Result r;
  r.amp = perf::Autocast::default_enabled(device) ? c10::toString(perf::Autocast::default_dtype(device)) : "off";
  if (a.config == "perf") {
    train(
        epoch,
        [&](const at::Tensor& xb, const at::Tensor& yb) {
          opt.zero_grad();
          auto loss = loss_of(fast(xb), yb);
          loss.backward();
          opt.step();
          return loss;
        },
        a, device, r);
  } else if (a.config == "perf_compiled" || a.config == "perf_compiled_graph") {
    const bool graph = a.config == "perf_compiled_graph";
    TORCH_CHECK(!graph || device.is_cuda(), "e2e: perf_compiled_graph needs --device cuda (CUDA graphs)");
    // The model is on the device and in the package's layout already (perf::optimize, above).
    perf::CompiledTrainStep step(a.package, model, opt,
                                 perf::CompiledTrainOptions().graph(graph).check_syncs(a.check_syncs));
    r.amp = step.amp() == "off" ? "off" : step.amp();
    r.package_layout = step.channels_last() ? "channels_last" : "contiguous";
    const auto& meta = step.metadata();
    const auto options = meta.find("perf.inductor_configs"), autotuned = meta.find("perf.max_autotune");
    if (autotuned != meta.end() && autotuned->second == "1") r.package_options = "max-autotune";
    if (options != meta.end() && !options->second.empty())
      r.package_options += (r.package_options.empty() ? "" : " ") + options->second;
    train(
        epoch, [&](const at::Tensor& xb, const at::Tensor& yb) { return step.step(xb, yb); }, a, device, r);
  } else {
    TORCH_CHECK(a.config == "perf_trainstep",
                "e2e: --config must be stock, perf, perf_trainstep, perf_compiled or "
                "perf_compiled_graph, got ",
                a.config);
    TORCH_CHECK(device.is_cuda(), "e2e: perf_trainstep needs --device cuda (CUDA graphs)");
    std::optional<perf::TrainStep> step;
    train(
        epoch,
        [&](const at::Tensor& xb, const at::Tensor& yb) {
          if (!step) {
            step.emplace(
                model, [&](const at::Tensor& in, const at::Tensor& t) { return loss_of(fast(in), t); }, opt, xb, yb,
                perf::TrainStepOptions().check_syncs(a.check_syncs));
          }
          return step->step(xb, yb);
        },
        a, device, r);
  }
}

int run_main(int argc, char** argv) {
  CLI::App app("perf end-to-end training run (bench/e2e/run.py drives it)");
  Args a;
  bool info = false;
  std::string size_text;
  app.add_flag("--info", info, "print perf's autocast default for --device and exit");
  app.add_option("--job", a.job)->check(CLI::IsMember({"cnn", "transformer", "mlp"}));
  app.add_option("--config", a.config)
      ->check(CLI::IsMember({"stock", "perf", "perf_trainstep", "perf_compiled", "perf_compiled_graph"}));
  app.add_option("--package", a.package, "training package for perf_compiled*");
  app.add_option("--export-seconds", a.export_s, "how long the package took to export (reported)");
  app.add_option("--device", a.device);
  app.add_option("--size", size_text, "sizes as k=v,k=v (bench/e2e/models.py JOBS)");
  app.add_option("--data", a.data);
  app.add_option("--init", a.init);
  app.add_option("--warmup", a.warmup);
  app.add_option("--steps", a.steps);
  app.add_option("--window", a.window);
  app.add_option("--threads", a.threads);
  app.add_option("--cpu-malloc-cache", a.cpu_malloc_cache, "perf configurations: perf::setup()'s cpu_malloc_cache");
  app.add_option("--cudnn-benchmark", a.cudnn_benchmark, "perf configurations: perf::setup()'s cudnn_benchmark");
  app.add_option("--check-syncs", a.check_syncs, "CUDA-graph configurations: check_syncs of their step's options");
  app.add_option("--profile-steps", a.profile_steps, "steps after the timed ones traced by the profiler (--profile)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--profile", a.profile, "where --profile-steps' trace goes (Chrome trace JSON)");
  app.add_option("--out", a.out);
  CLI11_PARSE(app, argc, argv);
  TORCH_CHECK(a.profile_steps == 0 || !a.profile.empty(), "e2e: --profile-steps ", a.profile_steps,
              " needs --profile PATH (where the trace goes)");
  const c10::Device device(a.device);
  if (info) {
    std::cout << "amp=" << (perf::Autocast::default_enabled(device) ? "bf16" : "off") << "\n";
    return 0;
  }
  if (a.threads > 0) at::set_num_threads(a.threads);
  std::istringstream kv(size_text);
  std::string item;
  while (std::getline(kv, item, ',')) {
    const auto eq = item.find('=');
    TORCH_CHECK(eq != std::string::npos, "e2e: --size entries are k=v, got ", item);
    a.size[item.substr(0, eq)] = std::stoll(item.substr(eq + 1));
  }
  auto data = load_dict(a.data);
  const auto x = data.at("x").toTensor(), y = data.at("y").toTensor();
  torch::manual_seed(0);
  const auto& s = a.size;
  if (a.job == "cnn") {
    run(perf_bench::ResNet(s.at("width"), 10), a, x, y);
  } else if (a.job == "transformer") {
    run(e2e::Gpt(s.at("vocab"), s.at("d"), s.at("layers"), s.at("heads"), s.at("context")), a, x, y);
  } else {
    run(e2e::mlp(s.at("inputs"), s.at("hidden"), s.at("classes")), a, x, y);
  }
  return 0;
}

}  // namespace

// An error ends the run with its message last, where run.py's report of a failed run looks (the
// backtrace of a LibTorch error before it).
int main(int argc, char** argv) {
  try {
    return run_main(argc, argv);
  } catch (const c10::Error& e) {
    std::cerr << e.what() << "\ne2e failed: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "e2e failed: " << e.what() << std::endl;
  }
  return 1;
}
