"""Read a libtorch-fsdp sharded checkpoint into a PyTorch state_dict, with only torch and safetensors.

    from read_checkpoint import read_checkpoint
    state = read_checkpoint("ckpts")              # a checkpoint directory, or a root (its latest)
    model.load_state_dict(state)                  # names are LibTorch's, which match PyTorch's

Each rank file is a safetensors file holding row ranges of tensors, named "<key>[first:last]";
manifest.json says, for every tensor, which file holds which rows (docs/checkpoint-format.md).
This reads every tensor's rows in order and concatenates them. It does not verify the checksums
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
    if manifest["format_version"] > 3:
        raise ValueError(f"{path}: format version {manifest['format_version']} is newer than this reader's (3)")
    files = [os.path.join(path, entry["name"]) for entry in manifest["files"]]
    handles = {}
    out = {}
    try:
        for key, t in manifest["tensors"].items():
            if not key.startswith(prefix):
                continue
            pieces = []
            for c in t["chunks"]:
                i = c["file"]
                if i not in handles:
                    handles[i] = safe_open(files[i], framework="pt")
                first, last = c["rows"]
                pieces.append(handles[i].get_tensor(f"{key}[{first}:{last}]"))
            shape = t["shape"]
            if not pieces:  # a tensor with no elements
                dtype = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
                         "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}[t["dtype"]]
                out[key[len(prefix):]] = torch.empty(shape, dtype=dtype)
            elif len(shape) == 0:  # a scalar: its one row
                out[key[len(prefix):]] = pieces[0].reshape([])
            else:
                out[key[len(prefix):]] = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
    finally:
        handles.clear()
    return out


if __name__ == "__main__":
    for name, tensor in read_checkpoint(sys.argv[1]).items():
        print(name, tensor.dtype, list(tensor.shape))
