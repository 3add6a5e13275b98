#!/usr/bin/env bash
# scripts/gpu-check.sh --part bench --bench optim as a lent GPU machine runs it, here on the CPU: the stand-ins
# of tests/gpu_standins.sh, bench_optim and bench/peer_optim.py each run on the CPU for two timed steps
# (gpu-check's --device cuda and --iters replaced). Its summary has the flat-optimizer goals judged from the run's
# rows, and bench.tar.gz keeps the run (runs/optim-cuda-*.jsonl) with the machine and the call's command.
#   tests/gpu_check_bench_check.sh <repo root> <python> <build/bench/bench_optim>
set -uo pipefail
root=$1 python=$2 bench_optim=$3
source "$(dirname "$0")/check.sh"  # $work, check, $fails
source "$(dirname "$0")/gpu_standins.sh"  # nvidia-smi, $work/bin/python, $work/build

# Both on the CPU, briefly: of the options gpu-check gives, --json alone is kept.
cpu_args='json=
while [ $# -gt 0 ]; do
  case $1 in --json) json=$2; shift 2 ;; --device | --iters | --warmup) shift 2 ;; *) shift ;; esac
done'
cat >"$work/build/bench/bench_optim" <<EOF
#!/usr/bin/env bash
$cpu_args
exec "$bench_optim" --device cpu --iters 2 --warmup 0 --json "\$json"
EOF
mv "$work/bin/python" "$work/bin/python-standin"
cat >"$work/bin/python" <<EOF
#!/usr/bin/env bash
if [[ \${1:-} == bench/peer_optim.py ]]; then
  $cpu_args
  exec "$python" bench/peer_optim.py --device cpu --iters 2 --warmup 0 --json "\$json"
fi
exec "$work/bin/python-standin" "\$@"
EOF
chmod +x "$work/build/bench/bench_optim" "$work/bin/python"

(cd "$root" && PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" PERF_GPU_BUILD="$work/build" \
  PERF_GPU_RESULTS="$work/out" PERF_GPU_BUDGET_S=200 bash scripts/gpu-check.sh --part bench --bench optim --quick \
  >"$work/stdout" 2>&1)
rc=$?
mkdir -p "$work/tar" && tar xzf "$work/out/bench.tar.gz" -C "$work/tar" 2>/dev/null
summary=$(cat "$work/out/bench-summary.txt" 2>/dev/null)
check "gpu-check's bench part passes (rc $rc)" test "$rc" = 0
check "its summary has the copy bandwidth" grep -q "^copy bandwidth (1 GiB copy_, read+write): " <<<"$summary"
goal='^- perf (AdamW|Adam|SGD) \(flat\): [0-9.]+x perf .* \(goal >?=? ?1\.0x: (met|not met)\)$'
check "and the flat-optimizer goals, judged (four on these CPU rows)" test "$(grep -cE "$goal" <<<"$summary")" = 4
check_kept bench optim-cuda 'PERF_GPU_BUDGET_S=200 bash scripts/gpu-check.sh --part bench --bench optim --quick'
check "the kept run has bench_optim's rows and the peer's" "$python" -c '
import json, sys
sys.exit(0 if {json.loads(line)["lang"] for line in open(sys.argv[1])} == {"cpp", "python"} else 1)' "${kept:-/dev/null}"

finish_check "gpu-check bench part"
