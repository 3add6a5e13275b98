// perf/impl/memory_format-inl.h — the out-of-line definitions of perf/memory_format.h.
// Included by perf/memory_format.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/detail/cpu.h>
#include <perf/memory_format.h>
#include <torch/nn/modules/conv.h>

#include <algorithm>
#include <sstream>
#include <variant>

namespace perf {

PERF_INLINE c10::MemoryFormat channels_last_format(int64_t dim) {
  TORCH_CHECK(dim == 4 || dim == 5, "perf::channels_last: needs a 4-D (NCHW) or 5-D (NCDHW) tensor, got ", dim, "-D");
  return dim == 4 ? c10::MemoryFormat::ChannelsLast : c10::MemoryFormat::ChannelsLast3d;
}

PERF_INLINE at::Tensor channels_last(const at::Tensor& t) { return t.contiguous(channels_last_format(t.dim())); }

PERF_INLINE int64_t to_channels_last(torch::nn::Module& module) {
  const int64_t changed = detail::convert_to_channels_last(module);
  detail::warn_onednn_1x1_hazards(module);
  return changed;
}

namespace detail {

PERF_INLINE int64_t convert_to_channels_last(torch::nn::Module& module) {
  int64_t changed = 0;
  auto convert = [&](at::Tensor& t) {
    if (!t.defined() || (t.dim() != 4 && t.dim() != 5)) return;
    const auto fmt = channels_last_format(t.dim());
    if (t.is_contiguous(fmt)) return;  // already (or trivially, e.g. 1x1 kernels) channels-last
    at::NoGradGuard no_grad;
    t.set_data(t.contiguous(fmt));  // same TensorImpl: optimizers keep their references
    if (t.grad().defined()) t.mutable_grad() = t.grad().contiguous(fmt);
    ++changed;
  };
  for (auto& p : module.parameters(/*recurse=*/true)) convert(p);
  for (auto& b : module.buffers(/*recurse=*/true)) convert(b);
  return changed;
}

PERF_INLINE int64_t onednn_ic_block() {
  static const int64_t block =
      missing_cpu_isa("AVX512").empty() ? int64_t{16} : (missing_cpu_isa("AVX2").empty() ? int64_t{8} : int64_t{0});
  return block;
}

PERF_INLINE std::vector<std::string> onednn_1x1_hazards(torch::nn::Module& module, int64_t block) {
  std::vector<std::string> found;
  auto check = [&](const torch::nn::Module& m, const std::string& name) {
    const auto* conv = dynamic_cast<const torch::nn::Conv2dImpl*>(&m);
    if (conv == nullptr || !conv->weight.defined() || !conv->weight.requires_grad() || !conv->weight.is_cpu()) return;
    const auto& o = conv->options;
    const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
    const bool unpadded = padding == nullptr ? std::holds_alternative<torch::enumtype::kValid>(o.padding())
                                             : (*padding)->at(0) == 0 && (*padding)->at(1) == 0;
    const bool one_by_one = o.kernel_size()->at(0) == 1 && o.kernel_size()->at(1) == 1;
    const bool strided = o.stride()->at(0) > 1 || o.stride()->at(1) > 1;
    if (!one_by_one || !strided || !unpadded || o.groups() != 1 || o.in_channels() >= block) return;
    std::ostringstream what;
    what << name << " (" << o.in_channels() << (o.in_channels() == 1 ? " input channel" : " input channels")
         << ", stride " << o.stride() << ")";
    found.push_back(what.str());
  };
  // Not named_modules(include_self=true): it needs the module in a shared_ptr, and a user's may be on the stack.
  check(module, "the module itself");
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false))
    check(*item.value(), item.key());
  return found;
}

PERF_INLINE void warn_onednn_1x1_hazards(torch::nn::Module& module) {
  const int64_t block = onednn_ic_block();
  if (block == 0 || !at::hasMKLDNN() || !at::globalContext().userEnabledMkldnn()) return;
  const auto found = onednn_1x1_hazards(module, block);
  if (found.empty()) return;
  std::ostringstream names;
  const size_t shown = std::min<size_t>(found.size(), 4);
  for (size_t i = 0; i < shown; ++i) names << (i ? ", " : "") << found[i];
  if (found.size() > shown) names << " and " << found.size() - shown << " more";
  TORCH_WARN(
      "perf::to_channels_last: training this model channels-last on this CPU can hang, crash or compute "
      "wrong weight gradients. oneDNN, in LibTorch 2.11, miscomputes the weight gradient of a strided, unpadded "
      "1x1 convolution whose input is channels-last and which has fewer input channels than its block (",
      block, " on this CPU): uxlfoundation/oneDNN#6035. Here: ", names.str(),
      ". Inference is not affected. To train on the CPU, keep the model contiguous there (do not convert it), "
      "or give these convolutions at least ",
      block, " input channels.");
}

PERF_INLINE std::optional<std::vector<at::Tensor*>> state_tensors(torch::optim::OptimizerParamState& s) {
  using V = std::vector<at::Tensor*>;
  if (auto* a = dynamic_cast<optim::AdamParamState*>(&s))
    return V{&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()};
  if (auto* g = dynamic_cast<optim::SGDParamState*>(&s)) return V{&g->momentum_buffer()};
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&s))
    return V{&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()};
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(&s))
    return V{&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()};
  if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(&s)) return V{&g->momentum_buffer()};
  if (auto* r = dynamic_cast<torch::optim::RMSpropParamState*>(&s))
    return V{&r->square_avg(), &r->momentum_buffer(), &r->grad_avg()};
  if (auto* a = dynamic_cast<torch::optim::AdagradParamState*>(&s)) return V{&a->sum()};
  return std::nullopt;
}

}  // namespace detail

PERF_INLINE int64_t to_channels_last(torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor*> states;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end() || !it->second) continue;
      auto ts = detail::state_tensors(*it->second);
      TORCH_CHECK(ts.has_value(),
                  "perf::to_channels_last: the optimizer has state of a type perf does not know, so it cannot convert "
                  "it; convert the model before the first optimizer step, or create the optimizer after conversion. "
                  "Nothing was changed.");
      for (auto* t : *ts)
        if (t->defined() && t->sizes() == p.sizes()) states.push_back(t);
    }
  }
  const int64_t changed = to_channels_last(module);
  at::NoGradGuard no_grad;
  for (auto* t : states) {
    if (t->dim() != 4 && t->dim() != 5) continue;
    const auto fmt = channels_last_format(t->dim());
    if (!t->is_contiguous(fmt)) *t = t->contiguous(fmt);
  }
  return changed;
}

}  // namespace perf
