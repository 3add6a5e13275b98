// A small ResNet-style CNN for benchmarks and the demo (synthetic data, no downloads).
#pragma once

#include <torch/torch.h>

namespace perf_bench {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t in, int64_t out, int64_t stride) {
    c1 = register_module("c1",
                         torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    b1 = register_module("b1", torch::nn::BatchNorm2d(out));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
    b2 = register_module("b2", torch::nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      down = register_module(
          "down",
          torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
                                torch::nn::BatchNorm2d(out)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(b1(c1(x)));
    h = b2(c2(h));
    return torch::relu(h + (down.is_empty() ? x : down->forward(x)));
  }
  torch::nn::Conv2d c1{nullptr}, c2{nullptr};
  torch::nn::BatchNorm2d b1{nullptr}, b2{nullptr};
  torch::nn::Sequential down{nullptr};
};
TORCH_MODULE(Block);

/// ResNet-18-like at reduced width: stem, 4 stages of 2 blocks, pooled linear head.
struct ResNetImpl : torch::nn::Module {
  explicit ResNetImpl(int64_t width = 32, int64_t classes = 10) {
    stem = register_module(
        "stem", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, width, 3).padding(1).bias(false)),
                                      torch::nn::BatchNorm2d(width), torch::nn::ReLU()));
    int64_t in = width;
    for (int s = 0; s < 4; ++s) {
      const int64_t out = width << s;
      for (int b = 0; b < 2; ++b) {
        blocks.push_back(register_module("block" + std::to_string(s) + "_" + std::to_string(b),
                                         Block(in, out, (s > 0 && b == 0) ? 2 : 1)));
        in = out;
      }
    }
    head = register_module("head", torch::nn::Linear(in, classes));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = stem->forward(x);
    for (auto& b : blocks) x = b->forward(x);
    return head(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
  }
  torch::nn::Sequential stem{nullptr};
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ResNet);

}  // namespace perf_bench
