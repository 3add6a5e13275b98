#!/usr/bin/env bash
# scripts/bootstrap.sh on a machine without a package manager (a lent GPU machine): what the
# build needs comes from PATH, PERF_DEPS_DIR and PERF_VENV, and nothing is installed.
#   tests/bootstrap_offline_check.sh <repo root> <python of a venv with torch and numpy>
# Runs it with a PATH that has no apt-get, a dpkg-query that knows no package and the
# tools as links, three ways: everything there (prints LibTorch's prefix), the offline
# copies missing (a clear error naming them and scripts/gpu-deps.sh), clang++ and
# ccache missing too (it goes on without them, saying so). Then with an apt-get that
# cannot reach its archive (a lent GPU machine has one, without a network): without
# clang++ and ccache it goes on, saying so; without a package the build needs it stops.
set -uo pipefail
root=$1 python=$2
venv=$(dirname "$(dirname "$python")")
# LibTorch's prefix as torch says it (bootstrap.sh works it out without importing torch).
prefix=$("$venv/bin/python" -c "import torch, numpy; print(torch.utils.cmake_prefix_path)" 2>/dev/null) ||
  { echo "skipped: $python is not the python of a venv with torch and numpy (bootstrap.sh's PERF_VENV)"; exit 0; }
# The venv's torch is the version bootstrap.sh is asked for (scripts/test-matrix.sh's venvs hold others).
version=$("$venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
source "$(dirname "$0")/check.sh"  # $work, check, $fails

bin=$work/bin
mkdir -p "$bin"
printf '#!/bin/sh\nexit 1\n' >"$bin/dpkg-query"  # no Debian package installed
chmod +x "$bin/dpkg-query"
for t in bash sh grep id dirname cmake g++ ninja ccache clang++; do
  p=$(command -v "$t") && ln -s "$p" "$bin/$t"
done
for t in cmake g++ ninja; do
  [ -e "$bin/$t" ] || { echo "skipped: $t is not on PATH here"; exit 0; }
done

deps=$work/deps
mkdir -p "$deps/googletest" "$deps/benchmark-prefix/include/benchmark" "$deps/CLI11/CLI" "$deps/gloo-include/gloo"
touch "$deps/googletest/CMakeLists.txt" "$deps/CLI11/CLI/CLI.hpp" "$deps/gloo-include/gloo/config.h"
run() {  # <PATH> <PERF_DEPS_DIR>: the exit status in $rc, stdout in $work/out, stderr in $work/err
  env -i HOME="$work" PATH="$1" PERF_DEPS_DIR="$2" PERF_VENV="$venv" PERF_TORCH_VERSION="$version" \
    bash "$root/scripts/bootstrap.sh" >"$work/out" 2>"$work/err"
  rc=$?
}

run "$bin" "$deps"
check "everything there: exit 0 (got $rc; stderr: $(head -c 300 "$work/err"))" [ "$rc" -eq 0 ]
check "everything there: LibTorch's prefix on the last line" [ "$(tail -n 1 "$work/out")" = "$prefix" ]
check "everything there: nothing installed" bash -c "! grep -q installing '$work/err'"

run "$bin" "$work/nothing"
check "no offline copies: exit 1 (got $rc)" [ "$rc" -eq 1 ]
check "no offline copies: names the missing packages" grep -q "missing googletest libgtest-dev libbenchmark-dev libcli11-dev libgloo-dev" "$work/err"
check "no offline copies: says where they come from" grep -q "scripts/gpu-deps.sh DIR" "$work/err"

rm -f "$bin/clang++" "$bin/ccache"
run "$bin" "$deps"
check "no clang++, no ccache: exit 0 (got $rc)" [ "$rc" -eq 0 ]
check "no clang++, no ccache: says it goes on without them" grep -q "no clang and no apt-get: going on without it" "$work/err"
check "no clang++, no ccache: ccache too" grep -q "no ccache and no apt-get" "$work/err"

printf '#!/bin/sh\necho "apt-get $*" >>"%s/apt-calls"\necho "E: Unable to locate package" >&2\nexit 100\n' "$work" \
  >"$bin/apt-get"
printf '#!/bin/sh\nexec "$@"\n' >"$bin/sudo"  # bootstrap.sh calls apt-get through sudo when not root
chmod +x "$bin/apt-get" "$bin/sudo"
run "$bin" "$deps"
check "apt-get without a network, no clang++, no ccache: exit 0 (got $rc; stderr: $(tail -c 300 "$work/err"))" \
  [ "$rc" -eq 0 ]
check "apt-get without a network: it tried them" grep -q "install -y -qq clang ccache" "$work/apt-calls"
check "apt-get without a network: says it goes on without them" \
  grep -q "could not install clang ccache: going on without them" "$work/err"
check "apt-get without a network: LibTorch's prefix on the last line" [ "$(tail -n 1 "$work/out")" = "$prefix" ]
run "$bin" "$work/nothing"
check "apt-get without a network, no offline copies: fails (got $rc)" [ "$rc" -ne 0 ]
check "apt-get without a network, no offline copies: prints no LibTorch prefix" [ ! -s "$work/out" ]
((fails == 0))
