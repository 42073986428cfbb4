"""Read a libtorch-fsdp sharded checkpoint into a PyTorch state_dict, with only torch and safetensors.

    from read_checkpoint import read_checkpoint
    state = read_checkpoint("ckpts")              # a checkpoint directory, or a root (its latest)
    model.load_state_dict(state)                  # names are LibTorch's, which match PyTorch's

Each rank file is a safetensors file holding row ranges of tensors, named "<key>[first:last]";
manifest.json says, for every tensor, which file holds which rows (and, for a tensor-parallel
part, which part of the width: "inner") (docs/checkpoint-format.md). This reads every chunk into
its place in the whole tensor. It does not verify the checksums
(`fsdp-ckpt verify DIR` does); for one safetensors file per model, use `fsdp-ckpt consolidate`.

    python read_checkpoint.py DIR    # prints each tensor's name, dtype and shape
"""
import json
import os
import sys

import torch
from safetensors import safe_open


def resolve(path):
    """The checkpoint directory `path` names: itself when it holds a manifest, else its latest."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    with open(os.path.join(path, "latest")) as f:
        return os.path.join(path, f.read().strip())


def read_checkpoint(path, prefix="model/"):
    """{name: tensor} of every tensor whose key starts with `prefix` ("model/": parameters and
    buffers; "optim/": optimizer state as "<parameter>/<state>"), the prefix removed."""
    path = resolve(path)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest["format_version"] > 4:
        raise ValueError(f"{path}: format version {manifest['format_version']} is newer than this reader's (4)")
    files = [os.path.join(path, entry["name"]) for entry in manifest["files"]]
    handles = {}
    out = {}
    try:
        for key, t in manifest["tensors"].items():
            if not key.startswith(prefix):
                continue
            dtype = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
                     "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}[t["dtype"]]
            shape = t["shape"]
            whole = torch.empty(shape, dtype=dtype)
            for c in t["chunks"]:
                i = c["file"]
                if i not in handles:
                    handles[i] = safe_open(files[i], framework="pt")
                first, last = c["rows"]
                # Format 4: a chunk may hold part of the width ("inner": [offset, length] per
                # dimension from 1, a tensor-parallel part), named "key[first:last, a:b, ...]".
                inner = c.get("inner")
                box = "".join(f", {o}:{o + n}" for o, n in inner) if inner else ""
                piece = handles[i].get_tensor(f"{key}[{first}:{last}{box}]")
                if len(shape) == 0:  # a scalar: its one row
                    whole = piece.reshape([])
                    continue
                index = [slice(first, last)] + ([slice(o, o + n) for o, n in inner] if inner else [])
                whole[tuple(index)] = piece
            out[key[len(prefix):]] = whole
    finally:
        handles.clear()
    return out


if __name__ == "__main__":
    for name, tensor in read_checkpoint(sys.argv[1]).items():
        print(name, tensor.dtype, list(tensor.shape))
