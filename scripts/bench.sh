#!/usr/bin/env bash
# Builds and runs perf's benchmarks; results go to stdout and bench-results/.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=$(bash scripts/bootstrap.sh | tail -n 1)
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/perf/ccache}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
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
