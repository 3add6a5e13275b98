// perf — configuration shared by every perf header.
//
// PERF_WITH_CUDA selects whether the CUDA parts of perf are compiled. The CMake
// target perf::perf sets it from what find_package(Torch) reports (and lets the
// user force it off with -DPERF_WITH_CUDA=OFF). A project that copies
// include/perf/ into its tree may define it itself (0 or 1); otherwise it is
// guessed from whether LibTorch's CUDA headers and the CUDA runtime headers are
// on the include path. With PERF_WITH_CUDA=1 the program must link torch_cuda
// and c10_cuda (TORCH_LIBRARIES from a CUDA LibTorch does).
#pragma once

#define PERF_VERSION_MAJOR 0
#define PERF_VERSION_MINOR 1
#define PERF_VERSION_PATCH 0
#define PERF_VERSION_STRING "0.1.0"

#ifndef PERF_WITH_CUDA
#if defined(__has_include)
#if __has_include(<c10/cuda/CUDAFunctions.h>) && __has_include(<cuda_runtime_api.h>)
#define PERF_WITH_CUDA 1
#else
#define PERF_WITH_CUDA 0
#endif
#else
#define PERF_WITH_CUDA 0
#endif
#endif

#include <torch/version.h>

#include <iosfwd>

// The floor scripts/test-matrix.sh proves (CMake's find_package(perf) checks it too).
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 11)
#error "perf needs LibTorch >= 2.11; see the README, \"Supported LibTorch versions\""
#endif

namespace perf {
/// Where perf writes progress lines and tables; nullptr = nowhere. (An alias
/// because TORCH_ARG needs a type that stays const-correct as one token.)
using OstreamPtr = std::ostream*;
}  // namespace perf
