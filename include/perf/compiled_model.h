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
// On CUDA the package runs on the current stream. With one runner (the
// default) it runs through the container's single-threaded entry point, which
// skips the per-run completion event, so it can be captured into a CUDA graph
// (perf::graph), and a call does not wait for the previous call's kernels.
// LibTorch's multi-threaded container (runners(n > 1), or single_threaded(false))
// lets n threads run at once, but when every runner has a run that has not
// finished it synchronizes with the oldest one's event: with one runner the
// host would wait for each call's kernels before it launches the next. It also
// queries that event (cudaEventQuery, not permitted while a stream captures)
// and records it on the stream (an event recorded in a capture can never be
// queried again, so every later call would fail): run() refuses a capturing
// stream in that mode before touching the container, naming the fix.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <perf/config.h>
#include <perf/detail/check.h>
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
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
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
  /// Model instances, so that this many threads can run() at once without
  /// waiting (LibTorch's multi-threaded container, unless single_threaded says otherwise).
  TORCH_ARG(size_t, runners) = 1;
  /// true: run through the container's single-threaded entry point (LibTorch's
  /// run_single_threaded): no per-run event, so CUDA graphs can capture it and
  /// a CUDA call never waits for the previous call's kernels; calls from
  /// several threads take turns (perf lets one in at a time). false: LibTorch's
  /// multi-threaded container, whose calls wait on the host for a runner's
  /// last run when every runner has one unfinished. Unset: true with one
  /// runner, false with runners(n > 1). CompiledModel::single_threaded() says which.
  TORCH_ARG(std::optional<bool>, single_threaded);
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

/// e.g. `Float [batch, 3, 32, 32] batch 1..64 channels_last`.
std::ostream& operator<<(std::ostream& out, const CompiledInput& input);

namespace detail {
class Package;
}  // namespace detail

/// Copies share the loaded package (like a module holder), so a copy can be
/// handed to perf::graph: `auto g = perf::graph(model, x);`. A CPU package that
/// computes in bfloat16 on a CPU without bfloat16 instructions (no AVX-512-BF16,
/// no AMX-BF16) warns when opened: its kernels emulate bf16, several times
/// slower than the same model in float32.
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
  /// Whether it runs through the single-threaded entry point (CompiledOptions::single_threaded).
  bool single_threaded() const noexcept;
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

PERF_INLINE std::string sizes_string(const std::vector<int64_t>& sizes);

// "  Inductor options: cpp.simdlen=1\n" for a package exported with --inductor-config; "" otherwise.
PERF_INLINE std::string inductor_options_line(const std::unordered_map<std::string, std::string>& metadata);

PERF_INLINE std::map<std::string, std::string> key_values(const std::string& text);

PERF_INLINE int64_t to_int(const std::string& text, const std::string& what);

// "3,32,32" -> {3, 32, 32}; "" -> {} (a 0-d tensor).
PERF_INLINE std::vector<int64_t> int_list(const std::string& text, const std::string& what);

PERF_INLINE at::ScalarType dtype_from_name(const std::string& name);

// perf.input.N = "dtype=float32 device=cpu sizes=-1,3,32,32 format=contiguous min=1 max=64"
PERF_INLINE CompiledInput parse_input(const std::string& text, size_t index);

// Leaves of a serialized pytree spec (the call spec's input half): the number of tensors.
PERF_INLINE size_t spec_leaves(const std::string& spec);

// Why a CPU package will run slowly on `cpu`, or "": it computes in bfloat16 (a bfloat16
// input, bf16 autocast inside a training step, or bfloat16 state) and `cpu` has no bfloat16
// instructions, so ATen and the generated kernels emulate them. perf's own CPU recipe stays
// in float32 there (perf/detail/cpu.h); a package exported in bf16 elsewhere cannot.
PERF_INLINE std::string emulated_bf16_reason(const std::unordered_map<std::string, std::string>& metadata,
                                             const std::vector<CompiledInput>& inputs, const CpuBf16& cpu);

// Input specs from the input checks inductor writes into every package's
// generated wrapper (data/aotinductor/<model>/*.wrapper.cpp; they run only
// under AOTI_RUNTIME_CHECK_INPUTS=1, and then fail with a bare "API call
// failed", which is why perf checks itself). Read from their messages, e.g.
//   "input_handles[0]: unmatched dim value at 1, " << "expected: 3, "
// dtype, device, static sizes and strides; a dimension with a range check is
// dynamic. The range itself is not taken: 2.11 writes bounds narrower than the
// export's (1..64 became 2..15 for a CNN, which runs fine at 64). nullopt when
// the package has no such code or it does not read as expected.
PERF_INLINE std::optional<std::vector<CompiledInput>> specs_from_generated_code(const std::string& path,
                                                                                const std::string& model_name,
                                                                                size_t num_inputs);

// Checks `inputs` against the exported specs (count, device, dtype, rank,
// static sizes, batch range) and returns them in the exported layout. `who`
// and `path` name the caller and package in errors; input numbers start at `first`.
PERF_INLINE std::vector<at::Tensor> check_inputs(const std::string& who, const std::vector<CompiledInput>& specs,
                                                 const c10::Device& device, const std::vector<at::Tensor>& inputs,
                                                 size_t expected_count);

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
      TORCH_CHECK(at::cuda::is_available(), who, ": '", path,
                  "' was compiled for CUDA, and this process sees no CUDA device. Export a CPU package "
                  "(tools/export_compiled.py --device cpu) to run here.");
      const auto index = options.device_index() >= 0 ? options.device_index() : c10::cuda::current_device();
      TORCH_CHECK(index < at::cuda::device_count(), "perf::CompiledOptions::device_index ", static_cast<int>(index),
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
      stream = static_cast<void*>(at::cuda::getCurrentCUDAStream(device_.index()).stream());
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

// TORCH_WARN with emulated_bf16_reason() for this CPU, when there is one (a CPU package only).
PERF_INLINE void warn_if_emulated_bf16(const Package& package);

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/compiled_model-inl.h>
#endif
