#!/usr/bin/env python3
"""End-to-end check of the example under torchrun (the issue's acceptance check).

Runs `train_gpt --steps N --seed S --json` in one process and under
`torchrun --no-python --nproc-per-node W`, then asserts that every step's loss matches to 1e-5
relative and that W ranks hold 1/W of the one-rank model state (within 5%).
"""
import argparse
import json
import os
import subprocess
import sys


def run(cmd, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    rows = [r for r in rows if "step" in r]
    if not rows:
        sys.exit(f"FAILED: no JSON rows from {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--extra", default="", help="more train_gpt flags, for both runs")
    a = ap.parse_args()
    args = ["--steps", str(a.steps), "--seed", str(a.seed), "--json"] + a.extra.split()
    one = run([a.train_gpt] + args, a.timeout)
    many = run([a.torchrun, "--no-python", "--nproc-per-node", str(a.ranks), a.train_gpt] + args, a.timeout)
    assert len(one) == len(many) == a.steps, (len(one), len(many))
    worst = 0.0
    for r1, rn in zip(one, many):
        rel = abs(rn["loss"] - r1["loss"]) / abs(r1["loss"])
        worst = max(worst, rel)
        if rel > 1e-5:
            sys.exit(f"FAILED: step {r1['step']}: loss {rn['loss']} on {a.ranks} ranks vs {r1['loss']} on 1 (rel {rel:.2e})")
    ratio = many[-1]["state_bytes"] / (one[-1]["state_bytes"] / a.ranks)
    print(f"[{a.extra or 'defaults'}] losses match over {a.steps} steps (worst relative difference {worst:.2e}); "
          f"state_bytes {many[-1]['state_bytes']} on {a.ranks} ranks vs {one[-1]['state_bytes']} on 1 "
          f"(ratio to 1/{a.ranks}: {ratio:.4f}); peak_bytes {many[-1]['peak_bytes']} vs {one[-1]['peak_bytes']}")
    if abs(ratio - 1) > 0.05:
        sys.exit("FAILED: state_bytes is not within 5% of 1/N of the one-rank value")


if __name__ == "__main__":
    main()
