// perf/muon.h — Python's torch.optim.Muon: momentum orthogonalised by Newton-Schulz iterations, for 2-D weights.
//
//   std::vector<torch::Tensor> matrices, others;  // hidden layers' weights; biases, norms, embeddings, the head
//   for (const auto& p : model->parameters()) (p.dim() == 2 ? matrices : others).push_back(p);
//   perf::optim::Muon muon(matrices, perf::optim::MuonOptions(0.02));
//   perf::optim::AdamW adamw(others, perf::optim::AdamWOptions(3e-4));
//   loss.backward(); muon.step(); adamw.step(); muon.zero_grad(); adamw.zero_grad();
//
// Python's names, defaults, checks, state_dict() layout and numbers (Muon added in PyTorch 2.9; the tests
// compare perf's with 2.11's step by step). Python's Muon loops over the matrices one at a time, over 20
// kernels each (its `foreach=True` is refused). perf's default runs the Newton-Schulz iterations of all
// matrices of one shape as one batch (bmm / baddbmm), and on a GPU the momentum, weight decay and update as
// multi-tensor kernels: a transformer's dozens of equal-shape matrices cost the kernels of one. foreach(false)
// runs Python's loop. A perf::optim::FusedOptimizer: perf::GradScaler (one host read of found_inf per step,
// as Python's GradScaler for an optimizer without fused kernels), LR schedulers, perf::TrainStep on CUDA
// (the lr a device tensor; without a scaler).
#pragma once

#include <ATen/ATen.h>
#include <perf/config.h>
#include <perf/optim.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace perf::optim {

/// Python's Muon arguments, names and defaults, plus foreach.
struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  MuonOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit like torch's
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.1;  // decoupled: the weights shrink by lr * weight_decay a step
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  using ns_coefficients_t = std::tuple<double, double, double>;
  /// (a, b, c) of the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T (Keller Jordan's).
  TORCH_ARG(ns_coefficients_t, ns_coefficients) = std::make_tuple(3.4445, -4.7750, 2.0315);
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  /// How the lr scales with a matrix's shape (rows A, columns B): unset or "original", sqrt(max(1, A / B));
  /// "match_rms_adamw", 0.2 sqrt(max(A, B)) (Moonshot's: AdamW's lr and weight decay carry over).
  TORCH_ARG(std::optional<std::string>, adjust_lr_fn);
  /// Unset or true: multi-tensor momentum and one batched Newton-Schulz per matrix shape; false: Python's
  /// loop, one matrix at a time. Not written to checkpoints (how the step runs, not training state).
  TORCH_ARG(std::optional<bool>, foreach);

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  PERF_INLINE void serialize(torch::serialize::OutputArchive& archive) const override;
  PERF_INLINE void serialize(torch::serialize::InputArchive& archive) override;
};

/// Python's Muon keeps what SGD with momentum keeps: a `momentum_buffer` per parameter.
using MuonParamState = SGDParamState;

/// Muon over 2-D parameters (Python's: any other is refused, at construction and at step()). Per step and
/// matrix: B <- mu B + (1 - mu) G (a lerp), U = nesterov ? lerp(G, B, mu) : B, O = NS(U) in bfloat16,
/// W <- W (1 - lr wd) - lr ratio(shape) O.
/// kernels() says per (device, dtype): "cpu Float: foreach, Newton-Schulz in 2 batches for 6 matrices" or
/// "cpu Float: single-tensor".
class Muon : public SerializableFusedOptimizer<MuonParamState, MuonOptions> {
 public:
  explicit Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, MuonOptions defaults = {});
  explicit Muon(std::vector<torch::Tensor> params, MuonOptions defaults = {})
      : Muon({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  /// As FusedOptimizer::add_param_group, refusing a parameter that is not 2-D before anything is added.
  PERF_INLINE void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

 protected:
  PERF_INLINE void update(const std::optional<torch::Tensor>& grad_scale,
                          const std::optional<torch::Tensor>& found_inf) override;
  std::unique_ptr<torch::optim::OptimizerParamState> make_state() const override {
    return std::make_unique<MuonParamState>();
  }
  std::array<torch::Tensor*, 3> state_tensors(torch::optim::OptimizerParamState& s) const override {
    return {&static_cast<MuonParamState&>(s).momentum_buffer(), nullptr, nullptr};
  }
  std::optional<bool> flat_option(const torch::optim::OptimizerOptions&) const override { return std::nullopt; }
  PERF_INLINE std::unique_ptr<torch::optim::OptimizerOptions> kept_options(
      const torch::optim::OptimizerOptions& given) const override;
  PERF_INLINE void check_options(const torch::optim::OptimizerOptions& o, size_t g) const override;
  PERF_INLINE void add_step_constants(const torch::optim::OptimizerOptions& options, size_t g,
                                      std::vector<StepConstant>& out) const override;
};

// ---------------------------------------------------------------------------
namespace detail {

// Python's _zeropower_via_newtonschulz on a matrix (r, c) or a batch of them (n, r, c): the result in bfloat16,
// the input left as it is (Python's divides a bfloat16 input in place: with nesterov=False, a bfloat16 parameter's
// momentum buffer).
PERF_INLINE at::Tensor zeropower_via_newtonschulz(const at::Tensor& update, const MuonOptions& o);

// Python's _adjust_lr's factor for a matrix of `rows` x `cols`.
PERF_INLINE double muon_lr_ratio(const MuonOptions& o, int64_t rows, int64_t cols);

}  // namespace detail
}  // namespace perf::optim

#ifdef PERF_HEADER_ONLY
#include <perf/impl/muon-inl.h>
#endif
