#!/usr/bin/env bash
# Builds and runs the perf demo (stock LibTorch vs perf, side by side).
# Installs what is missing first (scripts/bootstrap.sh). Extra arguments go to
# the demo, e.g. scripts/demo.sh --steps 20 --device cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=$(bash scripts/bootstrap.sh | tail -n 1)
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/perf/ccache}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build build --target demo
./build/examples/demo "$@"
