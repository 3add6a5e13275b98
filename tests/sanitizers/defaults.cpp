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

// intercept_tls_get_addr=0: the sanitizer runtime (GCC 12's here; reported up to GCC 13 and LLVM 16) misreads a
// dynamic TLS block that malloc placed 16 bytes past a page boundary as glibc 2.19's, and LeakSanitizer's exit scan
// then crashes ("Tracer caught signal 11", google/sanitizers#1322). AOTInductor packages from LibTorch 2.13 on hold a
// thread_local (g_aoti_last_error), so every test that opens one met it at random (2.15.0: most runs).
// What goes unscanned is the TLS of libraries opened later with dlopen (the packages'); the libraries loaded at
// start-up (perf's tests, LibTorch) have static TLS, which LeakSanitizer still scans.
PERF_SANITIZER_EXPORT const char* __asan_default_options() {
  return "detect_leaks=1:halt_on_error=1:intercept_tls_get_addr=0";
}
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
