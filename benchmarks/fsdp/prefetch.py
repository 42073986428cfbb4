#!/usr/bin/env python3
"""Prefetch on against off, side by side: the same 2-rank training run alternately with
--prefetch 1 and --prefetch 0, several rounds, in one invocation.

  python benchmarks/fsdp/prefetch.py --train-gpt build/examples/train_gpt --torchrun <venv>/bin/torchrun \
      [--ranks 2] [--rounds 3] [--steps 12] [-- extra train_gpt flags]

The default model is wider than train_gpt's (6 blocks x 256, short sequences) so that the
all-gathers are a visible part of the step. Reports each run's mean step time (steps after the
first, the slowest rank) and the on/off ratio of the means. The machine is shared and noisy;
alternating rounds spread the noise over both settings.
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
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("extra", nargs="*", default=["--n-layer", "6", "--n-embd", "256", "--block-size", "32",
                                                  "--batch-size", "4"])
    a = ap.parse_args()
    times = {1: [], 0: []}
    losses = {}
    for r in range(a.rounds):
        for depth in (1, 0):
            args = ["--json", "--steps", str(a.steps), "--prefetch", str(depth)] + a.extra
            steps, summary = run(command(a.train_gpt, a.torchrun, a.ranks, args))
            ms, loss = max(summary["per_rank_mean_step_ms"]), steps[-1]["loss"]
            times[depth].append(ms)
            losses[depth] = loss
            print(f"round {r}: prefetch {depth}: {ms:.1f} ms/step (final loss {loss:.7f})", flush=True)
    on, off = sum(times[1]) / a.rounds, sum(times[0]) / a.rounds
    print(f"{a.ranks} ranks, flags {' '.join(a.extra)}: prefetch on {on:.1f} ms/step, off {off:.1f} ms/step, "
          f"on/off ratio {on / off:.3f}; same final loss: {losses[1] == losses[0]}")


if __name__ == "__main__":
    main()
