"""PyTorch's side of benchmarks/pp/pp_side_by_side.py: the same Llama under torch.distributed.pipelining, with
the same schedule, stage split, microbatches and mesh as train_llama --pp.

Run under torchrun (one process per rank, Gloo on CPU):

  torchrun --standalone --nproc-per-node 2 benchmarks/pp/llama_pipelining.py --schedule 1f1b --microbatches 4 --json
  torchrun --standalone --nproc-per-node 8 benchmarks/pp/llama_pipelining.py --pp 2 --tp 2 --schedule 1f1b \\
      --microbatches 4 --batch-size 16 --json

The model is transformers' LlamaForCausalLM with train_llama's shape flags (random weights: this measures
time and memory, not values), cut as torchtitan cuts it: each rank keeps its stages' decoder layers (the
first stage the embedding too, the last the final norm and the head) and drops the rest. The split is
train_llama's (fsdp::pp::StageSplit::uniform, ported in split()): every stage holds at least one decoder
layer, the embedding and the head weigh as layers on the first and last stage, the heaviest stage as light
as it can be, the earlier stages the lighter; with several stages per rank the layout is looped (rank r
holds stages r, r + pp, ...), as train_llama's. Schedules: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, and
ScheduleInterleavedZeroBubble with one stage per rank (ZB1P, the zero-bubble schedule train_llama's
zero-bubble is: its backward split into input and weight passes).

On a (pp, dp, tp) mesh (world = pp x dp x tp, the mesh's dimensions in that order, as train_llama's), as
torchtitan's parallelize_llama: tensor parallelism inside each stage (q, k, v, gate, up ColwiseParallel; o,
down RowwiseParallel; the embedding RowwiseParallel over the vocabulary; the head ColwiseParallel with its
output left split over the vocabulary and the loss under loss_parallel), then FSDP2's fully_shard over the
data-parallel dimension, each decoder layer and the stage, with reshard_after_forward=False (weights
gathered once per step, not per microbatch); at dp 1 the stages are plain modules, unless --fsdp-one-rank
(FSDP2 over the stage's one rank, as train_llama wraps every stage). Each data-parallel rank's schedule
takes its rows of the global batch. AdamW.

Prints one JSON row per step (rank 0): the pipeline's step (schedule.step, the largest over ranks; the
optimizer step apart, as train_llama's step_ms). With --counting-lib build/fsdp/libtorch_fsdp.so, the
library's counting CPU allocator, loaded with ctypes and enabled before the model is built (as
benchmarks/fsdp/fsdp2_gpt.py measures FSDP2), counts every allocation of every thread as in train_llama:
each row adds peak_bytes, the most bytes live at once from the step's zero_grad to the end of its
optimizer step, as train_llama's peak_bytes, the largest over ranks.
"""
import argparse
import contextlib
import ctypes
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM


def split(n_layer, stages, first=1.0, last=1.0):
    """Each stage's decoder layers (first, end): train_llama's split (fsdp::pp::StageSplit::uniform, its
    pp/stage_split.cpp ported): every stage holds at least one layer, a layer weighs 1 and the embedding
    and the head `first` and `last` on the first and last stage; the heaviest stage as light as it can
    be, and within that each stage from the first takes as few layers as it may."""
    L = n_layer
    if L < stages:
        sys.exit(f"{L} layers cannot fill {stages} stages (each holds at least one layer)")

    def cost(s, b, e):
        return (e - b) + (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(stages + 1)]
    best[stages][L] = 0.0
    for s in range(stages - 1, -1, -1):
        for b in range(s, L - (stages - s) + 1):
            for e in range(b + 1, L - (stages - s - 1) + 1):
                best[s][b] = min(best[s][b], max(cost(s, b, e), best[s + 1][e]))
    top = best[0][0]
    slack = 1e-9 * max(1.0, top)
    out, b = [], 0
    for s in range(stages):
        e = b + 1
        while (e < L) if s == stages - 1 else not (cost(s, b, e) <= top + slack and best[s + 1][e] <= top + slack):
            e += 1
        out.append((b, e))
        b = e
    return out


class Stage(nn.Module):
    """A run of the Llama's decoder layers (the embedding before them on the first stage, the norm and
    head after them on the last), with the rotary tables the whole model's forward would pass them."""

    def __init__(self, model, layers, first, last):
        super().__init__()
        self.embed = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        pe = self.rotary(h, pos)
        for layer in self.layers:
            h = layer(h, position_ids=pos, position_embeddings=pe)
            h = h[0] if isinstance(h, tuple) else h
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def parallelize(stage, mesh, tp, dp, fsdp_one_rank):
    """torchtitan's order: tensor parallelism over mesh["tp"], then FSDP2 over mesh["dp"] (at dp 1 only
    with fsdp_one_rank, as train_llama wraps every stage)."""
    if tp > 1:
        for layer in stage.layers:
            parallelize_module(layer, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            })
        plan = {}
        if stage.embed is not None:
            plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if stage.head is not None:
            plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        if plan:
            parallelize_module(stage, mesh["tp"], plan)
    if dp > 1 or fsdp_one_rank:
        for layer in stage.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def run_schedule(schedule, stages, last, ids, losses):
    """One step: the first stage's rank gives the inputs, the last stage's the targets."""
    if stages[0].is_first:
        schedule.step(ids[:, :-1].contiguous(), target=ids[:, 1:].contiguous(), losses=losses)
    elif last:
        schedule.step(target=ids[:, 1:].contiguous(), losses=losses)
    else:
        schedule.step()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zero-bubble"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=0)
    ap.add_argument("--stages-per-rank", type=int, default=0, help="default: 2 for interleaved, else 1")
    ap.add_argument("--pp", type=int, default=0, help="default: the world")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fsdp-one-rank", action="store_true",
                    help="FSDP2 in the stages at dp 1 too, over the stage's one rank, as train_llama wraps every stage")
    ap.add_argument("--counting-lib", default="",
                    help="libtorch_fsdp.so: count the CPU allocator's bytes with it (each row's peak_bytes)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    P = a.pp or world // a.tp
    dp = world // (P * a.tp)
    if P * dp * a.tp != world:
        sys.exit(f"--pp {P} x --tp {a.tp} does not divide the world of {world}")
    V = a.stages_per_rank or (2 if a.schedule == "interleaved" else 1)
    M = a.microbatches or P
    if V > 1 and a.schedule in ("gpipe", "1f1b"):
        sys.exit(f"--stages-per-rank {V}: {a.schedule} runs one stage per rank (interleaved runs several)")
    if a.batch_size % dp or (a.batch_size // dp) % M:
        sys.exit(f"--batch-size {a.batch_size} does not split over {dp} data-parallel ranks into {M} microbatches")
    mesh = init_device_mesh("cpu", (P, dp, a.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    lib = None
    if a.counting_lib:
        lib = ctypes.CDLL(a.counting_lib)
        lib.fsdp_memory_cpu_peak_bytes.restype = ctypes.c_int64
        lib.fsdp_memory_enable_cpu_counting()
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.n_embd, intermediate_size=4 * a.n_embd,
                      num_hidden_layers=a.n_layer, num_attention_heads=a.n_head, num_key_value_heads=a.n_head,
                      max_position_embeddings=a.block_size, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg)
    n = P * V
    cuts = split(a.n_layer, n)
    stages, modules = [], []
    for index in range(pp_rank, n, P):  # looped: rank r holds stages r, r + P, ...
        begin, end = cuts[index]
        layers = list(range(begin, end))
        module = Stage(model, layers, index == 0, index == n - 1)
        parallelize(module, mesh, a.tp, dp, a.fsdp_one_rank)
        modules.append(module)
        stages.append(PipelineStage(module, index, n, torch.device("cpu"), group=mesh["pp"].get_group()))
    del model
    last = any(s.is_last for s in stages)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    if a.schedule in ("gpipe", "1f1b"):
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[a.schedule](stages[0], n_microbatches=M,
                                                                              loss_fn=loss_fn)
    else:
        kind = {"interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble}[a.schedule]
        schedule = kind(stages, n_microbatches=M, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)  # train_llama's is FusedAdamW
    g = torch.Generator().manual_seed(a.seed)
    rows = a.batch_size // dp
    total, peaks = 0.0, []
    for step in range(a.steps):
        ids = torch.randint(a.vocab, (a.batch_size, a.block_size + 1), generator=g)[dp_rank * rows:(dp_rank + 1) * rows]
        opt.zero_grad()
        if lib:
            lib.fsdp_memory_reset_cpu_peak()
        t0 = time.perf_counter()
        losses = []
        # The head's output split over the vocabulary: its loss and that loss's backward (inside the
        # schedule) under loss_parallel, as torchtitan's train context.
        with loss_parallel() if a.tp > 1 else contextlib.nullcontext():
            run_schedule(schedule, stages, last, ids, losses)
        ms = torch.tensor([(time.perf_counter() - t0) * 1000], dtype=torch.double)
        opt.step()
        peak = torch.tensor([lib.fsdp_memory_cpu_peak_bytes() if lib else 0], dtype=torch.long)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        loss = torch.tensor([sum(local(l).item() for l in losses) / M if losses else 0.0], dtype=torch.double)
        dist.all_reduce(loss)
        if step > 0:
            total += ms.item()
            peaks.append(peak.item())
        if rank == 0 and a.json:
            print(json.dumps({"step": step, "loss": loss.item() / (dp * a.tp), "step_ms": ms.item(),
                              "peak_bytes": peak.item() if lib else None, "pp": P, "dp": dp, "tp": a.tp,
                              "microbatches": M, "stages_per_rank": V}), flush=True)
    if rank == 0 and a.json:
        print(json.dumps({"summary": True, "mean_step_ms": total / max(1, a.steps - 1), "pp": P, "dp": dp,
                          "tp": a.tp, "schedule": a.schedule, "microbatches": M, "stages_per_rank": V,
                          "peak_bytes": max(peaks) if lib and peaks else None}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # As benchmarks/tp/llama_dtensor.py: Gloo's threads torn down at the interpreter's exit sometimes end
    # a rank in "terminate called without an active exception"; the run is complete by here.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
