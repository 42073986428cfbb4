"""The scenarios of scripts/inject_faults.py, 1 to 9 (faults injected into runs of train_gpt that this
script starts rank by rank), and the list of all of them (10 to 12 are in gtest_torchrun.py).

Each scenario function takes its Scenario, starts what it needs through it, injects the fault, and records
a row per rank and the checks of the expectation; the Scenario removes whatever was started.

Standard library only.
"""
import json
import os
import signal
import tempfile
import time

from .gtest_torchrun import s10, s11, s12
from .runner import (LONG, SMALL, START_LIMIT, STEPS_BEFORE_FAULT, connect_namespaces, fmt_s, free_port, listening_socket,
                     message_lines, now, sh)


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
    s = listening_socket()  # never accepted: the kernel completes the handshake, nobody answers
    sc.sockets.append(s)
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
    connect_namespaces(ns, veth, addr)
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
