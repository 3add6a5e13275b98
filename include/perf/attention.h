// perf/attention.h — LibTorch's attention layers through scaled_dot_product_attention.
//
//   perf::TransformerEncoderLayer layer(torch::nn::TransformerEncoderLayerOptions(512, 8));  // for torch::nn's
//   auto y = layer(x, causal_mask, torch::Tensor(), /*is_causal=*/true);
//   perf::MultiheadAttention mha(torch::nn::MultiheadAttentionOptions(512, 8));            // for torch::nn's
//   auto [out, none] = mha(q, k, v, torch::Tensor(), /*need_weights=*/false);
//   perf::MultiheadAttention mha_bf(torch::nn::MultiheadAttentionOptions(512, 8),
//                                   perf::AttentionOptions().batch_first(true));  // (N, L, E) in and out
//   // what LibTorch's options lack: Python's norm_first (pre-LayerNorm) and batch_first
//   auto layer_options = torch::nn::TransformerEncoderLayerOptions(512, 8);
//   perf::TransformerEncoder gpt(torch::nn::TransformerEncoderOptions(layer_options, 6),
//                                perf::TransformerLayerOptions().norm_first(true).batch_first(true));
//
// LibTorch's MultiheadAttention (and the TransformerEncoderLayer built on it)
// always computes the attention matrix, softmax and dropout one by one, with
// need_weights or without: a (batch * heads, L, S) tensor in memory and the
// math kernels. Python's nn.MultiheadAttention calls scaled_dot_product_attention
// when need_weights=False, as its TransformerEncoderLayer does, and so gets
// the fused kernels (flash and memory-efficient attention on CUDA, the flash
// kernel on the CPU). perf's classes derive from LibTorch's: the same options,
// parameters, names and state_dict, and the forward that Python's has.
#pragma once

#include <ATen/core/Tensor.h>
#include <perf/config.h>
#include <torch/arg.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/transformercoder.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/nn/options/transformercoder.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <tuple>

// LibTorch's FORWARD_HAS_DEFAULT_ARGS (what lets a module with default arguments sit in a Sequential or an
// AnyModule) expands to a TORCH_INTERNAL_ASSERT without a message, which clang's -Wpedantic refuses in C++17
// (clang 14 names it -Wgnu-zero-variadic-macro-arguments, clang 19 -Wc++20-extensions).
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wgnu-zero-variadic-macro-arguments"
#if __has_warning("-Wc++20-extensions")
#pragma clang diagnostic ignored "-Wc++20-extensions"
#endif
#endif

namespace perf {

/// Python's `F.multi_head_attention_forward(..., need_weights=False)` with the
/// weights of LibTorch's `attn`: the projections, then one
/// `at::scaled_dot_product_attention`, then the output projection. Inputs are
/// (L, N, E) as LibTorch's (no batch_first). `attn_mask` is (L, S) or
/// (N * heads, L, S), bool (true: not attended, as Python's) or float (added);
/// `key_padding_mask` is (N, S), bool or float. `is_causal` says that
/// `attn_mask` is the causal mask (Python requires the mask with it) and lets
/// the kernel skip it where no padding mask is given. Dropout as `attn` is
/// configured, in training mode only. add_bias_kv and add_zero_attn run
/// LibTorch's own path.
at::Tensor multi_head_attention(torch::nn::MultiheadAttentionImpl& attn, const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& key_padding_mask = {},
                                const at::Tensor& attn_mask = {}, bool is_causal = false);

/// What Python's transformer layers take and LibTorch's options
/// (TransformerEncoderLayerOptions, TransformerDecoderLayerOptions) lack; both
/// false by default, as in Python. The parameters and state_dict do not change.
struct TransformerLayerOptions {
  /// Python's `norm_first`: each block normalizes its input, then adds its
  /// output to it (pre-LayerNorm, as GPT-style models), instead of normalizing
  /// the sum.
  TORCH_ARG(bool, norm_first) = false;
  /// Python's `batch_first`: inputs and outputs are (N, L, E), not (L, N, E).
  TORCH_ARG(bool, batch_first) = false;
};

/// What Python's nn.MultiheadAttention takes and LibTorch's
/// MultiheadAttentionOptions lacks; false by default, as in Python. The
/// parameters and state_dict do not change.
struct AttentionOptions {
  /// Python's `batch_first`: query, key, value and the output are (N, L, E),
  /// not (L, N, E). The attention weights are (N, L, S) either way.
  TORCH_ARG(bool, batch_first) = false;
};

/// torch::nn::MultiheadAttention whose forward is Python's: with
/// `need_weights=false` it runs perf::multi_head_attention and returns an
/// undefined tensor for the weights; with `need_weights=true` (the default, as
/// in both languages) LibTorch's path, which computes them.
class MultiheadAttentionImpl : public torch::nn::MultiheadAttentionImpl {
 public:
  using torch::nn::MultiheadAttentionImpl::MultiheadAttentionImpl;
  MultiheadAttentionImpl(const torch::nn::MultiheadAttentionOptions& options_, AttentionOptions attention_options_)
      : torch::nn::MultiheadAttentionImpl(options_), attention_options(attention_options_) {}

  AttentionOptions attention_options;

  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                             const at::Tensor& key_padding_mask = {}, bool need_weights = true,
                                             const at::Tensor& attn_mask = {}, bool average_attn_weights = true,
                                             bool is_causal = false);
  /// A copy of this perf class (LibTorch's Cloneable would make the base class), its options, weights and mode.
  PERF_INLINE std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt)
      const override;  // inline in the class: no key function

 protected:
  FORWARD_HAS_DEFAULT_ARGS({3, torch::nn::AnyValue(at::Tensor())}, {4, torch::nn::AnyValue(true)},
                           {5, torch::nn::AnyValue(at::Tensor())}, {6, torch::nn::AnyValue(true)},
                           {7, torch::nn::AnyValue(false)})
};
TORCH_MODULE(MultiheadAttention);

/// torch::nn::TransformerEncoderLayer whose self-attention runs
/// perf::multi_head_attention, as Python's layer runs its attention with
/// need_weights=False. `is_causal` as Python's: `src_mask` is the causal mask.
class TransformerEncoderLayerImpl : public torch::nn::TransformerEncoderLayerImpl {
 public:
  using torch::nn::TransformerEncoderLayerImpl::TransformerEncoderLayerImpl;
  TransformerEncoderLayerImpl(const torch::nn::TransformerEncoderLayerOptions& options_,
                              TransformerLayerOptions layer_options_)
      : torch::nn::TransformerEncoderLayerImpl(options_), layer_options(layer_options_) {}

  at::Tensor forward(const at::Tensor& src, const at::Tensor& src_mask = {},
                     const at::Tensor& src_key_padding_mask = {}, bool is_causal = false);

  TransformerLayerOptions layer_options;
  /// A copy of this perf class (LibTorch's Cloneable would make the base class), its options, weights and mode.
  PERF_INLINE std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt)
      const override;  // inline in the class: no key function

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())}, {2, torch::nn::AnyValue(at::Tensor())},
                           {3, torch::nn::AnyValue(false)})
};
TORCH_MODULE(TransformerEncoderLayer);

/// torch::nn::TransformerDecoderLayer whose self- and cross-attention run
/// perf::multi_head_attention, as Python's layer runs them. `tgt_is_causal`
/// and `memory_is_causal` as Python's.
class TransformerDecoderLayerImpl : public torch::nn::TransformerDecoderLayerImpl {
 public:
  using torch::nn::TransformerDecoderLayerImpl::TransformerDecoderLayerImpl;
  TransformerDecoderLayerImpl(const torch::nn::TransformerDecoderLayerOptions& options_,
                              TransformerLayerOptions layer_options_)
      : torch::nn::TransformerDecoderLayerImpl(options_), layer_options(layer_options_) {}

  at::Tensor forward(const at::Tensor& tgt, const at::Tensor& memory, const at::Tensor& tgt_mask = {},
                     const at::Tensor& memory_mask = {}, const at::Tensor& tgt_key_padding_mask = {},
                     const at::Tensor& memory_key_padding_mask = {}, bool tgt_is_causal = false,
                     bool memory_is_causal = false);

  TransformerLayerOptions layer_options;
  /// A copy of this perf class (LibTorch's Cloneable would make the base class), its options, weights and mode.
  PERF_INLINE std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt)
      const override;  // inline in the class: no key function

 protected:
  FORWARD_HAS_DEFAULT_ARGS({2, torch::nn::AnyValue(at::Tensor())}, {3, torch::nn::AnyValue(at::Tensor())},
                           {4, torch::nn::AnyValue(at::Tensor())}, {5, torch::nn::AnyValue(at::Tensor())},
                           {6, torch::nn::AnyValue(false)}, {7, torch::nn::AnyValue(false)})
};
TORCH_MODULE(TransformerDecoderLayer);

/// torch::nn::TransformerEncoder of perf::TransformerEncoderLayer: the
/// options' layer copied `num_layers` times (its weights too, as LibTorch and
/// Python copy it), each with `layer_options`, then `norm` if given; the same
/// names and state_dict as LibTorch's and Python's. `is_causal` unset: true
/// where `mask` is the causal mask, as Python detects it.
class TransformerEncoderImpl : public torch::nn::Cloneable<TransformerEncoderImpl> {
 public:
  explicit TransformerEncoderImpl(torch::nn::TransformerEncoderOptions options_,
                                  TransformerLayerOptions layer_options_ = {});

  at::Tensor forward(const at::Tensor& src, const at::Tensor& mask = {}, const at::Tensor& src_key_padding_mask = {},
                     std::optional<bool> is_causal = std::nullopt);
  PERF_INLINE void reset() override;  // inline in the class: no key function, no vtable in every TU

  torch::nn::TransformerEncoderOptions options;
  TransformerLayerOptions layer_options;
  torch::nn::ModuleList layers = nullptr;
  torch::nn::AnyModule norm;

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())}, {2, torch::nn::AnyValue(at::Tensor())},
                           {3, torch::nn::AnyValue(std::optional<bool>())})
};
TORCH_MODULE(TransformerEncoder);

/// torch::nn::TransformerDecoder of perf::TransformerDecoderLayer, as
/// TransformerEncoder above; `tgt_is_causal` unset: detected from `tgt_mask`.
class TransformerDecoderImpl : public torch::nn::Cloneable<TransformerDecoderImpl> {
 public:
  explicit TransformerDecoderImpl(torch::nn::TransformerDecoderOptions options_,
                                  TransformerLayerOptions layer_options_ = {});

  at::Tensor forward(const at::Tensor& tgt, const at::Tensor& memory, const at::Tensor& tgt_mask = {},
                     const at::Tensor& memory_mask = {}, const at::Tensor& tgt_key_padding_mask = {},
                     const at::Tensor& memory_key_padding_mask = {}, std::optional<bool> tgt_is_causal = std::nullopt,
                     bool memory_is_causal = false);
  PERF_INLINE void reset() override;  // inline in the class: no key function, no vtable in every TU

  torch::nn::TransformerDecoderOptions options;
  TransformerLayerOptions layer_options;
  torch::nn::ModuleList layers = nullptr;
  torch::nn::AnyModule norm;

 protected:
  FORWARD_HAS_DEFAULT_ARGS({2, torch::nn::AnyValue(at::Tensor())}, {3, torch::nn::AnyValue(at::Tensor())},
                           {4, torch::nn::AnyValue(at::Tensor())}, {5, torch::nn::AnyValue(at::Tensor())},
                           {6, torch::nn::AnyValue(std::optional<bool>())}, {7, torch::nn::AnyValue(false)})
};
TORCH_MODULE(TransformerDecoder);

}  // namespace perf

#if defined(__clang__)
#pragma clang diagnostic pop
#endif

#ifdef PERF_HEADER_ONLY
#include <perf/impl/attention-inl.h>
#endif
