#!/usr/bin/env bash
# Configures perf's CUDA build (as scripts/test.sh's build/) with other GCC
# and clang versions and compiles every translation unit (the library, the
# tests, the benchmarks, the examples, the per-header checks) the way Ubuntu's
# g++ builds by default (_FORTIFY_SOURCE=3, stack protector, CET), under the
# project's own -Werror flags for that compiler. GPU machines run Ubuntu's g++
# 13, which this Debian host does not have: a warning only g++ 13 gives would
# otherwise first show up as a failed build on a lent GPU; and a user on a
# newer clang than this host's 14 (Ubuntu 24.04's 18, Debian 13's 19) compiles
# perf's headers with that one's warnings. Nothing is linked or run.
#
#   sudo bash scripts/compiler-check.sh [--compilers g++-13[,g++-14,clang++-18,clang++-19]]
#
# The compilers live in a Debian trixie chroot (PERF_CHROOT, default
# /opt/perf-trixie; debootstrap makes it once: about a minute, 1 GB, 1.2 GB
# with g++-14). CMake and Ninja run here and call the compiler through a
# wrapper that runs it in the chroot, where the source tree, LibTorch, CUDA's
# headers and the build directory are bind-mounted at the same paths; so CMake
# sees the real compiler and version (PERF_WARNINGS' per-version flags apply),
# and the chroot's own GoogleTest, Benchmark and CLI11 headers stand in for the
# host's. clang++-N comes from Debian's clang-N package and compiles against the
# chroot's libstdc++ (GCC 14's). Needs root, debootstrap and the Debian mirror.
# The build directories are temporary.
source "$(dirname "$0")/common.sh"  # LibTorch (PERF_TORCH_PREFIX), perf_configure
set +e
compilers=g++-13
while (($#)); do
  case $1 in
    --compilers) compilers=${2:?--compilers needs a list, e.g. g++-13,g++-14}; shift 2 ;;
    *) echo "compiler-check: unknown argument $1 (valid: --compilers g++-13,g++-14,clang++-19)" >&2; exit 2 ;;
  esac
done
fail() { echo "compiler-check: $*" >&2; exit 2; }
root=${PERF_CHROOT:-/opt/perf-trixie}
((EUID == 0)) || fail "needs root (chroot and bind mounts): run it with sudo"
IFS=, read -r -a ccs <<<"$compilers"
for cc in "${ccs[@]}"; do
  [[ $cc =~ ^(g|clang)\+\+-[0-9]+$ ]] ||
    fail "unknown compiler '$cc' in --compilers (valid: g++-N or clang++-N of a Debian trixie package)"
done
package() { [[ $1 == clang* ]] && echo "clang-${1#clang++-}" || echo "$1"; }  # clang++-19 is in clang-19

if [ ! -x "$root/usr/bin/apt-get" ]; then
  command -v debootstrap >/dev/null || fail "debootstrap not found (apt install debootstrap)"
  echo "== making the trixie chroot in $root"
  debootstrap --variant=minbase --include=g++-13,libgtest-dev,libgmock-dev,libbenchmark-dev,libcli11-dev,libgloo-dev \
    trixie "$root" http://deb.debian.org/debian >"${TMPDIR:-/tmp}/perf-debootstrap.log" 2>&1 ||
    fail "debootstrap failed (see ${TMPDIR:-/tmp}/perf-debootstrap.log)"
fi
missing=()
for cc in "${ccs[@]}"; do [ -x "$root/usr/bin/$cc" ] || missing+=("$(package "$cc")"); done
if ((${#missing[@]})); then
  chroot "$root" bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ${missing[*]}" \
    >/dev/null 2>&1 || fail "could not install ${missing[*]} in $root"
fi

work=$(mktemp -d)
mounts=()
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
trap "exit 130" INT TERM  # so that the mounts go on a stop too
torch_dir=$(cd "$PERF_TORCH_PREFIX/../.." && pwd)  # .../site-packages/torch
# shellcheck disable=SC2016  # CMake's variable, not the shell's
echo 'message("${CMAKE_ROOT}")' >"$work/root.cmake"
cmake_root=$(cmake -P "$work/root.cmake" 2>&1)  # its modules: the compiler checks compile files there
for d in "$PWD" "$work" "$torch_dir" "$cmake_root" /usr/local/cuda; do
  [ -d "$d" ] || continue
  mkdir -p "$root$d" && mount --bind "$d" "$root$d" && mounts+=("$root$d")
done
mountpoint -q "$root/proc" || { mount -t proc proc "$root/proc" && mounts+=("$root/proc"); }

hardening="-D_FORTIFY_SOURCE=3 -fstack-protector-strong -fstack-clash-protection -fcf-protection -Wformat -Wformat-security"
status=0
for cc in "${ccs[@]}"; do
  echo "== $(chroot "$root" "$cc" --version | head -1): perf's CUDA build, every translation unit, Ubuntu's default hardening"
  wrapper=$work/$cc dir=$work/build-$cc
  # The compiler in the chroot, in the caller's directory (the same path there).
  cat >"$wrapper" <<EOF
#!/bin/bash
exec chroot $root /bin/bash -c 'cd "\$0" && exec $cc "\$@"' "\$PWD" "\$@"
EOF
  chmod +x "$wrapper"
  start=$(date +%s)
  # As scripts/test.sh configures, without ccache (a throwaway build). With a clang++, LibTorch's CMake config makes
  # it nvcc's host compiler too (its CUDA check): nvcc's temporary files then go to $work, which the chroot sees.
  if ! TMPDIR=$work perf_configure "$dir" -DCMAKE_CXX_COMPILER_LAUNCHER= -DCMAKE_CXX_COMPILER="$wrapper" \
      -DCMAKE_CXX_FLAGS="$hardening" >"$work/configure-$cc.log" 2>&1; then
    status=1
    echo "   configure FAILED:"; tail -15 "$work/configure-$cc.log" | sed 's/^/     /'
    continue
  fi
  mapfile -t objects < <(ninja -C "$dir" -t targets all | sed -n 's/^\([^:]*\.o\): .*/\1/p' | sort -u)
  ninja -C "$dir" -k 0 "${objects[@]}" >"$work/build-$cc.log" 2>&1
  failed=$(grep -c "^FAILED: " "$work/build-$cc.log")
  if ((failed)); then
    status=1
    echo "   FAILED: $failed of ${#objects[@]} ($(($(date +%s) - start)) s):"
    grep -E "^FAILED: |error:" "$work/build-$cc.log" | sed -E 's/^FAILED: (\[code=[0-9]+\] )?/   /; s/^([^ ])/     \1/'
  else
    echo "   ok: ${#objects[@]} of ${#objects[@]} built under -Werror ($(($(date +%s) - start)) s;" \
      "$(grep -c "warning:" "$work/build-$cc.log") warnings that PERF_WARNINGS keeps non-fatal)"
  fi
done
exit $status
