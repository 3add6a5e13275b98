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
std::string reference_python() { return env_or("PERF_PYTHON", PERF_PYTHON); }
std::string source_dir() { return env_or("PERF_SOURCE_DIR", PERF_SOURCE_DIR); }
std::string test_packages() { return env_or("PERF_TEST_PACKAGES", PERF_TEST_PACKAGES); }
std::string fake_nvml_library() { return env_or("PERF_FAKE_NVML", PERF_FAKE_NVML); }
}  // namespace test_util
