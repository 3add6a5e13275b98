// perf/detail/data_parallel.h — what perf::TrainStep and perf::CompiledTrainStep
// need of a process group for data-parallel steps (their options'
// data_parallel(pg)), declared without c10d: the definitions are perf/distributed.h's
// (impl/distributed-inl.h), which a program that has a process group includes.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <perf/config.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace perf {

/// How a data-parallel step (TrainStepOptions / CompiledTrainOptions::data_parallel)
/// shares its work, named and defaulted as Python's DistributedDataParallel.
struct DataParallelOptions {
  /// Gradients are averaged in buckets of at most this many MiB (one all-reduce
  /// each, all in flight together); a tensor as large alone (a flat optimizer's
  /// gradient buffer) is averaged where it lies, without a copy.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Rank 0's buffers (BatchNorm running statistics) are broadcast before each step.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Gradient compression: "none", "fp16" or "bf16" (float32 and float64 gradients
  /// all-reduced in half the bytes, as DDPOptions::compression).
  TORCH_ARG(std::string, compression) = "none";
};

namespace detail {
// What a data-parallel step does on the process group: defined with perf/distributed.h
// (impl/distributed-inl.h), where c10d is compiled, so that this header does not include it.
class DataParallel {
 public:
  virtual ~DataParallel() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;
  // At construction: every rank's trainable parameters checked alike (c10d's
  // check: count, shapes, strides), then rank 0's parameters and buffers
  // broadcast to every rank.
  virtual void start(torch::nn::Module& module, const char* who) const = 0;
  // Before each step: rank 0's buffers, where broadcast_buffers() asks.
  virtual void sync_buffers(torch::nn::Module& module) const = 0;
  // After the step's backward: each dense tensor replaced by its mean over the ranks.
  virtual void average(const std::vector<at::Tensor>& tensors) const = 0;
};
using DataParallelPtr = std::shared_ptr<const DataParallel>;
// Defined with perf/distributed.h, which a program that has a process group includes. A template only so that a
// translation unit that includes this header without perf/distributed.h, and never calls it, is not told an inline
// function is used but never defined; its one instance is c10d::ProcessGroup's.
template <typename Group = c10d::ProcessGroup>
DataParallelPtr make_data_parallel(const c10::intrusive_ptr<Group>& process_group, const DataParallelOptions& options);
#ifdef PERF_SEPARATE_COMPILATION
extern template DataParallelPtr make_data_parallel(const c10::intrusive_ptr<c10d::ProcessGroup>&,
                                                   const DataParallelOptions&);
#endif
}  // namespace detail

}  // namespace perf
