#!/usr/bin/env bash
# Builds and runs perf's whole test suite:
#   build/        CUDA support compiled in (as LibTorch reports it): every test,
#                 the consumer projects, the per-header checks and the programs
#                 (examples, benchmarks: one translation unit, PERF_PROGRAMS_UNITY),
#                 with -D_FORTIFY_SOURCE=2 (warn_unused_result on system() & co.);
#   build-nocuda/ PERF_WITH_CUDA=OFF, under AddressSanitizer + UndefinedBehaviorSanitizer,
#                 linked to perf::perf_static (PERF_SEPARATE_COMPILATION);
#   build-tsan/   the threaded suites (prefetcher, loader, concurrent setup())
#                 under ThreadSanitizer.
# Installs what is missing first (scripts/bootstrap.sh).
source "$(dirname "$0")/common.sh"
jobs=${PERF_JOBS:-$(nproc)}

run_suite() {  # <build dir> <extra cmake args...>
  local dir=$1
  shift
  perf_configure "$dir" "$@"
  cmake --build "$dir" -j "$jobs"
  (cd "$dir" && ctest --output-on-failure -j "$jobs")
}

echo "== perf tests, CUDA support as LibTorch reports it, _FORTIFY_SOURCE=2 (as Ubuntu's g++ builds by default)"
run_suite build -DCMAKE_CXX_FLAGS=-D_FORTIFY_SOURCE=2 -DPERF_PROGRAMS_UNITY=ON
echo "== perf tests, PERF_WITH_CUDA=OFF, AddressSanitizer + UndefinedBehaviorSanitizer, perf::perf_static"
run_suite build-nocuda -DPERF_WITH_CUDA=OFF -DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF \
  -DPERF_SANITIZE=address,undefined -DPERF_TESTS_SEPARATE_COMPILATION=ON
echo "== perf threaded tests, ThreadSanitizer"
run_suite build-tsan -DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF -DPERF_SANITIZE=thread
