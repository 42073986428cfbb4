#!/usr/bin/env python3
"""A checkpoint every step: train_gpt at 2 ranks without saving, with --save-every 1 --async-save
--keep-last 2 (a save due while the previous one is being written is skipped on every rank), and
with synchronous saves every step, for train_gpt's default model and fsdp_bench's (16 layers,
n_embd 512). Reports each run's mean step time (train_gpt's summary: the slowest rank's mean over
the steps after the first, which does not include the save after it), the time the loop was held
by saves per step (a synchronous save whole; an asynchronous one its copy into the snapshot), their
sum ("per step"), its ratio to the run without saving, the saves started and skipped,
and the steps a failure would lose (steps since the latest committed checkpoint, after each step:
max and mean), side by side in one run.

    python3 benchmarks/save_every_step.py --train-gpt build/examples/train_gpt \\
        --torchrun $VENV/bin/torchrun --out benchmarks/results/save_every_step
"""
import argparse
import json
import os
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
from train_gpt_runs import command, run  # noqa: E402

MODELS = {
    "train_gpt default (4 x 128)": ["--steps", "40"],
    "fsdp_bench's (16 x 512, batch 8)": ["--n-layer", "16", "--n-head", "8", "--n-embd", "512", "--batch-size", "8",
                                         "--steps", "12"],
}
MODES = {
    "no saving": [],
    "async every step": ["--save-every", "1", "--async-save", "--keep-last", "2"],
    "sync every step": ["--save-every", "1", "--keep-last", "2"],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    rows, lines = [], []
    for model, margs in MODELS.items():
        base = None
        for mode, sargs in MODES.items():
            with tempfile.TemporaryDirectory(prefix="fsdp-save-every-step-", dir=os.path.dirname(a.out)) as d:
                extra = ["--save-dir", d] + sargs if sargs else []
                cmd = command(a.train_gpt, a.torchrun, 2, ["--seed", "1", "--json"] + margs + extra)
                steps, summary = run(cmd, a.timeout)
            step_ms = max(summary["per_rank_mean_step_ms"])
            held_ms = 1000.0 * summary["save_held_s"] / len(steps)
            ms = step_ms + held_ms
            base = ms if base is None else base
            r = dict(model=model, mode=mode, mean_step_ms=step_ms, held_ms_per_step=held_ms, per_step_ms=ms,
                     ratio=ms / base, steps=len(steps),
                     saves_started=summary["saves_started"], saves_skipped=summary["saves_skipped"],
                     steps_lost_max=summary["steps_lost_max"], steps_lost_mean=summary["steps_lost_mean"],
                     save_held_s=summary["save_held_s"], command=" ".join(cmd))
            rows.append(r)
            lines.append(f"{model:34s} {mode:18s} step {step_ms:7.1f} + held {held_ms:6.1f} = {ms:7.1f} ms  "
                         f"x{ms / base:5.2f}  saves {r['saves_started']:3d} started {r['saves_skipped']:3d} skipped  "
                         f"steps lost max {r['steps_lost_max']} mean {r['steps_lost_mean']:.2f}")
            print(lines[-1], flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(a.out + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
