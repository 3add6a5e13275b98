# Sourced by the shell-script tests (tests/*_check.sh): a temporary folder removed
# at exit, and check, which prints one ok/FAILED line per condition and counts the
# failures in $fails (the script ends with `((fails == 0))` or its own report).
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
check() {  # <what> <condition...>
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; fails=$((fails + 1)); fi
}
