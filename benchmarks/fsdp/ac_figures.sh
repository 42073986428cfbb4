#!/usr/bin/env bash
# The activation-checkpointing figures (docs/benchmarks.md, "Activation checkpointing"), raw output
# to stdout:
#   benchmarks/fsdp/ac_figures.sh > benchmarks/results/activation_checkpointing.txt
# fsdp_bench's GPT (4 blocks x 128 wide) at sequence 256, global batch 16, full sharding, 10 measured steps, at 1 and
# 2 ranks, each run beside PyTorch FSDP2 on the same model and wrapping: checkpointing off, every
# block, every 2nd block (FSDP2: torch.utils.checkpoint, non-reentrant, on the same blocks). Then
# the ratios against "off" and against FSDP2, from the JSON rows above them. Extra arguments go to
# every fsdp_bench run (e.g. --wrap torchtitan: both implementations then wrap as torchtitan does).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$("$root/scripts/setup.sh" | tail -n 1)"
bench="$root/build/benchmarks/fsdp_bench"
out="$(mktemp -d /tmp/ac-figures-XXXXXX)"
model=(--strategies full --world-sizes 1,2 --n-layer 4 --n-head 4 --n-embd 128 --block-size 256 --batch-size 16
  --steps 11 "$@")
echo "# $(date -u +%FT%TZ) $(git -C "$root" rev-parse --short HEAD) $(nproc --all) cores"
for mode in off 1 2; do
  flags=()
  [[ $mode != off ]] && flags=(--activation-checkpointing "$mode")
  echo "\$ fsdp_bench ${model[*]} ${flags[*]} --json"
  "$bench" "${model[@]}" "${flags[@]}" --json --out "$out/$mode.json" 2>/dev/null
  cat "$out/$mode.json"
done
"$venv/bin/python" - "$out" <<'PY'
import json, sys
rows = {m: json.load(open(f"{sys.argv[1]}/{m}.json")) for m in ("off", "1", "2")}
def pick(m, impl, n):
    return next(r for r in rows[m] if r["impl"] == impl and r["world_size"] == n)
print("impl           ranks  checkpoint  peak MiB  step ms  peak/off  step/off  peak/FSDP2  step/FSDP2")
for impl in ("libtorch-fsdp", "pytorch-fsdp2"):
    for n in (1, 2):
        off = pick("off", impl, n)
        for m in ("off", "1", "2"):
            r, t = pick(m, impl, n), pick(m, "pytorch-fsdp2", n)
            print(f"{impl:14} {n:5}  {m:>10}  {r['peak_bytes'] / 2**20:8.1f}  {r['step_ms']:7.1f}  "
                  f"{r['peak_bytes'] / off['peak_bytes']:8.3f}  {r['step_ms'] / off['step_ms']:8.3f}  "
                  f"{r['peak_bytes'] / t['peak_bytes']:10.3f}  {r['step_ms'] / t['step_ms']:10.3f}")
PY
rm -rf "$out"
