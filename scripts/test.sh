#!/usr/bin/env bash
# Runs every test: sets up, builds, then ctest (unit, multi-process parity, error, install and
# torchrun end-to-end tests). Extra arguments go to ctest (e.g. -R Parity).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
ctest --test-dir "${BUILD_DIR:-$root/build}" -j "${FSDP_JOBS:-$(nproc)}" --output-on-failure "$@"
