#!/usr/bin/env bash
# Installs the library into a temporary prefix, moves the prefix elsewhere (the package must be
# relocatable), then builds and runs tests/consumer against it with find_package(libtorch_fsdp)
# alone: no LibTorch path and no TORCH_CUDA_ARCH_LIST from the consumer (the package records
# both: FSDP_EXPECT_CUDA_ARCH is the build's), headers under include/libtorch_fsdp/ only.
#   install_consumer.sh <build dir>
set -euo pipefail
build="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
mv "$tmp/prefix" "$tmp/moved"
fail() { echo "install_consumer: $*"; exit 1; }
[[ -f "$tmp/moved/include/libtorch_fsdp/fsdp/fsdp.h" ]] || fail "fsdp/fsdp.h is not under include/libtorch_fsdp/"
[[ -f "$tmp/moved/include/libtorch_fsdp/optim/fused_adamw.h" ]] || fail "optim/ is not under include/libtorch_fsdp/"
[[ ! -e "$tmp/moved/include/libtorch_fsdp/fsdp/internal" ]] || fail "internal headers were installed"
extra=$(ls "$tmp/moved/include" | grep -v '^libtorch_fsdp$' || true)
[[ -z "$extra" ]] || fail "headers outside include/libtorch_fsdp/: $extra"
for lib in "$tmp"/moved/lib/libtorch_fsdp*.so; do
  readelf -d "$lib" | grep -q 'R.*PATH.*\$ORIGIN' || fail "$(basename "$lib") has no \$ORIGIN run path"
done
[[ -f "$tmp/moved/include/libtorch_fsdp/checkpoint/checkpoint.h" ]] || fail "checkpoint/ is not under include/libtorch_fsdp/"
# The tool runs from the moved prefix (its libraries by \$ORIGIN/../lib): usage, exit status 2.
set +e; "$tmp/moved/bin/fsdp-ckpt" >"$tmp/tool.log" 2>&1; rc=$?; set -e
[[ $rc -eq 2 ]] && grep -q "usage: fsdp-ckpt" "$tmp/tool.log" || { cat "$tmp/tool.log"; fail "bin/fsdp-ckpt does not run from the moved prefix (exit $rc)"; }
env -u TORCH_CUDA_ARCH_LIST -u CMAKE_PREFIX_PATH cmake -S "$here/consumer" -B "$tmp/build" \
  -DCMAKE_PREFIX_PATH="$tmp/moved" \
  ${CMAKE_CXX_COMPILER_LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER=$CMAKE_CXX_COMPILER_LAUNCHER} >"$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; exit 1; }
# Where LibTorch was built with CUDA, the consumer's CUDA flags come from the recorded
# TORCH_CUDA_ARCH_LIST (without it, torch's CMake would detect GPUs or fall back to all archs).
arch="${FSDP_EXPECT_CUDA_ARCH:-}"
if [[ -n "$arch" ]] && grep -q "CUDA NVCC flags" "$tmp/configure.log" &&
   ! grep -q "Added CUDA NVCC flags for: .*compute_${arch//./}" "$tmp/configure.log"; then
  cat "$tmp/configure.log"
  fail "the consumer's CUDA flags are not the build's TORCH_CUDA_ARCH_LIST ($arch)"
fi
cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$tmp/build/consumer"
