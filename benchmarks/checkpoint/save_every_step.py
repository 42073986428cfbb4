#!/usr/bin/env python3
"""A checkpoint every step: train_gpt at 2 ranks (and at 1, a core left to the writer) without saving, with --save-every 1 --async-save
--keep-last 2 (a save due while the previous one is being written is skipped on every rank), the
same with --direct-io (O_DIRECT: no copy into the page cache), and with synchronous saves every step, for train_gpt's default model and fsdp_bench's (16 layers,
n_embd 512). Reports each run's mean step time (train_gpt's summary: the slowest rank's mean over
the steps after the first, which does not include the save after it), the time the loop was held
by saves per step (a synchronous save whole; an asynchronous one its copy into the snapshot), their
sum ("per step"), its ratio to the run without saving, the saves started and skipped,
and the steps a failure would lose (steps since the latest committed checkpoint, after each step:
max and mean), side by side in one run: each mode --repeat times (default 3), the modes in turn,
medians reported (per-step figures on this shared 2-core machine move by 10-30% between runs).

    python3 benchmarks/checkpoint/save_every_step.py --train-gpt build/examples/train_gpt \\
        --torchrun $VENV/bin/torchrun --out benchmarks/results/save_every_step
"""
import argparse
import json
import os
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "programs"))
from torchrun_runs import command, run  # noqa: E402

# Model: (ranks, train_gpt's flags). At 2 ranks the background writer competes with the ranks for
# this machine's 2 cores; at 1 rank it has a core of its own, as on a GPU node, whose cores mostly
# wait for the GPU.
MODELS = {
    "train_gpt default (4 x 128)": (2, ["--steps", "40"]),
    "fsdp_bench's (16 x 512, batch 8)": (2, ["--n-layer", "16", "--n-head", "8", "--n-embd", "512", "--batch-size",
                                             "8", "--steps", "12"]),
    "train_gpt default, 1 rank, a core free": (1, ["--steps", "40"]),
}
MODES = {
    "no saving": [],
    "async every step": ["--save-every", "1", "--async-save", "--keep-last", "2"],
    "async, O_DIRECT": ["--save-every", "1", "--async-save", "--keep-last", "2", "--direct-io"],
    "sync every step": ["--save-every", "1", "--keep-last", "2"],
}


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each mode, interleaved; medians reported")
    a = ap.parse_args()
    rows, lines = [], []
    for model, (ranks, margs) in MODELS.items():
        runs = {mode: [] for mode in MODES}
        for rep in range(a.repeat):  # the modes in turn, so that the machine's drift hits all alike
            for mode, sargs in MODES.items():
                with tempfile.TemporaryDirectory(prefix="fsdp-save-every-step-", dir=os.path.dirname(a.out)) as d:
                    extra = ["--save-dir", d] + sargs if sargs else []
                    cmd = command(a.train_gpt, a.torchrun, ranks, ["--seed", "1", "--json"] + margs + extra)
                    steps, summary = run(cmd, a.timeout)
                step_ms = max(summary["per_rank_mean_step_ms"])
                held_ms = 1000.0 * summary["save_held_s"] / len(steps)
                runs[mode].append(dict(step_ms=step_ms, held_ms=held_ms, per_step_ms=step_ms + held_ms,
                                       summary=summary, steps=len(steps), command=" ".join(cmd)))
                print(f"  {model} / {mode} / run {rep + 1}: {step_ms + held_ms:.1f} ms per step", flush=True)
        base = median([x["per_step_ms"] for x in runs["no saving"]])
        for mode, xs in runs.items():
            step_ms = median([x["step_ms"] for x in xs])
            held_ms = median([x["held_ms"] for x in xs])
            ms = median([x["per_step_ms"] for x in xs])
            started = sum(x["summary"]["saves_started"] for x in xs)
            skipped = sum(x["summary"]["saves_skipped"] for x in xs)
            lost_max = max(x["summary"]["steps_lost_max"] for x in xs)
            lost_mean = sum(x["summary"]["steps_lost_mean"] for x in xs) / len(xs)
            r = dict(model=model, mode=mode, runs=len(xs), median_step_ms=step_ms, median_held_ms_per_step=held_ms,
                     median_per_step_ms=ms, ratio=ms / base, per_run_ms=[x["per_step_ms"] for x in xs],
                     saves_started=started, saves_skipped=skipped, steps_lost_max=lost_max,
                     steps_lost_mean=lost_mean, commands=[x["command"] for x in xs])
            rows.append(r)
            lines.append(f"{model:34s} {mode:18s} step {step_ms:7.1f} + held {held_ms:6.1f} = {ms:7.1f} ms  "
                         f"x{ms / base:5.2f}  (runs: {', '.join(f'{v:.0f}' for v in r['per_run_ms'])})  "
                         f"saves {started:3d} started {skipped:3d} skipped  "
                         f"steps lost max {lost_max} mean {lost_mean:.2f}")
            print(lines[-1], flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(a.out + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
