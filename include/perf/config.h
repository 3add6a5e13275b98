// perf — configuration shared by every perf header.
//
// PERF_WITH_CUDA selects whether the CUDA parts of perf are compiled. The CMake
// target perf::perf sets it from what find_package(Torch) reports (and lets the
// user force it off with -DPERF_WITH_CUDA=OFF). A project that copies
// include/perf/ into its tree may define it itself (0 or 1); otherwise it is
// guessed from whether LibTorch's CUDA headers and the CUDA runtime headers are
// on the include path. With PERF_WITH_CUDA=1 the program must link torch_cuda
// and c10_cuda (TORCH_LIBRARIES from a CUDA LibTorch does).
//
// PERF_SEPARATE_COMPILATION: perf is header-only by default. Defined (the CMake
// target perf::perf_static does it), each header declares its non-template
// functions and src/perf.cpp compiles their definitions (perf/impl/*-inl.h)
// once into a static library, so a translation unit that includes perf parses
// less (docs/compile-time.md). Every translation unit of a program must agree.
#pragma once

#ifdef PERF_SEPARATE_COMPILATION
#define PERF_INLINE
#else
#define PERF_HEADER_ONLY
#define PERF_INLINE inline
#endif

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

#if defined(PERF_SEPARATE_COMPILATION) && defined(PERF_STATIC_WITH_CUDA) && PERF_STATIC_WITH_CUDA != PERF_WITH_CUDA
#error "perf::perf_static was built with another PERF_WITH_CUDA: rebuild it with this one, or link perf::perf"
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
