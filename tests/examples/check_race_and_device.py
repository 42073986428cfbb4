#!/usr/bin/env python3
"""The race switch and the device flag through the example programs (issue 42's CPU checks).

1. `FSDP_RACE_DELAY=7 torchrun --standalone --no-python --nproc-per-node 2 train_gpt --steps 6 --seed 1
   --json --prefetch 2`: every step's loss and gradient norm bit-identical (as printed, %.9g) to the
   same command without the variable, and every rank's stderr says `race delays applied: N`, N > 0;
   the same at 4 ranks with hybrid sharding (replicas and groups at once).
2. FSDP_RACE_DELAY that is not a whole number: exit 1 naming the variable, nothing trained.
3. On a machine without CUDA: `--device cuda` on train_gpt and train_llama exits 2 naming CUDA, and
   FSDP_TEST_GLOO_CUDA=1 (the testing mode of several ranks on one GPU) is refused naming it; so is
   `fsdp_bench --simulate --device cuda` (exit 2 naming CUDA), whose --help lists --device.

With --device cuda (scripts/gpu-check.sh, on a GPU): the ranks run on cuda:0 over Gloo
(FSDP_TEST_GLOO_CUDA=1), and besides 1 (on the GPU) every strategy of train_gpt at 4 ranks and
train_llama at (dp_shard 2, tp 2) give the losses of one rank on the GPU (1e-5 relative), with the
race switch on and off, and so does train_gpt --build-sharded at 2 ranks (each block moved to the
GPU as it is built); LocalSGD H = 4 over hybrid's two replicas gives the same losses with the
switch on and off, and the CPU run's (1e-4); a sharded save at 2 ranks on the GPU, resumed at 1 rank
on the GPU and at 3 ranks on the CPU, continues with the uninterrupted run's losses (1e-5).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import command, run  # noqa: E402

SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8"]
failures = []


def expect(name, ok, detail=""):
    print(("ok    " if ok else "FAIL  ") + name + ("" if ok else "\n      " + detail.replace("\n", "\n      ")))
    if not ok:
        failures.append(name)


def rows_of(rows):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def race_parity(a, ranks, extra, prog=None, one_rank=False, cpu_rtol=None):
    """The race switch on and off at `ranks` ranks (on the GPU with --device cuda); with `one_rank`,
    both against one rank's losses too (1e-5 relative)."""
    prog = prog or a.train_gpt
    args = ["--steps", "6", "--seed", "1", "--json", "--prefetch", "2"] + extra
    env = {}
    if a.device == "cuda":
        args += ["--device", "cuda"]
        env["FSDP_TEST_GLOO_CUDA"] = "1"
    off, _ = run(command(prog, a.torchrun, ranks, args), 240, env)
    err = []
    on, _ = run(command(prog, a.torchrun, ranks, args), 240, dict(env, FSDP_RACE_DELAY="7"), err)
    if one_rank:
        one, _ = run(command(prog, a.torchrun, 1, args), 240, env)
        worst = max(abs(m["loss"] - o["loss"]) / abs(o["loss"]) for m, o in zip(off, one))
        expect(f"{os.path.basename(prog)} at {ranks} ranks {' '.join(extra)} on {a.device}: one rank's losses (1e-5)",
               len(one) == len(off) and worst <= 1e-5, f"worst relative difference {worst:.2e}")
    if cpu_rtol is not None:  # the same ranks on the CPU
        cpu, _ = run(command(prog, a.torchrun, ranks, [x for x in args if x not in ("--device", "cuda")]), 240)
        worst = max(abs(g["loss"] - c["loss"]) / abs(c["loss"]) for g, c in zip(off, cpu))
        expect(f"{os.path.basename(prog)} at {ranks} ranks {' '.join(extra)}: the GPU's losses are the CPU's "
               f"({cpu_rtol:g})", len(cpu) == len(off) and worst <= cpu_rtol, f"worst relative difference {worst:.2e}")
    counts = [int(n) for n in re.findall(r"race delays applied: (\d+)", err[0])]
    label = f"{ranks} ranks {' '.join(extra)}".strip()
    expect(f"race delays at {label}: losses and gradient norms bit-identical to the run without them",
           rows_of(on) == rows_of(off), f"on:  {rows_of(on)}\noff: {rows_of(off)}")
    expect(f"race delays at {label}: every rank says 'race delays applied: N' with N > 0",
           len(counts) == ranks and min(counts) > 0, err[0][-2000:])
    print(f"      {label}: {len(on)} steps, delays applied per rank {counts}, last loss {on[-1]['loss']}")


def resume_across(a):
    """A sharded save at 2 ranks on the GPU (after step 3), resumed at 1 rank on the GPU and at 3
    ranks on the CPU: steps 3 to 5 give the uninterrupted 2-rank run's losses."""
    small = [x if x != "8" else "12" for x in SMALL]  # --batch-size 12: 2, 1 and 3 ranks
    base = ["--seed", "1", "--json"] + small
    gpu, env = (["--device", "cuda"], {"FSDP_TEST_GLOO_CUDA": "1"}) if a.device == "cuda" else ([], {})
    whole, _ = run(command(a.train_gpt, a.torchrun, 2, base + gpu + ["--steps", "6"]), 240, env)
    with tempfile.TemporaryDirectory() as d:
        save = ["--save-dir", d, "--save-every", "3"]
        run(command(a.train_gpt, a.torchrun, 2, base + gpu + save + ["--steps", "3"]), 240, env)
        for ranks, where, extra, e in ((1, "1 rank on the GPU", gpu, env), (3, "3 ranks on the CPU", [], {})):
            rows, _ = run(command(a.train_gpt, a.torchrun, ranks,
                                  base + extra + ["--save-dir", d, "--save-every", "100", "--resume", "--steps", "6"]),
                          240, e)
            want = [r for r in whole if r["step"] >= 3]
            worst = max((abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(rows, want)), default=1.0)
            expect(f"a save at 2 ranks on the GPU resumed at {where}: steps 3-5 give the uninterrupted losses (1e-5)",
                   [r["step"] for r in rows] == [3, 4, 5] and worst <= 1e-5,
                   f"steps {[r['step'] for r in rows]}, worst relative difference {worst:.2e}")


def plain(cmd, env_extra=None, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout, p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--fsdp-bench", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()

    race_parity(a, 2, [])
    race_parity(a, 4, ["--strategy", "hybrid"] + SMALL)
    if a.device == "cuda":  # several ranks on one GPU over Gloo, against one rank on the GPU
        # One rank over NCCL (the default, no testing mode) and one in the testing mode: the same
        # run (alone, every collective is a copy), so the same numbers.
        base = ["--steps", "4", "--seed", "1", "--json", "--device", "cuda"] + SMALL
        nccl, _ = run(command(a.train_gpt, a.torchrun, 1, base), 240)
        gloo, _ = run(command(a.train_gpt, a.torchrun, 1, base), 240, {"FSDP_TEST_GLOO_CUDA": "1"})
        expect("train_gpt --device cuda alone: over NCCL as in the testing mode", rows_of(nccl) == rows_of(gloo),
               f"nccl: {rows_of(nccl)}\ngloo: {rows_of(gloo)}")
        for strategy in ("full", "grad-op", "optimizer", "replicate"):
            race_parity(a, 4, ["--strategy", strategy] + SMALL, one_rank=True)
        race_parity(a, 4, ["--tp", "2", "--n-layer", "2"], prog=a.train_llama, one_rank=True)
        race_parity(a, 2, ["--build-sharded"] + SMALL, one_rank=True)
        race_parity(a, 4, ["--strategy", "hybrid", "--local-sgd", "4"] + SMALL, cpu_rtol=1e-4)
        resume_across(a)
        if failures:
            sys.exit(f"FAILED: {len(failures)} check(s): {', '.join(failures)}")
        return

    rc, out, err = plain([a.train_gpt, "--steps", "1"] + SMALL, {"FSDP_RACE_DELAY": "seven"})
    expect("FSDP_RACE_DELAY=seven: exit 1 naming the variable, nothing trained",
           rc == 1 and "FSDP_RACE_DELAY='seven' is not a race-delay seed" in err and "step" not in out,
           f"exit {rc}; stdout:\n{out[-1000:]}\nstderr:\n{err[-2000:]}")

    cuda = subprocess.run([a.python, "-c", "import torch; print(int(torch.cuda.is_available()))"],
                          capture_output=True, text=True).stdout.strip() == "1"
    if cuda:
        print("skip  the refusals without CUDA: this machine has a CUDA device")
    else:
        for prog in (a.train_gpt, a.train_llama):
            rc, out, err = plain([prog, "--device", "cuda", "--steps", "1"])
            name = os.path.basename(prog)
            expect(f"{name} --device cuda without CUDA: exit 2 naming CUDA, nothing trained",
                   rc == 2 and "--device cuda, but this machine has no CUDA device" in err and not out.strip(),
                   f"exit {rc}; stdout:\n{out[-1000:]}\nstderr:\n{err[-2000:]}")
        rc, out, err = plain([a.train_gpt, "--steps", "1"] + SMALL, {"FSDP_TEST_GLOO_CUDA": "1"})
        expect("FSDP_TEST_GLOO_CUDA=1 without CUDA: exit 1 naming the mode, nothing trained",
               rc == 1 and "FSDP_TEST_GLOO_CUDA=1 asks for the testing mode of several ranks on one GPU" in err
               and "step" not in out, f"exit {rc}; stdout:\n{out[-1000:]}\nstderr:\n{err[-2000:]}")
        rc, out, err = plain([a.fsdp_bench, "--simulate", "--device", "cuda"])
        expect("fsdp_bench --simulate --device cuda without CUDA: exit 2 naming CUDA, nothing run",
               rc == 2 and "--device cuda, but this machine has no CUDA device" in err and not out.strip(),
               f"exit {rc}; stdout:\n{out[-1000:]}\nstderr:\n{err[-2000:]}")
    rc, out, err = plain([a.fsdp_bench, "--help"])
    expect("fsdp_bench --help lists --device", rc == 0 and re.search(r"^\s*--device", out, re.M) is not None,
           f"exit {rc}; stdout:\n{out[-3000:]}")
    rc, out, err = plain([a.fsdp_bench, "--device", "cuda"])
    expect("fsdp_bench --device cuda without --simulate: exit 2 naming --simulate, on any machine",
           rc == 2 and "--device cuda is for --simulate's rank" in err and not out.strip(),
           f"exit {rc}; stdout:\n{out[-1000:]}\nstderr:\n{err[-2000:]}")
    rc, out, err = plain([a.fsdp_bench, "--device", "gpu"])
    expect("fsdp_bench --device gpu: exit 2 naming --device", rc == 2 and "--device" in err,
           f"exit {rc}; stderr:\n{err[-2000:]}")
    rc, out, err = plain([a.train_gpt, "--device", "tpu", "--steps", "1"])
    expect("train_gpt --device tpu: exit 2 naming --device", rc == 2 and "--device" in err,
           f"exit {rc}; stderr:\n{err[-2000:]}")
    if failures:
        sys.exit(f"FAILED: {len(failures)} check(s): {', '.join(failures)}")


if __name__ == "__main__":
    main()
