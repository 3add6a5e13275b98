#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: builds perf with all cores,
# runs the whole test suite (each test in its own process, then every GPU test
# together in ONE process), every benchmark with --device cuda and the Python
# peers, and writes gpu-results/ with a one-screen summary at the end.
#
# Offline by design: never runs apt or pip.
#   LibTorch   from PERF_PYTHON's torch (default python3), or Torch_DIR.
#   GoogleTest, CLI11, Google Benchmark: installed CMake packages, or the folder
#              PERF_DEPS_DIR prepared on a connected machine by
#              `bash scripts/gpu-deps.sh DIR` (then copied here).
#
#   bash scripts/gpu-check.sh               # build, tests, benchmarks (~10 min on 16 cores)
#   bash scripts/gpu-check.sh --quick       # shorter benchmark runs
#   bash scripts/gpu-check.sh --build-only  # the offline build alone (works without a GPU)
#   bash scripts/gpu-check.sh --e2e         # also bench/e2e (Python vs C++ training jobs; +10-20 min)
# PERF_CMAKE_ARGS adds CMake arguments; PERF_GPU_BUILD / PERF_GPU_RESULTS name the
# build and results folders (build-gpu/, gpu-results/).
set -uo pipefail
cd "$(dirname "$0")/.."
quick=0 build_only=0 e2e=0
for a in "$@"; do
  case $a in
    --quick) quick=1 ;;
    --build-only) build_only=1 ;;
    --e2e) e2e=1 ;;
    *) echo "gpu-check: unknown argument $a (valid: --quick, --build-only, --e2e)" >&2; exit 2 ;;
  esac
done
py=${PERF_PYTHON:-python3}
out=${PERF_GPU_RESULTS:-gpu-results}
build=${PERF_GPU_BUILD:-build-gpu}
fail() { echo "gpu-check: $*" >&2; exit 2; }

# 1. A GPU, unless only the build is asked for.
if ((!build_only)); then
  command -v nvidia-smi >/dev/null || fail "refusing: nvidia-smi not found, this is not a machine with an NVIDIA GPU (use --build-only to check the build alone)"
  nvidia-smi -L >/dev/null 2>&1 || fail "refusing: nvidia-smi sees no GPU (driver missing or no device); use --build-only to check the build alone"
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null ||
    fail "refusing: $py's torch cannot use the GPU (torch.cuda.is_available() is False)"
fi

# 2. LibTorch and the test/bench dependencies, offline.
if [ -n "${Torch_DIR:-}" ]; then
  prefix_args=(-DTorch_DIR="$Torch_DIR")
else
  prefix=$("$py" -c "import torch; print(torch.utils.cmake_prefix_path)" 2>/dev/null) ||
    fail "no LibTorch: $py cannot import torch; set PERF_PYTHON to a Python with torch, or Torch_DIR"
  prefix_args=(-DCMAKE_PREFIX_PATH="$prefix" -DPERF_PYTHON="$(command -v "$py")")
fi
deps_args=()
have_gtest=0
if [ -n "${PERF_DEPS_DIR:-}" ]; then
  [ -f "$PERF_DEPS_DIR/googletest/CMakeLists.txt" ] || fail "PERF_DEPS_DIR=$PERF_DEPS_DIR has no googletest/CMakeLists.txt"
  deps_args=(-DPERF_DEPS_DIR="$(cd "$PERF_DEPS_DIR" && pwd)")
  have_gtest=1
elif [ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || [ -f /usr/local/lib/cmake/GTest/GTestConfig.cmake ] ||
     [ -f /usr/lib/cmake/GTest/GTestConfig.cmake ]; then
  have_gtest=1
fi
((have_gtest)) || fail "GoogleTest not found and PERF_DEPS_DIR not set. On a connected Debian/Ubuntu machine run
    bash scripts/gpu-deps.sh perf-deps
copy perf-deps/ here, and run: PERF_DEPS_DIR=perf-deps bash scripts/gpu-check.sh"

mkdir -p "$out"
jobs=$(nproc)
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
echo "== configure and build ($jobs jobs) -> $build"
# shellcheck disable=SC2086  # PERF_CMAKE_ARGS: extra arguments, split on spaces
cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${prefix_args[@]}" "${deps_args[@]}" ${PERF_CMAKE_ARGS:-} \
  >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; fail "configure failed ($out/configure.log)"; }
cmake --build "$build" -j "$jobs" >"$out/build.log" 2>&1 || { grep -E "error|Error" "$out/build.log" | head -30; fail "build failed ($out/build.log)"; }
echo "   built"
if ((build_only)); then
  echo "gpu-check: --build-only: build done in $build (tests and benchmarks need a GPU)"
  exit 0
fi

# 3. Machine and environment.
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
"$build/examples/doctor" >"$out/environment.txt" 2>&1
status=0

# 4. Tests: one process per test, then every GPU test in one process.
echo "== tests (ctest, one process per test)"
(cd "$build" && ctest -j "$jobs" --output-on-failure --timeout 600) >"$out/ctest.log" 2>&1 || status=1
tail -3 "$out/ctest.log"
echo "== GPU tests in one process"
"$build/tests/perf_tests" --gtest_filter='*OnGpu*' >"$out/gpu-tests-one-process.log" 2>&1 || status=1
tail -3 "$out/gpu-tests-one-process.log"

# 5. Benchmarks with --device cuda, then the Python peers.
if ((quick)); then
  opt=(--iters 30); amp=(--iters 5); data=(--samples 2048 --epochs 2 --gpu-batches 32); graph=(--iters 100)
else
  opt=(); amp=(); data=(); graph=()
fi
run_bench() {  # name args...
  local name=$1; shift
  echo "== $name $*"
  if [ -x "$build/bench/$name" ]; then
    "$build/bench/$name" "$@" >"$out/$name.txt" 2>&1 || { echo "   FAILED (see $out/$name.txt)"; status=1; }
  else
    echo "   not built" | tee "$out/$name.txt"
  fi
}
run_bench bench_setup --benchmark_min_time=0.05
run_bench bench_optim --device cuda "${opt[@]}"
run_bench bench_amp --device cuda "${amp[@]}"
run_bench bench_data --device cuda "${data[@]}"
run_bench bench_graph "${graph[@]}"
# AOTInductor packages of bench/resnet.py, compiled here for this GPU (about 80 s each).
variants=(fp32 bf16_nhwc); ((quick)) && variants=(fp32)
packages=()
for variant in "${variants[@]}"; do
  pkg=$out/resnet_cuda_$variant.pt2
  extra=(); [[ $variant == bf16_nhwc ]] && extra=(--dtype bfloat16 --channels-last)
  "$py" tools/export_compiled.py bench/resnet.py:make_resnet -o "$pkg" --input 8,3,64,64 --dynamic-batch 1:64 \
    --device cuda "${extra[@]}" >"$out/export_$variant.log" 2>&1 && packages+=(--package "$pkg") ||
    { echo "   export $variant FAILED (see $out/export_$variant.log)"; status=1; }
done
((${#packages[@]})) && run_bench bench_compiled --device cuda "${packages[@]}"
rm -f "$out"/resnet_cuda_*.pt2
# DDP's own overhead on one GPU: NCCL at world size 1.
RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${PERF_DDP_PORT:-29581} \
  run_bench bench_ddp --device cuda --width 64 --batch 64 --image 64
if ((e2e)); then
  echo "== bench/e2e (Python vs C++ training jobs on the GPU)"
  e2e_args=(); ((quick)) && e2e_args=(--quick)
  "$py" bench/e2e/run.py --e2e "$build/bench/e2e" --device cuda --out "$out/e2e" "${e2e_args[@]}" >"$out/e2e.txt" 2>&1 ||
    { echo "   FAILED (see $out/e2e.txt)"; status=1; }
  # The report needs matplotlib; without it, results.jsonl is there for report.py elsewhere.
  "$py" bench/e2e/report.py "$out/e2e/results.jsonl" --docs "$out/e2e" --name e2e-cuda >>"$out/e2e.txt" 2>&1 ||
    echo "   (no report: matplotlib missing? run bench/e2e/report.py on $out/e2e/results.jsonl elsewhere)"
fi
for peer in bench/peer_*.py; do
  name=$(basename "$peer" .py)
  echo "== $name"
  PYTHONUNBUFFERED=1 "$py" "$peer" >"$out/$name.txt" 2>&1 || { echo "   FAILED (see $out/$name.txt)"; status=1; }
done

# 6. Summary.
{
  echo "== gpu-check summary ($(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
  head -n 1 "$out/environment.txt"
  grep -m1 -E "cuda:0" "$out/environment.txt" || true
  echo "-- tests"
  grep -E "tests passed|tests failed" "$out/ctest.log" || echo "ctest: no summary (see ctest.log)"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$out/gpu-tests-one-process.log" | sort | uniq -c || true
  grep -E "^\s+[0-9]+ - .*\(Failed\)|\[  FAILED  \] [A-Za-z]" "$out/ctest.log" "$out/gpu-tests-one-process.log" | head -20 || true
  echo "-- headline ratios (B vs A: how many times faster B is)"
  grep -hE " vs .*: [0-9.]+x \(ratio of medians" "$out"/bench_*.txt || true
  grep -hE "x \(|ratio|speedup" "$out"/peer_*.txt 2>/dev/null | head -10 || true
} | tee "$out/summary.txt"
exit $status
