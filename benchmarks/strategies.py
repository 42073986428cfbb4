#!/usr/bin/env python3
"""Model state per strategy at 1, 2 and 4 ranks, against the ZeRO formulas, in one run.

  python benchmarks/strategies.py --train-gpt build/examples/train_gpt --torchrun <venv>/bin/torchrun \
      [--steps 10] [--ranks 1 2 4] [--out benchmarks/results/strategies.json]

For every strategy and world size: `train_gpt --steps N --seed 1 --json --strategy X` (hybrid: groups
of N/2 ranks, at least 1), the largest rank's model-state bytes at the optimizer step against the
strategy's formula, the largest per-rank allocator peak, the mean step time relative to the same
strategy at 1 rank, and the worst relative loss difference to the 1-rank run. The machine is shared
and has 2 cores: 4 ranks oversubscribe it, so times are context, not scaling.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt_runs import FORMULA_TEXT, FORMULAS, command, run  # noqa: E402

STRATEGIES = ["full", "grad-op", "optimizer", "replicate", "hybrid"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    print(f"{'strategy':<10} {'N':>2} {'S':>2} {'state_bytes':>12} {'formula':>10} {'bytes':>12} {'ratio':>7} "
          f"{'peak_bytes':>12} {'time/1 rank':>11} {'loss diff':>9}")
    for strategy in STRATEGIES:
        base = None
        for n in a.ranks:
            args = ["--steps", str(a.steps), "--seed", str(a.seed), "--json", "--strategy", strategy]
            steps, summary = run(command(a.train_gpt, a.torchrun, n, args))
            psi, s = summary["params"], summary["shard_group_size"]
            want = FORMULAS[strategy](psi, n, s)
            ms = max(summary["per_rank_mean_step_ms"])
            if base is None:
                base = (steps, ms)
            diff = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(steps, base[0]))
            row = {
                "strategy": strategy, "world_size": n, "shard_group_size": s, "params": psi,
                "state_bytes": steps[-1]["state_bytes"], "formula": FORMULA_TEXT[strategy] if n > 1 else "16Ψ",
                "formula_bytes": want, "ratio": steps[-1]["state_bytes"] / want,
                "per_rank_state_bytes": summary["per_rank_state_bytes"],
                "per_rank_peak_bytes": summary["per_rank_peak_bytes"],
                "mean_step_ms": ms, "time_vs_1_rank": ms / base[1], "worst_rel_loss_diff_vs_1_rank": diff,
            }
            rows.append(row)
            print(f"{strategy:<10} {n:>2} {s if strategy == 'hybrid' else '':>2} {row['state_bytes']:>12} "
                  f"{row['formula']:>10} {want:>12.0f} {row['ratio']:>7.4f} {max(row['per_rank_peak_bytes']):>12} "
                  f"{row['time_vs_1_rank']:>11.3f} {diff:>9.2e}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
