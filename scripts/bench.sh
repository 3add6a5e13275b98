#!/usr/bin/env bash
# Builds and runs perf's benchmarks; results go to stdout and bench-results/.
# Record what they print in docs/benchmarks.md (device, versions, date, commit).
source "$(dirname "$0")/common.sh"
perf_configure build --log-level=ERROR >/dev/null
targets=(bench_setup bench_optim bench_amp bench_data bench_graph)
cmake --build build --target "${targets[@]}"
mkdir -p bench-results
for t in "${targets[@]}"; do
  echo "== $t"
  case $t in
    bench_setup) ./build/bench/"$t" --benchmark_out=bench-results/"$t".json --benchmark_out_format=json ;;
    *) ./build/bench/"$t" | tee bench-results/"$t".txt ;;
  esac
done
