#!/usr/bin/env bash
# Exports bench/resnet.py to an AOTInductor package (tools/export_compiled.py)
# and times it against LibTorch eager in bench/bench_compiled.
#   bash scripts/bench-compiled.sh [--device cuda] [--width 32] [--image 64] [--batches 1 32]
# PERF_PYTHON: the Python that exports (default: the venv that provides LibTorch).
source "$(dirname "$0")/common.sh"
device=cpu width=32 image=64
args=("$@")
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
# fp32, and bf16 + channels-last (perf's recipe, compiled): exported once, kept in bench-results/.
packages=()
for variant in fp32 bf16_nhwc; do
  pkg=bench-results/resnet_w${width}_i${image}_${device}_${variant}.pt2
  extra=()
  [[ $variant == bf16_nhwc ]] && extra=(--dtype bfloat16 --channels-last)
  if [[ ! -f $pkg || bench/resnet.py -nt $pkg || tools/export_compiled.py -nt $pkg ]]; then
    "$python" tools/export_compiled.py bench/resnet.py:make_resnet -o "$pkg" --kwargs "{\"width\": $width}" \
      --input "8,3,$image,$image" --dynamic-batch 1:64 --device "$device" "${extra[@]}"
  fi
  packages+=(--package "$pkg")
done
./build/bench/bench_compiled "${packages[@]}" "$@"
