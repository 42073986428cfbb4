#!/usr/bin/env python3
"""The Llama's pipeline: build/examples/train_llama --pp against torch.distributed.pipelining on the same
model shape, stage split, schedule and microbatches (benchmarks/pp/llama_pipelining.py), side by side in one
run, interleaved, Gloo on CPU.

  python3 benchmarks/pp/pp_side_by_side.py --train-llama build/examples/train_llama \\
      --torchrun $VENV/bin/torchrun --out benchmarks/results/pp_side_by_side

Per case (pp 2: GPipe, 1F1B, interleaved 1F1B with 2 stages per rank, zero bubble; pp 4: GPipe and 1F1B;
3-D at 8 ranks: pp 2 x dp_shard 2 x tp 2, 1F1B, FSDP2 and DTensor inside PyTorch's stages): the mean step
of each (the pipeline's step, the largest over ranks, the optimizer step apart; steps after the first; the
median over --repeat interleaved runs) and their ratio; the peak of each (the most CPU allocator bytes live
at once from a step's zero_grad to the end of its optimizer step, the largest over ranks and over the steps
after the first, the most over the runs; both counted by the library's counting CPU allocator, train_llama's
peak_bytes and, loaded into PyTorch's ranks with ctypes (--counting-lib), llama_pipelining.py's) and their
ratio; our measured bubble (the
largest share of the step a rank waited on transfers) against the schedule's formula. More ranks than this
machine's cores measure core sharing more than the schedule: the bubble means something at pp 2 only.

train_llama wraps every stage with FSDP, over the stage's one rank at dp 1; PyTorch's stages at dp 1 are
plain modules unless --fsdp-one-rank (FSDP2 over one rank, like for like). --schedules and --worlds pick
cases (comma-separated: "1f1b,interleaved", "2,4").
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "programs"))
from torchrun_runs import run  # noqa: E402  (one process's JSON rows and summary, or exit with its output)

CASES = [  # (pp, tp, schedule, microbatches, layers, stages per rank); world = pp x dp x tp, dp = 2 at tp 2
    (2, 1, "gpipe", 4, 4, 1), (2, 1, "1f1b", 4, 4, 1), (2, 1, "interleaved", 4, 4, 2), (2, 1, "zero-bubble", 4, 4, 1),
    (4, 1, "gpipe", 8, 8, 1), (4, 1, "1f1b", 8, 8, 1), (2, 2, "1f1b", 4, 4, 1)]


def world(case):
    pp, tp = case[0], case[1]
    return pp * tp * (2 if tp > 1 else 1)


def formula(case):
    """The schedule's bubble, as a share of the step: (p-1)/(m+p-1) for GPipe and 1F1B; interleaved's
    (p-1)/(v m) of the ideal step, so (p-1)/(v m + p-1) of the step; ZB-H1's step 3m + p-1 with forward,
    input and weight passes of one unit each (pp/simulate.h), so (p-1)/(3m + p-1)."""
    pp, _, schedule, m, _, v = case
    if schedule == "zero-bubble":
        return (pp - 1) / (3 * m + pp - 1)
    return (pp - 1) / (v * m + pp - 1) if schedule == "interleaved" else (pp - 1) / (m + pp - 1)


def name(case):
    pp, tp, schedule, m, layers, v = case
    mesh = f"pp {pp} x dp_shard 2 x tp {tp}" if tp > 1 else f"pp {pp}"
    return f"{mesh} {schedule}{f' v {v}' if v > 1 else ''} m {m} ({layers} layers)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--counting-lib", default="",
                    help="libtorch_fsdp.so, whose counting allocator measures PyTorch's peaks (default: the one "
                         "beside --train-llama's build, build/fsdp/libtorch_fsdp.so)")
    ap.add_argument("--schedules", default="", help="only these cases' schedules (comma-separated)")
    ap.add_argument("--worlds", default="", help="only the cases of these world sizes (comma-separated)")
    ap.add_argument("--fsdp-one-rank", action="store_true",
                    help="PyTorch's stages under FSDP2 at dp 1 too (over one rank), as train_llama wraps every stage")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    lib = a.counting_lib or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(a.train_llama))), "fsdp",
                                         "libtorch_fsdp.so")
    if not os.path.isfile(lib):
        sys.exit(f"no counting allocator library at {lib}: pass --counting-lib build/fsdp/libtorch_fsdp.so")
    cases = [c for c in CASES if (not a.schedules or c[2] in a.schedules.split(","))
             and (not a.worlds or str(world(c)) in a.worlds.split(","))]
    if not cases:
        sys.exit(f"no case has --schedules {a.schedules!r} and --worlds {a.worlds!r}: the cases are "
                 + "; ".join(f"{name(c)} at world {world(c)}" for c in CASES))
    times = {(c, side): [] for c in cases for side in ("ours", "torch")}
    bubbles, peaks, torch_peaks = {c: [] for c in cases}, {c: [] for c in cases}, {c: [] for c in cases}

    def shape(c):
        pp, tp, schedule, m, layers, v = c
        return ["--n-layer", str(layers), "--batch-size", str(a.batch_size), "--steps", str(a.steps),
                "--microbatches", str(m), "--pp", str(pp), "--tp", str(tp), "--stages-per-rank", str(v), "--json"]

    def torch_side(c):
        return run([a.torchrun, "--standalone", "--nproc-per-node", str(world(c)),
                    os.path.join(HERE, "llama_pipelining.py"), "--schedule", c[2], "--counting-lib", lib]
                   + shape(c) + (["--fsdp-one-rank"] if a.fsdp_one_rank else []),
                   a.timeout)

    for _ in range(a.repeat):
        for c in cases:
            ours = run([a.torchrun, "--standalone", "--no-python", "--nproc-per-node", str(world(c)), a.train_llama,
                        "--pp-schedule", c[2]] + shape(c), a.timeout)
            theirs = torch_side(c)
            times[(c, "ours")].append(ours[1]["mean_step_ms"])
            times[(c, "torch")].append(theirs[1]["mean_step_ms"])
            bubbles[c].append(statistics.median(r["bubble"] for r in ours[0][1:]))
            peaks[c].append(max(r["peak_bytes"] for r in ours[0][1:]))
            torch_peaks[c].append(theirs[1]["peak_bytes"])
    results, lines = [], []
    for c in cases:
        pp, tp, schedule, m, layers, v = c
        ms, tms = statistics.median(times[(c, "ours")]), statistics.median(times[(c, "torch")])
        bubble, peak, tpeak = statistics.median(bubbles[c]), max(peaks[c]), max(torch_peaks[c])
        results.append({"pp": pp, "tp": tp, "world": world(c), "schedule": schedule, "microbatches": m,
                        "stages_per_rank": v, "n_layer": layers, "step_ms": ms, "torch_step_ms": tms,
                        "time_ratio": ms / tms, "peak_bytes": peak, "torch_peak_bytes": tpeak,
                        "peak_ratio": peak / tpeak,
                        "bubble": bubble, "bubble_formula": formula(c), "step_ms_runs": times[(c, "ours")],
                        "torch_step_ms_runs": times[(c, "torch")], "bubble_runs": bubbles[c], "peak_runs": peaks[c],
                        "torch_peak_runs": torch_peaks[c]})
        lines.append(f"{name(c)}: step {ms:.1f} ms vs torch.distributed.pipelining {tms:.1f} ms (x{ms / tms:.3f}); "
                     f"peak {peak} B vs {tpeak} B (x{peak / tpeak:.3f}); our bubble {bubble:.3f}, "
                     f"the schedule's {formula(c):.3f}")
    text = (f"train_llama's Llama (C 128, 4 heads, T 64, vocabulary 256), batch {a.batch_size}, {a.steps} steps, "
            f"median of {a.repeat} interleaved runs; peaks the most over the runs, both from the library's "
            f"counting allocator" + ("; PyTorch's stages under FSDP2 at dp 1 too" if a.fsdp_one_rank else "")
            + "\n" + "\n".join(lines) + "\n")
    print(text, end="")
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump({"steps": a.steps, "repeat": a.repeat, "batch_size": a.batch_size,
                       "fsdp_one_rank": a.fsdp_one_rank, "results": results}, f,
                      indent=1)
        with open(a.out + ".txt", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
