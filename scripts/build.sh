#!/usr/bin/env bash
# Sets up (scripts/setup.sh), configures and builds libtorch-fsdp into build/.
#   scripts/build.sh [cmake --build arguments, e.g. --target train_gpt]
# Environment: FSDP_LIBTORCH=<dir> builds against that LibTorch instead of the pinned wheel;
# BUILD_DIR (default build), FSDP_JOBS (default: number of cores).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
jobs="${FSDP_JOBS:-$(nproc)}"

venv="$("$root/scripts/setup.sh" | tail -n 1)"

# ccache shared by every clone: key on paths relative to the clone, tolerate the PCH.
export CCACHE_BASEDIR="$root"
export CCACHE_NOHASHDIR=true
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_DIR="${CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/libtorch-fsdp/ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"

generator=()
command -v ninja >/dev/null && [[ ! -f "$build/Makefile" ]] && generator=(-G Ninja)
cmake -S "$root" -B "$build" "${generator[@]}" -DFSDP_VENV="$venv" ${FSDP_LIBTORCH:+-DFSDP_LIBTORCH_DIR="$FSDP_LIBTORCH"} \
  -DCMAKE_INSTALL_PREFIX="${FSDP_INSTALL_PREFIX:-$build/install}" >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "$jobs" "$@"
