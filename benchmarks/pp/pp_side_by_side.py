#!/usr/bin/env python3
"""The Llama's pipeline: build/examples/train_llama --pp against torch.distributed.pipelining on the same
model shape, stage split, schedule and microbatches (benchmarks/pp/llama_pipelining.py), side by side in one
run, interleaved, Gloo on CPU.

  python3 benchmarks/pp/pp_side_by_side.py --train-llama build/examples/train_llama \\
      --torchrun $VENV/bin/torchrun --out benchmarks/results/pp_side_by_side

Per case (pp 2 and 4, GPipe and 1F1B): the mean step of each (the pipeline's step, the largest over ranks,
the optimizer step apart; steps after the first; the median over --repeat interleaved runs) and their
ratio, and our measured bubble (the largest share of the step a rank waited on transfers) against the
schedule's formula (p-1)/(m+p-1). More ranks than this machine's cores measure core sharing more than
the schedule: the bubble means something at pp 2 only.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "programs"))
from torchrun_runs import run  # noqa: E402  (one process's JSON rows and summary, or exit with its output)

CASES = [  # (pp, schedule, microbatches, layers)
    (2, "gpipe", 4, 4), (2, "1f1b", 4, 4), (4, "gpipe", 8, 8), (4, "1f1b", 8, 8)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    times = {(c, side): [] for c in CASES for side in ("ours", "torch")}
    bubbles = {c: [] for c in CASES}
    for _ in range(a.repeat):
        for c in CASES:
            pp, schedule, m, layers = c
            shape = ["--n-layer", str(layers), "--batch-size", str(a.batch_size), "--steps", str(a.steps),
                     "--microbatches", str(m), "--json"]
            ours = run([a.torchrun, "--standalone", "--no-python", "--nproc-per-node", str(pp), a.train_llama,
                        "--pp", str(pp), "--pp-schedule", schedule] + shape, a.timeout)
            theirs = run([a.torchrun, "--standalone", "--nproc-per-node", str(pp),
                          os.path.join(HERE, "llama_pipelining.py"), "--schedule", schedule] + shape, a.timeout)
            times[(c, "ours")].append(ours[1]["mean_step_ms"])
            times[(c, "torch")].append(theirs[1]["mean_step_ms"])
            bubbles[c].append(statistics.median(r["bubble"] for r in ours[0][1:]))
    results, lines = [], []
    for c in CASES:
        pp, schedule, m, layers = c
        ms, tms = statistics.median(times[(c, "ours")]), statistics.median(times[(c, "torch")])
        bubble, formula = statistics.median(bubbles[c]), (pp - 1) / (m + pp - 1)
        results.append({"pp": pp, "schedule": schedule, "microbatches": m, "n_layer": layers, "step_ms": ms,
                        "torch_step_ms": tms, "time_ratio": ms / tms, "bubble": bubble, "bubble_formula": formula,
                        "step_ms_runs": times[(c, "ours")], "torch_step_ms_runs": times[(c, "torch")],
                        "bubble_runs": bubbles[c]})
        lines.append(f"pp {pp} {schedule:5s} m {m} ({layers} layers): step {ms:.1f} ms vs torch.distributed.pipelining "
                     f"{tms:.1f} ms (x{ms / tms:.3f}); our bubble {bubble:.3f}, formula (p-1)/(m+p-1) {formula:.3f}")
    text = (f"train_llama's Llama (C 128, 4 heads, T 64, vocabulary 256), batch {a.batch_size}, {a.steps} steps, "
            f"median of {a.repeat} interleaved runs\n" + "\n".join(lines) + "\n")
    print(text, end="")
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump({"steps": a.steps, "repeat": a.repeat, "batch_size": a.batch_size, "results": results}, f,
                      indent=1)
        with open(a.out + ".txt", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
