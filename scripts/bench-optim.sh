#!/usr/bin/env bash
# Times perf::optim against torch::optim and its own flat mode (bench/bench_optim), then Python torch.optim
# (fused and foreach) on the same parameter sets (bench/peer_optim.py); table and chart into
# docs/optim-<device>.md, the run kept in docs/runs/.
#   bash scripts/bench-optim.sh [--device cuda] [--iters 20] [--warmup 3]
# PERF_PYTHON: the Python of the peer and the report (default: the venv that provides LibTorch).
source "$(dirname "$0")/common.sh"
device=cpu
for ((i = 1; i <= $#; i++)); do [[ ${!i} == --device ]] && { j=$((i + 1)); device=${!j}; }; done
python=${PERF_PYTHON:-${PERF_TORCH_PREFIX%/lib/python*}/bin/python}
perf_configure build --log-level=ERROR >/dev/null
cmake --build build --target bench_optim >/dev/null
mkdir -p bench-results
results=bench-results/optim-$device.jsonl
rm -f "$results"
./build/bench/bench_optim --json "$results" "$@"
"$python" bench/peer_optim.py --json "$results" "$@"  # the same options: --device, --iters, --warmup
"$python" -c "import matplotlib" 2>/dev/null ||
  "$python" -m pip install --quiet --disable-pip-version-check matplotlib >&2
machine="$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
[[ $device == cuda ]] && machine="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), host $machine"
"$python" bench/report_optim.py "$results" --docs docs --name "optim-$device" --machine "$machine" --keep docs/runs \
  --command "bash scripts/bench-optim.sh${*:+ $*}"
