#!/usr/bin/env bash
# The checkpoint figures (docs/benchmarks.md, "Checkpoints"), raw output to stdout:
#   benchmarks/checkpoint/ckpt_figures.sh [DIR] > benchmarks/results/ckpt_figures.txt
# 1. save at 4 ranks (full sharding; GPT 8 layers x 512, AdamW) against plain writes of the same
#    bytes; 2. load of it at 3 ranks against plain reads; 3. a replicated save at 4 ranks (its
#    rows split over the replicas: per-rank balance); 4. the manifest at 128-1024 simulated ranks.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$("$root/scripts/setup.sh" | tail -n 1)"
bench="$root/build/benchmarks/ckpt_bench"
dir="${1:-$(mktemp -d /tmp/ckpt-figures-XXXXXX)}"
export OMP_NUM_THREADS=1
run() { echo "\$ $*"; "$@" 2>&1 | grep '^{'; }
torchrun=("$venv/bin/torchrun" --standalone --no-python)
echo "# $(date -u +%FT%TZ) $(git -C "$root" rev-parse --short HEAD) $(nproc --all) cores; dir $dir ($(df -T "$dir" | awk 'NR==2 {print $2}'))"
run "${torchrun[@]}" --nproc-per-node 4 "$bench" save --dir "$dir/full"
run "${torchrun[@]}" --nproc-per-node 3 "$bench" load --dir "$dir/full"
run "${torchrun[@]}" --nproc-per-node 4 "$bench" save --dir "$dir/replicate" --strategy replicate --reps 4
run "${torchrun[@]}" --nproc-per-node 4 "$bench" save --dir "$dir/hybrid" --strategy hybrid --reps 4
run "$bench" simulate --ranks 128,256,512,1024
rm -rf "$dir"
