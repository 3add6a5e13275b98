// perf/impl/muon-inl.h — the out-of-line definitions of perf/muon.h.
// Included by perf/muon.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
//
// Each operation is Python's (torch/optim/_muon.py in 2.11); the foreach path runs the same operations on
// stacks of equal-shape matrices (Newton-Schulz) and, on a GPU, on lists (momentum, weight decay, update).
#pragma once

#include <c10/util/Exception.h>
#include <perf/impl/optim-inl.h>
#include <perf/muon.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace perf::optim {

namespace detail {

PERF_INLINE void check_muon_options(const MuonOptions& o, const std::string& where) {
  const char* name = "perf::optim::Muon";
  TORCH_CHECK(o.lr() >= 0, name, ": invalid lr ", o.lr(), where, " (must be >= 0)");
  TORCH_CHECK(o.momentum() >= 0, name, ": invalid momentum ", o.momentum(), where, " (must be >= 0)");
  TORCH_CHECK(o.weight_decay() >= 0, name, ": invalid weight_decay ", o.weight_decay(), where, " (must be >= 0)");
  TORCH_CHECK(o.eps() >= 0, name, ": invalid eps ", o.eps(), where, " (must be >= 0)");
  TORCH_CHECK(o.ns_steps() >= 0 && o.ns_steps() < 100, name, ": invalid ns_steps ", o.ns_steps(), where,
              " (must be in [0, 100), Python's bound)");
  const auto& fn = o.adjust_lr_fn();
  TORCH_CHECK(!fn || *fn == "original" || *fn == "match_rms_adamw", name, ": invalid adjust_lr_fn \"", fn.value_or(""),
              "\"", where, " (valid: \"original\", \"match_rms_adamw\", or unset for \"original\")");
}

PERF_INLINE void check_muon_matrix(const at::Tensor& p, size_t g, size_t i) {
  TORCH_CHECK(!p.defined() || p.dim() == 2, "perf::optim::Muon: parameter ", i, " of group ", g, " has shape ",
              p.sizes(),
              ": Muon updates 2-D parameters only, as Python's; give biases, norms, embeddings and the output "
              "layer's weight to another optimizer (perf::optim::AdamW)");
}

PERF_INLINE at::Tensor zeropower_via_newtonschulz(const at::Tensor& update, const MuonOptions& o) {
  const auto [a, b, c] = o.ns_coefficients();
  const bool batch = update.dim() == 3;
  at::Tensor x = update.to(at::kBFloat16, /*non_blocking=*/false, /*copy=*/true);
  const bool tall = update.size(-2) > update.size(-1);
  if (tall) x = x.mT();
  // Python's x.norm() is linalg.vector_norm(x, 2) over every element; per matrix here for a batch.
  const at::Tensor norm =
      batch ? at::linalg_vector_norm(x, 2, at::IntArrayRef{-2, -1}, /*keepdim=*/true) : at::linalg_vector_norm(x, 2);
  x.div_(at::clamp(norm, at::Scalar(o.eps())));
  for (int64_t k = 0; k < o.ns_steps(); ++k) {
    const at::Tensor gram = batch ? at::bmm(x, x.mT()) : at::mm(x, x.mT());
    const at::Tensor gram_update = batch ? at::baddbmm(gram, gram, gram, b, c) : at::addmm(gram, gram, gram, b, c);
    x = batch ? at::baddbmm(x, gram_update, x, a) : at::addmm(x, gram_update, x, a);
  }
  return tall ? x.mT() : x;
}

PERF_INLINE double muon_lr_ratio(const MuonOptions& o, int64_t rows, int64_t cols) {
  const auto a = static_cast<double>(rows), b = static_cast<double>(cols);
  const auto& fn = o.adjust_lr_fn();
  if (!fn || *fn == "original") return std::sqrt(std::max(1.0, a / b));
  return 0.2 * std::sqrt(std::max(a, b));  // "match_rms_adamw" (checked)
}

PERF_INLINE c10::impl::GenericDict python_group(const MuonOptions& o) {
  const auto [a, b, c] = o.ns_coefficients();
  auto g = python_dict();
  g.insert("lr", o.lr());
  g.insert("weight_decay", o.weight_decay());
  g.insert("momentum", o.momentum());
  g.insert("nesterov", o.nesterov());
  g.insert("ns_coefficients", c10::ivalue::Tuple::create(std::vector<c10::IValue>{a, b, c}));
  g.insert("eps", o.eps());
  g.insert("ns_steps", o.ns_steps());
  g.insert("adjust_lr_fn", o.adjust_lr_fn() ? c10::IValue(*o.adjust_lr_fn()) : c10::IValue());
  return g;
}

PERF_INLINE void from_python_group(const c10::impl::GenericDict& g, MuonOptions& o, const std::string& who,
                                   const std::string& where) {
  TORCH_CHECK(g.contains("ns_steps"), who, ": the state is not a Muon optimizer's",
              g.contains("betas")       ? " (it has betas: Adam or AdamW)"
              : g.contains("dampening") ? " (it has dampening: SGD)"
                                        : " (it has no ns_steps)",
              where);
  o.lr(python_number(g, "lr", who, where));
  o.weight_decay(python_number(g, "weight_decay", who, where));
  o.momentum(python_number(g, "momentum", who, where));
  o.nesterov(python_bool(g, "nesterov", std::nullopt, who, where));
  const c10::IValue abc = g.contains("ns_coefficients") ? g.at("ns_coefficients") : c10::IValue();
  const auto elements = abc.isTuple()  ? abc.toTupleRef().elements().vec()
                        : abc.isList() ? abc.toListRef().vec()
                                       : std::vector<c10::IValue>();
  TORCH_CHECK(elements.size() == 3 && std::all_of(elements.begin(), elements.end(),
                                                  [](const c10::IValue& v) { return v.isDouble() || v.isInt(); }),
              who, ": \"ns_coefficients\"", where, " is not three numbers");
  o.ns_coefficients(
      {elements[0].toScalar().toDouble(), elements[1].toScalar().toDouble(), elements[2].toScalar().toDouble()});
  o.eps(python_number(g, "eps", who, where));
  const c10::IValue steps = g.at("ns_steps");
  TORCH_CHECK(steps.isInt(), who, ": \"ns_steps\"", where, " is a ", steps.tagKind(), ", not an integer");
  o.ns_steps(steps.toInt());
  const c10::IValue fn = g.contains("adjust_lr_fn") ? g.at("adjust_lr_fn") : c10::IValue();
  TORCH_CHECK(fn.isNone() || fn.isString(), who, ": \"adjust_lr_fn\"", where, " is a ", fn.tagKind(),
              ", not None or a string");
  o.adjust_lr_fn(fn.isString() ? std::optional<std::string>(fn.toStringRef()) : std::nullopt);
}

}  // namespace detail

PERF_INLINE void MuonOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_coefficients);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_steps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adjust_lr_fn);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(foreach);
}

PERF_INLINE void MuonOptions::serialize(torch::serialize::InputArchive& archive) {
  const char* who = "perf::optim::MuonOptions";
  lr(detail::read_option(archive, "lr", who).toDouble());
  weight_decay(detail::read_option(archive, "weight_decay", who).toDouble());
  momentum(detail::read_option(archive, "momentum", who).toDouble());
  nesterov(detail::read_option(archive, "nesterov", who).toBool());
  ns_coefficients(detail::read_option(archive, "ns_coefficients", who).to<ns_coefficients_t>());
  eps(detail::read_option(archive, "eps", who).toDouble());
  ns_steps(detail::read_option(archive, "ns_steps", who).toInt());
  adjust_lr_fn(detail::read_option(archive, "adjust_lr_fn", who).toOptional<std::string>());
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG_OPTIONAL(bool, foreach);
}

PERF_INLINE Muon::Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, MuonOptions defaults)
    : SerializableFusedOptimizer<MuonParamState, MuonOptions>(
          [&] {
            detail::check_muon_options(defaults, "");
            auto groups = detail::checked_params(param_groups, "perf::optim::Muon");
            for (size_t g = 0; g < groups.size(); ++g)
              for (size_t i = 0; i < groups[g].params().size(); ++i)
                detail::check_muon_matrix(groups[g].params()[i], g, i);
            return groups;
          }(),
          std::make_unique<MuonOptions>(defaults)) {
  keep_group_options(param_groups);
  init_flat(false, "perf::optim::Muon");  // checks every group's options
}

PERF_INLINE void Muon::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  for (size_t i = 0; i < param_group.params().size(); ++i)
    detail::check_muon_matrix(param_group.params()[i], param_groups_.size(), i);
  FusedOptimizer::add_param_group(param_group);
}

PERF_INLINE std::unique_ptr<torch::optim::OptimizerOptions> Muon::kept_options(
    const torch::optim::OptimizerOptions& given) const {
  const auto* o = dynamic_cast<const MuonOptions*>(&given);
  // Of another type (check_options names it), or LibTorch 2.11: the group's options as given.
  if (o == nullptr || !detail::torch_merges_group_options) return given.clone();
  const MuonOptions unset;
  MuonOptions kept = static_cast<const MuonOptions&>(defaults());
  if (!perf::detail::same_value(o->lr(), unset.lr())) kept.lr(o->lr());
  if (!perf::detail::same_value(o->weight_decay(), unset.weight_decay())) kept.weight_decay(o->weight_decay());
  if (!perf::detail::same_value(o->momentum(), unset.momentum())) kept.momentum(o->momentum());
  if (o->nesterov() != unset.nesterov()) kept.nesterov(o->nesterov());
  if (o->ns_coefficients() != unset.ns_coefficients()) kept.ns_coefficients(o->ns_coefficients());
  if (!perf::detail::same_value(o->eps(), unset.eps())) kept.eps(o->eps());
  if (o->ns_steps() != unset.ns_steps()) kept.ns_steps(o->ns_steps());
  if (o->adjust_lr_fn()) kept.adjust_lr_fn(o->adjust_lr_fn());
  if (o->foreach()) kept.foreach(o->foreach());
  return std::make_unique<MuonOptions>(kept);
}

PERF_INLINE void Muon::check_options(const torch::optim::OptimizerOptions& o, size_t g) const {
  detail::check_muon_options(detail::group_options<MuonOptions>(o, g, "perf::optim::Muon", "perf::optim::MuonOptions"),
                             " in param group " + std::to_string(g));
}

PERF_INLINE void Muon::add_step_constants(const torch::optim::OptimizerOptions& options, size_t g,
                                          std::vector<StepConstant>& out) const {
  const auto& o = static_cast<const MuonOptions&>(options);
  const auto [a, b, c] = o.ns_coefficients();
  out.insert(out.end(), {{g, "weight_decay", o.weight_decay()},
                         {g, "momentum", o.momentum()},
                         {g, "nesterov", o.nesterov() ? 1.0 : 0.0},
                         {g, "ns_coefficients[0]", a},
                         {g, "ns_coefficients[1]", b},
                         {g, "ns_coefficients[2]", c},
                         {g, "eps", o.eps()},
                         {g, "ns_steps", static_cast<double>(o.ns_steps())},
                         {g, "adjust_lr_fn", o.adjust_lr_fn().value_or("original") == "original" ? 0.0 : 1.0},
                         {g, "foreach", o.foreach().value_or(true) ? 1.0 : 0.0}});
}

PERF_INLINE void Muon::update(const std::optional<torch::Tensor>& grad_scale,
                              const std::optional<torch::Tensor>& found_inf) {
  const char* name = "perf::optim::Muon";
  kernels_.clear();
  // What can be refused, for every group before any changes (a group added through torch::optim::Optimizer&
  // bypasses add_param_group's check).
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      detail::check_muon_matrix(params[i], g, i);
      if (params[i].grad().defined()) detail::check_grad(params[i], g, name);
    }
  }
  TORCH_CHECK(!found_inf || skip_updates_ || !detail::capturing_cuda_graph(), name,
              ": a GradScaler's step is skipped on an inf by a host decision here (one read of found_inf, as "
              "Python's GradScaler does for an optimizer without fused kernels), which a CUDA graph capture cannot "
              "make; train in bfloat16 without a scaler, or run the step eagerly (TrainStepOptions().graph(false))");
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& o = static_cast<const MuonOptions&>(param_groups_[g].options());  // checked by step()
    std::vector<detail::Bucket> buckets;
    for (const auto& p : param_groups_[g].params()) {
      if (!p.grad().defined()) continue;  // skipped, as Python
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) slot = std::make_unique<MuonParamState>();
      auto& buffer = static_cast<MuonParamState&>(*slot).momentum_buffer();
      detail::to_param_device(buffer, p);
      if (!buffer.defined()) buffer = at::zeros_like(p.grad(), at::MemoryFormat::Preserve);
      auto& b = detail::bucket_for(buckets, p);
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.a.push_back(buffer);
    }
    const bool foreach = o.foreach().value_or(true);
    const double mu = o.momentum(), wd = o.weight_decay();
    for (auto& b : buckets) {
      // Matrices of one shape, in parameter order: one Newton-Schulz batch each (foreach).
      std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> shapes;
      for (size_t i = 0; i < b.params.size(); ++i) shapes[{b.params[i].size(0), b.params[i].size(1)}].push_back(i);
      std::string line = b.device.str() + " " + c10::toString(b.dtype) + ": ";
      if (foreach) {
        line += "foreach, Newton-Schulz in " + std::to_string(shapes.size()) +
                (shapes.size() == 1 ? " batch for " : " batches for ") + std::to_string(b.params.size()) +
                (b.params.size() == 1 ? " matrix" : " matrices");
      } else {
        line += "single-tensor";
      }
      kernels_.push_back(std::move(line));
      // CUDA: the lr as a device tensor (made before any capture: TrainStep's warm-up skips the update).
      const at::Tensor lr = b.device.is_cuda() ? lr_tensor(g, b.device, o.lr()) : at::Tensor();
      if (skip_updates_) continue;  // the state exists, nothing moves
      if (!detail::foreach_prepare_scaled(b.grads, detail::on_device(grad_scale, b.device),
                                          detail::on_device(found_inf, b.device)))
        continue;
      // W <- W (1 - lr wd) - lr ratio O: Python's param.mul_ and param.add_(O, alpha=-lr ratio), one tensor at a
      // time on the CPU (its multi-tensor kernels are such loops anyway, and round a bfloat16 product otherwise
      // than mul_ and add_ do). On CUDA multi-tensor kernels from the lr tensor, each O cast to the parameter's
      // dtype first (a multi-tensor add takes equal dtypes).
      const bool decays = !perf::detail::same_value(wd, 0.0);
      const at::Tensor decay = lr.defined() && decays ? at::mul(lr, -wd).add_(1) : at::Tensor();
      const auto decay_and_add = [&](std::vector<at::Tensor> params, const at::Tensor& ortho, double ratio) {
        if (!lr.defined()) {
          const auto updates = ortho.dim() == 3 ? ortho.unbind(0) : std::vector<at::Tensor>{ortho};
          for (size_t i = 0; i < params.size(); ++i) {
            // A double tensor, as Python's mul_(float): mul_(Scalar) rounds it to a bfloat16 parameter's dtype.
            if (decays) params[i].mul_(at::scalar_tensor(1 - o.lr() * wd, at::kDouble));
            params[i].add_(updates[i], -(o.lr() * ratio));
          }
          return;
        }
        if (decays) at::_foreach_mul_(params, decay);
        const at::Tensor scaled =
            ortho.to(ortho.options().dtype(b.dtype), false, false, at::MemoryFormat::Contiguous).mul_(lr * -ratio);
        at::_foreach_add_(params, scaled.dim() == 3 ? scaled.unbind(0) : std::vector<at::Tensor>{scaled});
      };
      std::vector<at::Tensor> updates = b.a;  // Nesterov: lerp(G, B, mu), new tensors
      if (foreach && lr.defined()) {
        at::_foreach_lerp_(b.a, b.grads, 1 - mu);
        if (o.nesterov()) updates = at::_foreach_lerp(b.grads, b.a, mu);
      } else {
        for (size_t i = 0; i < b.a.size(); ++i) {
          b.a[i].lerp_(b.grads[i], 1 - mu);
          if (o.nesterov()) updates[i] = b.grads[i].lerp(b.a[i], mu);
        }
      }
      // Newton-Schulz: one batch per shape, or one matrix at a time (Python's _single_tensor_muon).
      std::vector<std::vector<size_t>> batches;
      for (auto& [shape, indices] : shapes) {
        if (foreach) {
          batches.push_back(std::move(indices));
        } else {
          for (const size_t i : indices) batches.push_back({i});
        }
      }
      for (const auto& indices : batches) {
        std::vector<at::Tensor> params, us;
        for (const size_t i : indices) {
          params.push_back(b.params[i]);
          us.push_back(updates[i]);
        }
        decay_and_add(params, detail::zeropower_via_newtonschulz(us.size() == 1 ? us[0] : at::stack(us), o),
                      detail::muon_lr_ratio(o, params[0].size(0), params[0].size(1)));
      }
    }
  }
}

}  // namespace perf::optim
