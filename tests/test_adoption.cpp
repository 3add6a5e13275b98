// Adopting perf in an existing LibTorch program (issue 17): checkpoints that
// move between torch::optim and perf::optim, defaults that keep results,
// modules of every shape, TrainStep in a real loop.
#include <gtest/gtest.h>
#include <perf/cuda_graph.h>
#include <perf/data.h>
#include <perf/model.h>
#include <perf/optim.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <memory>

#include "test_util.h"

namespace {

// The usual LibTorch style: a plain struct, registered submodules.
struct Net : torch::nn::Module {
  Net() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)));
    fc = register_module("fc", torch::nn::Linear(4 * 6 * 6, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv->forward(x));
    return fc->forward(x.view({-1, int64_t{4} * 6 * 6}));  // the line channels-last breaks
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};

struct LinearModel : torch::nn::Module {
  LinearModel() { fc = register_module("fc", torch::nn::Linear(16, 4)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};

using test_util::cat_params;

void train(torch::nn::Module& m, const std::function<torch::Tensor(torch::Tensor)>& fwd, torch::optim::Optimizer& opt,
           int steps, int seed) {
  torch::manual_seed(static_cast<uint64_t>(seed));
  for (int i = 0; i < steps; ++i) {
    const auto x = torch::randn({8, 16});
    opt.zero_grad();
    fwd(x).pow(2).mean().backward();
    opt.step();
  }
  (void)m;
}

// Trains 5 steps with optimizer A, saves, loads into optimizer B, trains 5 more;
// compares with 10 steps of A alone.
template <typename A, typename B, typename OA, typename OB>
void check_switch(const OA& oa, const OB& ob, const std::string& what) {
  const auto path = (std::filesystem::temp_directory_path() / ("perf_switch_" + what + ".pt")).string();
  torch::manual_seed(0);
  auto ref = std::make_shared<LinearModel>();
  auto m = std::make_shared<LinearModel>();
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < m->parameters().size(); ++i) m->parameters()[i].copy_(ref->parameters()[i]);
  }
  A ref_opt(ref->parameters(), oa);
  train(
      *ref, [&](const torch::Tensor& x) { return ref->forward(x); }, ref_opt, 5, 1);
  train(
      *ref, [&](const torch::Tensor& x) { return ref->forward(x); }, ref_opt, 5, 2);

  A first(m->parameters(), oa);
  train(
      *m, [&](const torch::Tensor& x) { return m->forward(x); }, first, 5, 1);
  torch::save(first, path);
  B second(m->parameters(), ob);
  torch::load(second, path);
  train(
      *m, [&](const torch::Tensor& x) { return m->forward(x); }, second, 5, 2);
  EXPECT_LE((cat_params(*m) - cat_params(*ref)).abs().max().item<double>(), 1e-6) << what;
  EXPECT_GT((cat_params(*m) - cat_params(*std::make_shared<LinearModel>())).abs().max().item<double>(), 0.0);
  std::filesystem::remove(path);
}

}  // namespace

// --------------------------------------------------------------------------- 1. checkpoints

TEST(Adoption, CheckpointsMoveBetweenTorchOptimAndPerfOptimBothWays) {
  check_switch<torch::optim::SGD, perf::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9),
                                                    perf::optim::SGDOptions(0.1).momentum(0.9), "sgd_to_perf");
  check_switch<perf::optim::SGD, torch::optim::SGD>(perf::optim::SGDOptions(0.1).momentum(0.9),
                                                    torch::optim::SGDOptions(0.1).momentum(0.9), "sgd_to_torch");
  check_switch<torch::optim::Adam, perf::optim::Adam>(torch::optim::AdamOptions(1e-2), perf::optim::AdamOptions(1e-2),
                                                      "adam_to_perf");
  check_switch<perf::optim::Adam, torch::optim::Adam>(perf::optim::AdamOptions(1e-2), torch::optim::AdamOptions(1e-2),
                                                      "adam_to_torch");
  check_switch<torch::optim::AdamW, perf::optim::AdamW>(torch::optim::AdamWOptions(1e-2).amsgrad(true),
                                                        perf::optim::AdamWOptions(1e-2).amsgrad(true), "adamw_to_perf");
  check_switch<perf::optim::AdamW, torch::optim::AdamW>(perf::optim::AdamWOptions(1e-2),
                                                        torch::optim::AdamWOptions(1e-2), "adamw_to_torch");
}

// --------------------------------------------------------------------------- 2. loader defaults

namespace {
struct Range : torch::data::datasets::Dataset<Range> {
  int64_t n;
  explicit Range(int64_t n_) : n(n_) {}
  torch::data::Example<> get(size_t i) override {
    return {torch::full({16}, static_cast<float>(i)), torch::tensor(static_cast<int64_t>(i % 4))};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n); }
};
}  // namespace

TEST(Adoption, LoaderOptionsKeepEverySampleAndTheProgramsChoices) {
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      Range(100).map(torch::data::transforms::Stack<>()), perf::loader_options(32));
  int64_t samples = 0, batches = 0;
  for (auto& b : *loader) {
    samples += b.data.size(0);
    ++batches;
  }
  EXPECT_EQ(samples, 100) << "drop_last is off by default, as in PyTorch";
  EXPECT_EQ(batches, 4);

  const auto mine = torch::data::DataLoaderOptions(32).workers(2).drop_last(true);
  const auto tuned = perf::loader_options(mine);
  EXPECT_EQ(tuned.workers(), 2u) << "an explicit choice is kept";
  EXPECT_TRUE(tuned.drop_last());
  EXPECT_EQ(tuned.batch_size(), 32u);
  ASSERT_TRUE(tuned.max_jobs().has_value());
  EXPECT_EQ(*tuned.max_jobs(), 4u);
  EXPECT_EQ(perf::describe(tuned, mine), "max_jobs default -> 4");
  const auto plain = perf::loader_options(torch::data::DataLoaderOptions(16));
  EXPECT_GE(plain.workers(), 1u) << "LibTorch's default workers(0) is tuned";
  EXPECT_NE(perf::describe(plain, torch::data::DataLoaderOptions(16)).find("workers 0 -> "), std::string::npos);
  EXPECT_EQ(perf::describe(mine, mine), "unchanged");
  EXPECT_EQ(perf::loader_options(mine, perf::LoaderTuning().workers(3)).workers(), 3u) << "tuning wins";
  // DataLoaderOptions cannot tell an explicit workers(0) from its default 0: the tuning keeps 0.
  const auto zero = perf::loader_options(torch::data::DataLoaderOptions(16), perf::LoaderTuning().workers(0));
  EXPECT_EQ(zero.workers(), 0u);
  EXPECT_FALSE(zero.max_jobs().has_value()) << "no workers, no jobs in flight";
}

// --------------------------------------------------------------------------- 3. channels-last and .view()

TEST(Adoption, ViewAfterAConvolutionUnderChannelsLastNamesTheFix) {
  const auto x = torch::randn({2, 3, 8, 8});
  auto model = perf::optimize(Net(), perf::ModelOptions().autocast(false));
  PERF_EXPECT_THROW_MSG(model(x), "use .reshape(...) or .flatten(1)");
  PERF_EXPECT_THROW_MSG(model(x), "view size is not compatible");
  auto nchw = perf::optimize(Net(), perf::ModelOptions().autocast(false).channels_last(false));
  EXPECT_EQ(nchw(x).sizes(), (std::vector<int64_t>{2, 10}));
}

// --------------------------------------------------------------------------- 4. modules of every shape

TEST(Adoption, ModulesOfEveryShape) {
  torch::manual_seed(0);
  const auto x = torch::randn({3, 16});
  // optimize: temporary plain module, lvalue plain module, shared_ptr, holder.
  auto a = perf::optimize(LinearModel(), perf::ModelOptions().autocast(false));
  EXPECT_EQ(a(x).sizes(), (std::vector<int64_t>{3, 4}));
  LinearModel local;
  auto b = perf::optimize(local, perf::ModelOptions().autocast(false));
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::equal(b(x), local.forward(x))) << "by reference: the same module";
  auto shared = std::make_shared<LinearModel>();
  auto c = perf::optimize(shared, perf::ModelOptions().autocast(false));
  EXPECT_EQ(c.module().get(), shared.get());
  auto holder = torch::nn::Linear(16, 4);
  auto d = perf::optimize(holder, perf::ModelOptions().autocast(false));
  EXPECT_TRUE(torch::equal(d(x), holder->forward(x)));
  // graph: plain module by reference, shared_ptr, holder.
  auto g1 = perf::graph(local, x);
  EXPECT_TRUE(torch::equal(g1(x), local.forward(x)));
  auto g2 = perf::graph(shared, x);
  EXPECT_TRUE(torch::equal(g2(x), shared->forward(x)));
  auto g3 = perf::graph(holder, x);
  EXPECT_TRUE(torch::equal(g3(x), holder->forward(x)));
  // InferenceScope: all three shapes.
  local.train();
  {
    perf::InferenceScope s1(local);
    EXPECT_FALSE(local.is_training());
  }
  EXPECT_TRUE(local.is_training());
  { perf::InferenceScope s2(shared); }
  { perf::InferenceScope s3(holder); }
}

// --------------------------------------------------------------------------- 5. TrainStep in a real loop

TEST(Adoption, TrainStepInARealLoopWithTorchOptimAndTheFirstBatch) {
  auto run = [](bool trainstep) {
    torch::manual_seed(0);
    LinearModel model;
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(1e-2));  // a torch::optim optimizer
    auto loss_fn = [&](const torch::Tensor& x, const torch::Tensor& t) {
      return torch::nn::functional::cross_entropy(model.forward(x), t);
    };
    // 100 samples in batches of 32: the last batch has 4.
    auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        Range(100).map(torch::data::transforms::Stack<>()), perf::loader_options(32, perf::LoaderTuning().workers(0)));
    std::optional<perf::TrainStep> step;
    int64_t samples = 0;
    for (int epoch = 0; epoch < 2; ++epoch) {
      for (auto& batch : *loader) {
        samples += batch.data.size(0);
        const auto x = batch.data / 100.0;
        if (trainstep) {
          if (!step) step.emplace(model, loss_fn, opt, torch::data::Example<>(x, batch.target));
          step->step(x, batch.target);
        } else {
          opt.zero_grad();
          loss_fn(x, batch.target).backward();
          opt.step();
        }
      }
    }
    if (step) {
      EXPECT_EQ(step->eager_steps(), 2) << "the last batch of each epoch ran eagerly, counted";
    }
    EXPECT_EQ(samples, 200);
    return cat_params(model);
  };
  EXPECT_TRUE(torch::equal(run(false), run(true)));
  // A wrong target dtype fails at construction, naming the loss function.
  LinearModel model;
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
  PERF_EXPECT_THROW_MSG(perf::TrainStep(
                            model,
                            [&](const torch::Tensor& x, const torch::Tensor& t) {
                              return torch::nn::functional::nll_loss(model.forward(x), t);
                            },
                            opt, torch::randn({4, 16}), torch::ones({4}, torch::kFloat)),
                        "perf::TrainStep: the loss function failed on the example batch");
  PERF_EXPECT_THROW_MSG(perf::TrainStep(
                            model, [&](const torch::Tensor& x, const torch::Tensor&) { return model.forward(x); }, opt,
                            torch::randn({4, 16}), torch::ones({4})),
                        "must return a floating-point scalar");
}
