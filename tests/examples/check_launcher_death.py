#!/usr/bin/env python3
"""Ranks end when their launcher dies.

Starts `torchrun --standalone --no-python --nproc-per-node 2 train_gpt` on a long run, waits for
its first step, SIGKILLs torchrun (which then stops nothing itself), and asserts that both ranks
exit within a few seconds: fsdp::init_process_group armed a parent-death signal (SIGTERM) because
torchrun started them. The same run with FSDP_PARENT_DEATH_SIGNAL=0 leaves the ranks running,
orphaned (they are killed by this script afterwards): that is what the library prevents.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

# /proc helpers shared with scripts/inject_faults.py (alive: running or stopped; a zombie, exited
# but not yet reaped by whoever adopted it, is not).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from faults.runner import alive, children  # noqa: E402


def run_and_kill_launcher(train_gpt, torchrun, env_extra, wait_s):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    cmd = [torchrun, "--standalone", "--no-python", "--nproc-per-node", "2", train_gpt, "--steps", "1000000",
           "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "4"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                start_new_session=True)
    try:
        line = launcher.stdout.readline()  # the banner, printed once the process group exists
        deadline = time.time() + 60
        while "step" not in line and time.time() < deadline:
            line = launcher.stdout.readline()
            if not line and launcher.poll() is not None:
                sys.exit(f"FAILED: torchrun exited {launcher.returncode} before the first step")
        ranks = [p for p in children(launcher.pid) if alive(p)]
        if len(ranks) != 2:
            sys.exit(f"FAILED: expected 2 ranks under torchrun {launcher.pid}, found {ranks}")
        killed_at = time.time()
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        while time.time() - killed_at < wait_s and any(alive(p) for p in ranks):
            time.sleep(0.05)
        return ranks, [p for p in ranks if alive(p)], time.time() - killed_at
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # whatever is left of the run
        except OSError:
            pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    a = ap.parse_args()

    ranks, left, took = run_and_kill_launcher(a.train_gpt, a.torchrun, {}, wait_s=10)
    if left:
        sys.exit(f"FAILED: ranks {left} still run {took:.1f} s after torchrun was SIGKILLed")
    print(f"torchrun SIGKILLed: ranks {ranks} exited within {took:.2f} s (parent-death signal SIGTERM)")

    ranks, left, took = run_and_kill_launcher(a.train_gpt, a.torchrun, {"FSDP_PARENT_DEATH_SIGNAL": "0"}, wait_s=3)
    if not left:
        sys.exit("FAILED: with FSDP_PARENT_DEATH_SIGNAL=0 the ranks exited too: the check above proves nothing")
    print(f"control, FSDP_PARENT_DEATH_SIGNAL=0: ranks {left} still ran {took:.1f} s after torchrun died (killed now)")


if __name__ == "__main__":
    main()
