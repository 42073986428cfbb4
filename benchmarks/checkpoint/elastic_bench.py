#!/usr/bin/env python3
"""Recovery of elastic runs, measured: tests/examples/check_elastic.py's cases (case 1, a worker SIGKILLed,
repeated --repeat times), each run's time from the kill to the first step after the restart broken
down (programs/torchrun_runs.py: breakdown), and the tally of restarts per fault.

    build/.../python benchmarks/checkpoint/elastic_bench.py --train-gpt build/examples/train_gpt \\
        --torchrun $VENV/bin/torchrun --repeat 20 --out benchmarks/results/elastic_recovery

writes OUT.json (every run) and OUT.txt (this summary).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
PHASES = ["detection", "stop", "rendezvous", "process_start", "group", "load", "first_step", "total", "caught_up"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--cases", default="worker,scale-down,scale-up")
    ap.add_argument("--out", required=True, help="path without extension")
    a = ap.parse_args()
    cmd = [sys.executable, os.path.join(here, "..", "..", "tests", "examples", "check_elastic.py"), "--train-gpt", a.train_gpt,
           "--torchrun", a.torchrun, "--repeat", str(a.repeat), "--cases", a.cases, "--json-out", a.out + ".json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if not os.path.exists(a.out + ".json"):
        sys.exit(f"FAILED: {' '.join(cmd)} exited {p.returncode} without results\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    with open(a.out + ".json") as f:
        data = json.load(f)
    lines = [f"$ {' '.join(cmd)}", f"exit {p.returncode}", ""]
    runs = data["results"]
    worker = [r for r in runs if r["case"] == "worker"]
    failed = len(data["failures"])
    lines.append(f"case 1 (a worker SIGKILLed, --max-restarts 1): {len(worker)} of {len(worker) + failed} runs "
                 f"recovered with one restart; restarts per run: {sorted({r['restarts'] for r in worker})}")
    if worker:
        lines.append("recovery of case 1, kill -> first step after the restart (ms): median, min, max")
        for k in PHASES:
            v = [r[k] * 1000 for r in worker]
            lines.append(f"  {k:14s} {statistics.median(v):8.0f} {min(v):8.0f} {max(v):8.0f}")
        lines.append(f"  steps redone: {sorted({r['steps_redone'] for r in worker})}; worst loss difference "
                     f"{max(r['worst_rel'] for r in worker):.2e}")
    for r in runs:
        if r["case"] != "worker":
            lines.append(f"{r['case']}: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                                        for k, v in r.items() if k != "case"}))
    for f in data["failures"]:
        lines.append("FAILED: " + f[:2000])
    text = "\n".join(lines) + "\n"
    with open(a.out + ".txt", "w") as f:
        f.write(text)
    print(text)
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
