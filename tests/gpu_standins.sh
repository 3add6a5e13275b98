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
