// perf/impl/optim-inl.h — the out-of-line definitions of perf/optim.h.
// Included by perf/optim.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <perf/optim.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <cuda_runtime_api.h>  // elements_per_call: the SM count
#endif

namespace perf::optim {

namespace detail {

PERF_INLINE Bucket& bucket_for(std::vector<Bucket>& buckets, const c10::Device& device, c10::ScalarType dtype,
                               bool first) {
  for (auto& b : buckets)
    if (b.device == device && b.dtype == dtype && b.first == first) return b;
  buckets.push_back(Bucket{device, dtype, first, {}, {}, {}, {}, {}, {}, {}, false, 0, 0});
  return buckets.back();
}

PERF_INLINE Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p, bool first) {
  return bucket_for(buckets, p.device(), p.scalar_type(), first);
}

PERF_INLINE void clear_grad(at::Tensor& g, bool set_to_none) {
  if (!g.defined()) return;
  if (g.grad_fn()) {
    g = g.detach();
  } else {
    g.requires_grad_(false);
  }
  if (set_to_none) {
    g.reset();
  } else {
    g.zero_();
  }
}

PERF_INLINE int64_t flat_align(int64_t n, c10::ScalarType dtype) {
  const int64_t a = std::max<int64_t>(1, 256 / static_cast<int64_t>(c10::elementSize(dtype)));
  return (n + a - 1) / a * a;
}

PERF_INLINE at::Tensor plain_view(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes,
                                  at::IntArrayRef strides) {
  return at::empty({0}, buffer.options()).set_(buffer.storage(), offset, sizes, strides);
}

PERF_INLINE at::Tensor slot_view(const at::Tensor& buffer, const FlatSlot& s) {
  return plain_view(buffer, s.offset, s.sizes, s.strides);
}

PERF_INLINE bool owns_storage(const at::Tensor& t) {
  return t.layout() == at::kStrided && t.storage_offset() == 0 && t.storage().nbytes() == t.nbytes();
}

PERF_INLINE bool same_storage(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.layout() == at::kStrided && b.layout() == at::kStrided &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

PERF_INLINE std::unordered_map<const void*, InPlaceRange> in_place_storages(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const std::unordered_set<const void*>& own,
    const char* name) {
  struct Use {
    int64_t begin, end;  // bytes of the storage that the parameter's elements span
    size_t g, i;
    const at::Tensor* p;
  };
  std::unordered_map<const void*, std::vector<Use>> uses;
  std::unordered_set<const void*> seen;  // a parameter passed twice is refused by the caller, by that name
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      if (p.layout() != at::kStrided || p.numel() == 0 || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
      int64_t extent = 1;
      for (int64_t d = 0; d < p.dim(); ++d) extent += (p.size(d) - 1) * p.stride(d);
      const int64_t item = p.element_size();
      uses[p.storage().unsafeGetStorageImpl()].push_back(
          {p.storage_offset() * item, (p.storage_offset() + extent) * item, g, i, &p});
    }
  }
  std::unordered_map<const void*, InPlaceRange> out;
  for (auto& [storage, v] : uses) {
    if (v.size() == 1 && owns_storage(*v[0].p)) continue;  // the usual case: a tensor of its own
    std::sort(v.begin(), v.end(), [](const Use& a, const Use& b) { return a.begin < b.begin; });
    size_t last = 0;  // the use reaching furthest so far
    bool gap_free = true;
    for (size_t n = 1; n < v.size(); ++n) {
      const auto& a = v[last];
      const auto& b = v[n];
      if (b.begin < a.end) {
        const bool a_first = std::make_pair(a.g, a.i) < std::make_pair(b.g, b.i);
        const auto& later = a_first ? b : a;
        const auto& earlier = a_first ? a : b;
        TORCH_CHECK(false, name, ": flat(true): parameter ", later.i, " of group ", later.g,
                    " shares memory with parameter ", earlier.i, " of group ", earlier.g,
                    " (their elements overlap: tied weights, or one a view of the other); flat mode gives each "
                    "parameter its own place in the buffer, which would untie them: pass the shared tensor once");
      }
      gap_free = gap_free && b.begin == v[n - 1].end;
      if (b.end > a.end) last = n;
    }
    if (own.count(storage) || !gap_free) continue;
    const auto& first = *v.front().p;
    const bool alike = std::all_of(v.begin(), v.end(), [&](const Use& u) {
      return u.p->scalar_type() == first.scalar_type() && u.p->is_non_overlapping_and_dense();
    });
    if (!alike) continue;
    const int64_t item = first.element_size();
    out[storage] = InPlaceRange{v.front().begin / item, (v.back().end - v.front().begin) / item};
  }
  return out;
}

PERF_INLINE std::mutex& flat_registry_mutex() {
  static std::mutex m;
  return m;
}

PERF_INLINE std::unordered_map<const void*, size_t>& flat_registry() {
  static std::unordered_map<const void*, size_t> r;
  return r;
}

PERF_INLINE void flat_register(const FlatStore& f, bool add) {
  std::lock_guard<std::mutex> lock(flat_registry_mutex());
  for (const auto& k : f.keys) {
    if (!k.grads.defined()) continue;
    const void* impl = k.grads.storage().unsafeGetStorageImpl();
    if (add) {
      flat_registry()[impl] = k.slots;
    } else {
      flat_registry().erase(impl);
    }
  }
}

PERF_INLINE std::vector<at::Tensor> coalesce_flat(const std::vector<at::Tensor>& grads) {
  std::unordered_map<const void*, std::unordered_set<const void*>> seen;  // storage -> grads
  {
    std::lock_guard<std::mutex> lock(flat_registry_mutex());
    if (flat_registry().empty()) return grads;
    for (const auto& g : grads) {
      if (!g.defined() || g.is_sparse()) continue;
      const void* st = g.storage().unsafeGetStorageImpl();
      auto it = flat_registry().find(st);
      if (it != flat_registry().end()) seen[st].insert(g.unsafeGetTensorImpl());
    }
    for (auto it = seen.begin(); it != seen.end();) {
      it = it->second.size() == flat_registry().at(it->first) ? std::next(it) : seen.erase(it);
    }
  }
  if (seen.empty()) return grads;
  std::vector<at::Tensor> out;
  std::unordered_set<const void*> done;
  for (const auto& g : grads) {
    if (!g.defined() || g.is_sparse()) {
      out.push_back(g);
      continue;
    }
    const void* st = g.storage().unsafeGetStorageImpl();
    if (!seen.count(st)) {
      out.push_back(g);
    } else if (done.insert(st).second) {
      const auto n = static_cast<int64_t>(g.storage().nbytes() / static_cast<size_t>(g.element_size()));
      out.push_back(plain_view(g, 0, {n}, {1}));
    }
  }
  return out;
}

PERF_INLINE bool fused_available(const Bucket& b) {
  const bool dtype_ok =
      b.dtype == at::kFloat || b.dtype == at::kDouble || b.dtype == at::kHalf || b.dtype == at::kBFloat16;
  return dtype_ok && (b.device.is_cpu() || b.device.is_cuda());
}

PERF_INLINE bool use_fused(const std::optional<bool>& fused, const Bucket& b, const char* name) {
  const bool available = fused_available(b);
  if (fused.has_value() && *fused) {
    TORCH_CHECK(available, name, ": fused(true) but no fused kernel for ", b.device, " ", b.dtype,
                " (fused kernels: cpu or cuda, float/double/half/bfloat16); use fused(false) or leave it unset");
  }
  return fused.value_or(true) && available;
}

PERF_INLINE int64_t elements_per_call(const Bucket& b) {
  if (!b.flat || !b.device.is_cuda()) return 0;
#if PERF_WITH_CUDA
  constexpr int64_t chunk = 65536, max_blocks = 320;  // ATen's multi_tensor_apply for the fused optimizers
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, b.device.index() < 0 ? 0 : b.device.index()) !=
          cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();  // clear it: the bucket goes in one call, as ATen would
    return 0;
  }
  const int64_t per_sm = std::max<int64_t>(1, max_blocks / sms);
  return per_sm * std::min<int64_t>(sms, max_blocks) * chunk;
#else
  return 0;
#endif
}

PERF_INLINE std::atomic<int>& flat_cuda_streams_setting() noexcept {
  static std::atomic<int> streams{1};
  return streams;
}

PERF_INLINE int flat_cuda_streams() noexcept { return flat_cuda_streams_setting().load(); }

PERF_INLINE void set_flat_cuda_streams(int streams) {
  TORCH_CHECK(streams == 1 || streams == 2, "perf::optim::detail::set_flat_cuda_streams: streams must be 1 or 2, got ",
              streams);
  flat_cuda_streams_setting().store(streams);
}

PERF_INLINE StreamAlternation::StreamAlternation(SideStream* side, const c10::Device& device) {
  if (side == nullptr) return;
  const auto current = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  if (current == side->stream) return;  // the pool handed out the stream this thread is on: nothing to overlap
  side->fork.record(current);           // before the first call: the side stream waits for what came before it
  side_ = side;
  current_ = current;
}

PERF_INLINE void StreamAlternation::join() {
  joined_ = true;
  if (!forked_) return;
  side_->join.record(side_->stream);
  side_->join.block(*current_);
}

PERF_INLINE StreamAlternation::~StreamAlternation() {
  if (joined_) return;
  try {
    join();
  } catch (...) {  // NOLINT(bugprone-empty-catch): the exception that unwinds us is the one to report
  }
}

PERF_INLINE std::string StreamAlternation::note(size_t calls) const {
  if (calls < 2) return "";
  return ", " + std::to_string(calls) + " calls" + (forked_ ? " on 2 streams" : "");
}

PERF_INLINE std::string kernel_line(const Bucket& b, bool fused) {
  std::string line = b.device.str() + " " + c10::toString(b.dtype) + ": " + (fused ? "fused" : "foreach");
  if (b.flat) {
    line += ", flat (" + std::to_string(b.params.size()) + (b.params.size() == 1 ? " tensor" : " tensors") + " for " +
            std::to_string(b.parameters) + (b.parameters == 1 ? " parameter" : " parameters") +
            (b.in_place > 0 ? ", " + std::to_string(b.in_place) + " of them in place in a buffer they share" : "") +
            ")";
  }
  return line;
}

PERF_INLINE std::vector<torch::optim::OptimizerParamGroup> checked_params(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const char* name) {
  std::vector<torch::optim::OptimizerParamGroup> out;
  out.reserve(groups.size());
  std::unordered_map<const void*, std::pair<size_t, size_t>> where;  // tensor -> (group, index) as given
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    std::vector<at::Tensor> kept;
    kept.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(params[i].defined(), name, ": parameter ", i, " of group ", g, " is undefined");
      TORCH_CHECK(at::isFloatingType(params[i].scalar_type()), name, ": parameter ", i, " of group ", g, " has dtype ",
                  params[i].scalar_type(), "; optimizers need floating-point parameters");
      TORCH_CHECK(params[i].device() == params[0].device(), name, ": parameters of group ", g,
                  " are on different devices (", params[0].device(), " and ", params[i].device(), " at index ", i,
                  "); put each device's parameters in its own group");
      const auto [it, fresh] = where.emplace(params[i].unsafeGetTensorImpl(), std::make_pair(g, i));
      if (fresh) {
        kept.push_back(params[i]);
        continue;
      }
      TORCH_CHECK(it->second.first == g, name, ": parameter ", i, " of group ", g, " is parameter ", it->second.second,
                  " of group ", it->second.first,
                  ": some parameters appear in more than one parameter group (as Python's optimizers, perf refuses "
                  "this); give each parameter one group");
    }
    out.emplace_back(std::move(kept));
    if (groups[g].has_options()) out.back().set_options(groups[g].options().clone());
  }
  return out;
}

PERF_INLINE void check_grad(const at::Tensor& p, size_t g, const char* name) {
  TORCH_CHECK(!p.grad().is_sparse(), name, " does not support sparse gradients (parameter in group ", g,
              "); use a dense embedding (sparse=false) or torch::optim::SGD");
}

PERF_INLINE void to_param_device(at::Tensor& t, const at::Tensor& p) {
  if (t.defined() && t.device() != p.device()) t = t.to(p.device());
}

PERF_INLINE std::optional<at::Tensor> on_device(const std::optional<at::Tensor>& t, const c10::Device& d) {
  if (!t) return std::nullopt;
  return t->device() == d ? *t : t->to(d, /*non_blocking=*/true);
}

PERF_INLINE bool foreach_prepare_scaled(std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& grad_scale,
                                        const std::optional<at::Tensor>& found_inf) {
  if (found_inf && !perf::detail::same_value(found_inf->item<float>(), 0.0f)) return false;
  if (grad_scale) grads = at::_foreach_div(grads, *grad_scale);
  return true;
}

PERF_INLINE c10::IValue read_option(torch::serialize::InputArchive& archive, const char* key, const char* who) {
  c10::IValue v;
  TORCH_CHECK(archive.try_read(key, v), who, ": the checkpoint's parameter group has no option \"", key,
              "\" (torch::optim and perf::optim always write it): not an optimizer checkpoint of this kind");
  return v;
}

PERF_INLINE void read_bool_if_present(torch::serialize::InputArchive& archive, const char* key, bool& out) {
  c10::IValue v;
  if (archive.try_read(key, v)) out = v.toBool();
}

PERF_INLINE void read_tensor_if_present(torch::serialize::InputArchive& archive, const char* key, at::Tensor& out) {
  c10::IValue v;
  if (archive.try_read(key, v)) out = v.toTensor();
}

PERF_INLINE c10::impl::GenericDict python_dict() {
  return c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
}

PERF_INLINE std::vector<double>* SchedulerGroupValues::find(const std::string& key) {
  for (auto& kv : values)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

PERF_INLINE std::vector<double>& SchedulerGroupValues::operator[](const std::string& key) {
  if (auto* found = find(key)) return *found;
  values.emplace_back(key, std::vector<double>());
  return values.back().second;
}

PERF_INLINE std::mutex& scheduler_group_values_mutex() {
  static std::mutex m;
  return m;
}

PERF_INLINE std::unordered_map<const torch::optim::Optimizer*, SchedulerGroupValues>& scheduler_group_values() {
  static std::unordered_map<const torch::optim::Optimizer*, SchedulerGroupValues> values;
  return values;
}

PERF_INLINE double python_number(const c10::impl::GenericDict& d, const char* key, const std::string& who,
                                 const std::string& where) {
  TORCH_CHECK(d.contains(key), who, ": the state has no \"", key, "\"", where);
  const c10::IValue v = d.at(key);
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().item<double>();  // a capturable lr
  TORCH_CHECK(v.isDouble() || v.isInt(), who, ": \"", key, "\"", where, " is a ", v.tagKind(), ", not a number");
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

PERF_INLINE bool python_bool(const c10::impl::GenericDict& d, const char* key, std::optional<bool> otherwise,
                             const std::string& who, const std::string& where) {
  if (!d.contains(key) && otherwise) return *otherwise;
  TORCH_CHECK(d.contains(key), who, ": the state has no \"", key, "\"", where);
  const c10::IValue v = d.at(key);
  TORCH_CHECK(v.isBool(), who, ": \"", key, "\"", where, " is a ", v.tagKind(), ", not a bool");
  return v.toBool();
}

PERF_INLINE at::Tensor python_tensor(const c10::impl::GenericDict& d, const char* key, bool required,
                                     const std::string& who, const std::string& where) {
  const c10::IValue v = d.contains(key) ? d.at(key) : c10::IValue();
  TORCH_CHECK(v.isTensor() || (!required && v.isNone()), who, ": the state", where,
              required && v.isNone() ? " has no \"" : " has a \"", key, "\"",
              v.isNone() ? "" : " that is not a tensor");
  return v.isTensor() ? v.toTensor() : at::Tensor();
}

PERF_INLINE c10::impl::GenericDict python_group(const SGDOptions& o) {
  auto g = python_dict();
  g.insert("lr", o.lr());
  g.insert("momentum", o.momentum());
  g.insert("dampening", o.dampening());
  g.insert("weight_decay", o.weight_decay());
  g.insert("nesterov", o.nesterov());
  g.insert("maximize", o.maximize());
  g.insert("foreach", c10::IValue());
  g.insert("differentiable", false);
  g.insert("fused", o.fused() ? c10::IValue(*o.fused()) : c10::IValue());
  return g;
}

PERF_INLINE void from_python_group(const c10::impl::GenericDict& g, SGDOptions& o, const std::string& who,
                                   const std::string& where) {
  TORCH_CHECK(!g.contains("betas"), who, ": the state is an Adam or AdamW optimizer's (it has betas)", where);
  o.lr(python_number(g, "lr", who, where));
  o.momentum(python_number(g, "momentum", who, where));
  o.dampening(python_number(g, "dampening", who, where));
  o.weight_decay(python_number(g, "weight_decay", who, where));
  o.nesterov(python_bool(g, "nesterov", false, who, where));
  o.maximize(python_bool(g, "maximize", false, who, where));
}

PERF_INLINE c10::impl::GenericDict python_state(const AdamParamState& s) {
  auto d = python_dict();
  // Python keeps the counter on the CPU unless its optimizer is fused or capturable (it moves it there itself);
  // a copy, since flat mode shares one counter among a run of parameters and Python would step it for each.
  d.insert("step", s.step().defined() ? s.step().detach().to(at::kCPU, at::kFloat, false, /*copy=*/true)
                                      : at::zeros({}, at::kFloat));
  d.insert("exp_avg", s.exp_avg());
  d.insert("exp_avg_sq", s.exp_avg_sq());
  if (s.max_exp_avg_sq().defined()) d.insert("max_exp_avg_sq", s.max_exp_avg_sq());
  return d;
}

PERF_INLINE void from_python_state(const c10::impl::GenericDict& d, AdamParamState& s, const std::string& who,
                                   const std::string& where) {
  TORCH_CHECK(d.contains("step"), who, ": the state", where, " has no \"step\" (not an Adam or AdamW state)");
  const c10::IValue step = d.at("step");  // a tensor since PyTorch 1.12, a number before
  TORCH_CHECK(step.isTensor() || step.isInt() || step.isDouble(), who, ": \"step\"", where, " is not a number");
  s.step(step.isTensor() ? step.toTensor().detach().reshape({}).to(at::kFloat)
                         : at::scalar_tensor(step.toScalar().toDouble(), at::kFloat));
  s.exp_avg(python_tensor(d, "exp_avg", true, who, where));
  s.exp_avg_sq(python_tensor(d, "exp_avg_sq", true, who, where));
  s.max_exp_avg_sq(python_tensor(d, "max_exp_avg_sq", false, who, where));
}

PERF_INLINE c10::impl::GenericDict python_state(const SGDParamState& s) {
  auto d = python_dict();
  d.insert("momentum_buffer", s.momentum_buffer().defined() ? c10::IValue(s.momentum_buffer()) : c10::IValue());
  return d;
}

PERF_INLINE void from_python_state(const c10::impl::GenericDict& d, SGDParamState& s, const std::string& who,
                                   const std::string& where) {
  TORCH_CHECK(!d.contains("exp_avg"), who, ": the state", where, " is an Adam or AdamW optimizer's");
  s.momentum_buffer(python_tensor(d, "momentum_buffer", false, who, where));
}

}  // namespace detail

// `step` is written as torch::optim::AdamParamState writes it (an integer; one
// host read per parameter at save time) and read in either form, so
// checkpoints move between perf::optim and torch::optim both ways.
PERF_INLINE void AdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  if (step().defined()) archive.write("step", c10::IValue(static_cast<int64_t>(step().item<double>())));
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
}

PERF_INLINE void AdamParamState::serialize(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("step", v)) {
    TORCH_CHECK(v.isInt() || v.isTensor() || v.isDouble(),
                "perf::optim::Adam: checkpoint entry \"step\" must be an integer or a tensor, got ", v.tagKind());
    step(v.isTensor() ? v.toTensor().detach().to(at::kFloat).reshape({})
                      : at::scalar_tensor(v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble(), at::kFloat));
  }
  detail::read_tensor_if_present(archive, "exp_avg", exp_avg_);
  detail::read_tensor_if_present(archive, "exp_avg_sq", exp_avg_sq_);
  detail::read_tensor_if_present(archive, "max_exp_avg_sq", max_exp_avg_sq_);
}

PERF_INLINE void SGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(fused);
}

PERF_INLINE void SGDOptions::serialize(torch::serialize::InputArchive& archive) {
  const char* who = "perf::optim::SGDOptions";
  lr(detail::read_option(archive, "lr", who).toDouble());
  momentum(detail::read_option(archive, "momentum", who).toDouble());
  dampening(detail::read_option(archive, "dampening", who).toDouble());
  weight_decay(detail::read_option(archive, "weight_decay", who).toDouble());
  nesterov(detail::read_option(archive, "nesterov", who).toBool());
  detail::read_bool_if_present(archive, "maximize", maximize_);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG_OPTIONAL(bool, fused);
}

PERF_INLINE void SGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
}

PERF_INLINE void SGDParamState::serialize(torch::serialize::InputArchive& archive) {
  detail::read_tensor_if_present(archive, "momentum_buffer", momentum_buffer_);
}

PERF_INLINE torch::Tensor FusedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  check_groups();
  at::NoGradGuard no_grad;
  update(std::nullopt, std::nullopt);
  return loss;
}

PERF_INLINE void FusedOptimizer::step_scaled(const std::optional<torch::Tensor>& grad_scale,
                                             const torch::Tensor& found_inf) {
  check_groups();
  at::NoGradGuard no_grad;
  update(grad_scale, found_inf);
}

PERF_INLINE void FusedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  // Checked as the constructors check their groups, before anything is added: a tensor already in a group is
  // refused, one listed twice in the new group kept once.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.reserve(param_groups_.size() + 1);
  for (const auto& g : param_groups_) groups.emplace_back(g.params());
  groups.push_back(param_group);
  torch::optim::Optimizer::add_param_group(detail::checked_params(groups, name_).back());
  if (param_group.has_options()) param_groups_.back().set_options(kept_options(param_group.options()));
  groups_kept_ = param_groups_.size();
}

PERF_INLINE void FusedOptimizer::keep_group_options(const std::vector<torch::optim::OptimizerParamGroup>& given) {
  // With a message: a bare condition passes nothing for the macro's `...`, which clang's -Wpedantic refuses in C++17.
  TORCH_INTERNAL_ASSERT(given.size() == param_groups_.size(), "perf::optim: ", given.size(),
                        " param groups given but the optimizer holds ", param_groups_.size());
  for (size_t g = 0; g < given.size(); ++g) {
    if (given[g].has_options()) param_groups_[g].set_options(kept_options(given[g].options()));
  }
  groups_kept_ = param_groups_.size();
}

PERF_INLINE std::vector<std::vector<size_t>> FusedOptimizer::match_saved_groups(
    const std::vector<std::vector<std::string>>& saved_keys) const {
  TORCH_CHECK(saved_keys.size() == param_groups_.size(), name_, ": the checkpoint has ", saved_keys.size(),
              " param group", saved_keys.size() == 1 ? "" : "s", " and the optimizer ", param_groups_.size(),
              "; build the optimizer with the param groups it was saved with (add_param_group), then load");
  std::vector<std::vector<size_t>> at(saved_keys.size());
  for (size_t g = 0; g < saved_keys.size(); ++g) {
    std::unordered_map<std::string, size_t> first;  // a key written twice is one parameter listed twice
    for (size_t i = 0; i < saved_keys[g].size(); ++i) {
      const auto& key = saved_keys[g][i];
      TORCH_CHECK(!key.empty() && key.size() < 20 && key.find_first_not_of("0123456789") == std::string::npos, name_,
                  ": param group ", g, " of the checkpoint has the parameter key \"", key,
                  "\", not a number: not a checkpoint torch::save of an optimizer wrote");
      if (first.emplace(key, i).second) at[g].push_back(i);
    }
    const size_t have = param_groups_[g].params().size();
    TORCH_CHECK(at[g].size() == have, name_, ": param group ", g, " of the checkpoint has ", at[g].size(),
                " parameters", at[g].size() == saved_keys[g].size() ? "" : " (some listed twice, counted once)",
                " and the optimizer's ", have,
                "; build the optimizer over the same parameters, in the same order, as the one saved; nothing was "
                "loaded");
  }
  return at;
}

PERF_INLINE void FusedOptimizer::check_loaded_state(torch::optim::OptimizerParamState& s, const at::Tensor& p, size_t g,
                                                    size_t i) const {
  for (const auto* t : state_tensors(s)) {
    TORCH_CHECK(t == nullptr || !t->defined() || t->sizes() == p.sizes(), name_,
                ": the checkpoint's state for parameter ", i, " of param group ", g, " has shape ", t->sizes(),
                " where the parameter has ", p.sizes(),
                ": a checkpoint of another model, or of its parameters in another order; nothing was loaded");
  }
}

PERF_INLINE void FusedOptimizer::fit_loaded_state(torch::optim::OptimizerParamState& s, const at::Tensor& p) const {
  for (auto* t : state_tensors(s)) {
    if (t != nullptr && t->defined()) *t = t->to(p.device(), p.scalar_type());
  }
  if (auto* step = state_step(s); step != nullptr && step->defined()) *step = step->to(p.device(), at::kFloat);
}

PERF_INLINE void FusedOptimizer::check_groups() const {
  // A group torch::optim::Optimizer::add_param_group added (through a torch::optim::Optimizer&): since LibTorch
  // 2.12 its options are a copy of the defaults, whatever it was given. Said once per such group.
  if (detail::torch_merges_group_options && param_groups_.size() > groups_kept_) {
    TORCH_WARN(name_, ": param group ", groups_kept_,
               param_groups_.size() - groups_kept_ > 1 ? " and later ones were" : " was",
               " added through torch::optim::Optimizer::add_param_group, which since LibTorch 2.12 gives a group of an "
               "optimizer that is not one of torch::optim's own a copy of the optimizer's defaults: options given "
               "with the group were dropped. Call add_param_group on the perf optimizer itself (",
               "perf::optim::FusedOptimizer&, not torch::optim::Optimizer&) to keep them.");
  }
  groups_kept_ = param_groups_.size();
  for (size_t g = 0; g < param_groups_.size(); ++g) check_options(param_groups_[g].options(), g);
}

namespace detail {

PERF_INLINE bool capturing_cuda_graph() {
#if PERF_WITH_CUDA
  if (!at::hasCUDA()) return false;
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}

}  // namespace detail

PERF_INLINE const torch::Tensor& FusedOptimizer::lr_tensor(size_t g, const c10::Device& device, double lr) {
  auto& slot = lr_tensors_[{g, device.str()}];
  if (!slot.value.defined()) {
    TORCH_CHECK(!detail::capturing_cuda_graph(),
                "perf::optim: the first step of an optimizer cannot be captured in a CUDA graph (its state and lr "
                "tensors must exist first); run one eager step (perf::TrainStep warms up for you)");
    slot.value = at::full({}, lr, at::device(device).dtype(at::kFloat));
    slot.host = lr;
  } else if (!perf::detail::same_value(slot.host, lr) && !detail::capturing_cuda_graph()) {
    slot.value.fill_(lr);  // outside capture only: a captured fill would freeze this value
    slot.host = lr;
  }
  return slot.value;
}

PERF_INLINE detail::SideStream* FusedOptimizer::side_stream(const detail::Bucket& b, int64_t per_call) {
  if (detail::flat_cuda_streams() < 2 || !flat_ || !b.flat || !b.device.is_cuda() || per_call <= 0) return nullptr;
  int64_t total = 0;
  for (const auto& p : b.params) total += p.numel();
  if (total <= per_call) return nullptr;  // one call
  auto it = flat_->sides.find(b.device.index());
  if (it == flat_->sides.end()) {
    // An eager step makes it (a step before capture is required anyway: lr_tensor). Under
    // capture without one, the calls stay on one stream: the same values, no overlap.
    if (detail::capturing_cuda_graph()) return nullptr;
    const auto stream = c10::impl::getDeviceGuardImpl(b.device.type())->getStreamFromGlobalPool(b.device);
    it = flat_->sides.try_emplace(b.device.index(), stream).first;
  }
  return &it->second;
}

PERF_INLINE std::vector<const void*> FusedOptimizer::state_addresses() {
  std::vector<const void*> out;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      const auto it = state_.find(p.unsafeGetTensorImpl());
      if (it == state_.end()) {
        out.push_back(nullptr);
        continue;
      }
      auto* step = state_step(*it->second);
      for (torch::Tensor* t : state_tensors(*it->second)) out.push_back(t && t->defined() ? t->data_ptr() : nullptr);
      out.push_back(step && step->defined() ? step->data_ptr() : nullptr);
    }
  }
  return out;
}

PERF_INLINE std::vector<StepConstant> FusedOptimizer::step_constants() const {
  check_groups();
  std::vector<StepConstant> out;
  for (size_t g = 0; g < param_groups_.size(); ++g) add_step_constants(param_groups_[g].options(), g, out);
  return out;
}

PERF_INLINE void FusedOptimizer::sync_lr() {
  at::NoGradGuard no_grad;
  for (auto& [key, slot] : lr_tensors_) {
    const double lr = param_groups_.at(key.first).options().get_lr();
    if (!perf::detail::same_value(slot.host, lr)) {
      slot.value.fill_(lr);
      slot.host = lr;
    }
  }
}

PERF_INLINE std::optional<torch::Tensor> FusedOptimizer::effective_found_inf(
    const std::optional<torch::Tensor>& found_inf, const c10::Device& device) {
  if (!skip_updates_) {
    if (!found_inf) return std::nullopt;
    // The fused kernels skip only when found_inf == 1 exactly; a sum over
    // several devices can be 2.
    return found_inf->clamp_max(1.0f);
  }
  auto& one = ones_[device.str()];
  if (!one.defined()) one = at::ones({}, at::device(device).dtype(at::kFloat));
  return one;
}

PERF_INLINE FusedOptimizer::FusedOptimizer(FusedOptimizer&&) noexcept = default;

PERF_INLINE FusedOptimizer::~FusedOptimizer() {
  if (flat_ && flat_->built) detail::flat_register(*flat_, false);
}

PERF_INLINE void FusedOptimizer::init_flat(bool flat, const char* name) {
  name_ = name;
  check_groups();
  for (size_t g = 0; g < param_groups_.size(); ++g) check_group_flat(g, flat);
  if (!flat) return;
  flat_ = std::make_unique<detail::FlatStore>();
  flatten();
}

PERF_INLINE void FusedOptimizer::check_group_flat(size_t g, bool flat) const {
  const auto f = flat_option(param_groups_[g].options());
  TORCH_CHECK(!f || *f == flat, name_, ": param group ", g, " has flat(", *f ? "true" : "false",
              ") but the optimizer's defaults have flat(", flat ? "true" : "false",
              "); flat is one setting for the whole optimizer: set it on the defaults and leave the groups' unset");
}

PERF_INLINE void FusedOptimizer::invalidate_flat() noexcept {
  if (flat_) flat_->built = false;
}

PERF_INLINE void FusedOptimizer::ensure_flat() {
  if (flat_ && flat_stale()) flatten();
}

// Cheap per-step check (pointer compares): same groups and parameters, each
// parameter still backed by its slot, state still the views handed out.
PERF_INLINE bool FusedOptimizer::flat_stale() const {
  const auto& f = *flat_;
  if (!f.built || f.group_begin.size() != param_groups_.size() + 1) return true;
  size_t i = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    if (f.group_begin[g + 1] - f.group_begin[g] != params.size()) return true;
    for (const auto& p : params) {
      const auto& s = f.slots[i++];
      const auto& k = f.keys[s.key];
      if (p.unsafeGetTensorImpl() != s.param.unsafeGetTensorImpl() || !detail::same_storage(p, k.params) ||
          p.storage_offset() != k.base + s.offset || p.strides() != at::IntArrayRef(s.strides) ||
          p.sizes() != at::IntArrayRef(s.sizes))
        return true;
      auto it = state_.find(p.unsafeGetTensorImpl());
      auto* owner = it == state_.end() ? nullptr : it->second.get();
      if (owner != s.owner) return true;
      if (owner) {
        auto ts = state_tensors(*owner);
        for (size_t j = 0; j < 3; ++j) {
          if (ts[j] && ts[j]->defined() && ts[j]->unsafeGetTensorImpl() != s.state[j].unsafeGetTensorImpl())
            return true;
        }
      }
    }
  }
  return false;
}

// (Re)builds the buffers from the parameters', gradients' and state's current
// values; the previous buffers (if any) are released once copied from.
PERF_INLINE void FusedOptimizer::flatten() {
  const char* name = name_;
  TORCH_CHECK(!detail::capturing_cuda_graph(), name,
              ": flat(true) must (re)build its buffers (first use, add_param_group, torch::load, or a parameter "
              "moved by model->to or perf::to_channels_last), which cannot happen while a CUDA graph is being "
              "captured; run one step eagerly first");
  at::NoGradGuard no_grad;
  // Checks and allocations first: a failure leaves everything as it was.
  const detail::FlatStore* old = flat_.get();
  auto f = std::make_unique<detail::FlatStore>();
  // Layout: per (device, dtype), groups in order, parameters in order; parameters that share a storage without
  // gaps stay where they are (detail::in_place_storages), one key per such storage.
  std::unordered_set<const void*> own;  // this optimizer's previous buffers: always rebuilt
  if (old) {
    for (const auto& k : old->keys)
      if (!k.in_place && k.params.defined()) own.insert(k.params.storage().unsafeGetStorageImpl());
  }
  const auto in_place = detail::in_place_storages(param_groups_, own, name);
  std::unordered_map<const void*, size_t> in_place_key;  // storage -> key
  std::unordered_map<const void*, std::pair<size_t, size_t>> seen_params;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    check_group_flat(g, true);  // a group added since construction
    f->group_begin.push_back(f->slots.size());
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      TORCH_CHECK(p.layout() == at::kStrided, name, ": flat(true): parameter ", i, " of group ", g,
                  " is not a dense (strided) tensor");
      auto [it, fresh] = seen_params.emplace(p.unsafeGetTensorImpl(), std::make_pair(g, i));
      TORCH_CHECK(fresh, name, ": flat(true): parameter ", i, " of group ", g, " is the same tensor as parameter ",
                  it->second.second, " of group ", it->second.first, "; pass each parameter once");
      detail::FlatSlot s;
      s.param = p;
      s.group = g;
      s.sizes = p.sizes().vec();
      const auto shared = in_place.find(p.storage().unsafeGetStorageImpl());
      if (p.numel() > 0 && shared != in_place.end()) {
        auto [kit, added] = in_place_key.emplace(shared->first, f->keys.size());
        if (added) {
          f->keys.push_back(detail::FlatKey{
              p.device(), p.scalar_type(), shared->second.numel, 0, {}, {}, {}, true, shared->second.base});
          f->keys.back().params = detail::plain_view(p, shared->second.base, {shared->second.numel}, {1});
        }
        s.key = kit->second;
        auto& k = f->keys[s.key];
        s.pos = k.slots++;  // renumbered in memory order below
        s.offset = p.storage_offset() - k.base;
        s.strides = p.strides().vec();
        f->slots.push_back(std::move(s));
        continue;
      }
      size_t key = 0;
      while (key < f->keys.size() &&
             (f->keys[key].in_place || f->keys[key].device != p.device() || f->keys[key].dtype != p.scalar_type()))
        ++key;
      if (key == f->keys.size())
        f->keys.push_back(detail::FlatKey{p.device(), p.scalar_type(), 0, 0, {}, {}, {}, false, 0});
      auto& k = f->keys[key];
      s.key = key;
      s.pos = k.slots++;
      s.offset = detail::flat_align(k.numel, k.dtype);
      s.strides = p.is_non_overlapping_and_dense() ? p.strides().vec()
                                                   : at::IntArrayRef(c10::contiguous_strides(p.sizes())).vec();
      k.numel = s.offset + p.numel();
      f->slots.push_back(std::move(s));
    }
  }
  // In a shared storage, adjacent slots are the ones adjacent in memory.
  for (size_t key = 0; key < f->keys.size(); ++key) {
    if (!f->keys[key].in_place) continue;
    std::vector<detail::FlatSlot*> order;
    for (auto& s : f->slots)
      if (s.key == key) order.push_back(&s);
    std::sort(order.begin(), order.end(),
              [](const detail::FlatSlot* a, const detail::FlatSlot* b) { return a->offset < b->offset; });
    for (size_t n = 0; n < order.size(); ++n) order[n]->pos = n;
  }
  f->group_begin.push_back(f->slots.size());
  std::vector<std::array<bool, 3>> needs(f->keys.size(), {false, false, false});  // state buffers in use
  for (auto& s : f->slots) {
    auto it = state_.find(s.param.unsafeGetTensorImpl());
    if (it == state_.end()) continue;
    auto ts = state_tensors(*it->second);
    for (size_t j = 0; j < 3; ++j) needs[s.key][j] = needs[s.key][j] || (ts[j] && ts[j]->defined());
  }
  for (size_t key = 0; key < f->keys.size(); ++key) {
    auto& k = f->keys[key];
    const auto opts = at::TensorOptions().device(k.device).dtype(k.dtype);
    if (!k.in_place) k.params = at::zeros({k.numel}, opts);
    k.grads = at::zeros({k.numel}, opts);
    for (size_t j = 0; j < 3; ++j) {
      if (needs[key][j]) k.state[j] = at::zeros({k.numel}, opts);
    }
  }
  // Values: parameters, gradients (unless another buffer owns them), state.
  std::vector<at::Tensor> steps;  // a counter per slot with state, for merging
  std::vector<size_t> step_slots;
  for (auto& s : f->slots) {
    auto& k = f->keys[s.key];
    auto& p = s.param;
    if (!k.in_place) {
      auto pv = detail::slot_view(k.params, s);
      pv.copy_(p);
      p.set_data(pv);
    }
    s.grad = detail::slot_view(k.grads, s);
    auto& grad = p.mutable_grad();
    const bool ours_before =
        grad.defined() && old && std::any_of(old->keys.begin(), old->keys.end(), [&](const detail::FlatKey& ok) {
          return detail::same_storage(grad, ok.grads);
        });
    if (!grad.defined()) {
      grad = s.grad;
    } else if (ours_before || detail::owns_storage(grad)) {  // a sparse gradient is neither: refused at step()
      s.grad.copy_(grad);
      grad = s.grad;
    }
    auto it = state_.find(p.unsafeGetTensorImpl());
    if (it == state_.end()) continue;
    s.owner = it->second.get();
    auto ts = state_tensors(*s.owner);
    for (size_t j = 0; j < 3; ++j) {
      if (!ts[j] || !ts[j]->defined()) continue;
      s.state[j] = detail::slot_view(k.state[j], s);
      s.state[j].copy_(*ts[j]);
      *ts[j] = s.state[j];
    }
    if (auto* step = state_step(*s.owner); step && step->defined()) {
      steps.push_back(step->detach().to(at::kCPU, at::kFloat).reshape({}));  // devices may differ
      step_slots.push_back(static_cast<size_t>(&s - f->slots.data()));
    }
  }
  // Step counters: one tensor per (group, key, value), so that runs stay long.
  if (!steps.empty()) {
    const auto values = at::stack(steps).to(at::kDouble);  // host values, read at rebuild only
    const auto* v = values.const_data_ptr<double>();
    std::map<std::tuple<size_t, size_t, double>, at::Tensor> shared;
    for (size_t n = 0; n < step_slots.size(); ++n) {
      auto& s = f->slots[step_slots[n]];
      auto& t = shared[{s.group, s.key, v[n]}];
      if (!t.defined()) t = at::full({}, v[n], at::TensorOptions().device(s.param.device()).dtype(at::kFloat));
      *state_step(*s.owner) = t;
    }
  }
  if (old && old->built) detail::flat_register(*old, false);
  f->built = true;
  detail::flat_register(*f, true);
  flat_ = std::move(f);
}

PERF_INLINE std::vector<detail::Bucket> FusedOptimizer::flat_buckets(size_t g, std::array<bool, 3> kinds,
                                                                     bool split_first) {
  auto& f = *flat_;
  const bool any_state = kinds[0] || kinds[1] || kinds[2];
  struct Part {
    size_t slot;
    bool ours, first;
    const void* step;
  };
  std::vector<Part> parts;
  std::map<size_t, at::Tensor> newcomer_steps;  // key -> counter of parameters stepped for the first time
  for (size_t i = f.group_begin[g]; i < f.group_begin[g + 1]; ++i) {
    auto& s = f.slots[i];
    auto& p = s.param;
    if (!p.requires_grad() || !p.grad().defined()) continue;  // frozen, or no gradient
    detail::check_grad(p, g, name_);
    auto& grad = p.mutable_grad();
    bool ours = grad.unsafeGetTensorImpl() == s.grad.unsafeGetTensorImpl();
    if (!ours && detail::owns_storage(grad)) {  // a fresh gradient: back into the buffer
      s.grad.copy_(grad);
      grad = s.grad;
      ours = true;
    }
    bool first = false;
    const void* step = nullptr;
    if (any_state) {
      auto& slot = state_[p.unsafeGetTensorImpl()];
      const bool created = !slot;
      if (created) slot = make_state();
      s.owner = slot.get();
      auto ts = state_tensors(*slot);
      auto& k = f.keys[s.key];
      for (size_t j = 0; j < 3; ++j) {
        if (!kinds[j] || ts[j]->defined()) continue;
        if (!k.state[j].defined()) k.state[j] = at::zeros({k.numel}, k.params.options());
        if (!s.state[j].defined()) s.state[j] = detail::slot_view(k.state[j], s);
        s.state[j].zero_();  // a parameter's first step: no history
        *ts[j] = s.state[j];
        if (j == 0) first = split_first;
      }
      if (auto* st = state_step(*slot)) {
        if (created || !st->defined()) {
          auto& t = newcomer_steps[s.key];
          if (!t.defined()) t = at::zeros({}, at::TensorOptions().device(p.device()).dtype(at::kFloat));
          *st = t;
        }
        step = st->unsafeGetTensorImpl();
      }
    }
    parts.push_back({i, ours, first, step});
  }
  // A counter shared with parameters not stepped now (frozen, no gradient)
  // forks: they keep a copy, so each counts only its own steps.
  if (!parts.empty() && parts.front().step) {
    std::unordered_map<const void*, size_t> stepping;
    for (const auto& pt : parts) ++stepping[pt.step];
    std::unordered_map<const void*, at::Tensor> forks;
    size_t pi = 0;
    for (size_t i = f.group_begin[g]; i < f.group_begin[g + 1]; ++i) {
      if (pi < parts.size() && parts[pi].slot == i) {
        ++pi;
        continue;
      }
      auto& s = f.slots[i];
      if (!s.owner) continue;
      auto* st = state_step(*s.owner);
      if (!st || !st->defined() || !stepping.count(st->unsafeGetTensorImpl())) continue;
      auto& fork = forks[st->unsafeGetTensorImpl()];
      if (!fork.defined()) fork = st->clone();
      *st = fork;
    }
  }
  // Runs: adjacent slots of one key with the same counter (and first flag), in memory order (a group's
  // parameters may alternate between keys: dtypes, or a storage left in place).
  std::stable_sort(parts.begin(), parts.end(), [&](const Part& a, const Part& b) {
    const auto& sa = f.slots[a.slot];
    const auto& sb = f.slots[b.slot];
    return std::make_pair(sa.key, sa.pos) < std::make_pair(sb.key, sb.pos);
  });
  std::vector<detail::Bucket> buckets;
  size_t run_begin = 0, run_end = 0;  // indices into parts, [begin, end)
  auto flush = [&] {
    if (run_begin == run_end) return;
    const auto& s0 = f.slots[parts[run_begin].slot];
    const auto& s1 = f.slots[parts[run_end - 1].slot];
    auto& k = f.keys[s0.key];
    auto& b = detail::bucket_for(buckets, k.device, k.dtype, parts[run_begin].first);
    b.flat = true;
    b.parameters += static_cast<int64_t>(run_end - run_begin);
    if (k.in_place) b.in_place += static_cast<int64_t>(run_end - run_begin);
    const bool single = run_end - run_begin == 1;
    const int64_t begin = s0.offset, len = s1.offset + s1.param.numel() - s0.offset;
    auto range = [&](const at::Tensor& buffer, const at::Tensor& view) {
      return single ? view : buffer.narrow(0, begin, len);
    };
    b.params.push_back(range(k.params, s0.param));
    b.grads.push_back(parts[run_begin].ours ? range(k.grads, s0.grad) : s0.param.grad());
    if (kinds[0]) b.a.push_back(range(k.state[0], s0.state[0]));
    if (kinds[1]) b.b.push_back(range(k.state[1], s0.state[1]));
    if (kinds[2]) b.c.push_back(range(k.state[2], s0.state[2]));
    if (parts[run_begin].step) {
      const auto& step = *state_step(*s0.owner);
      b.steps.push_back(step);
      if (std::none_of(b.unique_steps.begin(), b.unique_steps.end(),
                       [&](const at::Tensor& t) { return t.is_same(step); }))
        b.unique_steps.push_back(step);
    }
    run_begin = run_end;
  };
  for (size_t n = 0; n < parts.size(); ++n) {
    if (n > run_begin) {
      const auto& prev = parts[n - 1];
      const auto& cur = parts[n];
      const auto& ps = f.slots[prev.slot];
      const auto& cs = f.slots[cur.slot];
      const bool extend = prev.ours && cur.ours && cs.key == ps.key && cs.pos == ps.pos + 1 && cur.step == prev.step &&
                          cur.first == prev.first;
      if (!extend) flush();
    }
    run_end = n + 1;
  }
  flush();
  return buckets;
}

PERF_INLINE void FusedOptimizer::zero_grad(bool set_to_none) {
  if (!flat_) return perf::optim::zero_grad(*this, set_to_none);
  check_groups();  // before a rebuild reads a group added since
  ensure_flat();
  at::NoGradGuard no_grad;
  for (auto& k : flat_->keys) k.grads.zero_();
  for (auto& s : flat_->slots) {
    auto& grad = s.param.mutable_grad();
    if (grad.unsafeGetTensorImpl() == s.grad.unsafeGetTensorImpl()) continue;
    if (!grad.defined() || detail::owns_storage(grad)) {
      grad = s.grad;  // back into the buffer
      continue;
    }
    detail::clear_grad(grad, set_to_none);  // someone else's view (DDP's bucket): as without flat
  }
}

PERF_INLINE void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) detail::clear_grad(p.mutable_grad(), set_to_none);
  }
}

namespace detail {

PERF_INLINE void check_sgd_options(const SGDOptions& o, const std::string& where) {
  const char* name = "perf::optim::SGD";
  TORCH_CHECK(o.lr() >= 0, name, ": invalid lr ", o.lr(), where, " (must be >= 0)");
  TORCH_CHECK(o.momentum() >= 0, name, ": invalid momentum ", o.momentum(), where, " (must be >= 0)");
  TORCH_CHECK(o.weight_decay() >= 0, name, ": invalid weight_decay ", o.weight_decay(), where, " (must be >= 0)");
  TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && perf::detail::same_value(o.dampening(), 0.0)), name,
              ": nesterov requires momentum > 0 and dampening == 0", where, " (got momentum ", o.momentum(),
              ", dampening ", o.dampening(), ")");
}

}  // namespace detail

PERF_INLINE SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults)
    : SerializableFusedOptimizer<SGDParamState, SGDOptions>(
          [&] {
            detail::check_sgd_options(defaults, "");
            return detail::checked_params(param_groups, "perf::optim::SGD");
          }(),
          std::make_unique<SGDOptions>(defaults)) {
  keep_group_options(param_groups);
  init_flat(defaults.flat().value_or(false), "perf::optim::SGD");  // checks every group's options first
}

PERF_INLINE std::unique_ptr<torch::optim::OptimizerOptions> SGD::kept_options(
    const torch::optim::OptimizerOptions& given) const {
  const auto* o = dynamic_cast<const SGDOptions*>(&given);
  // Of another type (check_options names it), or LibTorch 2.11: the group's options as given.
  if (o == nullptr || !detail::torch_merges_group_options) return given.clone();
  const SGDOptions unset(1e-3);  // SGDOptions has no default lr: LibTorch compares with 1e-3
  SGDOptions kept = static_cast<const SGDOptions&>(defaults());
  if (!perf::detail::same_value(o->lr(), unset.lr())) kept.lr(o->lr());
  if (!perf::detail::same_value(o->momentum(), unset.momentum())) kept.momentum(o->momentum());
  if (!perf::detail::same_value(o->dampening(), unset.dampening())) kept.dampening(o->dampening());
  if (!perf::detail::same_value(o->weight_decay(), unset.weight_decay())) kept.weight_decay(o->weight_decay());
  if (o->nesterov() != unset.nesterov()) kept.nesterov(o->nesterov());
  if (o->maximize() != unset.maximize()) kept.maximize(o->maximize());
  if (o->fused()) kept.fused(o->fused());
  if (o->flat()) kept.flat(o->flat());
  return std::make_unique<SGDOptions>(kept);
}

PERF_INLINE void SGD::check_options(const torch::optim::OptimizerOptions& o, size_t g) const {
  detail::check_sgd_options(detail::group_options<SGDOptions>(o, g, "perf::optim::SGD", "perf::optim::SGDOptions"),
                            " in param group " + std::to_string(g));
}

PERF_INLINE void SGD::update(const std::optional<torch::Tensor>& grad_scale,
                             const std::optional<torch::Tensor>& found_inf) {
  const char* name = "perf::optim::SGD";
  kernels_.clear();
  ensure_flat();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& group = param_groups_[g];
    const auto& o = static_cast<const SGDOptions&>(group.options());  // checked by step()
    const bool momentum = !perf::detail::same_value(o.momentum(), 0.0);
    std::vector<detail::Bucket> buckets;
    if (flat()) {
      buckets = flat_buckets(g, {momentum, false, false}, /*split_first=*/true);
    } else {
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        detail::check_grad(p, g, name);
        SGDParamState* s = nullptr;
        if (momentum) {
          auto& slot = state_[p.unsafeGetTensorImpl()];
          if (!slot) slot = std::make_unique<SGDParamState>();
          s = static_cast<SGDParamState*>(slot.get());
          detail::to_param_device(s->momentum_buffer(), p);
        }
        const bool first = momentum && !s->momentum_buffer().defined();
        auto& b = detail::bucket_for(buckets, p, first);
        b.params.push_back(p);
        b.grads.push_back(p.grad());
        if (momentum) {
          // Zeros, not empty: a first step skipped on inf (found_inf) returns before
          // the kernel writes the buffer, and must leave it as if never called.
          if (first) s->momentum_buffer(at::zeros_like(p.grad()));
          b.a.push_back(s->momentum_buffer());
        }
      }
    }
    for (auto& b : buckets) {
      const bool fused = detail::use_fused(o.fused(), b, name);
      kernels_.push_back(detail::kernel_line(b, fused));
      const auto gs = detail::on_device(grad_scale, b.device);
      const auto fi = effective_found_inf(detail::on_device(found_inf, b.device), b.device);
      if (fused) {
        if (b.device.is_cuda()) {
          const auto& lr = lr_tensor(g, b.device, o.lr());
          const int64_t per_call = detail::elements_per_call(b);
          detail::StreamAlternation streams(side_stream(b, per_call), b.device);
          const size_t calls = detail::for_each_slice(b, per_call, [&](const detail::Bucket& s) {
            streams.run([&] {
              at::_fused_sgd_(s.params, s.grads, s.a, o.weight_decay(), o.momentum(), lr, o.dampening(), o.nesterov(),
                              o.maximize(), s.first, gs, fi);
            });
          });
          streams.join();
          kernels_.back() += streams.note(calls);
        } else {
          at::_fused_sgd_(b.params, b.grads, b.a, o.weight_decay(), o.momentum(), o.lr(), o.dampening(), o.nesterov(),
                          o.maximize(), b.first, gs, fi);
        }
        continue;
      }
      // _foreach_ path: Python's multi-tensor SGD.
      if (skip_updates_ || !detail::foreach_prepare_scaled(b.grads, gs, fi)) continue;
      auto grads = o.maximize() ? at::_foreach_neg(b.grads) : b.grads;
      if (!perf::detail::same_value(o.weight_decay(), 0.0)) grads = at::_foreach_add(grads, b.params, o.weight_decay());
      if (momentum) {
        if (b.first) {
          for (size_t i = 0; i < b.a.size(); ++i) b.a[i].copy_(grads[i]);
        } else {
          at::_foreach_mul_(b.a, o.momentum());
          at::_foreach_add_(b.a, grads, 1 - o.dampening());
        }
        grads = o.nesterov() ? at::_foreach_add(grads, b.a, o.momentum()) : b.a;
      }
      at::_foreach_add_(b.params, grads, -o.lr());
    }
  }
}

}  // namespace perf::optim

namespace perf {

PERF_INLINE torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm,
                                          double norm_type, bool error_if_nonfinite) {
  TORCH_CHECK(max_norm >= 0, "perf::clip_grad_norm_: max_norm must be >= 0, got ", max_norm);
  TORCH_CHECK(norm_type > 0, "perf::clip_grad_norm_: norm_type must be > 0 (or infinity), got ", norm_type);
  TORCH_CHECK(!error_if_nonfinite || !optim::detail::capturing_cuda_graph(),
              "perf::clip_grad_norm_: error_if_nonfinite=true reads the norm on the host, which a CUDA graph capture "
              "cannot do; capture with error_if_nonfinite=false (perf::GradScaler skips a step with non-finite "
              "gradients on the GPU)");
  at::NoGradGuard no_grad;
  std::map<std::pair<std::string, c10::ScalarType>, std::vector<at::Tensor>> groups;
  std::optional<c10::Device> first;
  // A tensor listed twice (LibTorch's parameters() of a model with a tensor registered under two names) counts once
  // in the norm and is scaled once, as Python's module.parameters() lists it once.
  std::unordered_set<const void*> seen;
  for (const auto& p : parameters) {
    if (!p.defined() || !p.grad().defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const auto& g = p.grad();
    TORCH_CHECK(!g.is_sparse(), "perf::clip_grad_norm_: sparse gradients are not supported");
    if (!first) first = g.device();
    groups[{g.device().str(), g.scalar_type()}].push_back(g);
  }
  if (!first) return at::zeros({}, at::kFloat);
  const bool inf = std::isinf(norm_type);
  for (auto& [key, grads] : groups) grads = optim::detail::coalesce_flat(grads);  // flat: one tensor
  // Norms in fp32 at least (half and bf16 gradients too), float64 gradients in
  // float64: _foreach_norm refuses to narrow, and Python keeps them double.
  // Mixed groups promote in stack(), as Python's do.
  auto norm_dtype = [](c10::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; };
  std::vector<at::Tensor> norms;
  for (auto& [key, grads] : groups) {
    for (auto& n : at::_foreach_norm(grads, norm_type, norm_dtype(key.second)))
      norms.push_back(n.to(*first, /*non_blocking=*/true));
  }
  const auto stacked = at::stack(norms);
  auto total = inf ? stacked.max() : at::linalg_vector_norm(stacked, norm_type);
  // LibTorch's message, checked before any gradient is scaled.
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(total.item<double>()),
              "perf::clip_grad_norm_: The total norm of order ", norm_type,
              " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable this error and "
              "scale the gradients with the non-finite norm anyway, set `error_if_nonfinite=false`");
  const auto coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
  for (auto& [key, grads] : groups) {
    const auto c = coef.to(grads.front().device(), norm_dtype(key.second), /*non_blocking=*/true);
    at::_foreach_mul_(grads, c);
  }
  return total;
}

}  // namespace perf
