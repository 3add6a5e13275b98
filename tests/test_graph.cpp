// Tests for perf/cuda_graph.h: eager-fallback semantics here, capture on a GPU.
#include <c10/util/ScopeExit.h>
#include <gtest/gtest.h>
#include <perf/cuda_graph.h>
#include <perf/memory.h>
#include <perf/optim.h>
#include <perf/setup.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <type_traits>
#include <vector>

#include "../bench/e2e/models.h"
#include "test_util.h"

namespace {

using test_util::has_cuda;

torch::nn::Sequential deep_mlp(int64_t width = 32) {
  torch::nn::Sequential m;
  m->push_back(torch::nn::Linear(16, width));
  for (int i = 0; i < 4; ++i) {
    m->push_back(torch::nn::ReLU());
    m->push_back(torch::nn::Linear(width, width));
  }
  m->push_back(torch::nn::Linear(width, 4));
  return m;
}

}  // namespace

// An input that requires grad (an evaluation inside a training loop, on a tensor that is not detached): its copy
// into the static input records no autograd history, which would keep the caller's graph (and its saved
// tensors) alive in the graph's buffers until the next call. Exact shapes and a padded bucket.
TEST(Graph, AnInputThatRequiresGradLeavesNoHistoryInTheGraph) {
  for (const bool bucketed : {false, true}) {
    SCOPED_TRACE(bucketed ? "bucketed" : "exact shapes");
    auto g = perf::graph([](const torch::Tensor& t) { return t * 2; }, torch::zeros({4, 3}),
                         bucketed ? perf::GraphOptions().batch_sizes({8}) : perf::GraphOptions());
    const auto w = torch::ones({4, 3}, torch::requires_grad());
    // x's grad_fn, held here (a std::shared_ptr in LibTorch 2.11 and 2.12, a c10::intrusive_ptr since 2.13): once x
    // is gone, no one else may hold it.
    std::decay_t<decltype(torch::Tensor().grad_fn())> history;
    {
      const auto x = w * 3;
      history = x.grad_fn();
      ASSERT_TRUE(history);
      const auto y = g(x);
      EXPECT_TRUE(torch::equal(y, torch::full({4, 3}, 6.0)));
      EXPECT_FALSE(y.requires_grad());
    }
    EXPECT_EQ(history.use_count(), 1) << "the graph's static input keeps the caller's autograd graph alive";
  }
}

// Outputs are the caller's by default: one kept from an earlier call keeps its
// values (the trap of views into the graph's static output, which the next
// call overwrites, is opt-in with clone_outputs(false)).
TEST(Graph, SameResultsAsEagerAndOutputsTheCallerKeeps) {
  torch::manual_seed(0);
  auto model = deep_mlp();
  model->eval();
  const auto x = torch::randn({8, 16});
  auto g = perf::graph(model, x);
  EXPECT_EQ(g.graphed(), has_cuda() && x.is_cuda());
  const auto x1 = torch::randn({8, 16}), x2 = torch::randn({8, 16});
  const auto y1 = g(x1);
  EXPECT_TRUE(torch::equal(y1, model->forward(x1)));
  const auto y1_copy = y1.clone();
  const auto y2 = g(x2);
  EXPECT_TRUE(torch::equal(y2, model->forward(x2)));
  EXPECT_TRUE(torch::equal(y1, y1_copy)) << "an output kept from the first call keeps its values";
  auto views = perf::graph(model, x, perf::GraphOptions().clone_outputs(false));
  const auto v1 = views(x1);
  views(x2);
  EXPECT_TRUE(torch::equal(v1, y2)) << "clone_outputs(false): views of the static output, overwritten by the next call";
  EXPECT_EQ(g.captures(), 0) << "eager on the CPU: nothing captured";
  // Move-only, its moves and destructor compiled with the capture code (perf::perf_static's, not the caller's):
  // the graph works where it was moved to.
  static_assert(std::is_nothrow_move_constructible_v<perf::Graphed<at::Tensor>> &&
                !std::is_copy_constructible_v<perf::Graphed<at::Tensor>>);
  std::vector<perf::Graphed<at::Tensor>> moved;
  moved.push_back(std::move(g));
  EXPECT_TRUE(torch::equal(moved[0](x2), model->forward(x2)));
  moved.push_back(std::move(views));
  moved.front() = std::move(moved.back());
  moved.pop_back();
  EXPECT_TRUE(torch::equal(moved[0](x1), model->forward(x1)));
}

TEST(Graph, BucketsPadToTheNextSizeAndSliceBack) {
  torch::manual_seed(0);
  auto model = deep_mlp();
  model->eval();
  auto g = perf::graph(model, torch::randn({8, 16}), perf::GraphOptions().batch_sizes({8, 2, 1, 4, 4}));
  EXPECT_EQ(g.buckets(), (std::vector<int64_t>{1, 2, 4, 8}));
  for (int64_t b : {1, 2, 3, 5, 7, 8}) {
    const auto x = torch::randn({b, 16});
    const auto y = g(x);
    ASSERT_EQ(y.size(0), b) << "sliced back to the call's batch";
    EXPECT_TRUE(torch::allclose(y, model->forward(x), 1e-6, 1e-6)) << "batch " << b;
  }
  EXPECT_EQ(g.eager_calls(), 0);
  const auto big = torch::randn({9, 16});
  EXPECT_TRUE(torch::allclose(g(big), model->forward(big), 1e-6, 1e-6));
  EXPECT_EQ(g.eager_calls(), 1) << "above every bucket: eager, as chosen";
  auto strict = perf::graph(model, torch::randn({4, 16}),
                            perf::GraphOptions().batch_sizes({2, 4}).out_of_bucket(perf::OutOfBucket::error));
  PERF_EXPECT_THROW_MSG(strict(big), "batch size 9 is larger than every captured bucket (largest 4)");
}

TEST(Graph, MultipleInputsAndOutputs) {
  auto fn = [](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{in[0] * in[1], (in[0] + in[1]).relu()};
  };
  const auto a = torch::randn({6, 3}), b = torch::randn({6, 3});
  auto g = perf::graph(fn, {a, b}, perf::GraphOptions().batch_sizes({4, 8}));
  const auto a2 = torch::randn({5, 3}), b2 = torch::randn({5, 3});
  const auto out = g({a2, b2});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(torch::equal(out[0], a2 * b2));
  EXPECT_TRUE(torch::equal(out[1], (a2 + b2).relu()));
  PERF_EXPECT_THROW_MSG(g({a2, torch::randn({4, 3})}), "inputs have different batch sizes");
}

TEST(Graph, RejectsWhatWouldBeSilentlyWrong) {
  auto model = deep_mlp();
  const auto x = torch::randn({4, 16});
  auto exact = perf::graph(model, x);
  PERF_EXPECT_THROW_MSG(exact(torch::randn({5, 16})), "captured for [4, 16]");
  PERF_EXPECT_THROW_MSG(exact(torch::randn({4, 16}, torch::kDouble)), "must be a 2-D Float tensor");
  PERF_EXPECT_THROW_MSG(exact(std::vector<torch::Tensor>{x, x}), "expected 1 inputs, got 2");
  auto bucketed = perf::graph(model, x, perf::GraphOptions().batch_sizes({4}));
  PERF_EXPECT_THROW_MSG(bucketed(torch::randn({2, 15})), "only dim 0 (the batch) may differ");
  // An output without the batch dimension cannot be padded.
  PERF_EXPECT_THROW_MSG(
      perf::graph([](const torch::Tensor& t) { return t.sum(); }, x, perf::GraphOptions().batch_sizes({2, 4})),
      "padded batches would change it");
  PERF_EXPECT_THROW_MSG(
      perf::graph([](const std::vector<torch::Tensor>& in) { return in[0] + 1; }, {x, torch::empty({4}, torch::kMeta)}),
      "example input 1 is on meta but input 0 is on cpu");
  PERF_EXPECT_THROW_MSG(perf::graph(model, x, perf::GraphOptions().batch_sizes({0, 4})), "batch_sizes: must be >= 1");
  // A failure that is not LibTorch's own error (AOTInductor's runner throws
  // std::runtime_error) still reaches the caller with perf's context and its own text.
  PERF_EXPECT_THROW_MSG(
      perf::graph([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("run_func_ failed"); }, x),
      "perf::graph: the function failed on the example inputs: run_func_ failed");
}

namespace {

struct Run {
  std::vector<double> losses;
  torch::Tensor w;
};

// moved: the TrainStep is moved after its capture and trains from where it was moved to.
Run train(bool use_trainstep, torch::Device device, int steps, bool flat = false,
          const perf::TrainStepOptions& options = {}, torch::Dtype dtype = torch::kFloat, bool moved = false) {
  torch::manual_seed(0);
  auto model = deep_mlp();
  model->to(device, dtype);
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-2).flat(flat));
  auto loss_fn = [&](const torch::Tensor& x, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(model->forward(x), t);
  };
  torch::manual_seed(1);
  std::vector<torch::Tensor> xs, ts;
  for (int i = 0; i < steps; ++i) {
    xs.push_back(torch::randn({16, 16}, torch::TensorOptions(device).dtype(dtype)));
    ts.push_back(xs.back().narrow(1, 0, 4).argmax(1));  // a learnable target
  }
  Run r;
  if (use_trainstep) {
    perf::TrainStep made(*model, loss_fn, opt, xs[0], ts[0], options);
    std::optional<perf::TrainStep> moved_to;
    if (moved) moved_to.emplace(std::move(made));
    perf::TrainStep& step = moved ? *moved_to : made;
    EXPECT_EQ(step.graphed(), device.is_cuda());
    for (size_t i = 0; i < xs.size(); ++i) r.losses.push_back(step.step(xs[i], ts[i]).item<double>());
    if (flat) {  // the replayed (or eager) steps kept every gradient in the flat buffer
      const auto ps = model->parameters();
      for (const auto& p : ps) EXPECT_TRUE(p.grad().is_alias_of(ps.front().grad()));
      EXPECT_NE(opt.kernels().at(0).find("flat (1 tensor for 12 parameters)"), std::string::npos)
          << opt.kernels().at(0);
    }
    PERF_EXPECT_THROW_MSG(step.step(torch::randn({8, 16}, device), ts[0]), "static shapes");
  } else {
    for (size_t i = 0; i < xs.size(); ++i) {
      opt.zero_grad();
      auto loss = loss_fn(xs[i], ts[i]);
      loss.backward();
      opt.step();
      r.losses.push_back(loss.item<double>());
    }
  }
  r.w = model->parameters()[0].detach().cpu();
  return r;
}

}  // namespace

TEST(TrainStep, MatchesTheEagerLoop) {
  const auto eager = train(false, torch::kCPU, 60);
  const auto stepped = train(true, torch::kCPU, 60);
  EXPECT_EQ(stepped.losses, eager.losses);
  EXPECT_TRUE(torch::equal(stepped.w, eager.w));
  const auto& l = eager.losses;
  EXPECT_LT(l[55] + l[56] + l[57] + l[58] + l[59], l[0] + l[1] + l[2] + l[3] + l[4]) << "it trains";
}

// TrainStep is move-only, its moves and destructor compiled with the capture code (perf::perf_static's, not the
// caller's): a step moved after it was made trains as the one that stayed.
TEST(TrainStep, AStepMovedAfterItWasMadeTrainsAsTheOneThatStayed) {
  static_assert(std::is_nothrow_move_constructible_v<perf::TrainStep> &&
                !std::is_copy_constructible_v<perf::TrainStep>);
  const auto stayed = train(true, torch::kCPU, 20);
  const auto moved = train(true, torch::kCPU, 20, false, {}, torch::kFloat, /*moved=*/true);
  EXPECT_EQ(moved.losses, stayed.losses);
  EXPECT_TRUE(torch::equal(moved.w, stayed.w));
}

// The same on CUDA, where the step moved is a captured graph: its replays, from where it was moved to, give the
// same losses and weights as the one that stayed.
TEST(TrainStep, OnGpuAStepMovedAfterItsCaptureReplaysAsTheOneThatStayed) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const auto stayed = train(true, torch::kCUDA, 20);
  const auto moved = train(true, torch::kCUDA, 20, false, {}, torch::kFloat, /*moved=*/true);
  EXPECT_EQ(moved.losses, stayed.losses);
  EXPECT_TRUE(torch::equal(moved.w, stayed.w));
}

// The e2e benchmark's jobs (bench/e2e): TrainStep's losses, kept one per step
// and read at the end as a user would, equal eager training's step by step,
// fp32. CPU: TrainStep runs the same operators eagerly, so they are bitwise
// equal; CUDA: the replayed graph against eager on the same GPU, TF32 off.
template <typename Model>
std::pair<std::vector<double>, std::vector<double>> e2e_losses(Model model, const at::Tensor& x, const at::Tensor& y,
                                                               const c10::Device& device, int steps) {
  model->to(device);
  std::vector<at::Tensor> init;
  for (auto& p : model->parameters()) init.push_back(p.detach().clone());
  auto loss_fn = [&](const at::Tensor& in, const at::Tensor& t) {
    auto out = model->forward(in);
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), t.reshape({-1}));
  };
  auto run = [&](bool trainstep) {
    {
      torch::NoGradGuard no_grad;
      auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(init[i]);
    }
    perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).weight_decay(0.01));
    std::unique_ptr<perf::TrainStep> step;
    if (trainstep) step = std::make_unique<perf::TrainStep>(*model, loss_fn, opt, x.to(device), y.to(device));
    std::vector<at::Tensor> kept;
    for (int i = 0; i < steps; ++i) {
      const auto xi = x.roll(i, 0).to(device), yi = y.roll(i, 0).to(device);
      if (trainstep) {
        kept.push_back(step->step(xi, yi));
      } else {
        opt.zero_grad();
        auto loss = loss_fn(xi, yi);
        loss.backward();
        opt.step();
        kept.push_back(loss.detach());
      }
    }
    std::vector<double> losses;
    losses.reserve(kept.size());
    for (const auto& l : kept) losses.push_back(l.item<double>());  // read at the end, like bench/e2e
    return losses;
  };
  auto eager = run(false);
  return {eager, run(true)};
}

// A flat optimizer under TrainStep (captured on CUDA, its zero_grad a fill of the
// gradient buffer inside the graph; clipping one norm over the buffer) trains
// like a non-flat one in an eager loop. Clipped, the two sum the squares in a
// different order (one norm over the buffer, a norm of per-tensor norms), so
// the clip coefficients differ in the last bit, and AdamW at lr 1e-2 amplifies
// that: in fp32 on the CPU the losses part by up to 9e-6 at step 38 on an AMD
// EPYC (1 ulp before step 37; on other CPUs less). The CPU compares the clipped
// runs in float64, where that amplification stays far below the bound.
TEST(TrainStep, AFlatOptimizerTrainsLikeTheEagerLoop) {
  std::vector<torch::Device> devices = {torch::kCPU};
  if (has_cuda()) devices.emplace_back(torch::kCUDA);
  perf::ScopedSettings fp32(perf::Settings().tf32(false).matmul_precision("highest"));
  for (const auto& device : devices) {
    SCOPED_TRACE(device.str());
    const auto eager = train(false, device, 40);
    const auto flat = train(true, device, 40, /*flat=*/true);
    const double tol = device.is_cuda() ? 1e-4 : 1e-6;
    ASSERT_EQ(flat.losses.size(), eager.losses.size());
    for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_NEAR(flat.losses[i], eager.losses[i], tol) << i;
    EXPECT_TRUE(torch::allclose(flat.w, eager.w, tol, tol));
    const auto clip = perf::TrainStepOptions().max_grad_norm(0.5);
    const auto clip_dtype = device.is_cuda() ? torch::kFloat : torch::kDouble;
    const double clip_tol = device.is_cuda() ? tol : 1e-9;
    const auto plain_clipped = train(true, device, 40, false, clip, clip_dtype);
    const auto flat_clipped = train(true, device, 40, true, clip, clip_dtype);
    for (size_t i = 0; i < eager.losses.size(); ++i)
      EXPECT_NEAR(flat_clipped.losses[i], plain_clipped.losses[i], clip_tol) << "clipped, step " << i;
    EXPECT_FALSE(torch::allclose(flat_clipped.w.to(torch::kFloat), flat.w, 1e-4, 1e-4)) << "clipping changed the run";
  }
}

TEST(TrainStep, KeptLossesEqualEagerStepByStepOnTheE2eJobs) {
  std::vector<c10::Device> devices = {c10::Device(c10::kCPU)};
  if (has_cuda()) devices.emplace_back(c10::kCUDA, 0);
  perf::ScopedSettings fp32(perf::Settings().tf32(false).matmul_precision("highest"));
  for (const auto& device : devices) {
    const double tol = device.is_cuda() ? 1e-4 : 0.0;
    torch::manual_seed(0);
    const auto tokens = torch::randint(0, 64, {8, 17});
    const auto [gpt_eager, gpt_step] = e2e_losses(e2e::Gpt(64, 32, 2, 4, 16), tokens.narrow(1, 0, 16).contiguous(),
                                                  tokens.narrow(1, 1, 16).contiguous(), device, 8);
    torch::manual_seed(0);
    const auto images = torch::randn({8, 3, 16, 16});
    const auto labels = torch::randint(0, 10, {8});
    const auto [cnn_eager, cnn_step] = e2e_losses(perf_bench::ResNet(8, 10), images, labels, device, 8);
    for (size_t i = 0; i < gpt_eager.size(); ++i) {
      EXPECT_NEAR(gpt_step[i], gpt_eager[i], tol) << device << " transformer step " << i;
      EXPECT_NEAR(cnn_step[i], cnn_eager[i], tol) << device << " CNN step " << i;
      if (i > 0) {
        EXPECT_NE(gpt_step[i], gpt_step[i - 1]) << "each kept loss is its own step's";
      }
    }
  }
}

namespace {

torch::nn::Sequential bn_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 4));
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()) + ".pt")).string();
}

}  // namespace

// What a captured step baked in, and what a replay would silently ignore:
// host-side checks, so they are tested here without a GPU (the re-capture
// itself in OnGpuCapturesAgainWhereAReplayWouldDifferFromEager).
TEST(TrainStep, ACaptureNoticesWhatItsReplaysWouldIgnore) {
  torch::manual_seed(0);
  auto model = bn_mlp();
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-2));
  auto train_once = [&] {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(torch::randn({8, 8})), torch::randint(0, 4, {8})).backward();
    opt.step();
  };
  train_once();  // state exists, as after TrainStep's warm-up
  auto fresh = [&] { return perf::detail::CapturedState(*model, {&opt}, /*training_modes=*/true); };
  auto captured = fresh();
  EXPECT_EQ(captured.changed(*model, {&opt}), "");
  train_once();  // steps update in place: nothing a replay would miss
  EXPECT_EQ(captured.changed(*model, {&opt}), "");

  model->eval();
  EXPECT_EQ(captured.changed(*model, {&opt}), "the model was switched to eval() mode");
  model->train();
  EXPECT_EQ(captured.changed(*model, {&opt}), "") << "a validation pass that ends in train() changes nothing";
  model[1]->eval();  // BatchNorm frozen
  EXPECT_EQ(captured.changed(*model, {&opt}), "module '1' was switched to eval() mode");
  EXPECT_EQ(perf::detail::CapturedState(*model, {&opt}, /*training_modes=*/false).changed(*model, {&opt}), "");
  model->train();

  model->parameters()[0].requires_grad_(false);
  EXPECT_EQ(captured.changed(*model, {&opt}), "parameter '0.weight' now has requires_grad=false");
  model->parameters()[0].requires_grad_(true);
  EXPECT_EQ(captured.changed(*model, {&opt}), "");

  const auto model_file = temp_path("perf_capture_model"), opt_file = temp_path("perf_capture_opt");
  torch::save(model, model_file);
  torch::load(model, model_file);  // LibTorch sets the loaded storage into the same tensors
  EXPECT_EQ(captured.changed(*model, {&opt}),
            "parameter '0.weight' was given new storage (torch::load, model->to, set_data)");
  captured = fresh();
  model[1]->as<torch::nn::BatchNorm1d>()->running_mean.set_data(torch::zeros({16}));
  EXPECT_EQ(captured.changed(*model, {&opt}), "buffer '1.running_mean' was given new storage (torch::load, model->to)");
  captured = fresh();
  torch::save(opt, opt_file);
  torch::load(opt, opt_file);
  EXPECT_EQ(captured.changed(*model, {&opt}), "the optimizer's state was replaced (torch::load of the optimizer)");
  captured = fresh();
  // Options the kernels take as host values (a weight-decay or momentum
  // schedule); lr reaches them as a device tensor and is no change.
  auto& options = static_cast<perf::optim::AdamWOptions&>(opt.param_groups()[0].options());
  options.lr(5e-3);
  EXPECT_EQ(captured.changed(*model, {&opt}), "");
  options.weight_decay(0.05);
  EXPECT_EQ(captured.changed(*model, {&opt}),
            "the optimizer's option weight_decay of param group 0 changed from 0.01 to 0.05 (the kernels take it as "
            "a host value, which a replay would keep)");
  options.weight_decay(0.01).betas({0.85, 0.999});
  EXPECT_EQ(captured.changed(*model, {&opt}),
            "the optimizer's option betas[0] of param group 0 changed from 0.9 to 0.85 (the kernels take it as a "
            "host value, which a replay would keep)");
  options.betas({0.9, 0.999}).amsgrad(true);
  EXPECT_NE(captured.changed(*model, {&opt}).find("option amsgrad of param group 0 changed from 0 to 1"),
            std::string::npos);
  options.amsgrad(false);
  EXPECT_EQ(captured.changed(*model, {&opt}), "");
  perf::optim::SGD sgd(model->parameters(), perf::optim::SGDOptions(0.1).momentum(0.9));
  const perf::detail::CapturedState sgd_captured(*model, {&sgd}, /*training_modes=*/true);
  static_cast<perf::optim::SGDOptions&>(sgd.param_groups()[0].options()).momentum(0.8);
  EXPECT_NE(sgd_captured.changed(*model, {&sgd}).find("option momentum of param group 0 changed from 0.9 to 0.8"),
            std::string::npos);
  // Two optimizers (TrainStep's {&muon, &adamw}): the second's options and groups are watched as the first's.
  const perf::detail::CapturedState both(*model, {&opt, &sgd}, /*training_modes=*/true);
  EXPECT_EQ(both.changed(*model, {&opt, &sgd}), "");
  static_cast<perf::optim::SGDOptions&>(sgd.param_groups()[0].options()).momentum(0.7);
  EXPECT_NE(both.changed(*model, {&opt, &sgd}).find("option momentum of param group 0 changed from 0.8 to 0.7"),
            std::string::npos);
  static_cast<perf::optim::SGDOptions&>(sgd.param_groups()[0].options()).momentum(0.8);
  EXPECT_EQ(both.changed(*model, {&opt, &sgd}), "");
  sgd.add_param_group(torch::optim::OptimizerParamGroup({torch::zeros({2}, torch::requires_grad())}));
  EXPECT_EQ(both.changed(*model, {&opt, &sgd}), "the optimizer's param groups changed (add_param_group)");
  // A scaler's update() is captured with its settings as host values; loading
  // a checkpoint saved with other settings changes them (the scale itself is
  // updated in place).
  perf::GradScaler scaler(perf::GradScalerOptions().growth_interval(100));
  scaler.scale(torch::ones({}));  // creates the scale
  const perf::detail::CapturedState scaled(*model, {&opt}, /*training_modes=*/true, &scaler);
  EXPECT_EQ(scaled.changed(*model, {&opt}, &scaler), "");
  const auto scaler_file = temp_path("perf_capture_scaler");
  perf::GradScaler other(perf::GradScalerOptions().init_scale(1024.0));
  torch::save(other, scaler_file);
  torch::load(scaler, scaler_file);
  EXPECT_EQ(scaler.get_scale(), 1024.0);
  EXPECT_EQ(scaled.changed(*model, {&opt}, &scaler),
            "the GradScaler's growth_factor, backoff_factor or growth_interval changed (torch::load of the scaler)");
  std::filesystem::remove(scaler_file);
  opt.add_param_group(torch::optim::OptimizerParamGroup({torch::zeros({3}, torch::requires_grad())}));
  EXPECT_EQ(captured.changed(*model, {&opt}), "the optimizer's param groups changed (add_param_group)");
  // Flat mode: constructing the optimizer moves the parameters into one buffer
  // (new storage, which a graph built before sees); steps keep them there.
  auto flat_model = bn_mlp();
  const perf::detail::CapturedState before_flat(*flat_model, {}, /*training_modes=*/true);
  perf::optim::AdamW flat(flat_model->parameters(), perf::optim::AdamWOptions(1e-2).flat(true));
  EXPECT_EQ(before_flat.changed(*flat_model, {}),
            "parameter '0.weight' was given new storage (torch::load, model->to, set_data)");
  auto flat_step = [&] {
    flat.zero_grad();
    flat_model->forward(torch::randn({8, 8})).square().mean().backward();
    flat.step();
  };
  flat_step();
  const perf::detail::CapturedState flat_captured(*flat_model, {&flat}, /*training_modes=*/true);
  flat_step();
  flat_step();
  EXPECT_EQ(flat_captured.changed(*flat_model, {&flat}), "");
  std::filesystem::remove(model_file);
  std::filesystem::remove(opt_file);
}

// perf::graph is for inference, but a module may be in train() mode (dropout
// kept on at inference). Building the graph runs the forward (warm-up,
// capture; on the CPU one eager call per bucket): the module's buffers and the
// generator are left as they were. A train()-mode BatchNorm with batch_sizes
// would average the padding rows into its batch statistics: refused.
TEST(Graph, ATrainModeModuleIsLeftAsItWasAndBatchNormIsNotPadded) {
  auto make = [] {
    return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU(),
                                 torch::nn::Dropout(0.5), torch::nn::Linear(16, 4));
  };
  torch::manual_seed(0);
  auto model = make();
  const auto x = torch::randn({8, 8});
  auto& bn = *model[1]->as<torch::nn::BatchNorm1d>();
  const auto mean_before = bn.running_mean.clone();
  const auto batches_before = bn.num_batches_tracked.item<int64_t>();
  PERF_EXPECT_THROW_MSG(perf::graph(model, x, perf::GraphOptions().batch_sizes({4, 8})),
                        "perf::graph: module '1' (torch::nn::BatchNorm1dImpl) is in train() mode: with batch_sizes a "
                        "call is padded with zero rows to its bucket");
  auto exact = perf::graph(model, x);
  EXPECT_TRUE(torch::equal(bn.running_mean, mean_before)) << "building the graph moved the running statistics";
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), batches_before);
  const auto next_random = torch::rand({3});
  torch::manual_seed(0);
  make();
  torch::randn({8, 8});
  EXPECT_TRUE(torch::equal(torch::rand({3}), next_random)) << "building the graph drew from the generator";
  // A call is one train()-mode forward, as eager: the same output (dropout
  // mask included) and the same running statistics afterwards.
  auto twin = make();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) twin->parameters()[i].copy_(model->parameters()[i]);
  }
  torch::manual_seed(5);
  const auto y = exact(x);
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  EXPECT_TRUE(torch::allclose(y, twin->forward(x), 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(bn.running_mean, twin[1]->as<torch::nn::BatchNorm1d>()->running_mean, 1e-6, 1e-6));
  model->eval();
  auto bucketed = perf::graph(model, x, perf::GraphOptions().batch_sizes({4, 8}));  // eval(): padding is harmless
  EXPECT_TRUE(torch::allclose(bucketed(x.narrow(0, 0, 3)), model->forward(x.narrow(0, 0, 3)), 1e-6, 1e-6));
  // Switched to train() after: refused at the next call (on CUDA, by the
  // capture the mode change triggers).
  model->train();
  PERF_EXPECT_THROW_MSG(bucketed(x.narrow(0, 0, 3)), "module '1' (torch::nn::BatchNorm1dImpl) is in train() mode");
  EXPECT_TRUE(torch::allclose(bn.running_mean, twin[1]->as<torch::nn::BatchNorm1d>()->running_mean, 1e-6, 1e-6))
      << "the refused call ran";
}

// Freezing a layer, a BatchNorm switched to eval(), a checkpoint loaded into
// the model and into the optimizer mid-training: the graphed step captures
// again each time and trains as the eager step does.
TEST(TrainStep, OnGpuCapturesAgainWhereAReplayWouldDifferFromEager) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  perf::ScopedSettings fp32(perf::Settings().tf32(false).matmul_precision("highest"));
  const auto model_file = temp_path("perf_recapture_model"), opt_file = temp_path("perf_recapture_opt");
  torch::manual_seed(1);
  std::vector<at::Tensor> xs, ts;
  for (int i = 0; i < 25; ++i) {
    xs.push_back(torch::randn({16, 8}, torch::kCUDA));
    ts.push_back(xs.back().narrow(1, 0, 4).argmax(1));
  }
  struct Result {
    std::vector<double> losses;
    at::Tensor frozen_before, frozen_after;
    int64_t captures = 0;
    std::vector<at::Tensor> params;
  };
  auto run = [&](bool graph) {
    torch::manual_seed(0);
    auto model = bn_mlp();
    model->to(torch::kCUDA);
    perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-2));
    auto loss_fn = [&](const at::Tensor& x, const at::Tensor& t) {
      return torch::nn::functional::cross_entropy(model->forward(x), t);
    };
    perf::TrainStep step(model, loss_fn, opt, xs[0], ts[0], perf::TrainStepOptions().graph(graph));
    EXPECT_EQ(step.graphed(), graph);
    Result r;
    for (int i = 0; i < 25; ++i) {
      if (i == 3) {
        torch::save(model, model_file);
        torch::save(opt, opt_file);
      }
      if (i == 5) {
        model->parameters()[0].requires_grad_(false);
        r.frozen_before = model->parameters()[0].detach().clone();
      }
      if (i == 10) {
        r.frozen_after = model->parameters()[0].detach().clone();
        model->parameters()[0].requires_grad_(true);
        model[1]->eval();
      }
      if (i == 15) torch::load(model, model_file);  // back to step 3's weights; BatchNorm still in eval()
      if (i == 20) torch::load(opt, opt_file);
      if (i == 22)  // a weight-decay schedule: a host value in the kernels
        static_cast<perf::optim::AdamWOptions&>(opt.param_groups()[0].options()).weight_decay(5.0);
      r.losses.push_back(step.step(xs[static_cast<size_t>(i)], ts[static_cast<size_t>(i)]).item<double>());
    }
    r.captures = step.captures();
    for (const auto& p : model->parameters()) r.params.push_back(p.detach().clone());
    return r;
  };
  const auto eager = run(false);
  const auto graphed = run(true);
  EXPECT_EQ(eager.captures, 0);
  EXPECT_EQ(graphed.captures, 6)
      << "the first capture, then after the freeze, the thaw and eval(), each load, the weight decay";
  EXPECT_TRUE(torch::equal(graphed.frozen_before, graphed.frozen_after)) << "a frozen parameter moved";
  for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_NEAR(graphed.losses[i], eager.losses[i], 1e-4) << i;
  ASSERT_EQ(graphed.params.size(), eager.params.size());
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_LT((graphed.params[i] - eager.params[i]).abs().max().item<double>(), 1e-4) << "parameter " << i;
  std::filesystem::remove(model_file);
  std::filesystem::remove(opt_file);
}

TEST(Graph, OnGpuReplayIsBitIdenticalToEager) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  torch::manual_seed(0);
  auto model = deep_mlp(256);
  model->to(torch::kCUDA);
  model->eval();
  const auto x = torch::randn({32, 16}, torch::kCUDA);
  auto g = perf::graph(model, x, perf::GraphOptions().batch_sizes({1, 2, 4, 8, 16, 32}));
  EXPECT_TRUE(g.graphed());
  auto bucket_of = [](int64_t b) {
    int64_t s = 1;
    while (s < b) s *= 2;
    return s;
  };
  for (int64_t b : {32, 16, 5, 1}) {
    const auto xb = torch::randn({b, 16}, torch::kCUDA);
    torch::NoGradGuard ng;
    // Eager on the same padded shape runs the same kernels: bit-identical.
    const auto ref = model->forward(torch::cat({xb, torch::zeros({bucket_of(b) - b, 16}, torch::kCUDA)}));
    EXPECT_TRUE(torch::equal(g(xb), ref.narrow(0, 0, b))) << "batch " << b;
  }
  {  // moved, the graphs replay where they were moved to
    auto moved = std::move(g);
    EXPECT_TRUE(moved.graphed());
    const auto xb = torch::randn({8, 16}, torch::kCUDA);
    torch::NoGradGuard ng;
    EXPECT_TRUE(torch::equal(moved(xb), model->forward(xb)));
  }
  // Dropout inside the graph: fresh randomness per replay, as in PyTorch.
  auto drop = perf::graph([](const torch::Tensor& t) { return torch::dropout(t, 0.5, true); },
                          torch::ones({1024}, torch::kCUDA));
  const auto d1 = drop(torch::ones({1024}, torch::kCUDA)).clone();
  const auto d2 = drop(torch::ones({1024}, torch::kCUDA)).clone();
  EXPECT_FALSE(torch::equal(d1, d2));
}

// torch::load of a module sets new storage into its parameters: a graph of the
// module captures again instead of reading the old, freed storage; a module
// switched to train() (dropout, BatchNorm statistics) is captured again too.
TEST(Graph, OnGpuCapturesAgainWhenTheModulesWeightsAreLoaded) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const auto file = temp_path("perf_graph_reload");
  torch::manual_seed(0);
  auto model = deep_mlp(64);
  model->to(torch::kCUDA);
  model->eval();
  const auto x = torch::randn({8, 16}, torch::kCUDA);
  auto g = perf::graph(model, x, perf::GraphOptions().batch_sizes({4, 8}));
  ASSERT_TRUE(g.graphed());
  EXPECT_EQ(g.captures(), 1);
  const auto before = g(x);
  torch::manual_seed(1);
  auto other = deep_mlp(64);
  other->to(torch::kCUDA);
  torch::save(other, file);
  torch::load(model, file);  // CUDA tensors: set into the same parameters, new storage
  torch::NoGradGuard no_grad;
  const auto after = g(x);
  EXPECT_EQ(g.captures(), 2);
  EXPECT_TRUE(torch::equal(after, model->forward(x))) << "the loaded weights";
  EXPECT_FALSE(torch::equal(after, before));
  EXPECT_TRUE(torch::equal(
      g(x.narrow(0, 0, 3)),
      model->forward(torch::cat({x.narrow(0, 0, 3), torch::zeros({1, 16}, torch::kCUDA)})).narrow(0, 0, 3)))
      << "every bucket captured again";
  EXPECT_EQ(g.captures(), 2) << "nothing changed since";
  model->train();
  g(x);
  EXPECT_EQ(g.captures(), 3);
  model->eval();
  std::filesystem::remove(file);
}

// What the warm-up calls left in the caching allocator is given back before
// capture, as torch.cuda.graph does: the capture allocates from its own pool,
// which those cached blocks cannot serve, and the allocator releases no cached
// block while a capture is under way, so a training step whose working set is
// over half the GPU's memory would run out under capture. Read from this
// process's allocator statistics as the function starts each call (a 256 MiB
// temporary, freed at return: cached), not by filling the GPU: ctest runs other
// GPU tests beside this one, and their memory is not this test's to count on.
TEST(Graph, OnGpuCaptureGivesBackWhatTheWarmupCached) {
#if PERF_WITH_CUDA
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  constexpr int64_t big_bytes = int64_t{256} << 20;
  c10::cuda::CUDACachingAllocator::emptyCache();
  struct Call {
    bool capturing;
    int64_t reserved;
  };
  std::vector<Call> calls;
  const auto x = torch::randn({64}, torch::kCUDA);
  {
    auto g = perf::graph(
        [&calls](const torch::Tensor& in) {
          calls.push_back({perf::optim::detail::capturing_cuda_graph(), *perf::memory_stats(in.device()).reserved});
          const auto big = torch::full({big_bytes / 4}, 2.0f, in.options());
          return in * big.narrow(0, 0, in.numel());
        },
        x, perf::GraphOptions().warmup(2));
    EXPECT_TRUE(g.graphed());
    const auto y = torch::randn({64}, torch::kCUDA);
    EXPECT_TRUE(torch::equal(g(y), y * 2));
  }
  // Relative to what the process held as the first call began: the tests run
  // before this one in the same process may hold memory of their own.
  ASSERT_EQ(calls.size(), 3u) << "two warm-up calls, then the capture";
  EXPECT_FALSE(calls[1].capturing);
  EXPECT_GE(calls[1].reserved, calls[0].reserved + big_bytes) << "the first warm-up call's temporary, cached";
  EXPECT_TRUE(calls[2].capturing);
  EXPECT_LE(calls[2].reserved + big_bytes, calls[1].reserved) << "given back before the capture began";
  c10::cuda::CUDACachingAllocator::emptyCache();  // the graph's pool, for the tests after this one
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

// The scope perf's captures (and perf::optimize's autotune_candidates(false))
// turn cuDNN's benchmark mode off in: only where it was on, and back on at
// release() or the scope's end, also when it ends by an exception.
TEST(Graph, CudnnBenchmarkOffGivesTheProgramsSettingBack) {
  // Set directly: perf::setup() leaves cuDNN's settings alone on a machine without CUDA.
  auto& context = at::globalContext();
  const bool before = context.benchmarkCuDNN();
  const auto restore = c10::make_scope_exit([&] { context.setBenchmarkCuDNN(before); });
  context.setBenchmarkCuDNN(true);
  {
    perf::detail::CudnnBenchmarkOff off;
    EXPECT_TRUE(off.active());
    EXPECT_FALSE(context.benchmarkCuDNN());
    off.release();
    EXPECT_FALSE(off.active());
    EXPECT_TRUE(at::globalContext().benchmarkCuDNN());
  }
  EXPECT_TRUE(at::globalContext().benchmarkCuDNN()) << "released once, not turned on again at the end";
  try {
    perf::detail::CudnnBenchmarkOff off;
    throw std::runtime_error("mid-scope");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(at::globalContext().benchmarkCuDNN());
  {
    perf::detail::CudnnBenchmarkOff off(/*wanted=*/false);
    EXPECT_FALSE(off.active());
    EXPECT_TRUE(at::globalContext().benchmarkCuDNN());
  }
  context.setBenchmarkCuDNN(false);
  {
    perf::detail::CudnnBenchmarkOff off;
    EXPECT_FALSE(off.active());
  }
  EXPECT_FALSE(at::globalContext().benchmarkCuDNN()) << "not turned on where the program had it off";
}

// perf::optimize's autotune_candidates(false) scope: benchmark mode off and, where the program has it off,
// cuDNN's deterministic mode on (ATen's plan cache keys on it, not on the benchmark flag: the candidates'
// heuristic plans kept apart from the program's); both given back at release() or the scope's end, also when
// it ends by an exception. A program with deterministic mode on keeps it, and the plans are not apart.
TEST(Graph, CudnnHeuristicPlansKeepsTheCandidatesPlansApartAndGivesTheSettingsBack) {
  auto& context = at::globalContext();
  const bool benchmark = context.benchmarkCuDNN(), deterministic = context.deterministicCuDNN();
  const auto restore = c10::make_scope_exit([&] {
    context.setBenchmarkCuDNN(benchmark);
    context.setDeterministicCuDNN(deterministic);
  });
  context.setBenchmarkCuDNN(true);
  context.setDeterministicCuDNN(false);
  {
    perf::detail::CudnnHeuristicPlans scope;
    EXPECT_TRUE(scope.active());
    EXPECT_TRUE(scope.plans_apart());
    EXPECT_FALSE(context.benchmarkCuDNN());
    EXPECT_TRUE(context.deterministicCuDNN());
    scope.release();
    EXPECT_FALSE(scope.active());
    EXPECT_FALSE(scope.plans_apart());
    EXPECT_TRUE(context.benchmarkCuDNN());
    EXPECT_FALSE(context.deterministicCuDNN());
  }
  EXPECT_TRUE(context.benchmarkCuDNN()) << "released once, not changed again at the end";
  EXPECT_FALSE(context.deterministicCuDNN());
  try {
    perf::detail::CudnnHeuristicPlans scope;
    throw std::runtime_error("mid-scope");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(context.benchmarkCuDNN());
  EXPECT_FALSE(context.deterministicCuDNN());
  {
    perf::detail::CudnnHeuristicPlans scope(/*wanted=*/false);
    EXPECT_FALSE(scope.active());
    EXPECT_FALSE(context.deterministicCuDNN());
  }
  context.setDeterministicCuDNN(true);
  {
    perf::detail::CudnnHeuristicPlans scope;
    EXPECT_TRUE(scope.active());
    EXPECT_FALSE(scope.plans_apart()) << "the program's deterministic mode: the same cache keys";
    EXPECT_FALSE(context.benchmarkCuDNN());
  }
  EXPECT_TRUE(context.deterministicCuDNN()) << "the program's deterministic mode left on";
  EXPECT_TRUE(context.benchmarkCuDNN());
  context.setDeterministicCuDNN(false);
  {
    // torch::use_deterministic_algorithms: ATen's key takes it as cuDNN's flag, so nothing to keep apart either.
    const bool algorithms = context.deterministicAlgorithms(), warn_only = context.deterministicAlgorithmsWarnOnly();
    const auto put_back = c10::make_scope_exit([&] { context.setDeterministicAlgorithms(algorithms, warn_only); });
    context.setDeterministicAlgorithms(true, false);
    perf::detail::CudnnHeuristicPlans scope;
    EXPECT_TRUE(scope.active());
    EXPECT_FALSE(scope.plans_apart());
    EXPECT_FALSE(context.deterministicCuDNN()) << "cuDNN's own flag left as it was";
  }
  EXPECT_FALSE(context.deterministicCuDNN());
  context.setBenchmarkCuDNN(false);
  {
    perf::detail::CudnnHeuristicPlans scope;
    EXPECT_FALSE(scope.active());
    EXPECT_FALSE(context.deterministicCuDNN()) << "nothing to keep apart where benchmark mode is off";
  }
  EXPECT_FALSE(context.benchmarkCuDNN());
}

// With cuDNN's benchmark mode on (perf::setup's default), a convolution that
// reaches the capture without a usable cached plan (its cached plan found no
// memory for its workspace under capture, or its shape had no warm-up) would
// benchmark again inside the capture (Conv_v8.cpp, run_single_conv: timed runs
// and syncs) and fail it in the convolution. perf captures with the mode off, so
// cuDNN's heuristics plan it instead; the flag is back on after the capture,
// whether it succeeded or threw. Here the capture's call pads its input to a
// shape (odd sizes, this test's own) that no call before it ran.
TEST(Graph, OnGpuCaptureWithCudnnBenchmarkPlansAConvolutionTheWarmupDidNot) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  perf::ScopedSettings recipe(perf::Settings().cudnn_benchmark(true).tf32(false).matmul_precision("highest"));
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(5, 7, 3));
  conv->to(torch::kCUDA);
  std::vector<bool> flag_in_capture;
  auto f = [&](const torch::Tensor& in) {
    const bool capturing = perf::optim::detail::capturing_cuda_graph();
    if (capturing) flag_in_capture.push_back(at::globalContext().benchmarkCuDNN());
    const auto x = capturing ? torch::constant_pad_nd(in, {0, 4, 0, 2}) : in;
    return conv(x).amax({2, 3});
  };
  auto reference = [&](const torch::Tensor& in) { return conv(torch::constant_pad_nd(in, {0, 4, 0, 2})).amax({2, 3}); };
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({3, 5, 29, 37}, torch::kCUDA);
  auto g = perf::graph(f, x);
  EXPECT_TRUE(g.graphed());
  EXPECT_EQ(flag_in_capture, std::vector<bool>{false});
  EXPECT_TRUE(at::globalContext().benchmarkCuDNN()) << "back on after the capture";
  for (int i = 0; i < 3; ++i) {
    const auto y = torch::randn({3, 5, 29, 37}, torch::kCUDA);
    EXPECT_TRUE(torch::allclose(g(y), reference(y), 1e-4, 1e-5)) << "replay " << i;
  }
  auto bad = [](const torch::Tensor& t) {
    if (perf::optim::detail::capturing_cuda_graph() && t.sum().item<float>() > 1e30f) return t * 2;
    return t + 1;
  };
  PERF_EXPECT_THROW_MSG(perf::graph(bad, torch::ones({8}, torch::kCUDA)), "CUDA graph capture failed");
  EXPECT_TRUE(at::globalContext().benchmarkCuDNN()) << "back on after a capture that threw";
}

TEST(Graph, OnGpuCaptureErrorsNameTheCause) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  auto bad = [](const torch::Tensor& t) {
    if (t.sum().item<float>() > 1e30f) return t * 2;  // host sync inside the region
    return t + 1;
  };
  const auto x = torch::ones({8}, torch::kCUDA);
  PERF_EXPECT_THROW_MSG(perf::graph(bad, x), "makes a host-device sync");
  PERF_EXPECT_THROW_MSG(perf::graph(bad, x, perf::GraphOptions().check_syncs(false)), "CUDA graph capture failed");
  PERF_EXPECT_THROW_MSG(perf::graph(bad, x, perf::GraphOptions().check_syncs(false)), "host sync");
  auto fallback = perf::graph(bad, x, perf::GraphOptions().eager_fallback(true));
  EXPECT_FALSE(fallback.graphed());
  EXPECT_TRUE(torch::equal(fallback(x), x + 1));
}

TEST(TrainStep, OnGpuLossSequenceMatchesEagerOver50Steps) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const auto eager = train(false, torch::kCUDA, 50);
  const auto graphed = train(true, torch::kCUDA, 50);
  ASSERT_EQ(graphed.losses.size(), eager.losses.size());
  for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_NEAR(graphed.losses[i], eager.losses[i], 1e-4) << i;
  EXPECT_TRUE(torch::allclose(graphed.w, eager.w, 1e-4, 1e-5));
}
