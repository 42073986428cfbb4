#!/usr/bin/env python3
"""Issue 25's check of train_gpt with activation checkpointing: at 2 ranks, sequence 256, global
batch 16, `--activation-checkpointing` gives the losses of the same command without it (1e-6
relative) and a per-rank peak of at most 0.6 of it (every block's activations but one are gone).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import command, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args()
    args = ["--steps", str(a.steps), "--seed", "1", "--json", "--block-size", "256", "--batch-size", "16"]
    off, off_summary = run(command(a.train_gpt, a.torchrun, 2, args), a.timeout)
    on, on_summary = run(command(a.train_gpt, a.torchrun, 2, args + ["--activation-checkpointing"]), a.timeout)
    assert len(off) == len(on) == a.steps, (len(off), len(on))
    for r0, r1 in zip(off, on):
        rel = abs(r1["loss"] - r0["loss"]) / abs(r0["loss"])
        if rel > 1e-6:
            sys.exit(f"FAILED: step {r0['step']}: loss {r1['loss']} with checkpointing vs {r0['loss']} (rel {rel:.2e})")
    peak_off, peak_on = max(off_summary["per_rank_peak_bytes"]), max(on_summary["per_rank_peak_bytes"])
    print(f"losses equal over {a.steps} steps; per-rank peak {peak_on} bytes with checkpointing, {peak_off} "
          f"without (ratio {peak_on / peak_off:.3f})")
    if peak_on > 0.6 * peak_off:
        sys.exit("FAILED: the peak with checkpointing is above 0.6 of the peak without")


if __name__ == "__main__":
    main()
