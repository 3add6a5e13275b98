// The build's paths, compiled into this file only: the suites' own files then
// carry no absolute path of the checkout, so that ccache's preprocessed mode
// serves a clone elsewhere from the same cache (scripts/common.sh). It is
// compiled again in every clone, so it includes no LibTorch: test_util.h declares
// these functions, and a mismatch fails the link.
#include <cstdlib>
#include <string>

#ifndef PERF_SOURCE_DIR
#define PERF_SOURCE_DIR ""
#endif
#ifndef PERF_TEST_PACKAGES
#define PERF_TEST_PACKAGES ""
#endif
#ifndef PERF_TEST_TIMEOUT_S
#define PERF_TEST_TIMEOUT_S 300
#endif

namespace test_util {
namespace {
// An environment variable, or `fallback` when unset or empty (paths baked in at
// build time that a binary run on another machine overrides).
std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}
}  // namespace
std::string reference_python() { return env_or("PERF_PYTHON", PERF_PYTHON); }
std::string source_dir() { return env_or("PERF_SOURCE_DIR", PERF_SOURCE_DIR); }
std::string test_packages() { return env_or("PERF_TEST_PACKAGES", PERF_TEST_PACKAGES); }
std::string fake_nvml_library() { return env_or("PERF_FAKE_NVML", PERF_FAKE_NVML); }
int python_timeout_s() {
  const int set = std::atoi(env_or("PERF_TEST_PYTHON_TIMEOUT", "0").c_str());
  return set > 0 ? set : PERF_TEST_TIMEOUT_S > 45 ? PERF_TEST_TIMEOUT_S - 15 : 30;
}
}  // namespace test_util
