"""PyTorch's side of benchmarks/pp/pp_side_by_side.py: the same Llama under torch.distributed.pipelining, with
the same schedule, stage split and microbatches as train_llama --pp.

Run under torchrun (one process per rank, Gloo on CPU):

  torchrun --standalone --nproc-per-node 2 benchmarks/pp/llama_pipelining.py --schedule 1f1b --microbatches 4 --json

The model is transformers' LlamaForCausalLM with train_llama's shape flags (random weights: this measures
time, not values), cut as torchtitan cuts it: each rank keeps its stage's decoder layers (the first stage
the embedding too, the last the final norm and the head) and drops the rest. The split is train_llama's
(fsdp::pp::StageSplit::uniform): the embedding and the head weigh as layers, the n_layer + 2 of them cut
into stages of equal size, the earlier stages the lighter where they cannot all be equal. AdamW. Prints
one JSON row per step (rank 0): the pipeline's step (schedule.step, the largest over ranks; the optimizer
step apart, as train_llama's step_ms).
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    P, rank = dist.get_world_size(), dist.get_rank()
    M = a.microbatches or P
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.n_embd, intermediate_size=4 * a.n_embd,
                      num_hidden_layers=a.n_layer, num_attention_heads=a.n_head, num_key_value_heads=a.n_head,
                      max_position_embeddings=a.block_size, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg)
    begin, end = split(a.n_layer, P)[rank]
    layers = [i - 1 for i in range(begin, end) if 1 <= i <= a.n_layer]  # item 0 the embedding, n + 1 the head
    stage_module = Stage(model, layers, rank == 0, rank == P - 1)
    del model
    stage = PipelineStage(stage_module, rank, P, torch.device("cpu"))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[a.schedule]
    schedule = kind(stage, n_microbatches=M, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(a.seed)
    total = 0.0
    for step in range(a.steps):
        ids = torch.randint(a.vocab, (a.batch_size, a.block_size + 1), generator=g)
        t0 = time.perf_counter()
        losses = []
        if rank == 0:
            schedule.step(ids[:, :-1].contiguous())
        elif rank == P - 1:
            schedule.step(target=ids[:, 1:].contiguous(), losses=losses)
        else:
            schedule.step()
        ms = torch.tensor([(time.perf_counter() - t0) * 1000], dtype=torch.double)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        loss = torch.tensor([sum(l.item() for l in losses) / M if losses else 0.0], dtype=torch.double)
        dist.all_reduce(loss)
        if step > 0:
            total += ms.item()
        if rank == 0 and a.json:
            print(json.dumps({"step": step, "loss": loss.item(), "step_ms": ms.item(), "pp": P,
                              "microbatches": M, "layers": layers}), flush=True)
    if rank == 0 and a.json:
        print(json.dumps({"summary": True, "mean_step_ms": total / max(1, a.steps - 1), "pp": P,
                          "schedule": a.schedule, "microbatches": M}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
