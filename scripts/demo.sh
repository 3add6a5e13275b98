#!/usr/bin/env bash
# Builds and runs the perf demo (stock LibTorch vs perf, side by side).
# Installs what is missing first (scripts/bootstrap.sh). Extra arguments go to
# the demo, e.g. scripts/demo.sh --steps 20 --device cuda.
source "$(dirname "$0")/common.sh"
perf_configure build --log-level=ERROR >/dev/null
cmake --build build --target demo
./build/examples/demo "$@"
