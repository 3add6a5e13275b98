// perf/compiled_model.h — run torch.compile's ahead-of-time output
// (AOTInductor packages, .pt2) from C++, with every call's inputs checked.
// (perf/compiled.h includes it, and perf/compiled_train_step.h for training.)
//
//   perf::CompiledModel model("resnet.pt2");            // CPU or CUDA package
//   std::vector<at::Tensor> out = model.run({x});        // any number of inputs and outputs
//   at::Tensor y = model(x);                             // one input, one output
//   std::cout << model;                                  // device, inputs expected, metadata
//
// A package is written in Python: tools/export_compiled.py (torch.export +
// torch._inductor.aoti_compile_and_package with freezing), which also records
// each input's dtype, device, sizes (dynamic batch range) and memory format in
// the package metadata (`perf.input.N`). CompiledModel checks those before
// calling the generated code, which itself trusts its inputs: a wrong shape or
// dtype there reads out of bounds instead of failing. Packages exported some
// other way are checked for the number of inputs (their call spec) and device.
//
// Inputs whose strides differ from the exported layout (a transposed view, a
// channels-last image for a contiguous package) are copied to that layout:
// the generated kernels index with the strides seen at export time.
// On CUDA the package runs on the current stream. Opened with
// CompiledOptions().single_threaded(true) it runs through the container's
// single-threaded entry point, which skips the per-run completion event, so it
// can be captured into a CUDA graph (perf::graph). The default multi-threaded
// container queries that event (cudaEventQuery, not permitted while a stream
// captures) and records it on the stream (an event recorded in a capture can
// never be queried again, so every later call would fail): run() refuses a
// capturing stream in that mode before touching the container, naming the fix.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <perf/config.h>
#include <perf/detail/cpu.h>
#include <torch/arg.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner.h>

#if PERF_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace perf {

struct CompiledOptions {
  /// The model inside the package (aoti_compile_and_package writes "model").
  TORCH_ARG(std::string, model_name) = "model";
  /// CUDA packages: the GPU to load onto; -1 = the current device.
  TORCH_ARG(c10::DeviceIndex, device_index) = -1;
  /// Model instances, so that this many threads can run() at once without waiting.
  TORCH_ARG(size_t, runners) = 1;
  /// Run through the container's single-threaded entry point (LibTorch's
  /// run_single_threaded): no per-run event, so CUDA graphs can capture it;
  /// one thread at a time may call run().
  TORCH_ARG(bool, single_threaded) = false;
  /// Check inputs before each call (a few comparisons). false: unchecked, the
  /// only way to run a package whose input specs perf cannot read, at the
  /// risk of the generated code reading memory by shapes it was not given.
  TORCH_ARG(bool, check_inputs) = true;
};

/// One input as the package was compiled for it: from perf's metadata
/// (tools/export_compiled.py), or read from the input checks inductor
/// generates into every package (a package exported any other way).
struct CompiledInput {
  at::ScalarType dtype = at::kFloat;
  c10::DeviceType device = c10::kCPU;
  std::vector<int64_t> sizes;            ///< -1: dynamic (the batch dimension)
  int64_t min_batch = 0, max_batch = 0;  ///< max 0: no upper bound known
  at::MemoryFormat format = at::MemoryFormat::Contiguous;
};

namespace detail {
class Package;
}

/// Copies share the loaded package (like a module holder), so a copy can be
/// handed to perf::graph: `auto g = perf::graph(model, x);`.
class CompiledModel {
 public:
  explicit CompiledModel(const std::string& path, const CompiledOptions& options = CompiledOptions());

  /// Runs the package; inputs are checked (and re-laid-out where needed) first.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs);
  /// One input, one output.
  at::Tensor operator()(const at::Tensor& input);
  at::Tensor forward(const at::Tensor& input) { return (*this)(input); }

  const std::string& path() const noexcept;
  /// Where the package runs (cpu, or cuda:N).
  c10::Device device() const noexcept;
  /// Inputs the package expects; empty when it carries no perf metadata.
  const std::vector<CompiledInput>& inputs() const noexcept;
  /// Number of input tensors (from perf's metadata or the package's call spec).
  size_t num_inputs() const noexcept { return num_inputs_; }
  std::optional<size_t> num_outputs() const noexcept { return num_outputs_; }
  /// Where inputs() came from: "perf metadata" (tools/export_compiled.py) or
  /// "generated code" (the input checks inductor writes into every package).
  const std::string& inputs_from() const noexcept;
  const std::unordered_map<std::string, std::string>& metadata() const noexcept;
  const CompiledOptions& options() const noexcept { return options_; }
  /// LibTorch's loader, for what perf does not wrap (constant swapping).
  torch::inductor::AOTIModelPackageLoader& loader();

 private:
  CompiledOptions options_;
  std::shared_ptr<detail::Package> package_;
  size_t num_inputs_ = 0;
  std::optional<size_t> num_outputs_;
};

std::ostream& operator<<(std::ostream& out, const CompiledModel& model);

// --------------------------------------------------------------------------- implementation

namespace detail {

inline std::string sizes_string(const std::vector<int64_t>& sizes) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < sizes.size(); ++i)
    s << (i ? ", " : "") << (sizes[i] < 0 ? std::string("batch") : std::to_string(sizes[i]));
  s << "]";
  return s.str();
}

inline std::map<std::string, std::string> key_values(const std::string& text) {
  std::map<std::string, std::string> kv;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    const auto eq = word.find('=');
    if (eq != std::string::npos) kv[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return kv;
}

inline int64_t to_int(const std::string& text, const std::string& what) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  TORCH_CHECK(false, "perf: malformed package metadata ", what, "='", text, "'");
}

// "3,32,32" -> {3, 32, 32}; "" -> {} (a 0-d tensor).
inline std::vector<int64_t> int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> v;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(to_int(item, what));
  return v;
}

inline at::ScalarType dtype_from_name(const std::string& name) {
  static const std::map<std::string, at::ScalarType> names = {
      {"float32", at::kFloat}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16}, {"float64", at::kDouble},
      {"int64", at::kLong},    {"int32", at::kInt},    {"uint8", at::kByte},        {"bool", at::kBool}};
  const auto it = names.find(name);
  TORCH_CHECK(it != names.end(), "perf: package metadata names an unknown dtype '", name, "'");
  return it->second;
}

// perf.input.N = "dtype=float32 device=cpu sizes=-1,3,32,32 format=contiguous min=1 max=64"
inline CompiledInput parse_input(const std::string& text, size_t index) {
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

// Leaves of a serialized pytree spec (the call spec's input half): the number of tensors.
inline size_t spec_leaves(const std::string& spec) {
  size_t n = 0;
  for (size_t at = spec.find("\"type\": null"); at != std::string::npos; at = spec.find("\"type\": null", at + 1)) ++n;
  return n;
}

// The vector ISA a CPU package was compiled for (AOTI_CPU_ISA: "AVX512 AVX512_VNNI
// AMX_TILE", "AVX2"), against this CPU: running AVX-512 code without it dies of SIGILL.
inline std::string missing_cpu_isa(const std::string& isa) {
  const auto caps = at::cpu::get_cpu_capabilities();
  auto has = [&](const char* name) { return cpu_flag(caps, name); };
  std::istringstream in(isa);
  std::string word, missing;
  while (in >> word) {
    bool ok = true;
    if (word == "AVX2") ok = has("avx2") && has("fma3");
    if (word == "AVX512") ok = has("avx512_f") && has("avx512_bw") && has("avx512_vl") && has("avx512_dq");
    if (word == "AVX512_VNNI") ok = has("avx512_vnni");
    if (word == "AMX_TILE") ok = has("amx_tile");
    if (!ok) missing += (missing.empty() ? "" : " ") + word;
  }
  return missing;
}

// Input specs from the input checks inductor writes into every package's
// generated wrapper (data/aotinductor/<model>/*.wrapper.cpp; they run only
// under AOTI_RUNTIME_CHECK_INPUTS=1, and then fail with a bare "API call
// failed", which is why perf checks itself). Read from their messages, e.g.
//   "input_handles[0]: unmatched dim value at 1, " << "expected: 3, "
// dtype, device, static sizes and strides; a dimension with a range check is
// dynamic. The range itself is not taken: 2.11 writes bounds narrower than the
// export's (1..64 became 2..15 for a CNN, which runs fine at 64). nullopt when
// the package has no such code or it does not read as expected.
inline std::optional<std::vector<CompiledInput>> specs_from_generated_code(const std::string& path,
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

// Checks `inputs` against the exported specs (count, device, dtype, rank,
// static sizes, batch range) and returns them in the exported layout. `who`
// and `path` name the caller and package in errors; input numbers start at `first`.
inline std::vector<at::Tensor> check_inputs(const std::string& who, const std::vector<CompiledInput>& specs,
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
    bool shape_ok = x.dim() == static_cast<int64_t>(want.sizes.size());
    for (int64_t d = 0; shape_ok && d < x.dim(); ++d) shape_ok = want.sizes[d] < 0 || want.sizes[d] == x.size(d);
    TORCH_CHECK(shape_ok, who, ": input ", i, " has shape ", x.sizes(), ", the package was exported for ",
                sizes_string(want.sizes));
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (want.sizes[d] >= 0) continue;
      TORCH_CHECK(x.size(d) >= want.min_batch && (want.max_batch <= 0 || x.size(d) <= want.max_batch), who, ": input ",
                  i, " has batch ", x.size(d), ", the package was exported for batches ", want.min_batch, "..",
                  want.max_batch, " (shape ", x.sizes(), " vs ", sizes_string(want.sizes), ")");
    }
    out.push_back(x.is_contiguous(want.format) ? x : x.contiguous(want.format));
  }
  return out;
}

// An opened AOTInductor package: metadata, device, ISA and loader, shared by
// CompiledModel (inference) and CompiledTrainStep (training).
class Package {
 public:
  // `kind`: "inference" or "train", what the caller runs; `who` names it in errors.
  Package(const std::string& path, const CompiledOptions& options, const std::string& kind, const std::string& who)
      : path_(path), single_threaded_(options.single_threaded()), who_(who + " '" + path + "'") {
    TORCH_CHECK(options.runners() >= 1, "perf::CompiledOptions::runners must be >= 1, got ", options.runners());
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
      TORCH_CHECK(at::cuda::is_available(), who, ": '", path,
                  "' was compiled for CUDA, and this process sees no CUDA device. Export a CPU package "
                  "(tools/export_compiled.py --device cpu) to run here.");
      const auto index = options.device_index() >= 0 ? options.device_index() : c10::cuda::current_device();
      TORCH_CHECK(index < static_cast<c10::DeviceIndex>(at::cuda::device_count()),
                  "perf::CompiledOptions::device_index ", static_cast<int>(index),
                  " is out of range: this process sees ", at::cuda::device_count(), " GPU(s)");
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
          path, options.model_name(), options.single_threaded(), options.runners(),
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
      TORCH_CHECK(
          single_threaded_ || c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None, who_,
          ": this package was opened multi-threaded, and LibTorch's multi-threaded AOTInductor container "
          "queries and records a completion event each run, which CUDA graph capture forbids (and which "
          "would break every later call). Open it with perf::CompiledOptions().single_threaded(true) to "
          "capture it, or call it outside the capture.");
      stream = static_cast<void*>(at::cuda::getCurrentCUDAStream(device_.index()).stream());
    }
#endif
    return loader_->run(inputs, stream);
  }

  const std::string& path() const noexcept { return path_; }
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
  std::string path_;
  bool single_threaded_;
  std::string who_;
  std::unordered_map<std::string, std::string> metadata_;
  std::vector<CompiledInput> inputs_;
  std::string inputs_from_;
  c10::Device device_ = c10::kCPU;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
};

}  // namespace detail

inline CompiledModel::CompiledModel(const std::string& path, const CompiledOptions& options)
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
}

inline const std::string& CompiledModel::path() const noexcept { return package_->path(); }
inline c10::Device CompiledModel::device() const noexcept { return package_->device(); }
inline const std::vector<CompiledInput>& CompiledModel::inputs() const noexcept { return package_->inputs(); }
inline const std::string& CompiledModel::inputs_from() const noexcept { return package_->inputs_from(); }
inline const std::unordered_map<std::string, std::string>& CompiledModel::metadata() const noexcept {
  return package_->metadata();
}
inline torch::inductor::AOTIModelPackageLoader& CompiledModel::loader() { return package_->loader(); }

inline std::vector<at::Tensor> CompiledModel::run(const std::vector<at::Tensor>& inputs) {
  if (!options_.check_inputs()) return package_->run(inputs);
  return package_->run(
      detail::check_inputs(package_->who(), package_->inputs(), package_->device(), inputs, num_inputs()));
}

inline at::Tensor CompiledModel::operator()(const at::Tensor& input) {
  TORCH_CHECK(num_inputs() <= 1, "perf::CompiledModel '", path(), "' takes ", num_inputs(),
              " inputs: call run({...}) with all of them");
  auto out = run({input});
  TORCH_CHECK(out.size() == 1, "perf::CompiledModel '", path(), "' returned ", out.size(),
              " outputs: call run({...}) to get all of them");
  return out[0];
}

inline std::ostream& operator<<(std::ostream& out, const CompiledModel& model) {
  const auto& md = model.metadata();
  out << "perf::CompiledModel '" << model.path() << "' on " << model.device();
  if (md.count("perf.torch")) out << ", exported with torch " << md.at("perf.torch");
  if (model.device().is_cpu() && md.count("AOTI_CPU_ISA")) out << ", CPU ISA " << md.at("AOTI_CPU_ISA");
  if (model.device().is_cuda() && md.count("AOTI_COMPUTE_CAPABILITY"))
    out << ", compute capability " << md.at("AOTI_COMPUTE_CAPABILITY");
  if (model.options().single_threaded()) out << ", single-threaded (capturable)";
  out << "\n";
  if (model.inputs().empty()) {
    out << "  inputs: " << model.num_inputs() << " tensor(s), unchecked (check_inputs(false))\n";
  } else if (model.inputs_from() == "generated code") {
    out << "  inputs as the package's generated code checks them (no perf metadata: batch range unknown)\n";
  }
  for (size_t i = 0; i < model.inputs().size(); ++i) {
    const auto& in = model.inputs()[i];
    out << "  input " << i << ": " << in.dtype << " " << detail::sizes_string(in.sizes);
    if (in.max_batch > 0) out << " batch " << in.min_batch << ".." << in.max_batch;
    if (in.format == at::MemoryFormat::ChannelsLast) out << " channels_last";
    out << "\n";
  }
  if (model.num_outputs()) out << "  outputs: " << *model.num_outputs() << "\n";
  return out;
}

}  // namespace perf
