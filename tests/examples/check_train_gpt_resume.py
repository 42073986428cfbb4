#!/usr/bin/env python3
"""train_gpt saves and resumes (the checkpoint issue's acceptance check).

1. An uninterrupted 2-rank run of --steps 20 gives the reference losses.
2. A 2-rank run of --steps 10 --save-dir D --save-every 10 saves D/step-000010; `fsdp-ckpt verify D`
   passes.
3. The same command on 3 ranks with --steps 20 --resume (and another --seed, which the checkpoint
   overrides, and micro-batches of at most 2 rows) logs steps 10-19 with the reference losses (1e-5
   relative) and the same epoch and samples_consumed; so does one process with another strategy,
   FusedAdamW and micro-batches of at most 5 rows, from the same checkpoint. The data is a corpus
   of 150 bytes (86 windows of 65 tokens: 7 global batches of 12 per epoch), so the runs cross
   epoch boundaries before and after the save.
4. `fsdp-ckpt consolidate D OUT` writes OUT/model.safetensors, which Python's safetensors loads and
   which equals the checkpoint's tensors (tools/read_checkpoint.py), bit for bit.
"""
import argparse
import os
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "programs"))
sys.path.insert(0, os.path.join(here, "..", "..", "tools"))
from torchrun_runs import command, run  # noqa: E402
from read_checkpoint import read_checkpoint  # noqa: E402


def check(rows, reference, first, what):
    steps = [r["step"] for r in rows]
    want = list(range(first, len(reference)))
    if steps != want:
        sys.exit(f"FAILED: {what} logged steps {steps}, not {want}")
    worst = 0.0
    for r in rows:
        for key in ("epoch", "samples_consumed"):
            if r[key] != reference[r["step"]][key]:
                sys.exit(f"FAILED: {what}: step {r['step']} {key} {r[key]} vs {reference[r['step']][key]} uninterrupted")
        ref = reference[r["step"]]["loss"]
        rel = abs(r["loss"] - ref) / abs(ref)
        worst = max(worst, rel)
        if rel > 1e-5:
            sys.exit(f"FAILED: {what}: step {r['step']} loss {r['loss']} vs {ref} uninterrupted (rel {rel:.2e})")
    print(f"{what}: steps {first}-{len(reference) - 1} match the uninterrupted run (worst relative {worst:.2e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--fsdp-ckpt", required=True)
    ap.add_argument("--timeout", type=int, default=240)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp-resume-") as d:
        corpus = os.path.join(d, "corpus.txt")
        with open(os.path.join(here, "..", "..", "examples", "data", "corpus.txt"), "rb") as f, open(corpus, "wb") as out:
            out.write(f.read(150))
        base = ["--seed", "1", "--json", "--data", corpus]
        reference, _ = run(command(a.train_gpt, a.torchrun, 2, ["--steps", "20"] + base), a.timeout)
        epochs = sorted({r["epoch"] for r in reference})
        if epochs != [0, 1, 2] or reference[-1]["samples_consumed"] != 20 * 12:
            sys.exit(f"FAILED: the reference run's epochs {epochs}, samples {reference[-1]['samples_consumed']}: "
                     "expected epochs 0-2 and 240 samples (7 global batches of 12 per epoch)")
        saved, _ = run(command(a.train_gpt, a.torchrun, 2,
                               ["--steps", "10", "--save-dir", d, "--save-every", "10"] + base), a.timeout)
        check(saved, reference[:10], 0, "2 ranks, saving")
        if not os.path.isfile(os.path.join(d, "step-000010", "manifest.json")):
            sys.exit(f"FAILED: no {d}/step-000010/manifest.json")
        v = subprocess.run([a.fsdp_ckpt, "verify", d], capture_output=True, text=True, timeout=a.timeout)
        if v.returncode != 0:
            sys.exit(f"FAILED: fsdp-ckpt verify {d} exited {v.returncode}\n{v.stdout}\n{v.stderr}")
        print(v.stdout.strip())
        resumed, _ = run(command(a.train_gpt, a.torchrun, 3,
                                 ["--steps", "20", "--resume", "--save-dir", d, "--seed", "99", "--json",
                                  "--data", corpus, "--max-rows", "2"]), a.timeout)
        check(resumed, reference, 10, "3 ranks, resumed (--seed 99 on the command line, --max-rows 2)")
        other, _ = run(command(a.train_gpt, a.torchrun, 1,
                               ["--steps", "20", "--resume", "--save-dir", d, "--json", "--strategy", "replicate",
                                "--optimizer", "torch-adamw", "--data", corpus, "--max-rows", "5"]), a.timeout)
        check(other, reference, 10, "1 rank, replicate, torch::optim::AdamW (saved with FusedAdamW), --max-rows 5, resumed")
        out = os.path.join(d, "consolidated")
        c = subprocess.run([a.fsdp_ckpt, "consolidate", d, out], capture_output=True, text=True, timeout=a.timeout)
        if c.returncode != 0:
            sys.exit(f"FAILED: fsdp-ckpt consolidate exited {c.returncode}\n{c.stdout}\n{c.stderr}")
        import torch
        from safetensors.torch import load_file
        got, want = load_file(os.path.join(out, "model.safetensors")), read_checkpoint(d)
        if set(got) != set(want) or any(not torch.equal(got[k], want[k]) for k in want):
            sys.exit("FAILED: the consolidated model.safetensors differs from the checkpoint's tensors")
        print(f"consolidated: {len(got)} tensors in model.safetensors equal the checkpoint's")


if __name__ == "__main__":
    main()
