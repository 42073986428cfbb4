#!/usr/bin/env python3
"""The examples' FLOPs and MFU (issue 43's CPU check): the JSON rows of train_llama and train_gpt
carry `flops_per_token`, `tokens_per_s` and `mfu`, and they are the honest count from the model's
shapes (programs/flops.h; docs/benchmarks.md, "Model FLOPs"):
  flops_per_token = 6 x (parameters - embeddings that are only looked up) + 12 x L x H x head_dim x T
  tokens_per_s    = global batch x T / step time
  mfu             = flops_per_token x tokens_per_s / (peak x 1e12 x world size)
The parameters are counted here from the shapes, independently of the programs: the Llama's
(Hugging Face's names: q/k/v/o, gate/up/down, two norms per layer, the final norm, an untied or
tied head) and the GPT's (nanoGPT's, biases on, an untied head). Without --peak-tflops on the CPU
the MFU is null (no peak is known for a CPU).

  python tests/examples/check_flops.py --train-llama build/examples/train_llama --train-gpt build/examples/train_gpt
"""
import argparse
import json
import os
import subprocess
import sys

failures = []


def expect(name, ok, detail=""):
    print(("ok    " if ok else "FAIL  ") + name + ("" if ok else "\n      " + detail))
    if not ok:
        failures.append(name)


def rows(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {p.returncode}\n{p.stderr[-3000:]}")
    return [r for r in map(json.loads, p.stdout.splitlines()) if "step" in r and "loss" in r]


def close(a, b, rel):
    return a is not None and b is not None and abs(a - b) <= rel * max(abs(b), 1e-300)


def check_rows(name, got, params, lookups, L, H, hd, T, batch, peak, world=1):
    want_flops = 6 * (params - lookups) + 12 * L * H * hd * T
    for r in got:
        tps = batch * T / (r["step_ms"] / 1000.0)
        expect(f"{name} step {r['step']}: params {r['params']} from the shapes", r["params"] == params,
               f"want {params}")
        expect(f"{name} step {r['step']}: flops_per_token {r['flops_per_token']} = 6(Ψ - lookups) + 12 L H hd T",
               r["flops_per_token"] == want_flops, f"want {want_flops}")
        expect(f"{name} step {r['step']}: tokens_per_s = batch x T / step time",
               close(r["tokens_per_s"], tps, 2e-3), f"{r['tokens_per_s']} vs {tps}")
        if peak is None:
            expect(f"{name} step {r['step']}: no peak on the CPU, MFU null", r["mfu"] is None, f"{r['mfu']}")
        else:
            want = want_flops * r["tokens_per_s"] / (peak * 1e12 * world)
            expect(f"{name} step {r['step']}: mfu = flops x tokens/s / (peak x world)", close(r["mfu"], want, 1e-5),
                   f"{r['mfu']} vs {want}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--train-gpt", required=True)
    a = ap.parse_args()

    V, C, L, H, I, T, B = 256, 128, 2, 4, 512, 96, 8
    for tied in (False, True):
        cmd = [a.train_llama, "--n-layer", str(L), "--n-head", str(H), "--n-embd", str(C), "--intermediate", str(I),
               "--block-size", str(T), "--batch-size", str(B), "--steps", "3", "--seed", "1", "--json",
               "--peak-tflops", "1"] + (["--tied"] if tied else [])
        got = rows(cmd)
        expect(f"train_llama{' --tied' if tied else ''}: 3 rows", len(got) == 3, f"{len(got)}")
        per_layer = 4 * C * C + 3 * C * I + 2 * C  # q, k, v, o (kv heads = heads); gate, up, down; two norms
        params = V * C + L * per_layer + C + (0 if tied else V * C)
        check_rows("train_llama" + (" --tied" if tied else ""), got, params, 0 if tied else V * C, L, H, C // H, T,
                   B, 1.0)

    C, L, H, T = 32, 2, 2, 16
    got = rows([a.train_gpt, "--n-layer", str(L), "--n-head", str(H), "--n-embd", str(C), "--block-size", str(T),
                "--batch-size", str(B), "--steps", "2", "--seed", "1", "--json"])
    per_block = (2 * C) + (C * 3 * C + 3 * C) + (C * C + C) + (2 * C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    params = V * C + T * C + L * per_block + 2 * C + V * C
    check_rows("train_gpt", got, params, (V + T) * C, L, H, C // H, T, B, None)
    if failures:
        sys.exit(f"FAILED: {len(failures)} check(s): {', '.join(failures)}")
    print("OK")


if __name__ == "__main__":
    main()
