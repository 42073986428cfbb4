#!/usr/bin/env python3
"""The Llama on 4 ranks as FSDP 4, FSDP 2 x TP 2 and TP 4: build/examples/train_llama against
PyTorch's DTensor tensor parallelism + FSDP2 on the same model shape and mesh
(benchmarks/tp/llama_dtensor.py), side by side in one run, interleaved.

  python3 benchmarks/tp/llama_bench.py --train-llama build/examples/train_llama \\
      --torchrun $VENV/bin/torchrun --out benchmarks/results/llama_tp

Per mesh: the mean step time of each (steps after the first, median over --repeat interleaved
runs) and their ratio; each rank's model state at the optimizer step (the largest over ranks)
against 16Ψ/(dp·tp) and against the exact count (the parameters tensor parallelism does not
split, the norms, whole on every tp rank); the library's communication per step (its own
counts) against the formula from the model's shapes: FSDP's all-gathers (the root unit once, every
other unit twice: forward and backward) and reduce-scatters of each unit's padded size, plus
the norm's one all-reduce of 3 numbers over the data-parallel and (with tp > 1) the
tensor-parallel ranks; tensor parallelism's 4 all-reduces of b x T x C per decoder layer, and
the embedding's, the head's (b x T x C each) and the loss's (3 of b x T). Exits non-zero when a
count or the state differs from its formula.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "programs"))
from torchrun_runs import run  # noqa: E402  (one process's JSON rows and summary, or exit with its output)


def padded(rows, inner, dp):
    """Elements of a parameter of `rows` x `inner` in a unit sharded over dp ranks (rows padded)."""
    return -(-rows // dp) * dp * inner


def formulas(m, tp, dp):
    """The library's elements per step from the shapes (see the module's docstring)."""
    C, L, H, K, I, V, T = m["n_embd"], m["n_layer"], m["n_head"], m["n_kv_head"] or m["n_head"], m["ffn"], \
        m["vocab"], m["block_size"]
    hd = C // H
    b = m["batch"] // dp
    # This rank's tensor-parallel part of each parameter: (rows, inner), rows sharded over dp.
    layer = [(H * hd // tp, C), (K * hd // tp, C), (K * hd // tp, C), (C, H * hd // tp),  # q, k, v, o
             (I // tp, C), (I // tp, C), (C, I // tp), (C, 1), (C, 1)]  # gate, up, down, 2 norms
    root = [(V // tp, C), (C, 1), (V // tp, C)]  # embedding, final norm, head
    unit = sum(padded(r, i, dp) for r, i in layer)
    fsdp = 2 * sum(padded(r, i, dp) for r, i in root) + 3 * L * unit + 2 * 3 * (2 if tp > 1 else 1)
    bTC, bT = b * T * C, b * T
    return {"fsdp_elements": fsdp, "tp_elements": 4 * L * 2 * bTC, "tp_vocab_elements": 2 * bTC + 2 * bTC + 3 * 2 * bT,
            "tp_collectives": 4 * L}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-kv-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default="")
    ap.add_argument("--ours-only", action="store_true",
                    help="skip the DTensor + FSDP2 runs (the formula checks only, as ctest runs it)")
    a = ap.parse_args()
    shape = ["--n-layer", str(a.n_layer), "--n-embd", str(a.n_embd), "--n-head", str(a.n_head), "--n-kv-head",
             str(a.n_kv_head), "--block-size", str(a.block_size), "--batch-size", str(a.batch_size),
             "--steps", str(a.steps), "--json"]
    model = {"n_embd": a.n_embd, "n_layer": a.n_layer, "n_head": a.n_head, "n_kv_head": a.n_kv_head,
             "ffn": 4 * a.n_embd, "vocab": 256, "block_size": a.block_size, "batch": a.batch_size}
    results, lines, failed = [], [], []
    times = {(tp, side): [] for tp in (1, 2, 4) for side in ("ours", "dtensor")}
    last = {}
    for rep in range(a.repeat):
        for tp in (1, 2, 4):
            ours = run([a.torchrun, "--standalone", "--no-python", "--nproc-per-node", "4", a.train_llama, "--tp",
                        str(tp)] + shape, a.timeout)
            theirs = ([{"state_bytes": 0}], {"mean_step_ms": float("nan")}) if a.ours_only else run(
                [a.torchrun, "--standalone", "--nproc-per-node", "4", os.path.join(HERE, "llama_dtensor.py"), "--tp",
                 str(tp)] + shape, a.timeout)
            times[(tp, "ours")].append(ours[1]["mean_step_ms"])
            times[(tp, "dtensor")].append(theirs[1]["mean_step_ms"])
            last[tp] = (ours, theirs)
    for tp in (1, 2, 4):
        dp = 4 // tp
        (steps, summary), (dsteps, dsummary) = last[tp]
        want = formulas(model, tp, dp)
        got = {k: steps[-1][k] for k in want}
        if got != want:
            failed.append(f"tp {tp}: counted {got}, formula {want}")
        state, exact, simple = steps[-1]["state_bytes"], summary["formula_state_bytes_exact"], \
            summary["formula_state_bytes"]
        if state != exact:
            failed.append(f"tp {tp}: state {state} bytes, exact formula {exact}")
        ms, dms = statistics.median(times[(tp, "ours")]), statistics.median(times[(tp, "dtensor")])
        row = {"tp": tp, "dp": dp, "params": summary["params"], "step_ms": ms, "dtensor_step_ms": dms,
               "time_ratio": ms / dms, "state_bytes": state, "formula_16psi_over_dp_tp": simple,
               "formula_exact": exact, "dtensor_state_bytes": dsteps[-1]["state_bytes"],
               "peak_bytes": steps[-1]["peak_bytes"], "counted": got, "formula": want,
               "step_ms_runs": times[(tp, "ours")], "dtensor_step_ms_runs": times[(tp, "dtensor")]}
        results.append(row)
        lines.append(f"FSDP {dp} x TP {tp}: step {ms:.1f} ms vs DTensor+FSDP2 {dms:.1f} ms (x{ms / dms:.2f}); state "
                     f"{state} B/rank = exact formula {exact:.0f} ({state / simple:.4f} x 16Ψ/(dp·tp) = {simple:.0f}); "
                     f"DTensor+FSDP2 state {dsteps[-1]['state_bytes']} B; per step: fsdp {got['fsdp_elements']}, tp "
                     f"blocks {got['tp_elements']} ({got['tp_collectives']} collectives), tp vocabulary "
                     f"{got['tp_vocab_elements']} elements, each equal to its formula: {got == want}")
    text = f"model {model}, {a.steps} steps, median of {a.repeat} interleaved runs\n" + "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump({"model": model, "steps": a.steps, "repeat": a.repeat, "results": results}, f, indent=1)
        with open(a.out + ".txt", "w") as f:
            f.write(text)
    if failed:
        sys.exit("FAILED:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
