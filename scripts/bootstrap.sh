#!/usr/bin/env bash
# Installs what perf's build, tests, examples and benchmarks need on a fresh
# Debian machine, skipping whatever is already there, and prints the CMake
# prefix of LibTorch on its last line.
#
#   - Debian packages: cmake, g++, ninja, ccache, GoogleTest, Google Benchmark, CLI11,
#     Gloo's headers (libgloo-dev: the wheel lacks them; perf/distributed.h's Gloo backend)
#   - LibTorch: the PyPI torch==2.11.0 wheel (its CUDA 13.0 build) in a
#     virtualenv kept outside the clone, reused when present:
#     $PERF_VENV (default ~/.cache/perf/venv-torch-2.11.0). Its python is also
#     the numerical reference for the tests.
#
# A user who already has LibTorch (official zip, source build, other wheel)
# does not need this script: pass -DTorch_DIR=... or CMAKE_PREFIX_PATH to CMake.
set -euo pipefail

TORCH_VERSION=${PERF_TORCH_VERSION:-2.11.0}  # scripts/test-matrix.sh picks others
PERF_VENV=${PERF_VENV:-$HOME/.cache/perf/venv-torch-$TORCH_VERSION}

log() { echo "[bootstrap] $*" >&2; }

need_pkgs=()
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for p in cmake g++ clang ninja-build ccache googletest libgtest-dev libbenchmark-dev libcli11-dev libgloo-dev python3-venv; do
  have "$p" || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
  log "installing Debian packages: ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >&2
fi

py="$PERF_VENV/bin/python"
if ! "$py" -c "import torch, numpy, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION into $PERF_VENV (a few GB, once)"
  PY=${PERF_BASE_PYTHON:-python3}
  [ -x "$py" ] || "$PY" -m venv "$PERF_VENV" >&2
  "$py" -m pip install --quiet --progress-bar off --disable-pip-version-check "torch==$TORCH_VERSION" numpy >&2
fi
"$py" -c "import torch; print(torch.utils.cmake_prefix_path)"
