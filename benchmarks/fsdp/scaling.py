#!/usr/bin/env python3
"""Side-by-side scaling run of the example: the same training at 1, 2 and 4 ranks in one go.

  python benchmarks/fsdp/scaling.py --train-gpt build/examples/train_gpt --torchrun <venv>/bin/torchrun \
      [--steps 20] [--ranks 1 2 4] [--out benchmarks/results/scaling.json]

Reports per-rank peak bytes (counting allocator) and model-state bytes at the optimizer step,
and each world size's mean step time relative to 1 rank (steps after the first; all runs use one
intra-op thread per rank, as torchrun sets, so the comparison is of the same work per core).
The machine is shared and noisy: the ratios are the result, absolute times only context.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import command, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out")
    a = ap.parse_args()
    results = []
    for w in a.ranks:
        args = ["--steps", str(a.steps), "--seed", str(a.seed), "--json"]
        cmd = command(a.train_gpt, a.torchrun, w, args)
        steps, summary = run(cmd)
        results.append({"world_size": w, "command": " ".join(cmd), "steps": steps, "summary": summary})
        print(f"ran {w} rank(s)", file=sys.stderr)
    base = results[0]
    base_ms = max(base["summary"]["per_rank_mean_step_ms"])
    base_state = max(base["summary"]["per_rank_state_bytes"])
    print(f"model: {base['summary']['params']} parameters; {a.steps} steps, seed {a.seed}")
    print(f"{'ranks':>5} {'rank':>4} {'peak_bytes':>12} {'state_bytes':>12} {'state/(1-rank/N)':>17} {'step_ms':>9} {'time vs 1 rank':>15} {'final loss':>12}")
    for r in results:
        s = r["summary"]
        w = r["world_size"]
        ms = max(s["per_rank_mean_step_ms"])  # a step ends when the slowest rank does
        for k in range(w):
            print(f"{w:>5} {k:>4} {s['per_rank_peak_bytes'][k]:>12} {s['per_rank_state_bytes'][k]:>12} "
                  f"{s['per_rank_state_bytes'][k] / (base_state / w):>17.4f} {s['per_rank_mean_step_ms'][k]:>9.1f} "
                  f"{ms / base_ms:>15.3f} {r['steps'][-1]['loss']:>12.7f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
