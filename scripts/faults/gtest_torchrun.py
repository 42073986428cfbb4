"""Scenarios 10 to 12 of scripts/inject_faults.py: faults train_gpt alone cannot make, run through another
binary (gtest cases of build/tests/fsdp_tests for 10 and 11; torchrun launching train_gpt for 12).

Standard library only.
"""
import os
import re
import shlex
import signal

from .runner import (CFG, LONG, SMALL, START_LIMIT, STEPS_BEFORE_FAULT, base_env, environ_of, fmt_s,
                     message_lines, now, proc_table, reap, status_text)


def run_gtest(sc, gtest_filter, show_output):
    env = base_env()
    if show_output:
        env["FSDP_TEST_SHOW_OUTPUT"] = "1"
    p = sc.start("fsdp_tests", [CFG.fsdp_tests, f"--gtest_filter={gtest_filter}"], env)
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
    if not os.path.exists(CFG.torchrun):
        sc.check(f"torchrun exists at {CFG.torchrun}", False)
        return
    cmd = [CFG.torchrun, "--standalone", "--no-python", "--nproc-per-node", "2", CFG.train_gpt] + SMALL + LONG + \
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
                    "exit status" if CFG.subreaper else "not a subreaper: the ranks' exit status is not readable")
