// perf/memory_format.h — channels-last for modules and tensors.
//
//   perf::to_channels_last(*model);          // 4-D weights -> channels_last, 5-D -> channels_last_3d, in place
//   perf::to_channels_last(*model, opt);     // ... and the optimizer's per-parameter state (resumed training)
//   auto x = perf::channels_last(images);    // NCHW tensor in NHWC memory order
//
// Tensor cores and cuDNN's fastest convolution kernels want NHWC; oneDNN on the
// CPU too. Conversion keeps parameter identity, so an optimizer that holds the
// parameters keeps them, and existing gradients are converted alike. An
// optimizer that already has state (moments, momentum buffers) must be passed
// too: fused CUDA kernels require state strides to match the parameter's.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/optim.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <vector>

namespace perf {

/// The channels-last format for a tensor of this rank: channels_last (4-D),
/// channels_last_3d (5-D); other ranks are an error.
PERF_INLINE c10::MemoryFormat channels_last_format(int64_t dim);

/// `t` in channels-last memory order (same shape and values).
PERF_INLINE at::Tensor channels_last(const at::Tensor& t);

/// Converts every 4-D / 5-D parameter and buffer of `module` (recursively) in
/// place; other tensors are left alone. Returns how many tensors changed layout.
PERF_INLINE int64_t to_channels_last(torch::nn::Module& module);

namespace detail {
// The per-parameter state tensors of the optimizers perf knows; nullopt for an
// unknown state type (the caller refuses rather than guess).
PERF_INLINE std::optional<std::vector<at::Tensor*>> state_tensors(torch::optim::OptimizerParamState& s);
}  // namespace detail

/// to_channels_last(module), plus every per-parameter state tensor of
/// `optimizer` shaped like its parameter (Adam/AdamW moments, SGD/RMSprop
/// buffers, of perf::optim and torch::optim), so the next step runs on
/// matching strides. An unknown state type is refused before anything changes.
PERF_INLINE int64_t to_channels_last(torch::nn::Module& module, torch::optim::Optimizer& optimizer);

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/memory_format-inl.h>
#endif
