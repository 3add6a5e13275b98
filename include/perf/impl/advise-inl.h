// perf/impl/advise-inl.h — the out-of-line definitions of perf/advise.h.
// Included by perf/advise.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <c10/util/accumulate.h>
#include <perf/advise.h>

// CUDA's headers only here, where the definitions use them: a perf::perf_static user's
// translation unit does not compile them (docs/compile-time.md).
#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace perf {

namespace detail {

PERF_INLINE AdviseSlot& advise_slot() {
  static AdviseSlot slot;
  return slot;
}

PERF_INLINE std::shared_ptr<AdviseCounters> advise_counters() {
  auto& slot = advise_slot();
  std::lock_guard<std::mutex> lock(slot.mutex);
  return slot.current;
}

PERF_INLINE bool is_data_scope(const std::string& name) {
  return name == "data" || name.rfind("perf::prefetch", 0) == 0 || name.rfind("data/", 0) == 0;
}

PERF_INLINE std::unique_ptr<at::ObserverContext> advise_start(const at::RecordFunction& fn) {
  op_stack.push_back(fn.name());  // popped by advise_end, which RecordFunction pairs with this call
  if (in_observer) return nullptr;
  ObserverScope self;
  const auto c = advise_counters();
  if (c == nullptr) return nullptr;
  const std::string& name = op_stack.back();
  if (fn.scope() == at::RecordScope::USER_SCOPE) {
    if (is_data_scope(name)) {
      std::lock_guard<std::mutex> lock(c->mutex);
      c->open_waits[fn.handle()] = std::chrono::steady_clock::now();
    }
    return nullptr;
  }
  const auto inputs = fn.inputs();
  const bool forward_thread = std::this_thread::get_id() == c->caller;
  // What this operator tells, gathered without the lock.
  std::optional<c10::DeviceIndex> cuda_index;
  std::optional<std::vector<int64_t>> conv_shape;
  bool conv_nchw = false, compute = false, compute_fp32 = false, compute_cuda_fp32 = false;
  bool h2d = false, pageable = false;
  int64_t h2d_bytes = 0;
  if (forward_thread) {
    for (const auto& v : inputs) {
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_cuda()) {
        cuda_index = v.toTensor().device().index();
        break;
      }
    }
  }
  if (forward_thread && name == "aten::_convolution" && !inputs.empty() && inputs[0].isTensor() &&
      inputs[0].toTensor().dim() == 4) {
    const auto& x = inputs[0].toTensor();
    conv_shape = x.sizes().vec();
    conv_nchw = x.size(1) > 1 && x.size(2) * x.size(3) > 1 && x.is_contiguous() &&
                !x.is_contiguous(at::MemoryFormat::ChannelsLast);
  }
  if (forward_thread && (name == "aten::_convolution" || name == "aten::mm" || name == "aten::addmm" ||
                         name == "aten::bmm" || name == "aten::baddbmm")) {
    // The first tensor input that is not a bias-like 1-d tensor.
    for (const auto& v : inputs) {
      if (!v.isTensor()) continue;
      const auto& t = v.toTensor();
      if (t.dim() < 2) continue;
      compute = true;
      compute_fp32 = t.scalar_type() == at::kFloat;
      compute_cuda_fp32 = compute_fp32 && t.is_cuda();
      break;
    }
  }
  std::vector<int64_t> bmm_out, scores;
  if (forward_thread && (name == "aten::bmm" || name == "aten::baddbmm")) {
    const size_t a = name == "aten::bmm" ? 0 : 1;  // baddbmm(self, batch1, batch2)
    if (inputs.size() > a + 1 && inputs[a].isTensor() && inputs[a + 1].isTensor() && inputs[a].toTensor().dim() == 3 &&
        inputs[a + 1].toTensor().dim() == 3) {
      bmm_out = {inputs[a].toTensor().size(0), inputs[a].toTensor().size(1), inputs[a + 1].toTensor().size(2)};
    }
  }
  if (forward_thread && name == "aten::softmax" && inputs.size() >= 2 && inputs[0].isTensor() && inputs[1].isInt()) {
    const auto& t = inputs[0].toTensor();
    const bool last_dim = inputs[1].toInt() == -1 || inputs[1].toInt() == t.dim() - 1;
    const bool in_sdpa = std::any_of(op_stack.begin(), op_stack.end() - 1, [](const std::string& op) {
      return op.find("scaled_dot_product") != std::string::npos;
    });
    if (last_dim && !in_sdpa && t.dim() >= 3 && t.size(-1) >= 16 && t.size(-2) >= 16) scores = t.sizes().vec();
  }
  if (name == "aten::copy_" && inputs.size() >= 2 && inputs[0].isTensor() && inputs[1].isTensor()) {
    const auto& dst = inputs[0].toTensor();
    const auto& src = inputs[1].toTensor();
    if (dst.is_cuda() && src.is_cpu()) {
      h2d = true;
      pageable = !src.is_pinned();  // an operator itself: dispatched here, unobserved, before the lock
      h2d_bytes = static_cast<int64_t>(src.nbytes());
    }
  }
  std::lock_guard<std::mutex> lock(c->mutex);
  if (cuda_index) {
    if (c->cuda_ops++ == 0) c->cuda_index = *cuda_index;
  }
  if (conv_shape) {
    ++c->convs;
    c->convs_nchw += conv_nchw ? 1 : 0;
    c->conv_shapes.push_back(std::move(*conv_shape));
  }
  if (compute) {
    ++c->compute_ops;
    c->compute_fp32 += compute_fp32 ? 1 : 0;
    c->cuda_compute_fp32 += compute_cuda_fp32 ? 1 : 0;
  }
  if (!bmm_out.empty()) c->last_bmm = std::move(bmm_out);
  if (!scores.empty() && c->last_bmm.size() == 3 && c->last_bmm[1] == scores[scores.size() - 2] &&
      c->last_bmm[2] == scores.back() && c10::multiply_integers(c->last_bmm) == c10::multiply_integers(scores)) {
    ++c->written_attention;
    c->attention_shape = std::move(scores);
    c->last_bmm.clear();
  }
  if (h2d) {
    ++c->h2d;
    if (pageable) {
      ++c->pageable_h2d;
      c->pageable_h2d_bytes += h2d_bytes;
    }
  }
  return nullptr;
}

PERF_INLINE void advise_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (!op_stack.empty()) op_stack.pop_back();
  if (in_observer || fn.scope() != at::RecordScope::USER_SCOPE) return;
  ObserverScope self;
  const auto c = advise_counters();
  if (c == nullptr) return;
  std::lock_guard<std::mutex> lock(c->mutex);
  auto it = c->open_waits.find(fn.handle());
  if (it == c->open_waits.end()) return;
  c->data_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - it->second).count();
  c->open_waits.erase(it);
}

}  // namespace detail

PERF_INLINE bool Advice::has(const std::string& text) const {
  return std::any_of(findings.begin(), findings.end(),
                     [&](const Finding& f) { return f.what.find(text) != std::string::npos; });
}

PERF_INLINE std::string Advice::to_string() const {
  std::ostringstream s;
  s << *this;
  return s.str();
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const Advice& a) {
  os << "perf::advise: " << a.steps << " steps on " << a.device << ", median " << std::fixed << std::setprecision(2)
     << a.median_step_ms << " ms per step\n";
  if (a.findings.empty()) return os << "  no findings: nothing perf knows how to speed up here\n";
  for (size_t i = 0; i < a.findings.size(); ++i) {
    const auto& f = a.findings[i];
    os << "  [" << i + 1 << "] " << f.what << "\n      evidence: " << f.evidence << "\n      fix: " << f.fix << "\n";
  }
  return os;
}

PERF_INLINE Advice advise(const std::function<void()>& step, const AdviseOptions& options) {
  TORCH_CHECK(options.steps() >= 1, "perf::AdviseOptions::steps must be >= 1, got ", options.steps());
  TORCH_CHECK(options.warmup() >= 0, "perf::AdviseOptions::warmup must be >= 0, got ", options.warmup());
  TORCH_CHECK(options.data_wait_share() > 0 && options.data_wait_share() < 1,
              "perf::AdviseOptions::data_wait_share must be in (0, 1), got ", options.data_wait_share());
#if PERF_WITH_CUDA
  const bool cuda_built = true;
  const bool cuda_present = at::cuda::is_available();
#else
  const bool cuda_built = false;
  const bool cuda_present = false;
#endif
  TORCH_CHECK(!options.device() || !options.device()->is_cuda() || cuda_built,
              "perf::advise: device cuda needs perf built with CUDA (PERF_WITH_CUDA=1)");
  TORCH_CHECK(!options.device() || !options.device()->is_cuda() || cuda_present,
              "perf::advise: AdviseOptions().device(cuda) but this process sees no CUDA device");
  // The device under study: forced, else what the warm-up steps' operators ran on.
  std::optional<c10::Device> device = options.device();
  auto found_on = [](const detail::AdviseCounters& c) {
    return c.cuda_ops > 0 ? c10::Device(c10::kCUDA, c.cuda_index) : c10::Device(c10::kCPU);
  };
  auto sync_device = [&] {
#if PERF_WITH_CUDA
    if (device && device->is_cuda()) {
      detail::SyncDebugGuard quiet(c10::cuda::SyncDebugMode::L_DISABLED);  // our own sync is not the user's
      c10::cuda::device_synchronize();
    }
#endif
  };
  if (options.warmup() > 0) {
    auto seen = std::make_shared<detail::AdviseCounters>();
    seen->caller = std::this_thread::get_id();
    {
      detail::AdviseScope observing(seen);
      for (int i = 0; i < options.warmup(); ++i) step();
    }
    std::lock_guard<std::mutex> lock(seen->mutex);
    if (!device) device = found_on(*seen);
  }
  sync_device();

  auto shared = std::make_shared<detail::AdviseCounters>();
  auto& counters = *shared;
  counters.caller = std::this_thread::get_id();
  std::vector<double> step_s, host_s;
  {
    detail::AdviseScope observing(shared);
    detail::SyncWarningCounter warnings(shared.get());
    std::optional<c10::WarningUtils::WarningHandlerGuard> handler;
#if PERF_WITH_CUDA
    // Sync-debug warnings cost nothing on the CPU: on whenever the step may use
    // CUDA (the device is not known yet with warmup(0)).
    std::optional<detail::SyncDebugGuard> warn_on_sync;
    if (cuda_present && (!device || device->is_cuda())) {
      handler.emplace(&warnings);
      warn_on_sync.emplace(c10::cuda::SyncDebugMode::L_WARN);
    }
#endif
    for (int i = 0; i < options.steps(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      step();
      const auto t1 = std::chrono::steady_clock::now();
      if (!device) {  // warmup(0): decided by the first observed step
        std::lock_guard<std::mutex> lock(counters.mutex);
        device = found_on(counters);
      }
      sync_device();
      const auto t2 = std::chrono::steady_clock::now();
      host_s.push_back(std::chrono::duration<double>(t1 - t0).count());
      step_s.push_back(std::chrono::duration<double>(t2 - t0).count());
      std::lock_guard<std::mutex> lock(counters.mutex);
      counters.end_step();
    }
  }
  const bool cuda = device->is_cuda();
  Advice advice;
  advice.device = *device;

  std::lock_guard<std::mutex> read_lock(counters.mutex);  // ops still ending on other threads
  const int n = options.steps();
  advice.steps = n;
  auto sorted = step_s;
  std::sort(sorted.begin(), sorted.end());
  advice.median_step_ms = sorted[sorted.size() / 2] * 1e3;
  const double total = std::accumulate(step_s.begin(), step_s.end(), 0.0);
  auto pct = [](double share) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(0) << 100.0 * share << "%";
    return s.str();
  };
  auto per_step = [&](int64_t count) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(count % n == 0 ? 0 : 1) << static_cast<double>(count) / n;
    return s.str();
  };
  auto& f = advice.findings;

  // Data.
  if (total > 0 && counters.data_wait_s / total > options.data_wait_share()) {
    std::ostringstream ev;
    ev << pct(counters.data_wait_s / total) << " of step time waiting for batches (" << std::fixed
       << std::setprecision(2) << counters.data_wait_s / n * 1e3 << " ms of " << total / n * 1e3
       << " ms per step, in perf::prefetch or perf::Range(\"data\") scopes)";
    f.push_back({"the loop waits on data", ev.str(),
                 "perf::loader_options(batch, perf::LoaderTuning().workers(N)) with more workers (perf::tune_workers "
                 "measures them), and perf::prefetch(loader, device) to load ahead"});
  }
  // Syncs (CUDA).
  if (counters.syncs > 0) {
    std::ostringstream ev;
    ev << per_step(counters.syncs) << " host-device syncs per step, at:";
    for (const auto& [where, count] : counters.sync_sites) ev << " " << where << " (" << count << "x)";
    f.push_back({"host-device syncs in the step", ev.str(),
                 "remove .item()/.cpu()/printing of CUDA tensors from the step (perf::Progress reads values once per "
                 "line); perf::GradScaler and perf::clip_grad_norm_ keep their checks on the GPU"});
  }
  // Memory format.
  if (counters.convs > 0 && counters.convs_nchw * 2 >= counters.convs) {
    f.push_back({"convolutions on NCHW inputs",
                 per_step(counters.convs_nchw) + " of " + per_step(counters.convs) +
                     " convolutions per step take contiguous (NCHW) inputs",
                 "perf::optimize(model) (channels-last + autocast), or perf::to_channels_last(module) and "
                 "perf::channels_last(input)"});
  }
  // Attention.
  if (counters.written_attention > 0) {
    f.push_back({"attention written out (scores, softmax, matmul)",
                 per_step(counters.written_attention) + " softmax calls per step over matmul scores of shape " +
                     c10::str(c10::IntArrayRef(counters.attention_shape)) +
                     ", outside scaled_dot_product_attention: the scores are written to memory and kept for backward, "
                     "as LibTorch's torch::nn::MultiheadAttention and its Transformer layers compute attention",
                 "perf/attention.h: perf::TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder or "
                 "MultiheadAttention (need_weights=false) in place of LibTorch's; at::scaled_dot_product_attention "
                 "for attention of your own"});
  }
  // Precision.
  const bool autocast_used = counters.compute_ops > 0 && counters.compute_fp32 * 2 < counters.compute_ops;
#if PERF_WITH_CUDA
  if (cuda && counters.cuda_compute_fp32 > 0 && counters.cuda_compute_fp32 * 2 >= counters.compute_ops) {
    const bool tf32 = at::globalContext().allowTF32CuBLAS() && at::globalContext().allowTF32CuDNN();
    f.push_back({tf32 ? "fp32 matmuls/convolutions without autocast" : "fp32 matmuls/convolutions with TF32 off",
                 per_step(counters.cuda_compute_fp32) + " of " + per_step(counters.compute_ops) +
                     " matmuls/convolutions per step run in fp32" + (tf32 ? " (TF32 on)" : " with TF32 off"),
                 std::string(tf32 ? "" : "perf::setup() (TF32 on); ") +
                     "perf::Autocast (bf16, or fp16 with perf::GradScaler), or perf::optimize(model)"});
  }
  if (cuda && counters.convs > 0 && !at::globalContext().benchmarkCuDNN() && !counters.conv_shapes_vary) {
    f.push_back({"cuDNN autotuning off with static shapes",
                 per_step(counters.convs) + " convolutions per step, each with the same input shape in every one of " +
                     std::to_string(n) + " steps; cudnn_benchmark off",
                 "perf::setup() (cudnn_benchmark on unless deterministic)"});
  }
  if (counters.pageable_h2d > 0) {
    f.push_back({"pageable host-to-device copies",
                 per_step(counters.pageable_h2d) + " copies per step from pageable memory (" +
                     detail::bytes_str(counters.pageable_h2d_bytes / n) +
                     " per step): each is synchronous and half speed",
                 "perf::prefetch(loader, device) (pinned, async, on a side stream), or .pin_memory() and "
                 "non_blocking copies"});
  }
  const double host_total = std::accumulate(host_s.begin(), host_s.end(), 0.0);
  if (cuda && total > 0 && host_total / total > 0.8 && advice.median_step_ms < 50) {
    std::ostringstream ev;
    ev << "the host spends " << pct(host_total / total)
       << " of the step launching work (the GPU waits for the CPU); median step " << std::fixed << std::setprecision(2)
       << advice.median_step_ms << " ms";
    f.push_back({"launch-bound step", ev.str(),
                 "perf::graph(model, example) for inference, perf::TrainStep for training (CUDA graphs: one launch)"});
  }
#endif
  // CPU.
  if (!cuda) {
    // This process's share of the cores: all of them, or cores / processes where
    // perf::init_process_group counted several of the job's processes here.
    const int64_t cores = detail::physical_cores();
    const int processes = std::max(1, detail::job_processes_here().load());
    const int64_t share = std::max<int64_t>(1, cores / processes);
    const int threads = at::get_num_threads();
    const std::string on = std::to_string(threads) + " intra-op threads on " + std::to_string(cores) +
                           " physical cores" +
                           (processes > 1 ? " shared by " + std::to_string(processes) + " processes of this job" : "");
    if (cores > 0 && threads < share) {
      f.push_back({"intra-op threads below the physical cores", on,
                   "perf::setup(perf::Settings().num_threads(" + std::to_string(share) + "))"});
    }
    if (cores > 0 && processes > 1 && threads > share) {
      f.push_back({"intra-op threads over this process's share of the cores", on,
                   "perf::setup(perf::Settings().num_threads(" + std::to_string(share) +
                       ")): oversubscribed, OpenMP's threads spin waiting for threads that have no core"});
    }
    if (detail::cpu_bf16().native() && counters.compute_fp32 > 0 && !autocast_used) {
      f.push_back({"bf16 autocast off on a CPU with native bf16",
                   per_step(counters.compute_fp32) + " of " + per_step(counters.compute_ops) +
                       " matmuls/convolutions per step in fp32; this CPU has " + detail::cpu_bf16().features(),
                   "perf::Autocast (bf16 on such CPUs by default), or perf::optimize(model)"});
    }
  }
  return advice;
}

}  // namespace perf
