// perf/detail/rng.h — saving and restoring the default CPU and CUDA generators
// (activation checkpointing, TrainStep warm-up). Internal to perf.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <perf/config.h>

#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include <mutex>
#include <utility>
#include <vector>

namespace perf::detail {

using RngStates = std::pair<at::Tensor, std::vector<std::pair<c10::DeviceIndex, at::Tensor>>>;  // CPU, CUDA

// Sets the given RNG states; returns the ones it replaced.
inline RngStates swap_rng(const RngStates& states) {
  RngStates prev;
  auto cpu_gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu_gen.mutex());
    prev.first = cpu_gen.get_state();
    cpu_gen.set_state(states.first);
  }
#if PERF_WITH_CUDA
  for (const auto& [idx, state] : states.second) {
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(idx);
    std::lock_guard<std::mutex> l(gen.mutex());
    prev.second.emplace_back(idx, gen.get_state());
    gen.set_state(state);
  }
#endif
  return prev;
}

// The CPU RNG state and that of each CUDA device among `inputs`.
inline RngStates current_rng(const std::vector<at::Tensor>& inputs) {
  RngStates now;
  auto cpu_gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu_gen.mutex());
    now.first = cpu_gen.get_state();
  }
#if PERF_WITH_CUDA
  for (const auto& x : inputs) {
    if (!x.defined() || !x.is_cuda()) continue;
    const auto idx = x.device().index();
    bool seen = false;
    for (const auto& s : now.second) seen = seen || s.first == idx;
    if (seen) continue;
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(idx);
    std::lock_guard<std::mutex> l(gen.mutex());
    now.second.emplace_back(idx, gen.get_state());
  }
#else
  (void)inputs;
#endif
  return now;
}

// Forks the RNG for a scope: the saved states now, the current ones after.
class RngFork {
 public:
  explicit RngFork(const RngStates& states) : prev_(swap_rng(states)) {}
  ~RngFork() { swap_rng(prev_); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStates prev_;
};

}  // namespace perf::detail
