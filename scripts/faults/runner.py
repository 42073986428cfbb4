"""Running processes for scripts/inject_faults.py: each in its own session with the torchrun-style
environment, their output read line by line with arrival times, the Scenario that owns (and, however it
ends, removes) whatever it started, reaping of adopted orphans, and splitting a rank's stderr into the
library's message and the rest.

Standard library only (and programs/torchrun_runs.py, for the free port).
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "programs"))
from torchrun_runs import free_port, listening_socket  # noqa: E402,F401 (the one port finder; scenarios use them)
SMALL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]
LONG = ["--steps", "1000000"]
STEPS_BEFORE_FAULT = 3  # rank 0 must have printed `step 3` (training under way) before a mid-run fault
START_LIMIT = 120.0  # seconds for a job to reach that step (4 ranks on 2 cores start slowly)


class Config:
    """What main() sets before any scenario runs: the binaries' paths, and whether this script is a
    child subreaper."""
    train_gpt = None
    fsdp_tests = None
    torchrun = None
    subreaper = False


CFG = Config()

now = time.monotonic
_STEP_RE = re.compile(r'^(?:step\s+(\d+)\s*\||\{"step": ?(\d+),)')
ALL_PROCS = []  # every Proc this script started (for the final sweep)
ALL_NAMESPACES = []


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


def children(pid):
    """Direct children of `pid`."""
    return [p for p, (pp, _) in proc_table().items() if pp == pid]


def connect_namespaces(ns, veth, addr):
    """Two network namespaces `ns` (created already) as two hosts: loopback up in each, and a veth
    pair, veth[i] in ns[i] with address addr[i]/24, up."""
    for n in ns:
        sh("ip", "-n", n, "link", "set", "lo", "up")
    sh("ip", "link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1], "netns", ns[1])
    for i in range(2):
        sh("ip", "-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", veth[i])
        sh("ip", "-n", ns[i], "link", "set", veth[i], "up")


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
        ALL_PROCS.append(self)
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
        cmd = [CFG.train_gpt] + list(args)
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        env = rank_env(rank, world, port, addr, **env_extra)
        return self.start(label or f"rank {rank}", cmd, env, rank)

    def add_netns(self, name):
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        ALL_NAMESPACES.append(name)
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


REAPED = {}


def reap(pid, deadline):
    """Waits for an adopted child `pid` (this script is a child subreaper) until `deadline`; returns
    (exit time or None, returncode as Popen writes it, or None)."""
    if pid in REAPED:
        return REAPED[pid]
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (no subreaper): watch /proc instead
            if not alive(pid):
                REAPED[pid] = (now(), None)
                return REAPED[pid]
            got = 0
        if got == pid:
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            REAPED[pid] = (now(), rc)
            return REAPED[pid]
        if now() >= deadline:
            return (None, None)
        time.sleep(0.01)


def reap_orphans():
    """Children this script adopted as subreaper and knows nothing of: killed and reaped."""
    me = os.getpid()
    known = {p.pid for p in ALL_PROCS}
    for pid, (ppid, state) in proc_table().items():
        if ppid != me or pid in known or pid in REAPED:
            continue
        if state not in ("Z", "X"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap(pid, now() + 5)
