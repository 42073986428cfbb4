#!/usr/bin/env python3
"""LocalSGD and DiLoCo against hybrid sharding: loss against bytes sent across replicas.

train_gpt on its corpus at 4 ranks as 2 replicas x 2 shards (--strategy hybrid --shard-group-size
2), the same seed and data for every run, side by side in one run: plain hybrid sharding (the
gradients all-reduced across replicas every step), LocalSGD and DiLoCo at H = 10 and 50, and
streaming DiLoCo (H = 50 in F fragments, one every H/F steps, each exchange overlapped with the next
inner step). For each: the final loss (replica
0's, the mean of the last 10 steps too), the bytes sent across replicas (the sum of the step rows'
replica_comm_bytes: one replica's), their ratio to hybrid's (the goal: 1/H), the loss gap to hybrid,
the largest bytes one step sent (streaming's point), and the mean step time (context only: 4 ranks on
this machine's 2 cores). Writes OUT.txt (the table), OUT.json (every run's rows) and OUT.svg
(loss against cumulative bytes, log scale).

    python3 benchmarks/optim/local_sgd_bench.py --train-gpt build/examples/train_gpt \\
        --torchrun $VENV/bin/torchrun --out benchmarks/results/local_sgd
"""
import argparse
import json
import math
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "programs"))
from torchrun_runs import command, run  # noqa: E402

HYBRID = ["--strategy", "hybrid", "--shard-group-size", "2"]


def runs(fragments):
    return {
        "hybrid": [],
        "LocalSGD H 10": ["--local-sgd", "10"],
        "LocalSGD H 50": ["--local-sgd", "50"],
        "DiLoCo H 10": ["--diloco", "10"],
        "DiLoCo H 50": ["--diloco", "50"],
        f"streaming DiLoCo H 50, F {fragments}": ["--diloco", "50", "--fragments", str(fragments), "--overlap"],
    }


def svg(results, path):
    """Loss (mean of 10 steps) against cumulative bytes across replicas, log-scaled bytes."""
    W, H, L, B = 720, 440, 70, 50
    colors = ["#000000", "#1f77b4", "#aec7e8", "#d62728", "#ff9896", "#2ca02c"]
    pts = {}
    for name, rows in results.items():
        total, xs = 0, []
        for r in rows:
            total += r["replica_comm_bytes"]
            xs.append(max(total, 1))
        losses = [r["loss"] for r in rows]
        smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        pts[name] = list(zip(xs, smooth))
    xmin = min(x for p in pts.values() for x, _ in p if x > 1)
    xmax = max(x for p in pts.values() for x, _ in p)
    ymin = min(y for p in pts.values() for _, y in p)
    ymax = max(y for p in pts.values() for _, y in p)
    lx0, lx1 = math.log10(xmin), math.log10(xmax)

    def X(x):
        return L + (math.log10(max(x, xmin)) - lx0) / (lx1 - lx0) * (W - L - 20)

    def Y(y):
        return H - B - (y - ymin) / (ymax - ymin) * (H - B - 20)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="20" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 10}" text-anchor="middle">bytes sent across replicas (cumulative, one replica, log scale)</text>',
           f'<text x="15" y="{H / 2}" transform="rotate(-90 15 {H / 2})" text-anchor="middle">loss (replica 0, mean of 10 steps)</text>']
    for e in range(math.ceil(lx0), math.floor(lx1) + 1):
        out.append(f'<text x="{X(10 ** e)}" y="{H - B + 15}" text-anchor="middle">1e{e}</text>')
    for k in range(5):
        y = ymin + (ymax - ymin) * k / 4
        out.append(f'<text x="{L - 5}" y="{Y(y) + 4}" text-anchor="end">{y:.2f}</text>')
    for i, (name, p) in enumerate(pts.items()):
        c = colors[i % len(colors)]
        line = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in p if x > 1)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{line}"/>')
        out.append(f'<text x="{W - 250}" y="{30 + 15 * i}" fill="{c}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fragments", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True, help="OUT.txt, OUT.json and OUT.svg are written")
    a = ap.parse_args()
    results, summaries = {}, {}
    for name, flags in runs(a.fragments).items():
        args = HYBRID + ["--steps", str(a.steps), "--seed", str(a.seed), "--json"] + flags
        rows, summary = run(command(a.train_gpt, a.torchrun, 4, args), timeout=3600)
        results[name], summaries[name] = rows, summary
        print(f"{name}: final loss {rows[-1]['loss']:.4f}", file=sys.stderr)
    base = results["hybrid"]
    base_bytes = sum(r["replica_comm_bytes"] for r in base)
    base_loss = sum(r["loss"] for r in base[-10:]) / 10
    psi = base[0]["params"]
    lines = [f"train_gpt at 4 ranks, 2 replicas x 2 shards, {a.steps} steps, seed {a.seed}, Ψ = {psi} parameters "
             f"(8Ψ = {8 * psi} bytes: one replica's all-reduce of the whole model in fp32, counted twice)",
             f"{'run':34} {'final loss':>10} {'last-10 mean':>12} {'gap to hybrid':>13} {'bytes across':>14} "
             f"{'/ hybrid':>9} {'H-fold goal':>11} {'max bytes/step':>14} {'step ms':>8}"]
    for name, rows in results.items():
        total = sum(r["replica_comm_bytes"] for r in rows)
        mean10 = sum(r["loss"] for r in rows[-10:]) / 10
        H = int(name.split("H ")[1].split(",")[0]) if "H " in name else 1
        lines.append(f"{name:34} {rows[-1]['loss']:10.4f} {mean10:12.4f} {mean10 - base_loss:+13.4f} {total:14d} "
                     f"{total / base_bytes:9.4f} {1 / H:11.4f} {max(r['replica_comm_bytes'] for r in rows):14d} "
                     f"{max(summaries[name]['per_rank_mean_step_ms']):8.1f}")
    text = "\n".join(lines)
    print(text)
    with open(a.out + ".txt", "w") as f:
        f.write(text + "\n")
    with open(a.out + ".json", "w") as f:
        json.dump({"steps": a.steps, "seed": a.seed, "runs": results, "summaries": summaries}, f)
    svg(results, a.out + ".svg")


if __name__ == "__main__":
    main()
