// The C++ twins of tests/compiled/models.py's modules: same layers, same
// parameter and buffer names, so a package exported from the Python module
// matches them (test_compiled.cpp, test_compiled_train.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace compiled_models {

struct Mlp : torch::nn::Module {
  Mlp()
      : fc1(register_module("fc1", torch::nn::Linear(16, 64))), fc2(register_module("fc2", torch::nn::Linear(64, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

struct Cnn : torch::nn::Module {
  Cnn()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(16))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).stride(2).padding(1)))),
        fc(register_module("fc", torch::nn::Linear(32, 10))) {}
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = torch::relu(conv2(h));
    return fc(torch::flatten(at::adaptive_avg_pool2d(h, {1, 1}), 1));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc;
};

struct TinyGpt : torch::nn::Module {
  TinyGpt()
      : tok(register_module("tok", torch::nn::Embedding(32, 16))),
        pos(register_module("pos", torch::nn::Embedding(8, 16))),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})))),
        qkv(register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(16, 48).bias(false)))),
        proj(register_module("proj", torch::nn::Linear(16, 16))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})))),
        fc1(register_module("fc1", torch::nn::Linear(16, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 16))),
        head(register_module("head", torch::nn::Linear(torch::nn::LinearOptions(16, 32).bias(false)))) {}
  at::Tensor forward(const at::Tensor& idx) {
    namespace F = torch::nn::functional;
    const auto b = idx.size(0), t = idx.size(1);
    auto x = tok(idx) + pos(torch::arange(t, idx.options()));
    auto q = qkv(ln1(x)).view({b, t, 3, 2, -1}).permute({2, 0, 3, 1, 4});
    auto a = at::scaled_dot_product_attention(q[0], q[1], q[2], {}, 0.0, /*is_causal=*/true);
    x = x +
        F::dropout(proj(a.transpose(1, 2).reshape({b, t, -1})), F::DropoutFuncOptions().p(0.1).training(is_training()));
    x = x + F::dropout(fc2(torch::gelu(fc1(ln2(x)))), F::DropoutFuncOptions().p(0.1).training(is_training()));
    return head(x);
  }
  torch::nn::Embedding tok, pos;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2, head;
};

}  // namespace compiled_models
