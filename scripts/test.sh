#!/usr/bin/env bash
# Builds and runs perf's whole test suite: once with CUDA support compiled in
# (as LibTorch reports it), once with PERF_WITH_CUDA=OFF. Installs what is
# missing first (scripts/bootstrap.sh). Build trees: build/ and build-nocuda/.
source "$(dirname "$0")/common.sh"
jobs=${PERF_JOBS:-$(nproc)}

run_suite() {  # <build dir> <extra cmake args...>
  local dir=$1
  shift
  perf_configure "$dir" "$@"
  cmake --build "$dir" -j "$jobs"
  (cd "$dir" && ctest --output-on-failure -j "$jobs")
}

echo "== perf tests, CUDA support as LibTorch reports it"
run_suite build
echo "== perf tests, PERF_WITH_CUDA=OFF"
run_suite build-nocuda -DPERF_WITH_CUDA=OFF -DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF
