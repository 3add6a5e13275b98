#!/usr/bin/env bash
# Runs bench/bench_ddp with WORLD ranks (default 2) on 127.0.0.1, as torchrun
# would; rank 0 prints the comparison. Extra arguments go to every rank.
#   bash scripts/bench-ddp.sh [world] [--iters N ...]
source "$(dirname "$0")/common.sh"
world=2
if [[ ${1:-} =~ ^[0-9]+$ ]]; then world=$1; shift; fi
perf_configure build --log-level=ERROR >/dev/null
cmake --build build --target bench_ddp >/dev/null
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
pids=()
for ((r = 1; r < world; r++)); do
  RANK=$r WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 600 ./build/bench/bench_ddp "$@" >/dev/null &
  pids+=($!)
done
RANK=0 WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 600 ./build/bench/bench_ddp "$@"
status=$?
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
