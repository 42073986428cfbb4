#!/usr/bin/env python3
"""Elastic runs of train_gpt under torchrun's own agent, with the library's checkpoints and sampler.

1. worker: one torchrun (2 workers, --max-restarts 1); a worker SIGKILLed after step K. One
   restart must be enough: the job ends with exit 0 after exactly one restart. worker-async: the
   same with a save every step in the background (--async-save): the resume starts at the newest
   checkpoint committed before the kill or a later one (the rows' committed_step), never an older
   one. (How many steps a save every step loses, with a machine's load: benchmarks/checkpoint/save_every_step.py.)
2. scale-down: two agents (--nnodes 1:2, c10d rendezvous, one worker each); the agent not hosting
   the rendezvous SIGKILLed after step K (its worker dies with it). The survivor's worker must exit
   promptly (its peer is gone), and the survivor continue alone at world size 1.
3. scale-up: one agent (--nnodes 1:2) trains alone at world size 1; a second agent joins after
   step K; torchrun restarts the workers at world size 2 and the run continues.

In each, train_gpt saves every --save-every steps and resumes from the latest checkpoint; every
step logged (the first time and when redone) must give the uninterrupted run's loss (1e-5
relative: another world size changes only the order of sums) and its samples_consumed, every step
up to --steps must be logged, and the run must end with exit 0. --repeat N runs case 1 N times and
--json-out writes every run's recovery breakdown (benchmarks/checkpoint/elastic_bench.py reports them).
"""
import argparse
import json
import os
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "programs"))
from torchrun_runs import Agent, agent_env, breakdown, free_port, torchrun_cmd, wait_for  # noqa: E402

# A small model: steps of tens of milliseconds, so that a kill lands mid-run.
MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "12",
         "--seed", "1", "--json", "--timeout", "20"]
RDZV = {"last_call_timeout": 1, "join_timeout": 30, "close_timeout": 5, "keep_alive_interval": 1,
        "keep_alive_max_attempt": 5}


class Failed(Exception):
    pass


def check_rows(rows, reference, steps, what):
    """Every step logged matches the uninterrupted run; every step up to `steps` logged."""
    ref = {r["step"]: r for r in reference}
    worst, seen = 0.0, {}
    for r in rows:
        s = r["step"]
        want = ref[s]
        rel = abs(r["loss"] - want["loss"]) / abs(want["loss"])
        worst = max(worst, rel)
        if rel > 1e-5:
            raise Failed(f"{what}: step {s} loss {r['loss']} vs {want['loss']} uninterrupted (rel {rel:.2e})")
        if r["samples_consumed"] != want["samples_consumed"] or r["epoch"] != want["epoch"]:
            raise Failed(f"{what}: step {s} samples_consumed {r['samples_consumed']} epoch {r['epoch']} vs "
                         f"{want['samples_consumed']} {want['epoch']} uninterrupted")
        seen[s] = seen.get(s, 0) + 1
    missing = [s for s in range(steps) if s not in seen]
    if missing:
        raise Failed(f"{what}: steps {missing} never logged")
    return worst, sum(1 for n in seen.values() if n > 1)


def restarts(agent):
    return sum(1 for _, _, s in agent.lines("err") if "Rendezvous complete for workers" in s) - 1


def reference_rows(a, d, ranks, steps):
    ag = Agent("reference", torchrun_cmd(a.torchrun, a.train_gpt, MODEL + ["--steps", str(steps)], ranks,
                                         max_restarts=0), agent_env())
    if ag.wait(a.timeout) != 0:
        raise Failed(f"the uninterrupted run at {ranks} rank(s) failed:\n{ag.log()[-4000:]}")
    return [r for r in ag.rows() if "step" in r]


def case_worker(a, d, reference, run=0, every_step=False):
    ck = os.path.join(d, f"worker-{run}{'-async' if every_step else ''}")
    saving = ["--save-every", "1", "--async-save", "--keep-last", "2"] if every_step else \
        ["--save-every", str(a.save_every)]
    args = MODEL + ["--steps", str(a.steps), "--save-dir", ck, "--resume"] + saving
    ag = Agent("agent", torchrun_cmd(a.torchrun, a.train_gpt, args, 2, max_restarts=1), agent_env())
    try:
        if not wait_for(lambda: ag.last_step() >= a.kill_step, a.timeout):
            raise Failed(f"case 1: step {a.kill_step} never logged:\n{ag.log()[-4000:]}")
        victim = run % 2  # rank 1, then rank 0 (which prints the rows and saves the manifest)
        try:
            t_kill = ag.kill_worker(victim)
        except (KeyError, ProcessLookupError):
            raise Failed(f"case 1 (run {run}): rank {victim}'s worker was gone before the kill (the run ended?)")
        rc = ag.wait(a.timeout)
        if rc != 0:
            raise Failed(f"case 1 (run {run}): torchrun exited {rc} after rank {victim} was killed:\n{ag.log()[-6000:]}")
        n = restarts(ag)
        if n != 1:
            raise Failed(f"case 1 (run {run}): {n} restarts, not 1:\n{ag.log()[-6000:]}")
        worst, twice = check_rows([r for r in ag.rows() if "step" in r], reference, a.steps, f"case 1 run {run}")
        b = breakdown(ag, t_kill)
        if b is None:
            raise Failed(f"case 1 (run {run}): no recovery time line in the log:\n{ag.log()[-6000:]}")
        if every_step:
            before = [r for r in ag.rows() if "step" in r and r["_t"] <= t_kill]
            committed = before[-1]["committed_step"] if before else 0
            if committed < 1:
                raise Failed(f"case 1 with a save every step: no save committed by step {before[-1]['step']}")
            if b["resumed_at_step"] < committed:
                raise Failed(f"case 1 with a save every step: resumed at step {b['resumed_at_step']}, before the "
                             f"checkpoint of step {committed} committed before the kill")
        b.update(case="worker-async" if every_step else "worker", run=run, killed_rank=victim, restarts=n,
                 worst_rel=worst, steps_logged_twice=twice)
        return b
    finally:
        if ag.p.poll() is None:
            ag.kill()


def two_agents(a, ck, steps):
    port = free_port()
    args = MODEL + ["--steps", str(steps), "--save-dir", ck, "--save-every", str(a.save_every), "--resume"]
    conf = dict(RDZV, is_host="true")
    host = Agent("host", torchrun_cmd(a.torchrun, a.train_gpt, args, 1, "1:2", f"127.0.0.1:{port}", 1,
                                      rdzv_conf=conf), agent_env())
    return host, port, args


def case_scale_down(a, d, reference):
    ck = os.path.join(d, "down")
    host, port, args = two_agents(a, ck, a.steps)
    other = None
    try:
        time.sleep(0.5)  # the host binds the rendezvous store first
        other = Agent("other", torchrun_cmd(a.torchrun, a.train_gpt, args, 1, "1:2", f"127.0.0.1:{port}", 1,
                                            rdzv_conf=dict(RDZV, is_host="false")), agent_env())
        # Both agents in the job (on a loaded machine the second may join a round later, through a
        # membership change), then step K logged at world size 2. The rows come from rank 0's
        # worker, on either agent.
        def at_two():
            for ag in (host, other):
                starts = [r for r in ag.rows() if r.get("start")]
                if starts and starts[-1]["world_size"] == 2 and ag.last_step() >= a.kill_step and \
                        any("step" in r and r["_t"] > starts[-1]["t_ready"] for r in ag.rows()):
                    return ag
            return None
        if not wait_for(lambda: at_two() is not None, a.timeout):
            raise Failed(f"case 2: step {a.kill_step} never logged at world size 2:\n{host.log()[-3000:]}\n"
                         f"{other.log()[-3000:]}")
        rank0 = at_two()
        t_kill = other.kill()
        rc = host.wait(a.timeout)
        if rc != 0:
            raise Failed(f"case 2: the surviving agent exited {rc}:\n{host.log()[-6000:]}")
        rows = [r for r in (host.rows() + (other.rows() if rank0 is other else [])) if "step" in r]
        worst, twice = check_rows(sorted(rows, key=lambda r: r["_t"]), reference, a.steps, "case 2")
        after = [r for r in host.rows() if r.get("start") and r["t_main"] >= t_kill]
        if not after or after[0]["world_size"] != 1:
            raise Failed(f"case 2: the survivor did not continue at world size 1: {after}\n{host.log()[-6000:]}")
        # The survivor's worker noticed its dead peer and exited: how long after the kill.
        failed = [t for t, _, s in host.lines("err") if t >= t_kill and ("failed (exitcode" in s or "FAILED" in s)]
        b = breakdown(host, t_kill) or {}
        b.update(case="scale-down", restarts=restarts(host), worst_rel=worst, steps_logged_twice=twice,
                 survivor_worker_failed_after=(failed[0] - t_kill) if failed else None)
        return b
    finally:
        for ag in (host, other):
            if ag is not None and ag.p.poll() is None:
                ag.kill()


def case_scale_up(a, d, reference):
    ck = os.path.join(d, "up")
    # Long enough at one rank for the second agent to start (about 2 s) and join.
    host, port, args = two_agents(a, ck, a.up_steps)
    other = None
    try:
        if not wait_for(lambda: host.last_step() >= a.kill_step, a.timeout):
            raise Failed(f"case 3: step {a.kill_step} never logged:\n{host.log()[-4000:]}")
        first_world = [r for r in host.rows() if r.get("start")][0]["world_size"]
        if first_world != 1:
            raise Failed(f"case 3: the job started at world size {first_world}, not 1")
        t_join = time.time()
        other = Agent("other", torchrun_cmd(a.torchrun, a.train_gpt, args, 1, "1:2", f"127.0.0.1:{port}", 1,
                                            rdzv_conf=dict(RDZV, is_host="false")), agent_env())
        rc = host.wait(a.timeout)
        rc_other = other.wait(a.timeout)
        if rc != 0 or rc_other != 0:
            raise Failed(f"case 3: the agents exited {rc} and {rc_other}:\n{host.log()[-4000:]}\n{other.log()[-4000:]}")
        after = [r for r in host.rows() + other.rows() if r.get("start") and r["t_main"] >= t_join]
        if not after or after[0]["world_size"] != 2:
            raise Failed(f"case 3: no restart at world size 2 after the join: {after}\n{host.log()[-4000:]}")
        rows = sorted([r for r in host.rows() + other.rows() if "step" in r], key=lambda r: r["_t"])
        worst, twice = check_rows(rows, reference, a.up_steps, "case 3")
        first_at_2 = next((r["_t"] for r in rows if r["_t"] > after[0]["t_ready"]), None)
        if first_at_2 is None:
            raise Failed(f"case 3: no step logged at world size 2:\n{host.log()[-4000:]}")
        return dict(case="scale-up", worst_rel=worst, steps_logged_twice=twice, restarts=restarts(host),
                    join_to_first_step_at_2=first_at_2 - t_join)
    finally:
        for ag in (host, other):
            if ag is not None and ag.p.poll() is None:
                ag.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--cases", default="worker,worker-async,scale-down,scale-up")
    ap.add_argument("--repeat", type=int, default=1, help="runs of case 1")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--up-steps", type=int, default=1000, help="case 3's steps")
    ap.add_argument("--kill-step", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    cases = a.cases.split(",")
    results, failures = [], []
    with tempfile.TemporaryDirectory(prefix="fsdp-elastic-") as d:
        try:
            ref2 = reference_rows(a, d, 2, a.steps)
            ref1 = reference_rows(a, d, 1, a.up_steps) if "scale-up" in cases else None
        except Failed as e:
            sys.exit(f"FAILED: {e}")
        for case in cases:
            for run in range(a.repeat if case == "worker" else 1):
                try:
                    if case == "worker":
                        r = case_worker(a, d, ref2, run)
                    elif case == "worker-async":
                        r = case_worker(a, d, ref2, 1, every_step=True)
                    elif case == "scale-down":
                        r = case_scale_down(a, d, ref2)
                    else:
                        r = case_scale_up(a, d, ref1)
                    results.append(r)
                    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
                          flush=True)
                except Failed as e:
                    failures.append(str(e))
                    print(f"FAILED: {e}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"results": results, "failures": failures}, f, indent=1)
    if failures:
        sys.exit(f"FAILED: {len(failures)} of {len(results) + len(failures)} runs")
    print(f"OK: {len(results)} runs")


if __name__ == "__main__":
    main()
