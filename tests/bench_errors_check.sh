#!/usr/bin/env bash
# How a benchmark program ends on an error (bench/program.h): exit status 1 and "<program>: <message>" as stderr's
# one line, without LibTorch's backtrace, which TORCH_SHOW_CPP_STACKTRACES=1 brings back. An unwritable --json
# fails before anything is measured or loaded.
#   tests/bench_errors_check.sh <build/bench/bench_optim> <build/bench/bench_compiled>
set -uo pipefail
bench_optim=$1 bench_compiled=$2
source "$(dirname "$0")/check.sh"  # $work, check, $fails

ends_with_message() {  # <program> <expected stderr line> <args...>: exit 1, stderr that one line only
  local program=$1 expected=$2
  shift 2
  local rc=0
  env -u TORCH_SHOW_CPP_STACKTRACES "$program" "$@" >"$work/out" 2>"$work/err" || rc=$?
  check "$(basename "$program") $* exits with 1 (got $rc)" [ "$rc" = 1 ]
  check "its stderr is the one line '$expected' (got: $(head -c 600 "$work/err"))" \
    [ "$(cat "$work/err")" = "$expected" ]
}

no_dir=$work/no-such-dir
ends_with_message "$bench_optim" "bench_optim: cannot open --json $no_dir/optim.jsonl to append to" \
  --device cpu --iters 1 --json "$no_dir/optim.jsonl"
check "bench_optim measured nothing before it failed" bash -c "! grep -q 'ms' '$work/out'"
ends_with_message "$bench_compiled" "bench_compiled: cannot open --json $no_dir/compiled.jsonl to append to" \
  --package "$work/none.pt2" --json "$no_dir/compiled.jsonl"
ends_with_message "$bench_compiled" "bench_compiled: perf::CompiledModel: cannot open '$work/none.pt2' (no such file \
or not readable). Write packages with tools/export_compiled.py." --package "$work/none.pt2"

# The backtrace where the user asks for it, as PyTorch's own switch does.
TORCH_SHOW_CPP_STACKTRACES=1 "$bench_compiled" --package "$work/none.pt2" >/dev/null 2>"$work/err"
check "TORCH_SHOW_CPP_STACKTRACES=1 prints where LibTorch raised it" grep -q "Exception raised from" "$work/err"

((fails == 0))
