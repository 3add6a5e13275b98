#!/usr/bin/env bash
# What each perf header adds to a translation unit's compile time, over
# `#include <torch/torch.h>` alone (what a LibTorch program already pays), and
# over an empty file. Compiles one small TU per header with the flags of a
# Release build (-O3), best of N runs each (compiler CPU time), and prints a
# markdown table. The last column is the same translation unit built the way
# perf::perf_static's users build it (PERF_SEPARATE_COMPILATION: declarations
# only; the definitions are compiled once, in src/perf.cpp).
#   bash scripts/compile-cost.sh [runs] [--headers perf.h,optim.h] [--memory]
# runs: default 2. --headers: only these headers (default: every include/perf/*.h).
# --memory (GCC only): instead of seconds, the memory GCC allocates for each
# translation unit (-fsyntax-only -ftime-report's TOTAL), one run each. It is
# the same from run to run where CPU time on a shared VM moves by seconds, and
# follows the time (docs/compile-time.md, 2026-11-30): compare changes with it.
source "$(dirname "$0")/common.sh"
runs=2 memory=0 headers=""
while [ $# -gt 0 ]; do
  case $1 in
    --memory) memory=1 ;;
    --headers) headers=${2:?compile-cost: --headers needs a list, e.g. --headers perf.h,optim.h}; shift ;;
    --headers=*) headers=${1#--headers=} ;;
    [0-9]*) runs=$1 ;;
    *) echo "compile-cost: unknown argument '$1' (valid: a number of runs, --headers a.h,b.h, --memory)" >&2; exit 2 ;;
  esac
  shift
done
torch_root=$(cd "$PERF_TORCH_PREFIX/../.." && pwd)  # .../site-packages/torch
inc="-isystem $torch_root/include -isystem $torch_root/include/torch/csrc/api/include"
cxx=${CXX:-c++}
# The definitions LibTorch's CMake target `torch` gives every consumer's translation unit (torch_cpu's and
# torch_cuda's INTERFACE_COMPILE_DEFINITIONS: USE_DISTRIBUTED, USE_C10D_GLOO, USE_C10D_NCCL, ...). They
# decide what perf/distributed.h includes: with USE_C10D_NCCL, c10d's ProcessGroupNCCL.hpp.
torch_defs=$(awk '/^set_target_properties\((torch_cpu|torch_cuda) PROPERTIES/ { on = 1 }
                  on && /INTERFACE_COMPILE_DEFINITIONS "/ {
                    sub(/.*INTERFACE_COMPILE_DEFINITIONS "/, ""); sub(/".*/, "")
                    n = split($0, d, ";"); for (i = 1; i <= n; i++) printf "-D%s ", d[i]; on = 0 }' \
                 "$torch_root/share/cmake/Caffe2/Caffe2Targets.cmake")
[ -n "$torch_defs" ] || { echo "compile-cost: no compile definitions of torch_cpu/torch_cuda found in $torch_root/share/cmake/Caffe2/Caffe2Targets.cmake" >&2; exit 1; }
echo "LibTorch's definitions for consumers: $torch_defs" >&2
flags="-std=c++17 -O3 -DNDEBUG -DPERF_WITH_CUDA=1 $torch_defs -Iinclude $inc -isystem /usr/local/cuda/include -w"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# CPU seconds (user + sys) of the compiler, best of `runs`: steadier than wall
# time on a shared VM, where one run's wall time moves by a second.
measure() {  # file [extra flags] -> best CPU seconds
  local best=999
  for ((i = 0; i < runs; i++)); do
    local t
    t=$( { TIMEFORMAT='%U %S'; time $cxx $flags ${2:-} -c "$1" -o "$tmp/o.o" 2>"$tmp/err"; } 2>&1 ) ||
      { echo "compile failed: $1" >&2; cat "$tmp/err" >&2; exit 1; }
    best=$(python3 -c "u, s = '$t'.split(); print(min($best, float(u) + float(s)))")
  done
  echo "$best"
}
# GCC's allocation for one translation unit, in MB (deterministic for a given compiler and tree).
allocated() {  # file [extra flags] -> MB
  $cxx $flags ${2:-} -fsyntax-only -ftime-report "$1" 2>"$tmp/report" ||
    { echo "compile failed: $1" >&2; cat "$tmp/report" >&2; exit 1; }
  awk '/^ *TOTAL/ { v = $NF; u = substr(v, length(v)); v = substr(v, 1, length(v) - 1)
                    print (u == "k" ? v / 1024 : u == "G" ? v * 1024 : v) }' "$tmp/report"
}
if [ -n "$headers" ]; then
  list=""
  for h in ${headers//,/ }; do
    [ -f "include/perf/${h#perf/}" ] || { echo "compile-cost: no header include/perf/${h#perf/}" >&2; exit 2; }
    list="$list include/perf/${h#perf/}"
  done
else
  list=$(echo include/perf/*.h)
fi
cost=measure unit=s fmt=%.1f
if [ "$memory" = 1 ]; then
  macros=$($cxx -dM -E -x c++ /dev/null)
  { grep -q __GNUC__ <<<"$macros" && ! grep -q __clang__ <<<"$macros"; } || { echo "compile-cost: --memory needs GCC (-ftime-report's TOTAL)" >&2; exit 2; }
  cost=allocated unit=MB fmt=%.0f
fi
printf 'int main() { return 0; }\n' >"$tmp/empty.cpp"
printf '#include <torch/torch.h>\nint main() { return 0; }\n' >"$tmp/torch.cpp"
base=$($cost "$tmp/empty.cpp")
torch=$($cost "$tmp/torch.cpp")
echo "| header | alone ($unit) | with torch/torch.h ($unit) | added over torch/torch.h ($unit) | added, perf::perf_static ($unit) |"
echo "| --- | --- | --- | --- | --- |"
printf "| (torch/torch.h only) | - | $fmt | - | - |\n" "$torch"
for h in $list; do
  name=${h#include/}
  printf '#include <%s>\nint main() { return 0; }\n' "$name" >"$tmp/alone.cpp"
  printf '#include <torch/torch.h>\n#include <%s>\nint main() { return 0; }\n' "$name" >"$tmp/with.cpp"
  a=$($cost "$tmp/alone.cpp")
  w=$($cost "$tmp/with.cpp")
  s=$($cost "$tmp/with.cpp" -DPERF_SEPARATE_COMPILATION)
  printf "| \`%s\` | $fmt | $fmt | %+${fmt#%} | %+${fmt#%} |\n" "$name" "$(python3 -c "print($a - $base)")" "$w" \
    "$(python3 -c "print($w - $torch)")" "$(python3 -c "print($s - $torch)")"
done
