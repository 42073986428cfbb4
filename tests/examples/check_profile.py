#!/usr/bin/env python3
"""--profile DIR (programs/profile.h; docs/benchmarks.md, "Reading a profile"), issue 43's check:
- train_llama --steps 3 --profile DIR writes DIR/trace.json, which json loads, holding the steps'
  spans ("fsdp.step step N") and the phases in them; it prints the per-step table, and DIR/steps.json
  has a row per step whose forward, backward and optimizer are positive and fit in the step's span;
  on the CPU the GPU columns are null;
- train_gpt at 2 ranks (torchrun) with --steps 6 profiles steps 2, 3 and 4 (two warm-up steps
  first), rank 1 writes its own trace, and the waits for all-gathers and reduce-scatters show;
  with --json the JSON rows on stdout stay JSON (the table goes to stderr);
- overhead_bench --profile profiles the plain and the wrapped step of rounds 2-4, labelled so;
- a DIR that cannot be created is refused before training (exit 2).

  python tests/examples/check_profile.py --train-llama build/examples/train_llama \\
      --train-gpt build/examples/train_gpt --overhead-bench build/benchmarks/overhead_bench --torchrun torchrun
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

failures = []


def expect(name, ok, detail=""):
    print(("ok    " if ok else "FAIL  ") + name + ("" if ok else "\n      " + detail))
    if not ok:
        failures.append(name)


def run(cmd, want_rc=0):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, stdin=subprocess.DEVNULL)
    if p.returncode != want_rc:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {p.returncode}, expected {want_rc}\n{p.stdout[-3000:]}\n"
                 f"{p.stderr[-3000:]}")
    return p


def check_profile(name, d, labels, text, trace="trace.json", waits=False):
    with open(os.path.join(d, trace)) as f:
        events = json.load(f)["traceEvents"]  # a Chrome / Perfetto trace
    names = {e.get("name") for e in events}
    for label in labels:
        expect(f"{name}: the trace holds the span 'fsdp.step {label}'", f"fsdp.step {label}" in names)
    for phase in ("fsdp.forward", "fsdp.backward", "fsdp.optimizer"):
        expect(f"{name}: the trace holds '{phase}'", phase in names)
    rows = [json.loads(line) for line in open(os.path.join(d, "steps.json"))]
    expect(f"{name}: steps.json has the profiled steps {labels}", [r["step"] for r in rows] == labels,
           f"{[r['step'] for r in rows]}")
    header = [line for line in text.splitlines() if line.startswith("ms ")]
    expect(f"{name}: the table's header is printed", header and all(
        c in header[0] for c in ("step", "forward", "backward", "optimizer", "wait AG", "wait RS", "wait AR",
                                 "wait other", "GPU busy", "GPU idle")),
        f"{header}")
    for r in rows:
        where = f"{name}, {r['step']}"
        expect(f"{where}: forward, backward and optimizer positive",
               r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["optimizer_ms"] > 0, f"{r}")
        expect(f"{where}: the phases fit in the step's span",
               r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"] <= r["step_ms"] * 1.001, f"{r}")
        expect(f"{where}: the GPU columns are null on the CPU", r["gpu_busy_ms"] is None and r["gpu_idle_ms"] is None)
        expect(f"{where}: its table row is printed", any(line.startswith(r["step"] + " ") for line in text.splitlines()))
        if waits:
            expect(f"{where}: the all-gathers' and reduce-scatters' waits show",
                   r["wait_all_gather_ms"] > 0 and r["wait_reduce_scatter_ms"] > 0, f"{r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--overhead-bench", required=True)
    ap.add_argument("--torchrun", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "llama")
        p = run([a.train_llama, "--n-layer", "2", "--n-head", "4", "--n-embd", "128", "--intermediate", "512",
                 "--block-size", "96", "--steps", "3", "--seed", "1", "--profile", d])
        check_profile("train_llama --steps 3", d, ["step 0", "step 1", "step 2"], p.stdout)

        d = os.path.join(tmp, "gpt")
        p = run([a.torchrun, "--standalone", "--no-python", "--nproc-per-node", "2", a.train_gpt, "--steps", "6",
                 "--json", "--profile", d])
        check_profile("train_gpt at 2 ranks, --steps 6", d, ["step 2", "step 3", "step 4"], p.stderr, waits=True)
        expect("train_gpt: rank 1 wrote its own trace", os.path.isfile(os.path.join(d, "trace-rank-1.json")))
        try:
            steps = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
            expect("train_gpt --json: stdout is JSON rows alone", len([r for r in steps if "loss" in r]) == 6)
        except ValueError as e:
            expect("train_gpt --json: stdout is JSON rows alone", False, str(e))

        d = os.path.join(tmp, "overhead")
        p = run([a.overhead_bench, "--sizes", "small", "--rounds", "5", "--profile", d])
        labels = [f"small {side} {r}" for r in (2, 3, 4) for side in ("plain", "wrapped")]
        check_profile("overhead_bench --rounds 5", d, labels, p.stdout)

        blocker = os.path.join(tmp, "a-file")
        open(blocker, "w").close()
        p = run([a.train_llama, "--steps", "1", "--profile", os.path.join(blocker, "sub")], want_rc=2)
        expect("a --profile DIR that cannot be created: exit 2 naming --profile", "--profile" in p.stderr, p.stderr)
    if failures:
        sys.exit(f"FAILED: {len(failures)} check(s)")
    print("profile checks passed")


if __name__ == "__main__":
    main()
