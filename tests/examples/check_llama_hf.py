#!/usr/bin/env python3
"""The C++ Llama and Hugging Face's transformers on the same weights (issue 27).

A small random LlamaForCausalLM made and saved here (grouped-query attention, an untied head, a
hidden size every tensor-parallel size divides, a non-default rope_theta) loads through
`train_llama --from-hf` at (tp, dp) = (1, 1), (2, 1), (1, 2), (2, 2), (4, 1), and the prompt's
logits (`--logits-out`, before any step) equal transformers' (1e-5, fp32); with sequence
parallelism and with a tied head too. After
3 training steps at (2, 2), `--export-hf` output loads with from_pretrained and its logits equal
the C++ model's on the same files. A fine-tune from the files as a pipeline (`--pp 2`, each stage
reading its own tensors; at (pp 2, dp_shard 2) with the tied head, whose embedding both stages
read) gives one rank's losses (1e-5), and a prompt's logits through the stages (pp 2; pp 2 x tp 2
tied) equal transformers'. Configurations the C++ model does not implement are refused by
name (exit 2).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import command  # noqa: E402  (train_llama alone, or under torchrun --standalone --no-python)

PROMPT = [1, 5, 9, 200, 3, 77, 12, 255, 0, 31]


def launch(a, ranks, args, expect_ok=True):
    cmd = command(a.train_llama, a.torchrun, ranks, args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if expect_ok and p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def reference_logits(path):
    m = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return m(torch.tensor([PROMPT])).logits[0]


def compare(got_file, want, what):
    got = load_file(got_file)["logits"]
    if got.shape != want.shape:
        sys.exit(f"FAILED: {what}: logits of shape {tuple(got.shape)}, transformers' {tuple(want.shape)}")
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    if err > 1e-5 * scale:
        sys.exit(f"FAILED: {what}: logits differ from transformers' by {err:.3e}")
    return err


def make(path, max_shard_size=None, **overrides):
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.update(overrides)
    c = LlamaConfig(**cfg)
    c.rope_parameters = {"rope_theta": 50000.0, "rope_type": "default"}
    torch.manual_seed(7)
    model = LlamaForCausalLM(c)
    with torch.no_grad():  # weights well away from their init scale, so that errors show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if max_shard_size:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llama-hf-") as tmp:
        check(a, tmp)


def check(a, tmp):
    src = os.path.join(tmp, "src")
    make(src)
    want = reference_logits(src)
    prompt = ["--prompt", ",".join(map(str, PROMPT)), "--steps", "0"]
    for tp, dp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1)):
        out = os.path.join(tmp, f"logits-{tp}-{dp}.safetensors")
        launch(a, tp * dp, ["--from-hf", src, "--tp", str(tp), "--logits-out", out] + prompt)
        err = compare(out, want, f"(tp {tp}, dp {dp})")
        print(f"(tp {tp}, dp {dp}): logits equal transformers' (max difference {err:.2e})")

    out = os.path.join(tmp, "logits-sp.safetensors")
    launch(a, 4, ["--from-hf", src, "--tp", "2", "--sequence-parallel", "--logits-out", out] + prompt)
    print(f"sequence parallel, (tp 2, dp 2): max difference {compare(out, want, 'sequence parallel'):.2e}")

    sharded = os.path.join(tmp, "sharded")  # several files and model.safetensors.index.json
    make(sharded, max_shard_size="40KB")
    out = os.path.join(tmp, "logits-sharded.safetensors")
    launch(a, 4, ["--from-hf", sharded, "--tp", "2", "--logits-out", out] + prompt)
    files = len([f for f in os.listdir(sharded) if f.endswith(".safetensors")])
    print(f"{files} files and an index, (tp 2, dp 2): max difference {compare(out, want, 'sharded'):.2e}")

    tied = os.path.join(tmp, "tied")
    make(tied, tie_word_embeddings=True)
    out = os.path.join(tmp, "logits-tied.safetensors")
    launch(a, 4, ["--from-hf", tied, "--tp", "2", "--logits-out", out] + prompt)
    print(f"tied head, (tp 2, dp 2): max difference {compare(out, reference_logits(tied), 'tied head'):.2e}")

    # Through a pipeline: the stages in turn, the last one's logits to rank 0.
    for name, d, ranks, extra in (("untied", src, 2, []), ("tied", tied, 4, ["--tp", "2"])):
        out = os.path.join(tmp, f"logits-pp-{name}.safetensors")
        launch(a, ranks, ["--from-hf", d, "--pp", "2", "--logits-out", out] + extra + prompt)
        err = compare(out, want if d == src else reference_logits(tied), f"--pp 2 ({name})")
        print(f"--pp 2{''.join(' ' + e for e in extra)} ({name} head) on {ranks} ranks: logits equal transformers' "
              f"(max difference {err:.2e})")

    exported = os.path.join(tmp, "exported")
    launch(a, 4, ["--from-hf", src, "--tp", "2", "--steps", "3", "--json", "--export-hf", exported])
    trained = reference_logits(exported)
    moved = (trained - want).abs().max().item()
    if moved < 1e-3:
        sys.exit(f"FAILED: the exported model's logits moved by {moved:.2e} only: were the trained weights written?")
    out = os.path.join(tmp, "logits-exported.safetensors")
    launch(a, 1, ["--from-hf", exported, "--logits-out", out] + prompt)
    print(f"after 3 steps at (tp 2, dp 2): the export loads with from_pretrained, its logits equal the C++ "
          f"model's (max difference {compare(out, trained, 'exported'):.2e}; they moved {moved:.2e} in training)")

    # A pipelined fine-tune: each stage reads only its tensors, a tied head's embedding on both.
    for name, d, ranks in (("untied", src, 2), ("tied", tied, 4)):
        train = ["--from-hf", d, "--steps", "3", "--json", "--batch-size", "16"]
        one = [json.loads(l) for l in launch(a, 1, train).stdout.splitlines() if l.startswith('{"step"')]
        p = launch(a, ranks, train + ["--pp", "2", "--microbatches", "4"])
        piped = [json.loads(l) for l in p.stdout.splitlines() if l.startswith('{"step"')]
        if len(one) != 3 or len(piped) != 3 or "warning" in p.stderr:
            sys.exit(f"FAILED: --from-hf {name} --pp 2: rows {piped} against {one}\n{p.stderr}")
        worst = max(abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(piped, one))
        if worst > 1e-5:
            sys.exit(f"FAILED: --from-hf {name} --pp 2 on {ranks} ranks: losses {piped} against one rank's {one}")
        print(f"--from-hf ({name}) --pp 2 on {ranks} ranks: 3 losses within {worst:.2e} of one rank's")

    # Refused by name, before anything runs.
    def refused(name, edit, want_text):
        d = os.path.join(tmp, name)
        make(d)
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        edit(cfg)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        p = launch(a, 1, ["--from-hf", d, "--steps", "1"], expect_ok=False)
        if p.returncode != 2 or want_text not in p.stderr:
            sys.exit(f"FAILED: {name}: exit {p.returncode}, expected 2 with '{want_text}'\n{p.stderr}")
        print(f"{name}: refused: {p.stderr.strip().splitlines()[0]}")

    p = launch(a, 1, ["--from-hf", src, "--build-sharded", "--steps", "1"], expect_ok=False)
    if p.returncode != 2 or "--build-sharded with --from-hf" not in p.stderr:
        sys.exit(f"FAILED: --build-sharded with --from-hf: exit {p.returncode}, expected 2 naming both\n{p.stderr}")
    print(f"--build-sharded with --from-hf: refused: {p.stderr.strip().splitlines()[0][:120]}")
    refused("mistral", lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral"),
            "the example implements LlamaForCausalLM only")
    refused("rope-scaling", lambda c: c["rope_parameters"].update(rope_type="llama3", factor=8.0),
            "rope_parameters")
    refused("small-vocab", lambda c: c.update(vocab_size=100), "needs at least 256")
    refused("gelu", lambda c: c.update(hidden_act="gelu"), "hidden_act")


if __name__ == "__main__":
    main()
