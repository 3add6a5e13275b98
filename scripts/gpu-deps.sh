#!/usr/bin/env bash
# Prepares, on a connected Debian/Ubuntu machine, the folder that
# scripts/gpu-check.sh builds perf's tests and benchmarks from on a GPU machine
# without internet or a package manager:
#
#   bash scripts/gpu-deps.sh DIR        # then copy DIR to the GPU machine
#   PERF_DEPS_DIR=DIR bash scripts/gpu-check.sh
#
# DIR gets: googletest/ (sources, as Debian's googletest package ships them),
# CLI11/CLI/ (header-only), benchmark-prefix/ (Debian's Google Benchmark
# headers, static library and CMake package; optional: without it only
# bench_setup is left out), ccache/ (Debian's ccache with the library it links
# that a GPU machine may lack, libhiredis; gpu-check's compile cache across
# sessions). Installs the Debian packages if missing (apt-get).
set -euo pipefail
dir=${1:?usage: scripts/gpu-deps.sh DIR}
need=()
for p in googletest libcli11-dev libbenchmark-dev ccache; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
mkdir -p "$dir/CLI11" "$dir/benchmark-prefix/include"
rm -rf "$dir/googletest" "$dir/CLI11/CLI"
cp -r /usr/src/googletest "$dir/googletest"
cp -r /usr/include/CLI "$dir/CLI11/CLI"
cp -r /usr/include/benchmark "$dir/benchmark-prefix/include/"
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
mkdir -p "$dir/benchmark-prefix/lib/$multiarch/cmake"
cp -P /usr/lib/"$multiarch"/libbenchmark* "$dir/benchmark-prefix/lib/$multiarch/"  # .a and .so: the CMake package names both
cp -r /usr/lib/"$multiarch"/cmake/benchmark "$dir/benchmark-prefix/lib/$multiarch/cmake/"
if [ -d /usr/include/gloo ]; then  # libgloo-dev: perf/distributed.h's Gloo tests
  mkdir -p "$dir/gloo-include" && cp -r /usr/include/gloo "$dir/gloo-include/"
fi
# ccache, run through a script that puts its own libhiredis first (a copy of Debian's libzstd and libstdc++ is
# not needed: every Ubuntu or Debian has them, and the compilers ccache starts would see them too).
rm -rf "$dir/ccache" && mkdir -p "$dir/ccache/bin" "$dir/ccache/libexec" "$dir/ccache/lib"
cp "$(command -v ccache)" "$dir/ccache/libexec/ccache"
ldd "$(command -v ccache)" | awk '/libhiredis/ { print $3 }' | xargs -r -I{} cp {} "$dir/ccache/lib/"
cat >"$dir/ccache/bin/ccache" <<'SH'
#!/bin/sh
d=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/libexec/ccache" "$@"
SH
chmod +x "$dir/ccache/bin/ccache"
"$dir/ccache/bin/ccache" --version | head -n 1
du -sh "$dir"
echo "gpu-deps: ready in $dir; on the GPU machine: PERF_DEPS_DIR=$dir bash scripts/gpu-check.sh"
