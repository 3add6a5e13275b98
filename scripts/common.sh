# Sourced by test.sh, demo.sh and bench.sh: installs what is missing
# (bootstrap.sh) and defines perf_configure to set up a build tree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PERF_TORCH_PREFIX=$(bash scripts/bootstrap.sh | tail -n 1)
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/perf/ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}  # relative paths: a new clone hits the same cache
# ...also for the sanitizer builds' -g1 objects, whose hash would otherwise
# include the working directory (their debug info then names the first clone's folder).
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# Depend mode: a miss runs the compiler once, its -MD file naming the headers, instead of the
# preprocessor first and then the compiler. A LibTorch translation unit missed in 26.3 s against
# 22.5 s without ccache, in 23.3 s in this mode: about 3 s of each of a fresh CI's 50 compiles.
# Entries stored either way are hit either way.
export CCACHE_DEPEND=${CCACHE_DEPEND:-1}
# ccache hashes LANG, LC_ALL, LC_CTYPE and LC_MESSAGES into every entry (they set the compiler's
# message language): a CI runner whose locale differs from the shell that filled the cache would
# miss every entry and compile everything again. One fixed locale for everything the scripts run.
export LANG=C.UTF-8 LC_ALL=C.UTF-8 LC_CTYPE=C.UTF-8 LC_MESSAGES=C.UTF-8
# One CUDA toolkit path whatever the PATH. CMake takes the toolkit from the first nvcc on PATH: with
# /usr/local/cuda/bin on PATH every command has -isystem /usr/local/cuda/include; without it, a
# wrapper /usr/local/bin/nvcc gives /usr/local/cuda-13.0/include (the same headers, by the
# symlink's target), so a runner with another PATH missed every ccache entry. The toolkit is
# CUDA_PATH, else CUDA_HOME, else the one around CUDACXX, else /usr/local/cuda.
perf_cuda_root=${CUDA_PATH:-${CUDA_HOME:-}}
if [[ -z $perf_cuda_root && -n ${CUDACXX:-} ]]; then
  perf_cuda_root=$(dirname "$(dirname "$CUDACXX")")
elif [[ -z $perf_cuda_root && -x /usr/local/cuda/bin/nvcc ]]; then
  perf_cuda_root=/usr/local/cuda
fi
if [[ -n $perf_cuda_root ]]; then
  export CUDA_PATH=$perf_cuda_root CUDACXX=${CUDACXX:-$perf_cuda_root/bin/nvcc}
fi

# Where bootstrap.sh went on without them (a machine without apt): no compile cache; GoogleTest,
# Google Benchmark, CLI11 and Gloo's headers from PERF_DEPS_DIR (scripts/gpu-deps.sh).
perf_cmake_extra=()
command -v ccache >/dev/null && perf_cmake_extra+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
[[ -n ${PERF_DEPS_DIR:-} ]] && perf_cmake_extra+=(-DPERF_DEPS_DIR="$(cd "$PERF_DEPS_DIR" && pwd)")

perf_configure() {  # <build dir> [extra cmake args...]
  local dir=$1
  shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PERF_TORCH_PREFIX" \
        "${perf_cmake_extra[@]}" "$@"
}

# The machine a benchmark report names: the GPU and its host, or the CPU with what decides its numbers (AVX2 or
# AVX-512, and native bf16, which turns perf's CPU autocast on), and the cores. A run on another kind of CPU goes to a
# page of its own: PERF_DOCS_SUFFIX=avx512-bf16 makes the benchmark scripts write docs/<name>-avx512-bf16.md (and
# keep the run under that name) instead of replacing docs/<name>.md.
perf_machine() {  # <device: cpu, cuda...>
  local cpu flags isa bf16
  cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  if [[ $flags == *" avx2 "* ]]; then
    isa=AVX2
    [[ $flags == *" avx512f "* ]] && isa=AVX-512
    bf16="no native bf16"
    [[ $flags == *" avx512_bf16 "* ]] && bf16="native bf16 (AVX512-BF16), no AMX"
    [[ $flags == *" amx_bf16 "* ]] && bf16="native bf16 (AMX)"
    cpu+=" ($isa, $bf16)"
  fi
  if [[ ${1%%:*} == cuda ]]; then
    echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), host $cpu, $(nproc) cores"
  else
    echo "$cpu, $(nproc) cores"
  fi
}
