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
#include <perf/config.h>
#include <perf/detail/check.h>
#include <perf/detail/cpu.h>
#include <torch/arg.h>

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

// AOTInductor's loader, declared only: its headers are the definitions'
// (impl/compiled_model-inl.h), which perf::perf_static compiles once.
namespace torch::inductor {
class AOTIModelPackageLoader;
}  // namespace torch::inductor

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
  /// LibTorch's loader, for what perf does not wrap (constant swapping). With
  /// perf::perf_static, include <torch/csrc/inductor/aoti_package/model_package_loader.h> to call it.
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

// TORCH_WARN with emulated_bf16_reason() for this CPU, when there is one (a CPU package only).
PERF_INLINE void warn_if_emulated_bf16(const Package& package);

}  // namespace detail

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/compiled_model-inl.h>
#endif
