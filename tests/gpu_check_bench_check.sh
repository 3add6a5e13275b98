#!/usr/bin/env bash
# scripts/gpu-check.sh --part bench --bench optim as a lent GPU machine runs it, here on the CPU: the stand-ins
# of tests/gpu_standins.sh, bench_optim and bench/peer_optim.py each run on the CPU for two timed steps
# (gpu-check's --device cuda and --iters replaced). Its summary has the flat-optimizer goals judged from the run's
# rows, and bench.tar.gz keeps the run (runs/optim-cuda-*.jsonl) with the machine and the call's command.
# Then --bench compiled with a stand-in bench_compiled that fails with an error (not a signal) while the packages'
# graphs are in its run: gpu-check runs it again without them, as it does after a crash.
#   tests/gpu_check_bench_check.sh <repo root> <python> <build/bench/bench_optim>
set -uo pipefail
root=$1 python=$2 bench_optim=$3
source "$(dirname "$0")/check.sh"  # $work, check, $fails
source "$(dirname "$0")/gpu_standins.sh"  # nvidia-smi, $work/bin/python, $work/build

# A stand-in CMake that builds nothing: each call's arguments in $work/cmake-calls, a target list for `--target
# help` as Ninja's build writes it, and a build step's line for a build. With a CMakeCache.txt the build folder is
# CMake's: a part without the build part in its call builds first what it runs.
cat >"$work/bin/cmake" <<EOF
#!/usr/bin/env bash
echo "\$*" >>"$work/cmake-calls"
if [[ " \$* " == *" --target help "* ]]; then
  printf '%s: phony\n' bench_optim bench_compiled bench_graph doctor e2e perf_tests "$work/build/CMakeFiles/perf_test_packages"
elif [[ \$1 == --build ]]; then
  echo "[1/1] Linking CXX executable stand-in"
fi
EOF
chmod +x "$work/bin/cmake"
touch "$work/build/CMakeCache.txt"
# The builds a call ran (its `cmake --build` calls but the target lists), one a line; the list emptied.
builds() {
  grep "^--build " "$work/cmake-calls" 2>/dev/null | grep -v -- "--target help" | sed "s|$work|\$work|; s| -j [0-9]*| -j N|"
  rm -f "$work/cmake-calls"
}

# Both on the CPU, briefly: of the options gpu-check gives, --json alone is kept.
cpu_args='json=
while [ $# -gt 0 ]; do
  case $1 in --json) json=$2; shift 2 ;; --device | --iters | --warmup) shift 2 ;; *) shift ;; esac
done'
cat >"$work/build/bench/bench_optim" <<EOF
#!/usr/bin/env bash
$cpu_args
exec "$bench_optim" --device cpu --iters 2 --warmup 0 --json "\$json"
EOF
# --bench compiled (the second call): the exports and the Python peer write stand-in files and rows.
mv "$work/bin/python" "$work/bin/python-standin"
cat >"$work/bin/python" <<EOF
#!/usr/bin/env bash
if [[ \${1:-} == bench/peer_optim.py ]]; then
  $cpu_args
  exec "$python" bench/peer_optim.py --device cpu --iters 2 --warmup 0 --json "\$json"
fi
# bench/e2e's training packages, which a build part exports beside the compilation where its call runs them.
if [[ \${1:-} == bench/e2e/run.py ]]; then
  echo "e2e export \${*:2}" >>"$work/starts"
  exit 0
fi
if [[ \${1:-} == tools/export_compiled.py ]]; then
  while [ \$# -gt 0 ]; do
    [ "\$1" = -o ] && { echo stand-in >"\$2"; echo "\$2" >>"$work/exported"; echo "export \$(basename "\$2")" >>"$work/starts"; exit 0; }
    shift
  done
  exit 1
fi
# The peer's warm-up (--compile-only, which gpu-check starts beside the exports): a line in the order file when it
# ends. Its max-autotune leaves timings in Inductor's cache folder (two files gpu-check carries, one it does not)
# and goes on for 5 s after its line at batch 1, which the max-autotune export waits for ($work/starts).
if [[ \${1:-} == bench/peer_compiled.py && " \$* " == *" --compile-only "* ]]; then
  sleep 1
  echo "torch.compile default, batch 1: compiled in 9 s"
  if [[ " \$* " != *" --no-max-autotune "* ]]; then
    mkdir -p "\$TORCHINDUCTOR_CACHE_DIR/cache" "\$TORCHINDUCTOR_CACHE_DIR/ab" "\$TORCHINDUCTOR_CACHE_DIR/fxgraph"
    echo measured >"\$TORCHINDUCTOR_CACHE_DIR/cache/warm-up"
    echo measured >"\$TORCHINDUCTOR_CACHE_DIR/ab/kernel.best_config"
    echo compiled >"\$TORCHINDUCTOR_CACHE_DIR/fxgraph/graph"
    echo "torch.compile max-autotune, batch 1: compiled in 99 s"
    echo "warm-up: max-autotune at batch 1" >>"$work/starts"
    sleep 5
  fi
  echo "warm-up \${*:2}" >>"$work/order"
  echo "warm-up: ended" >>"$work/starts"
  exit 0
fi
if [[ \${1:-} == bench/peer_compiled.py ]]; then
  $cpu_args
  echo '{"lang": "python", "config": "Python eager fp32", "device": "cuda", "batch": 1, "median_ms": 2.0}' >>"\$json"
  exit 0
fi
exec "$work/bin/python-standin" "\$@"
EOF
# bench_compiled: with the packages' graphs it writes a row and then fails as bench/program.h ends a program on
# an error (exit 1, the message last); without them (gpu-check's retry) it writes its rows and succeeds.
cat >"$work/build/bench/bench_compiled" <<'EOF'
#!/usr/bin/env bash
echo bench_compiled >>@ORDER@
json= graphs=1 traces=
while [ $# -gt 0 ]; do
  case $1 in
    --json) json=$2; shift 2 ;; --profile-traces) traces=$2; shift 2 ;; --no-package-graphs) graphs=0; shift ;;
    *) shift ;;
  esac
done
row() { echo "{\"lang\": \"cpp\", \"config\": \"C++ $1\", \"device\": \"cuda\", \"batch\": 1, \"median_ms\": $2}" >>"$json"; }
# A profiled call's trace (--profile-traces): one call of 40 us on the host, its kernel 10 us in, for 250 us; in
# the retry also the recipe pinned, the same kernel 20 us later.
mkdir -p "$traces"
trace() {  # <file> <row> <kernel's start>
  cat >"$traces/$1" <<JSON
{"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "call: $2", "ts": 100, "dur": 40},
  {"ph": "X", "cat": "kernel", "name": "stand-in kernel", "ts": $3, "dur": 250}]}
JSON
}
if ((graphs)); then
  trace profile-b1-1.json "perf::optimize(example) at batch 1 (failed attempt)" 110
else
  trace profile-b1-0.json "perf::optimize(example) at batch 1" 110
  trace profile-b1-2.json "perf::optimize(recipe pinned: stand-in recipe) at batch 1" 130
fi
row "eager fp32" 1.0
if ((graphs)); then
  row "perf::graph(package fp32 (batch 1))" 0.25
  echo "bench_compiled: stand-in failure in a package's graph" >&2
  exit 1
fi
row "package fp32 (batch 1)" 0.5
echo "launch check of perf::optimize(example) at batch 1: the call returns after 30.0 us on the host with the device \
idle, 31.0 us right behind its own previous call (median of 21; its table median 250.0 us)"
echo "order check of perf::optimize(example) at batch 1: 0.250 ms in the table, 0.270 ms timed in the reverse order, \
0.250 ms each behind eager fp32"
echo "profile of perf::optimize(example) at batch 1: 61.0 cuda operations a call, 250.5 us of their time a call (10 calls)"
echo "    40.00 us    1.0x  stand-in kernel"
EOF
sed -i "s|@ORDER@|$work/order|" "$work/build/bench/bench_compiled"
chmod +x "$work/build/bench/bench_optim" "$work/build/bench/bench_compiled" "$work/bin/python"

(cd "$root" && PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" PERF_GPU_BUILD="$work/build" \
  PERF_GPU_RESULTS="$work/out" PERF_GPU_BUDGET_S=200 bash scripts/gpu-check.sh --part bench --bench optim --quick \
  >"$work/stdout" 2>&1)
rc=$?
mkdir -p "$work/tar" && tar xzf "$work/out/bench.tar.gz" -C "$work/tar" 2>/dev/null
summary=$(cat "$work/out/bench-summary.txt" 2>/dev/null)
check "gpu-check's bench part passes (rc $rc)" test "$rc" = 0
check "its summary has the copy bandwidth" grep -q "^copy bandwidth (1 GiB copy_, read+write): " <<<"$summary"
goal='^- perf (AdamW|Adam|SGD) \(flat\): [0-9.]+x perf .* \(goal >?=? ?1\.0x: (met|not met)\)$'
check "and the flat-optimizer goals, judged (four on these CPU rows)" test "$(grep -cE "$goal" <<<"$summary")" = 4
check_kept bench optim-cuda 'PERF_GPU_BUDGET_S=200 bash scripts/gpu-check.sh --part bench --bench optim --quick'
check "the part built bench_optim first, and nothing else" test "$(builds)" = "--build \$work/build -j N --target bench_optim"
# The seconds are wall time across the stand-in build: 0, or 1 where it straddles a second (a busy machine).
check "and its summary says so" grep -qxE "built for this part first: bench_optim \(1 build steps, [0-9]+ s\)" <<<"$summary"
check "the kept run has bench_optim's rows and the peer's" "$python" -c '
import json, sys
sys.exit(0 if {json.loads(line)["lang"] for line in open(sys.argv[1])} == {"cpp", "python"} else 1)' "${kept:-/dev/null}"

# bench_compiled failing with an error, not a signal: run again without the packages' graphs, the failed
# attempt's rows dropped, and the summary says why with the program's last line.
rm -rf "$work/out" "$work/tar"
(cd "$root" && PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" PERF_GPU_BUILD="$work/build" \
  PERF_GPU_RESULTS="$work/out" PERF_GPU_BUDGET_S=200 bash scripts/gpu-check.sh --part bench --bench compiled --quick \
  >>"$work/stdout" 2>&1)
rc=$?
mkdir -p "$work/tar" && tar xzf "$work/out/bench.tar.gz" -C "$work/tar" 2>/dev/null
summary=$(cat "$work/out/bench-summary.txt" 2>/dev/null)
check "with bench_compiled failing, the bench part fails (rc $rc)" test "$rc" != 0
check "its summary says how bench_compiled failed and that it ran again" grep -qF "bench_compiled failed (exit 1: \
bench_compiled: stand-in failure in a package's graph) (log: bench_compiled-died.txt); again with --no-package-graphs" \
  <<<"$summary"
check "and the profiled rows' kernels a call, one line each" test "$(grep -c "^profile of perf::optimize(example) at \
batch 1: 61.0 cuda operations a call" <<<"$summary")" = 1
check "and the launch and order checks of the same rows" test "$(grep -cE "^(launch|order) check of \
perf::optimize\(example\) at batch 1: " <<<"$summary")" = 2
check "and where their calls' time went, from the retry's traces alone" test \
  "$(grep "^calls of perf::optimize(example) at batch 1" <<<"$summary")" = "calls of perf::optimize(example) at batch \
1: 260.0 us a call (median of 1): the device starts 10.0 us in (the call takes 40.0 us on the host), then spans \
250.0 us, busy 250.0 us, idle 0.0 us between 1 operation; widest gaps: none"
check "and the pinned recipe's calls against the decision's, operation by operation" test \
  "$(grep -A2 "^diff of " <<<"$summary")" = "diff of perf::optimize(recipe pinned: stand-in recipe) at batch 1 (280.0 \
us a call) against perf::optimize(example) at batch 1 (260.0 us): +20.0 us; the device's start +20.0 us, busy +0.0 \
us, idle +0.0 us; 1 against 1 operations
the same operations in the same order, with the same grids and blocks
gaps that grew the most: +20.0 us before #0 stand-in kernel"
check "bench.tar.gz has the retry's traces, not the failed attempt's" test \
  "$(tar -tzf "$work/out/bench.tar.gz" 2>/dev/null | grep "/profile-traces/." | sort | tr '\n' ' ')" \
  = "bench/profile-traces/profile-b1-0.json bench/profile-traces/profile-b1-2.json "
check_kept bench compiled-cuda 'PERF_GPU_BUDGET_S=200 bash scripts/gpu-check.sh --part bench --bench compiled --quick'
check "the kept run has the retry's rows and the peer's, not the failed attempt's" "$python" -c '
import json, sys
configs = sorted(json.loads(line)["config"] for line in open(sys.argv[1]))
sys.exit(0 if configs == ["C++ eager fp32", "C++ package fp32 (batch 1)", "Python eager fp32"] else 1)' \
  "${kept:-/dev/null}"

check "that call built bench_compiled first, and nothing else" \
  test "$(builds)" = "--build \$work/build -j N --target bench_compiled"
check "that call exported the two packages of --quick" test "$(wc -l <"$work/exported")" = 2
check "and compiled Python's modes first, once, without max-autotune, before bench_compiled ran (twice)" test \
  "$(tr '\n' '|' <"$work/order")" = "warm-up --device cuda --compile-only --no-max-autotune|bench_compiled|bench_compiled|"
check "the summary has the warm-up's compile times" grep -qxF \
  "Python warm-up: torch.compile default, batch 1: compiled in 9 s" <<<"$summary"

# --part build,bench without the tests: the build part starts the exports beside the compilation (a stand-in
# cmake here, which configures and builds nothing, and stand-in GoogleTest sources) and the bench part waits for
# them rather than exporting again. Without --quick: the five variants, of which the two --quick exported above are
# used again (the same sources and arguments: a max-autotune export can take more than one call's budget, so a
# second call on the machine goes on where the first stopped) and the other three exported once.
# Inductor's autotuning timings from an earlier session (PERF_GPU_INDUCTOR) seed its cache folder, in the build
# folder by default, without replacing a file this machine's calls wrote since; what the call's Pythons measured
# goes back beside them in gpu-inductor.tar, and nothing else of that folder.
mkdir -p "$work/deps/googletest" && touch "$work/deps/googletest/CMakeLists.txt"
rm -rf "$work/out" "$work/tar" "$work/exported" "$work/order" "$work/starts" "$work/build/inductor"
mkdir -p "$work/seed/cache" "$work/seed/k" "$work/build/inductor/cache"
echo seed >"$work/seed/cache/earlier" && echo seed >"$work/seed/k/x.best_config"
echo seed >"$work/seed/cache/machine" && tar -cf "$work/autotune.tar" -C "$work/seed" .
echo newer >"$work/build/inductor/cache/machine"
(cd "$root" && env -u TORCHINDUCTOR_CACHE_DIR PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" \
  PERF_GPU_BUILD="$work/build" PERF_GPU_RESULTS="$work/out" PERF_GPU_BUDGET_S=200 PERF_DEPS_DIR="$work/deps" \
  PERF_GPU_CCACHE=/nonexistent PERF_GPU_INDUCTOR="$work/autotune.tar" \
  bash scripts/gpu-check.sh --part build,bench --bench compiled >"$work/stdout-build" 2>&1)
check "the build part built bench_compiled alone, the programs the tests run and the test packages left out" \
  test "$(builds)" = "--build \$work/build -j N --target bench_compiled"
check "its summary says so" grep -qxF "built bench_compiled only, what --part build,bench runs (a call with --part \
tests, or --part build alone, builds the rest)" "$work/out/build-summary.txt"
check "and the bench part built nothing more" test -z "$(grep "^built for this part" "$work/out/bench-summary.txt")"
check "bench/e2e's training packages were not exported: the call runs no e2e" \
  test -z "$(grep "^e2e export" "$work/starts")"
check "the build part's summary says the five exports started beside the build" grep -qF \
  "bench_compiled's packages: 5 exports started beside the build" "$work/out/build-summary.txt"
check "the three new ones exported once, the two of --quick used again" test \
  "$(sort -u "$work/exported" | wc -l)-$(wc -l <"$work/exported")-$(grep -c "from an earlier call" "$work/stdout-build")" \
  = 3-3-2
check "and bench_compiled measured the five" test "$(grep -m1 "^== bench_compiled " "$work/stdout-build" |
  grep -o -- "--package " | wc -l)" = 5
check "after Python's warm-up, started once beside the build, with max-autotune" test \
  "$(tr '\n' '|' <"$work/order")" = "warm-up --device cuda --compile-only|bench_compiled|bench_compiled|"
check "whose max-autotune compile time is in the summary" grep -qxF \
  "Python warm-up: torch.compile max-autotune, batch 1: compiled in 99 s" "$work/out/bench-summary.txt"

check "the max-autotune export started after Python's max-autotune at batch 1, before the warm-up ended" test \
  "$(grep -E "^warm-up|_autotune" "$work/starts" | tr '\n' '|')" \
  = "warm-up: max-autotune at batch 1|export resnet_cuda_fp32_b1_autotune.pt2|warm-up: ended|"
check "the build summary says where Inductor's timings came from" grep -qxF \
  "Inductor's autotuning: seeded from $work/autotune.tar (3 files)" "$work/out/build-summary.txt"
check "the machine's newer file kept, the seed's others unpacked" test \
  "$(cat "$work/build/inductor/cache/machine" "$work/build/inductor/cache/earlier")" = "newer
seed"
check "gpu-inductor.tar has the seed's timings and the warm-up's, not its compiled graph" test \
  "$(tar -tf "$work/out/gpu-inductor.tar" 2>/dev/null | sort | tr '\n' ' ')" \
  = "./ab/kernel.best_config ./cache/earlier ./cache/machine ./cache/warm-up ./k/x.best_config "
check "and the call says how to carry it" grep -qE "^Inductor's autotuning: 5 files \([0-9]+ KiB\) in $work/out/\
gpu-inductor.tar: keep it as gpu-inductor/autotune.tar and carry gpu-inductor" "$work/stdout-build"

# --part build alone builds everything, and exports bench/e2e's training packages beside it for a later e2e part.
rm -rf "$work/out" "$work/starts"
(cd "$root" && PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" PERF_GPU_BUILD="$work/build" \
  PERF_GPU_RESULTS="$work/out" PERF_GPU_BUDGET_S=200 PERF_DEPS_DIR="$work/deps" PERF_GPU_CCACHE=/nonexistent \
  bash scripts/gpu-check.sh --part build >"$work/stdout-build-alone" 2>&1)
check "--part build alone builds everything" test "$(builds)" = "--build \$work/build -j N"
check "its summary says so" grep -qx "built everything" "$work/out/build-summary.txt"
check "and bench/e2e's training packages export beside it" grep -q "^e2e export --export-only" "$work/starts"

# --part build,gpu-tests builds what the one-process GPU run needs (perf_tests, its test packages, doctor for the
# environment), of what the build has (no CUDA test packages in this stand-in's list), and exports no e2e package.
rm -rf "$work/out" "$work/starts"
(cd "$root" && PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" PERF_GPU_BUILD="$work/build" \
  PERF_GPU_RESULTS="$work/out" PERF_GPU_BUDGET_S=200 PERF_DEPS_DIR="$work/deps" PERF_GPU_CCACHE=/nonexistent \
  bash scripts/gpu-check.sh --part build,gpu-tests >"$work/stdout-gpu-tests" 2>&1)
check "--part build,gpu-tests builds perf_tests, its packages and doctor" \
  test "$(builds)" = "--build \$work/build -j N --target perf_tests perf_test_packages doctor"
check "and no e2e package" test -z "$(grep "^e2e export" "$work/starts" 2>/dev/null)"
check "and runs the GPU tests" grep -q "^one process (every \*OnGpu\* test, 1 process(es))" \
  "$work/out/gpu-tests-summary.txt"

finish_check "gpu-check bench part"
