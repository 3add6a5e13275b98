// The sanitizers' options and suppressions, compiled into the instrumented test
// binary (the runtimes call these hooks at start-up), so that they apply however
// the binary is started: ctest, by hand, or from a debugger. Options in the
// environment (ASAN_OPTIONS, TSAN_OPTIONS, ...) still override them. (Passing
// them through gtest_discover_tests' ENVIRONMENT property kept only the first
// variable: the list was split into separate properties.)
#ifndef PERF_SANITIZER_DIR
#error "PERF_SANITIZER_DIR (tests/sanitizers) must be defined"
#endif

#define PERF_SANITIZER_EXPORT extern "C" __attribute__((visibility("default"), used))

PERF_SANITIZER_EXPORT const char* __asan_default_options() { return "detect_leaks=1:halt_on_error=1"; }
PERF_SANITIZER_EXPORT const char* __lsan_default_options() {
  return "suppressions=" PERF_SANITIZER_DIR "/lsan.supp:print_suppressions=0";
}
PERF_SANITIZER_EXPORT const char* __ubsan_default_options() { return "print_stacktrace=1:halt_on_error=1"; }
PERF_SANITIZER_EXPORT const char* __tsan_default_options() {
  return "suppressions=" PERF_SANITIZER_DIR "/tsan.supp:halt_on_error=1:second_deadlock_stack=1";
}

#include "hides_cuda.h"

#ifdef PERF_TEST_HIDES_CUDA
#include <cstdlib>

// No CUDA device in the sanitizer builds, on a GPU machine as on CI's. CUDA's driver is not
// instrumented: ThreadSanitizer cannot see the synchronisation it does (events, stream waits), and
// AddressSanitizer's protected shadow gap collides with the address range the driver reserves
// (cudaGetDeviceCount then fails with cudaErrorMemoryAllocation; google/sanitizers#629), and
// LeakSanitizer reports the driver's own allocations. What these builds check is perf's own code on
// its CPU paths (the ASan one is built with PERF_WITH_CUDA=OFF); the plain build runs the GPU tests.
// Set before main, so before anything starts CUDA, and inherited by the processes the tests start.
namespace {
[[maybe_unused]] const bool perf_sanitizers_hide_cuda = [] { return setenv("CUDA_VISIBLE_DEVICES", "", 1) == 0; }();
}  // namespace
#endif
