"""Running the example programs (examples/train_gpt, train_llama) from Python, alone or under
torchrun, and reading what they print: the one module the tests (tests/check_*.py), the fault
scripts (scripts/faults) and the Python benchmarks (benchmarks/*.py) share.

- free_port(), listening_socket(): the one place a Python script binds port 0 on 127.0.0.1.
- command(), run(): one process or `torchrun --standalone --no-python`, its --json rows.
- Agent, torchrun_cmd(), agent_env(), breakdown(): elastic runs under torchrun's agent, every
  line of every agent's stdout and stderr timestamped on arrival (time.time(), the clock of
  train_gpt's "start" row), so that a kill, torchrun's log (LOGLEVEL=INFO) and train_gpt's rows
  are on one time line.

Import it by its folder, computed from the importing script's own location:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "programs"))
    from torchrun_runs import command, run
Standard library only.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port():
    """A port the kernel just handed out on 127.0.0.1 and released (bind to port 0): free for a
    store to bind, or for a test of a port where nothing listens."""
    with listening_socket(listen=False) as s:
        return s.getsockname()[1]


def listening_socket(listen=True, backlog=16):
    """A socket bound to a free port of 127.0.0.1 (listening, with `listen`): the caller closes it."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        if listen:
            s.listen(backlog)
    except OSError:
        s.close()
        raise
    return s


# The strategies train_gpt takes (--strategy); their formulas come from train_gpt's summary row
# (formula_state_bytes, formula_text), computed from the library's strategy traits (fsdp/strategy.h).
STRATEGIES = ("full", "grad-op", "optimizer", "replicate", "hybrid")


def command(train_gpt, torchrun, ranks, args):
    """train_gpt alone for one rank, under `torchrun --no-python` for more."""
    if ranks == 1:
        return [train_gpt] + list(args)
    # --standalone: a free port per run, so that runs in parallel (ctest -j) do not collide.
    return [torchrun, "--standalone", "--no-python", "--nproc-per-node", str(ranks), train_gpt] + list(args)


def run(cmd, timeout=None, extra_env=None, stderr_out=None):
    """Runs train_gpt with --json (one intra-op thread per rank, as torchrun sets); returns the
    per-step rows and the summary row. Exits with the output on failure. `extra_env`: more
    variables for the run; `stderr_out`: a list that gets the run's stderr appended."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        sys.exit(f"FAILED: {' '.join(cmd)} did not finish in {timeout} s\n{e.stdout}\n{e.stderr}")
    if p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    if stderr_out is not None:
        stderr_out.append(p.stderr)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    steps = [r for r in rows if "step" in r]
    summary = next((r for r in rows if r.get("summary")), None)
    if not steps or summary is None:
        sys.exit(f"FAILED: no JSON rows from {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return steps, summary


def children(pid):
    """The pids whose parent is `pid` (torchrun's workers are its agent's children)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
            if int(s[s.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(d))
        except (OSError, ValueError):
            pass
    return out


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


class Agent:
    """One torchrun agent (its own process group), its output captured line by line with times."""

    def __init__(self, name, cmd, env):
        self.name = name
        self.cmd = cmd
        self.events = []  # (time, stream, line)
        self.lock = threading.Lock()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                  start_new_session=True)
        self.threads = [threading.Thread(target=self._read, args=(s, k), daemon=True)
                        for s, k in ((self.p.stdout, "out"), (self.p.stderr, "err"))]
        for t in self.threads:
            t.start()

    def _read(self, stream, kind):
        for line in iter(stream.readline, b""):
            with self.lock:
                self.events.append((time.time(), kind, line.decode(errors="replace").rstrip("\n")))

    def lines(self, kind=None):
        with self.lock:
            return [e for e in self.events if kind is None or e[1] == kind]

    def rows(self):
        """train_gpt's JSON rows (stdout), each with its arrival time as "_t"."""
        out = []
        for t, _, line in self.lines("out"):
            if line.startswith("{"):
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                r["_t"] = t
                out.append(r)
        return out

    def last_step(self):
        steps = [r["step"] for r in self.rows() if "step" in r]
        return steps[-1] if steps else -1

    def workers(self):
        """{rank: pid} of this agent's live workers."""
        return {r: c for c in children(self.p.pid) for r in [rank_of(c)] if r is not None}

    def kill_worker(self, rank):
        pid = self.workers()[rank]
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t

    def kill(self):
        t = time.time()
        os.killpg(self.p.pid, signal.SIGKILL)  # the agent; its workers get SIGTERM (parent death)
        return t

    def wait(self, timeout):
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
            return None
        finally:
            for t in self.threads:
                t.join(2)

    def log(self):
        return "\n".join(f"{t:.3f} {k} {s}" for t, k, s in self.lines())


def torchrun_cmd(torchrun, train_gpt, args, nproc, nnodes="1", rdzv=None, max_restarts=1, monitor=0.1,
                 rdzv_conf=None):
    """torchrun for train_gpt: --standalone, or the c10d rendezvous at `rdzv` (host:port) with
    --nnodes `nnodes` and the rendezvous settings `rdzv_conf`."""
    cmd = [torchrun]
    if rdzv is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "elastic-test", "--nnodes", nnodes]
        if rdzv_conf:
            cmd += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in rdzv_conf.items())]
    return cmd + ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                  "--monitor-interval", str(monitor), "--no-python", train_gpt] + list(args)


def agent_env():
    # torch 2.11: a node joining a later rendezvous round waits for a MASTER_ADDR that the cached
    # shared store never republishes (dynamic_rendezvous.next_rendezvous); one store per round avoids it.
    return dict(os.environ, LOGLEVEL="INFO", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def wait_for(pred, timeout, poll=0.01):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(poll)
    return False


def first_after(events, t0, text):
    return next((t for t, _, s in events if t >= t0 and text in s), None)


def breakdown(agent, t_kill):
    """Where the time from the kill to the first step completed after it went, from the agent that
    restarted (its torchrun log and train_gpt's rows), in seconds:
    detection      kill -> the agent sees a worker fail (its monitor, --monitor-interval)
    stop           -> the agent has stopped the other workers and starts the rendezvous
    rendezvous     -> the rendezvous completes (torchrun's first-round delay, last_call_timeout)
    process_start  -> the last rank's train_gpt main() (the processes started, the libraries loaded)
    group          -> rank 0's process group (store, claims, Gloo), from the last rank's start
    load           -> ready to train: model built, checkpoint loaded
    first_step     -> the first step after the restart done (steps redone come after it)
    """
    ev = agent.lines()
    seen = [t for t in (first_after(ev, t_kill, w) for w in ("closing signal", "failed (exitcode", "FAILED"))
            if t is not None]
    failed = min(seen) if seen else None
    rdzv_start = first_after(ev, t_kill, "Rendezvous'ing worker group")
    rdzv_done = first_after(ev, rdzv_start or t_kill, "Rendezvous complete")
    start = next((r for r in agent.rows() if r.get("start") and r["t_main"] >= t_kill), None)
    if None in (failed, rdzv_start, rdzv_done, start):
        return None
    step = next((r for r in agent.rows() if "step" in r and r["_t"] > start["t_ready"]), None)
    if step is None:
        return None
    last_main = start.get("t_main_last", start["t_main"])
    marks = [("detection", failed), ("stop", rdzv_start), ("rendezvous", rdzv_done), ("process_start", last_main),
             ("group", start["t_group"]), ("load", start["t_ready"]), ("first_step", step["_t"])]
    out, prev = {}, t_kill
    for name, t in marks:
        out[name] = t - prev
        prev = t
    out["total"] = step["_t"] - t_kill
    # Steps done before the kill and done again after it (from the last committed checkpoint), and
    # when the run was back where it was.
    before = [r["step"] for r in agent.rows() if "step" in r and r["_t"] <= t_kill]
    last = max(before) if before else start["first_step"] - 1
    out["steps_redone"] = max(0, last + 1 - start["first_step"])
    back = next((r for r in agent.rows() if "step" in r and r["_t"] > t_kill and r["step"] == last), None)
    out["caught_up"] = (back["_t"] - t_kill) if back and out["steps_redone"] > 0 else out["total"]
    out["world_size_after"] = start["world_size"]
    out["resumed_at_step"] = start["first_step"]
    return out


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path
