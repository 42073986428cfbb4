#!/usr/bin/env bash
# Every executable the build makes answers --help with its usage on stdout and exit status 0
# (tests/CMakeLists.txt passes them all, found from the build's targets, so a new one is checked
# too). A usage is a line containing "usage" (any case); a Google Test binary's own --help, which
# has none, is taken by its first line.
#   check_help.sh EXECUTABLE...
set -uo pipefail
[[ $# -gt 0 ]] || { echo "check_help: no executables given"; exit 1; }
failed=0
for exe in "$@"; do
  out="$(timeout 60 "$exe" --help 2>/dev/null)"
  rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "FAIL: $exe --help exited with status $rc"
    failed=1
  elif ! grep -qi -e 'usage' -e '^This program contains tests written using Google Test' <<<"$out"; then
    echo "FAIL: $exe --help printed no usage line on stdout"
    failed=1
  else
    echo "ok: $exe --help"
  fi
done
exit $failed
