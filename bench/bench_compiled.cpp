// Inference latency: LibTorch eager (fp32; perf's fixed recipe; perf::optimize
// measuring the recipes on the batch) vs the AOTInductor packages of the same
// ResNet-style CNN (bench/resnet.h, bench/resnet.py), side by side, batch 1 and
// 32, each package also in LibTorch's multi-threaded container. On CUDA also perf::graph of
// the eager recipe and of the package (perf's default single-threaded runner, the
// mode CUDA graphs can capture), and perf::optimize decided
// with cuDNN's benchmark mode off (what autotuning costs the decision). --json appends one line
// per configuration for bench/report_compiled.py, next to bench/peer_compiled.py's
// Python rows (a decision's recipe and times on perf::optimize's rows). scripts/bench-compiled.sh exports the packages
// and runs all of it. A package exported for one batch size (no --dynamic-batch) is timed at that batch only: the like
// of torch.compile, which specialises on the first shape. After each batch's timing, --profile-calls calls of
// perf::optimize's rows and the eager recipe's graphs run under LibTorch's profiler (profile_rows, below).
#include <ATen/record_function.h>
#include <perf/bench.h>
#include <perf/compiled.h>
#include <perf/cuda_graph.h>
#include <perf/model.h>
#include <perf/profile.h>
#include <perf/setup.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>

#include "program.h"
#include "resnet.h"

// The device's operations per call of each perf::optimize row and each graph of the eager recipe, from LibTorch's
// profiler: on an H200 at batch 1 the default decision's graph ran 8% faster than the same recipe pinned on a fresh
// model or decided on cuDNN's heuristics (0.286 against 0.310-0.313 ms), every row's spread under 0.5%. Kernels a
// graph replays are traced too (CUPTI), so a differing kernel, count or copy shows here; at ac79462 none did, the
// same 134 at the same 290 us. So each profiled call runs as perf::compare times it (after a sync, the device
// idle) inside a range "call: <row> at batch <n>", and the trace goes to `traces` (a folder; none: a temporary file)
// for bench/e2e/trace_table.py --calls, which splits each call's time into the host's start, the device's span and
// the idle gaps in it. A profiler that fails says so and costs the run nothing else.
static void profile_rows(const std::vector<std::pair<std::string, std::function<void()>>>& configs,
                         const c10::Device& device, int64_t batch, int calls, const std::string& traces) {
  const std::string on = device.is_cuda() ? "cuda" : "cpu";
  const auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  for (size_t row = 0; row < configs.size(); ++row) {
    const auto& [name, call] = configs[row];
    if (name.rfind("perf::optimize", 0) != 0 && name.rfind("perf::graph(eager recipe)", 0) != 0) continue;
    const auto trace = traces.empty()
                           ? (std::filesystem::temp_directory_path() / "bench_compiled_profile.json").string()
                           : (std::filesystem::path(traces) /
                              ("profile-b" + std::to_string(batch) + "-" + std::to_string(row) + ".json"))
                                 .string();
    const std::string range = "call: " + name + " at batch " + std::to_string(batch);
    try {
      call();
      sync();
      perf::Profile profile(trace, perf::ProfileOptions().top(0).out(nullptr).cuda(device.is_cuda()));
      for (int i = 0; i < calls; ++i) {
        {
          RECORD_USER_SCOPE(range.c_str());
          call();
        }
        sync();  // the next call starts on an idle device, and every kernel is done before the trace ends
      }
      std::vector<perf::OpStat> ops;
      for (const auto& o : profile.stop().ops)
        if (o.device == on) ops.push_back(o);
      std::sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.self_us > b.self_us; });
      int64_t n = 0;
      double us = 0;
      for (const auto& o : ops) {
        n += o.calls;
        us += o.self_us;
      }
      std::cout << "profile of " << name << " at batch " << batch << ": " << std::fixed << std::setprecision(1)
                << static_cast<double>(n) / calls << " " << on << " operations a call, " << us / calls
                << " us of their time a call (" << calls << " calls)\n";
      for (const auto& o : ops) {
        std::cout << "    " << std::setw(9) << std::setprecision(2) << o.self_us / calls << " us " << std::setw(6)
                  << std::setprecision(1) << static_cast<double>(o.calls) / calls << "x  " << o.name.substr(0, 110)
                  << "\n";
      }
    } catch (const std::exception& e) {
      const std::string what = e.what();
      std::cout << "profile of " << name << " at batch " << batch << ": none (" << what.substr(0, what.find('\n'))
                << ")\n";
    }
  }
}

// Where the batch-1 gap between rows that replay the same kernels comes from (docs/benchmarks.md): on the H200 the
// decision's graph and the eager recipe's NCHW-input graph ran at 0.287 ms, the pinned recipe, the heuristic
// decision and the NHWC-input graph at 0.310 ms, in four runs; LibTorch's profiler, with the device idle before
// each call, found the same kernels, grids and blocks and the same 290 us of device time in both, and calls 4-6 us
// apart, not 24. perf::compare times a call right behind an untimed call of its own, so a fast row's median is its
// device time alone. Two things it could be, each checked on the same rows, after the table:
// - the call: "launch check" times each call on the host, on an idle device and right behind its own previous
//   call; a call that returns only when the previous replay is done (a wait on the host) shows the device's time
//   there, and the launch it then exposes is the gap;
// - the place in the round-robin: on the H200 the fast rows were each the first graph after a row that is not one
//   (the eager recipe; LibTorch's multi-threaded container), the slow ones right behind another graph (on the H100
//   at dba86b3 the eager recipe's graph, behind a single-threaded package, was slow too). "order check" times the
//   rows again in the reverse order, and each behind eager fp32: if the fast set moves with the place, the gap is
//   the device's state between rows (its clocks, say), not the row's code.
static void order_check(const std::vector<std::pair<std::string, std::function<void()>>>& configs,
                        const std::vector<perf::Stats>& stats, const perf::BenchOptions& opts, int64_t batch) {
  using Config = std::pair<std::string, std::function<void()>>;
  std::vector<size_t> rows;
  for (size_t row = 0; row < configs.size(); ++row) {
    const auto& name = configs[row].first;
    if (name.rfind("perf::optimize", 0) == 0 || name.rfind("perf::graph(eager recipe)", 0) == 0) rows.push_back(row);
  }
  if (rows.size() < 2 || configs.empty()) return;
  const auto at = " at batch " + std::to_string(batch);
  try {
    const auto median_us = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    for (const size_t row : rows) {
      const auto& call = configs[row].second;
      std::vector<double> idle_us, behind_us;
      for (int i = 0; i < 21; ++i) {
        torch::cuda::synchronize();
        auto t0 = std::chrono::steady_clock::now();
        call();
        idle_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        torch::cuda::synchronize();
        call();
        t0 = std::chrono::steady_clock::now();
        call();
        behind_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      torch::cuda::synchronize();
      std::cout << "launch check of " << configs[row].first << at << ": the call returns after " << std::fixed
                << std::setprecision(1) << median_us(idle_us) << " us on the host with the device idle, "
                << median_us(behind_us) << " us right behind its own previous call (median of 21; its table median "
                << std::setprecision(1) << stats[row].median_ms * 1000 << " us)\n";
    }
    std::vector<Config> reversed, behind_eager;
    for (auto it = rows.rbegin(); it != rows.rend(); ++it) reversed.push_back(configs[*it]);
    for (const size_t row : rows) {
      behind_eager.push_back(configs[0]);
      behind_eager.push_back(configs[row]);
    }
    const auto in_reverse = perf::compare(reversed, opts);
    const auto after_eager = perf::compare(behind_eager, opts);
    for (size_t k = 0; k < rows.size(); ++k) {
      std::cout << "order check of " << configs[rows[k]].first << at << ": " << std::fixed << std::setprecision(3)
                << stats[rows[k]].median_ms << " ms in the table, " << in_reverse[rows.size() - 1 - k].median_ms
                << " ms timed in the reverse order, " << after_eager[2 * k + 1].median_ms << " ms each behind "
                << configs[0].first << "\n";
    }
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::cout << "order check" << at << ": none (" << what.substr(0, what.find('\n')) << ")\n";
  }
}

static int bench_compiled_main(int argc, char** argv) {
  CLI::App app("eager vs AOTInductor package, inference");
  std::vector<std::string> packages;
  std::string device_name = "cpu";
  int64_t width = 32, image = 64;
  std::vector<int64_t> batches = {1, 32};
  int iters = 30;
  std::string json;
  bool package_graphs = true;
  int profile_calls = 10;
  std::string profile_traces;
  app.add_option("--package", packages, "packages of bench/resnet.py (scripts/bench-compiled.sh writes them)")
      ->required();
  app.add_option("--device", device_name, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--width", width, "ResNet width (as exported)");
  app.add_option("--image", image, "image side (as exported)");
  app.add_option("--batches", batches, "batch sizes");
  app.add_option("--iters", iters, "timed calls per configuration");
  app.add_option("--json", json, "file to append one JSON line per configuration to");
  app.add_flag("!--no-package-graphs", package_graphs,
               "on CUDA, leave out perf::graph of the packages (gpu-check reruns with it when a run with them "
               "fails or crashes)");
  app.add_option("--profile-calls", profile_calls,
                 "after each batch's timing, calls of every perf::optimize row (and on CUDA every graph of the eager "
                 "recipe) under LibTorch's profiler: the device's operations a call, with their time, which tell "
                 "apart rows that run the same recipe at different speeds; 0: none")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--profile-traces", profile_traces,
                 "folder to keep those calls' traces in (profile-b<batch>-<row>.json), for bench/e2e/trace_table.py "
                 "--calls; default: none kept");
  CLI11_PARSE(app, argc, argv);
  if (!profile_traces.empty()) std::filesystem::create_directories(profile_traces);
  std::ofstream json_out;  // opened first, so that a path it cannot write to fails before the packages load
  if (!json.empty()) {
    json_out.open(json, std::ios::app);
    TORCH_CHECK(json_out, "cannot open --json ", json, " to append to");
  }

  perf::setup();
  const c10::Device device(device_name);
  // Each package as perf opens it by default (one runner: LibTorch's single-threaded entry point, the mode CUDA
  // graphs capture), and in LibTorch's multi-threaded container too, for its own rows: on CUDA, once its one runner
  // has been used, a call there waits on the host for the previous call's kernels (on the CPU the two should be
  // level). Copies share the loaded package.
  std::vector<perf::CompiledModel> compiled, multi;
  compiled.reserve(packages.size());
  for (const auto& p : packages) {
    compiled.emplace_back(p);
    std::cout << compiled.back();
    multi.emplace_back(p, perf::CompiledOptions().single_threaded(false));
  }
  auto label_of = [](const perf::CompiledModel& c) {
    const auto& in = c.inputs().at(0);
    return std::string("package ") + (in.dtype == torch::kFloat ? "fp32" : c10::toString(in.dtype)) +
           (in.format == at::MemoryFormat::ChannelsLast ? " NHWC" : "") +
           (c.metadata().count("perf.max_autotune") && c.metadata().at("perf.max_autotune") == "1" ? " max-autotune"
                                                                                                   : "") +
           (!in.sizes.empty() && in.sizes[0] >= 0 ? " (batch " + std::to_string(in.sizes[0]) + ")" : "");
  };
  // A package exported for one batch size (as torch.compile specialises on the first shape it sees)
  // runs only there; a dynamic one over its range.
  auto accepts = [](const perf::CompiledModel& c, int64_t batch) {
    const auto& in = c.inputs().at(0);
    if (in.sizes.empty()) return true;
    if (in.sizes[0] >= 0) return in.sizes[0] == batch;
    return batch >= in.min_batch && (in.max_batch == 0 || batch <= in.max_batch);
  };
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
    // perf::optimize with this batch as the example: measures the recipes and keeps the fastest.
    auto tuned = perf::optimize(perf_bench::ResNet(width), perf::ModelOptions().device(device).example(x));
    std::cout << tuned.choice();
    configs.emplace_back("perf::optimize(example)", [&] { tuned.infer(x); });
    std::map<std::string, const perf::RecipeChoice*> decisions = {{configs.back().first, &tuned.choice()}};
    // On CUDA the same decision again with the candidates measured on cuDNN's heuristic algorithms
    // (ModelOptions().autotune_candidates(false)), the winner autotuned as it is captured: how much of the
    // decision's time is cuDNN autotuning every candidate's convolutions, whether the same recipe wins, and what
    // it then runs at. Made after the first, so it does not pay the process's CUDA start-up, which the first
    // decision at the first batch does. (On an H100 at dba86b3, deciding under cuDNN benchmark mode off
    // altogether took 1.30 s / 1.33 s at batch 1 / 32, and its graph, which kept the heuristic kernels, ran 8%
    // slower at batch 1.)
    std::unique_ptr<decltype(tuned)> heuristic;
    if (device.is_cuda()) {
      heuristic.reset(new auto(perf::optimize(
          perf_bench::ResNet(width), perf::ModelOptions().device(device).example(x).autotune_candidates(false))));
      std::cout << "with autotune_candidates(false):\n" << heuristic->choice();
      configs.emplace_back("perf::optimize(example, autotune_candidates(false))",
                           [&heuristic, &x] { heuristic->infer(x); });
      decisions[configs.back().first] = &heuristic->choice();
    }
    // The decision's winner pinned on a fresh model (ModelOptions().recipe): captured as the decision captures it,
    // with no decision before. Beside the graph of the eager recipe below (and its NHWC-input twin), it splits a
    // gap between perf::optimize and a graph of the same recipe into what the decision leaves behind and what
    // the capture does differently.
    std::unique_ptr<decltype(tuned)> pinned;
    if (device.is_cuda()) {
      pinned.reset(new auto(perf::optimize(perf_bench::ResNet(width),
                                           perf::ModelOptions().device(device).example(x).recipe(tuned.recipe()))));
      configs.emplace_back("perf::optimize(recipe pinned: " + tuned.recipe().name() + ")",
                           [&pinned, &x] { pinned->infer(x); });
    }
    for (const auto& [models, suffix] : {std::pair(&compiled, ""), std::pair(&multi, ", multi-threaded")}) {
      for (const auto& c : *models) {
        if (!accepts(c, batch)) continue;
        configs.emplace_back(label_of(c) + suffix, [m = c, &x, dtype = c.inputs().at(0).dtype]() mutable {
          c10::InferenceMode guard;
          m(x.to(dtype));  // a no-op for fp32; the bf16 package's cast is part of its cost
        });
      }
    }
    using Fn = std::function<torch::Tensor(const torch::Tensor&)>;
    std::vector<decltype(perf::graph(Fn(), x))> graphs;
    if (device.is_cuda()) {
      graphs.reserve(2 + 2 * compiled.size());
      std::vector<std::string> names = {"perf::graph(eager recipe)", "perf::graph(eager recipe), NHWC static input"};
      graphs.push_back(perf::graph(Fn([&](const torch::Tensor& in) { return recipe.infer(in); }), x));
      // Captured from a channels-last example, as perf::optimize captures its graph: each call's NCHW input is
      // converted by the copy into the static input, outside the graph, rather than inside it.
      graphs.push_back(
          perf::graph(Fn([&](const torch::Tensor& in) { return recipe.infer(in); }), perf::channels_last(x)));
      // Each package's kernels replayed as one graph: as a user gets it (each call returns its own copy of the
      // output), and handing back the graph's own output tensor, which the next replay overwrites, as
      // torch.compile's reduce-overhead does (GraphOptions().clone_outputs(false)).
      for (const auto& st : compiled) {
        if (!package_graphs) break;
        if (!accepts(st, batch)) continue;
        const auto dtype = st.inputs().at(0).dtype;
        for (const bool clone : {true, false}) {
          graphs.push_back(perf::graph(Fn([m = st, dtype](const torch::Tensor& in) mutable { return m(in.to(dtype)); }),
                                       x, perf::GraphOptions().eager_fallback(true).clone_outputs(clone)));
          names.push_back("perf::graph(" + label_of(st) + ")" + (clone ? "" : ", outputs not cloned") +
                          (graphs.back().graphed() ? "" : " (fell back: eager)"));
        }
      }
      for (size_t g = 0; g < graphs.size(); ++g) configs.emplace_back(names[g], [&graphs, g, &x] { graphs[g](x); });
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
      if (json_out) {
        json_out << "{\"lang\": \"cpp\", \"config\": \"C++ " << s.name << "\", \"device\": \"" << device.type()
                 << "\", \"batch\": " << batch << ", \"median_ms\": " << s.median_ms;
        if (const auto d = decisions.find(s.name); d != decisions.end()) {
          const auto& c = *d->second;
          json_out << ", \"recipe\": \"" << c.recipe.name() << "\", \"decision_s\": " << c.seconds
                   << ", \"first_calls_s\": " << c.first_call_seconds << ", \"captures_s\": " << c.capture_seconds;
        }
        json_out << "}\n";
      }
      auto line = s.to_string();
      while (!line.empty() && line.back() == '\n') line.pop_back();
      std::cout << line << std::fixed << std::setprecision(2) << std::setw(10) << stats[0].median_ms / s.median_ms
                << "x\n";
    }
    if (device.is_cuda()) order_check(configs, stats, opts, batch);
    if (profile_calls > 0) profile_rows(configs, device, batch, profile_calls, profile_traces);
  }
  return 0;
}

int main(int argc, char** argv) { return perf_bench::run_program("bench_compiled", bench_compiled_main, argc, argv); }
