"""Running examples/train_gpt from Python: one process or torchrun, its JSON rows, the ZeRO formulas.

Shared by tests/check_train_gpt.py and the benchmark scripts in this directory.
"""
import json
import os
import subprocess
import sys

# Model-state bytes per rank with fp32 weights and AdamW (4 param + 4 grad + 8 optimizer bytes per
# parameter), psi parameters on n ranks (s: hybrid's group size): DESIGN.md section 4.
FORMULAS = {
    "full": lambda psi, n, s: 16 * psi / n,
    "grad-op": lambda psi, n, s: 16 * psi / n,
    "optimizer": lambda psi, n, s: 8 * psi + 8 * psi / n,
    "replicate": lambda psi, n, s: 16 * psi,
    "hybrid": lambda psi, n, s: 16 * psi / s,
}
FORMULA_TEXT = {"full": "16Ψ/N", "grad-op": "16Ψ/N", "optimizer": "8Ψ + 8Ψ/N", "replicate": "16Ψ", "hybrid": "16Ψ/S"}


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
