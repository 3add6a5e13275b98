// perf/impl/compiled_model-inl.h — the out-of-line definitions of perf/compiled_model.h.
// Included by perf/compiled_model.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <caffe2/serialize/inline_container.h>
#include <perf/compiled_model.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace perf {

namespace detail {

// An opened AOTInductor package: metadata, device, ISA and loader, shared by
// CompiledModel (inference) and CompiledTrainStep (training).
class Package {
 public:
  // `kind`: "inference" or "train", what the caller runs; `who` names it in errors.
  Package(const std::string& path, const CompiledOptions& options, const std::string& kind, const std::string& who)
      : path_(path),
        single_threaded_(options.single_threaded().value_or(options.runners() == 1)),
        who_(who + " '" + path + "'") {
    detail::check_count(options.runners(), 1, "perf::CompiledOptions::runners");
    TORCH_CHECK(!single_threaded_ || options.runners() == 1,
                "perf::CompiledOptions: single_threaded(true) runs one model instance, so runners(", options.runners(),
                ") would not run at once; for several threads at once leave single_threaded unset (or false), for one "
                "caller leave runners at 1");
    TORCH_CHECK(std::ifstream(path).good(), who, ": cannot open '", path,
                "' (no such file or not readable). Write packages with tools/export_compiled.py.");
    try {
      metadata_ = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(path, options.model_name());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, who, ": '", path, "' is not a readable AOTInductor package for model '", options.model_name(),
                  "': ", e.what());
    }
    const std::string has = metadata_.count("perf.kind") ? metadata_.at("perf.kind") : "inference";
    TORCH_CHECK(has == kind, who, ": '", path, "' was exported for ",
                has == "train" ? "training (tools/export_compiled.py --train): run it with perf::CompiledTrainStep"
                               : "inference: export the training step with tools/export_compiled.py --train",
                "");
    const std::string device = metadata_.count("AOTI_DEVICE_KEY") ? metadata_.at("AOTI_DEVICE_KEY") : "cpu";
    TORCH_CHECK(device == "cpu" || device == "cuda", who, ": '", path, "' was compiled for '", device,
                "'; perf runs cpu and cuda packages");
    if (device == "cuda") {
#if PERF_WITH_CUDA
      TORCH_CHECK(c10::cuda::device_count() > 0, who, ": '", path,
                  "' was compiled for CUDA, and this process sees no CUDA device. Export a CPU package "
                  "(tools/export_compiled.py --device cpu) to run here.");
      const auto index = options.device_index() >= 0 ? options.device_index() : c10::cuda::current_device();
      TORCH_CHECK(index < c10::cuda::device_count(), "perf::CompiledOptions::device_index ", static_cast<int>(index),
                  " is out of range: this process sees ", static_cast<int>(c10::cuda::device_count()), " GPU(s)");
      device_ = c10::Device(c10::kCUDA, index);
#else
      TORCH_CHECK(false, who, ": '", path,
                  "' was compiled for CUDA, and this program was built without CUDA (PERF_WITH_CUDA=0). Export a "
                  "CPU package (tools/export_compiled.py --device cpu) or build with CUDA.");
#endif
    } else if (metadata_.count("AOTI_CPU_ISA")) {
      const auto missing = missing_cpu_isa(metadata_.at("AOTI_CPU_ISA"));
      TORCH_CHECK(missing.empty(), who, ": '", path, "' was compiled for CPUs with ", metadata_.at("AOTI_CPU_ISA"),
                  "; this CPU lacks ", missing, ". Export it again on (or for) this machine.");
    }
    if (metadata_.count("perf.inputs")) {
      const auto n = static_cast<size_t>(to_int(metadata_.at("perf.inputs"), "perf.inputs"));
      for (size_t i = 0; i < n; ++i) {
        const auto key = "perf.input." + std::to_string(i);
        TORCH_CHECK(metadata_.count(key), who, ": '", path, "' lacks metadata ", key);
        inputs_.push_back(parse_input(metadata_.at(key), i));
      }
      inputs_from_ = "perf metadata";
    }
    try {
      loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
          path, options.model_name(), single_threaded_, options.runners(),
          device_.is_cuda() ? device_.index() : static_cast<c10::DeviceIndex>(-1));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, who, ": loading '", path, "' failed: ", e.what());
    }
  }

  // Runs the generated code on the current stream (inputs already checked).
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) {
    void* stream = nullptr;
#if PERF_WITH_CUDA
    std::optional<c10::cuda::CUDAGuard> guard;
    if (device_.is_cuda()) {
      guard.emplace(device_);
      const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
      TORCH_CHECK(!capturing || single_threaded_, who_,
                  ": this package was opened multi-threaded, and LibTorch's multi-threaded AOTInductor container "
                  "queries and records a completion event each run, which CUDA graph capture forbids (and which "
                  "would break every later call). Open it single-threaded to capture it (perf's default with one "
                  "runner: leave perf::CompiledOptions().runners at 1 and single_threaded unset or true), or call "
                  "it outside the capture.");
      // The container's first call folds the package's constants into new
      // device memory (model_container.h); captured, that memory would come
      // from the graph's pool and be freed with the graph while the container
      // keeps using it. (Folding ahead through the runner's run_const_fold is
      // no way out: it parks the container's only model in pending_models_,
      // and run_single_threaded then indexes an empty available_models_.)
      TORCH_CHECK(!capturing || ran_.load(), who_,
                  ": its first call folds the package's constants into new device memory, which must not happen "
                  "under CUDA graph capture (it would live in the graph's memory pool and be freed with the graph). "
                  "Call it once outside the capture first (perf::graph does with GraphOptions().warmup() >= 1).");
      stream = static_cast<void*>(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
    }
#endif
    // The single-threaded entry point is not safe for two callers at once (the model instance's
    // state, its lazily loaded kernels): perf lets one call in at a time, so any thread may call.
    // Each call only launches its kernels on its stream; it does not wait for the GPU.
    std::unique_lock<std::mutex> one_at_a_time(single_call_, std::defer_lock);
    if (single_threaded_) one_at_a_time.lock();
    if (!ran_.load()) {
      // LibTorch's container (aoti_runtime/model_container.h, run) folds the
      // constants on its first run under an exclusive lock it takes after
      // giving up its shared one, while a caller that finds no free model
      // instance waits for one holding its shared lock: more first callers
      // than runners can deadlock (pytorch/pytorch#181941, not in torch 2.11).
      // The first call goes alone; capture is refused above until it has run.
      std::lock_guard<std::mutex> alone(first_run_);
      if (!ran_.load()) {
        auto outputs = run_package(inputs, stream);
        ran_ = true;
        return outputs;
      }
    }
    return run_package(inputs, stream);
  }

  const std::string& path() const noexcept { return path_; }
  bool single_threaded() const noexcept { return single_threaded_; }
  const std::string& who() const noexcept { return who_; }
  c10::Device device() const noexcept { return device_; }
  const std::vector<CompiledInput>& inputs() const noexcept { return inputs_; }
  /// Where inputs() came from: "perf metadata", "generated code", or "" (none).
  const std::string& inputs_from() const noexcept { return inputs_from_; }
  void set_inputs(std::vector<CompiledInput> inputs, std::string from) {
    inputs_ = std::move(inputs);
    inputs_from_ = std::move(from);
  }
  const std::unordered_map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  std::string meta(const std::string& key) const {
    const auto it = metadata_.find(key);
    TORCH_CHECK(it != metadata_.end(), who_, " lacks metadata ", key, " (exported by an older tool? export it again)");
    return it->second;
  }
  torch::inductor::AOTIModelPackageLoader& loader() { return *loader_; }

 private:
  // The error names the package. Where the package's code failed, LibTorch 2.11's runner says only which
  // of its calls did ("run_func_(...) API call failed at model_container_runner.cpp", a std::runtime_error):
  // the cause went to stderr, where that code logs it, and the error says so. Later runners raise the
  // cause itself as a c10::Error. Out of memory stays a c10::OutOfMemoryError (perf::find_max_batch_size).
  std::vector<at::Tensor> run_package(const std::vector<at::Tensor>& inputs, void* stream) {
    try {
      return loader_->run(inputs, stream);
    } catch (const c10::OutOfMemoryError& e) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, who_, ": the package's run failed: ", e.what_without_backtrace());
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, who_, ": the package's run failed: ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      const bool logged = std::string(e.what()).find("API call failed") != std::string::npos;
      TORCH_CHECK(false, who_, ": the package's run failed: ", e.what(),
                  logged ? ". The package's code wrote the cause to stderr just before (AOTInductor's lines "
                           "\"Exception in aoti_torch: ...\" and \"Error: ...\")"
                         : "");
    }
  }

  std::string path_;
  bool single_threaded_;
  std::string who_;
  std::unordered_map<std::string, std::string> metadata_;
  std::vector<CompiledInput> inputs_;
  std::string inputs_from_;
  c10::Device device_ = c10::kCPU;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
  std::atomic<bool> ran_{false};  // a call outside capture has run (constants folded)
  std::mutex first_run_;          // held by the first call until it has run
  std::mutex single_call_;        // single-threaded: held by the call running
};

}  // namespace detail

namespace detail {

PERF_INLINE std::string sizes_string(const std::vector<int64_t>& sizes) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < sizes.size(); ++i)
    s << (i ? ", " : "") << (sizes[i] < 0 ? std::string("batch") : std::to_string(sizes[i]));
  s << "]";
  return s.str();
}

PERF_INLINE std::string inductor_options_line(const std::unordered_map<std::string, std::string>& metadata) {
  const auto it = metadata.find("perf.inductor_configs");
  return it == metadata.end() || it->second.empty() ? "" : "  Inductor options: " + it->second + "\n";
}

PERF_INLINE std::map<std::string, std::string> key_values(const std::string& text) {
  std::map<std::string, std::string> kv;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    const auto eq = word.find('=');
    if (eq != std::string::npos) kv[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return kv;
}

PERF_INLINE int64_t to_int(const std::string& text, const std::string& what) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  TORCH_CHECK(false, "perf: malformed package metadata ", what, "='", text, "'");
}

PERF_INLINE std::vector<int64_t> int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> v;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(to_int(item, what));
  return v;
}

PERF_INLINE at::ScalarType dtype_from_name(const std::string& name) {
  static const std::map<std::string, at::ScalarType> names = {
      {"float32", at::kFloat}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16}, {"float64", at::kDouble},
      {"int64", at::kLong},    {"int32", at::kInt},    {"uint8", at::kByte},        {"bool", at::kBool}};
  const auto it = names.find(name);
  TORCH_CHECK(it != names.end(), "perf: package metadata names an unknown dtype '", name, "'");
  return it->second;
}

PERF_INLINE CompiledInput parse_input(const std::string& text, size_t index) {
  const std::string what = "perf.input." + std::to_string(index);
  auto kv = key_values(text);
  CompiledInput in;
  in.dtype = dtype_from_name(kv["dtype"]);
  TORCH_CHECK(kv["device"] == "cpu" || kv["device"] == "cuda", "perf: package metadata ", what, " has device '",
              kv["device"], "'");
  in.device = kv["device"] == "cuda" ? c10::kCUDA : c10::kCPU;
  in.sizes = int_list(kv["sizes"], what + " sizes");
  in.format = kv["format"] == "channels_last" ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  if (kv.count("min")) in.min_batch = to_int(kv["min"], what + " min");
  if (kv.count("max")) in.max_batch = to_int(kv["max"], what + " max");
  return in;
}

PERF_INLINE size_t spec_leaves(const std::string& spec) {
  size_t n = 0;
  for (size_t at = spec.find("\"type\": null"); at != std::string::npos; at = spec.find("\"type\": null", at + 1)) ++n;
  return n;
}

PERF_INLINE std::string emulated_bf16_reason(const std::unordered_map<std::string, std::string>& metadata,
                                             const std::vector<CompiledInput>& inputs, const CpuBf16& cpu) {
  if (cpu.native()) return "";
  std::string what;  // the first sign that the package computes in bfloat16
  for (size_t i = 0; i < inputs.size() && what.empty(); ++i)
    if (inputs[i].dtype == at::kBFloat16) what = "input " + std::to_string(i) + " is BFloat16";
  const auto amp = metadata.find("perf.train.amp");
  if (what.empty() && amp != metadata.end() && amp->second == "bf16") what = "the step runs under bf16 autocast";
  for (size_t i = 0; what.empty(); ++i) {  // a training step's parameters and buffers, in order
    const auto state = metadata.find("perf.train.state." + std::to_string(i));
    if (state == metadata.end()) break;
    auto kv = key_values(state->second);
    if (kv["dtype"] == "bfloat16") what = "its state '" + kv["name"] + "' is BFloat16";
  }
  if (what.empty()) return "";
  return "it computes in bfloat16 (" + what + "), and this CPU has no bfloat16 instructions (" + cpu.features() +
         "), so its bfloat16 kernels are emulated: expect it several times slower than the same model in float32 "
         "(7-10x for bench_compiled's CNN on an AVX2 CPU). For this machine, export it in float32 "
         "(tools/export_compiled.py without --dtype bfloat16; for a training step, --amp off).";
}

PERF_INLINE std::optional<std::vector<CompiledInput>> specs_from_generated_code(const std::string& path,
                                                                                const std::string& model_name,
                                                                                size_t num_inputs) {
  std::string cpp;
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    const std::string dir = "data/aotinductor/" + model_name + "/";
    const std::string suffix = ".wrapper.cpp";
    for (const auto& name : reader.getAllRecords()) {
      if (name.rfind(dir, 0) != 0 || name.size() < suffix.size() ||
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      auto record = reader.getRecord(name);
      cpp.assign(static_cast<const char*>(std::get<0>(record).get()), std::get<1>(record));
      break;
    }
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (cpp.empty()) return std::nullopt;
  struct Seen {
    std::optional<at::ScalarType> dtype;
    std::optional<c10::DeviceType> device;
    std::map<int64_t, int64_t> sizes, strides;
    std::set<int64_t> dynamic;
  };
  std::map<size_t, Seen> seen;
  static const std::map<std::string, at::ScalarType> dtypes = {
      {"kFloat", at::kFloat}, {"kHalf", at::kHalf}, {"kBFloat16", at::kBFloat16}, {"kDouble", at::kDouble},
      {"kLong", at::kLong},   {"kInt", at::kInt},   {"kShort", at::kShort},       {"kChar", at::kChar},
      {"kByte", at::kByte},   {"kBool", at::kBool}};
  auto number_after = [&](size_t from, const std::string& key, int64_t& out) {
    const auto at = cpp.find(key, from);
    if (at == std::string::npos || at - from > 400) return false;
    char* end = nullptr;
    out = std::strtoll(cpp.c_str() + at + key.size(), &end, 10);
    return end != cpp.c_str() + at + key.size();
  };
  const std::string tag = "\"input_handles[";
  for (size_t at = cpp.find(tag); at != std::string::npos; at = cpp.find(tag, at + 1)) {
    char* end = nullptr;
    const auto index = static_cast<size_t>(std::strtoull(cpp.c_str() + at + tag.size(), &end, 10));
    const size_t msg = static_cast<size_t>(end - cpp.c_str()) + 3;  // past "]: "
    if (msg >= cpp.size()) return std::nullopt;
    Seen& s = seen[index];
    const std::string text = cpp.substr(msg, 40);
    int64_t dim = 0, value = 0;
    if (text.rfind("unmatched dtype", 0) == 0) {
      const auto k = cpp.find("(at::", msg);
      const auto close = k == std::string::npos ? k : cpp.find(')', k);
      if (close == std::string::npos || k - msg > 400) return std::nullopt;
      const auto it = dtypes.find(cpp.substr(k + 5, close - k - 5));
      if (it == dtypes.end()) return std::nullopt;
      s.dtype = it->second;
    } else if (text.rfind("unmatched dim value at ", 0) == 0) {
      if (!number_after(msg, "at ", dim) || !number_after(msg, "expected: ", value)) return std::nullopt;
      s.sizes[dim] = value;
    } else if (text.rfind("dim value is too ", 0) == 0) {
      if (!number_after(msg, " at ", dim)) return std::nullopt;
      s.dynamic.insert(dim);
    } else if (text.rfind("unmatched stride value at ", 0) == 0) {
      if (!number_after(msg, "at ", dim) || !number_after(msg, "expected: ", value)) return std::nullopt;
      s.strides[dim] = value;
    } else if (text.rfind("unmatched device type", 0) == 0) {
      const auto k = cpp.find("(cpu)", msg), c = cpp.find("(cuda)", msg);
      const auto first = std::min(k, c);
      if (first == std::string::npos || first - msg > 400) return std::nullopt;
      s.device = first == k ? c10::kCPU : c10::kCUDA;
    }
  }
  if (seen.size() != num_inputs) return std::nullopt;
  std::vector<CompiledInput> specs;
  for (size_t i = 0; i < num_inputs; ++i) {
    if (!seen.count(i) || !seen[i].dtype) return std::nullopt;
    const Seen& s = seen[i];
    int64_t rank = 0;
    for (const auto& kv : s.sizes) rank = std::max(rank, kv.first + 1);
    for (const auto& kv : s.strides) rank = std::max(rank, kv.first + 1);
    for (const auto d : s.dynamic) rank = std::max(rank, d + 1);
    CompiledInput in;
    in.dtype = *s.dtype;
    in.device = s.device.value_or(c10::kCPU);
    for (int64_t d = 0; d < rank; ++d) in.sizes.push_back(s.sizes.count(d) ? s.sizes.at(d) : -1);
    if (rank > 0 && std::find(in.sizes.begin(), in.sizes.end(), -1) != in.sizes.end()) in.min_batch = 1;
    if (rank == 4 && s.strides.count(1) && s.strides.at(1) == 1 && s.sizes.count(1) && s.sizes.at(1) > 1)
      in.format = at::MemoryFormat::ChannelsLast;
    specs.push_back(std::move(in));
  }
  return specs;
}

PERF_INLINE std::vector<at::Tensor> check_inputs(const std::string& who, const std::vector<CompiledInput>& specs,
                                                 const c10::Device& device, const std::vector<at::Tensor>& inputs,
                                                 size_t expected_count) {
  TORCH_CHECK(expected_count == 0 || inputs.size() == expected_count, who, " takes ", expected_count, " input(s), got ",
              inputs.size());
  std::vector<at::Tensor> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& x = inputs[i];
    TORCH_CHECK(x.defined(), who, ": input ", i, " is an undefined tensor");
    TORCH_CHECK(x.device().type() == device.type() && (!device.is_cuda() || x.device().index() == device.index()), who,
                ": input ", i, " is on ", x.device(), ", the package runs on ", device, " (move it with .to(", device,
                "))");
    if (specs.empty()) {
      out.push_back(x.is_contiguous() ? x : x.contiguous());
      continue;
    }
    const CompiledInput& want = specs[i];
    TORCH_CHECK(x.scalar_type() == want.dtype, who, ": input ", i, " has dtype ", x.scalar_type(),
                ", the package was exported for ", want.dtype, " (convert with .to(", want.dtype, "))");
    const auto sizes = x.sizes();
    bool shape_ok = sizes.size() == want.sizes.size();
    for (size_t d = 0; shape_ok && d < sizes.size(); ++d) shape_ok = want.sizes[d] < 0 || want.sizes[d] == sizes[d];
    TORCH_CHECK(shape_ok, who, ": input ", i, " has shape ", x.sizes(), ", the package was exported for ",
                sizes_string(want.sizes));
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (want.sizes[d] >= 0) continue;
      TORCH_CHECK(sizes[d] >= want.min_batch && (want.max_batch <= 0 || sizes[d] <= want.max_batch), who, ": input ", i,
                  " has batch ", sizes[d], ", the package was exported for batches ", want.min_batch, "..",
                  want.max_batch, " (shape ", sizes, " vs ", sizes_string(want.sizes), ")");
    }
    out.push_back(x.is_contiguous(want.format) ? x : x.contiguous(want.format));
  }
  return out;
}

PERF_INLINE void warn_if_emulated_bf16(const Package& package) {
  if (!package.device().is_cpu()) return;
  const auto why = emulated_bf16_reason(package.metadata(), package.inputs(), cpu_bf16());
  if (!why.empty()) {
    TORCH_WARN(package.who(), ": ", why);  // a macro of two statements
  }
}

}  // namespace detail

PERF_INLINE CompiledModel::CompiledModel(const std::string& path, const CompiledOptions& options)
    : options_(options),
      package_(std::make_shared<detail::Package>(path, options, "inference", "perf::CompiledModel")) {
  const auto& md = package_->metadata();
  num_inputs_ = package_->inputs().size();
  if (md.count("perf.outputs"))
    num_outputs_ = static_cast<size_t>(detail::to_int(md.at("perf.outputs"), "perf.outputs"));
  if (package_->inputs().empty()) {  // not exported by perf's tool: the call spec counts the tensors
    const auto spec = package_->loader().get_call_spec();
    if (!spec.empty()) num_inputs_ = detail::spec_leaves(spec[0]);
    if (spec.size() > 1) num_outputs_ = detail::spec_leaves(spec[1]);
    auto specs = detail::specs_from_generated_code(path, options.model_name(), num_inputs_);
    if (specs) {
      package_->set_inputs(std::move(*specs), "generated code");
    } else {
      TORCH_CHECK(!options.check_inputs(), "perf::CompiledModel: '", path,
                  "' carries no input specs perf can read (no perf metadata, and no input checks in its generated "
                  "code that read as expected), so a wrong shape or dtype would run through code that reads memory "
                  "by the shapes it was compiled for. Export it with tools/export_compiled.py, or open it with "
                  "perf::CompiledOptions().check_inputs(false) to run it unchecked at that risk.");
    }
  }
  detail::warn_if_emulated_bf16(*package_);
}

PERF_INLINE const std::string& CompiledModel::path() const noexcept { return package_->path(); }
PERF_INLINE bool CompiledModel::single_threaded() const noexcept { return package_->single_threaded(); }

PERF_INLINE c10::Device CompiledModel::device() const noexcept { return package_->device(); }

PERF_INLINE const std::vector<CompiledInput>& CompiledModel::inputs() const noexcept { return package_->inputs(); }

PERF_INLINE const std::string& CompiledModel::inputs_from() const noexcept { return package_->inputs_from(); }

PERF_INLINE const std::unordered_map<std::string, std::string>& CompiledModel::metadata() const noexcept {
  return package_->metadata();
}

PERF_INLINE torch::inductor::AOTIModelPackageLoader& CompiledModel::loader() { return package_->loader(); }

PERF_INLINE std::vector<at::Tensor> CompiledModel::run(const std::vector<at::Tensor>& inputs) {
  if (!options_.check_inputs()) return package_->run(inputs);
  return package_->run(
      detail::check_inputs(package_->who(), package_->inputs(), package_->device(), inputs, num_inputs()));
}

PERF_INLINE at::Tensor CompiledModel::operator()(const at::Tensor& input) {
  TORCH_CHECK(num_inputs() <= 1, "perf::CompiledModel '", path(), "' takes ", num_inputs(),
              " inputs: call run({...}) with all of them");
  auto out = run({input});
  TORCH_CHECK(out.size() == 1, "perf::CompiledModel '", path(), "' returned ", out.size(),
              " outputs: call run({...}) to get all of them");
  return out[0];
}

PERF_INLINE std::ostream& operator<<(std::ostream& out, const CompiledInput& input) {
  out << input.dtype << " " << detail::sizes_string(input.sizes);
  if (input.max_batch > 0) out << " batch " << input.min_batch << ".." << input.max_batch;
  if (input.format == at::MemoryFormat::ChannelsLast) out << " channels_last";
  return out;
}

PERF_INLINE std::ostream& operator<<(std::ostream& out, const CompiledModel& model) {
  const auto& md = model.metadata();
  out << "perf::CompiledModel '" << model.path() << "' on " << model.device();
  if (md.count("perf.torch")) out << ", exported with torch " << md.at("perf.torch");
  if (md.count("perf.max_autotune") && md.at("perf.max_autotune") == "1") out << ", max-autotune";
  if (model.device().is_cpu() && md.count("AOTI_CPU_ISA")) out << ", CPU ISA " << md.at("AOTI_CPU_ISA");
  if (model.device().is_cuda() && md.count("AOTI_COMPUTE_CAPABILITY"))
    out << ", compute capability " << md.at("AOTI_COMPUTE_CAPABILITY");
  if (model.single_threaded()) {
    out << ", single-threaded (capturable)";
  } else {
    out << ", multi-threaded (" << model.options().runners() << " runner" << (model.options().runners() == 1 ? "" : "s")
        << ")";
  }
  out << "\n" << detail::inductor_options_line(md);
  if (model.inputs().empty()) {
    out << "  inputs: " << model.num_inputs() << " tensor(s), unchecked (check_inputs(false))\n";
  } else if (model.inputs_from() == "generated code") {
    out << "  inputs as the package's generated code checks them (no perf metadata: batch range unknown)\n";
  }
  for (size_t i = 0; i < model.inputs().size(); ++i) out << "  input " << i << ": " << model.inputs()[i] << "\n";
  if (model.num_outputs()) out << "  outputs: " << *model.num_outputs() << "\n";
  return out;
}

}  // namespace perf
