// Tests for perf/optim.h: parity with LibTorch's and Python's optimizers.
#include <gtest/gtest.h>
#include <perf/optim.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <sstream>

#include "test_util.h"

#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{8, 5}, {5}, {3, 4, 2, 2}, {16}};
constexpr int kSteps = 100;

// Same draws, in the same order, as the Python reference below.
struct Problem {
  std::vector<torch::Tensor> params;
  std::vector<std::vector<torch::Tensor>> grads;  // [step][param]
};

Problem make_problem() {
  torch::manual_seed(0);
  Problem pr;
  for (const auto& s : kShapes) pr.params.push_back(torch::randn(s).requires_grad_(true));
  for (int k = 0; k < kSteps; ++k) {
    pr.grads.emplace_back();
    for (const auto& s : kShapes) pr.grads.back().push_back(torch::randn(s));
  }
  return pr;
}

torch::Tensor run(const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>& make) {
  Problem pr = make_problem();
  auto opt = make(pr.params);
  for (int k = 0; k < kSteps; ++k) {
    for (size_t i = 0; i < pr.params.size(); ++i) pr.params[i].mutable_grad() = pr.grads[k][i].clone();
    opt->step();
  }
  std::vector<torch::Tensor> flat;
  for (auto& p : pr.params) flat.push_back(p.detach().flatten());
  return torch::cat(flat);
}

// The reference runs of Python's fused optimizers, one line of values each.
const std::vector<torch::Tensor>& python_reference() {
  static const std::vector<torch::Tensor> ref = [] {
    const std::string out = test_util::python(
        "import torch\n"
        "shapes=[(8,5),(5,),(3,4,2,2),(16,)]\n"
        "def run(make):\n"
        "  torch.manual_seed(0)\n"
        "  ps=[torch.nn.Parameter(torch.randn(s)) for s in shapes]\n"
        "  gs=[[torch.randn(s) for s in shapes] for _ in range(100)]\n"
        "  o=make(ps)\n"
        "  for k in range(100):\n"
        "    for p,g in zip(ps,gs[k]): p.grad=g.clone()\n"
        "    o.step()\n"
        "  print(' '.join(repr(x) for x in torch.cat([p.detach().flatten() for p in ps]).tolist()))\n"
        "run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9,0.99), weight_decay=0.05, fused=True))\n"
        "run(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, amsgrad=True, fused=True))\n"
        "run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=True))\n"
        "run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, maximize=True, fused=True))\n");
    std::vector<torch::Tensor> lines;
    for (const auto& line : test_util::lines(out)) {
      const auto v = test_util::parse_numbers(line);
      lines.push_back(torch::tensor(std::vector<float>(v.begin(), v.end())));
    }
    return lines;
  }();
  return ref;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

template <typename Opt, typename Options>
std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)> maker(Options o) {
  return [o](std::vector<torch::Tensor> ps) { return std::make_unique<Opt>(std::move(ps), o); };
}

bool has_cuda() { return torch::cuda::is_available(); }

}  // namespace

TEST(Optim, AdamWMatchesLibTorchAndPythonFused) {
  const auto fused =
      run(maker<perf::optim::AdamW>(perf::optim::AdamWOptions(1e-2).betas({0.9, 0.99}).weight_decay(0.05)));
  const auto foreach = run(
      maker<perf::optim::AdamW>(perf::optim::AdamWOptions(1e-2).betas({0.9, 0.99}).weight_decay(0.05).fused(false)));
  const auto libtorch =
      run(maker<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).betas({0.9, 0.99}).weight_decay(0.05)));
  const auto& py = python_reference().at(0);
  ASSERT_EQ(py.numel(), fused.numel());
  EXPECT_LE(max_abs_diff(fused, py), 1e-6);
  EXPECT_LE(max_abs_diff(fused, libtorch), 1e-6);
  EXPECT_LE(max_abs_diff(foreach, py), 1e-6);
  std::vector<torch::Tensor> init;
  for (auto& p : make_problem().params) init.push_back(p.detach().flatten());
  EXPECT_GT(max_abs_diff(fused, torch::cat(init)), 0.1) << "the parameters moved";
}

TEST(Optim, AdamAmsgradMatchesLibTorchAndPythonFused) {
  const auto o = perf::optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(true);
  const auto fused = run(maker<perf::optim::Adam>(o));
  const auto foreach = run(maker<perf::optim::Adam>(perf::optim::AdamOptions(o).fused(false)));
  const auto libtorch =
      run(maker<torch::optim::Adam>(torch::optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(true)));
  const auto& py = python_reference().at(1);
  EXPECT_LE(max_abs_diff(fused, py), 1e-6);
  EXPECT_LE(max_abs_diff(fused, libtorch), 1e-6);
  // The _foreach_ fallback rounds bias corrections differently from the fused kernel.
  EXPECT_LE(max_abs_diff(foreach, py), 1e-5);
}

TEST(Optim, SgdNesterovMatchesLibTorchAndPythonFused) {
  const auto o = perf::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3);
  const auto fused = run(maker<perf::optim::SGD>(o));
  const auto foreach = run(maker<perf::optim::SGD>(perf::optim::SGDOptions(o).fused(false)));
  const auto libtorch =
      run(maker<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3)));
  const auto& py = python_reference().at(2);
  EXPECT_LE(max_abs_diff(fused, py), 1e-6);
  EXPECT_LE(max_abs_diff(fused, libtorch), 1e-6);
  EXPECT_LE(max_abs_diff(foreach, py), 1e-6);
}

TEST(Optim, SgdDampeningMaximizeMatchesPythonFused) {
  const auto o = perf::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1).maximize(true);
  const auto& py = python_reference().at(3);
  EXPECT_LE(max_abs_diff(run(maker<perf::optim::SGD>(o)), py), 1e-6);
  EXPECT_LE(max_abs_diff(run(maker<perf::optim::SGD>(perf::optim::SGDOptions(o).fused(false))), py), 1e-6);
}

TEST(Optim, ReportsWhichKernelsRan) {
  auto a = torch::randn({4}, torch::requires_grad());
  auto b = torch::randn({4}, torch::TensorOptions().dtype(torch::kBFloat16).requires_grad(true));
  perf::optim::AdamW opt({a, b});
  a.mutable_grad() = torch::ones_like(a);
  b.mutable_grad() = torch::ones_like(b);
  opt.step();
  EXPECT_EQ(opt.kernels(), (std::vector<std::string>{"cpu Float: fused", "cpu BFloat16: fused"}));
  perf::optim::SGD sgd({a}, perf::optim::SGDOptions(0.1).fused(false));
  sgd.step();
  EXPECT_EQ(sgd.kernels(), (std::vector<std::string>{"cpu Float: foreach"}));
}

TEST(Optim, MixedPrecisionParametersFollowTheirFp32Twins) {
  torch::manual_seed(1);
  const auto init = torch::randn({64});
  std::vector<torch::Tensor> ps = {init.clone().requires_grad_(), init.to(torch::kBFloat16).requires_grad_(),
                                   init.to(torch::kHalf).requires_grad_()};
  perf::optim::AdamW opt(ps, perf::optim::AdamWOptions(1e-2));
  for (int k = 0; k < 20; ++k) {
    const auto g = torch::randn({64});
    for (auto& p : ps) p.mutable_grad() = g.to(p.scalar_type());
    opt.step();
  }
  EXPECT_EQ(opt.kernels().size(), 3u);
  EXPECT_LE(max_abs_diff(ps[1].detach().to(torch::kFloat), ps[0].detach()), 1e-1);  // bf16: 8-bit mantissa
  EXPECT_LE(max_abs_diff(ps[2].detach().to(torch::kFloat), ps[0].detach()), 1e-2);
  EXPECT_GT(max_abs_diff(ps[0].detach(), init), 0.1) << "parameters moved";
}

TEST(Optim, ParametersWithoutGradientsAreSkipped) {
  auto a = torch::ones({3}, torch::requires_grad());
  auto b = torch::ones({3}, torch::requires_grad());
  perf::optim::Adam opt({a, b}, perf::optim::AdamOptions(0.1));
  a.mutable_grad() = torch::ones_like(a);
  opt.step();
  EXPECT_TRUE(torch::equal(b.detach(), torch::ones({3})));
  EXPECT_FALSE(torch::equal(a.detach(), torch::ones({3})));
  EXPECT_EQ(opt.state().size(), 1u);
  const auto& st = static_cast<const perf::optim::AdamParamState&>(*opt.state().at(a.unsafeGetTensorImpl()));
  EXPECT_EQ(st.step().item<float>(), 1.0f);
  EXPECT_EQ(st.step().device(), a.device()) << "step counter lives with the parameter (capturable)";
}

TEST(Optim, StateDictRoundTripResumesBitIdentically) {
  const auto dir = std::filesystem::temp_directory_path();
  auto check = [&](auto make, const std::string& tag) {
    Problem pr = make_problem();
    auto opt = make(pr.params);
    auto feed = [&](std::vector<torch::Tensor>& ps, int k) {
      for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = pr.grads[k][i].clone();
    };
    for (int k = 0; k < 10; ++k) {
      feed(pr.params, k);
      opt->step();
    }
    const auto path = (dir / ("perf_opt_" + tag + std::to_string(::getpid()) + ".pt")).string();
    torch::save(*opt, path);
    // A new process would rebuild the model and optimizer, then load.
    std::vector<torch::Tensor> resumed;
    for (auto& p : pr.params) resumed.push_back(p.detach().clone().requires_grad_(true));
    auto opt2 = make(resumed);
    torch::load(*opt2, path);
    std::filesystem::remove(path);
    for (int k = 10; k < 30; ++k) {
      feed(pr.params, k);
      opt->step();
      feed(resumed, k);
      opt2->step();
    }
    for (size_t i = 0; i < resumed.size(); ++i)
      EXPECT_TRUE(torch::equal(resumed[i].detach(), pr.params[i].detach())) << tag << " param " << i;
  };
  check(
      [](std::vector<torch::Tensor> ps) {
        return std::make_unique<perf::optim::AdamW>(ps, perf::optim::AdamWOptions(1e-2).amsgrad(true));
      },
      "adamw");
  check(
      [](std::vector<torch::Tensor> ps) {
        return std::make_unique<perf::optim::SGD>(ps, perf::optim::SGDOptions(0.05).momentum(0.9));
      },
      "sgd");
}

TEST(Optim, SchedulerLrChangesTakeEffect) {
  auto p = torch::zeros({4}, torch::requires_grad());
  perf::optim::SGD opt({p}, perf::optim::SGDOptions(1.0));
  torch::optim::StepLR sched(opt, /*step_size=*/1, /*gamma=*/0.5);
  const auto g = torch::tensor({1.f, 2.f, 3.f, 4.f});
  p.mutable_grad() = g.clone();
  opt.step();
  sched.step();  // LibTorch's StepLR counts this first call as step 0 ...
  sched.step();  // ... and decays here
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 0.5);
  const auto before = p.detach().clone();
  opt.step();
  EXPECT_TRUE(torch::equal(p.detach(), before - 0.5 * g));
}

TEST(Optim, ClosureRunsWithGradAndReturnsLoss) {
  auto w = torch::tensor({2.0f}, torch::requires_grad());
  perf::optim::SGD opt({w}, perf::optim::SGDOptions(0.1));
  const auto loss = opt.step([&] {
    opt.zero_grad();
    auto l = (w * w).sum();
    l.backward();
    return l;
  });
  EXPECT_FLOAT_EQ(loss.item<float>(), 4.0f);
  EXPECT_FLOAT_EQ(w.item<float>(), 2.0f - 0.1f * 4.0f);
}

TEST(Optim, ScaledStepUnscalesAndSkipsOnInfWithoutHostDecision) {
  for (bool fused : {true, false}) {
    Problem pr = make_problem();
    std::vector<torch::Tensor> ref;
    for (auto& p : pr.params) ref.push_back(p.detach().clone().requires_grad_(true));
    perf::optim::AdamW a(pr.params, perf::optim::AdamWOptions(1e-2).fused(fused));
    perf::optim::AdamW b(ref, perf::optim::AdamWOptions(1e-2).fused(fused));
    const auto scale = torch::full({}, 1024.0f);
    for (size_t i = 0; i < ref.size(); ++i) {
      pr.params[i].mutable_grad() = pr.grads[0][i] * 1024.0f;
      ref[i].mutable_grad() = pr.grads[0][i].clone();
    }
    a.step_scaled(scale, torch::zeros({}));
    b.step();
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_LE(max_abs_diff(pr.params[i].detach(), ref[i].detach()), 1e-6) << "fused=" << fused;
    // found_inf = 1: nothing moves, and the step counter does not advance.
    std::vector<torch::Tensor> before;
    for (auto& p : pr.params) before.push_back(p.detach().clone());
    a.step_scaled(scale, torch::ones({}));
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(pr.params[i].detach(), before[i]));
    const auto& st = static_cast<const perf::optim::AdamParamState&>(*a.state().at(pr.params[0].unsafeGetTensorImpl()));
    EXPECT_EQ(st.step().item<float>(), 1.0f) << "fused=" << fused;
  }
}

TEST(Optim, BadOptionsNameTheOption) {
  auto p = torch::zeros({2}, torch::requires_grad());
  using perf::optim::AdamWOptions;
  PERF_EXPECT_THROW_MSG(perf::optim::AdamW({p}, AdamWOptions(-1)), "perf::optim::AdamW: invalid lr -1");
  PERF_EXPECT_THROW_MSG(perf::optim::AdamW({p}, AdamWOptions().betas({1.0, 0.9})), "invalid betas[0] 1");
  PERF_EXPECT_THROW_MSG(perf::optim::AdamW({p}, AdamWOptions().betas({0.9, -0.1})), "invalid betas[1] -0.1");
  PERF_EXPECT_THROW_MSG(perf::optim::AdamW({p}, AdamWOptions().eps(-1e-8)), "invalid eps");
  PERF_EXPECT_THROW_MSG(perf::optim::Adam({p}, perf::optim::AdamOptions().weight_decay(-0.1)),
                        "perf::optim::Adam: invalid weight_decay -0.1");
  PERF_EXPECT_THROW_MSG(perf::optim::SGD({p}, perf::optim::SGDOptions(-0.1)), "perf::optim::SGD: invalid lr");
  PERF_EXPECT_THROW_MSG(perf::optim::SGD({p}, perf::optim::SGDOptions(0.1).momentum(-1)), "invalid momentum");
  PERF_EXPECT_THROW_MSG(perf::optim::SGD({p}, perf::optim::SGDOptions(0.1).nesterov(true)),
                        "nesterov requires momentum > 0 and dampening == 0");
  // Per-group options are checked too, and named by group.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{p});
  groups.emplace_back(std::vector<torch::Tensor>{torch::zeros({2}, torch::requires_grad())},
                      std::make_unique<AdamWOptions>(AdamWOptions(-0.5)));
  PERF_EXPECT_THROW_MSG(perf::optim::AdamW(groups, AdamWOptions()), "invalid lr -0.5 in param group 1");
  // A scheduler or user setting a bad lr later is caught at step().
  perf::optim::AdamW ok({p});
  ok.param_groups()[0].options().set_lr(-1);
  p.mutable_grad() = torch::ones_like(p);
  PERF_EXPECT_THROW_MSG(ok.step(), "invalid lr -1 in param group 0");
}

TEST(Optim, BadParametersAreRejected) {
  auto cpu = torch::zeros({2}, torch::requires_grad());
  auto meta = torch::zeros({2}, torch::TensorOptions().device(torch::kMeta).requires_grad(true));
  PERF_EXPECT_THROW_MSG(perf::optim::AdamW({cpu, meta}), "parameters of group 0 are on different devices");
  PERF_EXPECT_THROW_MSG(perf::optim::SGD({torch::zeros({2}, torch::kLong)}, perf::optim::SGDOptions(0.1)),
                        "floating-point parameters");
  // Sparse gradients: a clear error, as Python's fused optimizers give.
  auto w = torch::zeros({10, 3}, torch::requires_grad());
  perf::optim::AdamW opt({w});
  w.mutable_grad() = torch::zeros({10, 3}).to_sparse();
  PERF_EXPECT_THROW_MSG(opt.step(), "does not support sparse gradients");
  // fused(true) where no fused kernel exists.
  perf::optim::SGD on_meta({meta}, perf::optim::SGDOptions(0.1).fused(true));
  meta.mutable_grad() = torch::zeros({2}, torch::kMeta);
  PERF_EXPECT_THROW_MSG(on_meta.step(), "fused(true) but no fused kernel for meta");
}

TEST(Optim, OnGpuMatchesCpuAndCapturesInACudaGraph) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
#if PERF_WITH_CUDA
  const auto cpu = run(maker<perf::optim::AdamW>(perf::optim::AdamWOptions(1e-2).weight_decay(0.05)));
  Problem pr = make_problem();
  std::vector<torch::Tensor> ps;
  for (auto& p : pr.params) ps.push_back(p.detach().cuda().requires_grad_(true));
  perf::optim::AdamW opt(ps, perf::optim::AdamWOptions(1e-2).weight_decay(0.05));
  // Static grads for capture: copy each step's values in, replay the captured step.
  for (auto& p : ps) p.mutable_grad() = torch::zeros_like(p);
  auto feed = [&](int k) {
    for (size_t i = 0; i < ps.size(); ++i) ps[i].grad().copy_(pr.grads[k][i]);
  };
  feed(0);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  auto wait = [](c10::cuda::CUDAStream waiter, c10::cuda::CUDAStream on) {
    at::cuda::CUDAEvent e;
    e.record(on);
    e.block(waiter);
  };
  const auto main_stream = c10::cuda::getCurrentCUDAStream();
  wait(side, main_stream);
  {
    c10::cuda::CUDAStreamGuard g(side);
    opt.step();  // eager step 1 (state created)
  }
  wait(main_stream, side);
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard g(side);
    graph.capture_begin();
    opt.step();
    graph.capture_end();
  }
  wait(main_stream, side);
  EXPECT_EQ(opt.kernels(), (std::vector<std::string>{"cuda:0 Float: fused"}));
  // Capture recorded without running; steps 2..100 are replays.
  for (int k = 1; k < kSteps; ++k) {
    feed(k);
    graph.replay();
  }
  std::vector<torch::Tensor> flat;
  for (auto& p : ps) flat.push_back(p.detach().cpu().flatten());
  EXPECT_LE(max_abs_diff(torch::cat(flat), cpu), 1e-5);
#endif
}
