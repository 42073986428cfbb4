#!/usr/bin/env python3
"""End-to-end check of the example under torchrun (the issue's acceptance check).

Runs `train_gpt --steps N --seed S --json --strategy X` in one process and under
`torchrun --no-python --nproc-per-node W`, then asserts that every step's loss matches to 1e-5
relative (--loss-rtol) and that the model state at the optimizer step is within 5% of the strategy's formula
(16Ψ/N for full sharding and SHARD_GRAD_OP, 8Ψ + 8Ψ/N for ZeRO-1, 16Ψ replicated, 16Ψ/S hybrid)
at 1 rank and at W.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import STRATEGIES, command, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--strategy", default="full", choices=STRATEGIES)
    ap.add_argument("--extra", default="", help="more train_gpt flags, for both runs")
    ap.add_argument("--loss-rtol", type=float, default=1e-5,
                    help="largest relative loss difference allowed (bf16 computes means over other rows)")
    a = ap.parse_args()
    args = ["--steps", str(a.steps), "--seed", str(a.seed), "--json", "--strategy", a.strategy] + a.extra.split()
    one, one_summary = run(command(a.train_gpt, a.torchrun, 1, args), a.timeout)
    many, summary = run(command(a.train_gpt, a.torchrun, a.ranks, args), a.timeout)
    assert len(one) == len(many) == a.steps, (len(one), len(many))
    worst = 0.0
    for r1, rn in zip(one, many):
        rel = abs(rn["loss"] - r1["loss"]) / abs(r1["loss"])
        worst = max(worst, rel)
        if rel > a.loss_rtol:
            sys.exit(f"FAILED: step {r1['step']}: loss {rn['loss']} on {a.ranks} ranks vs {r1['loss']} on 1 (rel {rel:.2e})")
    # Model state at the optimizer step against the strategy's formula, at 1 rank and at N (the
    # largest rank's value, per step).
    # The formula is the strategy's traits' (train_gpt prints it with its summary).
    s = summary["shard_group_size"]
    want1, wantn = one_summary["formula_state_bytes"], summary["formula_state_bytes"]
    r1, rn = one[-1]["state_bytes"] / want1, many[-1]["state_bytes"] / wantn
    print(f"[{a.strategy} {a.extra or ''}] losses match over {a.steps} steps (worst relative difference {worst:.2e}); "
          f"state_bytes {one[-1]['state_bytes']} on 1 rank ({one_summary['formula_text']} = {want1:.0f}, ratio {r1:.4f}), "
          f"{many[-1]['state_bytes']} on {a.ranks} ranks ({summary['formula_text']} = {wantn:.0f}"
          f"{', S = %d' % s if a.strategy == 'hybrid' else ''}, ratio {rn:.4f}); "
          f"peak_bytes {many[-1]['peak_bytes']} vs {one[-1]['peak_bytes']}")
    if abs(r1 - 1) > 0.05 or abs(rn - 1) > 0.05:
        sys.exit("FAILED: state_bytes is not within 5% of the strategy's formula")


if __name__ == "__main__":
    main()
