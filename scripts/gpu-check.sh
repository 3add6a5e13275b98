#!/usr/bin/env bash
# perf on a machine with an NVIDIA GPU, in parts that each fit a short session
# (under 8 minutes on an H100 with 16 cores):
#
#   build   configure and build with all cores (works without a GPU): everything where the call tests or only
#           builds, else the programs its other parts run; on a GPU, beside the compilation, bench/e2e's
#           training packages (where the call builds everything or runs e2e) and (with bench, without tests)
#           bench_compiled's packages and its Python peer's compilations
#   tests   every ctest in its own process, then every GPU test in ONE process
#   gpu-tests  the GPU tests in one process alone, without ctest (20 s where ctest takes 2-3 min; CI runs it)
#   bench   every benchmark with --device cuda, the AOTInductor packages, the Python peers
#   e2e     bench/e2e: Python vs C++ training jobs on the GPU (--quick: no max-autotune), and
#           where each configuration's step time goes (2 profiled steps: profile-<job>.md)
#
#   bash scripts/gpu-check.sh                          # build,tests,bench (+ e2e with --e2e)
#   bash scripts/gpu-check.sh --part build             # one call
#   bash scripts/gpu-check.sh --part tests             # the next (the build is reused)
#   bash scripts/gpu-check.sh --part bench --quick     # and the next
#   bash scripts/gpu-check.sh --part bench --quick --bench optim,compiled   # some benchmarks only
#   bash scripts/gpu-check.sh --part e2e --quick [--jobs cnn,transformer]
#   PERF_E2E_ARGS="--compiled-layout contiguous" bash scripts/gpu-check.sh --part e2e --quick --jobs cnn
#
# The build lives outside the source tree (PERF_GPU_BUILD, default
# /tmp/perf-build-gpu), so consecutive calls on one machine reuse it. Each part
# writes its logs under the build folder and leaves in the results folder
# (PERF_GPU_RESULTS, default gpu-results/) only <part>-summary.txt and
# <part>.tar.gz with its logs: a handful of small files. Bulky intermediates
# (exported packages, e2e data sets and weights) stay in the build folder.
#
# Each call keeps to a time budget (PERF_GPU_BUDGET_S, default 540 s: a lent
# machine stops a command at 600 s, and then no summary would come back): a
# step the budget stops, or leaves no time for, is named in the summary, and
# what ran is reported. Each test is bounded by ctest at PERF_GPU_TEST_TIMEOUT
# (default 120 s) and runs with PERF_GPU_TEST_THREADS intra-op threads (default
# 2; ctest runs as many tests at once as cores / those threads). A test that
# crashes or hangs the one-process GPU run is named, and the tests after it run
# on in a new process. The summary lists the tests over PERF_GPU_SLOW_TEST_S
# (default 60 s) and, from a sample a second of every Python the tests start,
# where those tests' Pythons spent the time (tests/python_sampler).
#
# Where torch's venv holds no Python bytecode and Python may not write it there, the bytecode is kept in the
# build folder (PYTHONPYCACHEPREFIX; the build and tests summaries say which case the machine is).
#
# Offline by design: never runs apt or pip.
#   LibTorch   from PERF_PYTHON's torch (default python3), or Torch_DIR.
#   GoogleTest, CLI11, Google Benchmark: installed CMake packages, or the folder
#              PERF_DEPS_DIR prepared on a connected machine by
#              `bash scripts/gpu-deps.sh DIR` (then copied here).
# PERF_CMAKE_ARGS adds CMake arguments.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# This call as a user would type it, for the record of a kept run (the reports' --command: e2e, compiled bench).
invocation="${PERF_E2E_ARGS:+PERF_E2E_ARGS=\"$PERF_E2E_ARGS\" }bash scripts/gpu-check.sh $*"
parts="" quick=0 e2e=0 jobs_arg=() benches=all
all_benches=setup,optim,amp,data,graph,ddp,compiled
while (($#)); do
  case $1 in
    --part) parts=${2:?--part needs build, tests, gpu-tests, bench or e2e (comma-separated)}; shift ;;
    --part=*) parts=${1#--part=} ;;
    --quick) quick=1 ;;
    --e2e) e2e=1 ;;
    --jobs) jobs_arg=(--jobs "${2:?--jobs needs a list like cnn,transformer}"); shift ;;
    --bench) benches=${2:?--bench needs a list of $all_benches}; shift ;;
    --build-only) parts=build ;;
    *) echo "gpu-check: unknown argument $1 (valid: --part build,tests,gpu-tests,bench,e2e  --quick  --e2e  --jobs LIST  --bench LIST)" >&2
       exit 2 ;;
  esac
  shift
done
[ -n "$parts" ] || { parts=build,tests,bench; ((e2e)) && parts+=,e2e; }
for p in ${parts//,/ }; do
  case $p in build | tests | gpu-tests | bench | e2e) ;; *) echo "gpu-check: unknown part '$p' (valid: build, tests, gpu-tests, bench, e2e)" >&2; exit 2 ;; esac
done
[[ $benches == all ]] || for b in ${benches//,/ }; do
  [[ ",$all_benches," == *",$b,"* ]] || { echo "gpu-check: unknown benchmark '$b' in --bench (valid: $all_benches)" >&2; exit 2; }
done
# A benchmark --bench asks for (with its Python peer, if it has one).
wanted() { [[ $benches == all || ",$benches," == *",$1,"* ]]; }
py=${PERF_PYTHON:-python3}
# PERF_E2E_ARGS: more bench/e2e/run.py arguments, e.g. "--compiled-layout contiguous" or
# "--compiled-inductor-config layout_optimization=False" or "--compiled-max-autotune".
read -ra e2e_more <<<"${PERF_E2E_ARGS:-}"
out=${PERF_GPU_RESULTS:-gpu-results}
build=${PERF_GPU_BUILD:-/tmp/perf-build-gpu}
fail() { echo "gpu-check: $*" >&2; exit 2; }
budget=${PERF_GPU_BUDGET_S:-540}
test_timeout=${PERF_GPU_TEST_TIMEOUT:-120}
[[ $budget =~ ^[1-9][0-9]*$ ]] || fail "PERF_GPU_BUDGET_S must be a whole number of seconds > 0, got '$budget'"
[[ $test_timeout =~ ^[1-9][0-9]*$ ]] ||
  fail "PERF_GPU_TEST_TIMEOUT must be a whole number of seconds > 0, got '$test_timeout'"
[[ ${PERF_GPU_TEST_THREADS:-2} =~ ^[1-9][0-9]*$ ]] ||
  fail "PERF_GPU_TEST_THREADS must be a whole number of threads > 0, got '${PERF_GPU_TEST_THREADS:-}'"
started=$(date +%s)
left() { echo $((budget - ($(date +%s) - started))); }
# Runs a command within what is left of the call's budget less <reserve> seconds;
# a command stopped by it, or not started for want of time, is written to the
# part's budget.txt (and so to its summary).
within_budget() {  # reserve command...
  local reserve=$1 t rc
  shift
  t=$(($(left) - reserve))
  if ((t < 20)); then
    echo "not run, $(left) s left of the call's budget (PERF_GPU_BUDGET_S=$budget): $*" >>"$logs/budget.txt"
    return 125
  fi
  timeout -k 10 "$t" "$@"
  rc=$?
  ((rc == 124 || rc == 137)) &&
    echo "stopped after $t s by the call's budget (PERF_GPU_BUDGET_S=$budget): $*" >>"$logs/budget.txt"
  return $rc
}
has() { [[ ",$parts," == *",$1,"* ]]; }
# The tests part of the call: tests (ctest, then the GPU tests in one process) or gpu-tests (those alone).
tests_part=""
has tests && tests_part=tests
if has gpu-tests; then
  [ -z "$tests_part" ] || fail "--part tests runs the GPU tests already: give tests or gpu-tests, not both"
  tests_part=gpu-tests
fi

# AOTInductor packages of bench/resnet.py for bench_compiled, compiled here for this GPU (about 80 s each), kept
# out of the results. *_b1: static shapes for batch 1, as torch.compile specialises on the first shape it sees (the
# Python rows at batch 1); fp32_b1_autotune the same with --max-autotune, the like of Python's max-autotune row
# (left out with --quick, as that row is); bf16_nhwc*: perf's recipe (bf16, channels-last) compiled in, the
# candidate for 3x eager at batch 1; the others take batches 1 to 64. All at once: each export is mostly one
# compiler process, and the machine has cores to spare. A package an earlier call on this machine exported from
# the same sources and arguments is used again: the max-autotune export alone ran past 168 s on an H200 (a885395),
# so a second call finishes what the first could not. Sets variants[] and exports[] (a background job each, whose
# status says whether its package is there); each export's log is gpu-work/logs/export_<variant>.log, which the bench
# part copies to its own logs (started by the build part, an export outlives the bench part's fresh logs folder).
# Beside them, Python's peer compiles its torch.compile modes at its batches into Inductor's caches
# (peer_compiled.py --compile-only; $peer_warmup, its log gpu-work/logs/peer_compiled_warmup.log), so that the timed
# peer after bench_compiled takes them from there: Python's max-autotune compiles for minutes, as the export does.
# The max-autotune export waits for Python's at batch 1 and takes its timings (Inductor's cache, carried between
# sessions: gpu-inductor.tar below), so both sides run on the same choices, timed once with the other exports on the GPU.
variants=() exports=() peer_warmup=
start_bench_exports() {
  local variant shape extra pkg key sources_key peer_extra=()
  variants=(fp32 fp32_b1 fp32_b1_autotune bf16_nhwc bf16_nhwc_b1); ((quick)) && variants=(fp32 fp32_b1)
  wanted compiled || variants=()
  exports=() peer_warmup=
  rm -rf "$build/gpu-work/logs"; mkdir -p "$build/gpu-work/logs"
  if wanted compiled; then
    ((quick)) && peer_extra=(--no-max-autotune)
    PYTHONUNBUFFERED=1 within_budget 60 "$py" bench/peer_compiled.py --device cuda --compile-only "${peer_extra[@]}" \
      >"$build/gpu-work/logs/peer_compiled_warmup.log" 2>&1 &
    peer_warmup=$!
  fi
  sources_key=$(cat bench/resnet.py tools/export_compiled.py | cksum | cut -d' ' -f1)
  for variant in "${variants[@]}"; do
    shape=(--input "8,3,64,64" --dynamic-batch "1:64")
    extra=(); [[ $variant == bf16_nhwc* ]] && extra=(--dtype bfloat16 --channels-last)
    [[ $variant == *_b1* ]] && shape=(--input "1,3,64,64" --dynamic-batch static)
    [[ $variant == *_autotune ]] && extra+=(--max-autotune)
    pkg=$build/gpu-work/resnet_cuda_$variant.pt2 key="$sources_key ${shape[*]} ${extra[*]}"
    if [ -f "$pkg" ] && [ "$(cat "$pkg.key" 2>/dev/null)" = "$key" ]; then
      echo "   export $variant: $pkg from an earlier call on this machine (same sources and arguments)"
      echo "reused $pkg" >"$build/gpu-work/logs/export_$variant.log"
      true &
    else
      rm -f "$pkg" "$pkg.key"
      # The max-autotune export times the same convolutions, of the same shapes and layouts, as Python's
      # max-autotune at batch 1: it starts once the warm-up has compiled that (or ended), and takes the timings
      # from Inductor's cache rather than measure them again beside it. Both then run on the same choices.
      { [[ $variant == *_autotune && -n $peer_warmup ]] && until ! kill -0 "$peer_warmup" 2>/dev/null ||
          grep -qs "^torch.compile max-autotune, batch 1: compiled in" "$build/gpu-work/logs/peer_compiled_warmup.log"
        do sleep 2; done
        within_budget 60 "$py" tools/export_compiled.py bench/resnet.py:make_resnet -o "$pkg" "${shape[@]}" \
          --device cuda "${extra[@]}" >"$build/gpu-work/logs/export_$variant.log" 2>&1 && echo "$key" >"$pkg.key"; } &
    fi
    exports+=($!)
  done
}
mkdir -p "$out"
out=$(cd "$out" && pwd)

# Python's bytecode for torch's modules. Where the venv holds none (uv installs without it by default) and
# Python may not write it there (a venv this user cannot write to, or PYTHONDONTWRITEBYTECODE set), every Python
# that imports torch compiles its modules from source again, and the tests start dozens. Then the bytecode goes
# to the build folder (PYTHONPYCACHEPREFIX), written by the first Python and read by the rest, on this call and
# the next.
pyc_state=$("$py" - 2>/dev/null <<'PY'
import importlib.util, os, sys, tempfile
spec = importlib.util.find_spec("torch")  # finds it without importing it
root = os.path.dirname(spec.origin) if spec and spec.origin else None
parts = (["__init__.py"], ["_tensor.py"], ["_inductor", "codecache.py"])
sources = [os.path.join(root, *p) for p in parts] if root else []
missing = [s for s in sources if os.path.exists(s) and not os.path.exists(importlib.util.cache_from_source(s))]
def writable(folder):
    try:  # a real write: root passes os.access on a read-only mount
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(dir=folder)
        os.close(fd)
        os.remove(path)
        return True
    except OSError:
        return False
print("unknown" if not sources else "cached" if not missing else "not-written" if sys.dont_write_bytecode else
      "writable" if all(writable(os.path.dirname(importlib.util.cache_from_source(s))) for s in missing) else
      "read-only")
PY
) || pyc_state=unknown
case $pyc_state in
  cached) pyc_line="torch's bytecode: in the venv" ;;
  writable) pyc_line="torch's bytecode: not in the venv; the first Python that imports torch writes it there" ;;
  read-only | not-written)
    why="which is read-only"; [[ $pyc_state == not-written ]] && why="and PYTHONDONTWRITEBYTECODE is set"
    if [ -n "${PYTHONPYCACHEPREFIX:-}" ]; then
      pyc_line="torch's bytecode: not in the venv, $why; PYTHONPYCACHEPREFIX=$PYTHONPYCACHEPREFIX as set"
    else
      export PYTHONPYCACHEPREFIX=$build/gpu-work/pycache
      unset PYTHONDONTWRITEBYTECODE
      pyc_line="torch's bytecode: not in the venv, $why: kept in PYTHONPYCACHEPREFIX=$PYTHONPYCACHEPREFIX"
    fi ;;
  *) pyc_line="torch's bytecode: unknown ($py could not find torch's sources)" ;;
esac

# A GPU, unless only the build is asked for.
if [[ $parts != build ]]; then
  command -v nvidia-smi >/dev/null || fail "refusing: nvidia-smi not found, this is not a machine with an NVIDIA GPU (--part build checks the build alone)"
  nvidia-smi -L >/dev/null 2>&1 || fail "refusing: nvidia-smi sees no GPU (driver missing or no device); --part build checks the build alone"
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null ||
    fail "refusing: $py's torch cannot use the GPU (torch.cuda.is_available() is False)"
fi

# ccache: the compiles an earlier GPU session made come from its cache. Its build part left the cache in its
# results (gpu-ccache.tar), carried back here as PERF_GPU_CCACHE (default gpu-ccache/ccache.tar): on an H200 the
# build was 216 s of a 900-s session, nearly all of it compiling. ccache from PATH, else the copy scripts/gpu-deps.sh
# puts in PERF_DEPS_DIR/ccache. The cache lives in the build folder (every call on this machine uses it); a call
# that compiled something leaves what this machine's calls used in the results again, for the next session.
ccache_bin="" ccache_line="ccache: none (neither on PATH nor in PERF_DEPS_DIR/ccache: every compile is done here)"
for c in "$(command -v ccache 2>/dev/null)" "${PERF_DEPS_DIR:+$PERF_DEPS_DIR/ccache/bin/ccache}"; do
  [ -n "$c" ] && [ -x "$c" ] || continue
  if "$c" --version >/dev/null 2>&1; then
    ccache_bin=$(cd "$(dirname "$c")" && pwd)/$(basename "$c")
    break
  fi
  ccache_line="ccache: $c does not run here ($("$c" --version 2>&1 | head -n 1)): every compile is done here"
done
ccache_counts() {  # "<hits> <misses>" since this call zeroed the counters
  "$ccache_bin" --print-stats | awk '$1 ~ /^(direct|preprocessed)_cache_hit$/ { h += $2 }
                                    $1 == "cache_miss" { m += $2 } END { print h + 0, m + 0 }'
}
if [ -n "$ccache_bin" ]; then
  # Hits across sessions: paths under the tree relative (another checkout folder), the compiler known by its
  # content (not its mtime), and no size limit below what one build needs.
  export CCACHE_DIR=$build/ccache CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1 CCACHE_COMPILERCHECK=content CCACHE_MAXSIZE=4G \
    CCACHE_DEPEND=1  # a miss runs the compiler alone, not the preprocessor first (scripts/common.sh)
  seed=${PERF_GPU_CCACHE:-gpu-ccache/ccache.tar}
  if [ ! -f "$CCACHE_DIR/perf-since" ]; then
    mkdir -p "$CCACHE_DIR"
    if [ -f "$seed" ] && tar -xf "$seed" -C "$CCACHE_DIR" 2>/dev/null; then
      seeded="seeded from $seed ($(du -sh "$seed" | cut -f1))"
    else
      seeded="empty: no $seed from an earlier session"
    fi
    echo "$seeded" >"$CCACHE_DIR/perf-since"  # its mtime: entries older than it were not used on this machine
  fi
  "$ccache_bin" --zero-stats >/dev/null
  ccache_line="ccache: $ccache_bin, cache $(cat "$CCACHE_DIR/perf-since")"
fi
# What this machine's calls used of the cache, for the next session (a call that compiled nothing leaves none).
save_ccache() {
  local hits misses size
  if [ -n "$ccache_bin" ]; then
    read -r hits misses < <(ccache_counts)
    if ((misses > 0)); then
      "$ccache_bin" --evict-older-than "$(($(date +%s) - $(stat -c %Y "$CCACHE_DIR/perf-since")))s" >/dev/null
      tar -cf "$out/gpu-ccache.tar" -C "$CCACHE_DIR" --exclude=./perf-since .
      size=$(stat -c %s "$out/gpu-ccache.tar")
      if ((size > 15 * 1024 * 1024)); then  # a lent machine returns files up to 16 MiB
        "$ccache_bin" --recompress 19 >/dev/null
        tar -cf "$out/gpu-ccache.tar" -C "$CCACHE_DIR" --exclude=./perf-since .
        size=$(stat -c %s "$out/gpu-ccache.tar")
      fi
      # Still over (the whole build's cache was 17 MiB at a885395): in parts of 15 MiB, where the lent machine's
      # 8 returned files leave room for them beside this call's other results.
      parts=$(((size + 15 * 1024 * 1024 - 1) / (15 * 1024 * 1024)))
      others=$(find "$out" -maxdepth 1 -type f ! -name gpu-ccache.tar | wc -l)
      if ((size > 15 * 1024 * 1024 && parts <= 4 && others + parts <= 8)); then
        split -b 15M -d -a 1 "$out/gpu-ccache.tar" "$out/gpu-ccache.tar.part"
        rm -f "$out/gpu-ccache.tar"
        echo "ccache: $hits compiles from the cache, $misses compiled; the cache ($((size >> 20)) MiB) in $parts parts" \
             "in $out (gpu-ccache.tar.part*): keep them as gpu-ccache/ccache.tar (cat gpu-ccache.tar.part* >" \
             "gpu-ccache/ccache.tar) and carry gpu-ccache to the next session (docs/gpu-runs.md)"
      elif ((size > 15 * 1024 * 1024)); then
        rm -f "$out/gpu-ccache.tar"
        echo "ccache: $hits compiles from the cache, $misses compiled; the cache ($((size >> 20)) MiB) is too big" \
             "to return beside this call's $others other results (a lent machine returns 8 files of 16 MiB)"
      else
        echo "ccache: $hits compiles from the cache, $misses compiled; gpu-ccache.tar ($((size >> 20)) MiB) in" \
             "$out: keep it as gpu-ccache/ccache.tar and carry gpu-ccache to the next session (docs/gpu-runs.md)"
      fi
    else
      echo "ccache: $hits compiles from the cache, none compiled"
    fi
  fi
}

# Inductor's autotuning: max-autotune times every Triton template of every convolution and matmul against ATen's
# kernel, then tunes each Triton kernel's launch (coordinate descent). For bench/resnet.py at batch 1 on an H200
# that took 290 s in each of the max-autotune export and Python's warm-up, and neither finished in a 500-s call
# (ac79462). Inductor keeps those timings as it measures them, in small files of its cache folder: select_algorithm's
# in cache/<hash of the GPU's name and the CUDA and Triton versions>, coordinate descent's in a <kernel>.best_config
# beside each kernel's source. They go back in the results (gpu-inductor.tar), carried back here as
# PERF_GPU_INDUCTOR (default gpu-inductor/autotune.tar), so that a later session's compiles on the same kind of GPU
# take the timings measured already, a stopped call's too, and measure only the rest. One cache folder for the
# call's Pythons (TORCHINDUCTOR_CACHE_DIR, default in the build folder, which the machine's later calls reuse).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$build/inductor}
inductor_seed=${PERF_GPU_INDUCTOR:-gpu-inductor/autotune.tar}
inductor_line="Inductor's autotuning: none from an earlier session (no $inductor_seed)"
if [ -f "$inductor_seed" ]; then
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
  # A file an earlier call on this machine wrote is newer than the seed's: kept (--skip-old-files).
  if tar -xf "$inductor_seed" -C "$TORCHINDUCTOR_CACHE_DIR" --skip-old-files 2>/dev/null; then
    inductor_line="Inductor's autotuning: seeded from $inductor_seed ($(tar -tf "$inductor_seed" | grep -vc '/$') files)"
  else
    inductor_line="Inductor's autotuning: $inductor_seed did not unpack (not a tar?): every timing is measured here"
  fi
fi
save_inductor() {
  local files
  [ -d "$TORCHINDUCTOR_CACHE_DIR" ] || return 0
  files=$(cd "$TORCHINDUCTOR_CACHE_DIR" && find . -type f \( -path './cache/*' -o -name '*.best_config' \) | sort)
  [ -n "$files" ] || return 0
  tar -cf "$out/gpu-inductor.tar" -C "$TORCHINDUCTOR_CACHE_DIR" -T - <<<"$files"
  echo "Inductor's autotuning: $(wc -l <<<"$files") files ($(($(stat -c %s "$out/gpu-inductor.tar") >> 10)) KiB)" \
       "in $out/gpu-inductor.tar: keep it as gpu-inductor/autotune.tar and carry gpu-inductor to the next session" \
       "(docs/gpu-runs.md)"
}
# Both at the end, Inductor's first: the compiler cache's parts take what is left of the 8 files a machine returns.
trap 'rc=$?; save_inductor; save_ccache; exit $rc' EXIT

# Ends a part: its logs into <part>.tar.gz, its summary beside it.
finish() {  # part status started
  local part=$1 st=$2 t0=$3
  if [ -s "$logs/budget.txt" ]; then
    echo "-- time budget:"
    sed 's/^/  /' "$logs/budget.txt"
  fi >>"$logs/summary.txt"
  echo "-- $part: $( ((st)) && echo FAILED || echo ok ) in $(($(date +%s) - t0)) s" | tee -a "$logs/summary.txt"
  cp "$logs/summary.txt" "$out/$part-summary.txt"
  tar -czf "$out/$part.tar.gz" -C "$(dirname "$logs")" "$(basename "$logs")"
}
status=0

# What a call builds. Where it runs ctest, or only builds: everything (the tests, the programs, the test packages,
# whose CUDA ones export on the GPU). Otherwise only what its other parts run: perf_tests, its packages and doctor
# for gpu-tests, bench_<name> for each --bench, the e2e runner for e2e. Before, on an H200, `--part build,bench
# --bench compiled` compiled all 47 translation units and exported the CUDA test packages on the GPU beside
# bench_compiled's exports and Python's max-autotune, which time kernels on that GPU and compile Triton's on those
# cores (ac79462: the build 197 s, max-autotune stopped by the budget).
# A later part that needs what a call left out (the tests) builds it first, in its own budget.
whole_build=0; { has tests || [[ $parts == build ]]; } && whole_build=1
part_targets() {  # part...: the targets those parts run that this build has (none: build everything)
  local want=() have p t
  for p in "$@"; do
    case $p in
      bench) for t in ${all_benches//,/ }; do wanted "$t" && want+=("bench_$t"); done ;;
      e2e) want+=(e2e) ;;
      gpu-tests) want+=(perf_tests perf_test_packages perf_test_cuda_packages doctor) ;;
    esac
  done
  # Ninja's "name: phony" (a custom target's "<build>/CMakeFiles/name: phony"), Make's "... name".
  have=$(cmake --build "$build" --target help 2>/dev/null)
  for t in "${want[@]}"; do
    grep -qE "(^|/|\.\.\. )$t(:| |\$)" <<<"$have" && echo "$t"
  done
}
# The targets a part runs, built where this call's build part did not (a build folder CMake did not make, a
# stand-in, is used as it is). Sets built_line for the part's summary; returns the build's status.
built_line=""
build_for_part() {  # part
  local targets=() rc steps s0
  built_line=""
  has build && return 0
  [ -f "$build/CMakeCache.txt" ] || return 0
  [[ $1 == tests ]] || mapfile -t targets < <(part_targets "$1")
  s0=$(date +%s)
  within_budget 30 cmake --build "$build" -j "$(nproc)" ${targets[@]:+--target "${targets[@]}"} >"$logs/build.log" 2>&1
  rc=$?
  steps=$(grep -cE "^\[([0-9]+/[0-9]+| *[0-9]+%)\]" "$logs/build.log")  # Ninja's [k/n] or Make's [ k%] lines
  if ((rc)); then
    built_line="build of ${targets[*]:-everything} for this part: FAILED after $(($(date +%s) - s0)) s (build.log)"
  elif ((steps)); then
    built_line="built for this part first: ${targets[*]:-everything} ($steps build steps, $(($(date +%s) - s0)) s)"
  fi
  return $rc
}
# Starts a part other than the build: its logs folder, and what it runs built. Where that build fails, the part
# ends there, failed, with the build's errors in its summary.
start_part() {  # part
  t0=$(date +%s) logs=$build/gpu-logs/$1 st=0
  rm -rf "$logs"; mkdir -p "$logs"
  build_for_part "$1" && return 0
  { echo "$built_line"; grep -E "error|Error|^FAILED: " "$logs/build.log" | head -10; } | tee "$logs/summary.txt"
  finish "$1" 1 "$t0"
  status=1
  return 1
}

if has build; then
  t0=$(date +%s); logs=$build/gpu-logs/build; rm -rf "$logs"; mkdir -p "$logs"
  if [ -n "${Torch_DIR:-}" ]; then
    prefix_args=(-DTorch_DIR="$Torch_DIR")
  else
    prefix=$("$py" -c "import torch; print(torch.utils.cmake_prefix_path)" 2>/dev/null) ||
      fail "no LibTorch: $py cannot import torch; set PERF_PYTHON to a Python with torch, or Torch_DIR"
    prefix_args=(-DCMAKE_PREFIX_PATH="$prefix" -DPERF_PYTHON="$(command -v "$py")")
  fi
  deps_args=()
  if [ -n "${PERF_DEPS_DIR:-}" ]; then
    [ -f "$PERF_DEPS_DIR/googletest/CMakeLists.txt" ] || fail "PERF_DEPS_DIR=$PERF_DEPS_DIR has no googletest/CMakeLists.txt"
    deps_args=(-DPERF_DEPS_DIR="$(cd "$PERF_DEPS_DIR" && pwd)")
  elif ! ls /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake /usr/local/lib/cmake/GTest/GTestConfig.cmake \
         /usr/lib/cmake/GTest/GTestConfig.cmake >/dev/null 2>&1; then
    fail "GoogleTest not found and PERF_DEPS_DIR not set. On a connected Debian/Ubuntu machine run
    bash scripts/gpu-deps.sh perf-deps
copy perf-deps/ here, and run: PERF_DEPS_DIR=perf-deps bash scripts/gpu-check.sh"
  fi
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  # Many cores: one translation unit per test file finishes sooner than the
  # three batches that save CPU time on a 2-core CI machine (PERF_TESTS_UNITY); the examples and
  # benchmarks compile one by one too (PERF_PROGRAMS_UNITY stays off, its default).
  unity=ON; (($(nproc) >= 8)) && unity=OFF
  echo "== build ($(nproc) jobs) -> $build"
  st=0
  # Inductor checks the CPU's vector instruction sets in every Python that compiles a package, CUDA ones too
  # (a package records the CPU's), each check a new Python importing torch. Done once here, beside the
  # configuration, the exporter's markers (remember_vec_isa_checks) answer it in the build's exports that start
  # at once, and in the tests'.
  s0=$(date +%s)
  "$py" -c "import sys; sys.path.insert(0, 'tools'); import export_compiled as e; e.remember_vec_isa_checks()
from torch._inductor import cpu_vec_isa; print(', '.join(map(str, cpu_vec_isa.valid_vec_isa_list())) or 'none')" \
    >"$logs/vec-isa.txt" 2>&1 &
  isa_check=$!
  launcher_args=()
  [ -n "$ccache_bin" ] && launcher_args=(-DCMAKE_CXX_COMPILER_LAUNCHER="$ccache_bin")
  # shellcheck disable=SC2086  # PERF_CMAKE_ARGS: extra arguments, split on spaces
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${prefix_args[@]}" "${deps_args[@]}" \
    "${launcher_args[@]}" -DPERF_TEST_TIMEOUT="$test_timeout" -DPERF_TEST_SHARDS=0 -DPERF_TESTS_UNITY="$unity" ${PERF_CMAKE_ARGS:-} >"$logs/configure.log" 2>&1 ||
    { tail -30 "$logs/configure.log"; st=1; }
  if wait "$isa_check"; then
    isa_line="Inductor's vector ISA checks: $(tail -n 1 "$logs/vec-isa.txt") ($(($(date +%s) - s0)) s, with the configuration)"
  else
    isa_line="Inductor's vector ISA checks: failed ($(tail -n 1 "$logs/vec-isa.txt"); vec-isa.txt in build.tar.gz)"
  fi
  # bench/e2e's training packages (the CNN's took 100 s on an H200) export on a GPU beside the compilation
  # (Python alone: --amp bf16 is what the C++ runner's `--info` says on CUDA), so that --part e2e measures
  # rather than compiles: cached in $PERF_CACHE_DIR/e2e-packages by everything that shapes them
  # (PERF_E2E_ARGS and --jobs as --part e2e takes them). One this call has no time for is exported by the
  # next --part build, or by --part e2e.
  e2e_export="" cuda_here=0
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && cuda_here=1
  if ((!st && cuda_here)) && { ((whole_build)) || has e2e; }; then
    PYTHONUNBUFFERED=1 within_budget 15 "$py" bench/e2e/run.py --export-only --amp bf16 --device cuda \
      --out "$build/gpu-work/e2e" "${jobs_arg[@]}" "${e2e_more[@]}" >"$logs/e2e-export.txt" 2>&1 &
    e2e_export=$!
  fi
  # bench_compiled's packages beside the compilation too where this call benchmarks and does not test (the tests'
  # timings would share the GPU with them): the max-autotune export ran past 168 s on an H200. The bench part
  # waits for them.
  if ((!st && cuda_here)) && has bench && [ -z "$tests_part" ] && wanted compiled; then
    start_bench_exports
    echo "bench_compiled's packages: ${#variants[@]} exports started beside the build" >>"$logs/bench-exports.txt"
  fi
  targets=()  # none: everything (also where none of what the call runs is a target of this build)
  ((st || whole_build)) || mapfile -t targets < <(part_targets ${parts//,/ })
  if ((st)); then
    :  # configuration failed: nothing built
  elif ((${#targets[@]})); then
    echo "built ${targets[*]} only, what --part $parts runs (a call with --part tests, or --part build alone," \
      "builds the rest)" >"$logs/targets.txt"
  else
    echo "built everything" >"$logs/targets.txt"
  fi
  if ((!st)); then
    # Stopped by the budget, the next `--part build` on the same machine goes on where this one stopped.
    within_budget 15 cmake --build "$build" -j "$(nproc)" ${targets[@]:+--target "${targets[@]}"} >"$logs/build.log" 2>&1 ||
      { grep -E "error|Error|^FAILED: |^Fatal Python error|^  File \".* in " "$logs/build.log" | head -30; st=1; }
  fi
  if [ -n "$e2e_export" ]; then
    wait "$e2e_export" || echo "bench/e2e's training packages: not all exported (e2e-export.txt in build.tar.gz)"
  fi
  {
    echo "== gpu-check build ($(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(c++ --version | head -1))"
    cat "$logs/targets.txt" 2>/dev/null
    grep -c "warning:" "$logs/build.log" 2>/dev/null | sed 's/^/compiler warnings: /'
    echo "$pyc_line"
    echo "$isa_line"
    if [ -n "$ccache_bin" ]; then
      read -r hits misses < <(ccache_counts)
      echo "$ccache_line: $hits compiles from it, $misses compiled"
    else
      echo "$ccache_line"
    fi
    echo "$inductor_line"
    # The CUDA test packages, exported and checked against eager at build time: a refused one
    # ends its log with the exporter's reason (and the kernel it blames), kept with the logs.
    pk=$build/tests/packages/cuda
    if [ -f "$pk/stamp" ]; then
      sed 's/^/CUDA test packages: /' "$pk/stamp"
      for f in "$pk"/*.log; do
        [ -f "$f" ] || continue
        cp "$f" "$logs/export-$(basename "$f")"
        grep -q "FAILED.*$(basename "$f")" "$pk/stamp" || continue
        echo "-- $(basename "$f"):"
        # A crash: the fatal error and the innermost Python frames (faulthandler); else the log's end.
        if grep -q "^Fatal Python error" "$f"; then
          grep -m1 "^Fatal Python error" "$f"
          awk '/^Current thread/ { on = 1; n = 0; next } on && /^  File/ && n++ < 4 { print } on && !/^  File/ { on = 0 }' "$f"
        else
          grep -v "\[__output_code\]" "$f" | tail -n 6  # without the generated code a diagnostic export logs
        fi
      done
    fi
    cat "$logs/bench-exports.txt" 2>/dev/null
    [ -f "$logs/e2e-export.txt" ] && grep -E "^(cnn|transformer|mlp): |^FAILED" "$logs/e2e-export.txt" |
      sed 's/^/e2e training package: /'
    # The slowest compilations (ninja's log: start and end ms of each output), to see what bounds the build.
    if [ -f "$build/.ninja_log" ]; then
      cp "$build/.ninja_log" "$logs/ninja_log.txt"
      echo "slowest build steps (s):"
      # The log is appended to by every build: the last entry per output, one line per step (a step with
      # several outputs has one entry for each).
      awk -F'\t' 'NR > 1 && $4 != "help" { last[$4] = $1 "\t" $2 } END { for (o in last) { split(last[o], t, "\t");
        if (!seen[last[o]]++) printf "  %6.1f %s\n", (t[2] - t[1]) / 1000, o } }' "$build/.ninja_log" |
        sort -rn | head -n 5
    fi
  } >"$logs/summary.txt"
  finish build $st "$t0"
  status=$((status | st))
  ((st)) && exit 1
fi
[ -f "$build/CMakeCache.txt" ] || [ -x "$build/tests/perf_tests" ] ||
  fail "no build in $build: run --part build first (same PERF_GPU_BUILD)"

# GoogleTest's per-test lines, as "N ok, N failed, N skipped"; and the tests slower than a bound (ms).
gtest_outcomes() {
  awk '$1 == "[" && $NF ~ /ms\)$/ { n[$2]++ }
       END { printf "%d ok, %d failed, %d skipped", n["OK"], n["FAILED"], n["SKIPPED"] }' "$1" 2>/dev/null
}
gtest_slow() {  # log bound_ms
  awk -v bound="$2" '$1 == "[" && $2 == "OK" && $NF == "ms)" && substr($5, 2) + 0 > bound { print $4, substr($5, 2) / 1000 " s" }' \
    "$1" 2>/dev/null
}
# Every *OnGpu* test in one process, as a user's program runs them. A test that
# crashes that process, or runs longer than PERF_GPU_TEST_TIMEOUT, is named, and
# the tests after it run on in a new process (at most 4), so that one crash or
# hang does not hide the rest.
unfinished_test() {  # log: the test that started and has not ended, if any
  awk '$1 == "[" && $2 == "RUN" { t = $4 }
       $1 == "[" && ($2 == "OK" || $2 == "FAILED" || $2 == "SKIPPED") && $4 == t { t = "" }
       END { print t }' "$1"
}
# SIGINT first: perf_tests then prints every thread's stack (tests/crash_traces.cpp)
# and, SIGINT being ignored in a background job, runs on; once the log has the
# stacks and has stopped growing for a second (at most 10 s; none if the budget
# is nearly spent), its whole process group is killed.
stop_test_process() {  # pid log
  local waited=0 size=-1
  if (($(left) > 15)); then
    kill -INT "$1" 2>/dev/null
    while ((waited++ < 10)) && kill -0 "$1" 2>/dev/null; do
      sleep 1
      grep -qs "fatalSignalHandler" "$2" && (($(stat -c %s "$2") == size)) && break
      size=$(stat -c %s "$2")
    done
  fi
  kill -KILL -- "-$1" 2>/dev/null || kill -KILL "$1" 2>/dev/null
}
# The stack of the thread that took a fatal signal (or SIGINT from a stop), as
# c10's handler printed it, frames in perf_tests named with addr2line (the
# binary exports no symbols).
crash_stack() {  # log
  awk '/^SIG[A-Z0-9]+\([0-9]+\), PID: [0-9]+, Thread [0-9]+: *$/ { if (keep) exit; head = $0; n = 0; block = ""; inblock = 1; next }
       inblock && /frame #/ { n++; block = block "\n" $0; if ($0 ~ /fatalSignalHandler/) keep = 1; next }
       inblock { if (keep) exit; inblock = 0 }
       END { if (keep) { print head; printf "%s\n", substr(block, 2) } }' "$1" | head -n 40 |
    while IFS= read -r line; do
      if [[ $line =~ \+\ (0x[0-9a-f]+)\ \(0x[0-9a-f]+\ in\ ([^\)]*perf_tests)\) ]] && command -v addr2line >/dev/null; then
        line+="  = $(addr2line -Cfpe "${BASH_REMATCH[2]}" "${BASH_REMATCH[1]}" 2>/dev/null | head -n 1 | sed 's/ at ??:?$//')"
      fi
      printf '    %s\n' "${line# }"
    done | sed -E 's|\(0x[0-9a-f]+ in [^)]*/([^/)]+)\)|(\1)|'
}
one_process() {
  local skip="" round rc log pid current watched since why
  for round in 1 2 3 4; do
    if (($(left) < 80)); then
      echo "one process $round: not run, $(left) s left of the call's budget (PERF_GPU_BUDGET_S=$budget);" \
        "run --part tests in a call of its own" | tee -a "$logs/one-process-stops.txt"
      return 1
    fi
    log=$logs/gpu-tests-one-process-$round.log
    # In a process group of its own, so that a stop takes the processes a test started with it.
    setsid -w "$build/tests/perf_tests" --gtest_filter="*OnGpu*${skip:+-$skip}" >"$log" 2>&1 &
    pid=$! watched="" since=$(date +%s) why=""
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1
      current=$(unfinished_test "$log")
      [[ $current != "$watched" ]] && { watched=$current; since=$(date +%s); }
      if [ -n "$current" ] && (($(date +%s) - since > test_timeout)); then
        why="stopped after $test_timeout s (PERF_GPU_TEST_TIMEOUT)"
      elif (($(left) < 20)); then
        why="stopped by the call's budget (PERF_GPU_BUDGET_S=$budget)"
      fi
      [ -n "$why" ] && { stop_test_process "$pid" "$log"; break; }
    done
    wait "$pid"
    rc=$?
    ((rc == 0)) && [ -z "$why" ] && return 0
    current=$(unfinished_test "$log")
    [ -n "$why" ] || { ((rc > 128)) && why="died of signal $((rc - 128))" || why="exit $rc"; }
    if [ -z "$current" ]; then
      ((rc > 128)) && echo "one process $round: $why after its last test" | tee -a "$logs/one-process-stops.txt"
      return 1
    fi
    echo "one process $round: $why in $current; the tests after it run in the next process" |
      tee -a "$logs/one-process-stops.txt"
    skip=${skip:+$skip:}$(awk '$1 == "[" && $2 == "RUN" { print $4 }' "$log" | paste -sd: -)
  done
  return 1
}

if [ -n "$tests_part" ] && start_part "$tests_part"; then
  [ -x "$build/tests/perf_tests" ] || fail "no tests in $build: run --part build first (same PERF_GPU_BUILD)"
  timeout 60 nvidia-smi >"$logs/nvidia-smi.txt" 2>&1
  timeout 120 "$build/examples/doctor" >"$logs/environment.txt" 2>&1
  # ctest leaves the one-process run at least 100 s of the call (it took 21-22 s on an H100 and an
  # H200; it needs 80 to start). Two intra-op threads per test process (and its Python reference):
  # LibTorch's default, a thread per core in each of the $(nproc) tests at once, oversubscribes the
  # cores $(nproc)-fold, and OpenMP's spinning threads then crawl (tests that start Python took
  # 64-87 s under -j16 on an H100's 16 cores). Tests that need a thread count set it themselves; the
  # one-process run below keeps LibTorch's default.
  # Likewise one Inductor compile thread in each test's Python: its default, a compile pool of a process
  # per core (compile_threads), is $(nproc) processes importing torch in each of $(nproc) tests at once
  # (the exporter tests took 94-126 s under -j16 on an H100's 16 cores, 15-57 s on CI's 2; two of them at
  # once on 2 cores with 16 compile threads each, as there: 45-47 s, with one each: 36-39 s).
  # And as many tests at once as the cores hold at that many threads each: one per core (16 at
  # once, 32 threads) had scripts/test.sh's five Python exporter tests at 60-80 s on an H100's
  # host (dba86b3), against 27-34 s on CI's 2 cores two at a time. (At 8 at once, and at 14 with one
  # thread each, they took 71-86 s on an H200's host at 965827f: the load is not what holds them.)
  test_threads=${PERF_GPU_TEST_THREADS:-2}
  ctest_jobs=$(($(nproc) / test_threads)); ((ctest_jobs >= 1)) || ctest_jobs=1
  # Every Python the tests start writes its stack once a second (tests/python_sampler): for a test over
  # PERF_GPU_SLOW_TEST_S, the summary then says where its Pythons spent the time.
  slow_s=${PERF_GPU_SLOW_TEST_S:-60}  # the GPU-green issue's bound on one test
  samples=$build/gpu-work/python-samples; rm -rf "$samples"; mkdir -p "$samples"
  # What one new Python pays to import torch here, twice (the second from a warm page cache), and with CUDA
  # initialised: every Python a test starts pays the import (an export, and Inductor's check of each vector ISA
  # where the exporter has no marker), and Inductor's compiles, CPU ones too, initialise CUDA where there is a
  # GPU (its cache key reads the device's name: torch/_inductor/codecache.py, CacheBase.get_system).
  import_s=""
  if [[ $tests_part == tests ]]; then
    for code in "import torch" "import torch" "import torch; torch.cuda.init()"; do
      s0=$(date +%s%N) why=""
      "$py" -c "$code" >/dev/null 2>&1 || why=" (failed)"
      ms=$((($(date +%s%N) - s0) / 1000000))
      import_s+="${import_s:+, }$((ms / 1000)).$((ms % 1000 / 100)) s$why"
    done
    echo "== tests (ctest, one process per test; each at most $test_timeout s)"
    within_budget 100 env OMP_NUM_THREADS="$test_threads" TORCHINDUCTOR_COMPILE_THREADS=1 \
      PYTHONPATH="$PWD/tests/python_sampler${PYTHONPATH:+:$PYTHONPATH}" PERF_TEST_PYTHON_SAMPLES="$samples" \
      ctest --test-dir "$build" -j "$ctest_jobs" --output-on-failure >"$logs/ctest.log" 2>&1 || st=1
    tail -3 "$logs/ctest.log"
  fi
  echo "== GPU tests in one process"
  one_process || st=1
  cat "$logs"/gpu-tests-one-process-*.log >"$logs/gpu-tests-one-process.log" 2>/dev/null
  tail -3 "$logs/gpu-tests-one-process.log"
  {
    echo "== gpu-check $tests_part ($(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
    [ -z "$built_line" ] || echo "$built_line"
    head -n 1 "$logs/environment.txt"
    grep -m1 -E "cuda:0" "$logs/environment.txt" || true
    if [[ $tests_part == tests ]]; then
      grep -E "tests passed|tests failed" "$logs/ctest.log" || echo "ctest: no summary (see ctest.log)"
      grep -E "^\s+[0-9]+ - .* \(.*\)$" "$logs/ctest.log" | head -20 || true
    else
      echo "ctest: not run (--part gpu-tests: the GPU tests alone)"
    fi
    [ -z "$import_s" ] || echo "import torch in a new Python, before the tests (twice, then with CUDA initialised): $import_s"
    echo "$pyc_line"
    echo "one process (every *OnGpu* test, $(compgen -G "$logs/gpu-tests-one-process-*.log" | wc -l) process(es)):" \
      "$(gtest_outcomes "$logs/gpu-tests-one-process.log")"
    cat "$logs/one-process-stops.txt" 2>/dev/null
    for f in "$logs"/gpu-tests-one-process-[0-9]*.log; do
      grep -qs "fatalSignalHandler" "$f" || continue
      echo "  the stopped thread's stack in $(basename "$f") (every thread's: that log):"
      crash_stack "$f"
    done
    grep -E "^\[  FAILED  \] [A-Za-z_0-9]+\.[A-Za-z_0-9]+ \([0-9]+ ms\)" "$logs/gpu-tests-one-process.log" | head -20 || true
    echo "tests over $slow_s s:"
    grep -sE "Test +#[0-9]+: .* [0-9.]+ sec" "$logs/ctest.log" | awk -v s="$slow_s" '$(NF-1) > s {print "  ctest " $0 ($0 ~ /consumer_/ ? "  (a build check: compiles perf and a consumer project cold)" : "")}' || true
    mapfile -t slow < <(grep -sE "Test +#[0-9]+: .* [0-9.]+ sec" "$logs/ctest.log" | awk -v s="$slow_s" '$(NF-1) > s {print $4}')
    if ((${#slow[@]})) && ctest --test-dir "$build" --show-only=json-v1 >"$samples.json" 2>/dev/null; then
      echo "  where their Pythons spent the time (a sample a second; python-samples/ in tests.tar.gz has the stacks):"
      "$py" tests/python_samples.py --keep "$logs/python-samples" "$samples" "$samples.json" "${slow[@]}" 2>&1 |
        sed 's/^/    /'
    fi
    gtest_slow "$logs/gpu-tests-one-process.log" $((slow_s * 1000)) | sed 's/^/  one process: /'
  } >"$logs/summary.txt"
  finish "$tests_part" $st "$t0"
  status=$((status | st))
fi

if has bench && start_part bench; then
  work=$build/gpu-work; mkdir -p "$work"
  if ((quick)); then
    opt=(--iters 30); amp=(--iters 5); data=(--samples 2048 --epochs 2 --gpu-batches 32); graph=(--iters 100)
  else
    opt=(); amp=(); data=(); graph=()
  fi
  run_bench() {  # name args...: returns the benchmark's exit status
    local name=$1 rc; shift
    echo "== $name $*"
    if [ -x "$build/bench/$name" ]; then
      within_budget 30 "$build/bench/$name" "$@" >"$logs/$name.txt" 2>&1 ||
        { rc=$?; echo "   FAILED (see $name.txt)"; st=1; return $rc; }
    else
      echo "   not built" | tee "$logs/$name.txt"
    fi
  }
  wanted setup && run_bench bench_setup --benchmark_min_time=0.05
  # bench_optim and its Python peer into one results file, then the report (as for compiled below).
  optim=$logs/optim-cuda.jsonl
  wanted optim && run_bench bench_optim --device cuda "${opt[@]}" --json "$optim"
  wanted amp && run_bench bench_amp --device cuda "${amp[@]}"
  wanted data && run_bench bench_data --device cuda "${data[@]}"
  wanted graph && run_bench bench_graph "${graph[@]}"
  # DDP's own overhead on one GPU: NCCL at world size 1.
  wanted ddp && RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${PERF_DDP_PORT:-29581} \
    run_bench bench_ddp --device cuda --width 64 --batch 64 --image 64
  # The Python peers of the benchmarks above (peer_<name>.py beside bench_<name>); the compiled one comes
  # last, with bench_compiled.
  for peer in bench/peer_*.py; do
    name=$(basename "$peer" .py)
    [[ $name == peer_compiled || $name == peer_optim ]] && continue
    wanted "${name#peer_}" || continue
    echo "== $name"
    PYTHONUNBUFFERED=1 within_budget 30 "$py" "$peer" >"$logs/$name.txt" 2>&1 || { echo "   FAILED (see $name.txt)"; st=1; }
  done
  if wanted optim; then
    echo "== peer_optim"
    PYTHONUNBUFFERED=1 within_budget 30 "$py" bench/peer_optim.py --device cuda "${opt[@]}" --json "$optim" \
      >"$logs/peer_optim.txt" 2>&1 || { echo "   FAILED (see peer_optim.txt)"; st=1; }
    # runs/optim-cuda-<date>-<commit>.jsonl in bench.tar.gz: this run for docs/runs/ (docs/optim-cuda.md).
    if [ -s "$optim" ]; then
      "$py" bench/report_optim.py "$optim" --docs "$logs" --name optim-cuda --keep "$logs/runs" \
        --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
        --command "PERF_GPU_BUDGET_S=$budget $invocation" >>"$logs/peer_optim.txt" 2>&1 ||
        { echo "   report FAILED (see peer_optim.txt)"; st=1; }
    fi
  fi
  # bench/resnet.py's packages: started by the build part where it ran in this call without the tests, else here.
  ((${#exports[@]})) || start_bench_exports
  packages=()
  for i in "${!variants[@]}"; do
    if wait "${exports[i]}"; then
      packages+=(--package "$work/resnet_cuda_${variants[i]}.pt2")
    else
      echo "   export ${variants[i]} FAILED (see export_${variants[i]}.log)"; st=1
    fi
  done
  # Python's compilations too, before anything is timed on the GPU (a failed one leaves the timed peer to compile).
  if [ -n "$peer_warmup" ]; then
    wait "$peer_warmup" || echo "   peer_compiled --compile-only stopped or FAILED (see peer_compiled_warmup.log)"
    cp "$build/gpu-work/logs/peer_compiled_warmup.log" "$logs"/ 2>/dev/null
  fi
  ((${#variants[@]})) && cp "$build"/gpu-work/logs/export_*.log "$logs"/ 2>/dev/null
  # bench_compiled and its Python peer (eager, torch.compile modes) into one results file, then the report.
  compiled=$logs/compiled-cuda.jsonl
  # The profiled calls' traces (bench_compiled --profile-traces): their lines, where each call's time goes
  # (bench/e2e/trace_table.py --calls), go in the summary, and the traces themselves in bench.tar.gz
  # (bench/profile-traces/), so that a question the lines leave open (which operation a gap comes before, a
  # kernel's launch dimensions) is answered on any machine after the session rather than in the next one. About
  # 10 rows of 10 graph replays of 135 kernels: a few MiB of JSON, far less compressed; past 64 MiB they stay out.
  traces=(--profile-traces "$logs/profile-traces")
  if ((${#packages[@]})); then
    run_bench bench_compiled --device cuda "${packages[@]}" --json "$compiled" "${traces[@]}"
    rc=$?
    if ((rc != 0 && rc != 124 && rc != 125 && rc != 137)); then
      # Failed other than by the budget (124, 137: stopped; 125: not started). Most likely perf::graph of a
      # package (an AOTInductor runner under CUDA graph capture), whether it crashed the process or threw: its
      # rows are left out, the rest measured again.
      why="died of signal $((rc - 128))"
      ((rc > 128)) || why="failed (exit $rc: $(tail -n 1 "$logs/bench_compiled.txt"))"
      echo "bench_compiled $why (log: bench_compiled-died.txt); again with --no-package-graphs" |
        tee "$logs/bench_compiled-died.note"
      mv "$logs/bench_compiled.txt" "$logs/bench_compiled-died.txt"
      rm -f "$compiled"
      rm -rf "$logs/profile-traces"
      run_bench bench_compiled --device cuda "${packages[@]}" --json "$compiled" --no-package-graphs "${traces[@]}"
    fi
    if compgen -G "$logs/profile-traces/*.json" >/dev/null; then
      "$py" bench/e2e/trace_table.py --calls "$logs"/profile-traces/*.json >"$logs/profile_calls.txt" 2>&1 ||
        echo "   trace_table.py --calls FAILED (see profile_calls.txt)"
      # The rows that ran the same kernels 8% apart at batch 1 on an H200 (docs/benchmarks.md), operation by
      # operation: the decision's graph against the same recipe pinned on a fresh model and decided with
      # autotune_candidates(false), and the eager recipe's graph against its NHWC-input twin. Each pair: the faster
      # row's name, then the start of the slower one's (the pinned recipe's name follows it).
      for pair in "perf::optimize(example)|perf::optimize(recipe pinned: " \
                  "perf::optimize(example)|perf::optimize(example, autotune_candidates(false))" \
                  "perf::graph(eager recipe)|perf::graph(eager recipe), NHWC static input"; do
        for b in 1 32; do
          fast_trace=$(grep -lF "\"call: ${pair%%|*} at batch $b\"" "$logs"/profile-traces/*.json | head -n 1)
          slow_trace=$(grep -lF "\"call: ${pair#*|}" "$logs"/profile-traces/*.json |
            xargs -r grep -lF " at batch $b\"" | head -n 1)
          if [ -n "$fast_trace" ] && [ -n "$slow_trace" ]; then
            "$py" bench/e2e/trace_table.py --diff "$fast_trace" "$slow_trace" >>"$logs/profile_calls.txt" 2>&1 ||
              echo "   trace_table.py --diff FAILED (see profile_calls.txt)"
          fi
        done
      done
      if (($(du -sm "$logs/profile-traces" | cut -f1) > 64)); then
        rm -rf "$work/profile-traces" && mv "$logs/profile-traces" "$work/profile-traces"
        echo "profile traces: over 64 MiB, left out of bench.tar.gz (on this machine: $work/profile-traces)" \
          >>"$logs/profile_calls.txt"
      fi
    fi
    peer_extra=(); ((quick)) && peer_extra=(--no-max-autotune)
    echo "== peer_compiled ${peer_extra[*]}"
    PYTHONUNBUFFERED=1 within_budget 15 "$py" bench/peer_compiled.py --device cuda --json "$compiled" "${peer_extra[@]}" \
      >"$logs/peer_compiled.txt" 2>&1 || { echo "   FAILED (see peer_compiled.txt)"; st=1; }
    # The table needs only Python; the chart is drawn where matplotlib is installed. runs/compiled-cuda-<date>-
    # <commit>.jsonl in bench.tar.gz is this run for docs/runs/, from which docs/compiled-cuda.md is written.
    "$py" bench/report_compiled.py "$compiled" --docs "$logs" --name compiled-cuda --keep "$logs/runs" \
      --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
      --command "PERF_GPU_BUDGET_S=$budget $invocation" >>"$logs/peer_compiled.txt" 2>&1 ||
      { echo "   report FAILED (see peer_compiled.txt)"; st=1; }
  fi
  {
    echo "== gpu-check bench ($(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
    [ -z "$built_line" ] || echo "$built_line"
    echo "-- headline ratios (B vs A: how many times faster B is)"
    grep -hE " vs .*: [0-9.]+x \(ratio of medians" "$logs"/bench_*.txt || true
    grep -hE "x \(|ratio|speedup" "$logs"/peer_*.txt 2>/dev/null | head -10 || true
    echo "-- optimizer memory traffic (bench_optim; goal: flat AdamW >= 80% of copy bandwidth)"
    grep -hE "copy bandwidth|^launch geometry" "$logs/bench_optim.txt" 2>/dev/null || true
    grep -h "^kept the run" "$logs/peer_optim.txt" 2>/dev/null || true
    grep -hE "\(goal (>=|>) " "$logs/optim-cuda.md" 2>/dev/null || true
    cat "$logs/bench_compiled-died.note" 2>/dev/null
    grep -h "^kept the run" "$logs/peer_compiled.txt" 2>/dev/null || true
    # How long each torch.compile mode took to compile cold (the warm-up beside the build) and then from the cache,
    # where the autotuning's timings came from.
    wanted compiled && echo "$inductor_line"
    grep -h "compiled in" "$logs/peer_compiled_warmup.log" 2>/dev/null | sed 's/^/Python warm-up: /' || true
    grep -h "compiled in" "$logs/peer_compiled.txt" 2>/dev/null | sed 's/^/Python timed run: /' || true
    grep -hE "^(## |\| )|\(goal >= " "$logs/compiled-cuda.md" 2>/dev/null || true
    if grep -qs "^perf::optimize: " "$logs/bench_compiled.txt"; then
      echo "-- perf::optimize's decision per batch (bench_compiled; every recipe eager and as a CUDA graph)"
      awk '/^perf::optimize: / { on = 1 } on { print } /^  decided in / { on = 0 }' "$logs/bench_compiled.txt"
    fi
    if grep -qs "^profile of " "$logs/bench_compiled.txt"; then
      echo "-- kernels a call of perf::optimize's rows and the eager recipe's graphs (bench_compiled.txt lists them)"
      grep -h "^profile of " "$logs/bench_compiled.txt"
      grep -hE "^(launch check|order check)" "$logs/bench_compiled.txt" || true
      grep -hE "^(calls of |profile traces: )" "$logs/profile_calls.txt" 2>/dev/null || true
      grep -h -A2 "^diff of " "$logs/profile_calls.txt" 2>/dev/null | grep -v "^--$" || true
    fi
  } >"$logs/summary.txt"
  finish bench $st "$t0"
  status=$((status | st))
fi

if has e2e && start_part e2e; then
  work=$build/gpu-work/e2e
  echo "== bench/e2e (Python vs C++ training jobs on the GPU)"
  e2e_args=("${jobs_arg[@]}" --profile-steps 2); ((quick)) && e2e_args+=(--quick)
  e2e_args+=("${e2e_more[@]}")  # after ours: PERF_E2E_ARGS="--profile-steps 0" turns the profile off
  rm -f "$work"/profile-*.md "$work"/failed-*.log  # an earlier call's jobs: not this one's
  # Stopped by the budget, the runs that finished are reported (run.py appends each to results.jsonl).
  PYTHONUNBUFFERED=1 within_budget 20 "$py" bench/e2e/run.py --e2e "$build/bench/e2e" --device cuda --out "$work" "${e2e_args[@]}" \
    >"$logs/e2e.txt" 2>&1 || { echo "   FAILED (see e2e.txt)"; st=1; }
  cp "$work/results.jsonl" "$work"/profile-*.md "$work"/failed-*.log "$logs/" 2>/dev/null || true
  # The table needs only Python; the charts are drawn where matplotlib is installed
  # (else: report.py on results.jsonl elsewhere). runs/e2e-cuda-<date>-<commit>.jsonl in e2e.tar.gz is
  # this run for docs/runs/, from which docs/e2e-cuda.md is written (docs/gpu-runs.md, "Still to run").
  if [ -s "$logs/results.jsonl" ]; then
    "$py" bench/e2e/report.py "$logs/results.jsonl" --docs "$logs" --name e2e-cuda --keep "$logs/runs" \
      --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
      --command "PERF_GPU_BUDGET_S=$budget $invocation" >>"$logs/e2e.txt" 2>&1 ||
      { echo "   report FAILED (see e2e.txt)"; st=1; }
  fi
  {
    echo "== gpu-check e2e ($(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
    [ -z "$built_line" ] || echo "$built_line"
    echo "$inductor_line"
    grep -E "^(python|cpp) |^exported|^kept the run|^--diagnose: |FAILED|e2e failed: |Exception in aoti_torch: " "$logs/e2e.txt" | cut -c1-600 || true
    grep -hE "^(## |\| |Failed: )|\(goal >= " "$logs/e2e-cuda.md" 2>/dev/null | cut -c1-900 || true
    echo "-- where a step's time goes (profile-<job>.md in e2e.tar.gz has each configuration's top kernels)"
    grep -E "^profile |no profile" "$logs/e2e.txt" || true
  } >"$logs/summary.txt"
  finish e2e $st "$t0"
  status=$((status | st))
fi
exit $status
