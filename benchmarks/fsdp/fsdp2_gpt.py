"""One rank of fsdp_bench's PyTorch side: examples/gpt.h's GPT under PyTorch's own FSDP2.

fsdp_bench starts N of these (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, as for its own
workers), with the same model, global batch, optimizer and steps as its C++ runs, and reads the report
each rank writes to --report. Not meant to be run by hand, though it can be:

  RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 python benchmarks/fsdp/fsdp2_gpt.py \
      --counting-lib build/fsdp/libtorch_fsdp.so --report /tmp/r0.txt

Memory is measured as for the C++ runs: the counting CPU allocator (libtorch_fsdp.so loaded into
this process with ctypes, sharing its LibTorch), peak RSS (VmHWM), and model state at the
optimizer step (the storages of this rank's parameter shards, gradients and AdamW state).
"""
import argparse
import ctypes
import datetime
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.constants import default_pg_timeout


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c.n_head
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, 2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # as examples/gpt.h
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def storage_bytes(tensors):
    """Bytes of the storages behind `tensors` (DTensors by their local shard), each once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def main():
    ap = argparse.ArgumentParser()
    for k, v in [("n-layer", 16), ("n-head", 8), ("n-embd", 512), ("block-size", 64), ("vocab-size", 256),
                 ("batch-size", 8), ("steps", 4), ("seed", 1)]:
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--activation-checkpointing", type=int, default=0,
                    help="torch.utils.checkpoint (non-reentrant) on every K-th block; 0: none")
    ap.add_argument("--wrap", choices=["blocks", "torchtitan"], default="blocks",
                    help="units: the blocks (the root keeps the rest), or torchtitan's: the token embedding, "
                         "each block, and the final norm with the head")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", choices=["adamw", "torch-adamw"], default="adamw",
                    help="adamw: torch.optim.AdamW(fused=True), as fsdp::optim::FusedAdamW; torch-adamw: its default")
    ap.add_argument("--reshard-after-forward", type=int, default=1)
    ap.add_argument("--counting-lib")
    ap.add_argument("--report", required=True)
    ap.add_argument("--timeout", type=float, help="collective timeout, seconds (fsdp_bench --timeout)")
    ap.add_argument("--mixed-precision", choices=["bf16", "fp16"],
                    help="MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32), as libtorch-fsdp's")
    a = ap.parse_args()

    lib = None
    if a.counting_lib:
        lib = ctypes.CDLL(a.counting_lib)
        lib.fsdp_memory_cpu_peak_bytes.restype = ctypes.c_int64
        lib.fsdp_memory_cpu_current_bytes.restype = ctypes.c_int64
        lib.fsdp_memory_enable_cpu_counting()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    timeout = datetime.timedelta(seconds=a.timeout) if a.timeout else None  # None: PyTorch's default
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    base_rss = status_bytes("VmRSS")  # as the C++ ranks: after the process group, before the model
    torch.manual_seed(a.seed)
    model = GPT(a)
    mp = MixedPrecisionPolicy()
    if a.mixed_precision:
        mp = MixedPrecisionPolicy(param_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[a.mixed_precision],
                                  reduce_dtype=torch.float32)
    # Activation checkpointing as torchtitan applies it: blocks k, 2k, ... wrapped in the
    # non-reentrant torch.utils.checkpoint before fully_shard (the wrapper is the FSDP unit).
    k = a.activation_checkpointing
    if k > 0:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i in range(len(model.h)):
            if (i + 1) % k == 0:
                model.h[i] = checkpoint_wrapper(model.h[i])
    rf = bool(a.reshard_after_forward)
    if a.wrap == "torchtitan":  # parallelize_llama's order: embedding, blocks, [norm, output]
        fully_shard(model.wte, mesh=mesh, reshard_after_forward=rf, mp_policy=mp)
    for block in model.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=rf, mp_policy=mp)
    if a.wrap == "torchtitan":
        fully_shard([model.ln_f, model.lm_head], mesh=mesh, reshard_after_forward=rf, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=bool(a.reshard_after_forward), mp_policy=mp)
    scaler = None
    if a.mixed_precision == "fp16":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler()
    psi = sum(p.numel() for p in model.parameters())  # DTensors: full sizes
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1,
                            fused=True if a.optimizer == "adamw" else None)

    T, B = a.block_size, a.batch_size
    rows = B // world
    times, peaks = [], []
    state = 0
    for step in range(a.steps):
        dist.barrier()  # every rank starts the step together, as the C++ ranks do
        opt.zero_grad(set_to_none=True)
        if lib:
            lib.fsdp_memory_reset_cpu_peak()
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(a.seed * 1000003 + step)
        tokens = torch.randint(a.vocab_size, (B, T + 1), generator=g)[rank * rows:(rank + 1) * rows]
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        ms = (time.perf_counter() - t0) * 1e3
        params = list(model.parameters())
        state = storage_bytes(params) + storage_bytes(p.grad for p in params) + storage_bytes(
            t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
        if step > 0:  # the first step allocates the optimizer state and warms up
            times.append(ms)
            peaks.append(lib.fsdp_memory_cpu_peak_bytes() if lib else -1)
    report = {
        "params": psi, "step_ms": sum(times) / len(times), "peak_bytes": max(peaks),
        "peak_rss_bytes": status_bytes("VmHWM"), "base_rss_bytes": base_rss, "state_bytes_at_step": state,
        "loss": loss.item(), "activation_checkpointing": a.activation_checkpointing,
        "collective_timeout_s": (timeout or default_pg_timeout).total_seconds(),
    }
    with open(a.report, "w") as f:  # fsdp_bench's report format: one "name value" line each
        for k, v in report.items():
            f.write(f"{k} {v!r}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
