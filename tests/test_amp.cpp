// Tests for perf/amp.h, perf/memory_format.h and perf/model.h.
#include <gtest/gtest.h>
#include <malloc.h>
#include <perf/amp.h>
#include <perf/attention.h>
#include <perf/memory.h>
#include <perf/memory_format.h>
#include <perf/model.h>
#include <perf/optim.h>
#include <perf/setup.h>
#include <perf/state_dict.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <thread>

#include "test_util.h"

namespace {

using test_util::has_cuda;

}  // namespace

// --------------------------------------------------------------------------- Autocast

using test_util::ScopedCpuBf16;

TEST(Autocast, CpuDefaultIsBf16WithNativeBf16AndRestoresOnExit) {
  const ScopedCpuBf16 cpu(/*native=*/true);
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  const auto dtype_before = at::autocast::get_autocast_dtype(at::kCPU);
  {
    perf::Autocast ac(torch::kCPU);
    EXPECT_EQ(ac.dtype(), torch::kBFloat16);
    EXPECT_TRUE(ac.enabled());
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), dtype_before);
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
}

// Emulated bf16 is slower than fp32: without AVX-512-BF16/AMX the CPU default is off.
TEST(Autocast, CpuDefaultIsOffWithoutNativeBf16ButAnExplicitDtypeIsHonoured) {
  const ScopedCpuBf16 cpu(/*native=*/false);
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  EXPECT_FALSE(perf::Autocast::default_enabled(torch::kCPU));
  EXPECT_TRUE(perf::Autocast::default_enabled(torch::kCUDA));
  {
    perf::Autocast ac(torch::kCPU);
    EXPECT_FALSE(ac.enabled());
    EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
  }
  {
    perf::Autocast ac(torch::kCPU, torch::kBFloat16);
    EXPECT_TRUE(ac.enabled());
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  }
  // perf::optimize follows the same default, and the report says why.
  auto model = perf::optimize(torch::nn::Linear(4, 4), perf::ModelOptions().device(torch::kCPU));
  EXPECT_EQ(model(a).scalar_type(), torch::kFloat);
  EXPECT_EQ(perf::detail::cpu_bf16().autocast_choice(), "off (fp32): avx512_bf16=no amx_bf16=no");
}

TEST(Autocast, NestsLikeTorchAutocast) {
  const auto a = torch::randn({4, 4});
  {
    perf::Autocast outer(torch::kCPU, torch::kBFloat16);
    {
      perf::Autocast inner(torch::kCPU, torch::kHalf);
      EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
      {
        perf::Autocast off(torch::kCPU, std::nullopt, /*enabled=*/false);
        EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
      }
      EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
    }
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
  }
  // Nesting is balanced: the next region is the outermost again.
  EXPECT_EQ(at::autocast::increment_nesting(), 1);
  EXPECT_EQ(at::autocast::decrement_nesting(), 0);
}

TEST(Autocast, RejectsWhatItCannotDo) {
  PERF_EXPECT_THROW_MSG(perf::Autocast(torch::kCPU, torch::kFloat), "not an autocast dtype");
  PERF_EXPECT_THROW_MSG(perf::Autocast(torch::kCPU, torch::kInt), "torch::kBFloat16, torch::kHalf");
  // (void): without it, `perf::Autocast(torch::kMeta);` parses as a declaration (Clang refuses it; GCC lets it be).
  PERF_EXPECT_THROW_MSG((void)perf::Autocast(torch::kMeta), "device must be cpu or cuda");
  if (!has_cuda()) PERF_EXPECT_THROW_MSG((void)perf::Autocast(torch::kCUDA), "cuda");
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "nothing half-applied";
}

namespace {
// Sets perf::Autocast's CPU attention mode for a scope.
struct ScopedCpuAttention {
  explicit ScopedCpuAttention(const std::string& mode) : prev(perf::Autocast::cpu_attention()) {
    perf::Autocast::set_cpu_attention(mode);
  }
  ~ScopedCpuAttention() { perf::Autocast::set_cpu_attention(prev); }
  std::string prev;
};

// q, k, v as a transformer block makes them: views of one qkv projection
// (bench/e2e's transformer: batch 16, 4 heads, 64 tokens, head size 32).
std::vector<torch::Tensor> attention_inputs(int64_t tokens = 64) {
  auto qkv = torch::randn({16, tokens, 3, 4, 32}).permute({2, 0, 3, 1, 4});
  return {qkv[0].detach().requires_grad_(), qkv[1].detach().requires_grad_(), qkv[2].detach().requires_grad_()};
}

bool same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && torch::equal(a, b);
}
}  // namespace

// Training under perf::Autocast on the CPU: scaled_dot_product_attention runs
// in whichever of fp32 and bf16 measured faster for its shape (LibTorch's bf16
// backward is several times slower at short sequences), measured once per
// shape on scratch inputs without touching the user's RNG; the output keeps
// autocast's dtype, and inference keeps LibTorch's policy.
TEST(Autocast, CpuAttentionInTrainingRunsInTheFasterPrecisionPerShape) {
  const ScopedCpuAttention mode("fastest");
  torch::manual_seed(3);
  const auto in = attention_inputs(48);  // a shape no other test measures
  const auto count = [] { return perf::Autocast::cpu_attention_choices().size(); };
  const auto before = count();
  const auto& gen = at::detail::getDefaultCPUGenerator();
  const auto rng = gen.get_state();
  torch::Tensor out;
  {
    perf::Autocast ac(torch::kCPU, torch::kBFloat16);
    out = at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, /*is_causal=*/true);
  }
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(gen.get_state(), rng)) << "the measurement must not draw from the default generator";
  ASSERT_EQ(count(), before + 1);
  const auto line = perf::Autocast::cpu_attention_choices().back();
  EXPECT_NE(line.find("Float[16, 4, 48, 32] strides [18432, 32, 384, 1]"), std::string::npos) << line;
  EXPECT_NE(line.find("causal"), std::string::npos) << line;
  double flt = 0, low = 0;
  const auto times = line.find("(float32 ");
  ASSERT_NE(times, std::string::npos) << line;
  ASSERT_EQ(std::sscanf(line.c_str() + times, "(float32 %lf ms, BFloat16 %lf ms)", &flt, &low), 2) << line;
  EXPECT_GT(flt, 0);
  EXPECT_GT(low, 0);
  const bool picked_float = line.find("-> float32") != std::string::npos;
  EXPECT_EQ(picked_float, flt < low) << line;
  // Whichever was picked, the result is the one that precision gives.
  const auto reference = picked_float
                             ? at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true).to(torch::kBFloat16)
                             : at::scaled_dot_product_attention(in[0].to(torch::kBFloat16), in[1].to(torch::kBFloat16),
                                                                in[2].to(torch::kBFloat16), {}, 0.0, true);
  EXPECT_TRUE(same(out, reference));
  out.sum().backward();
  EXPECT_EQ(in[0].grad().scalar_type(), torch::kFloat);
  {
    perf::Autocast ac(torch::kCPU, torch::kBFloat16);
    at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true);  // measured already
    torch::NoGradGuard no_grad;
    const auto other = attention_inputs(40);
    const auto inferred = at::scaled_dot_product_attention(other[0], other[1], other[2], {}, 0.0, true);
    EXPECT_TRUE(
        same(inferred, at::scaled_dot_product_attention(other[0].to(torch::kBFloat16), other[1].to(torch::kBFloat16),
                                                        other[2].to(torch::kBFloat16), {}, 0.0, true)))
        << "inference: LibTorch's policy";
  }
  EXPECT_EQ(count(), before + 1) << "one measurement per shape, none for inference";
}

TEST(Autocast, CpuAttentionModesAndLibTorchsPolicyOutsidePerfRegions) {
  torch::manual_seed(4);
  const auto in = attention_inputs();
  const auto bf = [&](int i) { return in[static_cast<size_t>(i)].to(torch::kBFloat16); };
  const auto lowered = at::scaled_dot_product_attention(bf(0), bf(1), bf(2), {}, 0.0, true);
  const auto go = torch::randn(lowered.sizes()).to(torch::kBFloat16);
  const auto grads = [&](const torch::Tensor& out) {
    const auto g = torch::autograd::grad({out}, {in[0], in[1], in[2]}, {go});
    return torch::cat({g[0].flatten(), g[1].flatten(), g[2].flatten()});
  };
  const auto choices = perf::Autocast::cpu_attention_choices().size();
  {
    const ScopedCpuAttention mode("float32");
    EXPECT_EQ(perf::Autocast::cpu_attention(), "float32");
    torch::Tensor out;
    {
      perf::Autocast ac(torch::kCPU, torch::kBFloat16);
      out = at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true);
    }
    const auto want = at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true).to(torch::kBFloat16);
    EXPECT_TRUE(same(out, want)) << "computed in fp32, returned in the autocast dtype";
    EXPECT_TRUE(same(grads(out), grads(want)));
    // float64 is not autocast's to cast (cached_cast leaves it): it stays float64.
    const auto dq = in[0].detach().to(torch::kDouble).requires_grad_(), dk = in[1].to(torch::kDouble),
               dv = in[2].to(torch::kDouble);
    torch::Tensor out64;
    {
      perf::Autocast ac(torch::kCPU, torch::kBFloat16);
      out64 = at::scaled_dot_product_attention(dq, dk, dv, {}, 0.0, true);
    }
    EXPECT_EQ(out64.scalar_type(), torch::kDouble);
    EXPECT_TRUE(same(out64, at::scaled_dot_product_attention(dq, dk, dv, {}, 0.0, true)));
    // An autocast region perf did not open keeps LibTorch's policy.
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    const auto plain = at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    EXPECT_TRUE(same(plain, lowered));
    // Dropout: LibTorch's policy (the same draws as LibTorch's own autocast).
    torch::manual_seed(5);
    torch::Tensor dropped;
    {
      perf::Autocast ac(torch::kCPU, torch::kBFloat16);
      dropped = at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.5, false);
    }
    torch::manual_seed(5);
    EXPECT_TRUE(same(dropped, at::scaled_dot_product_attention(bf(0), bf(1), bf(2), {}, 0.5, false)));
  }
  {
    const ScopedCpuAttention mode("autocast");
    perf::Autocast ac(torch::kCPU, torch::kBFloat16);
    EXPECT_TRUE(same(at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true), lowered));
  }
  EXPECT_EQ(perf::Autocast::cpu_attention_choices().size(), choices) << "no mode above measures";
  const auto mode = perf::Autocast::cpu_attention();
  PERF_EXPECT_THROW_MSG(perf::Autocast::set_cpu_attention("fp32"),
                        "mode must be \"fastest\", \"float32\" or \"autocast\", got \"fp32\"");
  EXPECT_EQ(perf::Autocast::cpu_attention(), mode) << "nothing half-applied";
}

// perf replaces LibTorch's AutocastCPU kernel of the op; the dispatcher's
// "Overriding a previously registered kernel" warning must not reach the user.
TEST(Autocast, CpuAttentionKernelIsInstalledWithoutAWarning) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        struct Count : c10::WarningHandler {
          int overriding = 0;
          void process(const c10::Warning& w) override {
            if (w.msg().find("Overriding") != std::string::npos) ++overriding;
          }
        } handler;
        auto* prev = c10::WarningUtils::get_warning_handler();
        c10::WarningUtils::set_warning_handler(&handler);
        { perf::Autocast ac(torch::kCPU, torch::kBFloat16); }
        TORCH_WARN("Overriding: the handler counts (this one only)");
        c10::WarningUtils::set_warning_handler(prev);
        std::exit(handler.overriding);
      },
      ::testing::ExitedWithCode(1), "");
}

// An explicit bf16 CPU region on a CPU without native bf16 is honoured (it casts) and says so once per process,
// since a training loop opens one per step; with native bf16, or without a dtype (fp32 there), nothing is said.
// Each case in a process of its own (a death test), as the warning is once per process.
TEST(Autocast, ExplicitBf16OnACpuWithoutNativeBf16WarnsOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto warnings_in_three_steps = [](bool native) {
    const ScopedCpuBf16 cpu(native);
    test_util::CollectWarnings warnings;
    for (int step = 0; step < 3; ++step) {
      perf::Autocast ac(torch::kCPU, torch::kBFloat16);
      if (!ac.enabled() || torch::mm(torch::ones({2, 2}), torch::ones({2, 2})).scalar_type() != torch::kBFloat16)
        std::exit(100);  // not honoured
    }
    { perf::Autocast unset(torch::kCPU); }
    int n = 0;
    for (const auto& m : warnings.messages)
      n += m.rfind(
               "perf::Autocast: bfloat16 on a CPU without bfloat16 instructions (avx512_bf16=no amx_bf16=no): "
               "ATen emulates it",
               0) == 0;
    std::exit(n);
  };
  EXPECT_EXIT(warnings_in_three_steps(/*native=*/false), ::testing::ExitedWithCode(1), "");
  EXPECT_EXIT(warnings_in_three_steps(/*native=*/true), ::testing::ExitedWithCode(0), "");
}

TEST(Autocast, OnGpuPicksBf16OnAmpereAndCasts) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const auto a = torch::randn({8, 8}, torch::kCUDA);
  perf::Autocast ac(torch::kCUDA);
  EXPECT_EQ(ac.dtype(), perf::detail::cuda_bf16_supported() ? torch::kBFloat16 : torch::kHalf);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), ac.dtype());
}

// --------------------------------------------------------------------------- GradScaler

namespace {

// 30 steps with inf at steps 4 and 9 and NaN at step 15: scale history and final parameters.
struct ScalerRun {
  std::vector<double> scales;
  torch::Tensor params;
};

template <typename MakeOpt>
ScalerRun run_scaler(MakeOpt make_opt) {
  torch::manual_seed(0);
  const auto p0 = torch::randn({6});
  std::vector<torch::Tensor> gs;
  gs.reserve(30);
  for (int k = 0; k < 30; ++k) gs.push_back(torch::randn({6}));
  gs[4][2] = std::numeric_limits<float>::infinity();
  gs[9][2] = -std::numeric_limits<float>::infinity();
  gs[15][2] = std::numeric_limits<float>::quiet_NaN();
  auto p = p0.clone().requires_grad_(true);
  auto opt = make_opt(p);
  perf::GradScaler scaler(perf::GradScalerOptions().init_scale(1024).growth_interval(3));
  ScalerRun r;
  for (const auto& g : gs) {
    opt->zero_grad();
    scaler.scale((p * g).sum()).backward();
    scaler.step(*opt);
    scaler.update();
    r.scales.push_back(scaler.get_scale());
  }
  r.params = p.detach().clone();
  return r;
}

const std::vector<std::string>& python_scaler_reference() {
  static const std::vector<std::string> lines = [] {
    const std::string out = test_util::python(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "p0=torch.randn(6)\n"
        "gs=[torch.randn(6) for _ in range(30)]\n"
        "gs[4][2]=float('inf'); gs[9][2]=-float('inf'); gs[15][2]=float('nan')\n"
        "for fused in (False, True):\n"
        "  p=torch.nn.Parameter(p0.clone())\n"
        "  o=torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=fused)\n"
        "  s=torch.amp.GradScaler('cpu', init_scale=1024., growth_interval=3)\n"
        "  h=[]\n"
        "  for g in gs:\n"
        "    o.zero_grad(); s.scale((p*g).sum()).backward(); s.step(o); s.update(); h.append(s.get_scale())\n"
        "  print(' '.join(repr(x) for x in h)); print(' '.join(repr(x) for x in p.detach().tolist()))\n");
    return test_util::lines(out);
  }();
  return lines;
}

void expect_matches_python(const ScalerRun& r, size_t first_line) {
  const auto& ref = python_scaler_reference();
  ASSERT_GE(ref.size(), first_line + 2);
  EXPECT_EQ(r.scales, test_util::parse_numbers(ref[first_line]));
  const auto params = test_util::parse_numbers(ref[first_line + 1]);
  ASSERT_EQ(params.size(), 6u);
  for (int64_t i = 0; i < 6; ++i) EXPECT_NEAR(r.params[i].item<double>(), params[static_cast<size_t>(i)], 1e-6) << i;
}

}  // namespace

TEST(GradScaler, MatchesPythonWithLibTorchSgd) {
  const auto r = run_scaler([](torch::Tensor& p) {
    return std::make_unique<torch::optim::SGD>(std::vector<torch::Tensor>{p},
                                               torch::optim::SGDOptions(0.1).momentum(0.9));
  });
  // Backs off at the inf/NaN steps, grows every 3 clean steps.
  EXPECT_EQ(r.scales[0], 1024.0);
  EXPECT_EQ(r.scales[2], 2048.0);
  EXPECT_EQ(r.scales[4], 1024.0);
  expect_matches_python(r, 0);
}

TEST(GradScaler, MatchesPythonFusedWithPerfFusedSgd) {
  const auto r = run_scaler([](torch::Tensor& p) {
    return std::make_unique<perf::optim::SGD>(std::vector<torch::Tensor>{p},
                                              perf::optim::SGDOptions(0.1).momentum(0.9));
  });
  expect_matches_python(r, 2);
}

TEST(GradScaler, UnscaleForClippingThenStep) {
  auto p = torch::zeros({3}, torch::requires_grad());
  perf::optim::SGD opt({p}, perf::optim::SGDOptions(1.0));
  torch::optim::SGD ref_opt({p}, torch::optim::SGDOptions(1.0));
  for (torch::optim::Optimizer* o : std::vector<torch::optim::Optimizer*>{&opt, &ref_opt}) {
    p.detach().zero_();
    o->zero_grad();
    perf::GradScaler scaler(perf::GradScalerOptions().init_scale(512));
    scaler.scale((p * torch::tensor({3.f, 4.f, 0.f})).sum()).backward();
    EXPECT_FLOAT_EQ(p.grad()[0].item<float>(), 3.f * 512);
    scaler.unscale_(*o);
    EXPECT_FLOAT_EQ(p.grad()[0].item<float>(), 3.f);
    torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{p}, 1.0);  // |g| = 5 -> 1
    scaler.step(*o);
    scaler.update();
    EXPECT_NEAR(p[0].item<float>(), -0.6f, 1e-6);
    EXPECT_NEAR(p[1].item<float>(), -0.8f, 1e-6);
  }
}

TEST(GradScaler, SeveralOptimizersSkipOnlyTheOneWithInf) {
  auto a = torch::ones({2}, torch::requires_grad()), b = torch::ones({2}, torch::requires_grad());
  perf::optim::SGD fused({a}, perf::optim::SGDOptions(0.5));
  torch::optim::SGD plain({b}, torch::optim::SGDOptions(0.5));
  perf::GradScaler scaler(perf::GradScalerOptions().init_scale(8));
  const float inf = std::numeric_limits<float>::infinity();
  scaler.scale((a * torch::tensor({1.f, inf})).sum() + b.sum()).backward();
  scaler.step(fused);  // inf in a's gradient: skipped on the device
  scaler.step(plain);  // b's gradients are finite: steps
  scaler.update();
  EXPECT_TRUE(torch::equal(a.detach(), torch::ones({2})));
  EXPECT_TRUE(torch::equal(b.detach(), torch::full({2}, 0.5f)));
  EXPECT_EQ(scaler.get_scale(), 4.0) << "one inf anywhere backs the scale off";
}

TEST(GradScaler, RejectsTheMisusePythonRejects) {
  auto p = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  perf::GradScaler scaler;
  PERF_EXPECT_THROW_MSG(scaler.step(opt), "no scale yet");
  PERF_EXPECT_THROW_MSG(scaler.unscale_(opt), "did not use scaler.scale(loss)");
  scaler.scale(p.sum()).backward();
  PERF_EXPECT_THROW_MSG(scaler.update(), "no inf checks were recorded");
  scaler.unscale_(opt);
  PERF_EXPECT_THROW_MSG(scaler.unscale_(opt), "already called on this optimizer since the last update()");
  scaler.step(opt);
  PERF_EXPECT_THROW_MSG(scaler.step(opt), "already called since the last update()");
  PERF_EXPECT_THROW_MSG(scaler.unscale_(opt), "called after step()");
  scaler.update();
  EXPECT_NO_THROW(scaler.unscale_(opt)) << "update() starts a new iteration";
  // FP16 gradients are refused, as in Python.
  auto h = torch::ones({2}, torch::TensorOptions().dtype(torch::kHalf).requires_grad(true));
  torch::optim::SGD hopt({h}, torch::optim::SGDOptions(0.1));
  h.mutable_grad() = torch::ones_like(h);
  perf::GradScaler s2;
  s2.scale(torch::ones({1}));
  PERF_EXPECT_THROW_MSG(s2.unscale_(hopt), "attempting to unscale FP16 gradients");
  PERF_EXPECT_THROW_MSG(perf::GradScaler(perf::GradScalerOptions().growth_factor(1.0)), "growth_factor");
  PERF_EXPECT_THROW_MSG(perf::GradScaler(perf::GradScalerOptions().backoff_factor(1.0)), "backoff_factor");
  PERF_EXPECT_THROW_MSG(perf::GradScaler(perf::GradScalerOptions().growth_interval(0)), "growth_interval");
  PERF_EXPECT_THROW_MSG(perf::GradScaler(perf::GradScalerOptions().init_scale(0)), "init_scale");
}

TEST(GradScaler, DisabledIsAPassThrough) {
  auto p = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.5));
  perf::GradScaler scaler(perf::GradScalerOptions().enabled(false));
  auto loss = p.sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_FLOAT_EQ(p[0].item<float>(), 0.5f);
}

TEST(GradScaler, DeviceCreatesTheScaleThereAndRefusesOthers) {
  perf::GradScaler scaler(perf::GradScalerOptions().init_scale(128).device(torch::kCPU));
  ASSERT_TRUE(scaler.scale_tensor().defined()) << "created by the constructor, before any scale()";
  EXPECT_TRUE(scaler.scale_tensor().device().is_cpu());
  EXPECT_EQ(scaler.scale_tensor().item<float>(), 128.f);
  EXPECT_EQ(scaler.get_scale(), 128.0);
  const void* storage = scaler.scale_tensor().data_ptr();
  auto p = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.5));
  auto scaled = scaler.scale(p.sum());
  EXPECT_EQ(scaled.item<float>(), 256.f);
  scaled.backward();
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(scaler.scale_tensor().data_ptr(), storage) << "the same tensor, updated in place";
  EXPECT_FLOAT_EQ(p[0].item<float>(), 0.5f) << "the step saw the unscaled gradient (1)";
  PERF_EXPECT_THROW_MSG(perf::GradScaler(perf::GradScalerOptions().device(torch::Device(torch::kMeta))),
                        "perf::GradScalerOptions::device: must be cpu or cuda, got meta");
}

TEST(GradScaler, CudaDeviceWithoutCudaWarnsAndDisables) {
  if (has_cuda())
    GTEST_SKIP() << "skipped: this machine has a CUDA device (GradScaler.OnGpuDeviceCreatesTheScaleThere)";
  test_util::CollectWarnings warnings;
  perf::GradScaler scaler(perf::GradScalerOptions().device(torch::kCUDA));
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("device cuda requested but CUDA is not available; disabling the scaler"),
            std::string::npos)
      << warnings.messages[0];
  EXPECT_FALSE(scaler.is_enabled()) << "as torch.amp.GradScaler(\"cuda\") on a machine without CUDA";
  EXPECT_FALSE(scaler.scale_tensor().defined());
  const auto loss = torch::ones({});
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

TEST(GradScaler, OnGpuDeviceCreatesTheScaleThere) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  perf::GradScaler scaler(perf::GradScalerOptions().device(torch::kCUDA));
  ASSERT_TRUE(scaler.scale_tensor().defined());
  EXPECT_TRUE(scaler.scale_tensor().is_cuda());
  EXPECT_EQ(scaler.scale_tensor().device(), torch::ones({}, torch::kCUDA).device()) << "the current device";
  auto p = torch::ones({2}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.5));
  scaler.scale(p.sum()).backward();
  scaler.step(opt);
  scaler.update();
  EXPECT_FLOAT_EQ(p[0].item<float>(), 0.5f);
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  // A CPU model under the CUDA scaler, as Python allows: the scale and the inverse scale cross to the CPU.
  // Those copies must be blocking (a non_blocking one lands in pinned memory after the CPU op has read it).
  auto q = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD cpu_opt({q}, torch::optim::SGDOptions(0.5));
  for (int i = 0; i < 20; ++i) EXPECT_EQ(scaler.scale(torch::ones({})).item<float>(), 65536.f) << "try " << i;
  cpu_opt.zero_grad();
  scaler.scale(q.sum()).backward();
  scaler.step(cpu_opt);
  scaler.update();
  EXPECT_FLOAT_EQ(q[0].item<float>(), 0.5f) << "the CPU step saw the unscaled gradient (1)";
  EXPECT_EQ(scaler.get_scale(), 65536.0);
}

// Python's torch.amp.GradScaler state_dict() into perf's scaler and back, through the files of torch.save.
TEST(GradScaler, PythonsStateDictLoadsAndPerfsLoadsInPython) {
  test_util::TempDir dir;
  const auto from_python = dir / "python.pt", from_cpp = dir / "cpp.pt";
  test_util::python(
      "import torch\n"
      "s = torch.amp.GradScaler('cpu', init_scale=1024., growth_factor=3., backoff_factor=0.25, "
      "growth_interval=7)\n"
      "s.scale(torch.ones(1))\ns.update(512.)\ns._growth_tracker.fill_(4)\n"
      "torch.save(s.state_dict(), '" +
      from_python + "')\n");
  perf::GradScaler scaler;
  scaler.load_state_dict(perf::load(from_python));
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 512.0);
  EXPECT_DOUBLE_EQ(scaler.options().growth_factor(), 3.0);
  EXPECT_DOUBLE_EQ(scaler.options().backoff_factor(), 0.25);
  EXPECT_EQ(scaler.options().growth_interval(), 7);
  EXPECT_EQ(scaler.growth_tracker(), 4);
  scaler.scale(torch::ones({1}));  // the scale and tracker made on the CPU, from the loaded values
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 512.0);
  scaler.update(256.0);
  perf::save(scaler.state_dict(), from_cpp);
  EXPECT_EQ(test_util::python("import torch\ns = torch.amp.GradScaler('cpu')\n"
                              "s.load_state_dict(torch.load('" +
                              from_cpp +
                              "'))\n"
                              "print(s.get_scale(), s._growth_factor, s._backoff_factor, s._growth_interval, "
                              "s._get_growth_tracker())\n"),
            "256.0 3.0 0.25 7 4");

  // As Python: a disabled scaler's state is empty and it loads nothing; an enabled one refuses that empty
  // state, and a value the constructor refuses, before anything changes.
  perf::GradScaler off(perf::GradScalerOptions().enabled(false));
  EXPECT_EQ(off.state_dict().size(), 0u);
  off.load_state_dict(perf::load(from_python));
  EXPECT_DOUBLE_EQ(off.get_scale(), 1.0);
  PERF_EXPECT_THROW_MSG(scaler.load_state_dict(off.state_dict()),
                        "the state is empty, possibly because it was saved "
                        "from a disabled GradScaler");
  auto bad = perf::load(from_python).toGenericDict();
  bad.insert_or_assign("growth_factor", 0.5);
  PERF_EXPECT_THROW_MSG(scaler.load_state_dict(bad), "holds a value a GradScaler refuses");
  EXPECT_DOUBLE_EQ(scaler.options().growth_factor(), 3.0);
  EXPECT_EQ(scaler.growth_tracker(), 4);
}

TEST(GradScaler, SaveLoadRoundTrip) {
  auto p = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  perf::GradScaler a(perf::GradScalerOptions().init_scale(256).growth_interval(2).backoff_factor(0.25));
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    a.scale(p.sum()).backward();
    a.step(opt);
    a.update();
  }
  EXPECT_EQ(a.get_scale(), 512.0);
  EXPECT_EQ(a.growth_tracker(), 1);
  const auto path = (std::filesystem::temp_directory_path() / ("perf_scaler_" + std::to_string(::getpid()))).string();
  torch::save(a, path);
  perf::GradScaler b;
  torch::load(b, path);
  EXPECT_EQ(b.get_scale(), 512.0);
  EXPECT_EQ(b.growth_tracker(), 1);
  EXPECT_EQ(b.options().backoff_factor(), 0.25);
  EXPECT_EQ(b.options().growth_interval(), 2);
  opt.zero_grad();
  b.scale(p.sum()).backward();
  b.step(opt);
  b.update();
  EXPECT_EQ(b.get_scale(), 1024.0) << "resumes the growth count";
  // A disabled scaler saves nothing and loads nothing, as Python's state_dict() / load_state_dict(), so a program
  // that saves its scaler with AMP on or off needs no branch; its empty archive in an enabled scaler is refused.
  perf::GradScaler disabled(perf::GradScalerOptions().enabled(false));
  ASSERT_NO_THROW(torch::save(disabled, path));
  perf::GradScaler off(perf::GradScalerOptions().enabled(false));
  ASSERT_NO_THROW(torch::load(off, path));
  EXPECT_EQ(off.get_scale(), 1.0);
  perf::GradScaler on(perf::GradScalerOptions().init_scale(8.0));
  PERF_EXPECT_THROW_MSG(torch::load(on, path), "the archive has no scaler state (saved from a disabled GradScaler?)");
  // A value the constructor would refuse is refused with nothing loaded.
  torch::serialize::OutputArchive bad;
  bad.write("scale", c10::IValue(512.0));
  bad.write("growth_factor", c10::IValue(0.5));
  bad.write("backoff_factor", c10::IValue(0.25));
  bad.write("growth_interval", c10::IValue(int64_t{2}));
  bad.write("_growth_tracker", c10::IValue(int64_t{1}));
  bad.save_to(path);
  on.scale(p.sum());  // the scale tensor exists: a load would fill it
  PERF_EXPECT_THROW_MSG(torch::load(on, path),
                        "perf::GradScaler::load: the archive holds a value a GradScaler refuses "
                        "(perf::GradScalerOptions::growth_factor: must be > 1.0, got 0.5); nothing was loaded");
  EXPECT_EQ(on.get_scale(), 8.0);
  EXPECT_EQ(on.options().backoff_factor(), 0.5);
  torch::serialize::OutputArchive partial;
  partial.write("scale", c10::IValue(512.0));
  partial.save_to(path);
  PERF_EXPECT_THROW_MSG(torch::load(on, path), "the archive's \"growth_factor\" is missing or not a number");
  EXPECT_EQ(on.get_scale(), 8.0) << "nothing loaded";
  std::filesystem::remove(path);
}

// --------------------------------------------------------------------------- channels-last

TEST(ChannelsLast, TensorAndModuleConversion) {
  const auto x = torch::randn({2, 3, 5, 7});
  const auto cl = perf::channels_last(x);
  EXPECT_TRUE(cl.is_contiguous(torch::MemoryFormat::ChannelsLast));
  EXPECT_EQ(cl.strides(), (std::vector<int64_t>{105, 1, 21, 3}));
  EXPECT_TRUE(torch::equal(cl, x));
  EXPECT_TRUE(perf::channels_last(torch::randn({1, 2, 3, 4, 5})).is_contiguous(torch::MemoryFormat::ChannelsLast3d));
  PERF_EXPECT_THROW_MSG(perf::channels_last(torch::randn({2, 3, 4})), "4-D (NCHW) or 5-D (NCDHW) tensor, got 3-D");

  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)), torch::nn::ReLU(),
                            torch::nn::Conv3d(torch::nn::Conv3dOptions(8, 4, 3)));
  auto conv_w = net->ptr<torch::nn::Conv2dImpl>(0)->weight;
  const auto impl_before = conv_w.unsafeGetTensorImpl();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  const auto x4 = torch::randn({2, 3, 6, 6});
  const auto y_ref = net->ptr<torch::nn::Conv2dImpl>(0)->forward(x4);
  y_ref.sum().backward();
  const auto grad_before = conv_w.grad().clone();
  EXPECT_EQ(perf::to_channels_last(*net), 2) << "the 4-D Conv2d weight and the 5-D Conv3d weight";
  EXPECT_TRUE(conv_w.is_contiguous(torch::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(conv_w.grad().is_contiguous(torch::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(torch::equal(conv_w.grad(), grad_before));
  EXPECT_TRUE(net->ptr<torch::nn::Conv3dImpl>(2)->weight.is_contiguous(torch::MemoryFormat::ChannelsLast3d));
  EXPECT_EQ(conv_w.unsafeGetTensorImpl(), impl_before) << "parameter identity kept";
  EXPECT_EQ(net->parameters()[0].unsafeGetTensorImpl(), impl_before);
  const auto y_cl = net->ptr<torch::nn::Conv2dImpl>(0)->forward(perf::channels_last(x4));
  EXPECT_TRUE(torch::allclose(y_cl, y_ref, 1e-5, 1e-5));
  const auto w_before_step = conv_w.detach().clone();
  opt.step();  // the optimizer still updates the converted parameter
  EXPECT_TRUE(torch::allclose(conv_w.detach(), w_before_step - 0.1 * grad_before, 1e-6, 1e-6));
  EXPECT_EQ(perf::to_channels_last(*net), 0) << "idempotent";
}

namespace {

// A ResNet-style downsampling block: 3x3 stride-2 main path, 1x1 stride-2 shortcut of `in` input channels.
struct DownImpl : torch::nn::Module {
  DownImpl(int64_t in, torch::nn::Conv2dOptions shortcut_options) {
    main = register_module("main", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, 32, 3).stride(2).padding(1)));
    shortcut = register_module("shortcut", torch::nn::Conv2d(shortcut_options));
  }
  torch::Tensor forward(const torch::Tensor& x) { return main(x) + shortcut(x); }
  torch::nn::Conv2d main{nullptr}, shortcut{nullptr};
};
TORCH_MODULE(Down);

Down down(int64_t in) { return Down(in, torch::nn::Conv2dOptions(in, 32, 1).stride(2).bias(false)); }

std::vector<std::string> hazards(torch::nn::Module& m, int64_t block) {
  return perf::detail::onednn_1x1_hazards(m, block);
}

}  // namespace

// uxlfoundation/oneDNN#6035 (LibTorch 2.11): on this AVX2 VM a 4-channel stride-2 1x1 convolution's weight gradient
// with a channels-last input aborted ("double free or corruption"), hung, or came out 33% wrong. Which convolutions
// meet it: exactly the trainable, unpadded, ungrouped, strided 1x1 ones on the CPU narrower than oneDNN's block.
TEST(ChannelsLast, FindsTheConvolutionsOneDnnMiscomputesAndOnlyThose) {
  torch::nn::Sequential net(down(4), down(12));
  EXPECT_EQ(hazards(*net, 8), (std::vector<std::string>{"0.shortcut (4 input channels, stride [2, 2])"}));
  EXPECT_EQ(hazards(*net, 16), (std::vector<std::string>{"0.shortcut (4 input channels, stride [2, 2])",
                                                         "1.shortcut (12 input channels, stride [2, 2])"}))
      << "AVX-512's block is 16";
  EXPECT_TRUE(hazards(*net, 0).empty()) << "no block: a CPU where the bug is not known";
  EXPECT_TRUE(hazards(*down(8), 8).empty()) << "as wide as the block";

  const auto shortcut = [](torch::nn::Conv2dOptions o) {
    Down d(4, o);
    return hazards(*d, 8);
  };
  EXPECT_EQ(shortcut(torch::nn::Conv2dOptions(4, 8, 1).stride({2, 1})),
            (std::vector<std::string>{"shortcut (4 input channels, stride [2, 1])"}))
      << "a stride above 1 in one dimension (it crashed here too)";
  EXPECT_TRUE(shortcut(torch::nn::Conv2dOptions(4, 8, 1)).empty()) << "stride 1: oneDNN's path without the bug";
  EXPECT_TRUE(shortcut(torch::nn::Conv2dOptions(4, 8, 1).stride(2).padding(1)).empty()) << "padded: another kernel";
  EXPECT_TRUE(shortcut(torch::nn::Conv2dOptions(4, 8, 1).stride(2).padding(torch::kValid)).size() == 1)
      << "padding kValid is no padding";
  EXPECT_TRUE(shortcut(torch::nn::Conv2dOptions(4, 8, 1).stride(2).groups(2)).empty())
      << "grouped: ran right here (4 channels a group)";
  EXPECT_TRUE(shortcut(torch::nn::Conv2dOptions(4, 8, 3).stride(2)).empty()) << "not 1x1";

  Down frozen = down(4);
  frozen->shortcut->weight.requires_grad_(false);
  EXPECT_TRUE(hazards(*frozen, 8).empty()) << "no weight gradient, no bug (inference and a frozen layer ran right)";

  DownImpl on_stack(4, torch::nn::Conv2dOptions(4, 8, 1).stride(2));
  EXPECT_EQ(hazards(on_stack, 8), (std::vector<std::string>{"shortcut (4 input channels, stride [2, 2])"}))
      << "a module on the stack, not in a shared_ptr (named_modules(include_self=true) would throw)";
  {
    test_util::CollectWarnings collect;
    EXPECT_NO_THROW(perf::to_channels_last(on_stack));
    EXPECT_EQ(collect.messages.size(), perf::detail::onednn_ic_block() > 4 ? 1u : 0u);
  }

  auto alone = torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 1).stride(2));
  EXPECT_EQ(hazards(*alone, 8), (std::vector<std::string>{"the module itself (4 input channels, stride [2, 2])"}));
}

// to_channels_last warns once a call, naming the convolutions, this CPU's block and the fix; a model without them,
// or with oneDNN off, converts silently. perf::optimize converts back and forth while it measures, and says it once.
TEST(ChannelsLast, ToChannelsLastWarnsWhereTrainingOnThisCpuMeetsTheOneDnnBug) {
  const int64_t block = perf::detail::onednn_ic_block();
  if (block == 0) GTEST_SKIP() << "skipped: this CPU has neither AVX2 nor AVX-512, where oneDNN#6035 is known";
  const auto warnings = [](torch::nn::Module& m) {
    test_util::CollectWarnings collect;
    perf::to_channels_last(m);
    return collect.messages;
  };
  torch::nn::Sequential net(down(block / 2), down(block));
  const auto said = warnings(*net);
  ASSERT_EQ(said.size(), 1u);
  for (const std::string& part : std::vector<std::string>{
           // NOLINTNEXTLINE(bugprone-suspicious-missing-comma): one message, in two literals
           "perf::to_channels_last: training this model channels-last on this CPU can hang, crash or "
           "compute wrong weight gradients",
           "(" + std::to_string(block) + " on this CPU): uxlfoundation/oneDNN#6035",
           "Here: 0.shortcut (" + std::to_string(block / 2) + " input channels, stride [2, 2]). Inference",
           "keep the model contiguous there", "at least " + std::to_string(block) + " input channels"})
    EXPECT_NE(said[0].find(part), std::string::npos) << part << "\nin: " << said[0];
  EXPECT_TRUE(net[0]->as<Down>()->main->weight.is_contiguous(torch::MemoryFormat::ChannelsLast))
      << "converted all the same";

  EXPECT_TRUE(warnings(*down(block)).empty());
  {
    const bool was = at::globalContext().userEnabledMkldnn();
    at::globalContext().setUserEnabledMkldnn(false);
    const auto off = warnings(*down(1));
    at::globalContext().setUserEnabledMkldnn(was);
    EXPECT_TRUE(off.empty()) << "oneDNN off: ATen's own convolution runs";
  }

  torch::nn::Sequential many;
  for (int i = 0; i < 6; ++i) many->push_back(down(1));
  const auto six = warnings(*many);
  ASSERT_EQ(six.size(), 1u);
  EXPECT_NE(six[0].find("Here: 0.shortcut (1 input channel, stride [2, 2]), 1.shortcut"), std::string::npos);
  EXPECT_NE(six[0].find(", 3.shortcut (1 input channel, stride [2, 2]) and 2 more."), std::string::npos) << six[0];
  EXPECT_EQ(six[0].find("4.shortcut"), std::string::npos) << six[0];

  {
    test_util::CollectWarnings collect;
    auto model = perf::optimize(down(block / 2), perf::ModelOptions().autocast(false));
    EXPECT_EQ(collect.messages.size(), 1u) << "the flags' recipe: channels-last";
  }
  test_util::CollectWarnings collect;
  auto model =
      perf::optimize(down(block / 2), perf::ModelOptions().autocast(false).example(torch::randn({2, block / 2, 8, 8})));
  EXPECT_EQ(collect.messages.size(), model.choice().recipe.channels_last() ? 1u : 0u)
      << "once, for the layout kept, whichever it is: " << model.choice();
}

// --------------------------------------------------------------------------- model wrapper

namespace {

struct ProbeImpl : torch::nn::Module {
  ProbeImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    saw_channels_last = x.is_contiguous(torch::MemoryFormat::ChannelsLast) && !x.is_contiguous();
    saw_autocast = at::autocast::is_autocast_enabled(at::kCPU);
    return bn(conv(x));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  bool saw_channels_last = false, saw_autocast = false;
};
TORCH_MODULE(Probe);

// A convolution whose calls sleep: first_ms more in its first call in each layout and precision (a stand-in
// for cuDNN's autotuning), every_ms in every call. Counts the calls each recipe (layout, autocast) gets.
struct SlowImpl : torch::nn::Module {
  SlowImpl(int first, int every) : first_ms(first), every_ms(every) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const bool cl = x.is_contiguous(torch::MemoryFormat::ChannelsLast) && !x.is_contiguous();
    const int n = ++calls[{cl, at::autocast::is_autocast_enabled(at::kCPU)}];
    std::this_thread::sleep_for(std::chrono::milliseconds(every_ms + (n == 1 ? first_ms : 0)));
    return conv(x);
  }
  int first_ms, every_ms;
  torch::nn::Conv2d conv{nullptr};
  std::map<std::pair<bool, bool>, int> calls;
};
TORCH_MODULE(Slow);

}  // namespace

TEST(Optimize, ConvertsInputsRunsAutocastKeepsTheModule) {
  const ScopedCpuBf16 cpu(/*native=*/true);
  torch::manual_seed(0);
  Probe plain;
  const auto x = torch::randn({2, 3, 8, 8});
  const auto y_ref = plain->forward(x);
  auto model = perf::optimize(plain, perf::ModelOptions().device(torch::kCPU));
  const auto y = model(x);
  EXPECT_TRUE(model->saw_channels_last);
  EXPECT_TRUE(model->saw_autocast);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(y.to(torch::kFloat), y_ref, 0.1, 0.1));
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "autocast only inside forward";
  EXPECT_EQ(model.module().get(), plain.get()) << "the same module object";
  EXPECT_TRUE(model->conv->weight.is_contiguous(torch::MemoryFormat::ChannelsLast));

  auto fp32_out = perf::optimize(plain, perf::ModelOptions().float_outputs(true));
  EXPECT_EQ(fp32_out(x).scalar_type(), torch::kFloat);
  auto no_amp = perf::optimize(plain, perf::ModelOptions().autocast(false).channels_last(false));
  EXPECT_TRUE(torch::allclose(no_amp(x), plain->forward(x), 1e-5, 1e-5));
  EXPECT_FALSE(plain->saw_autocast);
  PERF_EXPECT_THROW_MSG(perf::optimize(plain, perf::ModelOptions().autocast_dtype(torch::kFloat)),
                        "not an autocast dtype");
}

TEST(Optimize, InferUsesEvalAndInferenceModeThenRestores) {
  Probe net;
  net->train();
  auto model = perf::optimize(net, perf::ModelOptions().autocast(false));
  const auto x = torch::randn({2, 3, 8, 8});
  const auto mean_before = net->bn->running_mean.clone();
  const auto y = model.infer(x);
  EXPECT_TRUE(y.is_inference());
  EXPECT_TRUE(torch::equal(net->bn->running_mean, mean_before)) << "eval mode: running stats untouched";
  EXPECT_TRUE(net->is_training()) << "training mode restored";
  // Each module's own mode comes back: a BatchNorm frozen in eval() while the
  // rest trains stays frozen (fine-tuning), after infer() and InferenceScope.
  net->bn->eval();
  model.infer(x);
  EXPECT_TRUE(net->is_training());
  EXPECT_FALSE(net->bn->is_training()) << "infer() unfroze the BatchNorm";
  {
    perf::InferenceScope scope(net);
    EXPECT_FALSE(net->is_training());
    EXPECT_TRUE(c10::InferenceMode::is_enabled());
  }
  EXPECT_TRUE(net->is_training());
  EXPECT_FALSE(net->bn->is_training()) << "InferenceScope unfroze the BatchNorm";
  net->eval();
  EXPECT_TRUE(torch::allclose(y, net->forward(perf::channels_last(x)), 1e-5, 1e-5));
}

// With an example, perf::optimize measures the recipes on it and keeps the
// fastest: never slower than the plain model (beyond the 2% a candidate must
// win by), the decision printable and pinnable, the module's values untouched.
TEST(Optimize, AnExampleIsMeasuredAndTheFastestRecipeKept) {
  const ScopedCpuBf16 cpu(/*native=*/true);  // bf16 candidates measured on every CPU
  torch::manual_seed(0);
  Probe net;
  net->eval();
  const auto x = torch::randn({4, 3, 32, 32});
  const auto y_ref = net->forward(x);
  std::vector<at::Tensor> before;
  for (const auto& t : net->parameters()) before.push_back(t.detach().clone());
  for (const auto& t : net->buffers()) before.push_back(t.detach().clone());
  auto model = perf::optimize(net, perf::ModelOptions().example(x).tune_seconds(0.3));
  const auto& c = model.choice();
  ASSERT_EQ(c.measured_ms.size(), 4u) << c;  // NCHW / channels-last x fp32 / bf16 (no CUDA graph on the CPU)
  EXPECT_EQ(c.measured_ms[0].first, perf::Recipe()) << "the plain model is measured first";
  double best = c.measured_ms[0].second, chosen = -1;
  for (const auto& [recipe, ms] : c.measured_ms) {
    EXPECT_GT(ms, 0.0);
    best = std::min(best, ms);
    if (recipe == c.recipe) chosen = ms;
  }
  EXPECT_LE(chosen, c.measured_ms[0].second) << "never slower than the plain model: " << c;
  EXPECT_LE(chosen, best / 0.98 + 1e-9) << c;
  EXPECT_NE(c.to_string().find("fastest of 4 measured on [4, 3, 32, 32] Float on cpu"), std::string::npos) << c;
  EXPECT_NE(c.to_string().find("* " + c.recipe.name()), std::string::npos) << c;
  // The model runs the chosen recipe; its values are the module's own.
  const auto y = model.infer(x);
  EXPECT_EQ(net->saw_channels_last, c.recipe.channels_last());
  EXPECT_EQ(net->saw_autocast, c.recipe.autocast().has_value());
  EXPECT_TRUE(torch::allclose(y.to(torch::kFloat), y_ref, 0.05, 0.05)) << "within the chosen precision";
  size_t i = 0;
  for (const auto& t : net->parameters()) EXPECT_TRUE(torch::equal(t, before[i++]));
  for (const auto& t : net->buffers()) EXPECT_TRUE(torch::equal(t, before[i++]));
  EXPECT_EQ(net->conv->weight.is_contiguous(torch::MemoryFormat::ChannelsLast) && !net->conv->weight.is_contiguous(),
            c.recipe.channels_last())
      << "parameters in the chosen layout";

  // Pinned: the same recipe again without measuring (reproducible runs).
  auto pinned = perf::optimize(net, perf::ModelOptions().recipe(c.recipe));
  EXPECT_EQ(pinned.recipe(), c.recipe);
  EXPECT_TRUE(pinned.choice().measured_ms.empty());
  EXPECT_NE(pinned.choice().to_string().find("pinned by ModelOptions().recipe(...)"), std::string::npos);
  // The flags say which candidates may be measured.
  auto fp32_only = perf::optimize(net, perf::ModelOptions().example(x).autocast(false).tune_seconds(0.2));
  EXPECT_EQ(fp32_only.choice().measured_ms.size(), 2u);
  EXPECT_FALSE(fp32_only.recipe().autocast().has_value());
  // No example: the flags are the recipe, and the choice says so.
  auto fixed = perf::optimize(net, perf::ModelOptions());
  EXPECT_TRUE(fixed.recipe().channels_last());
  EXPECT_NE(fixed.choice().to_string().find("not measured: ModelOptions().example(x) measures"), std::string::npos);
  PERF_EXPECT_THROW_MSG(perf::optimize(net, perf::ModelOptions().recipe(perf::Recipe().graph(true))),
                        "graph(true) needs a CUDA device");
  PERF_EXPECT_THROW_MSG(perf::optimize(net, perf::ModelOptions().example(x).tune_seconds(0)),
                        "tune_seconds must be > 0");
}

// The decision's time in parts: each candidate's first call (where cuDNN autotunes in benchmark mode, and
// lazy initialisation happens) is timed apart from the calls tune_seconds bounds, so a slow first call
// shows as what it is.
TEST(Optimize, EachCandidatesFirstCallIsTimedApart) {
  const ScopedCpuBf16 cpu(/*native=*/true);
  Slow net(/*first_ms=*/80, /*every_ms=*/0);
  net->eval();
  auto model = perf::optimize(net, perf::ModelOptions().example(torch::randn({2, 3, 16, 16})).tune_seconds(0.2));
  const auto& c = model.choice();
  ASSERT_EQ(c.measured_ms.size(), 4u) << c;
  EXPECT_EQ(net->calls.size(), 4u) << "every recipe ran";
  EXPECT_GE(c.first_call_seconds, 4 * 0.08) << "the four first calls are counted as such: " << c;
  EXPECT_LT(c.first_call_seconds, 4 * 0.08 + 0.3) << "and only they: " << c;
  EXPECT_EQ(c.capture_seconds, 0.0) << "no CUDA graph on the CPU";
  EXPECT_GE(c.seconds, c.first_call_seconds) << c;
  for (const auto& [recipe, ms] : c.measured_ms) EXPECT_LT(ms, 40.0) << "no first call among the timed ones: " << c;
  const std::string text = c.to_string();
  EXPECT_NE(text.find(" s (first calls 0."), std::string::npos) << text;
  EXPECT_NE(text.find(" s, measured calls "), std::string::npos) << text;
  EXPECT_EQ(text.find("CUDA graph captures"), std::string::npos) << text;
}

// A model too slow for tune_seconds to hold several calls of each recipe: each
// candidate runs three times (its first call, then two timed), the plain model
// once more (the timed call that sizes the budget); no further warm-up call, so
// the decision costs 13 calls of the model, not 17.
TEST(Optimize, ASlowModelsDecisionRunsEachRecipeThreeTimes) {
  const ScopedCpuBf16 cpu(/*native=*/true);
  Slow net(/*first_ms=*/0, /*every_ms=*/40);
  net->eval();
  auto model = perf::optimize(net, perf::ModelOptions().example(torch::randn({2, 3, 16, 16})).tune_seconds(0.1));
  const auto& c = model.choice();
  ASSERT_EQ(c.measured_ms.size(), 4u) << c;
  const std::map<std::pair<bool, bool>, int> expected = {
      {{false, false}, 4}, {{false, true}, 3}, {{true, false}, 3}, {{true, true}, 3}};
  EXPECT_EQ(net->calls, expected) << c;
  for (const auto& [recipe, ms] : c.measured_ms) EXPECT_GE(ms, 40.0) << "timed calls, each over the sleep: " << c;
  EXPECT_GE(c.seconds, 13 * 0.04) << c;
}

// The same slow model where autocast is no candidate (a CPU without native bf16): the plain recipe is alone in
// its layout, so the timed call that sized the budget is its first timed call too. Each recipe runs three times
// (6 calls, not 7), and the plain recipe's time is still the median of two timed calls (not the first).
TEST(Optimize, ASlowModelsBudgetCallIsThePlainRecipesFirstTimedCall) {
  const ScopedCpuBf16 cpu(/*native=*/false);
  Slow net(/*first_ms=*/200, /*every_ms=*/40);
  net->eval();
  auto model = perf::optimize(net, perf::ModelOptions().example(torch::randn({2, 3, 16, 16})).tune_seconds(0.1));
  const auto& c = model.choice();
  ASSERT_EQ(c.measured_ms.size(), 2u) << c;
  const std::map<std::pair<bool, bool>, int> expected = {{{false, false}, 3}, {{true, false}, 3}};
  EXPECT_EQ(net->calls, expected) << c;
  for (const auto& [recipe, ms] : c.measured_ms) {
    EXPECT_GE(ms, 40.0) << "timed calls, each over the sleep: " << c;
    EXPECT_LT(ms, 200.0) << "no first call (200 ms more) among the timed ones: " << c;
  }
  EXPECT_GE(c.first_call_seconds, 2 * 0.24) << c;
}

// A model without images: no channels-last candidate (nothing to lay out).
TEST(Optimize, AnMlpExampleMeasuresPrecisionsOnly) {
  const ScopedCpuBf16 cpu(/*native=*/true);
  torch::nn::Sequential mlp(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
  auto model = perf::optimize(mlp, perf::ModelOptions().example(torch::randn({32, 64})).tune_seconds(0.2));
  ASSERT_EQ(model.choice().measured_ms.size(), 2u) << model.choice();
  EXPECT_FALSE(model.recipe().channels_last());
  EXPECT_EQ(model(torch::randn({5, 64})).size(0), 5) << "other shapes run the chosen recipe eagerly";
}

// The decision rule: the fastest, where a candidate listed later (less simple:
// channels-last after NCHW, autocast after fp32, graphed after eager) must beat
// the best before it by 2% to take its place.
TEST(Optimize, ALaterCandidateMustBeatTheBestBeforeItByTwoPercent) {
  using perf::detail::fastest;
  EXPECT_EQ(fastest({1.0}, 1), 0u);
  EXPECT_EQ(fastest({1.0, 0.99, 0.985}, 3), 0u) << "within 2% of the first: noise";
  EXPECT_EQ(fastest({1.0, 0.97, 0.96}, 3), 1u) << "0.96 is not 2% under 0.97";
  EXPECT_EQ(fastest({1.0, 0.97, 0.95}, 3), 2u);
  EXPECT_EQ(fastest({0.5, 1.0, 0.2}, 2), 0u) << "only the first n count (the eager candidates)";
  EXPECT_EQ(fastest({0.5, 1.0, 0.2}, 3), 2u);
  PERF_EXPECT_THROW_MSG(fastest({1.0}, 2), "fastest of 2 of 1 times");
  PERF_EXPECT_THROW_MSG(fastest({}, 0), "fastest of 0 of 0 times");
}

// On CUDA every recipe is also measured as a CUDA graph of its forward
// (static shapes, inference), not only the eager winner: a graph removes the
// host's launches, which weigh most on the recipes with the most kernels. A
// graph is kept only if faster, and then used only where it is valid: the
// example's shape, eval mode, no autograd.
TEST(Optimize, OnGpuAnExampleAlsoMeasuresEachRecipeAsACudaGraph) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  // Like with like: cuDNN's fp32 convolutions may use TF32 by default (inputs
  // rounded to 10 mantissa bits: errors of order 1e-3 on this 27-term
  // convolution, against the 1e-4 below), and a graph keeps the kernels chosen
  // at capture, so the recipes are measured and captured under fp32 settings.
  perf::ScopedSettings fp32(perf::Settings().tf32(false).matmul_precision("highest"));
  torch::manual_seed(0);
  Probe net;
  net->eval();
  const auto x = torch::randn({1, 3, 32, 32}, torch::kCUDA);
  std::vector<at::Tensor> before;
  for (const auto& t : net->parameters()) before.push_back(t.detach().to(torch::kCPU));
  auto model = perf::optimize(net, perf::ModelOptions().device(torch::kCUDA).example(x).tune_seconds(0.5));
  const auto& c = model.choice();
  ASSERT_EQ(c.measured_ms.size(), 8u) << c;  // 2 layouts x {fp32, bf16} eager, then the same 4 as graphs
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_FALSE(c.measured_ms[k].first.graph()) << c;
    EXPECT_TRUE(c.measured_ms[k + 4].first.graph()) << c;
    EXPECT_TRUE(perf::Recipe(c.measured_ms[k].first).graph(true) == c.measured_ms[k + 4].first) << c;
  }
  EXPECT_NE(c.reason.find("fastest of 8 measured (4 eager, 4 as CUDA graphs)"), std::string::npos) << c;
  EXPECT_LE(c.seconds, 5.0) << "bounded decision time: " << c;
  double chosen = -1, fastest = c.measured_ms[0].second;
  for (const auto& [recipe, ms] : c.measured_ms) {
    if (recipe == c.recipe) chosen = ms;
    fastest = std::min(fastest, ms);
  }
  EXPECT_LE(chosen, c.measured_ms[0].second) << "never slower than the plain model: " << c;
  EXPECT_LE(chosen, fastest / 0.98) << "the fastest, eager or graphed, within the 2% that goes to simpler ones: " << c;
  // Whatever was kept, it answers like the plain fp32 model within its precision,
  // for new inputs each call (a graph replays the new input, not the example).
  const double tol = c.recipe.autocast() ? 0.05 : 1e-4;
  for (int i = 0; i < 3; ++i) {
    const auto xi = torch::randn({1, 3, 32, 32}, torch::kCUDA);
    at::Tensor ref;
    {
      at::NoGradGuard no_grad;
      ref = net->forward(xi);
    }
    const auto y = model.infer(xi);
    EXPECT_TRUE(torch::allclose(y.to(torch::kFloat), ref, tol, tol)) << c;
  }
  // Another shape, and training mode with autograd, run eagerly.
  EXPECT_EQ(model.infer(torch::randn({3, 3, 32, 32}, torch::kCUDA)).size(0), 3);
  net->train();
  const auto yt = model(torch::randn({1, 3, 32, 32}, torch::kCUDA));
  EXPECT_TRUE(yt.requires_grad()) << "training calls are not replayed";
  net->eval();
  size_t i = 0;
  for (const auto& t : net->parameters()) EXPECT_TRUE(torch::equal(t.detach().to(torch::kCPU), before[i++]));

  // A forward that cannot be captured (a host sync) stays eager, says why, and the process stays healthy.
  struct SyncingImpl : torch::nn::Module {
    SyncingImpl() { fc = register_module("fc", torch::nn::Linear(8, 8)); }
    torch::Tensor forward(const torch::Tensor& x) {
      const double s = x.abs().sum().item<double>();  // cudaStreamSynchronize: illegal while capturing
      return fc(x) * (s > -1.0 ? 1.0 : 0.0);
    }
    torch::nn::Linear fc{nullptr};
  };
  auto syncing = std::make_shared<SyncingImpl>();
  const auto xs = torch::randn({4, 8}, torch::kCUDA);
  auto eager_only = perf::optimize(syncing, perf::ModelOptions().device(torch::kCUDA).example(xs).tune_seconds(0.2));
  EXPECT_FALSE(eager_only.recipe().graph()) << eager_only.choice();
  EXPECT_NE(eager_only.choice().to_string().find("not as a CUDA graph: capture failed"), std::string::npos)
      << eager_only.choice();
  EXPECT_TRUE(torch::allclose(eager_only.infer(xs), syncing->forward(xs), 0.05, 0.05));
  EXPECT_EQ(torch::ones({3}, torch::kCUDA).sum().item<float>(), 3.0f) << "CUDA still usable after the failed capture";
}

namespace {
// Records cuDNN's benchmark flag at each forward call: the calls that run in
// `seen`, those a CUDA graph capture records in `captured`; cuDNN's
// deterministic flag at the calls that run in `deterministic`.
struct BenchmarkSpyImpl : torch::nn::Module {
  BenchmarkSpyImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const bool capturing = perf::optim::detail::capturing_cuda_graph();
    (capturing ? captured : seen).push_back(at::globalContext().benchmarkCuDNN());
    if (!capturing) deterministic.push_back(at::globalContext().deterministicCuDNN());
    return conv(x);
  }
  torch::nn::Conv2d conv{nullptr};
  std::vector<bool> seen, captured, deterministic;
};
TORCH_MODULE(BenchmarkSpy);
}  // namespace

// autotune_candidates(false) is about cuDNN's autotuning on CUDA: on the CPU the
// decision is the same and the program's benchmark flag is left as it is.
TEST(Optimize, AutotuneCandidatesChangesNothingOnTheCpu) {
  const bool before = at::globalContext().benchmarkCuDNN();
  const auto restore = c10::make_scope_exit([&] { at::globalContext().setBenchmarkCuDNN(before); });
  at::globalContext().setBenchmarkCuDNN(true);
  BenchmarkSpy spy;
  spy->eval();
  auto model = perf::optimize(
      spy, perf::ModelOptions().example(torch::randn({2, 3, 16, 16})).tune_seconds(0.1).autotune_candidates(false));
  EXPECT_TRUE(at::globalContext().benchmarkCuDNN());
  ASSERT_FALSE(spy->seen.empty());
  for (const bool b : spy->seen) EXPECT_TRUE(b) << "the CPU's calls saw the flag as the program set it";
  EXPECT_EQ(model.choice().reason.find("heuristic"), std::string::npos) << model.choice();
}

// On CUDA with benchmark mode on, autotune_candidates(false) measures every
// candidate with it off (cuDNN's heuristic algorithms: no candidate autotunes
// its convolutions) and cuDNN's deterministic mode on (ATen caches a plan under
// a key with the deterministic flag and without the benchmark one: the
// candidates' heuristic plans stay out of the winner's way), and turns both back
// before the winner's capture, whose warm-up calls autotune the winner alone; the
// program's flags are as they were afterwards. Left on (the default), every call
// autotunes, as before. With the program's benchmark mode off, nothing changes.
// Either way a capture records its calls with the mode off (perf's capture: the
// warm-up has autotuned).
TEST(Optimize, OnGpuAutotuneCandidatesFalseAutotunesTheWinnerOnly) {
  if (!has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  perf::ScopedSettings fp32(perf::Settings().tf32(false).matmul_precision("highest").cudnn_benchmark(true));
  const auto x = torch::randn({4, 3, 32, 32}, torch::kCUDA);
  const auto options = perf::ModelOptions().device(torch::kCUDA).example(x).tune_seconds(0.3);
  {
    BenchmarkSpy spy;
    spy->eval();
    auto model = perf::optimize(spy, perf::ModelOptions(options).autotune_candidates(false));
    const auto& c = model.choice();
    EXPECT_TRUE(at::globalContext().benchmarkCuDNN()) << "the program's flag back";
    EXPECT_NE(c.reason.find("measured on cuDNN's heuristic algorithms (autotune_candidates(false))"), std::string::npos)
        << c;
    const auto& seen = spy->seen;
    size_t off = 0;
    while (off < seen.size() && !seen[off]) ++off;
    EXPECT_GE(off, c.measured_ms.size()) << "every candidate measured with benchmark mode off: " << c;
    for (size_t i = off; i < seen.size(); ++i) EXPECT_TRUE(seen[i]) << "call " << i << ": the winner's warm-up";
    ASSERT_EQ(spy->deterministic.size(), seen.size());
    for (size_t i = 0; i < seen.size(); ++i)
      EXPECT_EQ(spy->deterministic[i], !seen[i]) << "call " << i << ": deterministic exactly while heuristic";
    EXPECT_FALSE(at::globalContext().deterministicCuDNN()) << "the program's deterministic flag back";
    if (c.recipe.graph()) {
      EXPECT_GE(seen.size() - off, 1u) << "the winner's capture (its warm-up calls) autotunes: " << c;
      EXPECT_FALSE(spy->captured.empty()) << c;
    } else {
      EXPECT_EQ(off, seen.size()) << "an eager winner autotunes at its first call after the decision: " << c;
    }
    const auto before = spy->seen.size();
    model.infer(x);
    if (!c.recipe.graph()) {
      ASSERT_EQ(spy->seen.size(), before + 1);
      EXPECT_TRUE(spy->seen.back());
    }
    for (const bool b : spy->captured) EXPECT_FALSE(b) << "captured with benchmark mode off";
  }
  {
    BenchmarkSpy spy;
    spy->eval();
    auto model = perf::optimize(spy, options);
    EXPECT_TRUE(at::globalContext().benchmarkCuDNN());
    for (const bool b : spy->seen) EXPECT_TRUE(b) << "autotune_candidates(true), the default: every call autotunes";
    for (const bool b : spy->deterministic) EXPECT_FALSE(b) << "the program's deterministic flag throughout";
    for (const bool b : spy->captured) EXPECT_FALSE(b) << "captured with benchmark mode off";
    EXPECT_EQ(model.choice().reason.find("heuristic"), std::string::npos) << model.choice();
  }
  {
    perf::ScopedSettings off(perf::Settings().tf32(false).matmul_precision("highest").cudnn_benchmark(false));
    BenchmarkSpy spy;
    spy->eval();
    auto model = perf::optimize(spy, perf::ModelOptions(options).autotune_candidates(false));
    EXPECT_FALSE(at::globalContext().benchmarkCuDNN());
    for (const bool b : spy->seen) EXPECT_FALSE(b);
    for (const bool b : spy->captured) EXPECT_FALSE(b);
    EXPECT_EQ(model.choice().reason.find("heuristic"), std::string::npos) << model.choice();
  }
  {
    // The program's own cuDNN deterministic mode: the candidates' plans cannot be kept apart, and the reason says so.
    at::globalContext().setDeterministicCuDNN(true);
    const auto restore = c10::make_scope_exit([] { at::globalContext().setDeterministicCuDNN(false); });
    BenchmarkSpy spy;
    spy->eval();
    auto model = perf::optimize(spy, perf::ModelOptions(options).autotune_candidates(false));
    EXPECT_TRUE(at::globalContext().benchmarkCuDNN());
    EXPECT_TRUE(at::globalContext().deterministicCuDNN());
    for (const bool b : spy->deterministic) EXPECT_TRUE(b);
    EXPECT_NE(model.choice().reason.find("which the winner keeps: the program's convolutions are deterministic"),
              std::string::npos)
        << model.choice();
  }
}

// --------------------------------------------------------------------------- Conv-BN fusion

TEST(FuseConvBn, MatchesPythonFuseConvBnEval) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 8, 3).padding(1));
  torch::nn::BatchNorm2d bn(8);
  torch::manual_seed(0);
  {
    torch::NoGradGuard ng;
    conv->weight.copy_(torch::randn({8, 3, 3, 3}));
    conv->bias.copy_(torch::randn({8}));
    bn->weight.copy_(torch::randn({8}));
    bn->bias.copy_(torch::randn({8}));
    bn->running_mean.copy_(torch::randn({8}));
    bn->running_var.copy_(torch::rand({8}) + 0.5);
  }
  const auto x = torch::randn({2, 3, 10, 10});
  conv->eval();
  bn->eval();
  auto fused = perf::fuse_conv_bn(conv, bn);
  const auto y = fused->forward(x);
  const auto ref =
      torch::tensor(test_util::parse_numbers(test_util::python(
                        "import torch\n"
                        "conv=torch.nn.Conv2d(3,8,3,padding=1); bn=torch.nn.BatchNorm2d(8)\n"
                        "torch.manual_seed(0)\n"
                        "with torch.no_grad():\n"
                        "  conv.weight.copy_(torch.randn(8,3,3,3)); conv.bias.copy_(torch.randn(8))\n"
                        "  bn.weight.copy_(torch.randn(8)); bn.bias.copy_(torch.randn(8))\n"
                        "  bn.running_mean.copy_(torch.randn(8)); bn.running_var.copy_(torch.rand(8)+0.5)\n"
                        "x=torch.randn(2,3,10,10)\n"
                        "f=torch.nn.utils.fuse_conv_bn_eval(conv.eval(), bn.eval())\n"
                        "print(' '.join(repr(v) for v in f(x).flatten().tolist()))")),
                    torch::kFloat);
  ASSERT_EQ(ref.numel(), y.numel());
  const double rel = ((y.flatten() - ref).abs().max() / ref.abs().max()).item<double>();
  EXPECT_LE(rel, 1e-5);
  EXPECT_TRUE(torch::allclose(y, bn->forward(conv->forward(x)), 1e-4, 1e-5));
  conv->train();
  PERF_EXPECT_THROW_MSG(perf::fuse_conv_bn(conv, bn), "call eval()");
}

TEST(FuseConvBn, SequentialPassFusesEveryPair) {
  torch::manual_seed(1);
  torch::nn::Sequential seq(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)), torch::nn::BatchNorm2d(8),
                            torch::nn::ReLU(),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1).bias(false)),
                            torch::nn::BatchNorm2d(8), torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 4, 1)));
  // Non-trivial running statistics.
  seq->train();
  for (int i = 0; i < 3; ++i) seq->forward(torch::randn({4, 3, 9, 9}));
  seq->eval();
  const auto x = torch::randn({2, 3, 9, 9});
  auto fused = perf::fuse_conv_bn(seq);
  EXPECT_EQ(fused->size(), 4u);  // conv+bn, relu, conv+bn (no bias), conv
  EXPECT_TRUE(fused->ptr<torch::nn::Conv2dImpl>(2)->bias.defined());
  EXPECT_FALSE(fused->is_training());
  EXPECT_TRUE(torch::allclose(fused->forward(x), seq->forward(x), 1e-4, 1e-5));
  EXPECT_EQ(seq->size(), 6u) << "input left unchanged";
  seq->train();
  PERF_EXPECT_THROW_MSG(perf::fuse_conv_bn(seq), "call eval() on the Sequential");
}

// --------------------------------------------------------------------------- checkpoint

TEST(Checkpoint, GradientsEqualWithDropoutAndParameters) {
  torch::manual_seed(0);
  torch::nn::Linear l1(16, 32), l2(32, 16);
  torch::nn::Dropout drop(0.5);
  auto block = [&](const std::vector<torch::Tensor>& in) { return l2(drop(torch::gelu(l1(in[0])))) * in[1]; };
  const auto x0 = torch::randn({8, 16}), s0 = torch::randn({8, 16});

  auto run = [&](bool ckpt) {
    for (auto& p : l1->parameters()) p.mutable_grad() = torch::Tensor();
    for (auto& p : l2->parameters()) p.mutable_grad() = torch::Tensor();
    auto x = x0.clone().requires_grad_(true), s = s0.clone().requires_grad_(true);
    torch::manual_seed(42);
    auto y = ckpt ? perf::checkpoint(block, {x, s}) : block({x, s});
    torch::randn({100});  // RNG moves on before backward, as in real training
    (y * y).sum().backward();
    return std::vector<torch::Tensor>{y.detach(), x.grad(), s.grad(), l1->weight.grad().clone(),
                                      l2->bias.grad().clone()};
  };
  const auto ref = run(false);
  const auto ck = run(true);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(torch::allclose(ck[i], ref[i], 1e-6, 1e-6)) << i;
  // Without RNG preservation the recomputed dropout mask differs.
  auto x = x0.clone().requires_grad_(true), s = s0.clone().requires_grad_(true);
  torch::manual_seed(42);
  auto y = perf::checkpoint(block, {x, s}, /*preserve_rng_state=*/false);
  torch::randn({100});
  (y * y).sum().backward();
  EXPECT_FALSE(torch::allclose(x.grad(), ref[1], 1e-6, 1e-6));
}

// The recomputation runs under the forward's autocast state, outside any
// autocast region of the caller: the weights it casts must not stay in
// autocast's cache (keyed on the weight, blind to in-place updates), or the next
// step's forward would run on the casts of the weights before optimizer.step().
// Python's checkpoint recomputes inside torch.autocast, whose exit clears the
// cache; so must this. Three SGD steps, checkpointed and plain, under bf16 autocast.
TEST(Checkpoint, UnderAutocastTheNextStepSeesTheUpdatedWeights) {
  auto train = [](bool ckpt) {
    torch::manual_seed(0);
    torch::nn::Linear l1(16, 32), l2(32, 4);
    torch::optim::SGD opt({l1->weight, l1->bias, l2->weight, l2->bias}, 0.5);
    auto block = [&](const std::vector<torch::Tensor>& in) { return l2(torch::gelu(l1(in[0]))); };
    const auto x = torch::randn({8, 16});
    std::vector<torch::Tensor> outs;
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      torch::Tensor y;
      {
        perf::Autocast ac(torch::kCPU, torch::kBFloat16);
        y = ckpt ? perf::checkpoint(block, {x}) : block({x});
      }
      outs.push_back(y.detach().to(torch::kFloat));
      y.to(torch::kFloat).pow(2).sum().backward();
      opt.step();
    }
    return outs;
  };
  const auto plain = train(false), ckpt = train(true);
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(torch::equal(ckpt[i], plain[i]))
        << "step " << i << ": max |difference| " << (ckpt[i] - plain[i]).abs().max().item<double>();
  EXPECT_FALSE(torch::equal(plain[0], plain[2])) << "the weights must move";
  // The recomputation runs with the forward's cache setting too (Python's checkpoint keeps cache_enabled),
  // and leaves the caller's as it was.
  torch::nn::Linear l(4, 4);
  std::vector<bool> cache_seen;
  auto block = [&](const std::vector<torch::Tensor>& in) {
    cache_seen.push_back(at::autocast::is_autocast_cache_enabled());
    return l(in[0]);
  };
  torch::Tensor y;
  {
    perf::Autocast ac(torch::kCPU, torch::kBFloat16, /*enabled=*/true, /*cache_enabled=*/false);
    y = perf::checkpoint(block, {torch::randn({2, 4})});
  }
  ASSERT_TRUE(at::autocast::is_autocast_cache_enabled());
  y.to(torch::kFloat).sum().backward();
  EXPECT_EQ(cache_seen, (std::vector<bool>{false, false})) << "forward, then the recomputation";
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  EXPECT_TRUE(l->weight.grad().defined());
}

// torch::autograd::grad() and backward(inputs) only return or fill what they
// were asked for; the recomputation accumulates into .grad(): refused, as
// Python's reentrant checkpoint refuses them.
TEST(Checkpoint, GradAndBackwardWithInputsAreClearErrors) {
  torch::manual_seed(0);
  torch::nn::Linear l1(16, 16);
  auto block = [&](const std::vector<torch::Tensor>& in) { return torch::gelu(l1(in[0])); };
  const auto x = torch::randn({8, 16}).requires_grad_(true);
  const char* expected = "perf::checkpoint is incompatible with torch::autograd::grad() and with backward() given";
  PERF_EXPECT_THROW_MSG(torch::autograd::grad({perf::checkpoint(block, {x}).sum()}, {x}), expected);
  PERF_EXPECT_THROW_MSG(perf::checkpoint(block, {x}).sum().backward({}, std::nullopt, false, {x}), expected);
  EXPECT_FALSE(x.grad().defined()) << "nothing accumulated";
  perf::checkpoint(block, {x}).sum().backward();  // the supported way still works
  const auto with_checkpoint = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  block({x}).sum().backward();
  EXPECT_TRUE(torch::allclose(with_checkpoint, x.grad(), 1e-6, 1e-6));
}

// The first block of a model sees the data, which does not require grad: its
// parameters must still get their gradients (Python's reentrant checkpoint
// loses them with a warning; its non-reentrant one, and this, do not).
TEST(Checkpoint, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(0);
  torch::nn::Linear l1(16, 32), l2(32, 4);
  auto block = [&](const std::vector<torch::Tensor>& in) { return l2(torch::gelu(l1(in[0]))); };
  const auto x = torch::randn({8, 16});  // data: no requires_grad
  auto run = [&](bool ckpt) {
    for (auto& p : l1->parameters()) p.mutable_grad() = torch::Tensor();
    for (auto& p : l2->parameters()) p.mutable_grad() = torch::Tensor();
    auto y = ckpt ? perf::checkpoint(block, {x}) : block({x});
    EXPECT_TRUE(y.requires_grad()) << (ckpt ? "checkpointed" : "plain");
    (y * y).sum().backward();
    return std::vector<torch::Tensor>{y.detach(), l1->weight.grad(), l1->bias.grad(), l2->weight.grad()};
  };
  const auto ref = run(false);
  const auto ck = run(true);
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(ck[i].defined()) << "tensor " << i << " (0: output, 1-3: gradients) is undefined";
    EXPECT_TRUE(torch::allclose(ck[i], ref[i], 1e-6, 1e-6)) << i;
  }
  EXPECT_FALSE(x.grad().defined());
  // Under no_grad nothing is recorded, as without the checkpoint.
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(perf::checkpoint(block, {x}).requires_grad());
}

TEST(Checkpoint, LowersPeakActivationMemory) {
  if (!perf::reset_peak_memory()) GTEST_SKIP() << "skipped: this kernel refuses to reset peak RSS (clear_refs)";
  // A fixed mmap threshold: glibc then returns every large block on free, so
  // RSS follows live memory (its dynamic threshold would keep freed blocks).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // 8 layers with 16384 x 256 activations (16 MiB each, several kept per layer)
  // and small weights (256 KiB), so that activations dominate the peak. Narrow
  // layers: the same memory as 4096 x 1024 for a quarter of the matmul work.
  torch::manual_seed(0);
  std::vector<torch::nn::Linear> layers;
  layers.reserve(8);
  for (int i = 0; i < 8; ++i) layers.emplace_back(256, 256);
  const auto x = torch::randn({16384, 256}, torch::requires_grad());
  auto peak_growth = [&](bool ckpt) {
    torch::Tensor h = x;
    for (auto& l : layers) l->zero_grad();
    perf::reset_peak_memory();
    const auto base = *perf::memory_stats().rss;
    for (auto& l : layers) {
      auto f = [&](const std::vector<torch::Tensor>& in) { return torch::tanh(l(in[0])) * torch::sigmoid(in[0]); };
      h = ckpt ? perf::checkpoint(f, {h}) : f({h});
    }
    h.sum().backward();
    return *perf::memory_stats().peak_rss - base;
  };
  peak_growth(false);  // warm the allocator
  const auto plain = peak_growth(false);
  const auto ckpt = peak_growth(true);
  std::cout << "peak RSS growth: plain " << plain / (1 << 20) << " MiB, checkpointed " << ckpt / (1 << 20) << " MiB\n";
  // Per-layer checkpoints keep each layer's input (16 MiB x 8) instead of ~4
  // activations per layer; backward recomputes one layer at a time.
  EXPECT_LT(ckpt, plain * 2 / 3);
}

// ---- perf/attention.h: LibTorch's attention layers through scaled_dot_product_attention, against Python's ----

namespace {

const char* const ATTENTION_PY =
    "import torch, torch.nn as nn\n"
    "torch.manual_seed(0)\n"
    "E, H, L, S, N = 16, 4, 7, 5, 3\n"
    "x, kv, v2 = torch.randn(L, N, E), torch.randn(S, N, E), torch.randn(S, N, E)\n"
    "k8, v6, mem = torch.randn(S, N, 8), torch.randn(S, N, 6), torch.randn(S, N, E)\n"
    "bm = torch.rand(L, S) > 0.7\n"
    "bm[:, 0] = False\n"
    "fm = torch.randn(N * H, L, S)\n"
    "kpm = torch.zeros(N, S, dtype=torch.bool)\n"
    "kpm[1, 4] = True\n"
    "kpl = torch.zeros(N, L, dtype=torch.bool)\n"
    "kpl[2, 6] = True\n"
    "causal = nn.Transformer.generate_square_subsequent_mask(L)\n"
    "def perturb(m):\n"
    "    with torch.no_grad():\n"
    "        for p in m.parameters(): p.add_(0.1 * torch.randn_like(p))\n"
    "    return m\n"
    "out = {'x': x, 'kv': kv, 'v2': v2, 'k8': k8, 'v6': v6, 'mem': mem, 'bm': bm, 'fm': fm, 'kpm': kpm, 'kpl': kpl,\n"
    "       'causal': causal}\n"
    "def record(name, module, fn, grad_of):\n"
    "    y = fn(module)\n"
    "    w = torch.randn_like(y)\n"
    "    if module.training:\n"
    "        module.zero_grad()\n"
    "        (y * w).sum().backward()\n"
    "        out[name + '.grad'] = dict(module.named_parameters())[grad_of].grad.clone()\n"
    "    out[name + '.y'] = y.detach()\n"
    "    out[name + '.w'] = w\n";

// One case of ATTENTION_PY's record(): C++'s call of the module, whose output and the named parameter's
// gradient (of sum(y * w), w Python's) must equal what Python recorded under the case's name.
struct AttentionCase {
  std::string name;
  torch::nn::Module* module;
  std::string grad_of;
  std::function<at::Tensor()> run;
};

void expect_like_python(const std::vector<AttentionCase>& cases, const c10::impl::GenericDict& py) {
  const auto t = [&](const std::string& k) { return py.at(k).toTensor(); };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    c.module->zero_grad();
    const at::Tensor y = c.run();
    EXPECT_LE(test_util::max_diff(y, t(c.name + ".y")), 1e-5);
    (y * t(c.name + ".w")).sum().backward();
    const at::Tensor grad = c.module->named_parameters()[c.grad_of].grad();
    ASSERT_TRUE(grad.defined());
    EXPECT_LE(test_util::max_diff(grad, t(c.name + ".grad")), 1e-4);
  }
}

}  // namespace

TEST(Attention, MultiheadAttentionEqualsPythonsWithEveryMaskWhereLibTorchsDoesNot) {
  test_util::TempDir dir;
  const auto file = dir / "mha.pt";
  test_util::python(std::string(ATTENTION_PY) +
                    "m, mk, mb = nn.MultiheadAttention(E, H), nn.MultiheadAttention(E, H, kdim=8, vdim=6), "
                    "nn.MultiheadAttention(E, H, bias=False)\n"
                    "for mod in (m, mk, mb): perturb(mod)\n"
                    "out['m'], out['mk'], out['mb'] = m.state_dict(), mk.state_dict(), mb.state_dict()\n"
                    "a = lambda mod, q, k, v, **kw: mod(q, k, v, need_weights=False, **kw)[0]\n"
                    "record('self', m, lambda mod: a(mod, x, x, x), 'in_proj_weight')\n"
                    "record('cross_kv', m, lambda mod: a(mod, x, kv, kv), 'in_proj_weight')\n"
                    "record('cross', m, lambda mod: a(mod, x, kv, v2), 'in_proj_weight')\n"
                    "record('bool_mask', m, lambda mod: a(mod, x, kv, kv, attn_mask=bm), 'in_proj_weight')\n"
                    "record('mask_3d', m, lambda mod: a(mod, x, kv, kv, attn_mask=fm), 'in_proj_weight')\n"
                    "record('padding', m, lambda mod: a(mod, x, kv, kv, key_padding_mask=kpm), 'in_proj_weight')\n"
                    "record('causal', m, lambda mod: a(mod, x, x, x, attn_mask=causal, is_causal=True), "
                    "'in_proj_weight')\n"
                    "record('causal_padding', m, lambda mod: a(mod, x, x, x, attn_mask=causal, is_causal=True, "
                    "key_padding_mask=kpl), 'in_proj_weight')\n"
                    "record('kdim', mk, lambda mod: a(mod, x, k8, v6), 'k_proj_weight')\n"
                    "record('no_bias', mb, lambda mod: a(mod, x, x, x), 'in_proj_weight')\n"
                    "m.eval()\n"
                    "with torch.no_grad(): record('eval', m, lambda mod: a(mod, x, x, x, key_padding_mask=kpl), '')\n"
                    "torch.save(out, '" +
                    file + "')\n");
  const auto py = perf::load(file).toGenericDict();
  const auto t = [&](const std::string& k) { return py.at(k).toTensor(); };
  const auto module = [&](const std::string& name, torch::nn::MultiheadAttentionOptions o) {
    perf::MultiheadAttention m(o);
    perf::load_state_dict(m, py.at(name));
    return m;
  };
  auto m = module("m", torch::nn::MultiheadAttentionOptions(16, 4));
  auto mk = module("mk", torch::nn::MultiheadAttentionOptions(16, 4).kdim(8).vdim(6));
  auto mb = module("mb", torch::nn::MultiheadAttentionOptions(16, 4).bias(false));
  const auto x = t("x"), kv = t("kv"), v2 = t("v2"), causal = t("causal"), none = at::Tensor();
  const auto a = [](perf::MultiheadAttention& mod, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& padding, const at::Tensor& mask, bool is_causal = false) {
    return std::get<0>(mod(q, k, v, padding, /*need_weights=*/false, mask, true, is_causal));
  };
  const std::vector<AttentionCase> cases = {
      {"self", m.get(), "in_proj_weight", [&] { return a(m, x, x, x, none, none); }},
      {"cross_kv", m.get(), "in_proj_weight", [&] { return a(m, x, kv, kv, none, none); }},
      {"cross", m.get(), "in_proj_weight", [&] { return a(m, x, kv, v2, none, none); }},
      {"bool_mask", m.get(), "in_proj_weight", [&] { return a(m, x, kv, kv, none, t("bm")); }},
      {"mask_3d", m.get(), "in_proj_weight", [&] { return a(m, x, kv, kv, none, t("fm")); }},
      {"padding", m.get(), "in_proj_weight", [&] { return a(m, x, kv, kv, t("kpm"), none); }},
      {"causal", m.get(), "in_proj_weight", [&] { return a(m, x, x, x, none, causal, true); }},
      {"causal_padding", m.get(), "in_proj_weight", [&] { return a(m, x, x, x, t("kpl"), causal, true); }},
      {"kdim", mk.get(), "k_proj_weight", [&] { return a(mk, x, t("k8"), t("v6"), none, none); }},
      {"no_bias", mb.get(), "in_proj_weight", [&] { return a(mb, x, x, x, none, none); }},
  };
  expect_like_python(cases, py);
  m->eval();
  {
    torch::NoGradGuard no_grad;
    EXPECT_LE(test_util::max_diff(a(m, x, x, x, t("kpl"), none), t("eval.y")), 1e-5);
    // A batch-first tensor seen as (L, N, E), not contiguous, gives the same.
    const auto batch_first = x.transpose(0, 1).contiguous().transpose(0, 1);
    EXPECT_LE(test_util::max_diff(a(m, batch_first, batch_first, batch_first, none, none), t("self.y")), 1e-5);
    // With need_weights (the default), LibTorch's own path, which returns the weights.
    const auto [y, weights] = m(x, x, x);
    EXPECT_LE(test_util::max_diff(y, t("self.y")), 1e-5);
    EXPECT_EQ(weights.sizes(), (std::vector<int64_t>{3, 7, 7}));
    // LibTorch 2.11's own MultiheadAttention reads a bool attn_mask otherwise than Python (and perf).
    torch::nn::MultiheadAttention stock(torch::nn::MultiheadAttentionOptions(16, 4));
    perf::load_state_dict(stock, py.at("m"));
    stock->eval();
    std::cout << "LibTorch's MultiheadAttention with a bool attn_mask differs from Python's by "
              << test_util::max_diff(std::get<0>(stock(x, kv, kv, none, true, t("bm"))), t("bool_mask.y")) << "\n";
  }
}

TEST(Attention, TransformerLayersAndStacksEqualPythonsInTrainingAndEval) {
  test_util::TempDir dir;
  const auto file = dir / "layers.pt";
  test_util::python(
      std::string(ATTENTION_PY) +
      "enc_layer = perturb(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0))\n"
      "gelu_layer = perturb(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, activation='gelu'))\n"
      "dec_layer = perturb(nn.TransformerDecoderLayer(E, H, 32, dropout=0.0))\n"
      "enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0), 2, norm=nn.LayerNorm(E),\n"
      "                            enable_nested_tensor=False)\n"
      "dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 32, dropout=0.0), 2, norm=nn.LayerNorm(E))\n"
      "perturb(enc.layers[1]); perturb(dec.layers[1])\n"
      "for k, mod in [('enc_layer', enc_layer), ('gelu_layer', gelu_layer), ('dec_layer', dec_layer), ('enc', enc),\n"
      "               ('dec', dec)]: out[k] = mod.state_dict()\n"
      "g = 'self_attn.in_proj_weight'\n"
      "record('enc_causal', enc_layer, lambda mod: mod(x, src_mask=causal, is_causal=True), g)\n"
      "record('enc_padding', enc_layer, lambda mod: mod(x, src_key_padding_mask=kpl), g)\n"
      "record('gelu', gelu_layer, lambda mod: mod(x, src_mask=causal, is_causal=True), 'linear1.weight')\n"
      "record('dec_layer', dec_layer, lambda mod: mod(x, mem, tgt_mask=causal, tgt_is_causal=True,\n"
      "       memory_key_padding_mask=kpm), 'multihead_attn.in_proj_weight')\n"
      "record('enc', enc, lambda mod: mod(x, mask=causal), 'layers.1.' + g)\n"
      "record('dec', dec, lambda mod: mod(x, mem, tgt_mask=causal, memory_key_padding_mask=kpm), 'layers.1.' + g)\n"
      "enc.eval()\n"
      "with torch.no_grad(): record('enc_eval', enc, lambda mod: mod(x, mask=causal, src_key_padding_mask=kpl), '')\n"
      "torch.save(out, '" +
      file + "')\n");
  const auto py = perf::load(file).toGenericDict();
  const auto t = [&](const std::string& k) { return py.at(k).toTensor(); };
  const auto x = t("x"), mem = t("mem"), causal = t("causal"), kpl = t("kpl"), kpm = t("kpm"), none = at::Tensor();
  using namespace torch::nn;
  const auto layer_options = TransformerEncoderLayerOptions(16, 4).dim_feedforward(32).dropout(0.0);
  const auto decoder_options = TransformerDecoderLayerOptions(16, 4).dim_feedforward(32).dropout(0.0);
  perf::TransformerEncoderLayer enc_layer(layer_options);
  perf::TransformerEncoderLayer gelu_layer(TransformerEncoderLayerOptions(layer_options).activation(torch::kGELU));
  perf::TransformerDecoderLayer dec_layer(decoder_options);
  perf::TransformerEncoder enc(TransformerEncoderOptions(TransformerEncoderLayer(layer_options), 2)
                                   .norm(AnyModule(LayerNorm(LayerNormOptions({16})))));
  perf::TransformerDecoder dec(TransformerDecoderOptions(TransformerDecoderLayer(decoder_options), 2)
                                   .norm(AnyModule(LayerNorm(LayerNormOptions({16})))));
  // Python's names: a strict load of each state_dict.
  perf::load_state_dict(enc_layer, py.at("enc_layer"));
  perf::load_state_dict(gelu_layer, py.at("gelu_layer"));
  perf::load_state_dict(dec_layer, py.at("dec_layer"));
  perf::load_state_dict(enc, py.at("enc"));
  perf::load_state_dict(dec, py.at("dec"));
  const std::string g = "self_attn.in_proj_weight";
  const std::vector<AttentionCase> cases = {
      {"enc_causal", enc_layer.get(), g, [&] { return enc_layer(x, causal, none, true); }},
      {"enc_padding", enc_layer.get(), g, [&] { return enc_layer(x, none, kpl); }},
      {"gelu", gelu_layer.get(), "linear1.weight", [&] { return gelu_layer(x, causal, none, true); }},
      {"dec_layer", dec_layer.get(), "multihead_attn.in_proj_weight",
       [&] { return dec_layer(x, mem, causal, none, none, kpm, true); }},
      {"enc", enc.get(), "layers.1." + g, [&] { return enc(x, causal); }},
      {"dec", dec.get(), "layers.1." + g, [&] { return dec(x, mem, causal, none, none, kpm); }},
  };
  expect_like_python(cases, py);
  enc->eval();
  torch::NoGradGuard no_grad;
  EXPECT_LE(test_util::max_diff(enc(x, causal, kpl), t("enc_eval.y")), 1e-5);
  // The stack's layers are copies of the options' layer: LibTorch's TransformerEncoder of the same layer.
  TransformerEncoderLayer stock_layer(layer_options);
  perf::TransformerEncoder copied(TransformerEncoderOptions(stock_layer, 3));
  TransformerEncoder stock(TransformerEncoderOptions(stock_layer, 3));
  stock->eval();
  copied->eval();
  EXPECT_EQ(perf::state_dict(copied).size(), perf::state_dict(stock).size());
  EXPECT_LE(test_util::max_diff(copied(x), stock(x)), 1e-5);
}

// What LibTorch's layer options lack and Python's layers take: norm_first and batch_first
// (perf::TransformerLayerOptions).
TEST(Attention, NormFirstAndBatchFirstLayersAndStacksEqualPythons) {
  test_util::TempDir dir;
  const auto file = dir / "pre.pt";
  test_util::python(
      std::string(ATTENTION_PY) +
      "xb, memb = x.transpose(0, 1).contiguous(), mem.transpose(0, 1).contiguous()\n"
      "out['xb'], out['memb'] = xb, memb\n"
      "kw = dict(dropout=0.0, norm_first=True, batch_first=True)\n"
      "pre = perturb(nn.TransformerEncoderLayer(E, H, 32, **kw))\n"
      "pre_seq = perturb(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, norm_first=True))\n"
      "post_bf = perturb(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True))\n"
      "pre_dec = perturb(nn.TransformerDecoderLayer(E, H, 32, **kw))\n"
      "enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, **kw), 2, norm=nn.LayerNorm(E),\n"
      "                            enable_nested_tensor=False)\n"
      "dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 32, **kw), 2, norm=nn.LayerNorm(E))\n"
      "perturb(enc.layers[1]); perturb(dec.layers[1])\n"
      "for k, mod in [('pre', pre), ('pre_seq', pre_seq), ('post_bf', post_bf), ('pre_dec', pre_dec), ('enc', enc),\n"
      "               ('dec', dec)]: out[k] = mod.state_dict()\n"
      "g = 'self_attn.in_proj_weight'\n"
      "record('pre', pre, lambda mod: mod(xb, src_mask=causal, is_causal=True, src_key_padding_mask=kpl), g)\n"
      "record('pre_seq', pre_seq, lambda mod: mod(x, src_mask=causal, is_causal=True), 'linear1.weight')\n"
      "record('post_bf', post_bf, lambda mod: mod(xb, src_key_padding_mask=kpl), g)\n"
      "record('pre_dec', pre_dec, lambda mod: mod(xb, memb, tgt_mask=causal, tgt_is_causal=True,\n"
      "       memory_key_padding_mask=kpm), 'multihead_attn.in_proj_weight')\n"
      "record('enc', enc, lambda mod: mod(xb, mask=causal), 'layers.1.' + g)\n"
      "record('dec', dec, lambda mod: mod(xb, memb, tgt_mask=causal, memory_key_padding_mask=kpm), 'layers.1.' + g)\n"
      "enc.eval()\n"
      "with torch.no_grad(): record('enc_eval', enc, lambda mod: mod(xb, mask=causal, src_key_padding_mask=kpl), '')\n"
      "torch.save(out, '" +
      file + "')\n");
  const auto py = perf::load(file).toGenericDict();
  const auto t = [&](const std::string& k) { return py.at(k).toTensor(); };
  const auto x = t("x"), xb = t("xb"), memb = t("memb"), causal = t("causal"), kpl = t("kpl"), kpm = t("kpm"),
             none = at::Tensor();
  using namespace torch::nn;
  const auto layer_options = TransformerEncoderLayerOptions(16, 4).dim_feedforward(32).dropout(0.0);
  const auto decoder_options = TransformerDecoderLayerOptions(16, 4).dim_feedforward(32).dropout(0.0);
  const auto pre_bf = perf::TransformerLayerOptions().norm_first(true).batch_first(true);
  perf::TransformerEncoderLayer pre(layer_options, pre_bf);
  perf::TransformerEncoderLayer pre_seq(layer_options, perf::TransformerLayerOptions().norm_first(true));
  perf::TransformerEncoderLayer post_bf(layer_options, perf::TransformerLayerOptions().batch_first(true));
  perf::TransformerDecoderLayer pre_dec(decoder_options, pre_bf);
  perf::TransformerEncoder enc(TransformerEncoderOptions(TransformerEncoderLayer(layer_options), 2)
                                   .norm(AnyModule(LayerNorm(LayerNormOptions({16})))),
                               pre_bf);
  perf::TransformerDecoder dec(TransformerDecoderOptions(TransformerDecoderLayer(decoder_options), 2)
                                   .norm(AnyModule(LayerNorm(LayerNormOptions({16})))),
                               pre_bf);
  // The same parameters and names as without the options: Python's state_dicts load strictly.
  perf::load_state_dict(pre, py.at("pre"));
  perf::load_state_dict(pre_seq, py.at("pre_seq"));
  perf::load_state_dict(post_bf, py.at("post_bf"));
  perf::load_state_dict(pre_dec, py.at("pre_dec"));
  perf::load_state_dict(enc, py.at("enc"));
  perf::load_state_dict(dec, py.at("dec"));
  const std::string g = "self_attn.in_proj_weight";
  const std::vector<AttentionCase> cases = {
      {"pre", pre.get(), g, [&] { return pre(xb, causal, kpl, true); }},
      {"pre_seq", pre_seq.get(), "linear1.weight", [&] { return pre_seq(x, causal, none, true); }},
      {"post_bf", post_bf.get(), g, [&] { return post_bf(xb, none, kpl); }},
      {"pre_dec", pre_dec.get(), "multihead_attn.in_proj_weight",
       [&] { return pre_dec(xb, memb, causal, none, none, kpm, true); }},
      {"enc", enc.get(), "layers.1." + g, [&] { return enc(xb, causal); }},
      {"dec", dec.get(), "layers.1." + g, [&] { return dec(xb, memb, causal, none, none, kpm); }},
  };
  expect_like_python(cases, py);
  enc->eval();
  torch::NoGradGuard no_grad;
  EXPECT_LE(test_util::max_diff(enc(xb, causal, kpl), t("enc_eval.y")), 1e-5);
  EXPECT_TRUE(enc->layers[0]->as<perf::TransformerEncoderLayerImpl>()->layer_options.norm_first())
      << "the stack's layers carry its layer options";
  // The options change the result: the same weights without them answer otherwise.
  perf::TransformerEncoderLayer post(layer_options);
  perf::load_state_dict(post, py.at("pre"));
  EXPECT_GT(test_util::max_diff(post(x), pre(xb).transpose(0, 1)), 1e-2);
}

// Python's nn.MultiheadAttention(batch_first=True): (N, L, E) in and out, the weights (N, L, S), on both paths.
TEST(Attention, ABatchFirstMultiheadAttentionEqualsPythons) {
  test_util::TempDir dir;
  const auto file = dir / "mha_bf.pt";
  test_util::python(
      std::string(ATTENTION_PY) +
      "xb, kvb = x.transpose(0, 1).contiguous(), kv.transpose(0, 1).contiguous()\n"
      "out['xb'], out['kvb'] = xb, kvb\n"
      "m = perturb(nn.MultiheadAttention(E, H, batch_first=True))\n"
      "out['m'] = m.state_dict()\n"
      "a = lambda mod, q, k, v, **kw: mod(q, k, v, need_weights=False, **kw)[0]\n"
      "record('self', m, lambda mod: a(mod, xb, xb, xb), 'in_proj_weight')\n"
      "record('cross_padding', m, lambda mod: a(mod, xb, kvb, kvb, key_padding_mask=kpm), 'in_proj_weight')\n"
      "record('causal', m, lambda mod: a(mod, xb, xb, xb, attn_mask=causal, is_causal=True), 'out_proj.weight')\n"
      "record('weights', m, lambda mod: mod(xb, kvb, kvb)[0], 'in_proj_weight')\n"
      "out['weights.attn'] = m(xb, kvb, kvb)[1].detach()\n"
      "m.eval()\n"
      "with torch.no_grad(): record('eval', m, lambda mod: a(mod, xb, xb, xb, key_padding_mask=kpl), '')\n"
      "torch.save(out, '" +
      file + "')\n");
  const auto py = perf::load(file).toGenericDict();
  const auto t = [&](const std::string& k) { return py.at(k).toTensor(); };
  perf::MultiheadAttention m(torch::nn::MultiheadAttentionOptions(16, 4), perf::AttentionOptions().batch_first(true));
  perf::load_state_dict(m, py.at("m"));  // the same names and shapes as without the option
  const auto xb = t("xb"), kvb = t("kvb"), none = at::Tensor();
  const auto a = [](perf::MultiheadAttention& mod, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& padding,
                    const at::Tensor& mask, bool is_causal = false) {
    return std::get<0>(mod(q, kv, kv, padding, /*need_weights=*/false, mask, true, is_causal));
  };
  const std::vector<AttentionCase> cases = {
      {"self", m.get(), "in_proj_weight", [&] { return a(m, xb, xb, none, none); }},
      {"cross_padding", m.get(), "in_proj_weight", [&] { return a(m, xb, kvb, t("kpm"), none); }},
      {"causal", m.get(), "out_proj.weight", [&] { return a(m, xb, xb, none, t("causal"), true); }},
      {"weights", m.get(), "in_proj_weight", [&] { return std::get<0>(m(xb, kvb, kvb)); }},
  };
  expect_like_python(cases, py);
  EXPECT_EQ(std::get<0>(m(xb, kvb, kvb)).sizes(), xb.sizes()) << "(N, L, E) out";
  EXPECT_LE(test_util::max_diff(std::get<1>(m(xb, kvb, kvb)), t("weights.attn")), 1e-5) << "(N, L, S) weights";
  // A clone keeps the option, and the option is the sequence-first module on the transposed batch.
  const auto copy = std::dynamic_pointer_cast<perf::MultiheadAttentionImpl>(m->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(copy->attention_options.batch_first());
  m->eval();
  copy->eval();
  torch::NoGradGuard no_grad;
  EXPECT_LE(test_util::max_diff(a(m, xb, xb, t("kpl"), none), t("eval.y")), 1e-5);
  EXPECT_LE(test_util::max_diff(std::get<0>(copy->forward(xb, xb, xb, t("kpl"), false)), t("eval.y")), 1e-5);
  perf::MultiheadAttention seq(torch::nn::MultiheadAttentionOptions(16, 4));
  perf::load_state_dict(seq, py.at("m"));
  seq->eval();
  EXPECT_LE(test_util::max_diff(a(seq, t("x"), t("x"), none, none).transpose(0, 1), a(m, xb, xb, none, none)), 1e-5)
      << "the same weights without the option, on (L, N, E)";
}

// LibTorch's clone() of a class derived from one of its modules makes the base class: a perf stack's clone then
// held LibTorch's layers, and its forward crashed on them. perf's clone as themselves.
TEST(Attention, ACloneIsPerfsClassWithItsOptionsWeightsAndModes) {
  using namespace torch::nn;
  torch::manual_seed(3);
  const auto options = TransformerEncoderLayerOptions(16, 4).dim_feedforward(32).dropout(0.0);
  const auto pre_bf = perf::TransformerLayerOptions().norm_first(true).batch_first(true);
  perf::TransformerEncoder enc(
      TransformerEncoderOptions(TransformerEncoderLayer(options), 2).norm(AnyModule(LayerNorm(LayerNormOptions({16})))),
      pre_bf);
  perf::TransformerDecoderLayer dec(TransformerDecoderLayerOptions(16, 4).dim_feedforward(32).dropout(0.0), pre_bf);
  perf::MultiheadAttention mha(MultiheadAttentionOptions(16, 4));
  {
    torch::NoGradGuard no_grad;  // away from the values a fresh module starts with
    for (auto& p : enc->parameters()) p.add_(0.1 * torch::randn_like(p));
    for (auto& p : dec->parameters()) p.add_(0.1 * torch::randn_like(p));
    for (auto& p : mha->parameters()) p.add_(0.1 * torch::randn_like(p));
  }
  const auto layer = [](perf::TransformerEncoder& e, size_t i) {
    return e->layers[i]->as<perf::TransformerEncoderLayerImpl>();
  };
  layer(enc, 1)->linear1->weight.requires_grad_(false);
  enc->layers[0]->eval();
  auto copy = std::dynamic_pointer_cast<perf::TransformerEncoderImpl>(enc->clone());
  ASSERT_TRUE(copy);
  perf::TransformerEncoder enc_copy(copy);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_NE(layer(enc_copy, i), nullptr) << "the stack's layers stay perf's";
    EXPECT_TRUE(layer(enc_copy, i)->layer_options.norm_first() && layer(enc_copy, i)->layer_options.batch_first());
  }
  EXPECT_FALSE(enc_copy->layers[0]->is_training());
  EXPECT_FALSE(layer(enc_copy, 0)->self_attn->is_training());
  EXPECT_TRUE(enc_copy->layers[1]->is_training());
  EXPECT_FALSE(layer(enc_copy, 1)->linear1->weight.requires_grad());
  EXPECT_TRUE(layer(enc_copy, 1)->linear2->weight.requires_grad());

  const auto x = torch::randn({3, 7, 16}), mem = torch::randn({3, 5, 16});
  const auto causal = TransformerImpl::generate_square_subsequent_mask(7);
  enc->eval();
  enc_copy->eval();
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(enc_copy(x, causal).equal(enc(x, causal)));
  layer(enc_copy, 0)->linear2->bias.add_(1);
  EXPECT_FALSE(enc_copy(x, causal).equal(enc(x, causal))) << "the copy has its own weights";

  auto dec_copy = std::dynamic_pointer_cast<perf::TransformerDecoderLayerImpl>(dec->clone());
  ASSERT_TRUE(dec_copy);
  EXPECT_TRUE(dec_copy->layer_options.norm_first() && dec_copy->layer_options.batch_first());
  dec->eval();
  dec_copy->eval();
  EXPECT_TRUE(dec_copy->forward(x, mem, causal).equal(dec(x, mem, causal)));
  auto mha_copy = std::dynamic_pointer_cast<perf::MultiheadAttentionImpl>(mha->clone());
  ASSERT_TRUE(mha_copy);
  const auto q = x.transpose(0, 1);
  EXPECT_TRUE(std::get<0>(mha_copy->forward(q, q, q, at::Tensor(), false))
                  .equal(std::get<0>(mha(q, q, q, at::Tensor(), false))));
}

TEST(Attention, DropoutRunsInTrainingOnlyAndKeepsTheMean) {
  // Queries and keys all zero, values the input, the output projection the identity: each output is the
  // mean of the kept values, scaled by 1 / (1 - p). With values of one, exactly one in eval mode.
  perf::MultiheadAttention m(torch::nn::MultiheadAttentionOptions(8, 2).dropout(0.5));
  {
    torch::NoGradGuard no_grad;
    m->in_proj_weight.zero_();
    m->in_proj_weight.narrow(0, 16, 8).copy_(torch::eye(8));
    m->in_proj_bias.zero_();
    m->out_proj->weight.copy_(torch::eye(8));
    m->out_proj->bias.zero_();
  }
  const auto x = torch::ones({16, 64, 8});
  torch::NoGradGuard no_grad;
  m->eval();
  const auto e = std::get<0>(m(x, x, x, at::Tensor(), false));
  EXPECT_LE(test_util::max_diff(e, torch::ones_like(e)), 1e-6);
  m->train();
  const auto y = std::get<0>(m(x, x, x, at::Tensor(), false));
  EXPECT_NEAR(y.mean().item<double>(), 1.0, 0.02) << "kept values scaled by 1 / (1 - p)";
  EXPECT_GT(y.std().item<double>(), 0.1) << "dropout is active in training";
  EXPECT_FALSE(y.equal(std::get<0>(m(x, x, x, at::Tensor(), false)))) << "new draws each call";
}

TEST(Attention, BadMasksAreRefusedNamingTheExpectedShape) {
  perf::MultiheadAttention m(torch::nn::MultiheadAttentionOptions(16, 4));
  const auto x = torch::randn({7, 3, 16});
  const auto call = [&](const at::Tensor& padding, const at::Tensor& mask, bool is_causal = false) {
    return std::get<0>(m(x, x, x, padding, false, mask, true, is_causal));
  };
  PERF_EXPECT_THROW_MSG(call({}, torch::zeros({7, 6})),
                        "the shape of the 2D attn_mask is [7, 6], but should be [7, 7]");
  PERF_EXPECT_THROW_MSG(call({}, torch::zeros({4, 7, 7})), "it must be [7, 7] or [12, 7, 7]");
  PERF_EXPECT_THROW_MSG(call(torch::zeros({3, 6}, torch::kBool), {}), "expecting key_padding_mask shape of [3, 7]");
  PERF_EXPECT_THROW_MSG(call({}, torch::zeros({7, 7}, torch::kInt)),
                        "attn_mask is Int; only bool and floating types of attn_mask are supported");
  PERF_EXPECT_THROW_MSG(call({}, {}, true), "is_causal is a hint that attn_mask is the causal mask, and needs it");
  PERF_EXPECT_THROW_MSG(std::get<0>(m(x, x.narrow(1, 0, 2), x.narrow(1, 0, 2), at::Tensor(), false)),
                        "key and value must have query's batch");
  PERF_EXPECT_THROW_MSG(perf::TransformerEncoder(
                            torch::nn::TransformerEncoderOptions(torch::nn::TransformerEncoderLayerOptions(16, 4), 0)),
                        "num_layers is 0; it must be at least 1");
}

TEST(Attention, OnGpuTheLayerMatchesLibTorchsAndKeepsNoAttentionMatrix) {
  if (!test_util::has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  const torch::Device cuda(torch::kCUDA);
  const auto options = torch::nn::TransformerEncoderLayerOptions(256, 4).dim_feedforward(512).dropout(0.0);
  torch::nn::TransformerEncoderLayer stock(options), reference(options);
  perf::TransformerEncoderLayer fast(options);
  perf::load_state_dict(fast, perf::state_dict(stock));
  perf::load_state_dict(reference, perf::state_dict(stock));
  stock->to(cuda, torch::kBFloat16);
  fast->to(cuda, torch::kBFloat16);
  reference->to(cuda);  // fp32
  const int64_t L = 2048, N = 4;
  const auto x = torch::randn({L, N, 256}, torch::TensorOptions().device(cuda));
  const auto causal = torch::nn::TransformerImpl::generate_square_subsequent_mask(L).to(cuda);
  const auto xb = x.to(torch::kBFloat16), causal_b = causal.to(torch::kBFloat16);
  const auto peak_of = [&](const std::function<at::Tensor()>& step, at::Tensor& out) {
    torch::cuda::synchronize();
    perf::reset_peak_memory(cuda);
    const int64_t before = perf::memory_stats(cuda).allocated.value_or(0);
    out = step();
    out.to(torch::kFloat).sum().backward();
    torch::cuda::synchronize();
    return perf::memory_stats(cuda).peak_allocated.value_or(0) - before;
  };
  at::Tensor a, b;
  const int64_t stock_peak = peak_of([&] { return stock(xb, causal_b); }, a);
  const int64_t fast_peak = peak_of([&] { return fast(xb, causal_b, at::Tensor(), true); }, b);
  // Both in bf16 against the fp32 layer: perf's error no larger than LibTorch's, beyond rounding.
  at::Tensor r;
  {
    torch::NoGradGuard no_grad;
    r = reference(x, causal);
  }
  const auto mean_error = [&](const at::Tensor& y) { return (y.to(torch::kFloat) - r).abs().mean().item<double>(); };
  EXPECT_LE(mean_error(b), 1.5 * mean_error(a) + 1e-3) << "LibTorch's bf16 error " << mean_error(a);
  EXPECT_LE(test_util::max_diff(a.to(torch::kFloat), b.to(torch::kFloat)), 0.25);
  // LibTorch's keeps (N * heads, L, L) weights for backward: 4 x 4 x 2048 x 2048 x 2 bytes = 128 MiB in bf16.
  EXPECT_LT(fast_peak, stock_peak - (64 << 20)) << "perf " << fast_peak << " bytes, LibTorch's " << stock_peak;
}
