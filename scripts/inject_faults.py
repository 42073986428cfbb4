#!/usr/bin/env python3
"""Fault injection into real runs of build/examples/train_gpt.

Each scenario starts real ranks of train_gpt (each in its own session / process group, with the
torchrun-style environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT a free
port), injects one fault (a peer stopped or killed mid-step, a closed or silent port, an unresolvable
host, a link cut between two network namespaces, options differing between ranks, bad flags, a
diverging run, a second job on the same port, the launcher killed), and measures for every rank the
time from the fault to its exit, its exit status (or signal) and the library's message (its stderr
lines, without c10d's `[W...]` warning lines). Scenarios 10 and 11 run gtest cases of
build/tests/fsdp_tests instead (those faults cannot be made with train_gpt).

Writes benchmarks/results/faults.txt (human-readable) and benchmarks/results/faults.json (the same
data), and exits 1 if any scenario did not end as expected (or left a process or namespace behind).

Every scenario is bounded: it has its own deadline, past which everything it started is SIGKILLed;
whatever it started (processes, their descendants, network namespaces, sockets, temporary files)
is removed when it ends, however it ends. Needs root for the network namespaces (scenarios 3c, 4b).

    ~/.cache/libtorch-fsdp/venv-torch-2.11.0/bin/python scripts/inject_faults.py
    ... scripts/inject_faults.py --only 1a,6a --results /tmp/faults    # a subset, elsewhere

Standard library only.
"""
import argparse
import ctypes
import datetime
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback

from faults.runner import (ALL_NAMESPACES, ALL_PROCS, CFG, REAPED, ROOT, SMALL, STEPS_BEFORE_FAULT, Failed,
                           Scenario, fmt_s, proc_table, reap_orphans, sh)
from faults.scenarios import s2, scenario_list


def text_report(meta, scenarios, leftovers):
    L = []
    L.append(f"date:    {meta['date']}")
    L.append(f"machine: {meta['machine']}")
    L.append(f"commit:  {meta['commit']}")
    L.append(f"command: {meta['command']}")
    L.append("report:  fault injection into real runs of build/examples/train_gpt (libtorch-fsdp), "
             "scripts/inject_faults.py")
    L.append(f"model:   {' '.join(SMALL)}; mid-run faults after rank 0 printed step {STEPS_BEFORE_FAULT}")
    L.append("times:   seconds from the fault to each rank's exit (for start-up faults, from the process's start)")
    L.append("")
    L.append("Summary")
    w = max(len(s.sid) for s in scenarios)
    L.append(f"  {'scenario'.ljust(max(w, 8))}  {'expectation met':15}  {'worst time':>10}  title")
    for s in scenarios:
        L.append(f"  {s.sid.ljust(max(w, 8))}  {('yes' if s.ok else 'NO'):15}  {fmt_s(s.worst_s()):>10}  {s.title}")
    L.append("  (worst time: the longest time from the fault to the exit of a rank under test; for 2, from the "
             "message to the exit; for start-up faults, 5, 7, 8, 10 and 11, from the process's start)")
    L.append(f"  left behind: {leftovers or 'nothing (no process, no network namespace)'}")
    L.append(f"  overall: {'PASS' if all(s.ok for s in scenarios) and not leftovers else 'FAIL'}")
    for s in scenarios:
        L.append("")
        L.append(f"== {s.sid}. {s.title}")
        L.append(f"setup:       {s.setup}")
        L.append(f"expectation: {s.expectation}")
        if s.fault:
            L.append(f"fault:       {s.fault}")
        L.append(f"result:      {'expectation met' if s.ok else 'EXPECTATION NOT MET'}"
                 f" (ran {s.wall_s} s, deadline {s.limit_s} s{'; DEADLINE PASSED' if s.expired else ''})")
        for r in s.rows:
            head = f"  {r['label']}" + (f" [{r['role']}]" if r["role"] else "")
            head += f": {r['status']}, {fmt_s(r['fault_to_exit_s'])} after the fault"
            if r.get("fault_to_message_s") is not None:
                head += (f" (message at {fmt_s(r['fault_to_message_s'])}, message to exit "
                         f"{fmt_s(r['message_to_exit_s'])})")
            L.append(head)
            if r.get("note"):
                L.append(f"      note: {r['note']}")
            msg = r["message"]
            if s.sid == "7":
                msg = msg[:1]
            if msg:
                L.append("      message: " + msg[0])
                for m in msg[1:12]:
                    L.append("               " + m)
                if len(msg) > 12:
                    L.append(f"               ... ({len(msg) - 12} more lines)")
            elif r["role"] not in ("test binary",):
                L.append("      message: (none)")
            other = r.get("other_stderr") or []
            if other:
                frames = sum(1 for o in other if o.startswith("frame #"))
                L.append(f"      other stderr: {other[0][:160]}" + (f" (+{len(other) - 1} more line(s)" +
                         (f", a C++ backtrace of {frames} frames" if frames else "") + ")" if len(other) > 1 else ""))
            for e in r.get("error_lines", []):
                L.append(f"      {e['test']}, rank {e['rank']}: {e['lines'][0]}")
                for m in e["lines"][1:]:
                    L.append(f"          {m}")
        for n in s.notes:
            L.append(f"  note: {n}")
        L.append("  checks:")
        for c in s.checks:
            L.append(f"    [{'ok' if c['ok'] else 'FAIL'}] {c['what']}")
            if not c["ok"] and c["detail"]:
                for d in str(c["detail"]).splitlines()[:8]:
                    L.append(f"           {d}")
    return "\n".join(L) + "\n"


def final_sweep():
    """Kills whatever this script started that still runs; returns a description of it ('' if none)."""
    left = []
    for p in ALL_PROCS:
        if not p.exited():
            left.append(f"{p.label} pid {p.pid}")
            p.kill_all()
    reap_orphans()
    exes = {os.path.realpath(CFG.train_gpt), os.path.realpath(CFG.fsdp_tests)}
    mine = {p.pid for p in ALL_PROCS} | set(REAPED)
    for pid in proc_table():
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if exe in exes and pid in mine:
            left.append(f"{exe} pid {pid}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    listed = sh("ip", "netns", "list", check=False).stdout.split() if shutil.which("ip") else []
    for n in ALL_NAMESPACES:
        if n in listed:
            left.append(f"network namespace {n}")
            sh("ip", "netns", "del", n, check=False)
    return "; ".join(left)


def other_train_gpts():
    out = []
    exe = os.path.realpath(CFG.train_gpt)
    for pid in proc_table():
        try:
            if os.readlink(f"/proc/{pid}/exe") == exe:
                out.append(pid)
        except OSError:
            pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="the build directory")
    ap.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"),
                    help="where faults.txt and faults.json are written")
    ap.add_argument("--only", default="", help="comma-separated scenario ids (e.g. 1a,3c,12); default all")
    a = ap.parse_args()
    CFG.train_gpt = os.path.join(a.build, "examples", "train_gpt")
    CFG.fsdp_tests = os.path.join(a.build, "tests", "fsdp_tests")
    CFG.torchrun = a.torchrun
    for path in (CFG.train_gpt, CFG.fsdp_tests):
        if not os.access(path, os.X_OK):
            sys.exit(f"inject_faults.py: {path} is not built (cmake --build {a.build})")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("inject_faults.py: warning: not root or no `ip`: scenarios 3c and 4b will fail", file=sys.stderr)
    try:  # adopt orphans (the ranks of a SIGKILLed torchrun) to read their exit status
        CFG.subreaper = ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        CFG.subreaper = False

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    already = other_train_gpts()
    if already:
        print(f"inject_faults.py: warning: train_gpt processes not started by this script are running: {already}",
              file=sys.stderr)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip().splitlines()
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{socket.gethostname()}, nproc {os.cpu_count()} ({len(os.sched_getaffinity(0))} usable), "
                   f"{os.uname().sysname} {os.uname().release}",
        "nproc": len(os.sched_getaffinity(0)),
        "commit": commit + (f" (working tree: {len(dirty)} tracked file(s) modified)" if dirty else ""),
        "command": f"cd {ROOT} && " + shlex.join([sys.executable] + sys.argv),
        "train_gpt": CFG.train_gpt, "torchrun": CFG.torchrun, "subreaper": CFG.subreaper,
    }
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    done = []
    by_id = {}
    try:
        for sid, title, setup, expectation, limit, fn in scenario_list():
            if only and sid not in only:
                continue
            sc = Scenario(sid, title, setup, expectation, limit)
            print(f"[{time.strftime('%H:%M:%S')}] {sid}. {title} ...", flush=True)
            try:
                if sid == "2":
                    s2(sc, [by_id[k] for k in ("1a", "1b") if k in by_id])
                else:
                    fn(sc)
            except Failed as e:
                sc.check("the scenario ran to its end", False, str(e))
            except Exception:
                sc.check("the scenario ran to its end", False, traceback.format_exc())
            finally:
                sc.cleanup()
            if sc.expired:
                sc.check(f"the scenario ended before its deadline ({limit} s)", False)
            done.append(sc)
            by_id[sid] = sc
            print(f"    {'ok' if sc.ok else 'EXPECTATION NOT MET'}; worst {fmt_s(sc.worst_s())}; "
                  f"{sc.wall_s} s", flush=True)
            for c in sc.checks:
                if not c["ok"]:
                    print(f"    FAIL {c['what']}: {str(c['detail'])[:500]}", flush=True)
    except KeyboardInterrupt:  # the running scenario cleaned up after itself (its finally)
        print("inject_faults.py: interrupted; cleaning up", file=sys.stderr)
        final_sweep()
        sys.exit(130)
    leftovers = final_sweep()
    os.makedirs(a.results, exist_ok=True)
    txt = text_report(meta, done, leftovers)
    with open(os.path.join(a.results, "faults.txt"), "w") as f:
        f.write(txt)
    data = dict(meta, overall_ok=all(s.ok for s in done) and not leftovers, left_behind=leftovers,
                scenarios=[s.to_json() for s in done])
    with open(os.path.join(a.results, "faults.json"), "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(txt.split("\n== ")[0])
    print(f"wrote {os.path.join(a.results, 'faults.txt')} and faults.json")
    sys.exit(0 if data["overall_ok"] else 1)


if __name__ == "__main__":
    main()
