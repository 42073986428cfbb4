"""PyTorch's side of benchmarks/pp/pp_side_by_side.py: the same Llama under torch.distributed.pipelining, with
the same schedule, stage split, microbatches and mesh as train_llama --pp.

Run under torchrun (one process per rank, Gloo on CPU):

  torchrun --standalone --nproc-per-node 2 benchmarks/pp/llama_pipelining.py --schedule 1f1b --microbatches 4 --json
  torchrun --standalone --nproc-per-node 8 benchmarks/pp/llama_pipelining.py --pp 2 --tp 2 --schedule 1f1b \\
      --microbatches 4 --batch-size 16 --json

The model is transformers' LlamaForCausalLM with train_llama's shape flags (random weights: this measures
time and memory, not values), cut as torchtitan cuts it: each rank keeps its stages' decoder layers (the
first stage the embedding too, the last the final norm and the head) and drops the rest. The split is
train_llama's (fsdp::pp::StageSplit::uniform): the embedding and the head weigh as layers, the n_layer + 2
of them cut into pp x stages-per-rank stages of equal size, the earlier stages the lighter where they cannot
all be equal; with several stages per rank the layout is looped (rank r holds stages r, r + pp, ...), as
train_llama's. Schedules: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, and
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
optimizer step apart, as train_llama's step_ms). With --peak, the whole run under torch.profiler's memory
records (profile_memory: every allocation and free of the CPU allocator, the bytes train_llama's counting
allocator sees): each row adds peak_bytes, the most bytes live at once from the step's zero_grad to the end
of its optimizer step, as train_llama's peak_bytes, the largest over ranks. The profiler slows the steps: time
and peak come from separate runs.
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM


def split(n_layer, stages):
    """Each stage's (first, end) over the items embedding, layers 0..n-1, head (train_llama's uniform split)."""
    items = n_layer + 2
    base, extra = divmod(items, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    out, at = [], 0
    for s in sizes:
        out.append((at, at + s))
        at += s
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


def step_peaks(prof, steps):
    """Each step's most bytes live at once over its window (its record_function span): the CPU allocator's
    count of live bytes at each of the profiler's allocation records (total_allocated: every allocation since
    the profiler began, before the model was built, less those freed)."""
    spans, live = {}, []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            live.append((e.start_time_ns, e.extra_fields.total_allocated))
        elif e.name.startswith("pp_step_"):
            spans[int(e.name[len("pp_step_"):])] = (e.start_time_ns, e.end_time_ns)
    return [max((b for at, b in live if spans[s][0] <= at <= spans[s][1]), default=0) for s in range(steps)]


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
    ap.add_argument("--peak", action="store_true", help="measure each step's allocator peak (slower steps)")
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
    mesh = init_device_mesh("cpu", (P, dp, a.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    prof = None
    if a.peak:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
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
        layers = [i - 1 for i in range(begin, end) if 1 <= i <= a.n_layer]  # item 0 the embedding, n + 1 the head
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
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(a.seed)
    rows = a.batch_size // dp
    total = 0.0
    for step in range(a.steps):
        ids = torch.randint(a.vocab, (a.batch_size, a.block_size + 1), generator=g)[dp_rank * rows:(dp_rank + 1) * rows]
        span = torch.profiler.record_function(f"pp_step_{step}") if prof else None
        if span:
            span.__enter__()
        opt.zero_grad()
        t0 = time.perf_counter()
        losses = []
        # The head's output split over the vocabulary: its loss and that loss's backward (inside the
        # schedule) under loss_parallel, as torchtitan's train context.
        with loss_parallel() if a.tp > 1 else contextlib.nullcontext():
            run_schedule(schedule, stages, last, ids, losses)
        ms = torch.tensor([(time.perf_counter() - t0) * 1000], dtype=torch.double)
        opt.step()
        if span:
            span.__exit__(None, None, None)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        loss = torch.tensor([sum(local(l).item() for l in losses) / M if losses else 0.0], dtype=torch.double)
        dist.all_reduce(loss)
        if step > 0:
            total += ms.item()
        if rank == 0 and a.json and not prof:
            print(json.dumps({"step": step, "loss": loss.item() / (dp * a.tp), "step_ms": ms.item(), "pp": P,
                              "dp": dp, "tp": a.tp, "microbatches": M, "stages_per_rank": V}), flush=True)
    peaks = None
    if prof:
        prof.__exit__(None, None, None)
        peaks = torch.tensor(step_peaks(prof, a.steps), dtype=torch.long)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        if rank == 0 and a.json:
            for step in range(a.steps):
                print(json.dumps({"step": step, "peak_bytes": peaks[step].item(), "pp": P, "dp": dp, "tp": a.tp}),
                      flush=True)
    if rank == 0 and a.json:
        print(json.dumps({"summary": True, "mean_step_ms": total / max(1, a.steps - 1), "pp": P, "dp": dp,
                          "tp": a.tp, "schedule": a.schedule, "microbatches": M, "stages_per_rank": V,
                          "peak_bytes": max(peaks[1:].tolist()) if peaks is not None and a.steps > 1 else None}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # As benchmarks/tp/llama_dtensor.py: Gloo's threads torn down at the interpreter's exit sometimes end
    # a rank in "terminate called without an active exception"; the run is complete by here.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
