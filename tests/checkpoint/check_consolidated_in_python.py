"""Python reads a consolidated checkpoint and the sharded one, and both equal the C++ model.

    check_consolidated_in_python.py REFERENCE CHECKPOINT SINGLE SHARDED

REFERENCE: the model's full weights, written by the C++ test with its own safetensors writer.
CHECKPOINT: the sharded checkpoint, read with tools/read_checkpoint.py.
SINGLE: `fsdp-ckpt consolidate` into one model.safetensors; SHARDED: into shards with
model.safetensors.index.json (Hugging Face's layout; total_size must add up) and the optimizer.
Each must equal REFERENCE bit for bit, loaded with safetensors.torch.load_file.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from read_checkpoint import read_checkpoint  # noqa: E402


def same(name, got, want):
    if set(got) != set(want):
        sys.exit(f"FAILED: {name}: tensors {sorted(got)} vs {sorted(want)}")
    for k, w in want.items():
        g = got[k]
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            sys.exit(f"FAILED: {name}: tensor {k}: {g.dtype} {list(g.shape)} differs from {w.dtype} {list(w.shape)}")
    print(f"{name}: {len(want)} tensors equal the C++ model's")


def main():
    reference, checkpoint, single, sharded = sys.argv[1:5]
    want = load_file(reference)
    same("consolidated, one file", load_file(os.path.join(single, "model.safetensors")), want)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    got, total = {}, 0
    for file in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(sharded, file))
        for k, t in part.items():
            if index["weight_map"][k] != file:
                sys.exit(f"FAILED: {k} is in {file} but the index says {index['weight_map'][k]}")
            total += t.numel() * t.element_size()
        got.update(part)
    if total != index["metadata"]["total_size"]:
        sys.exit(f"FAILED: total_size {index['metadata']['total_size']} but the shards hold {total} bytes")
    same(f"consolidated, {len(set(index['weight_map'].values()))} shards with an index", got, want)
    same("sharded checkpoint through read_checkpoint()", read_checkpoint(checkpoint), want)
    optim = {}
    for file in os.listdir(sharded):
        if file.startswith("optimizer") and file.endswith(".safetensors"):
            optim.update(load_file(os.path.join(sharded, file)))
    same("optimizer state, consolidated vs read_checkpoint(prefix='optim/')", optim,
         read_checkpoint(checkpoint, prefix="optim/"))


if __name__ == "__main__":
    main()
