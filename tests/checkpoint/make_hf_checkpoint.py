"""Writes Hugging Face-style safetensors weights of the tests' BufferedMLP, from Python:

    make_hf_checkpoint.py OUT

OUT/single/model.safetensors (every tensor, named "model.<name>", plus "model.unused", which the
C++ test's name map skips) and OUT/sharded/ (two files and model.safetensors.index.json).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

SHAPES = {"scale": [], "head.weight": [3, 5], "head.bias": [3], "fc1.weight": [13, 7], "fc1.bias": [13],
          "fc2.weight": [5, 13], "fc2.bias": [5], "running": [5]}


def main():
    out = sys.argv[1]
    g = torch.Generator().manual_seed(42)
    tensors = {f"model.{k}": torch.randn(s, generator=g) for k, s in SHAPES.items()}
    tensors["model.count"] = torch.tensor(11, dtype=torch.int64)
    tensors["model.unused"] = torch.zeros(4)
    os.makedirs(os.path.join(out, "single"))
    save_file(tensors, os.path.join(out, "single", "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(os.path.join(out, "sharded"))
    names = sorted(tensors)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(out, "sharded", file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "sharded", "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


if __name__ == "__main__":
    main()
