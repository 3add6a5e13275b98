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
#     the numerical reference for the tests (with PyPI's safetensors, for
#     perf's .safetensors files).
#
# A user who already has LibTorch (official zip, source build, other wheel)
# does not need this script: pass -DTorch_DIR=... or CMAKE_PREFIX_PATH to CMake.
#
# Without apt (a lent GPU machine): PERF_DEPS_DIR=perf-deps (scripts/gpu-deps.sh)
# and PERF_VENV=<a venv with torch and numpy>; it then installs nothing.
set -euo pipefail

TORCH_VERSION=${PERF_TORCH_VERSION:-2.11.0}  # scripts/test-matrix.sh picks others
PERF_VENV=${PERF_VENV:-$HOME/.cache/perf/venv-torch-$TORCH_VERSION}

log() { echo "[bootstrap] $*" >&2; }

py="$PERF_VENV/bin/python"
torch_ok="" torch_prefix=""  # asked once
# Found, not imported (importing torch takes 2-3 s, and every test run starts here): torch's version as
# bench/runs.py reads it (torch/version.py), and torch.utils.cmake_prefix_path as that module makes it.
torch_ready() {
  if [ -z "$torch_ok" ]; then
    read -r torch_ok torch_prefix < <("$py" -c 'import importlib.util as u, os, sys
sys.path.insert(0, sys.argv[1])
from runs import torch_version
t = u.find_spec("torch")
print(int(u.find_spec("numpy") is not None and torch_version().split("+")[0] == sys.argv[2]),
      os.path.join(os.path.dirname(t.origin), "share", "cmake"))' "$(cd "$(dirname "$0")/../bench" && pwd)" \
      "$TORCH_VERSION" 2>/dev/null || echo 0)
  fi
  [ "$torch_ok" = 1 ]
}

# A package counts as there when Debian has it installed, or when what the build takes from it is there
# otherwise: a tool on PATH, or the offline copy in PERF_DEPS_DIR that scripts/gpu-deps.sh makes. So a
# machine without a package manager or internet (a lent GPU machine: PERF_DEPS_DIR=perf-deps,
# PERF_VENV=/opt/torch/.venv) runs the whole suite as well.
deps=${PERF_DEPS_DIR:-}
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
provided() {
  case $1 in
    cmake | g++ | ccache) command -v "$1" ;;
    clang) command -v clang++ ;;
    ninja-build) command -v ninja ;;
    googletest | libgtest-dev) [ -f "$deps/googletest/CMakeLists.txt" ] ;;
    libbenchmark-dev) [ -d "$deps/benchmark-prefix/include/benchmark" ] ;;
    libcli11-dev) [ -f "$deps/CLI11/CLI/CLI.hpp" ] ;;
    libgloo-dev) [ -f "$deps/gloo-include/gloo/config.h" ] ;;
    python3-venv) torch_ready ;;  # only needed to make the venv
    *) false ;;
  esac
} >/dev/null 2>&1
optional() { [ "$1" = clang ] || [ "$1" = ccache ]; }  # without them: consumer_clang skips; no compile cache

need_pkgs=()
for p in cmake g++ clang ninja-build ccache googletest libgtest-dev libbenchmark-dev libcli11-dev libgloo-dev python3-venv; do
  have "$p" || provided "$p" || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})) && ! command -v apt-get >/dev/null; then
  missing=()
  for p in "${need_pkgs[@]}"; do
    if optional "$p"; then log "no $p and no apt-get: going on without it"; else missing+=("$p"); fi
  done
  ((${#missing[@]} == 0)) || {
    log "missing ${missing[*]}, and no apt-get to install them. Tools must be on PATH; GoogleTest, Google" \
      "Benchmark, CLI11 and Gloo's headers can come from PERF_DEPS_DIR (made on a connected machine by" \
      "scripts/gpu-deps.sh DIR); LibTorch from PERF_VENV (a venv with torch==$TORCH_VERSION and numpy)"
    exit 1
  }
  need_pkgs=()
fi
if ((${#need_pkgs[@]})); then
  # The optional ones install apart, and a failure there is not the run's: a lent GPU machine has apt-get
  # but no network, and goes on without clang and ccache as a machine without apt-get does.
  required=() wished=()
  for p in "${need_pkgs[@]}"; do if optional "$p"; then wished+=("$p"); else required+=("$p"); fi; done
  log "installing Debian packages: ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2 || ((${#required[@]} == 0))
  ((${#required[@]} == 0)) || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${required[@]}" >&2
  if ((${#wished[@]})) && ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${wished[@]}" >&2; then
    log "could not install ${wished[*]}: going on without them"
  fi
fi

if ! torch_ready; then
  log "installing torch==$TORCH_VERSION into $PERF_VENV (a few GB, once)"
  PY=${PERF_BASE_PYTHON:-python3}
  [ -x "$py" ] || "$PY" -m venv "$PERF_VENV" >&2
  "$py" -m pip install --quiet --progress-bar off --disable-pip-version-check "torch==$TORCH_VERSION" numpy >&2
  torch_ok=""  # found again, and this once imported
  torch_ready && "$py" -c "import torch, numpy" >&2 ||
    { log "torch==$TORCH_VERSION with numpy still does not import from $py"; exit 1; }
fi
# Python's safetensors: the tests' reference for perf's .safetensors reader and writer. Optional: without a
# network (PERF_DEPS_DIR, a lent GPU machine) it goes on without it, and the tests that need it say they skipped.
if ! "$py" -c "import safetensors" 2>/dev/null; then
  if [ -n "$deps" ]; then
    log "no safetensors in $PERF_VENV, and no network to install it: the tests comparing with it skip"
  else
    log "installing safetensors into $PERF_VENV (the tests' reference for .safetensors files)"
    "$py" -m pip install --quiet --progress-bar off --disable-pip-version-check safetensors >&2 ||
      log "could not install safetensors: the tests comparing with it skip"
  fi
fi
echo "$torch_prefix"
