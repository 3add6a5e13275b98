// Calls from several threads into perf's inference entry points, as a C++ server makes them: perf::graph (its
// calls take turns on its static buffers; on CUDA a call from another stream waits on the device for the last
// one) and perf::optimize's infer() (side by side on a model in eval(), one at a time where each call switches a
// training model to eval() and back). Also in the ThreadSanitizer build.
#include <gtest/gtest.h>
#include <perf/cuda_graph.h>
#include <perf/model.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "test_util.h"

#if PERF_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

// Runs fn(0) ... fn(n - 1) on n threads released together; rethrows the first failure.
void on_threads(int n, const std::function<void(int)>& fn) {
  std::atomic<int> ready{0};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      ++ready;
      while (ready.load() < n) std::this_thread::yield();
      try {
        fn(t);
      } catch (...) {
        errors[static_cast<size_t>(t)] = std::current_exception();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Says which mode each call ran in: the input where eval() held at the end of the call, zeros where train() did.
// The pause in between lets another thread switch the modes meanwhile; `inside` and `most` count the calls
// running at once.
struct ModeProbeImpl : torch::nn::Module {
  ModeProbeImpl(std::atomic<int>* inside, std::atomic<int>* most, int pause_ms)
      : inside_(inside), most_(most), pause_ms_(pause_ms) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const int now = ++*inside_;
    for (int seen = most_->load(); now > seen && !most_->compare_exchange_weak(seen, now);) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms_));
    --*inside_;
    return is_training() ? torch::zeros_like(x) : x;
  }
  std::atomic<int>*inside_, *most_;
  int pause_ms_;
};
TORCH_MODULE(ModeProbe);

torch::nn::Sequential probed_model(std::atomic<int>* inside, std::atomic<int>* most, int pause_ms) {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::BatchNorm1d(3), ModeProbe(inside, most, pause_ms));
}

}  // namespace

// CPU: the graph runs its function eagerly on the same static buffers, so without turns a call's input could be
// overwritten by another's while the function pauses before reading it.
TEST(Threads, GraphCallsFromSeveralThreadsEachGetTheirOwnOutputs) {
  auto slow_affine = [](const torch::Tensor& t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return t * 2 + 1;
  };
  auto exact = perf::graph(slow_affine, torch::zeros({4}));
  auto bucketed = perf::graph(slow_affine, torch::zeros({4, 3}), perf::GraphOptions().batch_sizes({2, 4, 8}));
  constexpr int kThreads = 4, kCalls = 10;
  std::vector<int> wrong(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    for (int i = 0; i < kCalls; ++i) {
      const auto x = torch::full({4}, 100.0 * t + i);
      if (!torch::equal(exact(x), x * 2 + 1)) ++wrong[static_cast<size_t>(t)];
      const auto b = torch::full({1 + (t + i) % 8, 3}, 100.0 * t + i);  // batches 1 to 8: all buckets, padded
      if (!torch::equal(bucketed(b), b * 2 + 1)) ++wrong[static_cast<size_t>(t)];
    }
  });
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(wrong[static_cast<size_t>(t)], 0) << "thread " << t;
  EXPECT_EQ(bucketed.eager_calls(), 0);
}

// A model left in train() (a BatchNorm that would use the batch's statistics and update its running ones): every
// call must run in eval() mode, and the model ends as it was. Each call switches the modes, so they take turns.
TEST(Threads, InferOnATrainingModelFromSeveralThreadsRunsEveryCallInEvalMode) {
  std::atomic<int> inside{0}, most{0};
  auto model = probed_model(&inside, &most, 2);
  auto optimized = perf::optimize(model, perf::ModelOptions().device(torch::kCPU).channels_last(false).autocast(false));
  ASSERT_TRUE(model->is_training());
  const auto running_mean = model[1]->as<torch::nn::BatchNorm1d>()->running_mean.clone();
  constexpr int kThreads = 4, kCalls = 8;
  std::vector<torch::Tensor> xs, want;
  for (int i = 0; i < kThreads * kCalls; ++i) {
    xs.push_back(torch::randn({5, 3}));
    want.push_back(optimized.infer(xs.back()));
  }
  ASSERT_GT(want[0].abs().max().item<float>(), 0.f) << "the reference ran in eval mode";
  most = 0;
  std::vector<int> wrong(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    for (int i = 0; i < kCalls; ++i) {
      const size_t k = static_cast<size_t>(t) * kCalls + static_cast<size_t>(i);
      if (!torch::allclose(optimized.infer(xs[k]), want[k])) ++wrong[static_cast<size_t>(t)];
    }
  });
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(wrong[static_cast<size_t>(t)], 0) << "thread " << t;
  EXPECT_EQ(most.load(), 1) << "calls that switch modes run one at a time";
  EXPECT_TRUE(model->is_training());
  for (const auto& m : model->modules(/*include_self=*/false)) EXPECT_TRUE(m->is_training()) << m->name();
  EXPECT_TRUE(torch::equal(model[1]->as<torch::nn::BatchNorm1d>()->running_mean, running_mean))
      << "no call ran the BatchNorm in train() mode";
}

// A model in eval() already: nothing to switch, so the calls run side by side (a server's threads), and the
// model is never written to.
TEST(Threads, InferOnAnEvalModelRunsTheCallsSideBySide) {
  std::atomic<int> inside{0}, most{0};
  auto model = probed_model(&inside, &most, 10);
  model->eval();
  auto optimized = perf::optimize(model, perf::ModelOptions().device(torch::kCPU).channels_last(false).autocast(false));
  const auto x = torch::randn({5, 3});
  const auto want = optimized.infer(x);
  most = 0;
  std::vector<int> wrong(4, 0);
  on_threads(4, [&](int t) {
    for (int i = 0; i < 3; ++i)
      if (!torch::allclose(optimized.infer(x), want)) ++wrong[static_cast<size_t>(t)];
  });
  for (int t = 0; t < 4; ++t) EXPECT_EQ(wrong[static_cast<size_t>(t)], 0) << "thread " << t;
  EXPECT_GE(most.load(), 2) << "calls on a model in eval() should overlap";
  EXPECT_FALSE(model->is_training());
  // perf::InferenceScope on a model in eval() writes nothing either, so scopes in several threads may share it.
  on_threads(4, [&](int) {
    perf::InferenceScope scope(model);
    (void)model->forward(x);
  });
  EXPECT_FALSE(model->is_training());
}

// CUDA: each thread on its own stream. The replay spins on the device (a sleep kernel) before it reads its
// input, so a call from another stream that did not wait would copy its input in meanwhile.
TEST(Threads, OnGpuGraphCallsFromThreadsOnTheirOwnStreamsEachGetTheirOwnOutputs) {
#if PERF_WITH_CUDA
  if (!test_util::has_cuda()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  auto slow_affine = [](const torch::Tensor& t) {
    at::cuda::sleep(1000000);  // about 0.5 ms
    return t * 2 + 1;
  };
  auto g = perf::graph(slow_affine, torch::zeros({1 << 16}, torch::kCUDA));
  ASSERT_TRUE(g.graphed());
  constexpr int kThreads = 4, kCalls = 10;
  std::vector<int> wrong(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    const auto stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
    c10::cuda::CUDAStreamGuard guard(stream);
    for (int i = 0; i < kCalls; ++i) {
      const auto x = torch::full({1 << 16}, 100.0 * t + i, torch::kCUDA);
      const auto y = g(x);
      if (!torch::equal(y.cpu(), (x * 2 + 1).cpu())) ++wrong[static_cast<size_t>(t)];
    }
  });
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(wrong[static_cast<size_t>(t)], 0) << "thread " << t;
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}
