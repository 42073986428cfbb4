#!/usr/bin/env python3
"""End-to-end check of train_llama --pp (issue 44's commands; the checkpoints' resume is
check_pipelined_checkpoints.py's).

- `--nproc-per-node 4 --n-layer 4 --pp 2 --tp 2 --microbatches 4 --pp-schedule 1f1b --steps 5 --seed 1 --json`
  gives the losses of `--n-layer 4 --steps 5 --seed 1 --json` on one rank (1e-5 relative); its rows carry
  pp 2, the schedule, the microbatches, a bubble in [0, 1) and p2p_bytes from the shapes: per step each of
  the 2 tensor-parallel pipelines moves M microbatches' activations forward and their gradients back,
  each [B/M, T, C] fp32.
- `--nproc-per-node 4 --pp 4 --pp-schedule interleaved --stages-per-rank 2 --n-layer 8 --microbatches 8
  --batch-size 16` against one rank with `--n-layer 8 --batch-size 16`.
- `--nproc-per-node 4 --n-layer 4 --pp 2 --microbatches 4 --pp-schedule zero-bubble --batch-size 16` (FSDP
  over 2 data-parallel ranks inside each stage) against one rank with `--n-layer 4 --batch-size 16`; the
  same at 2 ranks (plain stages); 1f1b with FSDP in the stages, tied and clipped; gpipe at 2 ranks, tied
  and clipped, and the same built sharded (--build-sharded: each layer sharded as it is built, over the
  stage's ranks): the same losses bit for bit and the same parameter count. Every stage is FSDP over its ranks (over one where the mesh's dp_shard is 1): each rank's
  stage gathers each of its units once per step and reduce-scatters each once (the rows'
  fsdp_all_gathers and fsdp_reduce_scatters; at --n-layer 4 --pp 2: its 2 layers and its root).
- 3-D at 8 ranks, pp 2 x dp_shard 2 x tp 2, in bf16 (--mixed-precision bf16, activations between stages
  in bf16: 2 bytes each) with activation checkpointing, against one rank in bf16 (no recompute), to
  the mixed-precision tolerance (3e-2).
- fp16 at (pp 2, dp_shard 2) (--mixed-precision fp16: one loss scaler over the stages), against one rank
  in fp16, to the mixed-precision tolerance (3e-2): the first step overflows at the initial scale on
  both and is skipped (grad_norm null), the steps after train alike.
- 1f1b at pp 2 with and without --activation-checkpointing: both one rank's losses, the recomputing
  run's peak (the rows' peak_bytes, max over ranks) below the other's. Zero bubble with it is refused
  (its weight pass cannot run through a recompute).
- `--pp 2 --microbatches 1 --pp-schedule 1f1b` on 2 ranks is refused before any step (exit 2, naming the
  microbatches); so is a hand-made list that deadlocks (--pp-schedule-file), naming the action;
  --pp-schedule-dump prints the lists in one process.
- A stage's process stopped (SIGSTOP) or killed (SIGKILL) mid-run, the ranks started directly (as
  torchrun would, without its agent, which would end the others itself): the first stage's rank
  ends within the timeout (--timeout 5, plus 10 s) with an error naming what it waited in: a
  transfer (the point-to-point operation, its microbatch and the peer stage), or, when the fault
  lands while the ranks are in the step's own collectives (the loss, the norm), that collective
  and the peer rank that stopped answering. Which one is a race; both are reported.
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import Agent, command, free_port, run  # noqa: E402

T, C = 64, 128  # train_llama's --block-size and --n-embd


def compare(a, ranks, pipelined, reference, label, B=12, M=None, dp=1, units=None, rtol=1e-5, elt=4):
    one, _ = run(command(a.train_llama, a.torchrun, 1, reference), a.timeout)
    err = []
    many, summary = run(command(a.train_llama, a.torchrun, ranks, pipelined), a.timeout, stderr_out=err)
    if "Warning" in err[0]:  # e.g. the library taking the pipeline's clipping for the per-rank habit
        sys.exit(f"FAILED: {label}: warnings\n{err[0]}")
    assert len(one) == len(many), (len(one), len(many))
    worst = 0.0
    for r1, rn in zip(one, many):
        rel = abs(rn["loss"] - r1["loss"]) / abs(r1["loss"])
        worst = max(worst, rel)
        if rel > rtol:
            sys.exit(f"FAILED: {label}: step {r1['step']}: loss {rn['loss']} vs one rank's {r1['loss']} (rel {rel:.2e})")
        if not (0 <= rn["bubble"] < 1) or rn["pp"] < 2 or rn["microbatches"] != M or rn["dp"] != dp:
            sys.exit(f"FAILED: {label}: row {rn}")
        # Each tensor-parallel pipeline: M activations forward and M gradients back across each of
        # the stage boundaries that cross ranks.
        V = rn["stages_per_rank"]
        boundaries = rn["pp"] * V - 1
        want = dp * rn["tp"] * boundaries * 2 * M * (B // (dp * M)) * T * C * elt
        if rn["p2p_bytes"] != want:
            sys.exit(f"FAILED: {label}: p2p_bytes {rn['p2p_bytes']}, want {want} from the shapes")
        # Every stage is FSDP over its ranks: one all-gather and one reduce-scatter per unit and step.
        ag, rs = rn["fsdp_all_gathers"], rn["fsdp_reduce_scatters"]
        if ag != rs or ag < 1 or (units is not None and ag != units):
            sys.exit(f"FAILED: {label}: step {rn['step']}: {ag} all-gathers and {rs} reduce-scatters, want "
                     f"{units if units is not None else 'as many'} of each (one per unit)")
    print(f"{label} on {ranks} ranks (mesh {summary['mesh']}): {len(many)} losses within {worst:.2e} of one rank's, "
          f"bubble {many[-1]['bubble']:.3f}, {many[-1]['p2p_bytes']} bytes between stages per step, "
          f"peak {many[-1]['peak_bytes']} bytes")
    return many


def refused(a, ranks, args, text, label):
    p = subprocess.run(command(a.train_llama, a.torchrun, ranks, args), capture_output=True, text=True,
                       timeout=a.timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = p.stdout + p.stderr
    if p.returncode == 0 or text not in out or "step    0" in out or '"step"' in p.stdout:
        sys.exit(f"FAILED: {label}: exit {p.returncode}, wanted a refusal naming '{text}' before any step\n{out}")
    print(f"{label}: refused (exit {p.returncode}): {text}")


def stage_fault(a, sig, label, timeout=5, slack=10):
    """Ranks 0 and 1 of a 1F1B pipeline at pp 2; once rank 0 has reported step 1, `sig` to rank 1."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    cmd = [a.train_llama, "--n-layer", "2", "--pp", "2", "--microbatches", "8", "--batch-size", "16", "--pp-schedule", "1f1b",
           "--steps", "100000", "--timeout", str(timeout), "--json"]
    ranks = [Agent(f"rank {r}", cmd, dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    try:
        deadline = time.time() + a.timeout
        while ranks[0].last_step() < 1:
            if time.time() > deadline or ranks[0].p.poll() is not None:
                sys.exit(f"FAILED: {label}: rank 0 never reported step 1\n" +
                         "\n".join(l for _, _, l in ranks[0].lines()))
            time.sleep(0.05)
        t_fault = time.time()
        os.kill(ranks[1].p.pid, sig)
        try:
            rc = ranks[0].p.wait(timeout=timeout + slack)
        except subprocess.TimeoutExpired:
            sys.exit(f"FAILED: {label}: rank 0 still running {timeout + slack} s after the fault")
        took = time.time() - t_fault
        for t in ranks[0].threads:
            t.join(timeout=5)
        err = "\n".join(l for _, kind, l in ranks[0].lines("err") if not l.startswith("[W"))
        transfer = ("recv of microbatch" in err or "send of microbatch" in err) and "stage 1" in err
        collective = "fsdp::all_reduce" in err and "Peer rank 1" in err
        if rc == 0 or not (transfer or collective):
            sys.exit(f"FAILED: {label}: rank 0 exited {rc} after {took:.1f} s; wanted an error naming the transfer "
                     f"(its microbatch and stage 1) or the collective and peer rank 1:\n{err}")
        line = next(l for l in err.splitlines() if ("of microbatch" in l if transfer else "fsdp::all_reduce" in l))
        print(f"{label}: rank 0 ended (exit {rc}) {took:.1f} s after the fault, in "
              f"{'a transfer' if transfer else 'a collective'}: {line[:220]}")
    finally:
        for r in ranks:
            if r.p.poll() is None:
                os.kill(r.p.pid, signal.SIGKILL)
            r.p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args()
    base = ["--steps", "5", "--seed", "1", "--json"]
    compare(a, 4, ["--n-layer", "4", "--pp", "2", "--tp", "2", "--microbatches", "4", "--pp-schedule", "1f1b"] + base,
            ["--n-layer", "4"] + base, "1f1b, pp 2 x tp 2", M=4)
    compare(a, 4, ["--pp", "4", "--pp-schedule", "interleaved", "--stages-per-rank", "2", "--n-layer", "8",
                   "--microbatches", "8", "--batch-size", "16"] + base,
            ["--n-layer", "8", "--batch-size", "16"] + base, "interleaved, pp 4, 2 stages per rank", B=16, M=8)
    compare(a, 2, ["--n-layer", "4", "--pp", "2", "--microbatches", "4", "--pp-schedule", "zero-bubble",
                   "--batch-size", "16"] + base,
            ["--n-layer", "4", "--batch-size", "16"] + base, "zero-bubble, pp 2", B=16, M=4)
    # FSDP over 2 data-parallel ranks inside each stage: the third command, then 1f1b tied and
    # clipped (the norm over the stages' shards).
    compare(a, 4, ["--n-layer", "4", "--pp", "2", "--microbatches", "4", "--pp-schedule", "zero-bubble",
                   "--batch-size", "16"] + base,
            ["--n-layer", "4", "--batch-size", "16"] + base, "zero-bubble, pp 2 x dp_shard 2 (FSDP in each stage)",
            B=16, M=4, dp=2, units=3)
    tied = ["--n-layer", "4", "--pp", "2", "--microbatches", "4", "--pp-schedule", "1f1b", "--batch-size", "16",
            "--tied", "--clip", "0.5"] + base
    whole = compare(a, 4, tied, ["--n-layer", "4", "--batch-size", "16", "--tied", "--clip", "0.5"] + base,
                    "1f1b, pp 2 x dp_shard 2 (FSDP in each stage), tied, clipped", B=16, M=4, dp=2, units=3)
    built, _ = run(command(a.train_llama, a.torchrun, 4, tied + ["--build-sharded"]), a.timeout)
    if [(r["loss"], r["grad_norm"], r["params"]) for r in built] != [(r["loss"], r["grad_norm"], r["params"]) for r in whole]:
        sys.exit(f"FAILED: --build-sharded at (pp 2, dp_shard 2): rows {built}\nagainst the stages built whole: {whole}")
    print(f"--build-sharded at (pp 2, dp_shard 2), tied, clipped: {len(built)} losses and norms those of the stages "
          f"built whole, bit for bit ({built[-1]['params']} parameters)")
    compare(a, 8, ["--n-layer", "4", "--pp", "2", "--tp", "2", "--microbatches", "4", "--pp-schedule", "1f1b",
                   "--batch-size", "16", "--mixed-precision", "bf16", "--activation-checkpointing"] + base,
            ["--n-layer", "4", "--batch-size", "16", "--mixed-precision", "bf16"] + base,
            "1f1b, pp 2 x dp_shard 2 x tp 2, bf16, activation checkpointing", B=16, M=4, dp=2, units=3, rtol=3e-2,
            elt=2)
    fp16 = compare(a, 4, ["--n-layer", "4", "--pp", "2", "--microbatches", "4", "--pp-schedule", "1f1b",
                          "--batch-size", "16", "--mixed-precision", "fp16", "--clip", "1.0"] + base,
                   ["--n-layer", "4", "--batch-size", "16", "--mixed-precision", "fp16", "--clip", "1.0"] + base,
                   "1f1b, pp 2 x dp_shard 2, fp16", B=16, M=4, dp=2, units=3, rtol=3e-2, elt=2)
    if fp16[0]["grad_norm"] is not None or any(r["grad_norm"] is None for r in fp16[1:]):
        sys.exit(f"FAILED: fp16 under --pp: want the first step skipped (an overflow at the initial scale) and "
                 f"the rest stepped: grad norms {[r['grad_norm'] for r in fp16]}")
    # Activation checkpointing with several microbatches in flight (1F1B at pp 2 holds 2 on the first
    # stage): one rank's losses, and a lower peak than the same run storing its activations.
    plain = compare(a, 2, ["--n-layer", "4", "--pp", "2", "--microbatches", "4", "--pp-schedule", "1f1b",
                           "--batch-size", "16"] + base,
                    ["--n-layer", "4", "--batch-size", "16"] + base, "1f1b, pp 2", B=16, M=4)
    ac = compare(a, 2, ["--n-layer", "4", "--pp", "2", "--microbatches", "4", "--pp-schedule", "1f1b",
                        "--batch-size", "16", "--activation-checkpointing"] + base,
                 ["--n-layer", "4", "--batch-size", "16"] + base, "1f1b, pp 2, activation checkpointing", B=16, M=4)
    if not ac[-1]["peak_bytes"] < plain[-1]["peak_bytes"]:
        sys.exit(f"FAILED: activation checkpointing under --pp: peak {ac[-1]['peak_bytes']} bytes, not below "
                 f"{plain[-1]['peak_bytes']} without it: were the activations recomputed?")
    print(f"activation checkpointing under --pp: peak {ac[-1]['peak_bytes'] / plain[-1]['peak_bytes']:.3f} of the "
          f"run without")
    compare(a, 2, ["--n-layer", "3", "--pp", "2", "--microbatches", "3", "--pp-schedule", "gpipe", "--tied",
                   "--clip", "0.5"] + base,
            ["--n-layer", "3", "--tied", "--clip", "0.5"] + base, "gpipe, pp 2, tied, clipped", M=3)
    refused(a, 2, ["--pp", "2", "--pp-schedule", "zero-bubble", "--activation-checkpointing"] + base,
            "--activation-checkpointing with --pp-schedule zero-bubble", "zero bubble with activation checkpointing")
    refused(a, 2, ["--pp", "2", "--microbatches", "1", "--pp-schedule", "1f1b"] + base,
            "needs at least as many microbatches as pipeline ranks: 1 microbatches for 2 ranks", "too few microbatches")
    with tempfile.TemporaryDirectory() as d:
        bad = os.path.join(d, "deadlock.csv")
        with open(bad, "w") as f:  # rank 0 waits for a gradient before it sends the activations
            f.write("0F0,0RECV_B0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")
        refused(a, 2, ["--pp", "2", "--microbatches", "1", "--pp-schedule-file", bad] + base,
                "the order deadlocks: rank 0 waits at its action 1, 0RECV_B0", "a deadlocking list from a file")
    stage_fault(a, signal.SIGSTOP, "the second stage stopped")
    stage_fault(a, signal.SIGKILL, "the second stage killed")
    p = subprocess.run([a.train_llama, "--pp", "4", "--pp-schedule", "1f1b", "--microbatches", "8", "--n-layer", "4",
                        "--pp-schedule-dump"], capture_output=True, text=True, timeout=a.timeout)
    lines = p.stdout.splitlines()
    if p.returncode != 0 or len(lines) != 5 or not lines[1].startswith("0F0,0SEND_F0,0F1,0SEND_F1,0F2,0SEND_F2,0F3"):
        sys.exit(f"FAILED: --pp-schedule-dump: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    print("--pp-schedule-dump: " + lines[0])


if __name__ == "__main__":
    main()
