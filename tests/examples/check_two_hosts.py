#!/usr/bin/env python3
"""Two hosts, one rank each, and the link between them cut mid-training.

Each host is a network namespace this script creates (as root), joined by a veth pair with
addresses that exist only inside those namespaces; nothing leaves this machine. Rank 0 (hosting
the store) runs in one, rank 1 in the other, `train_gpt --timeout T`. After a few steps the link
is set down; both ranks must exit non-zero within the bound (default 60 s with T = 20), each with
the library's message on stderr. Prints the time from the cut to each rank's exit and the last
lines each printed.

Exit status 77 (ctest's SKIP_RETURN_CODE) when not root or without `ip` / namespaces.
"""
import argparse
import os
import shutil
import subprocess
import sys
import threading
import time

SKIP = 77

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from faults.runner import connect_namespaces  # noqa: E402 (shared with scripts/inject_faults.py)


def sh(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--timeout", type=float, default=20, help="train_gpt --timeout (seconds)")
    ap.add_argument("--bound", type=float, default=60, help="both ranks must have exited this long after the cut")
    ap.add_argument("--steps-before-cut", type=int, default=3)
    a = ap.parse_args()

    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("SKIPPED: needs root and iproute2's `ip` to create network namespaces")
        sys.exit(SKIP)
    tag = f"fsdp{os.getpid() % 100000}"
    ns = [f"{tag}h0", f"{tag}h1"]
    veth = [f"{tag}a", f"{tag}b"]
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    addr = [f"{net}.1", f"{net}.2"]
    try:
        for n in ns:
            if sh("ip", "netns", "add", n, check=False).returncode != 0:
                print(f"SKIPPED: cannot create network namespace {n}")
                sys.exit(SKIP)
        connect_namespaces(ns, veth, addr)
        sh("ip", "netns", "exec", ns[0], "ping", "-c", "1", "-W", "2", addr[1], check=False)

        procs, logs = [], [[], []]
        for r in range(2):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=addr[0],
                       MASTER_PORT="29555", GLOO_SOCKET_IFNAME=veth[r], OMP_NUM_THREADS="1")
            for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "FSDP_TIMEOUT"):
                env.pop(k, None)
            cmd = ["ip", "netns", "exec", ns[r], a.train_gpt, "--timeout", str(a.timeout), "--steps", "1000000",
                   "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))

        exited = [None, None]
        steps_seen = threading.Event()

        def drain(r):
            for line in procs[r].stdout:
                logs[r].append(line.rstrip("\n"))
                if r == 0 and line.startswith("step") and int(line.split()[1]) >= a.steps_before_cut:
                    steps_seen.set()
            procs[r].wait()
            exited[r] = time.time()

        threads = [threading.Thread(target=drain, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        if not steps_seen.wait(120):
            sys.exit("FAILED: no training steps within 120 s\n" + "\n".join(logs[0][-20:] + logs[1][-20:]))
        cut = time.time()
        sh("ip", "-n", ns[0], "link", "set", veth[0], "down")
        print(f"link cut after step {a.steps_before_cut} (train_gpt --timeout {a.timeout:g})")
        for t in threads:
            t.join(a.bound + 30)
        ok = True
        for r in range(2):
            p = procs[r]
            if exited[r] is None:
                p.kill()
                print(f"rank {r}: still running {a.bound + 30:.0f} s after the cut (killed)")
                ok = False
                continue
            took = exited[r] - cut
            print(f"rank {r}: exited with status {p.returncode} {took:.1f} s after the cut; its last lines:")
            for line in [x for x in logs[r] if not x.startswith("step")][-6:]:
                print(f"    {line}")
            ok = ok and p.returncode != 0 and took <= a.bound
        if not ok:
            sys.exit(f"FAILED: both ranks must exit non-zero within {a.bound:g} s of the cut")
        print(f"PASSED: both ranks exited non-zero within {a.bound:g} s of the cut")
    finally:
        for n in ns:
            sh("ip", "netns", "del", n, check=False)


if __name__ == "__main__":
    main()
