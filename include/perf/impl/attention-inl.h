// perf/impl/attention-inl.h — the out-of-line definitions of perf/attention.h.
// Included by perf/attention.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <ATen/ops/equal.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <perf/attention.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/transformer.h>

#include <functional>
#include <limits>
#include <optional>
#include <variant>

namespace perf {

namespace detail {

// Python's F._canonical_mask: a bool mask (true: not attended) as the additive float mask it means.
PERF_INLINE at::Tensor canonical_mask(const at::Tensor& mask, const char* name, c10::ScalarType dtype) {
  if (!mask.defined()) return mask;
  TORCH_CHECK(mask.scalar_type() == at::kBool || at::isFloatingType(mask.scalar_type()),
              "perf::multi_head_attention: ", name, " is ", mask.scalar_type(), "; only bool and floating types of ",
              name, " are supported");
  if (mask.scalar_type() != at::kBool) return mask;
  return at::zeros_like(mask, mask.options().dtype(dtype)).masked_fill_(mask, -std::numeric_limits<double>::infinity());
}

// The feed-forward block's activation, as LibTorch's options name it.
PERF_INLINE at::Tensor activate(const torch::nn::activation_t& act, const at::Tensor& h) {
  if (std::holds_alternative<torch::enumtype::kReLU>(act)) return at::relu(h);
  if (std::holds_alternative<torch::enumtype::kGELU>(act)) return at::gelu(h);
  return std::get<std::function<at::Tensor(const at::Tensor&)>>(act)(h);
}

// Python's _detect_is_causal_mask: the hint where given, else whether `mask` is the causal mask of `size`.
PERF_INLINE bool detect_is_causal(const at::Tensor& mask, std::optional<bool> is_causal, int64_t size) {
  if (is_causal.has_value() || !mask.defined()) return is_causal.value_or(false);
  const at::Tensor m = canonical_mask(mask, "mask", at::kFloat);
  if (m.dim() != 2 || m.size(0) != size || m.size(1) != size) return false;
  return at::equal(m, torch::nn::TransformerImpl::generate_square_subsequent_mask(size).to(m.options()));
}

// Copies of `layer` as perf's layer type, registered as LibTorch's TransformerEncoder/Decoder register theirs:
// "layers", then "norm" where the options give one.
template <typename Perf, typename Layer>
void register_stack(torch::nn::Module& self, const Layer& layer, int64_t n, const torch::nn::AnyModule& norm_option,
                    const TransformerLayerOptions& layer_options, torch::nn::ModuleList& layers,
                    torch::nn::AnyModule& norm) {
  TORCH_CHECK(!layer.is_empty(), "perf::Transformer{Encoder,Decoder}: the options hold no layer");
  TORCH_CHECK(n >= 1, "perf::Transformer{Encoder,Decoder}: num_layers is ", n, "; it must be at least 1");
  torch::nn::ModuleList list;
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    auto copy = std::make_shared<Perf>(layer->options, layer_options);
    const auto from = layer->named_parameters(), to = copy->named_parameters();
    for (const auto& kv : from) to[kv.key()].set_data(kv.value().detach().clone());
    copy->train(layer->is_training());
    list->push_back(copy);
  }
  layers = self.register_module("layers", list);
  if (!norm_option.is_empty()) {
    norm = norm_option.clone();
    self.register_module("norm", norm.ptr());
  }
}

// LibTorch's clone() of a class derived from one of its modules makes the base class (Cloneable<Base>), which for
// perf's transformer stacks left layers their forward cannot use. So perf's classes clone as themselves: a module
// built from `args` (the same options), given a copy of every parameter and buffer (moved to `device` where given),
// each parameter's requires_grad and each submodule's training mode.
template <typename Impl, typename... Args>
std::shared_ptr<torch::nn::Module> clone_as(const torch::nn::Module& self, const std::optional<torch::Device>& device,
                                            const Args&... args) {
  torch::NoGradGuard no_grad;
  auto copy = std::make_shared<Impl>(args...);
  const auto copy_data = [&](const at::Tensor& from, at::Tensor to) {
    to.set_data(device && from.device() != *device ? from.to(*device) : from.clone());
  };
  auto params = copy->named_parameters();
  for (const auto& kv : self.named_parameters()) {
    copy_data(kv.value(), params[kv.key()]);
    params[kv.key()].requires_grad_(kv.value().requires_grad());
  }
  auto buffers = copy->named_buffers();
  for (const auto& kv : self.named_buffers()) copy_data(kv.value(), buffers[kv.key()]);
  copy->train(self.is_training());
  auto modules = copy->named_modules("", /*include_self=*/false);
  for (const auto& kv : self.named_modules("", false)) {  // parents first, so each keeps its own mode
    modules[kv.key()]->train(kv.value()->is_training());
  }
  return copy;
}

// (len, N, E) -> (N, heads, len, head_dim): a view where the projection's output allows one.
PERF_INLINE at::Tensor split_heads(const at::Tensor& x, int64_t heads, int64_t head_dim) {
  return x.reshape({x.size(0), x.size(1), heads, head_dim}).permute({1, 2, 0, 3});
}

}  // namespace detail

PERF_INLINE at::Tensor multi_head_attention(torch::nn::MultiheadAttentionImpl& attn, const at::Tensor& query,
                                            const at::Tensor& key, const at::Tensor& value,
                                            const at::Tensor& key_padding_mask, const at::Tensor& attn_mask,
                                            bool is_causal) {
  const auto& o = attn.options;
  TORCH_CHECK(!is_causal || attn_mask.defined(),
              "perf::multi_head_attention: is_causal is a hint that attn_mask is the causal mask, and needs it "
              "(as Python's): pass torch::nn::TransformerImpl::generate_square_subsequent_mask(L) with it");
  if (attn.bias_k.defined() || o.add_zero_attn()) {  // rare options: LibTorch's path, which has them
    return std::get<0>(attn.torch::nn::MultiheadAttentionImpl::forward(query, key, value, key_padding_mask,
                                                                       /*need_weights=*/false, attn_mask));
  }
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "perf::multi_head_attention: query, key and value are (L, N, E), (S, N, E), (S, N, E) as LibTorch's "
              "MultiheadAttention takes them; got ",
              query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  const int64_t L = query.size(0), N = query.size(1), E = query.size(2), S = key.size(0);
  const int64_t H = o.num_heads(), D = attn.head_dim;
  TORCH_CHECK(E == o.embed_dim(), "perf::multi_head_attention: query's embedding dimension is ", E,
              ", the module's embed_dim ", o.embed_dim());
  TORCH_CHECK(key.size(1) == N && value.size(1) == N && value.size(0) == S,
              "perf::multi_head_attention: key and value must have query's batch and one length; got query ",
              query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());

  // Masks as Python's F.multi_head_attention_forward takes them.
  const at::Tensor padding = detail::canonical_mask(key_padding_mask, "key_padding_mask", query.scalar_type());
  at::Tensor mask;
  if (!(is_causal && !padding.defined())) {  // with only the causal mask, the kernel makes it itself
    mask = detail::canonical_mask(attn_mask, "attn_mask", query.scalar_type());
    if (padding.defined()) is_causal = false;
  }
  if (mask.defined()) {
    if (mask.dim() == 2) {
      TORCH_CHECK(mask.size(0) == L && mask.size(1) == S,
                  "perf::multi_head_attention: the shape of the 2D attn_mask is ", mask.sizes(), ", but should be [", L,
                  ", ", S, "]");
      mask = mask.reshape({1, 1, L, S});
    } else {
      TORCH_CHECK(mask.dim() == 3 && mask.size(0) == N * H && mask.size(1) == L && mask.size(2) == S,
                  "perf::multi_head_attention: attn_mask is ", mask.sizes(), "; it must be [", L, ", ", S, "] or [",
                  N * H, ", ", L, ", ", S, "] (batch * num_heads, L, S)");
      mask = mask.reshape({N, H, L, S});
    }
  }
  if (padding.defined()) {
    TORCH_CHECK(padding.dim() == 2 && padding.size(0) == N && padding.size(1) == S,
                "perf::multi_head_attention: expecting key_padding_mask shape of [", N, ", ", S, "], but got ",
                padding.sizes());
    const at::Tensor p = padding.reshape({N, 1, 1, S});
    mask = mask.defined() ? mask + p : p;
  }

  // The projections, as Python's _in_projection_packed: one matmul where query, key and value are one tensor.
  at::Tensor q, k, v;
  if (attn._qkv_same_embed_dim) {
    const at::Tensor& w = attn.in_proj_weight;
    const at::Tensor& b = attn.in_proj_bias;
    const auto bias = [&](int64_t from, int64_t n) { return b.defined() ? b.narrow(0, from, n) : at::Tensor(); };
    if (query.is_same(key) && key.is_same(value)) {
      const at::Tensor qkv = at::linear(query, w, b).reshape({L, N, 3, H, D}).permute({2, 1, 3, 0, 4});
      q = qkv[0];
      k = qkv[1];
      v = qkv[2];
    } else if (key.is_same(value)) {
      q = detail::split_heads(at::linear(query, w.narrow(0, 0, E), bias(0, E)), H, D);
      const at::Tensor kv = at::linear(key, w.narrow(0, E, 2 * E), bias(E, 2 * E)).reshape({S, N, 2, H, D});
      k = kv.select(2, 0).permute({1, 2, 0, 3});
      v = kv.select(2, 1).permute({1, 2, 0, 3});
    } else {
      q = detail::split_heads(at::linear(query, w.narrow(0, 0, E), bias(0, E)), H, D);
      k = detail::split_heads(at::linear(key, w.narrow(0, E, E), bias(E, E)), H, D);
      v = detail::split_heads(at::linear(value, w.narrow(0, 2 * E, E), bias(2 * E, E)), H, D);
    }
  } else {  // kdim or vdim other than embed_dim: three weights
    const at::Tensor& b = attn.in_proj_bias;
    const auto bias = [&](int64_t i) { return b.defined() ? b.narrow(0, i * E, E) : at::Tensor(); };
    q = detail::split_heads(at::linear(query, attn.q_proj_weight, bias(0)), H, D);
    k = detail::split_heads(at::linear(key, attn.k_proj_weight, bias(1)), H, D);
    v = detail::split_heads(at::linear(value, attn.v_proj_weight, bias(2)), H, D);
  }
  const double dropout = attn.is_training() ? o.dropout() : 0.0;
  const at::Tensor out = at::scaled_dot_product_attention(
      q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt, dropout, is_causal);  // (N, H, L, D)
  return attn.out_proj->forward(out.permute({2, 0, 1, 3}).reshape({L, N, E}));
}

PERF_INLINE std::tuple<at::Tensor, at::Tensor> MultiheadAttentionImpl::forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_padding_mask,
    bool need_weights, const at::Tensor& attn_mask, bool average_attn_weights, bool is_causal) {
  // Python's batch_first: batched (N, L, E) inputs seen as (L, N, E), and the output turned back.
  const bool batch_first = attention_options.batch_first() && query.dim() == 3;
  const auto in = [&](const at::Tensor& x) { return batch_first ? x.transpose(0, 1) : x; };
  if (!need_weights) {
    const at::Tensor out =
        multi_head_attention(*this, in(query), in(key), in(value), key_padding_mask, attn_mask, is_causal);
    return {in(out), at::Tensor()};
  }
  TORCH_CHECK(!is_causal || attn_mask.defined(),
              "perf::MultiheadAttention: is_causal is a hint that attn_mask is the causal mask, and needs it");
  auto [out, weights] = torch::nn::MultiheadAttentionImpl::forward(in(query), in(key), in(value), key_padding_mask,
                                                                   true, attn_mask, average_attn_weights);
  return {in(out), weights};
}

PERF_INLINE std::shared_ptr<torch::nn::Module> MultiheadAttentionImpl::clone(
    const std::optional<torch::Device>& device) const {
  return detail::clone_as<MultiheadAttentionImpl>(*this, device, options, attention_options);
}

PERF_INLINE std::shared_ptr<torch::nn::Module> TransformerEncoderLayerImpl::clone(
    const std::optional<torch::Device>& device) const {
  return detail::clone_as<TransformerEncoderLayerImpl>(*this, device, options, layer_options);
}

PERF_INLINE std::shared_ptr<torch::nn::Module> TransformerDecoderLayerImpl::clone(
    const std::optional<torch::Device>& device) const {
  return detail::clone_as<TransformerDecoderLayerImpl>(*this, device, options, layer_options);
}

PERF_INLINE at::Tensor TransformerEncoderLayerImpl::forward(const at::Tensor& src, const at::Tensor& src_mask,
                                                            const at::Tensor& src_key_padding_mask, bool is_causal) {
  // Python's TransformerEncoderLayer: its _sa_block and _ff_block, the norms after (LibTorch's only order) or before.
  const bool batch_first = layer_options.batch_first();
  at::Tensor x = batch_first ? src.transpose(0, 1) : src;
  const auto sa = [&](const at::Tensor& h) {
    return dropout1(multi_head_attention(*self_attn, h, h, h, src_key_padding_mask, src_mask, is_causal));
  };
  const auto ff = [&](const at::Tensor& h) {
    return dropout2(linear2(dropout(detail::activate(options.activation(), linear1(h)))));
  };
  if (layer_options.norm_first()) {
    x = x + sa(norm1(x));
    x = x + ff(norm2(x));
  } else {
    x = norm1(x + sa(x));
    x = norm2(x + ff(x));
  }
  return batch_first ? x.transpose(0, 1) : x;
}

PERF_INLINE at::Tensor TransformerDecoderLayerImpl::forward(const at::Tensor& tgt, const at::Tensor& memory,
                                                            const at::Tensor& tgt_mask, const at::Tensor& memory_mask,
                                                            const at::Tensor& tgt_key_padding_mask,
                                                            const at::Tensor& memory_key_padding_mask,
                                                            bool tgt_is_causal, bool memory_is_causal) {
  // Python's TransformerDecoderLayer: its _sa_block, _mha_block and _ff_block, the norms after or before.
  const bool batch_first = layer_options.batch_first();
  at::Tensor x = batch_first ? tgt.transpose(0, 1) : tgt;
  const at::Tensor mem = batch_first ? memory.transpose(0, 1) : memory;
  const auto sa = [&](const at::Tensor& h) {
    return dropout1(multi_head_attention(*self_attn, h, h, h, tgt_key_padding_mask, tgt_mask, tgt_is_causal));
  };
  const auto mha = [&](const at::Tensor& h) {
    return dropout2(
        multi_head_attention(*multihead_attn, h, mem, mem, memory_key_padding_mask, memory_mask, memory_is_causal));
  };
  const auto ff = [&](const at::Tensor& h) {
    return dropout3(linear2(dropout(detail::activate(options.activation(), linear1(h)))));
  };
  if (layer_options.norm_first()) {
    x = x + sa(norm1(x));
    x = x + mha(norm2(x));
    x = x + ff(norm3(x));
  } else {
    x = norm1(x + sa(x));
    x = norm2(x + mha(x));
    x = norm3(x + ff(x));
  }
  return batch_first ? x.transpose(0, 1) : x;
}

PERF_INLINE TransformerEncoderImpl::TransformerEncoderImpl(torch::nn::TransformerEncoderOptions options_,
                                                           TransformerLayerOptions layer_options_)
    : options(std::move(options_)), layer_options(layer_options_) {
  reset();
}

PERF_INLINE void TransformerEncoderImpl::reset() {
  detail::register_stack<TransformerEncoderLayerImpl>(*this, options.encoder_layer(), options.num_layers(),
                                                      options.norm(), layer_options, layers, norm);
}

PERF_INLINE at::Tensor TransformerEncoderImpl::forward(const at::Tensor& src, const at::Tensor& mask,
                                                       const at::Tensor& src_key_padding_mask,
                                                       std::optional<bool> is_causal) {
  const bool causal = detail::detect_is_causal(mask, is_causal, src.size(layer_options.batch_first() ? 1 : 0));
  at::Tensor out = src;
  for (const auto& layer : *layers) {
    out = layer->as<TransformerEncoderLayerImpl>()->forward(out, mask, src_key_padding_mask, causal);
  }
  return norm.is_empty() ? out : norm.forward(out);
}

PERF_INLINE TransformerDecoderImpl::TransformerDecoderImpl(torch::nn::TransformerDecoderOptions options_,
                                                           TransformerLayerOptions layer_options_)
    : options(std::move(options_)), layer_options(layer_options_) {
  reset();
}

PERF_INLINE void TransformerDecoderImpl::reset() {
  detail::register_stack<TransformerDecoderLayerImpl>(*this, options.decoder_layer(), options.num_layers(),
                                                      options.norm(), layer_options, layers, norm);
}

PERF_INLINE at::Tensor TransformerDecoderImpl::forward(const at::Tensor& tgt, const at::Tensor& memory,
                                                       const at::Tensor& tgt_mask, const at::Tensor& memory_mask,
                                                       const at::Tensor& tgt_key_padding_mask,
                                                       const at::Tensor& memory_key_padding_mask,
                                                       std::optional<bool> tgt_is_causal, bool memory_is_causal) {
  const bool causal = detail::detect_is_causal(tgt_mask, tgt_is_causal, tgt.size(layer_options.batch_first() ? 1 : 0));
  at::Tensor out = tgt;
  for (const auto& layer : *layers) {
    out = layer->as<TransformerDecoderLayerImpl>()->forward(out, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                                                            memory_key_padding_mask, causal, memory_is_causal);
  }
  return norm.is_empty() ? out : norm.forward(out);
}

}  // namespace perf
