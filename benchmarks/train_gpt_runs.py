"""Running examples/train_gpt from Python: one process or torchrun, its JSON rows, the ZeRO formulas.

Shared by tests/check_train_gpt.py and the benchmark scripts in this directory.
"""
import json
import os
import subprocess
import sys

# The strategies train_gpt takes (--strategy); their formulas come from train_gpt's summary row
# (formula_state_bytes, formula_text), computed from the library's strategy traits (fsdp/strategy.h).
STRATEGIES = ("full", "grad-op", "optimizer", "replicate", "hybrid")


def command(train_gpt, torchrun, ranks, args):
    """train_gpt alone for one rank, under `torchrun --no-python` for more."""
    if ranks == 1:
        return [train_gpt] + list(args)
    # --standalone: a free port per run, so that runs in parallel (ctest -j) do not collide.
    return [torchrun, "--standalone", "--no-python", "--nproc-per-node", str(ranks), train_gpt] + list(args)


def run(cmd, timeout=None):
    """Runs train_gpt with --json (one intra-op thread per rank, as torchrun sets); returns the
    per-step rows and the summary row. Exits with the output on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        sys.exit(f"FAILED: {' '.join(cmd)} did not finish in {timeout} s\n{e.stdout}\n{e.stderr}")
    if p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    steps = [r for r in rows if "step" in r]
    summary = next((r for r in rows if r.get("summary")), None)
    if not steps or summary is None:
        sys.exit(f"FAILED: no JSON rows from {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return steps, summary
