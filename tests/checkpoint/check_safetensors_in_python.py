"""Python's safetensors opens a file the C++ writer wrote and writes it back.

    check_safetensors_in_python.py IN OUT

Loads IN with safetensors.torch.load_file (the metadata must say "format": "pt"), prints each
tensor's name, dtype and shape, and saves the same tensors with safetensors.torch.save_file to OUT,
which the C++ test then reads with its own reader and compares to what it wrote, bit for bit.
"""
import sys

from safetensors import safe_open
from safetensors.torch import load_file, save_file


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with safe_open(src, framework="pt") as f:
        meta = f.metadata()
    if meta.get("format") != "pt":
        sys.exit(f"{src}: __metadata__ {meta!r} has no \"format\": \"pt\"")
    tensors = load_file(src)
    for name, t in sorted(tensors.items()):
        print(name, t.dtype, list(t.shape))
    save_file(tensors, dst, metadata=meta)


if __name__ == "__main__":
    main()
