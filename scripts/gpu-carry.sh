#!/usr/bin/env bash
# The binaries scripts/gpu-check.sh runs, stripped, in the build's layout under one folder (default
# build-gpu/, ignored by git), for a GPU machine that has no compiler: carry the folder there (the
# device tool's `carry`) and run `scripts/gpu-check.sh --build build-gpu`. About 9 MB.
#
#   scripts/gpu-carry.sh [BUILD [DIR]]     # defaults: build, build-gpu
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DIR=${2:-build-gpu}
rm -rf "$DIR"
for f in tests/fsdp_tests benchmarks/overhead_bench benchmarks/fsdp_bench examples/train_gpt examples/train_llama \
         fsdp/libtorch_fsdp.so optim/libtorch_fsdp_optim.so checkpoint/libtorch_fsdp_checkpoint.so \
         tp/libtorch_fsdp_tp.so data/libtorch_fsdp_data.so; do
  [ -f "$BUILD/$f" ] || { echo "gpu-carry: $BUILD/$f is missing: build first (scripts/build.sh)" >&2; exit 2; }
  mkdir -p "$DIR/$(dirname "$f")"
  strip --strip-unneeded -o "$DIR/$f" "$BUILD/$f"
done
du -sh "$DIR" >&2
