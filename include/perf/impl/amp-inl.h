// perf/impl/amp-inl.h — the out-of-line definitions of perf/amp.h.
// Included by perf/amp.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <perf/amp.h>

namespace perf {

namespace detail {

PERF_INLINE bool cuda_bf16_supported() {
#if PERF_WITH_CUDA
  if (c10::cuda::device_count() == 0) return false;
  return at::cuda::getCurrentDeviceProperties()->major >= 8;
#else
  return false;
#endif
}

}  // namespace detail

PERF_INLINE c10::ScalarType Autocast::default_dtype(c10::Device device) {
  if (device.is_cuda()) return detail::cuda_bf16_supported() ? at::kBFloat16 : at::kHalf;
  return at::kBFloat16;
}

PERF_INLINE bool Autocast::default_enabled(c10::Device device) {
  return !device.is_cpu() || detail::cpu_bf16().native();
}

PERF_INLINE c10::ScalarType Autocast::resolve_dtype(c10::Device device, std::optional<c10::ScalarType> dtype,
                                                    bool enabled) {
  TORCH_CHECK(device.is_cuda() || device.is_cpu(), "perf::Autocast: device must be cpu or cuda, got ", device);
  const auto t = dtype.value_or(default_dtype(device));
  TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf, "perf::Autocast: dtype ", t,
              " is not an autocast dtype; valid values: torch::kBFloat16, torch::kHalf");
  if (enabled && device.is_cuda()) {
#if PERF_WITH_CUDA
    TORCH_CHECK(c10::cuda::device_count() > 0, "perf::Autocast: ", device,
                " requested but no CUDA device is available");
    TORCH_CHECK(t != at::kBFloat16 || detail::cuda_bf16_supported(), "perf::Autocast: the current CUDA device (sm_",
                at::cuda::getCurrentDeviceProperties()->major, at::cuda::getCurrentDeviceProperties()->minor,
                ") does not support bfloat16; use torch::kHalf");
#else
    TORCH_CHECK(false, "perf::Autocast: ", device, " requested but perf was built without CUDA (PERF_WITH_CUDA=0)");
#endif
  }
  return t;
}

PERF_INLINE Autocast::Autocast(c10::Device device, std::optional<c10::ScalarType> dtype, bool enabled,
                               bool cache_enabled)
    : type_(device.type()),
      dtype_(resolve_dtype(device, dtype, enabled)),
      enabled_(enabled && (dtype.has_value() || default_enabled(device))) {
  prev_enabled_ = at::autocast::is_autocast_enabled(type_);
  prev_dtype_ = at::autocast::get_autocast_dtype(type_);
  prev_cache_ = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_enabled(type_, enabled_);
  at::autocast::set_autocast_dtype(type_, dtype_);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

PERF_INLINE Autocast::~Autocast() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, prev_enabled_);
  at::autocast::set_autocast_dtype(type_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_);
}

PERF_INLINE GradScaler::GradScaler(const GradScalerOptions& options) : options_(options) {
  TORCH_CHECK(options_.init_scale() > 0, "perf::GradScalerOptions::init_scale: must be > 0, got ",
              options_.init_scale());
  TORCH_CHECK(options_.growth_factor() > 1.0, "perf::GradScalerOptions::growth_factor: must be > 1.0, got ",
              options_.growth_factor());
  TORCH_CHECK(options_.backoff_factor() > 0.0 && options_.backoff_factor() < 1.0,
              "perf::GradScalerOptions::backoff_factor: must be in (0, 1), got ", options_.backoff_factor());
  TORCH_CHECK(options_.growth_interval() >= 1, "perf::GradScalerOptions::growth_interval: must be >= 1, got ",
              options_.growth_interval());
}

PERF_INLINE void GradScaler::check_initialized(const char* fn) const {
  TORCH_CHECK(scale_.defined(), "perf::GradScaler::", fn,
              ": no scale yet. This may indicate your program did not use scaler.scale(loss) earlier in the "
              "iteration.");
}

PERF_INLINE torch::Tensor GradScaler::scale(const torch::Tensor& outputs) {
  if (!is_enabled()) return outputs;
  if (!scale_.defined()) {
    scale_ = at::full({}, options_.init_scale(), at::device(outputs.device()).dtype(at::kFloat));
    growth_tracker_ = at::full({}, init_growth_tracker_, at::device(outputs.device()).dtype(at::kInt));
  }
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

PERF_INLINE std::vector<torch::Tensor> GradScaler::scale(const std::vector<torch::Tensor>& outputs) {
  std::vector<torch::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& o : outputs) out.push_back(scale(o));
  return out;
}

// Unscales every gradient of `optimizer` by inv_scale, grouped by device and
// dtype; returns one found_inf flag per device.
PERF_INLINE std::vector<torch::Tensor> GradScaler::unscale_grads(torch::optim::Optimizer& optimizer,
                                                                 const torch::Tensor& inv_scale, bool allow_fp16) {
  at::NoGradGuard no_grad;
  std::map<std::pair<std::string, c10::ScalarType>, std::vector<torch::Tensor>> groups;
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> per_device;  // found_inf, inv_scale
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(allow_fp16 || p.grad().scalar_type() != at::kHalf,
                  "perf::GradScaler::unscale_: attempting to unscale FP16 gradients; keep fp32 master parameters "
                  "(autocast casts the compute, not the parameters)");
      torch::Tensor g = p.grad();
      if (g.is_sparse()) {
        if (g.scalar_type() == at::kHalf) p.mutable_grad() = g = g.coalesce();
        g = g._values();
      }
      const std::string dev = g.device().str();
      if (!per_device.count(dev)) {
        per_device[dev] = {at::zeros({}, at::device(g.device()).dtype(at::kFloat)),
                           inv_scale.to(g.device(), /*non_blocking=*/true)};
      }
      groups[{dev, g.scalar_type()}].push_back(g);
    }
  }
  for (auto& [key, grads] : groups) {
    auto& [found_inf, inv] = per_device[key.first];
    grads = optim::detail::coalesce_flat(grads);  // a flat optimizer's gradients: one tensor
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv);
  }
  std::vector<torch::Tensor> found;
  for (auto& [dev, fi] : per_device) found.push_back(fi.first);
  return found;
}

PERF_INLINE void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) return;
  check_initialized("unscale_");
  auto& st = states_[&optimizer];
  TORCH_CHECK(st.stage != Stage::unscaled,
              "perf::GradScaler::unscale_: already called on this optimizer since the last update()");
  TORCH_CHECK(st.stage != Stage::stepped, "perf::GradScaler::unscale_: called after step(); call update() first");
  const auto inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  st.found_inf_per_device = unscale_grads(optimizer, inv_scale, /*allow_fp16=*/false);
  st.stage = Stage::unscaled;
}

PERF_INLINE torch::Tensor GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) return optimizer.step();
  check_initialized("step");
  auto& st = states_[&optimizer];
  TORCH_CHECK(st.stage != Stage::stepped, "perf::GradScaler::step: already called since the last update()");
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer)) {
    // Device-side skip: the fused kernels unscale and honour found_inf.
    if (st.stage == Stage::ready) {
      st.found_inf_per_device = unscale_grads(optimizer, at::ones({}, scale_.options()), /*allow_fp16=*/true);
    }
    auto found_inf = at::zeros({}, scale_.options());
    for (const auto& f : st.found_inf_per_device) found_inf.add_(f.to(scale_.device(), /*non_blocking=*/true));
    const std::optional<torch::Tensor> grad_scale =
        st.stage == Stage::unscaled ? std::nullopt : std::optional<torch::Tensor>(scale_);
    fused->step_scaled(grad_scale, found_inf);
    st.stage = Stage::stepped;
    return {};
  }
  if (st.stage == Stage::ready) unscale_(optimizer);
  TORCH_CHECK(!st.found_inf_per_device.empty(),
              "perf::GradScaler::step: no inf checks were recorded for this "
              "optimizer (it has no gradients?)");
  double inf_sum = 0;
  for (const auto& f : st.found_inf_per_device) inf_sum += f.item<double>();  // the documented sync
  torch::Tensor ret;
  if (inf_sum == 0) ret = optimizer.step();
  st.stage = Stage::stepped;
  return ret;
}

PERF_INLINE void GradScaler::update() {
  if (!is_enabled()) return;
  check_initialized("update");
  std::vector<torch::Tensor> found;
  for (auto& [opt, st] : states_)
    for (auto& f : st.found_inf_per_device) found.push_back(f.to(scale_.device(), /*non_blocking=*/true));
  TORCH_CHECK(!found.empty(),
              "perf::GradScaler::update: no inf checks were recorded prior to update(); call "
              "step() (or unscale_()) first");
  auto combined = found[0];
  for (size_t i = 1; i < found.size(); ++i) combined = combined + found[i];
  at::_amp_update_scale_(scale_, growth_tracker_, combined, options_.growth_factor(), options_.backoff_factor(),
                         options_.growth_interval());
  states_.clear();
}

PERF_INLINE void GradScaler::update(double new_scale) {
  if (!is_enabled()) return;
  check_initialized("update");
  scale_.fill_(new_scale);
  states_.clear();
}

PERF_INLINE double GradScaler::get_scale() const {
  if (!is_enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : options_.init_scale();
}

PERF_INLINE int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

PERF_INLINE void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  TORCH_CHECK(is_enabled(), "perf::GradScaler::save: a disabled GradScaler has no state to save");
  archive.write("scale", c10::IValue(get_scale()));
  archive.write("growth_factor", c10::IValue(options_.growth_factor()));
  archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
  archive.write("growth_interval", c10::IValue(options_.growth_interval()));
  archive.write("_growth_tracker", c10::IValue(growth_tracker()));
}

PERF_INLINE void GradScaler::load(torch::serialize::InputArchive& archive) {
  if (!is_enabled()) return;
  c10::IValue v;
  TORCH_CHECK(archive.try_read("scale", v),
              "perf::GradScaler::load: the archive has no scaler state (saved from a disabled GradScaler?)");
  options_.init_scale(v.toDouble());
  if (scale_.defined()) scale_.fill_(v.toDouble());
  archive.read("growth_factor", v);
  options_.growth_factor(v.toDouble());
  archive.read("backoff_factor", v);
  options_.backoff_factor(v.toDouble());
  archive.read("growth_interval", v);
  options_.growth_interval(v.toInt());
  archive.read("_growth_tracker", v);
  init_growth_tracker_ = v.toInt();
  if (growth_tracker_.defined()) growth_tracker_.fill_(init_growth_tracker_);
}

PERF_INLINE torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                                        const GradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

PERF_INLINE torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

}  // namespace perf
