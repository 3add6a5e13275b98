// PERF_TEST_HIDES_CUDA: this translation unit is built under ThreadSanitizer or AddressSanitizer, whose
// test builds hide CUDA's devices (defaults.cpp says why). Shared by defaults.cpp, which hides them, and
// the test that checks it (tests/test_setup.cpp).
#pragma once

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)  // GCC
#define PERF_TEST_HIDES_CUDA 1
#elif defined(__has_feature)  // clang
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define PERF_TEST_HIDES_CUDA 1
#endif
#endif
