#!/usr/bin/env python3
"""The examples' step with their fused kernels against the step before them, side by side in one run:
train_gpt and train_llama by default (attention through at::scaled_dot_product_attention, the
Llama's at::rms_norm, enable_gqa and cached rotary tables, fsdp::optim::FusedAdamW) against
--reference-path (the arithmetic before them) with --optimizer torch-adamw, and each change alone.
The variants run interleaved, --repeat times each; per variant the median over the repeats of the
run's mean step time (steps after the first), and its ratio to the old step.

  python3 benchmarks/fsdp/fused_paths.py --train-gpt build/examples/train_gpt \\
      --train-llama build/examples/train_llama --out benchmarks/results/fused_paths_cpu.json

One process each (world size 1), on the CPU by default (--device cuda on a GPU).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

VARIANTS = {
    "before (reference path, torch AdamW)": ["--reference-path", "--optimizer", "torch-adamw"],
    "fused kernels only": ["--optimizer", "torch-adamw"],
    "FusedAdamW only": ["--reference-path"],
    "now (both, the default)": [],
}


def mean_step_ms(cmd, timeout):
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {p.returncode}\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    summary = [r for r in rows if r.get("summary")][0]
    if "mean_step_ms" in summary:
        return summary["mean_step_ms"], rows
    return statistics.mean(summary["per_rank_mean_step_ms"]), rows


class HelpFormat(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    ap.add_argument("--train-gpt", default="build/examples/train_gpt")
    ap.add_argument("--train-llama", default="build/examples/train_llama")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out")
    a = ap.parse_args()
    models = {
        "gpt": [a.train_gpt, "--n-layer", "4", "--n-head", "4", "--n-embd", "256", "--block-size", "128",
                "--batch-size", "8"],
        "llama": [a.train_llama, "--n-layer", "4", "--n-head", "8", "--n-kv-head", "2", "--n-embd", "256",
                  "--intermediate", "768", "--block-size", "128", "--batch-size", "8"],
    }
    common = ["--steps", str(a.steps), "--seed", "1", "--json", "--device", a.device]
    result = {"device": a.device, "steps": a.steps, "repeat": a.repeat, "models": {}}
    for name, base in models.items():
        times = {v: [] for v in VARIANTS}
        losses = {}
        for _ in range(a.repeat):
            for v, flags in VARIANTS.items():
                ms, rows = mean_step_ms(base + common + flags, a.timeout)
                times[v].append(ms)
                losses[v] = [r["loss"] for r in rows if "loss" in r]
        before = statistics.median(times["before (reference path, torch AdamW)"])
        result["models"][name] = {
            "command": " ".join(base + common),
            "variants": {v: {"flags": " ".join(VARIANTS[v]), "mean_step_ms": times[v],
                             "median_ms": statistics.median(times[v]),
                             "over_before": statistics.median(times[v]) / before,
                             "last_loss": losses[v][-1]} for v in VARIANTS}}
        for v in VARIANTS:
            r = result["models"][name]["variants"][v]
            print(f"{name:5s} {v:38s} {r['median_ms']:8.2f} ms  x{r['over_before']:.3f}  last loss {r['last_loss']:.6f}",
                  flush=True)
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
