"""The PyTorch side of ckpt_bench: torch.distributed.checkpoint (DCP) saving and loading the
FSDP2-sharded GPT of fsdp2_gpt.py (examples/gpt.h) and its AdamW state, CPU only, over Gloo.

  torchrun --standalone --nproc-per-node N python benchmarks/checkpoint/dcp_bench.py save --dir D \
      [--n-layer 8 --n-embd 512 --n-head 8] [--reps 3] [--async-reps 3]
  torchrun --standalone --nproc-per-node M python benchmarks/checkpoint/dcp_bench.py load --dir D [--reps 3]

Every run builds the model with a fixed seed, wraps each block and then the root with fully_shard,
takes one AdamW step (so the moments exist) and uses get_state_dict(model, optimizer) as the state
{"model": ..., "optim": ...}. Rank 0 prints exactly one JSON line on stdout (anything else goes to
stderr) with "mode" and "world_size" and:

save: sync dcp.save into D/dcp-<i> per rep, timed barrier to barrier (max over ranks); the last rep
  is kept as D/dcp, and D/dcp_ref.pt holds the full model state dict at that point (for load's check).
  save_s, save_s_median; bytes_on_disk (files of D/dcp); state_bytes (sum over ranks of the local
  shard bytes of every model and optimizer tensor, replicated ones such as "step" once per rank).
  Then dcp.async_save (thread-based; its background collectives on a separate Gloo group) into
  D/dcp-async-<i>, training steps running while it writes: async_kind; async_stall_s (time for
  async_save() to return, max over ranks), async_stall_s_median; async_total_s_median (until the
  write completed, max over ranks); step_s_plain (mean step time, no save in flight) and
  step_s_during_async (mean over the steps run while a save was in flight; null if none ran);
  rss_after_each_async (rank 0's VmRSS after each async save); host_peak_rss_bytes (max VmHWM).
load: drop the page cache of D/dcp's files on every rank, then dcp.load + set_state_dict into a
  fresh model at this world size (the reshard case when it differs from the saving one), timed
  barrier to barrier: load_s, load_s_median; bytes_read (sum over ranks of /proc/self/io rchar
  during the last rep's load), bytes_needed (state_bytes at this world size), read_over_needed;
  saved_world_size (from the .distcp file names); verified (the loaded full model state dict
  torch.equal to D/dcp_ref.pt).
"""
import argparse
import glob
import json
import os
import re
import shutil
import statistics
import sys
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fsdp"))
from fsdp2_gpt import GPT, status_bytes  # noqa: E402


def local_bytes(obj):
    """Bytes of the tensors in a state dict, DTensors by their local shard."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(local_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(local_bytes(v) for v in obj)
    return 0


def reduce(x, op=dist.ReduceOp.SUM):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def io_rchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def dir_files(path):
    return sorted(os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns)


def build(a, mesh):
    torch.manual_seed(a.seed)
    model = GPT(a)
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def train_step(model, opt, a, step):
    g = torch.Generator().manual_seed(a.seed * 1000003 + step * 1009 + dist.get_rank())
    tokens = torch.randint(a.vocab_size, (a.batch_size, a.block_size + 1), generator=g)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()


def make_state(model, opt):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def timed(fn):
    """Runs fn between two barriers; seconds, max over ranks."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return reduce(time.perf_counter() - t0, dist.ReduceOp.MAX)


def on_rank0(fn):
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def save_mode(a, model, opt, out):
    D, rank = a.dir, dist.get_rank()
    ckpt = os.path.join(D, "dcp")
    state = make_state(model, opt)
    out["state_bytes"] = int(reduce(local_bytes(state)))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    on_rank0(lambda: (os.makedirs(D, exist_ok=True), torch.save(full, os.path.join(D, "dcp_ref.pt"))))
    del full
    times, prev = [], None
    for i in range(a.reps):
        path = os.path.join(D, f"dcp-{i}")
        on_rank0(lambda: shutil.rmtree(path, ignore_errors=True))
        times.append(timed(lambda: dcp.save(state, checkpoint_id=path)))
        if rank == 0:
            print(f"[dcp_bench] save rep {i}: {times[-1]:.3f}s", file=sys.stderr)
        if prev:
            on_rank0(lambda: shutil.rmtree(prev))
        prev = path
    on_rank0(lambda: (shutil.rmtree(ckpt, ignore_errors=True), os.rename(prev, ckpt)))
    out.update(save_s=times, save_s_median=statistics.median(times),
               bytes_on_disk=sum(os.path.getsize(f) for f in dir_files(ckpt)))
    del state

    # Async: a thread-based writer whose collectives run on their own Gloo group, so they never
    # interleave with the training step's FSDP collectives on the default group.
    ckpt_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.timeout))
    kind = dcp.state_dict_saver.AsyncCheckpointerType.THREAD
    step = 1
    train_step(model, opt, a, step)  # warm-up
    plain = []
    for _ in range(5):
        step += 1
        t0 = time.perf_counter()
        train_step(model, opt, a, step)
        plain.append(time.perf_counter() - t0)
    stalls, totals, during, rss = [], [], [], []
    for i in range(a.async_reps):
        path = os.path.join(D, f"dcp-async-{i}")
        on_rank0(lambda: shutil.rmtree(path, ignore_errors=True))
        state = make_state(model, opt)
        done_at = []
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path, process_group=ckpt_pg, async_checkpointer_type=kind)
        stall = time.perf_counter() - t0
        fut.add_done_callback(lambda f: done_at.append(time.perf_counter()))
        del state
        while reduce(0.0 if fut.done() else 1.0, dist.ReduceOp.MAX) > 0:  # same step count on every rank
            step += 1
            ts = time.perf_counter()
            train_step(model, opt, a, step)
            during.append(time.perf_counter() - ts)
        fut.result()
        stalls.append(reduce(stall, dist.ReduceOp.MAX))
        totals.append(reduce(done_at[0] - t0, dist.ReduceOp.MAX))
        rss.append(status_bytes("VmRSS"))
        if rank == 0:
            print(f"[dcp_bench] async rep {i}: stall {stalls[-1]:.3f}s total {totals[-1]:.3f}s", file=sys.stderr)
        on_rank0(lambda: shutil.rmtree(path))
    step_plain = reduce(statistics.mean(plain), dist.ReduceOp.MAX)
    n_during = reduce(len(during), dist.ReduceOp.MIN)  # equal on every rank by construction
    step_during = reduce(statistics.mean(during), dist.ReduceOp.MAX) if n_during else None
    out.update(async_kind=kind.value, async_stall_s=stalls, async_stall_s_median=statistics.median(stalls),
               async_total_s_median=statistics.median(totals), step_s_plain=step_plain,
               step_s_during_async=step_during, steps_during_async=len(during), rss_after_each_async=rss,
               host_peak_rss_bytes=int(reduce(status_bytes("VmHWM"), dist.ReduceOp.MAX)))


def load_mode(a, model, opt, out):
    ckpt, rank = os.path.join(a.dir, "dcp"), dist.get_rank()
    ranks = [int(m.group(1)) for f in os.listdir(ckpt) if (m := re.match(r"__(\d+)_\d+\.distcp$", f))]
    if ranks:
        out["saved_world_size"] = max(ranks) + 1
    times, read = [], 0
    for i in range(a.reps):
        for f in dir_files(ckpt):  # every rank: its own reads must not hit a warm page cache
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        state = make_state(model, opt)
        out["bytes_needed"] = int(reduce(local_bytes(state)))
        r0 = io_rchar()

        def load():
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        times.append(timed(load))
        read = int(reduce(io_rchar() - r0))
        if rank == 0:
            print(f"[dcp_bench] load rep {i}: {times[-1]:.3f}s, rchar {read}", file=sys.stderr)
    out.update(load_s=times, load_s_median=statistics.median(times), bytes_read=read,
               read_over_needed=read / out["bytes_needed"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        ref = torch.load(os.path.join(a.dir, "dcp_ref.pt"))
        out["verified"] = ref.keys() == full.keys() and all(torch.equal(ref[k], full[k]) for k in ref)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["save", "load"])
    ap.add_argument("--dir", required=True)
    for k, v in [("n-layer", 8), ("n-embd", 512), ("n-head", 8), ("block-size", 64), ("vocab-size", 256),
                 ("batch-size", 2), ("seed", 1), ("reps", 3), ("async-reps", 3), ("timeout", 300)]:
        ap.add_argument("--" + k, type=int, default=v)
    a = ap.parse_args()
    json_out = os.fdopen(os.dup(1), "w")  # the JSON line only; everything else (C++ too) to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    world = dist.get_world_size()
    model, opt = build(a, init_device_mesh("cpu", (world,)))
    # One step so the AdamW state exists; load mode's step uses other data, so the loaded
    # weights differ from the ones it starts with and "verified" means something.
    train_step(model, opt, a, 0 if a.mode == "save" else 10**6)
    out = {"mode": a.mode, "world_size": world}
    (save_mode if a.mode == "save" else load_mode)(a, model, opt, out)
    dist.barrier()
    if dist.get_rank() == 0:
        json_out.write(json.dumps(out) + "\n")
        json_out.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
