// Tests for the CUDA-path defects of issue 10: what the CPU can show runs here;
// the GPU tests run the program a user would write, in one process, and skip
// with a reason where there is no GPU.
#include <gtest/gtest.h>
#include <perf/amp.h>
#include <perf/cuda_graph.h>
#include <perf/data.h>
#include <perf/lr_scheduler.h>
#include <perf/memory.h>
#include <perf/memory_format.h>
#include <perf/optim.h>
#include <perf/swa_utils.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <thread>

#include "test_util.h"

namespace {

using test_util::has_cuda;

torch::nn::Sequential mlp(int64_t width = 32) {
  torch::nn::Sequential m;
  m->push_back(torch::nn::Linear(16, width));
  m->push_back(torch::nn::ReLU());
  m->push_back(torch::nn::Linear(width, width));
  m->push_back(torch::nn::ReLU());
  m->push_back(torch::nn::Linear(width, 4));
  return m;
}

std::vector<torch::Tensor> flat_params(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().cpu().flatten());
  return out;
}

using test_util::cat_params;

struct Data {
  std::vector<torch::Tensor> xs, ts;
};

Data make_data(int steps, int64_t batch, torch::Device device) {
  torch::manual_seed(1);
  Data d;
  for (int i = 0; i < steps; ++i) {
    d.xs.push_back(torch::randn({batch, 16}).to(device));
    d.ts.push_back(d.xs.back().narrow(1, 0, 4).argmax(1));
  }
  return d;
}

}  // namespace

// --------------------------------------------------------------------------- 5. SGD momentum buffers

TEST(CudaPaths, SgdSkippedFirstStepLeavesTheOptimizerAsIfNeverCalled) {
  // Poison freed memory so that an uninitialised buffer would show as NaN.
  for (int i = 0; i < 8; ++i) {
    auto junk = torch::full({64, 64}, std::nan(""));
    auto junk2 = torch::full({64}, std::nan(""));
  }
  torch::manual_seed(0);
  auto a = torch::nn::Linear(64, 64), b = torch::nn::Linear(64, 64);
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  const auto opts = perf::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3);
  perf::optim::SGD perf_sgd(a->parameters(), opts);
  torch::optim::SGD ref(b->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3));
  // First step: gradients are inf, the scaler flags it; the update is skipped on the device.
  for (auto& p : a->parameters()) p.mutable_grad() = torch::full_like(p, std::numeric_limits<float>::infinity());
  perf_sgd.step_scaled(torch::ones({}), torch::ones({}));
  const auto before = cat_params(*b);
  EXPECT_TRUE(torch::equal(cat_params(*a), before)) << "a skipped step moves nothing";
  torch::manual_seed(3);
  for (int k = 0; k < 20; ++k) {
    const auto x = torch::randn({8, 64});
    for (auto* m : {&a, &b}) {
      (*m)->zero_grad();
      (*m)->forward(x).pow(2).mean().backward();
    }
    perf_sgd.step();
    ref.step();
  }
  const auto got = cat_params(*a), want = cat_params(*b);
  EXPECT_FALSE(torch::isnan(got).any().item<bool>()) << "momentum buffers started from garbage";
  EXPECT_LE((got - want).abs().max().item<double>(), 1e-6);
  EXPECT_GT((want - before).abs().max().item<double>(), 1e-3) << "it trained";
}

TEST(CudaPaths, SkipUpdatesCreatesStateButMovesNothing) {
  torch::manual_seed(0);
  auto m = mlp();
  perf::optim::AdamW opt(m->parameters(), perf::optim::AdamWOptions(1e-2));
  const auto before = cat_params(*m);
  m->forward(torch::randn({4, 16})).sum().backward();
  opt.skip_updates(true);
  opt.step();
  opt.skip_updates(false);
  EXPECT_TRUE(torch::equal(cat_params(*m), before));
  ASSERT_EQ(opt.state().size(), m->parameters().size()) << "state exists (a capture needs it)";
  for (auto& [key, st] : opt.state()) {
    auto& s = static_cast<perf::optim::AdamParamState&>(*st);
    EXPECT_EQ(s.step().item<float>(), 0.f) << "step count undone";
    EXPECT_EQ(s.exp_avg().abs().sum().item<float>(), 0.f);
  }
  opt.step();
  EXPECT_FALSE(torch::equal(cat_params(*m), before)) << "and the next step trains";
}

TEST(CudaPaths, FoundInfSummedOverDevicesStillSkips) {
  // GradScaler sums one flag per device; the fused kernels skip only on exactly 1.
  auto p = torch::ones({4}).requires_grad_(true);
  perf::optim::AdamW opt({p}, perf::optim::AdamWOptions(0.1));
  p.mutable_grad() = torch::ones({4});
  opt.step_scaled(std::nullopt, torch::full({}, 2.0f));
  EXPECT_TRUE(torch::equal(p.detach(), torch::ones({4})));
}

// --------------------------------------------------------------------------- 3. learning-rate schedulers

namespace {

// Makes a scheduler on the optimizer and returns its step() (owning the scheduler): LibTorch's or perf's.
using SchedulerFactory = std::function<std::function<void()>(torch::optim::Optimizer&)>;

SchedulerFactory torch_step_lr() {
  return [](torch::optim::Optimizer& o) -> std::function<void()> {
    auto s = std::make_shared<torch::optim::StepLR>(o, /*step_size=*/3, /*gamma=*/0.5);
    return [s] { s->step(); };
  };
}

// 12 steps of an MLP under perf's AdamW and the scheduler, eagerly or through a TrainStep (graphed on CUDA);
// the rate after each step into `lrs`, the TrainStep's captures into `captures`, where given.
torch::Tensor train_with_scheduler(bool trainstep, torch::Device device, const SchedulerFactory& make_scheduler,
                                   std::vector<double>* lrs, int64_t* captures = nullptr) {
  torch::manual_seed(0);
  auto model = mlp();
  model->to(device);
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-2));
  const auto scheduler_step = make_scheduler(opt);
  auto loss_fn = [&](const torch::Tensor& x, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(model->forward(x), t);
  };
  const auto d = make_data(12, 16, device);
  std::optional<perf::TrainStep> step;
  if (trainstep) step.emplace(model, loss_fn, opt, d.xs[0], d.ts[0]);
  for (size_t i = 0; i < d.xs.size(); ++i) {
    if (step) {
      step->step(d.xs[i], d.ts[i]);
    } else {
      opt.zero_grad();
      loss_fn(d.xs[i], d.ts[i]).backward();
      opt.step();
    }
    scheduler_step();
    if (lrs) lrs->push_back(opt.param_groups()[0].options().get_lr());
  }
  if (step && captures) *captures = step->captures();
  return cat_params(*model);
}

}  // namespace

TEST(CudaPaths, SchedulerUnderTrainStepEqualsTheEagerLoop) {
  std::vector<double> lrs;
  const auto eager = train_with_scheduler(false, torch::kCPU, torch_step_lr(), &lrs);
  const auto stepped = train_with_scheduler(true, torch::kCPU, torch_step_lr(), nullptr);
  EXPECT_TRUE(torch::equal(eager, stepped));
  EXPECT_DOUBLE_EQ(lrs.back(), 1e-2 / 8) << "the scheduler did change the lr";
  // A frozen lr would train differently: the same loop without the scheduler.
  torch::manual_seed(0);
  auto model = mlp();
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-2));
  const auto d = make_data(12, 16, torch::kCPU);
  for (size_t i = 0; i < d.xs.size(); ++i) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(d.xs[i]), d.ts[i]).backward();
    opt.step();
  }
  EXPECT_FALSE(torch::equal(cat_params(*model), eager));
}

// --------------------------------------------------------------------------- 4. autocast cache

TEST(CudaPaths, GraphConstructionRunsWithTheAutocastCacheOff) {
  std::vector<bool> cache_seen;
  auto fn = [&](const torch::Tensor& x) {
    cache_seen.push_back(at::autocast::is_autocast_cache_enabled());
    return x * 2;
  };
  {
    perf::Autocast ac(torch::kCPU);
    ASSERT_TRUE(at::autocast::is_autocast_cache_enabled());
    auto g = perf::graph(fn, torch::ones({4}));
    EXPECT_TRUE(at::autocast::is_autocast_cache_enabled()) << "restored after construction";
  }
  ASSERT_FALSE(cache_seen.empty());
  for (bool c : cache_seen) EXPECT_FALSE(c) << "cached casts would be baked into the graph";
}

// --------------------------------------------------------------------------- 7. exception types

TEST(CudaPaths, ErrorsKeepTheirTypeWithPerfContext) {
  auto oom = [](const torch::Tensor& x) -> torch::Tensor {
    if (x.size(0) > 4) TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (simulated)");
    return x + 1;
  };
  try {
    perf::graph(oom, torch::ones({8}));
    ADD_FAILURE() << "expected an OutOfMemoryError";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("simulated"), std::string::npos) << what;
    EXPECT_NE(what.find("perf::graph"), std::string::npos) << what;
  }
  // find_max_batch_size sees the OOM through perf::graph and bisects.
  const int64_t best = perf::find_max_batch_size([&](int64_t b) { perf::graph(oom, torch::ones({b})); }, 1, 64);
  EXPECT_EQ(best, 4);
  // A loss function that cannot run on the example fails at construction, named.
  auto model = mlp();
  perf::optim::SGD opt(model->parameters(), perf::optim::SGDOptions(0.1));
  PERF_EXPECT_THROW_MSG(perf::TrainStep(
                            model,
                            [&](const torch::Tensor& x, const torch::Tensor& t) {
                              return torch::nn::functional::cross_entropy(model->forward(x), t);
                            },
                            opt, torch::randn({4, 16}), torch::randn({4, 3})),
                        "the loss function failed on the example batch");
}

// --------------------------------------------------------------------------- 8. channels-last with state

TEST(CudaPaths, ChannelsLastConvertsOptimizerStateToo) {
  torch::manual_seed(0);
  auto conv = torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3));
  auto twin = torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3));
  {
    torch::NoGradGuard ng;
    twin->weight.copy_(conv->weight);
    twin->bias.copy_(conv->bias);
  }
  perf::optim::Adam opt(conv->parameters(), perf::optim::AdamOptions(1e-2));
  perf::optim::Adam opt_twin(twin->parameters(), perf::optim::AdamOptions(1e-2));
  const auto x = torch::randn({2, 3, 8, 8});
  for (auto* pair : {&conv, &twin}) (*pair)->forward(x).sum().backward();
  opt.step();
  opt_twin.step();
  EXPECT_EQ(perf::to_channels_last(*conv, opt), 1);
  auto& st = static_cast<perf::optim::AdamParamState&>(*opt.state().at(conv->weight.unsafeGetTensorImpl()));
  EXPECT_TRUE(st.exp_avg().is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(st.exp_avg_sq().is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_FALSE(st.exp_avg().is_contiguous()) << "really converted";
  conv->zero_grad();
  twin->zero_grad();
  conv->forward(perf::channels_last(x)).sum().backward();
  twin->forward(x).sum().backward();
  opt.step();
  opt_twin.step();
  EXPECT_LE((conv->weight - twin->weight).abs().max().item<double>(), 1e-6);
  // torch::optim state converts too.
  torch::optim::SGD sgd(twin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  twin->forward(x).sum().backward();
  sgd.step();
  perf::to_channels_last(*twin, sgd);
  auto& buf = static_cast<torch::optim::SGDParamState&>(*sgd.state().at(twin->weight.unsafeGetTensorImpl()));
  EXPECT_TRUE(buf.momentum_buffer().is_contiguous(at::MemoryFormat::ChannelsLast));
}

// --------------------------------------------------------------------------- clip_grad_norm_

TEST(CudaPaths, ClipGradNormMatchesPythonWithoutASync) {
  const std::string out = test_util::python(
      "import torch, math\n"
      "for nt in (2.0, 1.0, 3.0, math.inf):\n"
      "  torch.manual_seed(0)\n"
      "  ps=[torch.nn.Parameter(torch.randn(s)) for s in [(5,3),(7,),(2,2,2)]]\n"
      "  for p in ps: p.grad=torch.randn(p.shape)*3\n"
      "  n=torch.nn.utils.clip_grad_norm_(ps, 1.5, norm_type=nt)\n"
      "  print(repr(n.item()), ' '.join(repr(x) for x in torch.cat([p.grad.flatten() for p in ps]).tolist()))\n"
      "torch.manual_seed(0)\n"  // float64 gradients beside float32 ones
      "ps=[torch.nn.Parameter(torch.randn(s, dtype=d)) for s, d in [((5,3),torch.float64),((7,),torch.float32)]]\n"
      "for p in ps: p.grad=torch.randn(p.shape, dtype=p.dtype)*3\n"
      "n=torch.nn.utils.clip_grad_norm_(ps, 1.5)\n"
      "print(repr(n.item()), ' '.join(repr(x) for p in ps for x in p.grad.flatten().tolist()))\n");
  const auto lines = test_util::lines(out);
  ASSERT_EQ(lines.size(), 5u);
  const double types[] = {2.0, 1.0, 3.0, std::numeric_limits<double>::infinity()};
  for (size_t k = 0; k < 4; ++k) {
    torch::manual_seed(0);
    std::vector<torch::Tensor> ps;
    for (const auto& s : std::vector<std::vector<int64_t>>{{5, 3}, {7}, {2, 2, 2}})
      ps.push_back(torch::randn(s).requires_grad_());
    for (auto& p : ps) p.mutable_grad() = torch::randn(p.sizes()) * 3;
    const auto norm = perf::clip_grad_norm_(ps, 1.5, types[k]);
    EXPECT_EQ(norm.dim(), 0);
    const auto v = test_util::parse_numbers(lines[k]);
    EXPECT_NEAR(norm.item<double>(), v[0], 1e-5) << "norm_type " << types[k];
    std::vector<torch::Tensor> g;
    g.reserve(ps.size());
    for (auto& p : ps) g.push_back(p.grad().flatten());
    const auto want = torch::tensor(std::vector<float>(v.begin() + 1, v.end()));
    EXPECT_LE((torch::cat(g) - want).abs().max().item<double>(), 1e-6) << "norm_type " << types[k];
  }
  {
    torch::manual_seed(0);
    std::vector<torch::Tensor> ps = {torch::randn({5, 3}, torch::kDouble).requires_grad_(),
                                     torch::randn({7}).requires_grad_()};
    for (auto& p : ps) p.mutable_grad() = torch::randn(p.sizes(), p.options()) * 3;
    const auto norm = perf::clip_grad_norm_(ps, 1.5);
    EXPECT_EQ(norm.scalar_type(), torch::kDouble) << "promoted, as Python's stack() does";
    const auto v = test_util::parse_numbers(lines[4]);
    EXPECT_NEAR(norm.item<double>(), v[0], 1e-12);
    const auto got = torch::cat({ps[0].grad().flatten(), ps[1].grad().flatten().to(torch::kDouble)});
    const auto want = torch::tensor(std::vector<double>(v.begin() + 1, v.end()), torch::kDouble);
    EXPECT_LE((got.narrow(0, 0, 15) - want.narrow(0, 0, 15)).abs().max().item<double>(), 1e-12) << "float64 grads";
    EXPECT_LE((got.narrow(0, 15, 7) - want.narrow(0, 15, 7)).abs().max().item<double>(), 1e-6) << "float32 grads";
  }
  PERF_EXPECT_THROW_MSG(perf::clip_grad_norm_({}, -1.0), "max_norm must be >= 0");
  EXPECT_EQ(perf::clip_grad_norm_({torch::ones({2})}, 1.0).item<float>(), 0.f) << "no gradients: norm 0";
}

TEST(CudaPaths, ClipGradNormWithErrorIfNonfiniteThrowsBeforeScalingAnyGradient) {
  std::vector<torch::Tensor> ps = {torch::zeros({3}).requires_grad_(), torch::zeros({2}).requires_grad_()};
  const auto finite = torch::tensor({3.f, 0.f, 4.f}), other = torch::tensor({1.f, 2.f});
  const float bad[] = {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  for (float v : bad) {
    ps[0].mutable_grad() = finite.clone();
    ps[1].mutable_grad() = torch::tensor({v, 2.f});
    PERF_EXPECT_THROW_MSG(perf::clip_grad_norm_(ps, 1.0, 2.0, /*error_if_nonfinite=*/true),
                          "perf::clip_grad_norm_: The total norm of order 2 for gradients from `parameters` is "
                          "non-finite, so it cannot be clipped. To disable this error and scale the gradients with "
                          "the non-finite norm anyway, set `error_if_nonfinite=false`");
    EXPECT_TRUE(ps[0].grad().equal(finite)) << "a gradient was scaled before the error";
    // LibTorch's own says the same.
    PERF_EXPECT_THROW_MSG(torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{ps[1]}, 1.0, 2.0, true),
                          "is non-finite, so it cannot be clipped");
    // Without the check, as before: every gradient scaled by the non-finite norm.
    EXPECT_FALSE(std::isfinite(perf::clip_grad_norm_(ps, 1.0).item<double>()));
  }
  ps[0].mutable_grad() = finite.clone();
  ps[1].mutable_grad() = other.clone();
  const auto norm = perf::clip_grad_norm_(ps, 1.0, 2.0, true);
  const double want = std::sqrt(9.0 + 16.0 + 1.0 + 4.0);
  EXPECT_NEAR(norm.item<double>(), want, 1e-6);
  EXPECT_LE((ps[1].grad() - other / (want + 1e-6)).abs().max().item<double>(), 1e-7);
}

TEST(CudaPaths, ClipGradNormAfterGradScalerUnscale) {
  torch::manual_seed(0);
  auto a = mlp(), b = mlp();
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  perf::optim::SGD oa(a->parameters(), perf::optim::SGDOptions(0.1)), ob(b->parameters(), perf::optim::SGDOptions(0.1));
  perf::GradScaler scaler(perf::GradScalerOptions().init_scale(1024));
  const auto x = torch::randn({8, 16});
  scaler.scale(a->forward(x).pow(2).sum()).backward();
  scaler.unscale_(oa);
  const auto na = perf::clip_grad_norm_(a->parameters(), 0.5);
  scaler.step(oa);
  scaler.update();
  b->forward(x).pow(2).sum().backward();
  const double nb = torch::nn::utils::clip_grad_norm_(b->parameters(), 0.5);
  ob.step();
  EXPECT_NEAR(na.item<double>(), nb, 1e-3 * nb);
  EXPECT_LE((cat_params(*a) - cat_params(*b)).abs().max().item<double>(), 1e-6);
}

// --------------------------------------------------------------------------- TrainStep: batches, accumulation

TEST(CudaPaths, TrainStepWithAccumulationAndClippingEqualsTheEagerLoop) {
  auto run = [](bool trainstep) {
    torch::manual_seed(0);
    auto model = mlp();
    perf::optim::SGD opt(model->parameters(), perf::optim::SGDOptions(0.1).momentum(0.9));
    // Three batch tensors: input, target, per-sample weight.
    auto loss_fn = [&](const std::vector<torch::Tensor>& b) {
      auto per = torch::nn::functional::cross_entropy(
          model->forward(b[0]), b[1], torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
      return (per * b[2]).mean();
    };
    torch::manual_seed(1);
    std::vector<std::vector<torch::Tensor>> batches;
    // Ten full batches, then an epoch's last batches that 4 does not divide: 7 rows (micro-batches of 2, 2, 2
    // and 1) and 3 rows (fewer rows than micro-batches).
    for (int64_t n : {16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 7, 3}) {
      auto x = torch::randn({n, 16});
      batches.push_back({x, x.narrow(1, 0, 4).argmax(1), torch::rand({n})});
    }
    std::vector<float> losses;
    std::vector<double> norms;  // before clipping: TrainStep::grad_norm(), LibTorch's clip_grad_norm_'s result
    if (trainstep) {
      perf::TrainStep step(model, loss_fn, opt, batches[0],
                           perf::TrainStepOptions().accumulation_steps(4).max_grad_norm(0.25));
      PERF_EXPECT_THROW_MSG(step.grad_norm(), "grad_norm() before the first step()");
      torch::Tensor first_norm;
      for (auto& b : batches) {
        losses.push_back(step.step(b).item<float>());
        norms.push_back(step.grad_norm().item<double>());
        if (!first_norm.defined()) first_norm = step.grad_norm();
      }
      EXPECT_EQ(step.eager_steps(), 2);
      EXPECT_EQ(first_norm.item<double>(), norms[0]) << "the caller's copy, which later steps leave alone";
    } else {
      for (auto& b : batches) {
        opt.zero_grad();
        torch::Tensor total;
        if (b[0].size(0) % 4 != 0) {  // a partial batch trains as its whole batch's mean loss
          total = loss_fn(b);
          total.backward();
          norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), 0.25));
          opt.step();
          losses.push_back(total.item<float>());
          continue;
        }
        for (int k = 0; k < 4; ++k) {
          std::vector<torch::Tensor> micro;
          micro.reserve(b.size());
          for (auto& t : b) micro.push_back(t.chunk(4, 0)[static_cast<size_t>(k)]);
          auto part = loss_fn(micro) / 4.0;
          part.backward();
          total = total.defined() ? total + part.detach() : part.detach();
        }
        norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), 0.25));
        opt.step();
        losses.push_back(total.item<float>());
      }
    }
    return std::make_tuple(losses, cat_params(*model), norms);
  };
  const auto [eager_losses, eager_params, eager_norms] = run(false);
  const auto [losses, params, norms] = run(true);
  ASSERT_EQ(eager_losses.size(), losses.size());
  ASSERT_EQ(eager_norms.size(), norms.size());
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(eager_losses[i], losses[i], 1e-6) << i;
    EXPECT_NEAR(eager_norms[i], norms[i], 1e-5 * eager_norms[i]) << i;
  }
  EXPECT_GE(std::count_if(norms.begin(), norms.end(), [](double n) { return n > 0.25; }), 3)
      << "steps that clipped, whose norms are from before the clipping";
  EXPECT_LE((eager_params - params).abs().max().item<double>(), 1e-6);
  auto model = mlp();
  perf::optim::SGD opt(model->parameters(), perf::optim::SGDOptions(0.1));
  {
    perf::TrainStep unclipped(
        model, [&](const std::vector<torch::Tensor>& b) { return model->forward(b[0]).sum(); }, opt,
        std::vector<torch::Tensor>{torch::randn({8, 16})});
    PERF_EXPECT_THROW_MSG(unclipped.grad_norm(),
                          "perf::TrainStep::grad_norm: the step computes the gradient norm only where it clips; set "
                          "perf::TrainStepOptions().max_grad_norm(x) (infinity measures it without clipping)");
  }
  PERF_EXPECT_THROW_MSG(
      perf::TrainStep(
          model, [&](const std::vector<torch::Tensor>& b) { return model->forward(b[0]).sum(); }, opt,
          std::vector<torch::Tensor>{torch::randn({6, 16})}, perf::TrainStepOptions().accumulation_steps(4)),
      "divisible by 4");
}

// --------------------------------------------------------------------------- GPU: the programs a user runs

namespace {

struct TensorDataset : torch::data::datasets::Dataset<TensorDataset> {
  torch::Tensor x, t;
  TensorDataset(int64_t n) : x(torch::randn({n, 16})), t(torch::randint(0, 4, {n})) {}
  torch::data::Example<> get(size_t i) override { return {x[static_cast<int64_t>(i)], t[static_cast<int64_t>(i)]}; }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
};

int64_t cuda_allocated() { return perf::memory_stats(torch::Device(torch::kCUDA, 0)).allocated.value_or(-1); }

}  // namespace

TEST(CudaPaths, OnGpuAFailedCaptureLeavesTheProcessHealthy) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  auto bad = [](const torch::Tensor& t) {
    if (t.sum().item<float>() > 1e30f) return t * 2;  // host sync inside the captured region
    return t + 1;
  };
  const auto x = torch::ones({8}, torch::kCUDA);
  // Found before capture, by the checked warm-up call.
  PERF_EXPECT_THROW_MSG(perf::graph(bad, x), "host-device sync");
  // A real failed capture (the check off): the generator and allocator must be put back.
  PERF_EXPECT_THROW_MSG(perf::graph(bad, x, perf::GraphOptions().check_syncs(false)), "CUDA graph capture failed");
  // clip_grad_norm_'s error_if_nonfinite reads the norm on the host: refused in the capture, before its sync.
  auto w = torch::ones({4}, torch::kCUDA).requires_grad_();
  w.mutable_grad() = torch::ones({4}, torch::kCUDA);
  auto clipped = [&](const torch::Tensor& t) {
    perf::clip_grad_norm_({w}, 1.0, 2.0, /*error_if_nonfinite=*/true);
    return t + 1;
  };
  PERF_EXPECT_THROW_MSG(perf::graph(clipped, x, perf::GraphOptions().check_syncs(false)),
                        "error_if_nonfinite=true reads the norm on the host, which a CUDA graph capture cannot do");
  auto fallback = perf::graph(bad, x, perf::GraphOptions().check_syncs(false).eager_fallback(true));
  EXPECT_FALSE(fallback.graphed());
  EXPECT_TRUE(torch::equal(fallback(x), x + 1));
  // RNG ops work ("Offset increment outside graph capture" before the fix).
  const auto d = torch::dropout(torch::ones({1024}, torch::kCUDA), 0.5, true);
  EXPECT_GT(d.sum().item<float>(), 0.f);
  EXPECT_NO_THROW(torch::randn({16}, torch::kCUDA));
  // Cross-stream frees are reclaimed again: 50 prefetched batches, memory back to its level.
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      TensorDataset(int64_t{50} * 64).map(torch::data::transforms::Stack<>()), perf::loader_options(64));
  torch::cuda::synchronize();
  const int64_t base = cuda_allocated();
  int64_t n = 0;
  {
    auto prefetcher = perf::prefetch(*loader, torch::kCUDA);
    for (auto& batch : prefetcher) {
      n += batch.data.size(0);
      (void)batch.data.sum();
    }
    EXPECT_LE(prefetcher.events_created(), 4u) << "events come from a small pool, not one per batch";
  }
  torch::cuda::synchronize();
  EXPECT_EQ(n, 50 * 64);
  EXPECT_LE(cuda_allocated(), base + (1 << 20)) << "prefetched batches were not reclaimed";
  // And a capture still works afterwards, replaying dropout with fresh masks.
  auto drop = perf::graph([](const torch::Tensor& t) { return torch::dropout(t, 0.5, true); },
                          torch::ones({1024}, torch::kCUDA));
  EXPECT_TRUE(drop.graphed());
  const auto m1 = drop(torch::ones({1024}, torch::kCUDA)).clone();
  EXPECT_FALSE(torch::equal(m1, drop(torch::ones({1024}, torch::kCUDA))));
}

#if PERF_WITH_CUDA
namespace {

// Whether the calling thread's current stream is capturing a CUDA graph (autograd's device threads run a
// captured backward on the capturing stream too).
bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream().stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

// Twice the device's memory: an allocation of that many bytes fails in cudaMalloc, a real out-of-memory error of
// the caching allocator (which frees none of its cached blocks while a capture is under way).
int64_t twice_the_device_memory() {
  size_t free_bytes = 0, total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return 2 * static_cast<int64_t>(total_bytes);
}

void allocate_bytes(int64_t n) { (void)torch::empty({n}, torch::dtype(torch::kUInt8).device(torch::kCUDA)); }

// A model in two parts, so a loss can hook the activation between them.
struct TwoPart : torch::nn::Module {
  torch::nn::Sequential first{torch::nn::Linear(16, 64)};
  torch::nn::Sequential rest{torch::nn::ReLU(), torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 4)};
  TwoPart() {
    register_module("first", first);
    register_module("rest", rest);
  }
};

}  // namespace
#endif

// Out of memory inside the capture, the warm-up having passed: what a step whose working set fits once but not
// twice meets (the capture's private pool cannot reuse the blocks the warm-up cached). The error is the
// allocator's own c10::OutOfMemoryError with perf's context, so perf::find_max_batch_size sees it; the process
// stays healthy; eager_fallback runs the function eagerly.
TEST(CudaPaths, OnGpuOutOfMemoryInACaptureStaysAnOutOfMemoryErrorAndLeavesTheProcessHealthy) {
#if PERF_WITH_CUDA
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const int64_t huge = twice_the_device_memory();
  int calls = 0;
  auto greedy = [&](const torch::Tensor& t) {
    ++calls;
    auto out = t * 2;  // allocated in the graph's pool before the failure
    if (capturing()) allocate_bytes(huge);
    return out + 1;
  };
  const auto x = torch::ones({1024}, torch::kCUDA);
  torch::cuda::synchronize();
  const int64_t base = cuda_allocated();
  try {
    perf::graph(greedy, x);
    ADD_FAILURE() << "expected an OutOfMemoryError from the capture";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("perf::graph: CUDA graph capture failed"), std::string::npos) << what;
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
  }
  EXPECT_GE(calls, 2) << "the warm-up calls ran before the capture";
  EXPECT_FALSE(capturing());
  torch::cuda::synchronize();
  EXPECT_LE(cuda_allocated(), base + (1 << 20)) << "the failed capture's allocations were not given back";
  // find_max_batch_size bisects over real out-of-memory errors raised inside captures.
  const int64_t ok_up_to = 6;
  const int64_t best = perf::find_max_batch_size(
      [&](int64_t b) {
        perf::graph(
            [&](const torch::Tensor& t) {
              if (b > ok_up_to && capturing()) allocate_bytes(huge);
              return t + 1;
            },
            torch::ones({b}, torch::kCUDA));
      },
      1, 64, perf::FindBatchOptions().log(nullptr));
  EXPECT_EQ(best, ok_up_to);
  // eager_fallback(true): a warning, then eager calls with the right values.
  auto fallback = perf::graph(greedy, x, perf::GraphOptions().eager_fallback(true));
  EXPECT_FALSE(fallback.graphed());
  EXPECT_TRUE(torch::equal(fallback(x), x * 2 + 1));
  // Healthy: random numbers, and a capture replaying dropout with fresh masks.
  EXPECT_NO_THROW(torch::randn({16}, torch::kCUDA));
  auto drop = perf::graph([](const torch::Tensor& t) { return torch::dropout(t, 0.5, true); },
                          torch::ones({1024}, torch::kCUDA));
  EXPECT_TRUE(drop.graphed());
  const auto m1 = drop(torch::ones({1024}, torch::kCUDA)).clone();
  EXPECT_FALSE(torch::equal(m1, drop(torch::ones({1024}, torch::kCUDA))));
  EXPECT_TRUE(torch::equal(fallback(x), x * 2 + 1));
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

// Out of memory in the captured backward of a TrainStep, after the last layers' gradients were allocated in the
// graph's pool (backward runs from the output): kernels that never ran. The constructor throws the allocator's
// error, and leaves no parameter holding such a gradient (none without flat, zeros in flat mode), nor any other
// trace: a TrainStep built afterwards trains exactly as one on a twin model that never failed.
TEST(CudaPaths, OnGpuOutOfMemoryInATrainStepCaptureLeavesNoUncomputedGradients) {
#if PERF_WITH_CUDA
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const int64_t huge = twice_the_device_memory();
  const auto data = make_data(6, 32, torch::kCUDA);
  for (const bool flat : {false, true}) {
    SCOPED_TRACE(flat ? "flat" : "not flat");
    auto make = [] {
      torch::manual_seed(0);
      auto m = std::make_shared<TwoPart>();
      m->to(torch::kCUDA);
      return m;
    };
    auto model = make(), twin = make();
    perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-2).flat(flat));
    perf::optim::AdamW twin_opt(twin->parameters(), perf::optim::AdamWOptions(1e-2).flat(flat));
    bool fail = true;
    auto loss_of = [&fail, huge](TwoPart& m) {
      return [&m, &fail, huge](const torch::Tensor& x, const torch::Tensor& t) {
        auto h = m.first->forward(x);
        if (fail) {
          h.register_hook([huge](const torch::Tensor& g) {
            if (capturing()) allocate_bytes(huge);
            return g;
          });
        }
        return torch::nn::functional::cross_entropy(m.rest->forward(h), t);
      };
    };
    try {
      perf::TrainStep failed(model, loss_of(*model), opt, data.xs[0], data.ts[0]);
      ADD_FAILURE() << "expected an OutOfMemoryError from the capture";
    } catch (const c10::OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("perf::TrainStep: CUDA graph capture failed"),
                std::string::npos)
          << e.what_without_backtrace();
    }
    EXPECT_FALSE(capturing());
    for (const auto& p : model->named_parameters()) {
      if (flat) {
        ASSERT_TRUE(p.value().grad().defined()) << p.key() << ": a flat gradient stays a view of the buffer";
        EXPECT_EQ(p.value().grad().abs().max().item<float>(), 0.f) << p.key();
      } else {
        EXPECT_FALSE(p.value().grad().defined()) << p.key() << " kept a gradient the failed capture allocated";
      }
    }
    fail = false;
    perf::TrainStep step(model, loss_of(*model), opt, data.xs[0], data.ts[0]);
    perf::TrainStep twin_step(twin, loss_of(*twin), twin_opt, data.xs[0], data.ts[0]);
    ASSERT_TRUE(step.graphed());
    for (size_t i = 0; i < data.xs.size(); ++i) {
      const float a = step.step(data.xs[i], data.ts[i]).item<float>();
      const float b = twin_step.step(data.xs[i], data.ts[i]).item<float>();
      EXPECT_NEAR(a, b, 1e-6) << "step " << i;
    }
    EXPECT_LE((cat_params(*model) - cat_params(*twin)).abs().max().item<float>(), 1e-6f);
  }
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

namespace {

// After each step(), every parameter's .grad() is that step's gradients, as after an eager backward, whatever the
// program did between steps: the optimizer's zero_grad() or the model's out of an eager loop's habit, an epoch's
// last batch trained eagerly. Compared with a twin trained by an eager TrainStep (graph(false)) on the same batches.
// Graphed, the replays write the tensors the capture allocated: TrainStep puts them back; before the first step they
// are as zero_grad() leaves them, not the capture's uncomputed ones.
void expect_each_steps_gradients(torch::Device device) {
  const auto data = make_data(6, 32, device);
  for (const bool flat : {false, true}) {
    SCOPED_TRACE(flat ? "flat" : "not flat");
    auto make = [device] {
      torch::manual_seed(0);
      auto m = mlp();
      m->to(device);
      return m;
    };
    auto model = make(), twin = make();
    // The optimizer holds all but the last bias, which still requires grad: its gradient accumulates over steps,
    // as LibTorch's autograd accumulates it, until a zero_grad() of the model sets it to none.
    auto held = [](torch::nn::Sequential& m) {
      auto ps = m->parameters();
      ps.pop_back();
      return ps;
    };
    perf::optim::AdamW opt(held(model), perf::optim::AdamWOptions(1e-2).flat(flat));
    perf::optim::AdamW twin_opt(held(twin), perf::optim::AdamWOptions(1e-2).flat(flat));
    auto loss_of = [](torch::nn::Sequential m) {
      return [m](const torch::Tensor& x, const torch::Tensor& t) mutable {
        return torch::nn::functional::cross_entropy(m->forward(x), t);
      };
    };
    // max_grad_norm(infinity): grad_norm() measured without clipping, checked against the gradients read back.
    const auto measure = perf::TrainStepOptions().max_grad_norm(std::numeric_limits<double>::infinity());
    perf::TrainStep step(model, loss_of(model), opt, data.xs[0], data.ts[0], measure);
    perf::TrainStep twin_step(twin, loss_of(twin), twin_opt, data.xs[0], data.ts[0],
                              perf::TrainStepOptions(measure).graph(false));
    ASSERT_EQ(step.graphed(), device.is_cuda());
    ASSERT_FALSE(twin_step.graphed());
    if (step.graphed()) {
      const auto ps = model->named_parameters();
      for (size_t i = 0; i < ps.size(); ++i) {
        if (flat && i + 1 < ps.size()) {
          ASSERT_TRUE(ps[i].value().grad().defined()) << ps[i].key() << ": a flat gradient stays a view of the buffer";
          EXPECT_EQ(ps[i].value().grad().abs().max().item<float>(), 0.f) << ps[i].key() << " before the first step";
        } else {
          EXPECT_FALSE(ps[i].value().grad().defined()) << ps[i].key() << " before the first step";
        }
      }
    }
    auto expect_same = [&](const std::string& when) {
      const auto a = model->named_parameters(), b = twin->named_parameters();
      for (size_t i = 0; i < a.size(); ++i) {
        const auto &ga = a[i].value().grad(), &gb = b[i].value().grad();
        ASSERT_TRUE(ga.defined()) << when << ": " << a[i].key() << " has no gradient";
        ASSERT_TRUE(gb.defined()) << when << ": the twin's " << b[i].key() << " has no gradient";
        EXPECT_LE((ga - gb).abs().max().item<float>(), 1e-5f) << when << ": " << a[i].key();
      }
      EXPECT_LE((cat_params(*model) - cat_params(*twin)).abs().max().item<float>(), 1e-5f) << when;
      std::vector<torch::Tensor> grads;  // the optimizer's parameters', which the step clips
      for (const auto& p : held(model)) grads.push_back(p.grad().flatten());
      const double norm = torch::cat(grads).norm().item<double>();
      EXPECT_NEAR(step.grad_norm().item<double>(), norm, 1e-5 * norm) << when << ": grad_norm()";
      EXPECT_NEAR(twin_step.grad_norm().item<double>(), norm, 1e-5 * norm) << when << ": the twin's grad_norm()";
    };
    auto both = [&](const torch::Tensor& x, const torch::Tensor& t) {
      const float a = step.step(x, t).item<float>();
      const float b = twin_step.step(x, t).item<float>();
      EXPECT_NEAR(a, b, 1e-5);
    };
    both(data.xs[0], data.ts[0]);
    expect_same("after the first step");
    opt.zero_grad();
    twin_opt.zero_grad();
    both(data.xs[1], data.ts[1]);
    expect_same("after the optimizer's zero_grad() between steps");
    model->zero_grad();
    twin->zero_grad();
    both(data.xs[2], data.ts[2]);
    expect_same("after the model's zero_grad() between steps");
    both(data.xs[3].narrow(0, 0, 20), data.ts[3].narrow(0, 0, 20));
    EXPECT_EQ(step.eager_steps(), 1);
    expect_same("after an epoch's last, smaller batch");
    both(data.xs[4], data.ts[4]);
    expect_same("after a full batch following the smaller one");
    const auto first_grad = model->parameters()[0].grad();
    both(data.xs[5], data.ts[5]);
    expect_same("after the last step");
    if (step.graphed()) {
      EXPECT_TRUE(first_grad.is_same(model->parameters()[0].grad())) << "a replay writes the same gradient tensors";
    }
  }
}

}  // namespace

TEST(CudaPaths, TrainStepLeavesEachStepsGradientsWhateverTheProgramDidBetweenSteps) {
  expect_each_steps_gradients(torch::kCPU);
}

TEST(CudaPaths, OnGpuAfterEachGraphedStepTheGradientsAreThatStepsWhateverTheProgramDidBetweenSteps) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  expect_each_steps_gradients(torch::kCUDA);
}

namespace {

// A loss function returning {loss, outputs...}: after each step, outputs() are that step's (the logits and each
// sample's correctness, from the step's own forward), equal to a forward of the same weights before the step;
// with accumulation_steps(4) the micro-batches' concatenated, an epoch's smaller last batches (7 and 3 rows)
// included. Graphed, the caller's copies of the graph's, which later replays leave alone.
void expect_each_steps_outputs(torch::Device device) {
  torch::manual_seed(0);
  auto model = mlp();
  model->to(device);
  perf::optim::SGD opt(model->parameters(), perf::optim::SGDOptions(0.1).momentum(0.9));
  torch::manual_seed(1);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int64_t n : {16, 16, 16, 7, 16, 3, 16}) {
    auto x = torch::randn({n, 16}).to(device);
    batches.emplace_back(x, x.narrow(1, 0, 4).argmax(1));
  }
  perf::TrainStep step(
      model,
      [&](const std::vector<torch::Tensor>& b) -> std::vector<torch::Tensor> {
        auto logits = model->forward(b[0]);
        return {torch::nn::functional::cross_entropy(logits, b[1]), logits, logits.argmax(1) == b[1]};
      },
      opt, std::vector<torch::Tensor>{batches[0].first, batches[0].second},
      perf::TrainStepOptions().accumulation_steps(4));
  ASSERT_EQ(step.graphed(), device.is_cuda());
  PERF_EXPECT_THROW_MSG(step.outputs(), "perf::TrainStep: outputs() before the first step()");
  std::vector<torch::Tensor> first;
  for (size_t i = 0; i < batches.size(); ++i) {
    const auto& [x, t] = batches[i];
    torch::Tensor want;
    {
      // The weights the step trains from, on its micro-batches' shapes: the same kernels (with TF32 too, where
      // perf::setup() ran earlier in the process).
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> parts;
      for (const auto& piece : x.tensor_split(std::min<int64_t>(4, x.size(0)), 0))
        parts.push_back(model->forward(piece));
      want = torch::cat(parts);
    }
    step.step(x, t);
    const auto outs = step.outputs();
    ASSERT_EQ(outs.size(), 2u) << "step " << i;
    EXPECT_FALSE(outs[0].requires_grad()) << "step " << i << ": detached";
    ASSERT_EQ(outs[0].sizes(), want.sizes()) << "step " << i << ": the micro-batches' logits, concatenated";
    EXPECT_LE((outs[0] - want).abs().max().item<float>(), 1e-5f) << "step " << i;
    EXPECT_TRUE(torch::equal(outs[1], want.argmax(1) == t)) << "step " << i;
    if (i == 0) first = outs;
  }
  EXPECT_EQ(step.eager_steps(), 2);
  EXPECT_FALSE(torch::equal(first[0], step.outputs()[0])) << "the weights moved";
  torch::NoGradGuard no_grad;
  EXPECT_GT((first[0] - model->forward(batches[0].first)).abs().max().item<float>(), 1e-3f)
      << "the first step's outputs, kept, are still the first step's";
}

}  // namespace

TEST(CudaPaths, TrainStepGivesEachStepsOutputsWithoutASecondForward) {
  expect_each_steps_outputs(torch::kCPU);
  // Only the loss: no outputs. Outputs that cannot be concatenated over micro-batches: refused at construction.
  auto model = mlp();
  perf::optim::SGD opt(model->parameters(), perf::optim::SGDOptions(0.1));
  const std::vector<torch::Tensor> batch{torch::randn({8, 16}), torch::randint(0, 4, {8})};
  perf::TrainStep plain(
      model,
      [&](const std::vector<torch::Tensor>& b) {
        return torch::nn::functional::cross_entropy(model->forward(b[0]), b[1]);
      },
      opt, batch);
  plain.step({batch[0], batch[1]});  // a braced batch: the vector overload, not Example's
  EXPECT_TRUE(plain.outputs().empty());
  plain.step_eager({batch[0].narrow(0, 0, 5), batch[1].narrow(0, 0, 5)});
  EXPECT_TRUE(plain.outputs().empty());
  auto with = [&](int64_t k, bool sum) {
    return perf::TrainStep(
        model,
        [&, sum](const std::vector<torch::Tensor>& b) -> std::vector<torch::Tensor> {
          auto logits = model->forward(b[0]);
          auto correct = logits.argmax(1) == b[1];
          return {torch::nn::functional::cross_entropy(logits, b[1]), sum ? correct.sum() : correct};
        },
        opt, batch, perf::TrainStepOptions().accumulation_steps(k));
  };
  PERF_EXPECT_THROW_MSG(with(2, true),
                        "output 1 of the loss function (after the loss) is 0-dim, but with accumulation_steps(2) the "
                        "micro-batches' outputs are concatenated along dim 0");
  auto summed = with(1, true);
  summed.step(batch);
  EXPECT_EQ(summed.outputs().at(0).dim(), 0) << "without accumulation any output is kept as returned";
}

TEST(CudaPaths, OnGpuAGraphedStepGivesEachStepsOutputs) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  expect_each_steps_outputs(torch::kCUDA);
}

TEST(CudaPaths, OnGpuTrainStepFromTheFirstPrefetchedBatchWhileThePrefetcherRuns) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  torch::manual_seed(0);
  auto model = mlp(256);
  model->to(torch::kCUDA);
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));
  auto loss_fn = [&](const torch::Tensor& x, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(model->forward(x), t);
  };
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      TensorDataset(int64_t{40} * 64).map(torch::data::transforms::Stack<>()),
      perf::loader_options(64, perf::LoaderTuning().drop_last(true)));
  std::optional<perf::TrainStep> step;
  int64_t steps = 0;
  for (auto& batch : perf::prefetch(*loader, torch::kCUDA, perf::PrefetchOptions().depth(4))) {
    if (!step) step.emplace(model, loss_fn, opt, batch);  // the prefetcher keeps pinning meanwhile
    step->step(batch);
    ++steps;
  }
  EXPECT_TRUE(step->graphed());
  EXPECT_EQ(steps, 40);
  EXPECT_TRUE(torch::isfinite(cat_params(*model)).all().item<bool>());
}

TEST(CudaPaths, OnGpuSchedulerChangesTheReplayedLearningRate) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  std::vector<double> lrs;
  const auto eager = train_with_scheduler(false, torch::kCUDA, torch_step_lr(), &lrs);
  const auto graphed = train_with_scheduler(true, torch::kCUDA, torch_step_lr(), nullptr);
  EXPECT_LE((eager - graphed).abs().max().item<double>(), 1e-5);
}

// perf/lr_scheduler.h's schedulers under a graphed TrainStep: a warm-up and cosine schedule's rate reaches every
// replay with one capture; OneCycleLR's cycling of Adam's first beta (a constant of the captured fused kernel)
// makes TrainStep capture again after each step. Both train as the eager loop does.
TEST(CudaPaths, OnGpuPerfSchedulersUnderAGraphedTrainStepTrainAsTheEagerLoop) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  for (const bool cycle : {false, true}) {
    SCOPED_TRACE(cycle ? "OneCycleLR, cycling beta1" : "SequentialLR(LinearLR, CosineAnnealingLR)");
    const SchedulerFactory make = [cycle](torch::optim::Optimizer& opt) -> std::function<void()> {
      std::shared_ptr<perf::optim::LRScheduler> sched;
      if (cycle) {
        sched = std::make_shared<perf::optim::OneCycleLR>(opt, perf::optim::OneCycleLROptions(2e-2, 12));
      } else {
        std::vector<std::shared_ptr<perf::optim::LRScheduler>> parts{
            std::make_shared<perf::optim::LinearLR>(opt, 0.1, 1.0, 4),
            std::make_shared<perf::optim::CosineAnnealingLR>(opt, 8, 1e-4)};
        sched = std::make_shared<perf::optim::SequentialLR>(opt, parts, std::vector<int64_t>{4});
      }
      return [sched] { sched->step(); };
    };
    int64_t captures = 0;
    const auto eager = train_with_scheduler(false, torch::kCUDA, make, nullptr);
    const auto graphed = train_with_scheduler(true, torch::kCUDA, make, nullptr, &captures);
    EXPECT_LE((eager - graphed).abs().max().item<double>(), 1e-5);
    if (cycle) {
      EXPECT_GE(captures, 11) << "beta1 changed after every step: captured again each time";
    } else {
      EXPECT_EQ(captures, 1) << "a changing rate alone needs no new capture";
    }
  }
}

// An EMA of a CUDA model trained by a flat(true) optimizer: one lerp over the flat buffer per update, no host
// sync (Python's AveragedModel reads n_averaged back each update), the numbers of the same average on the CPU.
TEST(CudaPaths, OnGpuAnEmaOfAFlatModelIsOneLerpWithoutASync) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
#if PERF_WITH_CUDA
  namespace po = perf::optim;
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::BatchNorm1d(32), torch::nn::ReLU(),
                                     torch::nn::Linear(32, 4));
  model->to(torch::kCUDA);
  po::AdamW opt(model->parameters(), po::AdamWOptions(1e-2).flat(true));
  const auto options = po::AveragedModelOptions().multi_avg_fn(po::get_ema_multi_avg_fn(0.9)).use_buffers(true);
  po::AveragedModel ema(model, options);
  auto host = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::BatchNorm1d(32), torch::nn::ReLU(),
                                    torch::nn::Linear(32, 4));
  po::AveragedModel reference(host, options);  // the same updates, on the CPU, through the multi-tensor lerp
  for (int k = 0; k < 6; ++k) {
    const auto x = torch::randn({64, 16}, torch::kCUDA);
    opt.zero_grad();
    model->forward(x).square().mean().backward();
    opt.step();
    {
      perf::detail::SyncDebugGuard no_sync(c10::cuda::SyncDebugMode::L_ERROR);
      EXPECT_NO_THROW(ema->update_parameters(model)) << "update " << k << " synced with the host";
    }
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < host->parameters().size(); ++i) host->parameters()[i].copy_(model->parameters()[i]);
    for (std::size_t i = 0; i < host->buffers().size(); ++i) host->buffers()[i].copy_(model->buffers()[i]);
    reference->update_parameters(host);
  }
  EXPECT_EQ(ema->packed_spans(), 1) << "the flat buffer's parameters in one lerp";
  EXPECT_EQ(reference->packed_spans(), 0);
  EXPECT_EQ(ema->n_averaged(), 6);
  const auto a = ema->module()->named_parameters(), b = reference->module()->named_parameters();
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_LE((a[i].value().cpu() - b[i].value()).abs().max().item<double>(), 1e-6) << a[i].key();
  const auto ab = ema->module()->named_buffers(), bb = reference->module()->named_buffers();
  for (std::size_t i = 0; i < ab.size(); ++i)
    EXPECT_LE((ab[i].value().cpu().to(at::kDouble) - bb[i].value().to(at::kDouble)).abs().max().item<double>(), 1e-6)
        << ab[i].key();
#endif
}

TEST(CudaPaths, OnGpuCaptureInsideAutocastSeesUpdatedWeights) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  torch::manual_seed(0);
  auto lin = torch::nn::Linear(64, 64);
  lin->to(torch::kCUDA);
  const auto x = torch::randn({8, 64}, torch::kCUDA);
  perf::Autocast ac(torch::kCUDA, torch::kHalf);  // outer region, cache on
  auto g = perf::graph(lin, x);
  {
    torch::NoGradGuard ng;
    lin->weight.mul_(2);  // a weight update after capture
  }
  torch::NoGradGuard ng;
  const auto want = lin->forward(x);
  EXPECT_LE((g(x).to(torch::kFloat) - want.to(torch::kFloat)).abs().max().item<double>(), 1e-2)
      << "a cached fp16 copy of the old weight was baked into the graph";
}

TEST(CudaPaths, OnGpuResumedCheckpointFirstStepEqualsEager) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const auto path = std::filesystem::temp_directory_path() / "perf_resume_test.pt";
  const auto d = make_data(6, 16, torch::kCUDA);
  auto make = [] {
    torch::manual_seed(0);
    auto m = mlp();
    m->push_back(torch::nn::BatchNorm1d(4));
    m->to(torch::kCUDA);
    return m;
  };
  auto loss_of = [](torch::nn::Sequential& m) {
    return [&m](const torch::Tensor& x, const torch::Tensor& t) {
      return torch::nn::functional::cross_entropy(m->forward(x), t);
    };
  };
  {  // train a little and save, as a resumed run's earlier process did
    auto m = make();
    perf::optim::Adam opt(m->parameters(), perf::optim::AdamOptions(1e-2));
    for (size_t i = 0; i < 3; ++i) {
      opt.zero_grad();
      loss_of(m)(d.xs[i], d.ts[i]).backward();
      opt.step();
    }
    torch::save(m, (path.string() + ".model"));
    torch::save(opt, path.string());
  }
  auto resume = [&](bool trainstep) {
    auto m = make();
    torch::load(m, path.string() + ".model");
    perf::optim::Adam opt(m->parameters(), perf::optim::AdamOptions(1e-2));
    torch::load(opt, path.string());
    if (trainstep) {
      perf::TrainStep step(m, loss_of(m), opt, d.xs[3], d.ts[3]);
      EXPECT_TRUE(step.graphed());
      step.step(d.xs[3], d.ts[3]);
    } else {
      opt.zero_grad();
      loss_of(m)(d.xs[3], d.ts[3]).backward();
      opt.step();
    }
    std::vector<torch::Tensor> all = flat_params(*m);
    for (auto& b : m->buffers()) all.push_back(b.detach().cpu().flatten().to(torch::kFloat));
    return torch::cat(all);
  };
  EXPECT_LE((resume(true) - resume(false)).abs().max().item<double>(), 1e-5)
      << "warm-up changed the resumed parameters, Adam moments, step counts or BatchNorm statistics";
}

TEST(CudaPaths, OnGpuChannelsLastFusedAdamWithLiveState) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  auto conv = torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3));
  conv->to(torch::kCUDA);
  perf::optim::Adam opt(conv->parameters(), perf::optim::AdamOptions(1e-2));
  const auto x = torch::randn({2, 3, 8, 8}, torch::kCUDA);
  conv->forward(x).sum().backward();
  opt.step();
  perf::to_channels_last(*conv, opt);
  conv->zero_grad();
  conv->forward(perf::channels_last(x)).sum().backward();
  EXPECT_NO_THROW(opt.step()) << "fused Adam checks that param, grad and state strides match";
}

TEST(CudaPaths, OnGpuPrefetchToAMissingDeviceIsAClearError) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      TensorDataset(8).map(torch::data::transforms::Stack<>()), perf::loader_options(4));
  const auto n = torch::cuda::device_count();
  PERF_EXPECT_THROW_MSG(perf::prefetch(*loader, torch::Device(torch::kCUDA, n)), "no such CUDA device");
}
