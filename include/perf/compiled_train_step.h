// perf/compiled_train_step.h — training steps compiled ahead of time by
// Inductor: forward, loss and backward as one generated program, driven from
// C++ with perf's fused optimizers, GradScaler and CUDA graphs.
//
//   # once, in Python (the model's Python twin and a loss(model, *batch) callable):
//   python tools/export_compiled.py model.py:make --train --loss model.py:loss
//          --input 64,512 --input 64:int64 -o net_train.pt2
//
//   perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));
//   perf::CompiledTrainStep step("net_train.pt2", model, opt);
//   for (auto& b : *loader) torch::Tensor loss = step.step(b.data, b.target);
//
// The package takes the module's parameters and buffers as inputs (C++ owns
// and updates them: checkpoints, eval() and optimizers see the usual tensors)
// and returns the mutated buffers (BatchNorm statistics), the loss and one
// gradient per trainable parameter. step() hands the gradients to the
// parameters' .grad (no copy), writes the buffers back and runs the
// optimizer — with a GradScaler, gradient accumulation, clipping and LR
// schedulers as perf::TrainStep runs them. On CUDA the whole step (compiled
// kernels, optimizer, scaler) is captured into one CUDA graph at the first
// step() and replayed; the package runs through its single-threaded entry
// point, the one that capture allows. On the CPU every step runs eagerly.
// With CompiledTrainOptions().data_parallel(pg) (perf/distributed.h) each rank
// trains on its share of the batch and the step averages the gradients across
// the ranks, inside the same CUDA graph.
//
// Names, shapes, dtypes, strides and requires_grad of the module's state are
// checked against the package at construction, and again (cheaply) at every
// step, so a model moved, re-laid-out or frozen after export fails clearly
// instead of feeding the generated code tensors it was not compiled for. So is
// train() mode: the package computes the step as exported, in train() mode
// (batch statistics, dropout), whatever mode the module is in.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <perf/amp.h>
#include <perf/compiled_model.h>
#include <perf/config.h>
#include <perf/cuda_graph.h>
#include <perf/detail/float.h>
#include <perf/module.h>
#include <torch/arg.h>
#include <torch/data/example.h>
#include <torch/optim/optimizer.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace perf {

struct CompiledTrainOptions {
  /// The model inside the package (aoti_compile_and_package writes "model").
  TORCH_ARG(std::string, model_name) = "model";
  /// CUDA: capture the whole step into one CUDA graph at the first step()
  /// (static shapes; a smaller last batch runs uncaptured and is counted).
  TORCH_ARG(bool, graph) = true;
  /// Steps run before capture with the optimizer update skipped (they do not
  /// train; buffers, RNG and the scaler are restored afterwards).
  TORCH_ARG(int, warmup) = 3;
  /// Loss scaling: the scale multiplies the loss inside the compiled graph.
  TORCH_ARG(GradScalerPtr, scaler) = nullptr;
  /// Clip the total gradient norm before the update (perf::clip_grad_norm_).
  TORCH_ARG(std::optional<double>, max_grad_norm);
  /// Every batch tensor split in k chunks along dim 0 (the package must take
  /// the chunk's batch size), gradients accumulated, one update per step().
  TORCH_ARG(int64_t, accumulation_steps) = 1;
  TORCH_ARG(std::optional<c10::MempoolId_t>, pool);
  /// On a failed capture, or a torch::optim optimizer on CUDA: warn and run eagerly.
  TORCH_ARG(bool, eager_fallback) = false;
  TORCH_ARG(CaptureErrorMode, capture_error_mode) = CaptureErrorMode::thread_local_;
  TORCH_ARG(bool, check_syncs) = true;

 public:  // after TORCH_ARG, which leaves its field private
  /// Data-parallel training over `process_group`, as TrainStepOptions::data_parallel
  /// (include perf/distributed.h): rank 0's parameters and buffers broadcast at
  /// construction, the package's gradients averaged across the ranks in every step.
  CompiledTrainOptions& data_parallel(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
                                      const DataParallelOptions& options = DataParallelOptions()) {
    data_parallel_ = detail::make_data_parallel(process_group, options);
    return *this;
  }
  /// Null unless data_parallel(...) was set.
  const detail::DataParallelPtr& data_parallel() const noexcept { return data_parallel_; }

 private:
  detail::DataParallelPtr data_parallel_;
};

class CompiledTrainStep {
 public:
  using Example = torch::data::Example<at::Tensor, at::Tensor>;

  /// `optimizers`: one (`opt`), or several (`{&muon, &adamw}`), as perf::TrainStep takes them.
  CompiledTrainStep(const std::string& path, ModuleRef module, Optimizers optimizers,
                    const CompiledTrainOptions& options = CompiledTrainOptions());
  CompiledTrainStep(const CompiledTrainStep&) = delete;  // its captured step refers to it
  CompiledTrainStep& operator=(const CompiledTrainStep&) = delete;
  ~CompiledTrainStep();

  /// One training step on `batch` (the tensors the package was exported for, in
  /// that order); returns its loss, owned by the caller (0-dim float32 on the
  /// device; reading it is the only sync).
  at::Tensor step(const std::vector<at::Tensor>& batch);
  at::Tensor step(const at::Tensor& input, const at::Tensor& target) {
    return step(std::vector<at::Tensor>{input, target});
  }
  at::Tensor step(const Example& batch) { return step(batch.data, batch.target); }
  /// step({x, y}): a braced list is the batch vector (it would otherwise match Example too).
  at::Tensor step(std::initializer_list<at::Tensor> batch) { return step(std::vector<at::Tensor>(batch)); }
  /// The last step's loss without a copy (graphed: overwritten by the next step).
  const at::Tensor& static_loss() const;
  /// The last step's total gradient norm before clipping, as TrainStep::grad_norm()
  /// (set max_grad_norm; infinity measures without clipping).
  at::Tensor grad_norm() const;

  /// True once the first step() captured the step into a CUDA graph.
  bool graphed() const noexcept { return inner_ && inner_->graphed(); }
  /// Steps that ran uncaptured because their batch was smaller than the first one's.
  int64_t eager_steps() const noexcept { return inner_ ? inner_->eager_steps() : 0; }
  c10::Device device() const noexcept;
  /// The recipe compiled into the step: "off", "bf16" or "fp16" autocast.
  std::string amp() const;
  bool channels_last() const;
  /// Attention under autocast, as exported (tools/export_compiled.py --attention):
  /// "fastest", "float32" or "autocast"; "off" without autocast; "" for a package
  /// from before the option (LibTorch's policy).
  std::string attention() const {
    const auto it = metadata().find("perf.train.attention");
    return it == metadata().end() ? std::string() : it->second;
  }
  const std::string& path() const noexcept;
  const CompiledTrainOptions& options() const noexcept { return options_; }
  const std::unordered_map<std::string, std::string>& metadata() const noexcept;
  /// The batch tensors the package takes.
  const std::vector<CompiledInput>& inputs() const noexcept;

 private:
  struct State {
    std::string name;
    bool param = false, grad = false;
    at::Tensor live;  // the module's own tensor
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> sizes, strides;
  };
  void bind_state();
  void check_state() const;
  std::string layout_hint() const;
  at::Tensor micro(const std::vector<at::Tensor>& batch, double divisor);

  std::unique_ptr<detail::Package> package_;
  ModuleRef module_;
  Optimizers opts_;
  CompiledTrainOptions options_;
  std::vector<State> state_;
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> submodules_;  // train() checked per step
  std::vector<size_t> mutated_, grads_;  // state indexes of the package's buffer and gradient outputs
  std::unique_ptr<TrainStep> inner_;     // made at the first step(), on its batch
};

std::ostream& operator<<(std::ostream& out, const CompiledTrainStep& step);

// --------------------------------------------------------------------------- implementation

namespace detail {
// Strides address the same elements: equal wherever a dimension has more than
// one element (a 1x1 convolution's weight is both contiguous and channels-last).
PERF_INLINE bool same_layout(c10::IntArrayRef sizes, c10::IntArrayRef a, c10::IntArrayRef b);
}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/compiled_train_step-inl.h>
#endif
