#!/usr/bin/env python3
"""Issue 28's check: train_gpt's LocalSGD and DiLoCo over hybrid sharding at 4 ranks (2 replicas x 2).

1. `--diloco 4 --outer-lr 1 --outer-momentum 0` gives the losses of `--local-sgd 4` (1e-6 relative)
   over 12 steps, while `--diloco 4` at its default outer optimizer does not.
   Its model state at the step is within 5% of 16Ψ/S + 8Ψ/S (the outer state included).
2. Over 50 steps the sum of replica_comm_bytes of `--diloco 10` is at most 0.1 of the plain hybrid
   run's, plus 1%. From the shapes: a hybrid step sends the same bytes every step, at least 8Ψ (twice
   the fp32 bytes of an all-reduce of the replica's flat shards, which hold Ψ elements between them
   plus padding to whole rows per rank), an outer step exactly as much, the other steps nothing.
3. DiLoCo saved mid-period resumes on the same replicas (4 ranks; 2 ranks of one shard each) with
   the uninterrupted run's losses (1e-5), and on one replica restarts from the global state.
4. Flags that cannot work are refused with exit status 2 and a message naming what to add.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import command, run  # noqa: E402

HYBRID = ["--strategy", "hybrid", "--shard-group-size", "2"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args()

    def train(steps, *flags):
        rows, summary = run(command(a.train_gpt, a.torchrun, 4,
                                    HYBRID + ["--steps", str(steps), "--seed", "1", "--json"] + list(flags)), a.timeout)
        assert len(rows) == steps - rows[0]["step"], (flags, len(rows))
        train.summary = summary
        return rows

    local = train(12, "--local-sgd", "4")
    plain_outer = train(12, "--diloco", "4", "--outer-lr", "1", "--outer-momentum", "0")
    nesterov = train(12, "--diloco", "4")
    # DiLoCo's outer state (fp32 global shards, momentum) is in the model state and its formula.
    ratio = nesterov[-1]["state_bytes"] / train.summary["formula_state_bytes"]
    if abs(ratio - 1) > 0.05:
        sys.exit(f"FAILED: DiLoCo's state_bytes {nesterov[-1]['state_bytes']} is not within 5% of "
                 f"{train.summary['formula_text']} = {train.summary['formula_state_bytes']}")
    print(f"DiLoCo's model state at the step: {nesterov[-1]['state_bytes']} bytes = "
          f"{ratio:.4f} x {train.summary['formula_text']}")
    worst = max(abs(p["loss"] - q["loss"]) / abs(q["loss"]) for p, q in zip(plain_outer, local))
    if worst > 1e-6:
        sys.exit(f"FAILED: DiLoCo (outer lr 1, momentum 0) vs LocalSGD: worst relative loss difference {worst:.2e}")
    apart = max(abs(p["loss"] - q["loss"]) / abs(q["loss"]) for p, q in zip(nesterov, local))
    if apart < 1e-4:
        sys.exit(f"FAILED: DiLoCo's default outer optimizer changed nothing (worst difference {apart:.2e})")
    print(f"12 steps: DiLoCo (lr 1, momentum 0) = LocalSGD within {worst:.2e}; default DiLoCo differs by up to "
          f"{apart:.2e}")

    psi = local[0]["params"]
    hybrid = train(50)
    # An outer step sends what a hybrid step does: the replica's flat shards in fp32, counted twice.
    per_step = hybrid[0]["replica_comm_bytes"]
    for name, rows, H in (("LocalSGD", local, 4), ("DiLoCo", nesterov, 4)):
        for r in rows:
            want = per_step if (r["step"] + 1) % H == 0 else 0
            if r["replica_comm_bytes"] != want:
                sys.exit(f"FAILED: {name} step {r['step']}: replica_comm_bytes {r['replica_comm_bytes']}, "
                         f"expected {want} (a hybrid step's at an outer step, else 0)")

    diloco = train(50, "--diloco", "10")
    h, d = sum(r["replica_comm_bytes"] for r in hybrid), sum(r["replica_comm_bytes"] for r in diloco)
    if any(r["replica_comm_bytes"] != per_step for r in hybrid) or per_step < 8 * psi:
        sys.exit(f"FAILED: hybrid steps sent {sorted(set(r['replica_comm_bytes'] for r in hybrid))} bytes across "
                 f"replicas; expected the same every step, at least 8Ψ = {8 * psi}")
    if d != 5 * per_step:
        sys.exit(f"FAILED: DiLoCo H 10 sent {d} bytes across replicas in 50 steps, expected 5 x {per_step}")
    if d > 0.1 * h * 1.01:
        sys.exit(f"FAILED: DiLoCo H 10 sent {d} bytes, more than 0.1 of hybrid's {h} plus 1%")
    print(f"50 steps: replica_comm_bytes hybrid {h}, DiLoCo H 10 {d} (ratio {d / h:.4f}); final loss hybrid "
          f"{hybrid[-1]['loss']:.4f}, DiLoCo {diloco[-1]['loss']:.4f}")

    # Checkpoints: saved after 6 steps (mid-period), resumed on the same replicas (4 ranks, and 2 of
    # one rank each): the losses of the uninterrupted run; on one replica of 2 ranks, every rank
    # restarts from the global state, says so, and trains.
    with tempfile.TemporaryDirectory() as d:
        train(8, "--diloco", "4", "--save-dir", d, "--save-every", "6")
        resumed = train(12, "--diloco", "4", "--save-dir", d, "--resume")
        for two_ranks in (["--shard-group-size", "1"], ["--shard-group-size", "2"]):
            cmd = command(a.train_gpt, a.torchrun, 2, ["--strategy", "hybrid", "--steps", "8", "--seed", "1", "--json",
                                                       "--diloco", "4", "--save-dir", d, "--resume"] + two_ranks)
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith('{"step"')]
            if p.returncode != 0 or not rows:
                sys.exit(f"FAILED: resume at 2 ranks {two_ranks}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
            if two_ranks[1] == "1":
                worst_two = max(abs(r["loss"] - q["loss"]) / q["loss"] for r, q in zip(rows, nesterov[6:8]))
                if worst_two > 1e-5:
                    sys.exit(f"FAILED: resumed on 2 replicas of 1 rank: losses differ by {worst_two:.2e}")
            elif "restarted from the global state at inner step 4" not in p.stderr:
                sys.exit(f"FAILED: resumed on 1 replica: no 'restarted from the global state' in\n{p.stderr}")
    worst = max(abs(r["loss"] - q["loss"]) / q["loss"] for r, q in zip(resumed, nesterov[6:]))
    if len(resumed) != 6 or worst > 1e-5:
        sys.exit(f"FAILED: DiLoCo resumed at step 6 of 12: {len(resumed)} rows, worst loss difference {worst:.2e}")
    print(f"DiLoCo saved at step 6 (mid-period): resumed on the same replicas within {worst:.2e} of the uninterrupted "
          f"run, on 2 replicas of 1 rank within {worst_two:.2e}; on 1 replica restarted from the global state")

    # Refused before anything runs: exit status 2, the remedy named.
    for flags, needle in ((["--local-sgd", "4"], "add --strategy hybrid"),
                          (HYBRID + ["--diloco", "4", "--fragments", "3"], "--fragments 3 does not divide H = 4"),
                          (HYBRID + ["--outer-lr", "1"], "add --diloco H"),
                          (HYBRID + ["--overlap"], "--overlap needs --local-sgd H or --diloco H"),
                          (HYBRID + ["--local-sgd", "4", "--diloco", "4"], "pass one")):
        p = subprocess.run([a.train_gpt, "--steps", "1"] + flags, capture_output=True, text=True, timeout=60)
        if p.returncode != 2 or needle not in p.stderr:
            sys.exit(f"FAILED: {flags}: exit {p.returncode}, expected 2 with '{needle}'\n{p.stderr}")
    print("bad flags refused with exit status 2")


if __name__ == "__main__":
    main()
