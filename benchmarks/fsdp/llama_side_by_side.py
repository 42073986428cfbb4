#!/usr/bin/env python3
"""One Llama, four ways, side by side in one run at world size 1: this library's wrapped model and
plain LibTorch (build/benchmarks/overhead_bench, alternating in one process), then Hugging Face's
LlamaForCausalLM (SDPA attention) under PyTorch's FSDP2, eager and with torch.compile (each in its
own process). Same shape, vocabulary 256, batch, bf16 compute with fp32 master weights, fused
AdamW on every side.

  python3 benchmarks/fsdp/llama_side_by_side.py --overhead-bench build/benchmarks/overhead_bench \\
      --size llama1b --device cuda --batch-size 4 --rounds 10 --out benchmarks/results/llama_side_by_side.json

Reported per side: the median step (after warm-up), tokens per second, MFU with the FLOPs per token
overhead_bench prints (programs/flops.h: 6 x the parameters less the token embedding, plus
attention's 12 x layers x heads x head_dim x T) against the peak overhead_bench takes (--peak-tflops,
else the device's by name),
and the peak memory of a step: the bytes allocated when it began (the model state between steps)
plus the most it allocated above them (CUDA's allocator for PyTorch; for ours, which share one
process, overhead_bench's model state from shapes plus its step peak above the start, from our
allocator counts; null on the CPU for PyTorch); then our step over each PyTorch side's and over
plain LibTorch's. Exits non-zero if a side fails. --sides picks sides.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import free_port  # noqa: E402  (one free-port finder for the programs' scripts)

# Model shapes, as overhead_bench's kLlamaSizes (benchmarks/fsdp/overhead_bench.cpp).
SIZES = {
    "llama-small": dict(block=64, layers=2, heads=4, kv_heads=2, width=128, ffn=512),
    "llama1b": dict(block=2048, layers=16, heads=16, kv_heads=8, width=2048, ffn=8192),
}


def pytorch_worker(a):
    """One PyTorch side in this process: FSDP2 over a one-rank group, eager or compiled."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    s = SIZES[a.size]
    dev = torch.device(a.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(a.port))
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=s["width"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=s["block"],
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa",
        use_cache=False)  # training: no key-value cache (whose layer index would recompile each layer)
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(config)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:  # each decoder layer a unit, as ours
        if a.side == "compiled":
            layer.compile()
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(256, (a.batch_size, s["block"] + 1), generator=g).to(dev)
    x, y = tok[:, :-1], tok[:, 1:].flatten()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        sync()
        t0 = time.perf_counter()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        return (time.perf_counter() - t0) * 1e3, loss.item()

    for _ in range(3):
        step()
    peak = None
    if dev.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
    times = [step()[0] for _ in range(a.rounds)]
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated()  # the state between steps is in it
    print(json.dumps({"side": "pytorch_fsdp2_" + a.side, "step_ms": statistics.median(times), "peak_bytes": peak,
                      "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
                      "transformers": transformers.__version__,
                      "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}))
    dist.destroy_process_group()


def run_json(cmd, timeout, what):
    """The command's stdout, or exit naming it (ours: nothing to compare without it)."""
    out, error = try_run(cmd, timeout, what)
    if error:
        sys.exit(error)
    return out


def try_run(cmd, timeout, what):
    """(stdout, None), or (None, what failed) for a side that failed or ran out of time."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"FAILED: {what} did not finish within {timeout} s\n$ {' '.join(cmd)}"
    if r.returncode != 0:
        return None, f"FAILED: {what} exited {r.returncode}\n$ {' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout, None


class HelpFormat(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    ap.add_argument("--overhead-bench", default="build/benchmarks/overhead_bench")
    ap.add_argument("--size", choices=sorted(SIZES), default="llama-small")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="0: the device's by name")
    ap.add_argument("--sides", default="ours,eager,compiled", help="ours (with plain LibTorch), eager, compiled")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per side")
    ap.add_argument("--out", help="the rows as JSON")
    ap.add_argument("--worker", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.side = a.worker
        pytorch_worker(a)
        return
    sides = a.sides.split(",")
    rows, ours = [], None
    if "ours" in sides:
        cmd = [a.overhead_bench, "--sizes", a.size, "--device", a.device, "--mixed-precision", "bf16",
               "--batch-size", str(a.batch_size), "--rounds", str(max(a.rounds, 3)), "--json"]
        if a.peak_tflops > 0:
            cmd += ["--peak-tflops", str(a.peak_tflops)]
        ours = json.loads(run_json(cmd, a.timeout, "overhead_bench"))[0]
        print(f"overhead_bench: plain {ours['plain_ms']:.2f} ms, wrapped {ours['wrapped_ms']:.2f} ms", file=sys.stderr,
              flush=True)
        for side, key in (("libtorch_plain", "plain"), ("libtorch_fsdp_wrapped", "wrapped")):
            rows.append({"side": side, "step_ms": ours[key + "_ms"],
                         "peak_bytes": ours[key + "_state_bytes"] + ours[key + "_step_peak_bytes"]})
    failed = []  # a PyTorch side that fails (no transformers on a machine, say) leaves ours reported
    for side in (s for s in ("eager", "compiled") if s in sides):
        out, error = try_run([sys.executable, os.path.abspath(__file__), "--worker", side, "--size", a.size,
                              "--device", a.device, "--batch-size", str(a.batch_size), "--rounds", str(a.rounds),
                              "--port", str(free_port())], a.timeout, "the PyTorch " + side + " side")
        if error:
            print(error, file=sys.stderr, flush=True)
            failed.append({"side": "pytorch_fsdp2_" + side, "error": error[-2000:]})
            continue
        rows.append(json.loads(out.strip().splitlines()[-1]))
        if ours and rows[-1]["params"] != ours["params"]:
            sys.exit(f"FAILED: LlamaForCausalLM has {rows[-1]['params']} parameters, ours {ours['params']}: "
                     "not the same model")
        print(f"pytorch fsdp2 {side}: {rows[-1]['step_ms']:.2f} ms", file=sys.stderr, flush=True)
    s = SIZES[a.size]
    tokens = a.batch_size * s["block"]
    device_name = next((r["device_name"] for r in rows if "device_name" in r), a.device)
    # The peak and the FLOPs per token are overhead_bench's (programs/flops.h): --peak-tflops, else
    # the device's by name.
    peak = ours["peak_tflops"] if ours else (a.peak_tflops or None)
    flops = ours["flops_per_token"] if ours else None
    for r in rows:
        r["tokens_per_s"] = tokens / (r["step_ms"] / 1e3)
        r["mfu"] = flops * r["tokens_per_s"] / (peak * 1e12) if flops and peak else None
    by = {r["side"]: r for r in rows}
    summary = {"size": a.size, "shape": s, "batch_size": a.batch_size, "device": a.device,
               "device_name": device_name, "peak_tflops": peak or None, "flops_per_token": flops,
               "rounds": a.rounds, "rows": rows, "failed": failed}
    w = by.get("libtorch_fsdp_wrapped")
    for other in ("libtorch_plain", "pytorch_fsdp2_eager", "pytorch_fsdp2_compiled"):
        if w and other in by:
            summary["ours_over_" + other.replace("pytorch_fsdp2_", "fsdp2_")] = w["step_ms"] / by[other]["step_ms"]
    text = json.dumps(summary, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if failed:
        sys.exit(f"FAILED: {', '.join(f['side'] for f in failed)}")


if __name__ == "__main__":
    main()
