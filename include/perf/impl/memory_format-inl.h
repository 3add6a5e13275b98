// perf/impl/memory_format-inl.h — the out-of-line definitions of perf/memory_format.h.
// Included by perf/memory_format.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/memory_format.h>

namespace perf {

PERF_INLINE c10::MemoryFormat channels_last_format(int64_t dim) {
  TORCH_CHECK(dim == 4 || dim == 5, "perf::channels_last: needs a 4-D (NCHW) or 5-D (NCDHW) tensor, got ", dim, "-D");
  return dim == 4 ? c10::MemoryFormat::ChannelsLast : c10::MemoryFormat::ChannelsLast3d;
}

PERF_INLINE at::Tensor channels_last(const at::Tensor& t) { return t.contiguous(channels_last_format(t.dim())); }

PERF_INLINE int64_t to_channels_last(torch::nn::Module& module) {
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

namespace detail {

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
