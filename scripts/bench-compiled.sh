#!/usr/bin/env bash
# Exports bench/resnet.py to AOTInductor packages (tools/export_compiled.py),
# times them against LibTorch eager and perf::optimize in bench/bench_compiled,
# then Python (eager, torch.compile modes) on the same model and batches
# (bench/peer_compiled.py); table and chart into docs/compiled-<device>.md, the run kept in docs/runs/.
#   bash scripts/bench-compiled.sh [--device cuda] [--width 32] [--image 64] [--batches 1 32] [--no-max-autotune]
# --no-max-autotune: leave out Python's torch.compile max-autotune row (minutes to compile on CUDA).
# PERF_PYTHON: the Python that exports (default: the venv that provides LibTorch). PERF_DOCS_SUFFIX=avx2: the page
# is docs/compiled-<device>-avx2.md, for a kind of CPU whose page should not replace the main one (scripts/common.sh).
source "$(dirname "$0")/common.sh"
device=cpu width=32 image=64 peer_only=()
args=()
for arg in "$@"; do  # --no-max-autotune is the Python peer's alone
  if [[ $arg == --no-max-autotune ]]; then peer_only=(--no-max-autotune); else args+=("$arg"); fi
done
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --device) device=${args[i + 1]} ;;
    --width) width=${args[i + 1]} ;;
    --image) image=${args[i + 1]} ;;
  esac
done
python=${PERF_PYTHON:-${PERF_TORCH_PREFIX%/lib/python*}/bin/python}
perf_configure build --log-level=ERROR >/dev/null
cmake --build build --target bench_compiled >/dev/null
mkdir -p bench-results
# fp32, and bf16 + channels-last (perf's recipe, compiled), for batches 1 to 64; fp32 with static shapes
# for batch 1 (as torch.compile specialises on the first shape it sees): exported once, kept in bench-results/.
packages=()
for variant in fp32 fp32_b1 bf16_nhwc; do
  pkg=bench-results/resnet_w${width}_i${image}_${device}_${variant}.pt2
  extra=() shape=(--input "8,3,$image,$image" --dynamic-batch "1:64")
  [[ $variant == bf16_nhwc ]] && extra=(--dtype bfloat16 --channels-last)
  [[ $variant == fp32_b1 ]] && shape=(--input "1,3,$image,$image" --dynamic-batch static)
  if [[ ! -f $pkg || bench/resnet.py -nt $pkg || tools/export_compiled.py -nt $pkg ]]; then
    "$python" tools/export_compiled.py bench/resnet.py:make_resnet -o "$pkg" --kwargs "{\"width\": $width}" \
      "${shape[@]}" --device "$device" "${extra[@]}"
  fi
  packages+=(--package "$pkg")
done
results=bench-results/compiled-$device.jsonl
rm -f "$results"
./build/bench/bench_compiled "${packages[@]}" --json "$results" "${args[@]}"
# Python's side on the same model and batches: eager, torch.compile modes.
peer_args=(--device "$device" --width "$width" --image "$image" --json "$results" "${peer_only[@]}")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --batches)
      peer_args+=(--batches)
      j=$((i + 1))
      while ((j < ${#args[@]})) && [[ ${args[j]} != --* ]]; do peer_args+=("${args[j]}"); j=$((j + 1)); done ;;
    --iters) peer_args+=(--iters "${args[i + 1]}") ;;
  esac
done
"$python" bench/peer_compiled.py "${peer_args[@]}"
"$python" -c "import matplotlib" 2>/dev/null || "$python" -m pip install --quiet --disable-pip-version-check matplotlib >&2
# The run is kept in docs/runs/ (bench/runs.py), the way this call was made beside it.
"$python" bench/report_compiled.py "$results" --docs docs --name "compiled-$device${PERF_DOCS_SUFFIX:+-$PERF_DOCS_SUFFIX}" \
  --machine "$(perf_machine "$device")" \
  --keep docs/runs --command "bash scripts/bench-compiled.sh${*:+ $*}"
