// C++ twins of bench/e2e/models.py (same layers, same parameter and buffer
// names): the transformer and the MLP; the CNN is perf_bench::ResNet (resnet.h).
#pragma once

#include <torch/torch.h>

#include "../resnet.h"

namespace e2e {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t n_heads)
      : heads(n_heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(torch::Tensor x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2);
    auto qkv_ = qkv(ln1(x)).view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
    auto a = at::scaled_dot_product_attention(qkv_[0], qkv_[1], qkv_[2], {}, 0.0, /*is_causal=*/true);
    x = x + proj(a.transpose(1, 2).reshape({b, t, d}));
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl(int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t context)
      : tok(register_module("tok", torch::nn::Embedding(vocab, d))),
        pos(register_module("pos", torch::nn::Embedding(context, d))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        head(register_module("head", torch::nn::Linear(torch::nn::LinearOptions(d, vocab).bias(false)))) {
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(Block(d, heads));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx) + pos(torch::arange(idx.size(1), idx.options()));
    for (const auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return head(ln_f(x));
  }
  torch::nn::Embedding tok, pos;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(Gpt);

inline torch::nn::Sequential mlp(int64_t inputs, int64_t hidden, int64_t classes) {
  return torch::nn::Sequential(torch::nn::Linear(inputs, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, hidden),
                               torch::nn::ReLU(), torch::nn::Linear(hidden, classes));
}

}  // namespace e2e
