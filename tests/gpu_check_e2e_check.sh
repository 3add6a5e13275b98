#!/usr/bin/env bash
# scripts/gpu-check.sh --part e2e as a lent GPU machine runs it, here on the CPU: a stand-in
# nvidia-smi, a Python that answers gpu-check's "can torch use the GPU?" with yes (and runs the
# real Python otherwise), and a build folder whose bench/e2e is the real runner. run.py's own
# --device cpu (in PERF_E2E_ARGS, after gpu-check's --device cuda) trains on the CPU.
#   tests/gpu_check_e2e_check.sh <repo root> <python> <build/bench/e2e>
# Two calls: a --check run of the MLP (the summary's table, the run kept in e2e.tar.gz with the
# machine and the call's command), then a runner that fails unless cuDNN's benchmark mode is off,
# with --diagnose (the failure and its cause in the summary, the retry's row named by what it
# turned off, the part FAILED). Catches what breaks gpu-check's e2e part before a GPU call does.
set -uo pipefail
root=$1 python=$2 e2e=$3
source "$(dirname "$0")/check.sh"  # $work, check, $fails
source "$(dirname "$0")/gpu_standins.sh"  # nvidia-smi, $work/bin/python, $work/build
ln -s "$e2e" "$work/build/bench/e2e"

call() {  # <PERF_E2E_ARGS> <gpu-check arguments...>: exit status in $rc, results in $work/out
  local args=$1
  shift
  rm -rf "$work/out" "$work/tar"
  (cd "$root" && PATH="$work/bin:$PATH" PERF_PYTHON="$work/bin/python" PERF_GPU_BUILD="$work/build" \
    PERF_GPU_RESULTS="$work/out" PERF_GPU_BUDGET_S=200 PERF_E2E_ARGS="$args" \
    bash scripts/gpu-check.sh --part e2e "$@" >"$work/stdout" 2>&1)
  rc=$?
  mkdir -p "$work/tar" && tar xzf "$work/out/e2e.tar.gz" -C "$work/tar" 2>/dev/null
  summary=$(cat "$work/out/e2e-summary.txt" 2>/dev/null)
}

call "--device cpu --check --profile-steps 0" --jobs mlp
check "a --check run: gpu-check's e2e part passes (rc $rc)" test "$rc" = 0
check "its summary has the table" grep -q "^| C++ stock LibTorch fp32 | " <<<"$summary"
check_kept e2e e2e-cuda \
  'PERF_GPU_BUDGET_S=200 PERF_E2E_ARGS="--device cpu --check --profile-steps 0" bash scripts/gpu-check.sh --part e2e --jobs mlp'
check "the kept run has the MLP's two rows" test "$(wc -l <"${kept:-/dev/null}")" = 2

cat >"$work/picky" <<EOF
#!/usr/bin/env bash
case " \$* " in *" --info "* | *" --cudnn-benchmark false "*) exec "$e2e" "\$@" ;; esac
echo "e2e failed: the convolution failed with cuDNN benchmark on" >&2
exit 1
EOF
chmod +x "$work/picky"
ln -sf "$work/picky" "$work/build/bench/e2e"
call "--device cpu --configs perf --diagnose --profile-steps 0" --quick --jobs mlp
check "a failed row: the part FAILED (rc $rc)" test "$rc" = 1
check "the summary says --diagnose ran it again" grep -q "^--diagnose: cpp mlp perf again with cuDNN benchmark off" <<<"$summary"
check "the summary has the failure's cause" \
  grep -qF "Failed: C++ perf recipe: rc 1: e2e failed: the convolution failed with cuDNN benchmark on." <<<"$summary"
check "and the retry's row, named by what it turned off" grep -q "^| C++ perf recipe (cuDNN benchmark off) | " <<<"$summary"
check "and the compiled-training goal, not judged without its rows" \
  grep -qF "against Python torch.compile + recipe (goal >= 1.0x: not judged: no C++ row in this run)" <<<"$summary"

finish_check "gpu-check e2e part"
