#!/usr/bin/env bash
# scripts/gpu-check.sh --part tests as a lent GPU machine runs it, here on the CPU with a stand-in build: a
# CTestTestfile.cmake of two tests, one whose Python waits for a subprocess and then computes, for longer than
# PERF_GPU_SLOW_TEST_S (2 s here, 60 by default). The summary lists it among the slow tests, with where its Python
# spent the time from tests/python_sampler's samples, and tests.tar.gz keeps those samples; its torch is a stand-in
# with bytecode (whatever the machine's torch is). Then twice more with a stand-in torch that has no bytecode and
# where Python may not write it: gpu-check keeps it in its build folder.
#   tests/gpu_check_tests_check.sh <repo root> <python>
set -uo pipefail
root=$1 python=$2
source "$(dirname "$0")/check.sh"  # $work, check, $fails
source "$(dirname "$0")/gpu_standins.sh"  # nvidia-smi, $work/bin/python, $work/build

cat >"$work/slow.py" <<'PY'
import subprocess, time
subprocess.run(['sleep', '3'])
def busy_here():
    start = time.monotonic()
    while time.monotonic() - start < 3:
        pass
busy_here()
PY
cat >"$work/build/CTestTestfile.cmake" <<EOF
add_test(slow_python "$python" "$work/slow.py")
add_test(quick_one "true")
EOF
# Run inside gpu-check on a GPU machine, this inherits the outer call's PYTHONPYCACHEPREFIX: gpu-check's calls
# here must find their own case.
unset PYTHONPYCACHEPREFIX
# Stand-in torches (a package of gpu-check's three probed sources), here one with its bytecode (the machine's
# torch may have none).
standin_torch() {  # <folder>
  mkdir -p "$1/torch/_inductor"
  touch "$1/torch/__init__.py" "$1/torch/_tensor.py" "$1/torch/_inductor/__init__.py" "$1/torch/_inductor/codecache.py"
}
standin_torch "$work/site-cached"
"$python" -m compileall -q "$work/site-cached" >/dev/null
cd "$root" || exit 1
PYTHONPATH="$work/site-cached" PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" \
  PERF_GPU_BUILD="$work/build" PERF_GPU_RESULTS="$work/out" PERF_GPU_SLOW_TEST_S=2 PERF_GPU_BUDGET_S=400 \
  bash scripts/gpu-check.sh --part tests >"$work/stdout" 2>&1
summary=$(cat "$work/out/tests-summary.txt" 2>/dev/null)
mkdir -p "$work/tar" && tar xzf "$work/out/tests.tar.gz" -C "$work/tar" 2>/dev/null
# CMake 3 ends with "100% tests passed, 0 tests failed out of 2", CMake 4 (pip's, on the GPU machine) without the 0.
check "ctest ran both tests" grep -qE "100% tests passed(, 0 tests failed)? out of 2" "$work/tar/tests/ctest.log"
check "the summary lists the slow test, and only it" \
  test "$(sed -n '/^tests over 2 s:/,/^  where/p' <<<"$summary" | grep -c "ctest .*Test")" = 1 -a \
  -n "$(grep -E "^  ctest .*slow_python .*Passed" <<<"$summary")"
line=$(grep -E "^    slow_python: 1 Python\(s\), [0-9]+ samples" <<<"$summary")
check "its Python's time: waiting for the subprocess in the script, then computing in busy_here" \
  test -n "$(grep "waiting for a subprocess (.*slow.py:<module>" <<<"$line")" -a \
  -n "$(grep "running Python (.*slow.py:busy_here" <<<"$line")"
t="[0-9]+\.[0-9] s"
check "the summary says what a new Python's import torch takes, twice, then with CUDA (the stand-in's fails)" \
  grep -qE "^import torch in a new Python, before the tests \(.*\): $t, $t, $t \(failed\)$" <<<"$summary"
check "tests.tar.gz keeps its samples, in a folder named by the test" \
  test "$(ls "$work/tar/tests/python-samples/slow_python" 2>/dev/null | wc -l)" = 1
check "the summary says the venv holds torch's bytecode" grep -qx "torch's bytecode: in the venv" <<<"$summary"

# --part gpu-tests: the GPU tests in one process alone, ctest not run (a stand-in perf_tests that passes one test).
cat >"$work/build/tests/perf_tests" <<'EOF'
#!/bin/sh
echo "[ RUN      ] Stand.OnGpuIn"
echo "[       OK ] Stand.OnGpuIn (5 ms)"
EOF
PYTHONPATH="$work/site-cached" PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" \
  PERF_GPU_BUILD="$work/build" PERF_GPU_RESULTS="$work/out-gpu" PERF_GPU_BUDGET_S=400 \
  bash scripts/gpu-check.sh --part gpu-tests >>"$work/stdout" 2>&1
rc=$?
summary=$(cat "$work/out-gpu/gpu-tests-summary.txt" 2>/dev/null)
check "--part gpu-tests passes (rc $rc)" test "$rc" = 0
check "its summary says ctest did not run" grep -qxF "ctest: not run (--part gpu-tests: the GPU tests alone)" \
  <<<"$summary"
check "and counts the one-process run's test" grep -qxF \
  "one process (every *OnGpu* test, 1 process(es)): 1 ok, 0 failed, 0 skipped" <<<"$summary"
check "gpu-tests.tar.gz has the one-process log and no ctest log" test \
  "$(tar -tzf "$work/out-gpu/gpu-tests.tar.gz" 2>/dev/null | grep -cE "/(gpu-tests-one-process|ctest)\.log$")-$(
    tar -tzf "$work/out-gpu/gpu-tests.tar.gz" 2>/dev/null | grep -c "/ctest\.log$")" = 1-0
PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" PERF_GPU_BUILD="$work/build" PERF_GPU_RESULTS="$work/out-both" \
  bash scripts/gpu-check.sh --part tests,gpu-tests >"$work/both" 2>&1
rc=$?
check "tests and gpu-tests together are refused (rc $rc), saying why" test "$rc" = 2 -a \
  "$(cat "$work/both")" = "gpu-check: --part tests runs the GPU tests already: give tests or gpu-tests, not both"

# Again with a torch without bytecode that Python may not write: into folders that cannot take it (a
# __pycache__ that is a file: root writes past a read-only mode, not past that), or under
# PYTHONDONTWRITEBYTECODE. The bytecode then goes to the build folder, written by the first Python. The slow
# test is not needed for that (6 s a call).
echo 'add_test(quick_one "true")' >"$work/build/CTestTestfile.cmake"
for how in read-only PYTHONDONTWRITEBYTECODE; do
  fake=$work/site-$how
  standin_torch "$fake"
  if [[ $how == read-only ]]; then
    touch "$fake/torch/__pycache__" "$fake/torch/_inductor/__pycache__"
    why="which is read-only" set_env=(-u PYTHONDONTWRITEBYTECODE)
  else
    why="and PYTHONDONTWRITEBYTECODE is set" set_env=(PYTHONDONTWRITEBYTECODE=1)
  fi
  rm -rf "$work/build/gpu-work/pycache"
  env "${set_env[@]}" PYTHONPATH="$fake" PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" \
    PERF_GPU_BUILD="$work/build" PERF_GPU_RESULTS="$work/out-$how" PERF_GPU_SLOW_TEST_S=100 PERF_GPU_BUDGET_S=400 \
    bash scripts/gpu-check.sh --part tests >>"$work/stdout" 2>&1
  summary=$(cat "$work/out-$how/tests-summary.txt" 2>/dev/null)
  check "$how: the summary says the bytecode goes to the build folder" grep -qx \
    "torch's bytecode: not in the venv, $why: kept in PYTHONPYCACHEPREFIX=$work/build/gpu-work/pycache" <<<"$summary"
  check "$how: and the first Python wrote torch's there" \
    test -n "$(find "$work/build/gpu-work/pycache" -path "*/torch/__init__.*.pyc" 2>/dev/null)"
done
finish_check "gpu-check --part tests on the CPU"
