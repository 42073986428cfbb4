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
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]
LONG = ["--steps", "1000000"]
STEPS_BEFORE_FAULT = 3  # rank 0 must have printed `step 3` (training under way) before a mid-run fault
START_LIMIT = 120.0  # seconds for a job to reach that step (4 ranks on 2 cores start slowly)

now = time.monotonic
_STEP_RE = re.compile(r'^(?:step\s+(\d+)\s*\||\{"step": (\d+),)')
_ALL_PROCS = []  # every Proc this script started (for the final sweep)
_ALL_NAMESPACES = []
_SUBREAPER = False


def fmt_s(x):
    return "-" if x is None else f"{x:.2f} s"


def status_text(rc):
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra):
    """This environment without any launcher's or the library's variables, OMP_NUM_THREADS=1, plus `extra`."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("TORCHELASTIC_", "FSDP_", "SLURM_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def rank_env(rank, world, port, addr="127.0.0.1", **extra):
    return base_env(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, MASTER_ADDR=addr, MASTER_PORT=port, **extra)


def proc_table():
    """{pid: (ppid, state)} from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(d)] = (int(fields[1]), fields[0])
        except (OSError, IndexError, ValueError):
            pass
    return out


def descendants(pid, table=None):
    table = table or proc_table()
    kids = {}
    for p, (pp, _) in table.items():
        kids.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid):
    """Running or stopped (a zombie is not)."""
    st = proc_table().get(pid)
    return st is not None and st[1] not in ("Z", "X")


def environ_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
    except OSError:
        return {}


def sh(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check, stdin=subprocess.DEVNULL,
                          timeout=30)


_LOG_RE = re.compile(r"^(\[[A-Z]\d{4} |[IWEF]\d{4} \d\d:)")  # glog/c10d ("[E1130 12:00:..."), torchrun ("W1130 12:...")


def split_stderr(err_lines, rank=None):
    """(message, other): the library's message as train_gpt prints it ('train_gpt (rank R): ...' or
    'train_gpt: ...' and its continuation lines), and the other stderr lines (c10d's [E...] logs and
    their backtraces, a launcher's logs). c10d's [W...] warnings and blank lines are dropped. With
    `rank`, for a stream several ranks share, only that rank's message."""
    msg, other, cur = [], [], None
    for _, line in err_lines:
        if not line.strip():
            continue
        if line.startswith(("[W", "W")) and (line.startswith("[W") or _LOG_RE.match(line)):
            cur = "warning"
        elif _LOG_RE.match(line):
            cur = "log"
        elif line.startswith(("train_gpt (rank ", "train_gpt: ")):
            cur = "msg" if rank is None or line.startswith(f"train_gpt (rank {rank}): ") else "skip"
        if cur in ("warning", "skip"):
            continue
        (msg if cur == "msg" else other).append(line)
    return msg, other


def message_lines(err_lines, rank=None):
    return split_stderr(err_lines, rank)[0]


class Proc:
    """One process in its own session, stdout and stderr read line by line with arrival times."""

    def __init__(self, label, cmd, env, rank=None, cwd=ROOT):
        self.label, self.cmd, self.rank = label, cmd, rank
        self.cond = threading.Condition()
        self.out, self.err = [], []  # (monotonic time, line)
        self.max_step = -1
        self.exit_t = None
        self.p = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        self.start_t = now()
        self.pid = self.p.pid
        _ALL_PROCS.append(self)
        self.readers = [threading.Thread(target=self._read, args=(self.p.stdout, self.out, True), daemon=True),
                        threading.Thread(target=self._read, args=(self.p.stderr, self.err, False), daemon=True)]
        self.waiter = threading.Thread(target=self._wait, daemon=True)
        for t in self.readers + [self.waiter]:
            t.start()

    def _read(self, pipe, sink, is_stdout):
        try:
            for raw in iter(pipe.readline, b""):
                t = now()
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                with self.cond:
                    sink.append((t, line))
                    if is_stdout:
                        m = _STEP_RE.match(line)
                        if m:
                            self.max_step = max(self.max_step, int(m.group(1) or m.group(2)))
                    self.cond.notify_all()
        finally:
            pipe.close()

    def _wait(self):
        self.p.wait()
        with self.cond:
            self.exit_t = now()
            self.cond.notify_all()

    @property
    def rc(self):
        return self.p.returncode if self.exit_t is not None else None

    def exited(self):
        return self.exit_t is not None

    def wait_step(self, n, deadline):
        with self.cond:
            while self.max_step < n and self.exit_t is None and now() < deadline:
                self.cond.wait(min(0.2, max(0.01, deadline - now())))
            return self.max_step >= n

    def wait_exit(self, deadline):
        with self.cond:
            while self.exit_t is None and now() < deadline:
                self.cond.wait(min(0.2, max(0.01, deadline - now())))
            return self.exit_t is not None

    def finish_reading(self, timeout=3.0):
        for t in self.readers:
            t.join(timeout)

    def signal(self, sig):
        if self.exit_t is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill_all(self):
        """SIGKILL this process, its process group and every descendant (ranks a launcher started in
        sessions of their own included)."""
        victims = descendants(self.pid) if self.exit_t is None else []
        for target, fn in [(self.pid, os.killpg)] + [(d, os.kill) for d in victims]:
            try:
                fn(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # A process group whose leader exited may keep members.
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stdout_lines(self):
        with self.cond:
            return [l for _, l in self.out]

    def first_message_t(self, rank=None):
        prefix = "train_gpt (rank " if rank is None else f"train_gpt (rank {rank}): "
        with self.cond:
            for t, l in self.err:
                if l.startswith(prefix):
                    return t
        return None


class Failed(Exception):
    pass


class Scenario:
    def __init__(self, sid, title, setup, expectation, limit_s):
        self.sid, self.title, self.setup, self.expectation, self.limit_s = sid, title, setup, expectation, limit_s
        self.procs, self.namespaces, self.pids, self.sockets, self.tmpdirs = [], [], [], [], []
        self.rows, self.checks, self.notes = [], [], []
        self.fault = None
        self.expired = False
        self.t0 = now()
        self.deadline = self.t0 + limit_s
        self.lock = threading.Lock()
        self.timer = threading.Timer(limit_s, self._expire)
        self.timer.daemon = True
        self.timer.start()
        self.wall_s = None
        self.worst_field = "fault_to_exit_s"  # what the summary's "worst time" is the maximum of

    def until(self, seconds):
        """A deadline `seconds` from now, never past the scenario's own."""
        return min(self.deadline, now() + seconds)

    def _expire(self):
        self.expired = True
        self.kill_everything()

    def kill_everything(self):
        with self.lock:
            for p in self.procs:
                p.kill_all()
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def start(self, label, cmd, env, rank=None):
        with self.lock:
            if self.expired:
                raise Failed("the scenario's deadline passed")
            p = Proc(label, cmd, env, rank)
            self.procs.append(p)
            return p

    def start_rank(self, rank, world, port, args, addr="127.0.0.1", netns=None, label=None, **env_extra):
        cmd = [TRAIN_GPT] + list(args)
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        env = rank_env(rank, world, port, addr, **env_extra)
        return self.start(label or f"rank {rank}", cmd, env, rank)

    def add_netns(self, name):
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        _ALL_NAMESPACES.append(name)
        return name

    def check(self, what, ok, detail=""):
        self.checks.append({"what": what, "ok": bool(ok), "detail": detail})
        return ok

    def row(self, p, t_fault, role, measured=True, rank=None, note=None, msg_rank=None):
        """A rank's (or process's) row: time from the fault to its exit, status, message."""
        p.finish_reading()
        rank = p.rank if rank is None else rank
        msg, other = split_stderr(p.err, msg_rank)
        t_msg = p.first_message_t(msg_rank)
        r = {
            "rank": rank, "label": p.label, "role": role, "pid": p.pid, "measured": measured,
            "fault_to_exit_s": None if p.exit_t is None else round(p.exit_t - t_fault, 3),
            "fault_to_message_s": None if t_msg is None else round(t_msg - t_fault, 3),
            "message_to_exit_s": None if (t_msg is None or p.exit_t is None) else round(p.exit_t - t_msg, 3),
            "returncode": p.rc, "status": status_text(p.rc), "message": msg, "other_stderr": other,
            "command": shlex.join(p.cmd),
        }
        if note:
            r["note"] = note
        self.rows.append(r)
        return r

    def cleanup(self):
        self.timer.cancel()
        self.kill_everything()
        for p in self.procs:
            if not p.wait_exit(now() + 10):
                self.check(f"{p.label} (pid {p.pid}) ended when SIGKILLed at cleanup", False)
            p.finish_reading(2)
        for pid in self.pids:  # adopted processes (a launcher's ranks): reap them
            reap(pid, now() + 10)
        reap_orphans()
        for s in self.sockets:
            s.close()
        for n in self.namespaces:
            sh("ip", "netns", "del", n, check=False)
        for d in self.tmpdirs:
            shutil.rmtree(d, ignore_errors=True)
        self.wall_s = round(now() - self.t0, 2)

    @property
    def ok(self):
        return bool(self.checks) and all(c["ok"] for c in self.checks)

    def worst_s(self):
        ts = [r[self.worst_field] for r in self.rows if r["measured"] and r[self.worst_field] is not None]
        return max(ts) if ts else None

    def to_json(self):
        return {"id": self.sid, "title": self.title, "setup": self.setup, "expectation": self.expectation,
                "fault": self.fault, "expectation_met": self.ok, "worst_time_s": self.worst_s(),
                "worst_time_of": self.worst_field,
                "deadline_s": self.limit_s, "wall_s": self.wall_s, "deadline_passed": self.expired,
                "ranks": self.rows, "checks": self.checks, "notes": self.notes}


_REAPED = {}


def reap(pid, deadline):
    """Waits for an adopted child `pid` (this script is a child subreaper) until `deadline`; returns
    (exit time or None, returncode as Popen writes it, or None)."""
    if pid in _REAPED:
        return _REAPED[pid]
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (no subreaper): watch /proc instead
            if not alive(pid):
                _REAPED[pid] = (now(), None)
                return _REAPED[pid]
            got = 0
        if got == pid:
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _REAPED[pid] = (now(), rc)
            return _REAPED[pid]
        if now() >= deadline:
            return (None, None)
        time.sleep(0.01)


def reap_orphans():
    """Children this script adopted as subreaper and knows nothing of: killed and reaped."""
    me = os.getpid()
    known = {p.pid for p in _ALL_PROCS}
    for pid, (ppid, state) in proc_table().items():
        if ppid != me or pid in known or pid in _REAPED:
            continue
        if state not in ("Z", "X"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap(pid, now() + 5)


# ----------------------------------------------------------------------------------------------
# Scenarios


def peer_fault(sc, world, victim, sig, T, bound, extra, phrases):
    """Shared by 1 and 6: `world` ranks train; after a few steps `victim` gets `sig`; every other
    rank must exit 1 within `bound` s, its message containing each of phrases(rank)."""
    port = free_port()
    ps = [sc.start_rank(r, world, port, SMALL + LONG + ["--timeout", f"{T:g}"] + extra) for r in range(world)]
    if not ps[0].wait_step(STEPS_BEFORE_FAULT, sc.until(START_LIMIT)):
        sc.check(f"training under way (rank 0 printed step {STEPS_BEFORE_FAULT})", False,
                 "\n".join(l for _, l in ps[0].err[-10:]))
        return None
    step = ps[0].max_step
    t_fault = now()
    os.kill(ps[victim].pid, sig)
    sc.fault = f"{signal.Signals(sig).name} to rank {victim} (pid {ps[victim].pid}) after rank 0 printed step {step}"
    survivors = [p for p in ps if p is not ps[victim]]
    for p in survivors:
        p.wait_exit(min(sc.deadline - 5, t_fault + bound + 20))  # past the bound, to measure how late
    t_kill = None
    if sig == signal.SIGSTOP:
        t_kill = now()
        os.kill(ps[victim].pid, signal.SIGKILL)
    ps[victim].wait_exit(sc.until(10))
    for p in survivors:
        r = sc.row(p, t_fault, "survivor")
        t = r["fault_to_exit_s"]
        text = "\n".join(r["message"])
        sc.check(f"rank {p.rank} exits 1 within {bound:g} s of the fault",
                 r["returncode"] == 1 and t is not None and t <= bound, f"{r['status']} after {fmt_s(t)}")
        for ph in phrases(p.rank):
            sc.check(f"rank {p.rank}'s message names \"{ph}\"", ph in text, text)
    note = None
    if t_kill is not None:
        note = (f"stopped (SIGSTOP) at the fault; SIGKILLed by this script {t_kill - t_fault:.2f} s after it, "
                f"once the other ranks had exited")
    rv = sc.row(ps[victim], t_fault, "stopped peer" if sig == signal.SIGSTOP else "killed peer", measured=False,
                note=note)
    sc.check(f"rank {victim} (the {'stopped' if sig == signal.SIGSTOP else 'killed'} peer) ended by SIGKILL",
             rv["returncode"] == -signal.SIGKILL, rv["status"])
    return ps, t_fault


def s1(sc, world, victim, extra, hybrid):
    T = 10.0
    bound = T + 3

    def phrases(r):
        out = [f"Peer rank {victim}", "stopped answering"]
        if hybrid:
            out = [f"global rank {r} of {world}"]
        return out

    res = peer_fault(sc, world, victim, signal.SIGSTOP, T, bound, extra, phrases)
    if res and hybrid:
        for row in sc.rows:
            if row["role"] == "survivor":
                named = f"Peer rank {victim}" in "\n".join(row["message"])
                sc.notes.append(f"rank {row['rank']}'s message {'names' if named else 'does not name'} "
                                f"\"Peer rank {victim}\" (not required)")


def s2(sc, sources):
    """Teardown: from the runs of 1a and 1b, the time between each survivor's message and its exit."""
    limit = 1.0
    sc.worst_field = "message_to_exit_s"
    sc.notes.append(
        "train_gpt prints its message in main()'s catch, after the exception unwound run(): the model and the "
        "process group are destroyed before the message appears, so 'fault to message' contains the library's "
        "teardown of the group (it must stay close to the timeout, bound of 1), and 'message to exit' is what is "
        "left at exit (static destructors, threads). For comparison, a run stopped by a bad flag (scenario 7), "
        "which never made a process group, takes about 0.1 s from its message to its exit.")
    for src in sources:
        for r in src.rows:
            if r["role"] != "survivor":
                continue
            rr = dict(r, label=f"{src.sid}: {r['label']}")
            sc.rows.append(rr)
            m2e = r["message_to_exit_s"]
            sc.check(f"{src.sid} rank {r['rank']}: message to exit within {limit:g} s", m2e is not None and
                     m2e <= limit, f"message at {fmt_s(r['fault_to_message_s'])}, exit at {fmt_s(r['fault_to_exit_s'])}")
            f2m = r["fault_to_message_s"]
            sc.check(f"{src.sid} rank {r['rank']}: message within the timeout + 3 s (13 s) of the fault", f2m is not None
                     and f2m <= 13.0, f"message at {fmt_s(f2m)}")
    if not sc.rows:
        sc.check("scenario 1 produced survivors to measure", False)


def startup_case(sc, rank, world, port, T, bound, phrases, addr="127.0.0.1", netns=None, env_extra=None,
                 timeout_flag=True):
    args = SMALL + ["--steps", "5"] + (["--timeout", f"{T:g}"] if timeout_flag else [])
    p = sc.start_rank(rank, world, port, args, addr=addr, netns=netns, **(env_extra or {}))
    t_fault = p.start_t
    sc.fault = sc.fault or "present from the start (time measured from the process's start)"
    p.wait_exit(sc.until(bound + 30))
    r = sc.row(p, t_fault, "alone")
    t = r["fault_to_exit_s"]
    text = "\n".join(r["message"])
    sc.check(f"rank {rank} exits 1 within {bound:g} s", r["returncode"] == 1 and t is not None and t <= bound,
             f"{r['status']} after {fmt_s(t)}")
    for ph in phrases:
        sc.check(f"the message names \"{ph}\"", ph in text, text)


def s3a(sc):
    port = free_port()  # bound, then closed: nothing listens there
    startup_case(sc, 1, 2, port, 5.0, 6.0, ["127.0.0.1", str(port), "nothing listens"])


def s3b(sc):
    s = socket.socket()
    sc.sockets.append(s)
    s.bind(("127.0.0.1", 0))
    s.listen(16)  # never accepted: the kernel completes the handshake, nobody answers
    port = s.getsockname()[1]
    sc.setup += f" (port {port})"
    startup_case(sc, 1, 2, port, 5.0, 7.0, ["did not answer as a c10d store"])


def s3c(sc):
    ns = sc.add_netns(f"fsdpflt{os.getpid() % 100000}c")
    sc.setup += f" (namespace {ns})"
    startup_case(sc, 1, 2, 29500, 5.0, 7.0, ["no-such-host.invalid"], addr="no-such-host.invalid", netns=ns)


def s3d(sc):
    startup_case(sc, 0, 2, free_port(), 5.0, 7.0, ["missing: 1"])


def s4a(sc):
    port = free_port()
    startup_case(sc, 1, 2, port, 4.0, 5.0, ["nothing listens", str(port)], env_extra={"FSDP_TIMEOUT": "4"},
                 timeout_flag=False)


def s4b(sc):
    T, bound = 20.0, 60.0
    tag = f"fsdpflt{os.getpid() % 100000}"
    ns = [f"{tag}h0", f"{tag}h1"]
    veth = [f"{tag}a", f"{tag}b"]
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    addr = [f"{net}.1", f"{net}.2"]
    for n in ns:
        sc.add_netns(n)
        sh("ip", "-n", n, "link", "set", "lo", "up")
    sh("ip", "link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1], "netns", ns[1])
    for i in range(2):
        sh("ip", "-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", veth[i])
        sh("ip", "-n", ns[i], "link", "set", veth[i], "up")
    sc.setup += f" (namespaces {ns[0]} {addr[0]} on {veth[0]}, {ns[1]} {addr[1]} on {veth[1]})"
    port = 29555
    ps = [sc.start_rank(r, 2, port, SMALL + LONG + ["--timeout", f"{T:g}"], addr=addr[0], netns=ns[r],
                        GLOO_SOCKET_IFNAME=veth[r]) for r in range(2)]
    if not ps[0].wait_step(STEPS_BEFORE_FAULT, sc.until(START_LIMIT)):
        sc.check("training under way", False, "\n".join(l for _, l in ps[0].err[-10:] + ps[1].err[-10:]))
        return
    step = ps[0].max_step
    t_fault = now()
    sh("ip", "-n", ns[0], "link", "set", veth[0], "down")
    sc.fault = f"link {veth[0]} set down after rank 0 printed step {step}"
    for p in ps:
        p.wait_exit(min(sc.deadline - 5, t_fault + bound + 20))
    for p in ps:
        r = sc.row(p, t_fault, "host")
        t = r["fault_to_exit_s"]
        sc.check(f"rank {p.rank} exits non-zero within {bound:g} s of the cut",
                 r["returncode"] not in (None, 0) and t is not None and t <= bound, f"{r['status']} after {fmt_s(t)}")
        sc.check(f"rank {p.rank} printed the library's message", any(l.startswith(f"train_gpt (rank {p.rank}): ")
                                                                     for l in r["message"]), "\n".join(r["message"]))


def differing_options(sc, args_per_rank, phrase, bound=10.0):
    port = free_port()
    ps = [sc.start_rank(r, 2, port, SMALL + ["--steps", "20", "--timeout", "10"] + args_per_rank[r])
          for r in range(2)]
    t_fault = min(p.start_t for p in ps)
    sc.fault = "present from the start (time measured from the first rank's start)"
    for p in ps:
        p.wait_exit(sc.until(bound + 30))
    for p in ps:
        r = sc.row(p, t_fault, "rank")
        t = r["fault_to_exit_s"]
        text = "\n".join(r["message"])
        sc.check(f"rank {p.rank} exits 1 within {bound:g} s of its start", r["returncode"] == 1 and t is not None and
                 t <= bound, f"{r['status']} after {fmt_s(t)}")
        sc.check(f"rank {p.rank}'s message names the option \"{phrase}\"", phrase in text, text)


def s5a(sc):
    differing_options(sc, [["--prefetch", "1"], ["--prefetch", "2"]], "prefetch")


def s5b(sc):
    differing_options(sc, [["--strategy", "replicate", "--bucket-mb", "1"], ["--strategy", "replicate",
                                                                              "--bucket-mb", "2"]], "bucket")


def s6(sc, world, victim, extra, hybrid):
    T, bound = 10.0, 5.0

    def phrases(r):
        return [f"global rank {r} of {world}"] if hybrid else [f"Peer rank {victim}"]

    peer_fault(sc, world, victim, signal.SIGKILL, T, bound, extra, phrases)
    if hybrid:
        for row in sc.rows:
            if row["role"] == "survivor":
                named = f"Peer rank {victim}" in "\n".join(row["message"])
                sc.notes.append(f"rank {row['rank']}'s message {'names' if named else 'does not name'} "
                                f"\"Peer rank {victim}\" (not required)")


def s7(sc):
    tmp = tempfile.mkdtemp(prefix="fsdp-faults-")
    sc.tmpdirs.append(tmp)
    fifo = os.path.join(tmp, "corpus.fifo")
    os.mkfifo(fifo)
    cases = [(["--n-head", "0"], "--n-head"), (["--block-size", "0"], "--block-size"),
             (["--n-layer", "-1"], "--n-layer"), (["--clip", "-1"], "--clip"), (["--clip", "nan"], "--clip"),
             (["--lr", "inf"], "--lr"), (["--seed", "-1"], "--seed"), (["--steps", "3x"], "--steps"),
             (["--data", tmp], tmp), (["--data", "/dev/zero"], "/dev/zero"), (["--data", fifo], fifo)]
    bound = 10.0
    for extra, named in cases:
        p = sc.start_rank(0, 1, free_port(), SMALL + ["--steps", "2"] + extra, label=" ".join(extra))
        p.wait_exit(sc.until(30))
        if not p.exited():
            p.kill_all()
            p.wait_exit(now() + 5)
        r = sc.row(p, p.start_t, "single process")
        text = "\n".join(r["message"])
        t = r["fault_to_exit_s"]
        sc.check(f"{' '.join(extra)}: exit 2 within {bound:g} s with a message naming {named}",
                 r["returncode"] == 2 and t is not None and t <= bound and named in text and "frame #" not in text,
                 f"{r['status']} after {fmt_s(t)}: {text[:300]}")
    sc.fault = "a bad flag or --data (time measured from the process's start)"


def reject_constant(token):
    raise ValueError(f"{token} is not strict JSON")


def strict_json_lines(lines):
    bad = []
    for line in lines:
        try:
            json.loads(line, parse_constant=reject_constant)
        except ValueError as e:
            bad.append(f"{line!r}: {e}")
    return bad


def s8(sc, world):
    port = free_port()
    args = SMALL + ["--lr", "1e30", "--json", "--steps", "5", "--timeout", "10"]
    ps = [sc.start_rank(r, world, port, args) for r in range(world)]
    t0 = min(p.start_t for p in ps)
    sc.fault = "--lr 1e30: the first step's update makes the second step's gradients non-finite (time from start)"
    for p in ps:
        p.wait_exit(sc.until(60))
    for p in ps:
        r = sc.row(p, t0, "rank")
        text = "\n".join(r["message"])
        sc.check(f"rank {p.rank} exits 1 with a message on stderr", r["returncode"] == 1 and
                 text.startswith(f"train_gpt (rank {p.rank}): ") and "frame #" not in text,
                 f"{r['status']}: {text[:400]}")
        out = p.stdout_lines()
        bad = strict_json_lines(out)
        r["stdout_lines"] = len(out)
        sc.check(f"rank {p.rank}: every stdout line ({len(out)}) is strict JSON", not bad, "\n".join(bad[:5]))
        if p.rank == 0:
            sc.check("rank 0 printed at least one step line before the stop", len(out) >= 1, "")
            sc.notes.append("rank 0's stdout: " + " | ".join(out[:4]))


def s9(sc):
    port = free_port()
    job = [sc.start_rank(r, 2, port, SMALL + LONG + ["--timeout", "10"], label=f"job rank {r}") for r in range(2)]
    if not job[0].wait_step(STEPS_BEFORE_FAULT, sc.until(START_LIMIT)):
        sc.check("the first job trains", False, "\n".join(l for _, l in job[0].err[-10:]))
        return
    sc.fault = f"a third process (RANK=1 WORLD_SIZE=2) on the job's MASTER_PORT {port}, once the job trained"
    bound = 5.0
    for label, extra_env, phrase in [("intruder, same job identity (none)", {}, "is already taken"),
                                     ("intruder, FSDP_JOB_ID=other", {"FSDP_JOB_ID": "other"},
                                      "belongs to another job")]:
        before = job[0].max_step
        p = sc.start_rank(1, 2, port, SMALL + ["--steps", "5", "--timeout", "10"], label=label, **extra_env)
        p.wait_exit(sc.until(bound + 30))
        r = sc.row(p, p.start_t, "intruder", rank=1)
        r["job_step_at_start"] = before
        text = "\n".join(r["message"])
        t = r["fault_to_exit_s"]
        sc.check(f"{label}: exits 1 within {bound:g} s", r["returncode"] == 1 and t is not None and t <= bound,
                 f"{r['status']} after {fmt_s(t)}")
        sc.check(f"{label}: the message says \"{phrase}\"", phrase in text, text)
    s1_, t1 = job[0].max_step, now()
    job[0].wait_step(s1_ + 20, sc.until(5))
    time.sleep(max(0.0, 2.0 - (now() - t1)))
    s2_ = job[0].max_step
    running = [not p.exited() for p in job]
    job_msgs = [message_lines(p.err) for p in job]
    sc.check("the first job keeps training (step lines continue, both ranks run, no error)",
             s2_ > s1_ and all(running) and not any(job_msgs),
             f"step {s1_} -> {s2_} in {now() - t1:.1f} s; running {running}; messages {job_msgs}")
    sc.notes.append(f"the first job went on from step {s1_} to step {s2_} in {now() - t1:.1f} s after the intruders")
    t_stop = now()
    for p in job:
        p.signal(signal.SIGTERM)
    for p in job:
        if not p.wait_exit(sc.until(5)):
            p.kill_all()
            p.wait_exit(sc.until(5))
    for p in job:
        sc.row(p, t_stop, "the first job, stopped by this script with SIGTERM", measured=False,
               note="its time is measured from this script's SIGTERM, not from the intruders")


def run_gtest(sc, gtest_filter, show_output):
    env = base_env()
    if show_output:
        env["FSDP_TEST_SHOW_OUTPUT"] = "1"
    p = sc.start("fsdp_tests", [FSDP_TESTS, f"--gtest_filter={gtest_filter}"], env)
    p.wait_exit(sc.until(sc.limit_s))
    p.finish_reading()
    r = sc.row(p, p.start_t, "test binary")
    r["message"] = []  # the test's output is summarised below, not a library message
    out = [l for _, l in p.out] + [l for _, l in p.err]
    ran = [m.group(2) for m in (re.match(r"\[\s+(OK|FAILED)\s+\] (\S+)", l) for l in out) if m]
    passed = any(re.match(r"\[  PASSED  \] \d+ tests?\.", l) for l in out)
    failed = [l for l in out if l.startswith("[  FAILED  ]")]
    sc.check(f"fsdp_tests --gtest_filter={gtest_filter} passes", r["returncode"] == 0 and passed and not failed,
             f"{r['status']}; " + "; ".join(failed[:5]))
    r["tests"] = sorted(set(ran))
    return out, r


def s10(sc):
    out, r = run_gtest(sc, "Errors.BuffersAreBroadcastAndChecked", False)
    sc.notes.append("not a runtime fault: covered by ctest Errors.BuffersAreBroadcastAndChecked; tests run: " +
                    ", ".join(l for l in out if l.startswith(("[       OK ]", "[  FAILED  ]"))))


def s11(sc):
    out, r = run_gtest(sc, "Faults.RankSkipping*:Faults.GradientSyncDiffering*:Faults.SkippedUnit*", True)
    # The outer binary prints "[ RUN      ] Faults.X", then each rank's log under "===== rank R of N: ... =====".
    errors, test, rank, in_err = [], None, None, False
    for line in out:
        m = re.match(r"\[ RUN      \] (\S+)", line)
        if m and rank is None:
            test = m.group(1)
        m = re.match(r"===== rank (\d+) of (\d+): (.*) =====", line)
        if m:
            rank, in_err = int(m.group(1)), False
            continue
        m = re.match(r"\[\s+(OK|FAILED)\s+\] (\S+)", line)
        if m and m.group(2) == test:  # a rank's own verdict, or the test's: that rank's log has ended
            rank = None
        if line.startswith("error: "):
            errors.append({"test": test, "rank": rank, "lines": [line]})
            in_err = True
        elif in_err and line.startswith("  ") and errors:
            errors[-1]["lines"].append(line)
        else:
            in_err = False
    r["error_lines"] = errors
    for t in r["tests"]:
        n = sum(1 for e in errors if e["test"] == t)
        sc.notes.append(f"{t}: {n} 'error:' line(s) printed" + ("" if n else " (this test prints none; it only "
                                                                               "asserts on the message)"))


def s12(sc):
    if not os.path.exists(TORCHRUN):
        sc.check(f"torchrun exists at {TORCHRUN}", False)
        return
    cmd = [TORCHRUN, "--standalone", "--no-python", "--nproc-per-node", "2", TRAIN_GPT] + SMALL + LONG + \
        ["--timeout", "30"]
    launcher = sc.start("torchrun", cmd, base_env())
    if not launcher.wait_step(STEPS_BEFORE_FAULT, sc.until(START_LIMIT)):
        sc.check("training under way under torchrun", False, "\n".join(l for _, l in launcher.err[-15:]))
        return
    table = proc_table()
    ranks = [p for p, (pp, st) in table.items() if pp == launcher.pid and st not in ("Z", "X")]
    with sc.lock:
        sc.pids.extend(ranks)
    rank_of = {p: int(environ_of(p).get("RANK", "-1")) for p in ranks}
    if not sc.check("torchrun started 2 ranks", len(ranks) == 2, f"children {ranks}"):
        return
    step = launcher.max_step
    t_fault = now()
    os.kill(launcher.pid, signal.SIGKILL)
    sc.fault = f"SIGKILL to torchrun (pid {launcher.pid}) after rank 0 printed step {step}"
    launcher.wait_exit(sc.until(10))
    bound = 5.0
    results = {}
    for pid in ranks:
        results[pid] = reap(pid, min(sc.deadline - 5, t_fault + bound + 10))
    for pid in sorted(ranks, key=lambda p: rank_of[p]):
        t_exit, rc = results[pid]
        if t_exit is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reap(pid, now() + 5)
        r = {"rank": rank_of[pid], "label": f"rank {rank_of[pid]}", "role": "rank under torchrun", "pid": pid,
             "measured": True, "fault_to_exit_s": None if t_exit is None else round(t_exit - t_fault, 3),
             "fault_to_message_s": None, "message_to_exit_s": None, "returncode": rc,
             "status": ("exited (status unknown: not this script's child)" if rc is None and t_exit is not None
                        else status_text(rc) if t_exit is not None else "still running (SIGKILLed by this script)"),
             "message": message_lines(launcher.err, rank_of[pid]), "command": shlex.join(cmd)}
        sc.rows.append(r)
        sc.check(f"rank {rank_of[pid]} exits within {bound:g} s of torchrun's death",
                 t_exit is not None and t_exit - t_fault <= bound, f"{r['status']} after {fmt_s(r['fault_to_exit_s'])}")
    lr = sc.row(launcher, t_fault, "launcher (SIGKILLed)", measured=False, rank="torchrun")
    lr["message"] = [l for l in lr["message"] if not l.startswith("train_gpt (rank ")][-5:]
    sc.notes.append("the ranks' parent-death signal (armed by fsdp::init_process_group under torchrun) is SIGTERM "
                    "by default; this script is a child subreaper, so it adopts the orphaned ranks and reads their "
                    "exit status" if _SUBREAPER else "not a subreaper: the ranks' exit status is not readable")


# ----------------------------------------------------------------------------------------------


def scenario_list():
    T = "--timeout"
    return [
        ("1a", "A peer SIGSTOPped mid-step (2 ranks)",
         f"2 ranks, {T} 10; after rank 0 printed step {STEPS_BEFORE_FAULT}, SIGSTOP rank 1; once rank 0 exited, "
         "SIGKILL rank 1",
         "rank 0 exits 1 within 10 s + 3 s, naming \"Peer rank 1\" and \"stopped answering\"; the stopped rank is "
         "SIGKILLed afterwards", 200, lambda sc: s1(sc, 2, 1, [], False)),
        ("1b", "A peer SIGSTOPped mid-step, hybrid (4 ranks; the issue's \"2b\")",
         f"4 ranks, --strategy hybrid --shard-group-size 2, {T} 10; after step {STEPS_BEFORE_FAULT}, SIGSTOP rank 3",
         "ranks 0, 1, 2 exit 1 within 10 s + 3 s, each message naming its own global rank (\"global rank R of 4\")",
         240, lambda sc: s1(sc, 4, 3, ["--strategy", "hybrid", "--shard-group-size", "2"], True)),
        ("2", "Teardown after a timeout",
         "the survivors of 1a and 1b: time between the error message appearing on stderr and the process's exit",
         "short (at most 1 s): tearing down the process group does not block", 10, None),
        ("3a", "Start-up: MASTER_PORT where nothing listens",
         f"rank 1 of 2 alone, MASTER_PORT a closed port, {T} 5",
         "exits 1 within 1.2 x 5 s, naming the address and port and \"nothing listens\"", 60, s3a),
        ("3b", "Start-up: MASTER_PORT held by a silent listener",
         f"rank 1 of 2, MASTER_PORT a socket this script bound and listens on but never accepts, {T} 5",
         "exits 1 within about 5 s (7 s), naming \"did not answer as a c10d store\"", 60, s3b),
        ("3c", "Start-up: an unresolvable MASTER_ADDR",
         f"rank 1 of 2, MASTER_ADDR=no-such-host.invalid, {T} 5, inside a fresh network namespace with nothing "
         "configured (no DNS query leaves the machine)",
         "exits 1 within about 5 s (7 s), naming the host", 60, s3c),
        ("3d", "Start-up: rank 0 alone of 2",
         f"rank 0 of 2, rank 1 never started, {T} 5",
         "exits 1 within about 5 s (7 s), naming the missing rank 1 (\"missing: 1\")", 60, s3d),
        ("4a", "The timeout without recompiling: FSDP_TIMEOUT",
         "as 3a, FSDP_TIMEOUT=4 in the environment and no --timeout flag",
         "exits 1 within about 4-5 s (5 s), naming \"nothing listens\"", 60, s4a),
        ("4b", "The timeout without recompiling: two hosts, link cut",
         f"two network namespaces joined by a veth pair, rank 0 (hosting the store) in one, rank 1 in the other, "
         f"GLOO_SOCKET_IFNAME the veth of each, {T} 20; after step {STEPS_BEFORE_FAULT} the link is set down",
         "both ranks exit non-zero within 60 s of the cut, each with the library's message", 260, s4b),
        ("5a", "Options differing between ranks: --prefetch",
         "2 ranks, rank 0 --prefetch 1, rank 1 --prefetch 2",
         "every rank exits 1 within seconds (10 s of its start) naming the option (\"prefetch\")", 60, s5a),
        ("5b", "Options differing between ranks: --bucket-mb",
         "2 ranks, --strategy replicate, rank 0 --bucket-mb 1, rank 1 --bucket-mb 2",
         "every rank exits 1 within seconds (10 s of its start) naming the option (\"bucket\")", 60, s5b),
        ("6a", "A peer SIGKILLed mid-step (2 ranks)",
         f"2 ranks, {T} 10; after step {STEPS_BEFORE_FAULT}, SIGKILL rank 1",
         "rank 0 exits 1 within a few seconds (5 s), naming \"Peer rank 1\"", 200, lambda sc: s6(sc, 2, 1, [], False)),
        ("6b", "A peer SIGKILLed mid-step, hybrid (4 ranks)",
         f"4 ranks, --strategy hybrid --shard-group-size 2, {T} 10; after step {STEPS_BEFORE_FAULT}, SIGKILL rank 3",
         "ranks 0, 1, 2 exit 1 within a few seconds (5 s), each message naming its own global rank", 240,
         lambda sc: s6(sc, 4, 3, ["--strategy", "hybrid", "--shard-group-size", "2"], True)),
        ("7", "Bad flags",
         "one process per flag (RANK=0 WORLD_SIZE=1): --n-head 0, --block-size 0, --n-layer -1, --clip -1, "
         "--clip nan, --lr inf, --seed -1, --steps 3x, --data <a directory>, --data /dev/zero, --data <a FIFO>",
         "each exits 2 within 10 s with a message naming the flag or the path (its first line reported)", 200, s7),
        ("8a", "NaN: a diverging run, 1 process",
         "1 process, --lr 1e30 --json --steps 5",
         "exits 1 with a message on stderr; every stdout line is strict JSON (no NaN/Infinity)", 90,
         lambda sc: s8(sc, 1)),
        ("8b", "NaN: a diverging run, 2 ranks",
         "2 ranks, --lr 1e30 --json --steps 5",
         "every rank exits 1 with a message on stderr; every stdout line is strict JSON", 90,
         lambda sc: s8(sc, 2)),
        ("9", "A second job on the same port",
         f"a 2-rank job (long run, {T} 10); after step {STEPS_BEFORE_FAULT}, a third process RANK=1 WORLD_SIZE=2 "
         "on the same MASTER_PORT, then another with FSDP_JOB_ID=other; then the job is stopped (SIGTERM)",
         "each third process exits 1 within seconds (5 s): \"is already taken\", then \"belongs to another job\"; "
         "the first job keeps training (its step lines continue)", 240, s9),
        ("10", "Buffers",
         "not a runtime fault: covered by ctest Errors.BuffersAreBroadcastAndChecked; run "
         "build/tests/fsdp_tests --gtest_filter=Errors.BuffersAreBroadcastAndChecked",
         "the test passes", 300, s10),
        ("11", "One rank on another code path",
         "train_gpt cannot do that; run build/tests/fsdp_tests "
         "--gtest_filter='Faults.RankSkipping*:Faults.GradientSyncDiffering*:Faults.SkippedUnit*' with "
         "FSDP_TEST_SHOW_OUTPUT=1",
         "the tests pass; the 'error:' lines each rank printed are reported", 300, s11),
        ("12", "torchrun SIGKILLed",
         f"torchrun --standalone --no-python --nproc-per-node 2 build/examples/train_gpt (long run, {T} 30); "
         f"after step {STEPS_BEFORE_FAULT}, SIGKILL torchrun",
         "both ranks exit within a few seconds (5 s) of torchrun's death (the parent-death signal)", 200, s12),
    ]


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
    for p in _ALL_PROCS:
        if not p.exited():
            left.append(f"{p.label} pid {p.pid}")
            p.kill_all()
    reap_orphans()
    exes = {os.path.realpath(TRAIN_GPT), os.path.realpath(FSDP_TESTS)}
    mine = {p.pid for p in _ALL_PROCS} | set(_REAPED)
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
    for n in _ALL_NAMESPACES:
        if n in listed:
            left.append(f"network namespace {n}")
            sh("ip", "netns", "del", n, check=False)
    return "; ".join(left)


def other_train_gpts():
    out = []
    exe = os.path.realpath(TRAIN_GPT)
    for pid in proc_table():
        try:
            if os.readlink(f"/proc/{pid}/exe") == exe:
                out.append(pid)
        except OSError:
            pass
    return out


def main():
    global TRAIN_GPT, FSDP_TESTS, TORCHRUN, _SUBREAPER
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="the build directory")
    ap.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"),
                    help="where faults.txt and faults.json are written")
    ap.add_argument("--only", default="", help="comma-separated scenario ids (e.g. 1a,3c,12); default all")
    a = ap.parse_args()
    TRAIN_GPT = os.path.join(a.build, "examples", "train_gpt")
    FSDP_TESTS = os.path.join(a.build, "tests", "fsdp_tests")
    TORCHRUN = a.torchrun
    for path in (TRAIN_GPT, FSDP_TESTS):
        if not os.access(path, os.X_OK):
            sys.exit(f"inject_faults.py: {path} is not built (cmake --build {a.build})")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("inject_faults.py: warning: not root or no `ip`: scenarios 3c and 4b will fail", file=sys.stderr)
    try:  # adopt orphans (the ranks of a SIGKILLed torchrun) to read their exit status
        _SUBREAPER = ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        _SUBREAPER = False

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
        "train_gpt": TRAIN_GPT, "torchrun": TORCHRUN, "subreaper": _SUBREAPER,
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


TRAIN_GPT = FSDP_TESTS = TORCHRUN = None

if __name__ == "__main__":
    main()
