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

#if defined(__SANITIZE_THREAD__)  // GCC
#define PERF_TSAN 1
#elif defined(__has_feature)  // clang
#if __has_feature(thread_sanitizer)
#define PERF_TSAN 1
#endif
#endif

#ifdef PERF_TSAN
#include <cstdlib>

// No CUDA device in the ThreadSanitizer build: CUDA's driver is not instrumented, so the
// synchronisation it does (events, stream waits) is invisible to ThreadSanitizer, and what these
// tests check is perf's own threads. They take the CPU paths, as on a machine without a GPU; the
// plain build runs the GPU tests. Set before main, so before anything starts CUDA, and inherited
// by the processes the tests start.
namespace {
[[maybe_unused]] const bool perf_tsan_hides_cuda = [] { return setenv("CUDA_VISIBLE_DEVICES", "", 1) == 0; }();
}  // namespace
#endif
