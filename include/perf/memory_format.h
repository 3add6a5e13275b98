// perf/memory_format.h — channels-last for modules and tensors.
//
//   perf::to_channels_last(*model);          // 4-D weights -> channels_last, 5-D -> channels_last_3d, in place
//   auto x = perf::channels_last(images);    // NCHW tensor in NHWC memory order
//
// Tensor cores and cuDNN's fastest convolution kernels want NHWC; oneDNN on the
// CPU too. Conversion keeps parameter identity, so optimizers that already hold
// the parameters keep working, and converts existing gradients alike.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <torch/nn/module.h>

namespace perf {

/// The channels-last format for a tensor of this rank: channels_last (4-D),
/// channels_last_3d (5-D); other ranks are an error.
inline c10::MemoryFormat channels_last_format(int64_t dim) {
  TORCH_CHECK(dim == 4 || dim == 5, "perf::channels_last: needs a 4-D (NCHW) or 5-D (NCDHW) tensor, got ", dim, "-D");
  return dim == 4 ? c10::MemoryFormat::ChannelsLast : c10::MemoryFormat::ChannelsLast3d;
}

/// `t` in channels-last memory order (same shape and values).
inline at::Tensor channels_last(const at::Tensor& t) { return t.contiguous(channels_last_format(t.dim())); }

/// Converts every 4-D / 5-D parameter and buffer of `module` (recursively) in
/// place; other tensors are left alone. Returns how many tensors changed layout.
inline int64_t to_channels_last(torch::nn::Module& module) {
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

}  // namespace perf
