#!/usr/bin/env bash
# Builds and runs perf's whole test suite:
#   build/        CUDA support compiled in (as LibTorch reports it): every test,
#                 the consumer projects, the per-header checks and the programs
#                 (examples, benchmarks: one translation unit, PERF_PROGRAMS_UNITY),
#                 with -D_FORTIFY_SOURCE=2 (warn_unused_result on system() & co.);
#   build-nocuda/ PERF_WITH_CUDA=OFF, under AddressSanitizer + UndefinedBehaviorSanitizer,
#                 linked to perf::perf_static (PERF_SEPARATE_COMPILATION), with libstdc++'s
#                 bounds and precondition checks (-D_GLIBCXX_ASSERTIONS: operator[] past the end,
#                 front() of an empty container, which ASan alone misses inside capacity);
#   build-tsan/   the threaded suites (prefetcher, loader, concurrent setup())
#                 under ThreadSanitizer.
# Installs what is missing first (scripts/bootstrap.sh).

# PERF_TEST_SUITES picks some of the three (default: all, which is what CI runs), so that a machine
# lent for 10-minute commands runs them in two calls: PERF_TEST_SUITES=cuda, then asan,tsan.
suites=${PERF_TEST_SUITES:-cuda,asan,tsan}
n_suites=0
for s in ${suites//,/ }; do
  case $s in cuda | asan | tsan) n_suites=$((n_suites + 1)) ;; *)
    echo "test.sh: PERF_TEST_SUITES has '$s'; valid: cuda, asan, tsan (comma-separated; default all three)" >&2
    exit 2 ;;
  esac
done
((n_suites > 0)) || { echo "test.sh: PERF_TEST_SUITES='$suites' names no suite; valid: cuda, asan, tsan" >&2; exit 2; }
wanted() { [[ ",$suites," == *",$1,"* ]]; }

run_started=$(date +%s)
source "$(dirname "$0")/common.sh"
jobs=${PERF_JOBS:-$(nproc)}

# How many compiles the cache served, printed however the run ends: a warm run that compiles
# everything again (a changed locale, CUDA path, flag) shows here first. One line per run is also
# kept in ~/.cache/perf/test-runs.log (when, commit, exit status, time, cache), so the runs a CI
# runner made on this machine can be read afterwards.
ccache_counts() {  # prints "<hits> <misses>" of the whole cache so far
  command -v ccache >/dev/null || { echo 0 0; return; }
  ccache --print-stats | awk '$1 ~ /^(direct|preprocessed)_cache_hit$/ { h += $2 }
                              $1 == "cache_miss" { m += $2 } END { print h + 0, m + 0 }'
}
read -r ccache_hits0 ccache_misses0 < <(ccache_counts)
run_report() {
  local rc=$? hits misses line
  read -r hits misses < <(ccache_counts)
  line="$((hits - ccache_hits0)) compiles from the cache, $((misses - ccache_misses0)) compiled"
  command -v ccache >/dev/null || line="no ccache"
  [ "$suites" = cuda,asan,tsan ] || line+=", suites $suites only"
  echo "== ccache ($CCACHE_DIR): $line; test.sh took $(($(date +%s) - run_started)) s"
  echo "$(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo '-') exit $rc" \
       "$(($(date +%s) - run_started)) s, $line, $PWD" >>"$HOME/.cache/perf/test-runs.log" 2>/dev/null || true
}
trap run_report EXIT
trap 'exit 130' INT  # so that the report says how a stopped run ended
trap 'exit 143' TERM

# On many cores (a GPU machine's 16) each test gets two intra-op threads and one Inductor compile
# thread, as scripts/gpu-check.sh runs them: LibTorch's and Inductor's defaults, a thread and a compile
# process per core in every test, oversubscribe the cores many-fold (tests that start Python took
# 64-126 s under -j16 on an H100's 16 cores). And ctest runs cores / 2 tests at once, not one per
# core: 16 at once on an H100 machine (32 threads) had the five Python exporter tests at 60-80 s
# (dba86b3), over the 60 s a test may take, against 27-34 s on CI's 2 cores two at a time. The build
# keeps every core. CI's 2 cores keep the defaults.
test_env=()
ctest_jobs=$jobs
if ((jobs >= 8)); then
  test_env=(OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}")
  ctest_jobs=$((jobs / 2))
fi

# A suite that fails does not stop the next: a GPU machine lent for a few calls learns every suite's state
# from one (at a885395 the ASan suite's failure left ThreadSanitizer's unrun). The run fails at the end, naming them.
failed_suites=()
# Each suite's time goes to the log in two parts, so that a slow run (a fresh CI's limit is 30 minutes) says where.
run_suite() {  # <name> <build dir> <extra cmake args...>
  local name=$1 dir=$2 t0 t1
  shift 2
  t0=$(date +%s) t1=
  if ! { perf_configure "$dir" "$@" && cmake --build "$dir" -j "$jobs" && t1=$(date +%s) &&
         (cd "$dir" && env "${test_env[@]}" ctest --output-on-failure -j "$ctest_jobs"); }; then
    failed_suites+=("$name")
    echo "== test.sh: the $name suite FAILED (above); going on with the others"
  fi
  if [ -n "$t1" ]; then
    echo "== $name suite: configure and build $((t1 - t0)) s, tests $(($(date +%s) - t1)) s"
  else
    echo "== $name suite: configure and build stopped after $(($(date +%s) - t0)) s"
  fi
}

if wanted cuda; then
  echo "== perf tests, CUDA support as LibTorch reports it, _FORTIFY_SOURCE=2 (as Ubuntu's g++ builds by default)"
  run_suite cuda build -DCMAKE_CXX_FLAGS=-D_FORTIFY_SOURCE=2 -DPERF_PROGRAMS_UNITY=ON
fi
if wanted asan; then
  echo "== perf tests, PERF_WITH_CUDA=OFF, AddressSanitizer + UndefinedBehaviorSanitizer, _GLIBCXX_ASSERTIONS, perf::perf_static"
  run_suite asan build-nocuda -DPERF_WITH_CUDA=OFF -DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF \
    -DPERF_SANITIZE=address,undefined -DPERF_TESTS_SEPARATE_COMPILATION=ON -DCMAKE_CXX_FLAGS=-D_GLIBCXX_ASSERTIONS
fi
if wanted tsan; then
  echo "== perf threaded tests, ThreadSanitizer"
  run_suite tsan build-tsan -DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF -DPERF_SANITIZE=thread
fi
if ((${#failed_suites[@]})); then
  echo "== test.sh: FAILED suites: ${failed_suites[*]} (of $suites)"
  exit 1
fi
