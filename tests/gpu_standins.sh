# Sourced by the tests of scripts/gpu-check.sh on the CPU (tests/gpu_check_*_check.sh), after check.sh:
# in $work/bin a stand-in nvidia-smi and a Python ($work/bin/python) that answers gpu-check's "can
# torch use the GPU?" with yes and runs $python otherwise; $work/build/tests/perf_tests, gpu-check's
# "is there a build?". Each test puts its own programs in $work/build/bench.
mkdir -p "$work/bin" "$work/build/tests" "$work/build/bench"
cat >"$work/bin/nvidia-smi" <<'SMI'
#!/bin/sh
case "$*" in -L) echo "GPU 0: Stand-in GPU (UUID: none)" ;; *) echo "Stand-in GPU" ;; esac
SMI
cat >"$work/bin/python" <<PY
#!/bin/sh
if [ "\$1" = -c ] && case "\$2" in *cuda.is_available*) true ;; *) false ;; esac; then exit 0; fi
exec "$python" "\$@"
PY
printf '#!/bin/sh\nexit 0\n' >"$work/build/tests/perf_tests"
chmod +x "$work/bin/"* "$work/build/tests/perf_tests"

# The test's end: on a failure gpu-check's output ($work/stdout) and $summary, and exit 1.
finish_check() {  # <what passed>
  if ((fails)); then
    echo "== gpu-check's output"
    cat "$work/stdout"
    echo "== summary"
    echo "$summary"
    exit 1
  fi
  echo "$1: ok"
}

# After a call: <part>.tar.gz unpacked in $work/tar keeps the run as runs/<name>-*.jsonl (its path in $kept),
# $summary says so, and every kept row names the stand-in machine and the call as typed.
check_kept() {  # <part> <name> <the call as typed>
  kept=$(ls "$work/tar/$1/runs/$2"-*.jsonl 2>/dev/null | head -1)
  check "the run is kept in $1.tar.gz (runs/$2-*.jsonl), and the summary says so" \
    test -n "$kept" -a -n "$(grep "^kept the run in .*$(basename "${kept:-none}")" <<<"$summary")"
  check "each kept row names the machine and the call as typed" "$python" -c '
import json, sys
runs = [json.loads(line)["run"] for line in open(sys.argv[1])]
sys.exit(0 if runs and all(r == runs[0] for r in runs) and runs[0]["machine"] == "Stand-in GPU"
         and runs[0]["command"] == sys.argv[2] else 1)' "${kept:-/nonexistent}" "$3"
}
