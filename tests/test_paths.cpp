// The build's paths, compiled into this file only: the suites' own files then
// carry no absolute path of the checkout, so that ccache's preprocessed mode
// serves a clone elsewhere from the same cache (scripts/common.sh).
#include "test_util.h"

#ifndef PERF_SOURCE_DIR
#define PERF_SOURCE_DIR ""
#endif
#ifndef PERF_TEST_PACKAGES
#define PERF_TEST_PACKAGES ""
#endif

namespace test_util {
const char* build_python() { return PERF_PYTHON; }
const char* build_source_dir() { return PERF_SOURCE_DIR; }
const char* build_test_packages() { return PERF_TEST_PACKAGES; }
const char* build_fake_nvml() { return PERF_FAKE_NVML; }
}  // namespace test_util
