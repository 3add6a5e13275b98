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
//
// On the CPU, LibTorch 2.11's oneDNN computes the weight gradient of a strided
// 1x1 convolution wrongly when its input is channels-last and it has fewer input
// channels than oneDNN's block (uxlfoundation/oneDNN#6035): it hangs, crashes or
// returns wrong numbers. to_channels_last warns when a module it converts has
// such a convolution on the CPU; it cannot fix it, since the layout of the
// activations, not of the weight, is what reaches the bug.
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
#include <string>
#include <vector>

namespace perf {

/// The channels-last format for a tensor of this rank: channels_last (4-D),
/// channels_last_3d (5-D); other ranks are an error.
PERF_INLINE c10::MemoryFormat channels_last_format(int64_t dim);

/// `t` in channels-last memory order (same shape and values).
PERF_INLINE at::Tensor channels_last(const at::Tensor& t);

/// Converts every 4-D / 5-D parameter and buffer of `module` (recursively) in
/// place; other tensors are left alone. Returns how many tensors changed layout.
/// Warns (TORCH_WARN) when training the result on this CPU would meet
/// uxlfoundation/oneDNN#6035 (see the top of this header).
PERF_INLINE int64_t to_channels_last(torch::nn::Module& module);

namespace detail {
// to_channels_last(module) without the warning: perf::optimize converts back
// and forth while it measures, and warns once for the layout it keeps.
PERF_INLINE int64_t convert_to_channels_last(torch::nn::Module& module);

// oneDNN's input-channel block for its 1x1 convolution kernels on this CPU:
// 16 with AVX-512 (avx512_core), 8 with AVX2, 0 where the bug is not known.
PERF_INLINE int64_t onednn_ic_block();

// The Conv2d modules of `module` whose weight gradient on the CPU meets
// oneDNN#6035 with channels-last inputs: a trainable CPU weight, a 1x1 kernel,
// a stride above 1, no padding, one group, fewer than `block` input channels.
// Each as "name (N input channels, stride [a, b])".
PERF_INLINE std::vector<std::string> onednn_1x1_hazards(torch::nn::Module& module, int64_t block);

// TORCH_WARN naming those convolutions, when oneDNN is on and there are any.
PERF_INLINE void warn_onednn_1x1_hazards(torch::nn::Module& module);

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
