#!/usr/bin/env bash
# Times perf::optim against torch::optim and its own flat mode (bench/bench_optim), then Python torch.optim
# (fused and foreach) on the same parameter sets (bench/peer_optim.py); table and chart into
# docs/optim-<device>.md, the run kept in docs/runs/.
#   bash scripts/bench-optim.sh [--device cuda] [--iters 20] [--warmup 3]
# PERF_PYTHON: the Python of the peer and the report (default: the venv that provides LibTorch). PERF_DOCS_SUFFIX=avx2:
# the page is docs/optim-<device>-avx2.md, for a kind of CPU whose page should not replace the main one.
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
"$python" bench/report_optim.py "$results" --docs docs --name "optim-$device${PERF_DOCS_SUFFIX:+-$PERF_DOCS_SUFFIX}" \
  --machine "$(perf_machine "$device")" --keep docs/runs \
  --command "bash scripts/bench-optim.sh${*:+ $*}"
