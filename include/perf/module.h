// perf/module.h — one way to pass "a module" to perf, whatever its shape.
//
//   struct Net : torch::nn::Module { ... };           Net net;            perf::InferenceScope s(net);
//   TORCH_MODULE(Net) / torch::nn::Sequential seq;    perf::TrainStep step(seq, ...);
//   auto net = std::make_shared<Net>();               perf::TrainStep step(net, ...);
//
// perf::ModuleRef converts implicitly from a plain module (by reference), a
// ModuleHolder (Sequential, TORCH_MODULE types) and a std::shared_ptr to a
// module; holders and shared_ptrs are kept alive by the ModuleRef.
#pragma once

#include <c10/util/Exception.h>
#include <perf/config.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <type_traits>

namespace perf {

class ModuleRef {
 public:
  ModuleRef(torch::nn::Module& module) : module_(&module) {}  // NOLINT: implicit by design
  template <typename T>
  ModuleRef(const torch::nn::ModuleHolder<T>& holder)  // NOLINT
      : module_(holder.is_empty() ? nullptr : holder.ptr().get()), keep_(holder.is_empty() ? nullptr : holder.ptr()) {
    TORCH_CHECK(module_ != nullptr, "perf: the module holder is empty");
  }
  template <typename T, std::enable_if_t<std::is_base_of_v<torch::nn::Module, T>, int> = 0>
  ModuleRef(const std::shared_ptr<T>& module) : module_(module.get()), keep_(module) {  // NOLINT
    TORCH_CHECK(module_ != nullptr, "perf: null std::shared_ptr to a module");
  }

  torch::nn::Module& operator*() const noexcept { return *module_; }
  torch::nn::Module* operator->() const noexcept { return module_; }
  torch::nn::Module& get() const noexcept { return *module_; }

 private:
  torch::nn::Module* module_;
  std::shared_ptr<torch::nn::Module> keep_;
};

}  // namespace perf
