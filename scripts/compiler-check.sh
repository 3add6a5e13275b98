#!/usr/bin/env bash
# Compiles every translation unit of an existing build (the library, the
# tests, the benchmarks, the examples, the per-header checks) again with other
# GCC versions, the way Ubuntu's g++ builds by default (_FORTIFY_SOURCE=3,
# stack protector, CET), with the build's own -Werror flags. GPU machines run
# Ubuntu's g++ 13, which this Debian host does not have: a warning only g++ 13
# gives would otherwise first show up as a failed build on a lent GPU.
#
#   sudo bash scripts/compiler-check.sh [--build DIR] [--compilers g++-13[,g++-14]]
#
# g++-14 is not clean, for LibTorch 2.11's headers rather than perf's: at -O3 it
# reports false -Warray-bounds in libstdc++'s vector<bool>::reserve inlined from
# torch::autograd::Function::apply (any custom Function: perf::checkpoint,
# perf::DistributedDataParallel) and -Wmaybe-uninitialized in c10::InferenceMode
# (README, "Compilers").
#
# The compilers live in a Debian trixie chroot (PERF_CHROOT, default
# /opt/perf-trixie; debootstrap makes it once: about a minute, 1 GB, 1.2 GB
# with g++-14). The build's source, include and output directories are
# bind-mounted at the same paths, so the build's compile commands run unchanged
# apart from the compiler. Needs root, debootstrap and the Debian mirror. DIR is
# a configured Ninja build (default build/, scripts/test.sh's CUDA build).
# Objects go to a temporary directory; the build is not touched.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
build=build
compilers=g++-13
while (($#)); do
  case $1 in
    --build) build=${2:?--build needs a directory}; shift 2 ;;
    --compilers) compilers=${2:?--compilers needs a list, e.g. g++-13,g++-14}; shift 2 ;;
    *) echo "compiler-check: unknown argument $1 (valid: --build DIR  --compilers g++-13,g++-14)" >&2; exit 2 ;;
  esac
done
fail() { echo "compiler-check: $*" >&2; exit 2; }
root=${PERF_CHROOT:-/opt/perf-trixie}
((EUID == 0)) || fail "needs root (chroot and bind mounts): run it with sudo"
[ -f "$build/build.ninja" ] || fail "$build is not a configured Ninja build: run scripts/test.sh first, or pass --build DIR"
IFS=, read -r -a ccs <<<"$compilers"
for cc in "${ccs[@]}"; do
  [[ $cc =~ ^g\+\+-[0-9]+$ ]] || fail "unknown compiler '$cc' in --compilers (valid: g++-N, a Debian trixie package)"
done

if [ ! -x "$root/usr/bin/apt-get" ]; then
  command -v debootstrap >/dev/null || fail "debootstrap not found (apt install debootstrap)"
  echo "== making the trixie chroot in $root"
  debootstrap --variant=minbase --include=g++-13,libgtest-dev,libgmock-dev,libbenchmark-dev,libcli11-dev,libgloo-dev \
    trixie "$root" \
    http://deb.debian.org/debian >"${TMPDIR:-/tmp}/perf-debootstrap.log" 2>&1 ||
    fail "debootstrap failed (see ${TMPDIR:-/tmp}/perf-debootstrap.log)"
fi
missing=()
for cc in "${ccs[@]}"; do [ -x "$root/usr/bin/$cc" ] || missing+=("$cc"); done
if ((${#missing[@]})); then
  chroot "$root" bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ${missing[*]}" \
    >/dev/null 2>&1 || fail "could not install ${missing[*]} in $root"
fi

# The compile lines, without the launcher (ccache) and the dependency-file flags.
work=$(mktemp -d)
mounts=()
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
ninja -C "$build" -t commands | grep -E " -c [^ ]+\.(cpp|cc)$" | sort -u >"$work/commands.txt"
[ -s "$work/commands.txt" ] || fail "no C++ compile commands in $build"
# Directories the commands read: the source tree, the build, every absolute -I/-isystem outside /usr.
dirs=("$PWD" "$(cd "$build" && pwd)" "$work")
while read -r d; do
  [[ -d $d && $d != /usr/include* && $d != /usr/lib* ]] && dirs+=("$d")
done < <(grep -oE "(-I|-isystem )/[^ ]+" "$work/commands.txt" | sed -E 's/^-I|^-isystem //' | sort -u)
last=""
for d in $(printf '%s\n' "${dirs[@]}" | sort -u); do
  [[ -n $last && $d == "$last"/* ]] && continue  # inside the one mounted before
  last=$d
  grep -q " $root$d " /proc/mounts && continue
  mkdir -p "$root$d" && mount --bind "$d" "$root$d" && mounts+=("$root$d")
done
mountpoint -q "$root/proc" || { mount -t proc proc "$root/proc" && mounts+=("$root/proc"); }

status=0
for cc in "${ccs[@]}"; do
  echo "== $(chroot "$root" "$cc" --version | head -1)," \
    "$(wc -l <"$work/commands.txt") translation units of $build, Ubuntu's default hardening"
  n=0 srcs=()
  rm -f "$work"/job_*
  while read -r line; do
    # "<launcher> <compiler> args... -o obj -c src": the compiler replaced, the object into $work.
    src=${line##* -c }
    srcs+=("$src")
    args=$(sed -E 's/^(ccache |sccache )?[^ ]+ //; s/ -MD / /; s/ -M[TF] [^ ]+/ /g; s/ -o [^ ]+ -c [^ ]+$//' <<<"$line")
    cat >"$work/job_$n" <<EOF
cd $(cd "$build" && pwd) && $cc $args -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=3 -fstack-protector-strong \
  -fstack-clash-protection -fcf-protection -Wformat -Wformat-security -o $work/$n.o -c $src >$work/$n.log 2>&1 ||
  echo "$src" >>$work/failed-$cc
EOF
    n=$((n + 1))
  done <"$work/commands.txt"
  rm -f "$work/failed-$cc"
  start=$(date +%s)
  (cd "$work" && ls job_*) | chroot "$root" xargs -P "$(nproc)" -I{} bash "$work/{}"
  if [ -s "$work/failed-$cc" ]; then
    status=1
    echo "   FAILED: $(wc -l <"$work/failed-$cc") of $n ($(($(date +%s) - start)) s):"
    for ((i = 0; i < n; i++)); do
      [ -s "$work/$i.log" ] || continue
      echo "   ${srcs[i]}:"
      grep -m 8 -E "error:|warning:" "$work/$i.log" | sed 's/^/     /'
    done
  else
    echo "   ok: $n of $n warning-free ($(($(date +%s) - start)) s)"
  fi
  rm -f "$work"/*.o
done
exit $status
