// perf/detail/ddp_registry.h — which parameters a perf::DistributedDataParallel
// synchronises, so that perf::TrainStep can refuse them. Internal to perf.
#pragma once

#include <ATen/core/Tensor.h>

#include <mutex>
#include <unordered_map>

namespace perf::detail {

inline std::mutex& ddp_registry_mutex() {
  static std::mutex m;
  return m;
}

// TensorImpl* -> number of live DDP wrappers holding it.
inline std::unordered_map<const void*, int>& ddp_registry() {
  static std::unordered_map<const void*, int> r;
  return r;
}

inline void ddp_register(const std::vector<at::Tensor>& params, int delta) {
  std::lock_guard<std::mutex> lock(ddp_registry_mutex());
  for (const auto& p : params) {
    auto& n = ddp_registry()[p.unsafeGetTensorImpl()];
    n += delta;
    if (n <= 0) ddp_registry().erase(p.unsafeGetTensorImpl());
  }
}

inline bool ddp_owns(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(ddp_registry_mutex());
  return ddp_registry().count(p.unsafeGetTensorImpl()) > 0;
}

}  // namespace perf::detail
