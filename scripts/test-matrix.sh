#!/usr/bin/env bash
# Builds and runs perf's whole test suite against several LibTorch versions,
# each from its PyPI torch wheel in its own venv (~/.cache/perf/venv-torch-X),
# and prints a table. Versions below perf's floor (cmake/perfTorch.cmake) must
# be refused by CMake with the floor message; that counts as the expected
# result for them.
#
#   bash scripts/test-matrix.sh [--cuda | --asan | --tsan] [version...]     default: 2.11.0
#
# The suite is built with PERF_WITH_CUDA=OFF (a CPU build, in build-matrix/X)
# so that a wheel whose CUDA differs from the local toolkit still builds; the
# CUDA build of the supported version is what scripts/test.sh (CI) runs.
# --cuda builds as CI's CUDA suite does instead (PERF_WITH_CUDA=ON, examples
# and benchmarks as one translation unit, in build-matrix/X-cuda) and runs its
# tests: on a machine without a GPU that checks that perf's CUDA code compiles
# and links against that LibTorch and that the CPU tests pass there (the GPU
# tests skip). --asan builds as CI's sanitizer suite does (the CPU build under
# AddressSanitizer + UndefinedBehaviorSanitizer, linked to perf::perf_static,
# in build-matrix/X-asan), --tsan its ThreadSanitizer build of the threaded
# suites (in build-matrix/X-tsan).
set -uo pipefail
cd "$(dirname "$0")/.."
variant=cpu
case ${1:-} in
  --cuda | --asan | --tsan) variant=${1#--}; shift ;;
  --*) echo "test-matrix.sh: unknown option $1 (valid: --cuda, --asan, --tsan, then versions)" >&2; exit 2 ;;
esac
versions=("$@")
((${#versions[@]})) || versions=(2.11.0)
floor=$(sed -n 's/^set(PERF_MIN_TORCH_VERSION \([0-9.]*\)).*/\1/p' cmake/perfTorch.cmake)
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/perf/ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
results=()
for v in "${versions[@]}"; do
  echo "== LibTorch $v"
  dir=build-matrix/$v log=build-matrix/$v.log label=$v
  build_args=(-DPERF_WITH_CUDA=OFF -DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF)
  case $variant in
    cuda)
      dir=build-matrix/$v-cuda log=build-matrix/$v-cuda.log label="$v (CUDA build)"
      build_args=(-DPERF_WITH_CUDA=ON -DPERF_BUILD_EXAMPLES=ON -DPERF_BUILD_BENCH=ON -DPERF_PROGRAMS_UNITY=ON) ;;
    asan)  # as scripts/test.sh's asan suite
      dir=build-matrix/$v-asan log=build-matrix/$v-asan.log label="$v (ASan + UBSan build)"
      build_args+=(-DPERF_SANITIZE=address,undefined -DPERF_TESTS_SEPARATE_COMPILATION=ON
                   -DCMAKE_CXX_FLAGS=-D_GLIBCXX_ASSERTIONS) ;;
    tsan)  # as scripts/test.sh's tsan suite: CUDA as LibTorch reports it
      dir=build-matrix/$v-tsan log=build-matrix/$v-tsan.log label="$v (TSan build)"
      build_args=(-DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF -DPERF_SANITIZE=thread) ;;
  esac
  mkdir -p build-matrix
  if ! prefix=$(PERF_TORCH_VERSION=$v bash scripts/bootstrap.sh 2>"$log" | tail -n 1) || [ -z "$prefix" ]; then
    results+=("| $label | install failed (see $log) |")
    continue
  fi
  # The linker resolves libtorch_cuda's own dependencies (NCCL, cuDNN, ...) in the -rpath folders first, where
  # /usr/local/cuda/lib (which LibTorch's CMake adds) may hold an older NCCL than the wheel's: 2.15.0's libtorch_cuda
  # then fails to link ("undefined reference to ncclCommGrow"). The wheel's own libraries come first.
  wheel_libs=$(compgen -G "$prefix/../../../nvidia/*/lib" | paste -sd: -)
  if ! cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_CXX_COMPILER_LAUNCHER=ccache "${build_args[@]}" \
      ${wheel_libs:+"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$wheel_libs"} >>"$log" 2>&1; then
    if grep -q "perf needs LibTorch >= $floor" "$log"; then
      results+=("| $label | refused by CMake (below the floor $floor), as expected |")
    else
      results+=("| $label | configure FAILED (see $log) |")
    fi
    continue
  fi
  if ! cmake --build "$dir" -j "$(nproc)" >>"$log" 2>&1; then
    results+=("| $label | build FAILED (see $log) |")
    continue
  fi
  if (cd "$dir" && ctest -j "$(nproc)" --output-on-failure >>"../../$log" 2>&1); then
    summary=$(grep -E "tests passed" "$log" | tail -n 1)
    results+=("| $label | $summary |")
  else
    results+=("| $label | tests FAILED: $(grep -E 'tests passed' "$log" | tail -n 1) (see $log) |")
  fi
done
echo
echo "| LibTorch | result |"
echo "| --- | --- |"
printf '%s\n' "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q "FAILED\|install failed"
