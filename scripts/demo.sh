#!/usr/bin/env bash
# The demo: sets up, builds, then trains the example GPT on 2 ranks on CPU with torchrun, printing
# the loss every step and each rank's memory. Extra arguments go to train_gpt (e.g. --steps 50).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh" --target train_gpt
venv="$("$root/scripts/setup.sh" 2>/dev/null | tail -n 1)"
echo "== torchrun --no-python --nproc-per-node 2 build/examples/train_gpt --steps 20 $*"
OMP_NUM_THREADS=1 "$venv/bin/torchrun" --no-python --nproc-per-node 2 \
  "${BUILD_DIR:-$root/build}/examples/train_gpt" --steps 20 "$@" 2> >(grep -v -e '^W[0-9]* ' -e '\*\*\*\*' -e 'OMP_NUM_THREADS' >&2)
