"""PyTorch's side of benchmarks/tp/llama_bench.py: the same Llama under DTensor tensor parallelism and
FSDP2 on the same 2-D mesh, as torchtitan's parallelize_llama does it.

Run under torchrun (one process per rank, Gloo on CPU):

  torchrun --standalone --nproc-per-node 4 benchmarks/tp/llama_dtensor.py --tp 2 --steps 10 --json

The model is transformers' LlamaForCausalLM with train_llama's shape flags (random weights: this
measures time and memory, not values). Tensor parallelism: q, k, v, gate, up ColwiseParallel; o,
down RowwiseParallel; the embedding RowwiseParallel (vocabulary split); the head ColwiseParallel
with its output left split over the vocabulary and the loss under loss_parallel (no full logits),
as torchtitan. Then fully_shard over the data-parallel dimension: each decoder layer, then the
root. AdamW. Prints one JSON row per step (rank 0): step time, and each rank's model state at the
optimizer step (its local parameter, gradient and AdamW bytes), the largest over ranks.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from transformers import LlamaConfig, LlamaForCausalLM


def local_bytes(t):
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-kv-head", type=int, default=0)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // a.tp
    mesh = init_device_mesh("cpu", (dp, a.tp), mesh_dim_names=("dp", "tp"))
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.n_embd, intermediate_size=a.intermediate or 4 * a.n_embd,
                      num_hidden_layers=a.n_layer, num_attention_heads=a.n_head,
                      num_key_value_heads=a.n_kv_head or a.n_head, max_position_embeddings=a.block_size,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg)
    psi = sum(p.numel() for p in model.parameters())
    if a.tp > 1:
        tp = mesh["tp"]
        for layer in model.model.layers:
            parallelize_module(layer, tp, {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            })
        parallelize_module(model, tp, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
    if dp > 1:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(a.seed)
    rows = a.batch_size // dp
    me = mesh["dp"].get_local_rank()
    total = 0.0
    for step in range(a.steps):
        ids = torch.randint(a.vocab, (a.batch_size, a.block_size + 1), generator=g)[me * rows:(me + 1) * rows]
        t0 = time.perf_counter()
        logits = model(input_ids=ids[:, :-1]).logits
        if a.tp > 1:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        opt.step()
        state = sum(local_bytes(p) + local_bytes(p.grad) for p in model.parameters())
        state += sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        opt.zero_grad()
        ms = (time.perf_counter() - t0) * 1000
        if step > 0:
            total += ms
        st = torch.tensor([state], dtype=torch.long)
        dist.all_reduce(st, op=dist.ReduceOp.MAX)
        lv = loss.detach()
        if isinstance(lv, DTensor):
            lv = lv.full_tensor()
        if rank == 0 and a.json:
            print(json.dumps({"step": step, "loss": lv.item(), "step_ms": ms, "state_bytes": st.item(),
                              "tp": a.tp, "dp": dp, "params": psi}), flush=True)
    if rank == 0 and a.json:
        print(json.dumps({"summary": True, "mean_step_ms": total / max(1, a.steps - 1), "tp": a.tp, "dp": dp,
                          "params": psi}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Interpreter shutdown after the group is destroyed sometimes ends rank 0 in "terminate called
    # without an active exception" (torch 2.11, Gloo's threads torn down at exit; seen once in this
    # script): the run is complete by here, so leave without the interpreter's teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
