#!/usr/bin/env python3
"""train_gpt's flags and inputs, one process each (no torchrun):

- every bad flag value (zero, negative, NaN, infinite, trailing characters, out of range, unknown
  flags, missing values) exits with status 2 and a message on stderr naming the flag, never a
  signal, an abort with a C++ backtrace, or a run;
- a bad --data (a directory, /dev/zero, a FIFO, a missing file, a file over --max-data-mb, a file
  too short for --block-size) exits with status 2 within seconds, naming the path;
- a diverging run (--lr 1e30) stops with status 1 and a message on stderr, and with --json every
  line of stdout is strict JSON (no NaN or Infinity tokens);
- --timeout reaches the process group: a rank whose store never answers fails with status 1 and a
  message within seconds (the default timeout would be 10 minutes);
- good runs exit 0, with --json lines that are strict JSON.

  python tests/examples/check_train_gpt_inputs.py --train-gpt build/examples/train_gpt
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "programs"))
from torchrun_runs import free_port  # noqa: E402

SMALL = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--batch-size", "2",
         "--steps", "2"]

# Appended after SMALL (a flag given twice takes the last value); the flag the message must name.
BAD_FLAGS = [
    (["--n-head", "0"], "--n-head"),
    (["--n-head", "3"], "--n-head"),  # 16 is not a multiple of 3
    (["--n-embd", "15"], "--n-embd"),
    (["--n-embd", "0"], "--n-embd"),
    (["--block-size", "0"], "--block-size"),
    (["--n-layer", "-1"], "--n-layer"),
    (["--n-layer", "0"], "--n-layer"),
    (["--clip", "-1"], "--clip"),
    (["--clip", "nan"], "--clip"),
    (["--clip", "inf"], "--clip"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1e-3"], "--lr"),
    (["--lr", "1e-3x"], "--lr"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--seed", "-1"], "--seed"),
    (["--seed", "1.5"], "--seed"),
    (["--seed", "18446744073709551616"], "--seed"),
    (["--steps", "3x"], "--steps"),
    (["--steps", "0"], "--steps"),
    (["--steps", ""], "--steps"),
    (["--steps", "99999999999999999999"], "--steps"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "3", "--grad-accum", "2"], "--batch-size"),
    (["--prefetch", "-1"], "--prefetch"),
    (["--grad-accum", "0"], "--grad-accum"),
    (["--shard-group-size", "0"], "--shard-group-size"),
    (["--bucket-mb", "0"], "--bucket-mb"),
    (["--save-every", "5"], "--save-dir"),
    (["--resume"], "--save-dir"),
    (["--save-dir", "/tmp/fsdp-unused-save-dir"], "--save-every"),
    (["--save-every", "0", "--save-dir", "/tmp/fsdp-unused-save-dir"], "--save-every"),
    (["--bucket-mb", "nan"], "--bucket-mb"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "-1"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--max-data-mb", "0"], "--max-data-mb"),
    (["--optimizer", "adam"], "--optimizer"),
    (["--strategy", "zero9"], "--strategy"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--data", "--json"], "--data"),  # the value is missing: the next word is a flag
    (["--lr"], "--lr"),  # the value is missing: nothing follows
    (["--max-rows", "0"], "--max-rows"),
    (["--max-rows", "2", "--grad-accum", "2"], "--max-rows"),
    (["--async-save", "--save-dir", "/tmp/fsdp-unused-save-dir", "--resume"], "--async-save"),
    (["--keep-last", "0", "--save-dir", "/tmp/fsdp-unused-save-dir", "--save-every", "1"], "--keep-last"),
]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FSDP_TIMEOUT", "FSDP_JOB_ID")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def limit_memory():
    # A corpus read whole from /dev/zero must fail on this bound, not take the machine's memory.
    resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))


class Checker:
    def __init__(self, train_gpt):
        self.train_gpt = train_gpt
        self.failures = []

    def run(self, args, timeout=60, env=None):
        """(exit status or None on timeout, seconds, stdout, stderr)."""
        t0 = time.monotonic()
        try:
            p = subprocess.run([self.train_gpt] + args, capture_output=True, text=True, timeout=timeout,
                               env=env or clean_env(), stdin=subprocess.DEVNULL, preexec_fn=limit_memory)
            return p.returncode, time.monotonic() - t0, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            return None, time.monotonic() - t0, out, err

    def expect(self, name, ok, detail):
        print(("ok    " if ok else "FAIL  ") + name + ("" if ok else "\n      " + detail.replace("\n", "\n      ")))
        if not ok:
            self.failures.append(name)

    @staticmethod
    def status(rc):
        if rc is None:
            return "did not exit (timed out)"
        return f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"


def reject_constant(token):
    raise ValueError(f"{token} is not JSON")


def json_lines(stdout):
    """Every line of stdout parsed as strict JSON; raises on the first that is not."""
    rows = []
    for line in stdout.splitlines():
        try:
            rows.append(json.loads(line, parse_constant=reject_constant))
        except ValueError as e:
            raise ValueError(f"stdout line {line!r} is not strict JSON: {e}") from None
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    a = ap.parse_args()
    c = Checker(a.train_gpt)

    for extra, flag in BAD_FLAGS:
        rc, secs, out, err = c.run(SMALL + extra, timeout=60)
        detail = f"{c.status(rc)} after {secs:.1f} s; stderr:\n{err[-2000:]}"
        c.expect(f"bad flag {' '.join(extra) or '(none)'}: exit 2 naming {flag}",
                 rc == 2 and flag in err and "frame #" not in err and not out.strip(), detail)

    with tempfile.TemporaryDirectory() as tmp:
        fifo = os.path.join(tmp, "corpus.fifo")
        os.mkfifo(fifo)
        big = os.path.join(tmp, "big.txt")
        with open(big, "w") as f:
            f.write("the quick brown fox jumps over the lazy dog\n" * (2 * 1024 * 1024 // 44 + 1))
        short = os.path.join(tmp, "short.txt")
        with open(short, "w") as f:
            f.write("hello")
        good = os.path.join(tmp, "good.txt")
        with open(good, "w") as f:
            f.write("a small corpus of plain text, long enough for the context\n" * 40)
        data_cases = [
            (tmp, [], "a directory"),
            ("/dev/zero", [], "a character device"),
            (fifo, [], "a FIFO"),
            (os.path.join(tmp, "missing.txt"), [], "missing"),
            (big, ["--max-data-mb", "1"], "over --max-data-mb"),
            (short, [], "shorter than --block-size + 1"),
        ]
        for path, extra, what in data_cases:
            rc, secs, out, err = c.run(SMALL + ["--data", path] + extra, timeout=30)
            detail = f"{c.status(rc)} after {secs:.1f} s; stderr:\n{err[-2000:]}"
            c.expect(f"--data {what}: exit 2 within seconds naming the path",
                     rc == 2 and secs < 30 and path in err and "frame #" not in err, detail)
        rc, secs, out, err = c.run(SMALL + ["--data", big, "--max-data-mb", "1"], timeout=30)
        c.expect("--data over the bound: the message names --max-data-mb", "--max-data-mb" in err, err[-2000:])
        rc, secs, out, err = c.run(SMALL + ["--data", good, "--max-data-mb", "1", "--json"], timeout=120)
        c.expect("--data a regular file within --max-data-mb: exit 0", rc == 0,
                 f"{c.status(rc)}; stderr:\n{err[-2000:]}")

    # A run that diverges: stopped with status 1 and a message; stdout stays strict JSON.
    # The first step updates every weight by about 1e30, so the second step's gradients are NaN: the
    # gradient-norm check (fsdp::optim::grad_norm, or clip_grad_norm with --clip) stops it, naming the
    # rank and this rank's first parameter whose gradient is not finite.
    for extra in (["--json"], [], ["--json", "--clip", "1"]):
        args = SMALL + ["--lr", "1e30", "--steps", "5"] + extra
        rc, secs, out, err = c.run(args, timeout=120)
        detail = f"{c.status(rc)}; stdout:\n{out[-2000:]}\nstderr:\n{err[-2000:]}"
        fn = "fsdp::optim::clip_grad_norm (rank 0 of 1)" if "--clip" in extra else "fsdp::optim::grad_norm (rank 0 of 1)"
        c.expect(f"--lr 1e30 {' '.join(extra)}: exit 1, '{fn}' names the norm and a parameter on stderr",
                 rc == 1 and "train_gpt (rank 0): " + fn in err and "not finite" in err and
                 "first parameter with a non-finite gradient is '" in err and "frame #" not in err, detail)
        if "--json" in extra:  # step lines, then {"error": ..., "rank": 0} as the last line
            try:
                rows = json_lines(out)
                ok, why = len(rows) >= 2, "no step line before the stop"
                last = rows[-1] if rows else {}
                if ok and not ("not finite" in str(last.get("error", "")) and last.get("rank") == 0):
                    ok, why = False, f"the last line is not the error record {{\"error\": ..., \"rank\": 0}}: {last}"
            except ValueError as e:
                ok, why = False, str(e)
            c.expect(f"--lr 1e30 {' '.join(extra)}: every stdout line is strict JSON", ok, why + "\n" + detail)

    # --timeout reaches init_process_group: rank 1 of 2 whose store (rank 0) never starts gives up
    # within seconds, exit 1, a message without a C++ backtrace (default: after 10 minutes).
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rc, secs, out, err = c.run(SMALL + ["--timeout", "2"], timeout=90, env=env)
    ours = err[err.rfind("train_gpt (rank 1): "):] if "train_gpt (rank 1): " in err else ""
    c.expect("--timeout 2 bounds the start-up: exit 1 within a minute, message as 'train_gpt (rank 1): ...'",
             rc == 1 and secs < 60 and ours and "frame #" not in ours,
             f"{c.status(rc)} after {secs:.1f} s; stderr:\n{err[-3000:]}")

    # Good runs: exit 0, strict JSON, finite losses and gradient norms.
    for extra in (["--json"], ["--json", "--clip", "0.5", "--timeout", "30.5"], ["--json", "--seed", "0"]):
        rc, secs, out, err = c.run(SMALL + ["--steps", "3"] + extra, timeout=120)
        try:
            rows = json_lines(out)
            steps = [r for r in rows if "step" in r]
            ok = (rc == 0 and len(steps) == 3 and sum(1 for r in rows if r.get("summary")) == 1 and
                  all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in steps))
            why = f"{c.status(rc)}; rows {rows}"
        except ValueError as e:
            ok, why = False, str(e)
        c.expect(f"good run {' '.join(extra)}: exit 0, strict JSON, finite loss and grad_norm", ok,
                 why + "\nstderr:\n" + err[-2000:])
    rc, secs, out, err = c.run(SMALL, timeout=120)
    c.expect("good run (text): exit 0", rc == 0 and "step    1" in out, f"{c.status(rc)}\n{out}\n{err[-2000:]}")
    rc, secs, out, err = c.run(["--help"], timeout=60)
    c.expect("--help: exit 0 with the usage on stdout", rc == 0 and "usage: train_gpt" in out, f"{c.status(rc)}")

    if c.failures:
        sys.exit(f"FAILED: {len(c.failures)} check(s): " + "; ".join(c.failures))
    print("OK")


if __name__ == "__main__":
    main()
