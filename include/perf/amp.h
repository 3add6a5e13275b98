// perf/amp.h — automatic mixed precision for C++: Autocast and GradScaler.
//
//   perf::GradScaler scaler;                                // torch.amp.GradScaler's defaults
//   for (auto& batch : loader) {
//     opt.zero_grad();
//     torch::Tensor loss;
//     {
//       perf::Autocast ac(torch::kCUDA);                    // bf16 on sm_80+, else fp16
//       loss = criterion(model->forward(batch.data), batch.target);
//     }
//     scaler.scale(loss).backward();
//     scaler.unscale_(opt);                                 // optional: before clipping
//     torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
//     scaler.step(opt);                                     // skipped when a gradient is inf/NaN
//     scaler.update();
//   }
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/detail/cpu.h>
#include <perf/detail/float.h>
#include <perf/optim.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace perf {

class TrainStep;

/// RAII autocast region for CUDA or CPU, like Python's `with torch.autocast(...)`.
/// Nestable: restores the previous enabled state, dtype and cache setting on
/// exit, and clears the autocast cache when the outermost region ends.
class Autocast {
 public:
  /// dtype unset: on CUDA bfloat16 on sm_80+, else float16; on the CPU bfloat16
  /// where the CPU computes it natively (AVX-512-BF16 or AMX-BF16), else the
  /// region stays fp32 (autocast off: emulated bf16 is slower than fp32), see
  /// default_enabled(). An explicit dtype is always honoured; bfloat16 on a CPU
  /// without native bf16 warns once per process (it is emulated, slower than fp32).
  explicit Autocast(c10::Device device, std::optional<c10::ScalarType> dtype = std::nullopt, bool enabled = true,
                    bool cache_enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;
  c10::ScalarType dtype() const noexcept { return dtype_; }
  /// Whether this region casts at all (false: disabled, or a CPU without native bf16).
  bool enabled() const noexcept { return enabled_; }
  /// The dtype Autocast picks for `device` when none is given.
  static c10::ScalarType default_dtype(c10::Device device);
  /// Whether an Autocast on `device` without a dtype casts: always on CUDA; on
  /// the CPU only with native bf16 (perf::setup()'s report says which features decided).
  static bool default_enabled(c10::Device device);
  /// The dtype an Autocast(device, dtype, enabled) would use; throws what its constructor would.
  static c10::ScalarType resolve_dtype(c10::Device device, std::optional<c10::ScalarType> dtype, bool enabled = true);

  /// How a CPU region runs scaled_dot_product_attention when it will be
  /// trained (grad mode on, an input requiring grad, no dropout). LibTorch's
  /// autocast casts it to bf16, whose CPU backward (torch 2.11) costs ~5x fp32's
  /// at short sequences (bench/e2e's transformer: 4.9 ms against 1.1 ms):
  ///   "fastest"  (default) time both once per shape (sizes, strides, dtypes,
  ///              mask, causal) on scratch inputs, forward and backward, and
  ///              keep the faster; the output keeps the autocast dtype.
  ///   "float32"  always fp32 inside, output cast to the autocast dtype.
  ///   "autocast" LibTorch's policy.
  /// Process-wide; applies inside perf::Autocast regions only (an autocast
  /// entered otherwise keeps LibTorch's policy), and inference is never changed.
  static void set_cpu_attention(const std::string& mode);
  static std::string cpu_attention();
  /// One line per shape "fastest" decided: the shapes, both times, the pick.
  static std::vector<std::string> cpu_attention_choices();

 private:
  c10::DeviceType type_;
  c10::ScalarType dtype_;
  bool enabled_;
  bool prev_enabled_, prev_cache_;
  c10::ScalarType prev_dtype_;
};

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
  /// Where the scale and the growth tracker live: cpu or cuda (torch.amp.GradScaler's
  /// `device`). Unset: the device of the first scaled loss. Set: created there by the
  /// constructor, so scale_tensor() exists before the first scale() (a graph can capture it).
  /// Like Python, a cuda scaler on a machine without CUDA warns and disables itself.
  TORCH_ARG(std::optional<c10::Device>, device);
};

/// torch.amp.GradScaler in C++, same semantics and defaults. The scale and the
/// growth tracker live on options().device(), else on the device of the first
/// scaled loss; bookkeeping runs there (ATen's _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_).
/// Host syncs: only step() on an optimizer without fused support reads the inf
/// flag to decide whether to skip (as in Python); with perf::optim optimizers
/// the skip happens on the device and step() never syncs. get_scale() syncs.
class GradScaler {
 public:
  explicit GradScaler(const GradScalerOptions& options = GradScalerOptions());

  /// loss * scale (the input unchanged when disabled).
  torch::Tensor scale(const torch::Tensor& outputs);
  std::vector<torch::Tensor> scale(const std::vector<torch::Tensor>& outputs);
  /// Divides the optimizer's gradients by the scale and records infs/NaNs. At
  /// most once per optimizer between update()s, and before step().
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales (unless unscale_ ran) and steps, unless a gradient was inf/NaN.
  /// Returns the optimizer's return value, or an undefined tensor if skipped.
  torch::Tensor step(torch::optim::Optimizer& optimizer);
  /// Backs off after a skipped step, grows after growth_interval clean steps.
  void update();
  void update(double new_scale);
  /// The current scale (host sync); 1.0 when disabled.
  double get_scale() const;
  /// The scale tensor on its device (undefined before the first scale()).
  const torch::Tensor& scale_tensor() const noexcept { return scale_; }
  int64_t growth_tracker() const;
  bool is_enabled() const noexcept { return options_.enabled(); }
  const GradScalerOptions& options() const noexcept { return options_; }

  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  /// Python's `GradScaler.state_dict()` ({"scale", "growth_factor",
  /// "backoff_factor", "growth_interval", "_growth_tracker"}; empty when
  /// disabled) and `load_state_dict` (checked before anything changes; a no-op
  /// when disabled): with perf::save / perf::load (perf/state_dict.h), an AMP run
  /// moves between Python and C++ with its scale.
  c10::impl::GenericDict state_dict() const;
  void load_state_dict(const c10::IValue& state);

 private:
  friend class TrainStep;  // undoes its warm-up steps
  void restore_(double scale, int64_t growth_tracker) {
    if (scale_.defined()) scale_.fill_(scale);
    if (growth_tracker_.defined()) growth_tracker_.fill_(growth_tracker);
    states_.clear();
  }

  enum class Stage { ready, unscaled, stepped };
  struct OptState {
    Stage stage = Stage::ready;
    std::vector<torch::Tensor> found_inf_per_device;
  };
  void check_initialized(const char* fn) const;
  // load / load_state_dict: `read(key)` gives the saved value; all read and checked before anything changes.
  void load_values(const char* source, const std::function<std::optional<c10::IValue>(const char*)>& read);
  void create_state(c10::Device device);  // the scale and the growth tracker, on `device`
  std::vector<torch::Tensor> unscale_grads(torch::optim::Optimizer& optimizer, const torch::Tensor& inv_scale,
                                           bool allow_fp16);

  GradScalerOptions options_;
  int64_t init_growth_tracker_ = 0;
  torch::Tensor scale_, growth_tracker_;
  std::unordered_map<const torch::optim::Optimizer*, OptState> states_;
};

/// torch::save(scaler, path) / torch::load(scaler, path).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const GradScaler& scaler);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradScaler& scaler);

// ---------------------------------------------------------------------------
namespace detail {

PERF_INLINE bool cuda_bf16_supported();

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/amp-inl.h>
#endif
