#!/usr/bin/env python3
"""What a load of a tensor-parallel checkpoint on another mesh reads against what it needs.

    python3 benchmarks/tp/llama_reshard.py --train-llama build/examples/train_llama \\
        --torchrun $VENV/bin/torchrun --out benchmarks/results/llama_reshard

train_llama at llama_bench.py's shape (4 layers, width 256, 8 heads, 4 key-value heads, MLP 1024)
saves after 2 steps on 4 ranks at each mesh (--tp 1, 2, 4), then resumes from it at every other
mesh of 4 ranks, on 2 ranks (--tp 1 and 2) and on one rank, for one step; each resume's JSON row gives the bytes the load read and
needed, summed over its ranks. A part split along dimension 0 (q, k, v, gate, up, the embedding,
the head) is read at its need rounded to checksum blocks; one split along dimension 1 (o, down)
is read as whole saved rows: x(saved TP / loaded TP) for those tensors when the load's TP is
larger, its need when smaller.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import command, run  # noqa: E402

SHAPE = ["--n-layer", "4", "--n-embd", "256", "--n-head", "8", "--n-kv-head", "4", "--intermediate", "1024",
         "--block-size", "128", "--batch-size", "8", "--seed", "1", "--json"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows, lines = [], []
    for saved_tp in (1, 2, 4):
        with tempfile.TemporaryDirectory() as d:
            run(command(a.train_llama, a.torchrun, 4,
                        SHAPE + ["--steps", "2", "--tp", str(saved_tp), "--save-dir", d, "--save-every", "2"]))
            for ranks, tp in ((4, 1), (4, 2), (4, 4), (2, 1), (2, 2), (1, 1)):
                if (ranks, tp) == (4, saved_tp):
                    continue
                out, _ = run(command(a.train_llama, a.torchrun, ranks,
                                     SHAPE + ["--steps", "3", "--tp", str(tp), "--save-dir", d, "--resume"]))
                r = next(x for x in out if "resumed" in x)
                row = {"saved": f"(dp_shard {4 // saved_tp}, tp {saved_tp})", "loaded": r["mesh"],
                       "bytes_needed": r["bytes_needed"], "bytes_read": r["bytes_read"],
                       "ratio": r["bytes_read"] / r["bytes_needed"], "load_seconds": r["load_seconds"]}
                rows.append(row)
                lines.append(f"saved {row['saved']} -> loaded {row['loaded']}: read {row['bytes_read']} B for "
                             f"{row['bytes_needed']} B needed: x{row['ratio']:.4f}")
                print(lines[-1], flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"shape": SHAPE, "rows": rows}, f, indent=1)
    with open(a.out + ".txt", "w") as f:
        f.write("train_llama " + " ".join(SHAPE) + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
