// perf/impl/amp-inl.h — the out-of-line definitions of perf/amp.h.
// Included by perf/amp.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <perf/amp.h>

// CUDA's headers only here, where the definitions use them: a perf::perf_static user's
// translation unit does not compile them (docs/compile-time.md).
#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif
#include <torch/csrc/autograd/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iomanip>
#include <mutex>
#include <sstream>

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

// GradScaler's copies between its device and the loss's or a gradient's. To the CPU a copy is
// blocking: with non_blocking, ATen's _to_copy pins the output and the CUDA->CPU copy lands
// asynchronously, so the CPU op right after it (the multiply, the inf sum) would read it before it
// arrived. To a GPU it stays asynchronous (host memory is staged; stream order does the rest).
PERF_INLINE at::Tensor scaler_copy(const at::Tensor& t, c10::Device device) {
  return t.to(device, /*non_blocking=*/!device.is_cpu());
}

// --- CPU autocast and scaled_dot_product_attention -------------------------
// perf registers its own AutocastCPU kernel for aten::scaled_dot_product_attention
// (once, when the first CPU perf::Autocast region opens). Outside perf's regions,
// for inference, with dropout, or in "autocast" mode it does what LibTorch's
// kernel does (autocast_mode.cpp: lower_precision_fp); else it runs the op in
// fp32 or the autocast dtype as the mode, or a measurement per shape, says.

enum class CpuAttention { fastest, float32, autocast };
inline constexpr const char* kCpuAttentionNames[] = {"fastest", "float32", "autocast"};  // in the enum's order

inline std::atomic<int>& cpu_attention_mode() {
  static std::atomic<int> mode{static_cast<int>(CpuAttention::fastest)};
  return mode;
}

inline int& cpu_autocast_depth() {  // open CPU perf::Autocast regions on this thread
  thread_local int depth = 0;
  return depth;
}

struct CpuAttentionChoices {
  std::mutex mutex;
  std::map<std::vector<int64_t>, bool> use_float;  // key -> fp32 is faster
  std::vector<std::string> lines;
};

inline CpuAttentionChoices& cpu_attention_choices() {
  static auto* c = new CpuAttentionChoices();  // never destroyed: used by kernels until exit
  return *c;
}

PERF_INLINE void add_to_key(std::vector<int64_t>& key, const at::Tensor& t) {
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.dim());
  key.insert(key.end(), t.sizes().begin(), t.sizes().end());
  key.insert(key.end(), t.strides().begin(), t.strides().end());
}

PERF_INLINE void describe_tensor(std::ostringstream& text, const at::Tensor& t) {
  text << t.scalar_type() << t.sizes();
  if (!t.is_contiguous()) text << " strides " << t.strides();
  text << " ";
}

// A tensor of t's sizes, strides and dtype with values from `gen`, a leaf
// requiring grad as t does: what the measurement runs on (the user's RNG untouched).
PERF_INLINE at::Tensor scratch_like(const at::Tensor& t, at::Generator& gen) {
  auto s = at::empty_strided(t.sizes(), t.strides(), t.options());
  if (t.is_floating_point()) {
    s.normal_(0.0, 1.0, gen);
  } else {
    s.copy_(t);
  }
  return s.set_requires_grad(t.requires_grad() && t.is_floating_point());
}

PERF_INLINE at::Tensor sdpa_in(at::ScalarType compute, c10::ScalarType out_dtype, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                               double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  // Autocast's eligible inputs (floating, not double: cached_cast's rule) in `compute`.
  auto cast = [compute](const at::Tensor& t) {
    return t.is_floating_point() && t.scalar_type() != at::kDouble ? t.to(compute) : t;
  };
  std::optional<at::Tensor> m;
  if (mask && mask->defined()) m = cast(*mask);
  auto out = at::scaled_dot_product_attention(cast(q), cast(k), cast(v), m, dropout_p, is_causal, scale, enable_gqa);
  return compute == at::kFloat && out.scalar_type() == at::kFloat ? out.to(out_dtype) : out;
}

// Forward and backward of both variants on scratch inputs: one warm-up each,
// then the smaller of three timings each, alternated. Where the autocast
// dtype's first timed run takes over 0.25 s (long sequences, where it wins),
// float32 is not timed: the autocast dtype is kept.
PERF_INLINE bool measure_float_is_faster(c10::ScalarType lower, const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const std::optional<at::Tensor>& mask, bool is_causal,
                                         std::optional<double> scale, bool enable_gqa, std::string& why) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
  const auto sq = scratch_like(q, gen), sk = scratch_like(k, gen), sv = scratch_like(v, gen);
  std::optional<at::Tensor> sm;
  if (mask && mask->defined()) sm = scratch_like(*mask, gen);
  std::vector<at::Tensor> leaves;
  for (const auto* t : {&sq, &sk, &sv}) {
    if (t->requires_grad()) leaves.push_back(*t);
  }
  if (sm && sm->requires_grad()) leaves.push_back(*sm);
  at::Tensor go;
  auto run = [&](at::ScalarType compute) {
    const auto start = std::chrono::steady_clock::now();
    auto out = sdpa_in(compute, lower, sq, sk, sv, sm, 0.0, is_causal, scale, enable_gqa);
    if (!go.defined()) go = at::empty_like(out).normal_(0.0, 1.0, gen);
    torch::autograd::grad({out}, leaves, {go}, /*retain_graph=*/false, /*create_graph=*/false,
                          /*allow_unused=*/true);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  at::AutoGradMode grad(true);
  run(lower);  // warm-up: the first call in a process also pays one-time setup (measured: 274 ms for 5 ms of work)
  double low = run(lower);
  if (low > 250.0) {
    why = "autocast dtype kept unmeasured (one forward and backward took " + std::to_string(low) + " ms)";
    return false;
  }
  run(at::kFloat);
  double flt = run(at::kFloat);
  for (int i = 0; i < 2; ++i) {
    flt = std::min(flt, run(at::kFloat));
    low = std::min(low, run(lower));
  }
  std::ostringstream text;
  text << std::fixed << std::setprecision(3) << "float32 " << flt << " ms, " << lower << " " << low << " ms";
  why = text.str();
  return flt < low;
}

// "fastest": the measured pick for this shape, measuring it on first sight.
PERF_INLINE bool fastest_is_float(c10::ScalarType lower, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask, bool is_causal, std::optional<double> scale,
                                  bool enable_gqa) {
  std::vector<int64_t> key{static_cast<int64_t>(lower), is_causal, enable_gqa};
  for (const auto* t : {&q, &k, &v}) add_to_key(key, *t);
  if (mask && mask->defined()) add_to_key(key, *mask);
  auto& c = cpu_attention_choices();
  std::lock_guard<std::mutex> lock(c.mutex);  // measurements one at a time: they time the whole CPU
  const auto it = c.use_float.find(key);
  if (it != c.use_float.end()) return it->second;
  std::ostringstream shapes;
  for (const auto* t : {&q, &k, &v}) describe_tensor(shapes, *t);
  if (mask && mask->defined()) {
    shapes << "mask ";
    describe_tensor(shapes, *mask);
  }
  if (is_causal) shapes << "causal ";
  constexpr size_t kMaxShapes = 256;  // varying shapes: measure the first ones, keep LibTorch's policy for the rest
  bool use_float = false;
  std::string why;
  if (c.use_float.size() >= kMaxShapes) {
    why = "autocast dtype kept unmeasured (" + std::to_string(kMaxShapes) + " shapes measured already)";
  } else {
    try {
      use_float = measure_float_is_faster(lower, q, k, v, mask, is_causal, scale, enable_gqa, why);
    } catch (const std::exception& e) {  // e.g. out of memory for the scratch copies: never fail the step
      why = std::string("autocast dtype kept, the measurement failed: ") + e.what();
      use_float = false;
    }
  }
  c.use_float.emplace(std::move(key), use_float);
  c.lines.push_back(shapes.str() + "-> " + (use_float ? "float32" : std::string(c10::toString(lower))) + " (" + why +
                    ")");
  return use_float;
}

PERF_INLINE at::Tensor autocast_cpu_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                                         std::optional<double> scale, bool enable_gqa) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const auto lower = at::autocast::get_lower_precision_fp_from_device_type(c10::DeviceType::CPU);
  const bool trained = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                                      (mask && mask->defined() && mask->requires_grad()));
  const auto mode = static_cast<CpuAttention>(cpu_attention_mode().load());
  if (cpu_autocast_depth() > 0 && trained && detail::same_value(dropout_p, 0.0) && mode != CpuAttention::autocast &&
      (mode == CpuAttention::float32 || fastest_is_float(lower, q, k, v, mask, is_causal, scale, enable_gqa))) {
    return sdpa_in(at::kFloat, lower, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  }
  // LibTorch's own policy for this op (WrapFunction_<CastPolicy::lower_precision_fp>).
  const auto dev = c10::DeviceType::CPU;
  return at::scaled_dot_product_attention(
      at::autocast::cached_cast(lower, q, dev), at::autocast::cached_cast(lower, k, dev),
      at::autocast::cached_cast(lower, v, dev), at::autocast::cached_cast(lower, mask, dev), dropout_p, is_causal,
      scale, enable_gqa);
}

// Drops the dispatcher's "Overriding a previously registered kernel" warning
// for perf's own registration; passes every other warning on.
class QuietOverride : public c10::WarningHandler {
 public:
  explicit QuietOverride(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& w) override {
    if (w.msg().find("Overriding a previously registered kernel") == std::string::npos) next_->process(w);
  }

 private:
  c10::WarningHandler* next_;
};

PERF_INLINE void install_cpu_attention_kernel() {
  static std::once_flag once;
  std::call_once(once, [] {
    QuietOverride quiet(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    // Never destroyed (destroying it would deregister the kernel while other
    // threads may still call it), and held by a static so it is not a leak.
    static torch::Library* lib = nullptr;
    lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutocastCPU, __FILE__, __LINE__);
    lib->impl("scaled_dot_product_attention", TORCH_FN(autocast_cpu_sdpa));
  });
}

}  // namespace detail

PERF_INLINE void Autocast::set_cpu_attention(const std::string& mode) {
  const auto* names = std::begin(detail::kCpuAttentionNames);
  const auto* it = std::find(names, std::end(detail::kCpuAttentionNames), mode);
  TORCH_CHECK(it != std::end(detail::kCpuAttentionNames),
              "perf::Autocast::set_cpu_attention: mode must be \"fastest\", \"float32\" or \"autocast\", got \"", mode,
              "\"");
  detail::cpu_attention_mode().store(static_cast<int>(it - names));
}

PERF_INLINE std::string Autocast::cpu_attention() {
  return detail::kCpuAttentionNames[detail::cpu_attention_mode().load()];
}

PERF_INLINE std::vector<std::string> Autocast::cpu_attention_choices() {
  auto& c = detail::cpu_attention_choices();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.lines;
}

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
  if (type_ == c10::DeviceType::CPU && enabled_) {
    detail::install_cpu_attention_kernel();
    ++detail::cpu_autocast_depth();
    // Asked for by name (unset, the region would have stayed fp32 here): honoured, but said once, since a
    // training loop opens a region per step.
    if (dtype_ == at::kBFloat16 && !detail::cpu_bf16().native()) {
      TORCH_WARN_ONCE("perf::Autocast: bfloat16 on a CPU without bfloat16 instructions (",
                      detail::cpu_bf16().features(),
                      "): ATen emulates it, far slower than float32 (a 512x512 matmul 58x, a 3x3 convolution 35x "
                      "on an AVX2 CPU). Leave the dtype unset, perf::Autocast(torch::kCPU), to run such a CPU in "
                      "float32.");
    }
  }
}

PERF_INLINE Autocast::~Autocast() {
  if (type_ == c10::DeviceType::CPU && enabled_) --detail::cpu_autocast_depth();
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
  if (!options_.device()) return;
  const c10::Device device = *options_.device();
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "perf::GradScalerOptions::device: must be cpu or cuda, got ",
              device);
  if (device.is_cuda() && options_.enabled() && !at::hasCUDA()) {
    // torch.amp.GradScaler("cuda") does the same: the program still trains, unscaled.
    TORCH_WARN("perf::GradScaler: device ", device, " requested but CUDA is not available; disabling the scaler");
    options_.enabled(false);
  }
  if (options_.enabled()) create_state(device);
}

PERF_INLINE void GradScaler::create_state(c10::Device device) {
  scale_ = at::full({}, options_.init_scale(), at::device(device).dtype(at::kFloat));
  growth_tracker_ = at::full({}, init_growth_tracker_, at::device(device).dtype(at::kInt));
}

PERF_INLINE void GradScaler::check_initialized(const char* fn) const {
  TORCH_CHECK(scale_.defined(), "perf::GradScaler::", fn,
              ": no scale yet. This may indicate your program did not use scaler.scale(loss) earlier in the "
              "iteration.");
}

PERF_INLINE torch::Tensor GradScaler::scale(const torch::Tensor& outputs) {
  if (!is_enabled()) return outputs;
  if (!scale_.defined()) create_state(outputs.device());
  return outputs * detail::scaler_copy(scale_, outputs.device());
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
  // A parameter listed twice (a torch::optim optimizer given LibTorch's parameters() of a model with a tensor
  // registered under two names) is unscaled once.
  std::unordered_set<const void*> seen;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
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
                           detail::scaler_copy(inv_scale, g.device())};
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
  found.reserve(per_device.size());
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
    for (const auto& f : st.found_inf_per_device) found_inf.add_(detail::scaler_copy(f, scale_.device()));
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
  if (detail::same_value(inf_sum, 0.0)) ret = optimizer.step();
  st.stage = Stage::stepped;
  return ret;
}

PERF_INLINE void GradScaler::update() {
  if (!is_enabled()) return;
  check_initialized("update");
  std::vector<torch::Tensor> found;
  for (auto& [opt, st] : states_)
    for (auto& f : st.found_inf_per_device) found.push_back(detail::scaler_copy(f, scale_.device()));
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
  if (!is_enabled()) return;  // Python's state_dict() of a disabled scaler is empty
  archive.write("scale", c10::IValue(get_scale()));
  archive.write("growth_factor", c10::IValue(options_.growth_factor()));
  archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
  archive.write("growth_interval", c10::IValue(options_.growth_interval()));
  archive.write("_growth_tracker", c10::IValue(growth_tracker()));
}

PERF_INLINE void GradScaler::load(torch::serialize::InputArchive& archive) {
  if (!is_enabled()) return;  // as Python's load_state_dict
  load_values("perf::GradScaler::load: the archive", [&](const char* key) {
    c10::IValue v;
    return archive.try_read(key, v) ? std::optional<c10::IValue>(v) : std::nullopt;
  });
}

PERF_INLINE c10::impl::GenericDict GradScaler::state_dict() const {
  c10::impl::GenericDict d(c10::AnyType::get(), c10::AnyType::get());
  if (!is_enabled()) return d;  // Python's state_dict() of a disabled scaler is empty
  d.insert("scale", get_scale());
  d.insert("growth_factor", options_.growth_factor());
  d.insert("backoff_factor", options_.backoff_factor());
  d.insert("growth_interval", options_.growth_interval());
  d.insert("_growth_tracker", growth_tracker());
  return d;
}

PERF_INLINE void GradScaler::load_state_dict(const c10::IValue& state) {
  if (!is_enabled()) return;  // as Python's load_state_dict
  TORCH_CHECK(state.isGenericDict(), "perf::GradScaler::load_state_dict: the state is a ", state.tagKind(),
              ", not Python's GradScaler.state_dict() (a dict)");
  const auto d = state.toGenericDict();
  TORCH_CHECK(!d.empty(),
              "perf::GradScaler::load_state_dict: the state is empty, possibly because it was saved from a disabled "
              "GradScaler (Python's words)");
  load_values("perf::GradScaler::load_state_dict: the state",
              [&](const char* key) { return d.contains(key) ? std::optional<c10::IValue>(d.at(key)) : std::nullopt; });
}

PERF_INLINE void GradScaler::load_values(const char* source,
                                         const std::function<std::optional<c10::IValue>(const char*)>& read) {
  TORCH_CHECK(read("scale"), source, " has no scaler state (saved from a disabled GradScaler?)");
  // Everything read and checked before anything changes.
  const auto number = [&](const char* key, bool integer) {
    const auto v = read(key);
    TORCH_CHECK(v && (integer ? v->isInt() : v->isDouble() || v->isInt()), source, "'s \"", key,
                "\" is missing or not ", integer ? "an integer" : "a number", ": not a GradScaler's state");
    return *v;
  };
  const double scale = number("scale", false).toScalar().toDouble();
  GradScalerOptions loaded = options_;
  loaded.init_scale(scale);
  loaded.growth_factor(number("growth_factor", false).toScalar().toDouble());
  loaded.backoff_factor(number("backoff_factor", false).toScalar().toDouble());
  loaded.growth_interval(number("growth_interval", true).toInt());
  const int64_t tracker = number("_growth_tracker", true).toInt();
  TORCH_CHECK(tracker >= 0, source, "'s \"_growth_tracker\" must be >= 0, got ", tracker);
  try {
    GradScalerOptions check = loaded;
    static_cast<void>(GradScaler(check.device(std::nullopt)));  // the constructor's checks, each naming its value
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, source, " holds a value a GradScaler refuses (", e.what_without_backtrace(),
                "); nothing was loaded");
  }
  options_ = loaded;
  if (scale_.defined()) scale_.fill_(scale);
  init_growth_tracker_ = tracker;
  if (growth_tracker_.defined()) growth_tracker_.fill_(tracker);
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
