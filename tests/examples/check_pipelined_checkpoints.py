#!/usr/bin/env python3
"""End-to-end check of train_llama --pp's checkpoints (checkpoint/pipelined.h): one checkpoint of the
whole model, resumed on any mesh, training continuing as uninterrupted.

- The issue's command: `--nproc-per-node 4 --n-layer 4 --pp 2 --tp 2 --microbatches 4 --pp-schedule
  1f1b --steps 5 --seed 1 --json --save-dir D --save-every 3`, then `--n-layer 4 --steps 8 --seed 1
  --json --save-dir D --resume` at one rank continues the uninterrupted 8-step losses of one rank
  (1e-5 relative); the same checkpoint resumed at (pp 4) on 4 ranks too, given --seed 2: the
  checkpoint's seed continues (the same losses), and the program says on stderr that --seed 2 is
  ignored.
- Saved at (pp 2, dp_shard 2) with a tied embedding and head, clipped, 5 layers (uneven stages):
  resumed at one rank and at (pp 4, 4 ranks) continuing one rank's uninterrupted losses (1e-5).
- `--export-hf` from that pipelined run, bit for bit the export of its checkpoint loaded at one
  rank (which runs no step); transformers' from_pretrained loads it and its logits equal the C++
  model's on the same files (1e-5).
- An elastic restart: `--pp 2` on 2 workers under torchrun's agent (--max-restarts 1), saving every 2
  steps; the second stage's worker SIGKILLed mid-run: the agent restarts both once, they resume from
  the latest checkpoint, and every step is logged with the uninterrupted losses (1e-5), the job
  ending with exit 0.
- fp16 at pp 2 (one loss scaler over the stages): saved after step 3, resumed on the same mesh and at
  one rank, the remaining steps give the uninterrupted fp16 run's losses exactly (the loss scale and its
  growth count travel in the checkpoint's metadata; without them the resumed run would start again
  from the initial scale, overflow and skip a step).
- `--async-save` with --pp is refused before any step (exit 2).
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import Agent, agent_env, command, run, torchrun_cmd, wait_for  # noqa: E402

PROMPT = [1, 5, 9, 200, 3, 77, 12, 255, 0, 31]


def losses(a, ranks, args, stderr=None):
    rows, _ = run(command(a.train_llama, a.torchrun, ranks, args), a.timeout, stderr_out=stderr)
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def continues(label, got, want, first, last, rtol=1e-5):
    """`got`'s steps are first..last, each within rtol of the uninterrupted run's."""
    if sorted(got) != list(range(first, last)):
        sys.exit(f"FAILED: {label}: steps {sorted(got)}, expected {first}..{last - 1}")
    worst = 0.0
    for s, l in got.items():
        rel = abs(l - want[s]) / abs(want[s])
        worst = max(worst, rel)
        if rel > rtol:
            sys.exit(f"FAILED: {label}: step {s}: loss {l} vs uninterrupted {want[s]} (rel {rel:.2e})")
    print(f"{label}: steps {first}..{last - 1} within {worst:.2e} of the uninterrupted losses")


def elastic(a, tmp):
    """A stage's worker killed under torchrun's agent: one restart, resumed, every step's loss."""
    ck = os.path.join(tmp, "elastic")
    args = ["--n-layer", "4", "--batch-size", "16", "--seed", "1", "--json", "--timeout", "20"]
    steps, kill_after = 16, 5
    whole = losses(a, 1, args + ["--steps", str(steps)])
    pipelined = args + ["--pp", "2", "--microbatches", "4", "--steps", str(steps), "--save-dir", ck, "--save-every",
                        "2", "--resume"]
    ag = Agent("agent", torchrun_cmd(a.torchrun, a.train_llama, pipelined, 2, max_restarts=1), agent_env())
    try:
        if not wait_for(lambda: ag.last_step() >= kill_after, a.timeout):
            sys.exit(f"FAILED: elastic: step {kill_after} never logged:\n{ag.log()[-4000:]}")
        killed_at = ag.last_step()
        ag.kill_worker(1)
        rc = ag.wait(a.timeout)
        if rc != 0:
            sys.exit(f"FAILED: elastic: torchrun exited {rc} after the second stage's worker was killed:\n"
                     f"{ag.log()[-6000:]}")
        restarts = sum(1 for _, _, s in ag.lines("err") if "Rendezvous complete for workers" in s) - 1
        resumed = [r for r in ag.rows() if "resumed" in r]
        if restarts != 1 or len(resumed) != 1 or resumed[0]["step"] > killed_at + 1:
            sys.exit(f"FAILED: elastic: {restarts} restart(s), resumed rows {resumed} (killed after step "
                     f"{killed_at}):\n{ag.log()[-6000:]}")
        rows = [r for r in ag.rows() if "loss" in r]
        got = {}
        for r in rows:
            rel = abs(r["loss"] - whole[r["step"]]) / abs(whole[r["step"]])
            if rel > 1e-5:
                sys.exit(f"FAILED: elastic: step {r['step']}: loss {r['loss']} vs {whole[r['step']]} (rel {rel:.2e})")
            got[r["step"]] = max(got.get(r["step"], 0.0), rel)
        if sorted(got) != list(range(steps)):
            sys.exit(f"FAILED: elastic: steps logged {sorted(got)}, expected 0..{steps - 1}")
        print(f"elastic: the second stage's worker killed after step {killed_at}, one restart, resumed at step "
              f"{resumed[0]['step']}; steps 0..{steps - 1} within {max(got.values()):.2e} of the uninterrupted losses")
    finally:
        if ag.p.poll() is None:
            ag.kill()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-llama", required=True)
    p.add_argument("--torchrun", required=True)
    p.add_argument("--timeout", type=float, default=240)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # The command, saved at (pp 2, tp 2) after step 3, resumed at one rank and at pp 4.
        d = os.path.join(tmp, "tp")
        base = ["--n-layer", "4", "--seed", "1", "--json"]
        whole = losses(a, 1, base + ["--steps", "8"])
        first = losses(a, 4, base + ["--pp", "2", "--tp", "2", "--microbatches", "4", "--pp-schedule", "1f1b",
                                     "--steps", "5", "--save-dir", d, "--save-every", "3"])
        continues("(pp 2, tp 2) before the save", first, whole, 0, 5)
        if not os.path.isfile(os.path.join(d, "step-000003", "manifest.json")):
            sys.exit(f"FAILED: no checkpoint step-000003 under {d}: {os.listdir(d)}")
        continues("saved at (pp 2, tp 2), resumed at one rank",
                  losses(a, 1, base + ["--steps", "8", "--save-dir", d, "--resume"]), whole, 3, 8)
        # With another --seed: the checkpoint's seed continues, and the program says so.
        said = []
        reseeded = [x if x != "1" else "2" for x in base]
        continues("saved at (pp 2, tp 2), resumed at (pp 4) with --seed 2",
                  losses(a, 4, reseeded + ["--pp", "4", "--microbatches", "4", "--steps", "8", "--save-dir", d,
                                           "--resume"], said), whole, 3, 8)
        if "--seed 2 ignored" not in said[0] or "the checkpoint's seed 1" not in said[0]:
            sys.exit(f"FAILED: --resume with --seed 2 over a seed-1 checkpoint said nothing of it:\n{said[0]}")

        # (pp 2, dp_shard 2), tied, clipped, 5 layers: resumed at one rank and at (pp 4); its export.
        e, x1, x2 = (os.path.join(tmp, n) for n in ("dp", "exported-pp", "exported-one"))
        tied = ["--n-layer", "5", "--batch-size", "16", "--tied", "--clip", "0.5", "--seed", "1", "--json"]
        whole = losses(a, 1, tied + ["--steps", "6"])
        first = losses(a, 4, tied + ["--pp", "2", "--microbatches", "4", "--steps", "3", "--save-dir", e,
                                     "--save-every", "3", "--export-hf", x1])
        continues("(pp 2, dp_shard 2) before the save", first, whole, 0, 3)
        continues("saved at (pp 2, dp_shard 2), resumed at one rank",
                  losses(a, 1, tied + ["--steps", "6", "--save-dir", e, "--resume"]), whole, 3, 6)
        continues("saved at (pp 2, dp_shard 2), resumed at (pp 4)",
                  losses(a, 4, tied + ["--pp", "4", "--microbatches", "4", "--steps", "6", "--save-dir", e,
                                       "--resume"]), whole, 3, 6)
        # The export of the pipelined run and of its checkpoint at one rank (no step run): the same bytes.
        cmd = command(a.train_llama, a.torchrun, 1, tied + ["--steps", "3", "--save-dir", e, "--resume",
                                                            "--export-hf", x2])
        q = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        if q.returncode != 0:
            sys.exit(f"FAILED: {' '.join(cmd)} exited {q.returncode}\n{q.stdout}\n{q.stderr}")
        got, want = load_file(os.path.join(x1, "model.safetensors")), load_file(os.path.join(x2, "model.safetensors"))
        if sorted(got) != sorted(want) or any(not torch.equal(got[k], want[k]) for k in want):
            diff = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
            sys.exit(f"FAILED: --export-hf at (pp 2, dp_shard 2) differs from its checkpoint's at one rank: {diff[:5]}")
        if "lm_head.weight" in got or "model.embed_tokens.weight" not in got:
            sys.exit(f"FAILED: a tied head exported as {sorted(got)[:3]}...: the embedding once, no lm_head")
        # transformers loads it; its logits equal the C++ model's on the same files.
        m = LlamaForCausalLM.from_pretrained(x1).eval()
        with torch.no_grad():
            ref = m(torch.tensor([PROMPT])).logits[0]
        out = os.path.join(tmp, "logits.safetensors")
        cmd = command(a.train_llama, a.torchrun, 1, ["--from-hf", x1, "--steps", "0", "--prompt",
                                                     ",".join(map(str, PROMPT)), "--logits-out", out])
        q = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        if q.returncode != 0:
            sys.exit(f"FAILED: {' '.join(cmd)} exited {q.returncode}\n{q.stdout}\n{q.stderr}")
        err = (load_file(out)["logits"] - ref).abs().max().item()
        if err > 1e-5 * max(1.0, ref.abs().max().item()):
            sys.exit(f"FAILED: the pipelined export's logits under transformers differ from the C++ model's by {err:.2e}")
        print(f"--export-hf at (pp 2, dp_shard 2): {len(got)} tensors, bit for bit its checkpoint's export at one "
              f"rank; from_pretrained's logits within {err:.2e} of the C++ model's")

        # fp16: the loss scale continues from the checkpoint.
        f = os.path.join(tmp, "fp16")
        fp16 = ["--n-layer", "4", "--batch-size", "16", "--mixed-precision", "fp16", "--seed", "1", "--json"]
        piped = ["--pp", "2", "--microbatches", "4"]
        whole = losses(a, 2, fp16 + piped + ["--steps", "6"])
        losses(a, 2, fp16 + piped + ["--steps", "3", "--save-dir", f, "--save-every", "3"])
        continues("fp16 at pp 2, resumed at pp 2", losses(a, 2, fp16 + piped + ["--steps", "6", "--save-dir", f,
                                                                                "--resume"]), whole, 3, 6, rtol=0)
        continues("fp16 saved at pp 2, resumed at one rank",
                  losses(a, 1, fp16 + ["--steps", "6", "--save-dir", f, "--resume"]), whole, 3, 6, rtol=3e-3)
        elastic(a, tmp)

        # --async-save with --pp: refused before any step.
        cmd = command(a.train_llama, a.torchrun, 1, base + ["--pp", "2", "--steps", "1", "--save-dir", e,
                                                            "--save-every", "1", "--async-save"])
        q = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        if q.returncode != 2 or "--async-save" not in q.stderr:
            sys.exit(f"FAILED: --async-save with --pp: exit {q.returncode}, expected 2 naming it\n{q.stderr}")
        print("--async-save with --pp: refused (exit 2)")
    print("OK")


if __name__ == "__main__":
    main()
