#!/usr/bin/env python3
"""Checks fsdp_bench's JSON rows against the issue's criteria.

  python tests/benchmarks/check_fsdp_bench.py --bench build/benchmarks/fsdp_bench [fsdp_bench flags...]
      runs fsdp_bench --json with those flags (a small model for ctest) and checks its rows;
  python tests/benchmarks/check_fsdp_bench.py --rows benchmarks/results/fsdp_bench.json --strict
      checks a committed run of the default model.

Every formula is the row's own (formula_at_step, formula_peak, comm_formula), which fsdp_bench takes
from the library's strategy traits (fsdp/strategy.h). Full sharding at the largest world size: model
state at the step within 5% of 16Ψ/N and an
allocator peak below replicated's at the same world size. Every libtorch-fsdp row: model state at
the step within 5% of its formula, communication per step exactly what the units' padded shapes
give, and with --strict that within 1% of the ZeRO volume (3Ψ full, 2Ψ replicated; a small
model's root, gathered once rather than twice, is too large a part of it for 1%). The state peak: at
least the state at the step; grad-op's at least 4Ψ + 12Ψ/N (the whole model gathered); full
sharding's below grad-op's. PyTorch FSDP2 rows (required with --require-fsdp2): model state
within 1% of 16Ψ/N and an allocator peak counted. With --expect-collective-timeout S: every row's
ranks report the collective timeout S (fsdp_bench --timeout reached each of them).
"""
import argparse
import json
import subprocess
import sys


def fail(msg):
    sys.exit("FAILED: " + msg)


def check_simulated(rows, peak_ratio=None, max_peak_gib=None):
    """Simulated rows (fsdp_bench --simulate): each measured, state at the step within 5% of 16Ψ/N,
    the construction peak below the state at the step (the model was never whole); with
    `peak_ratio`, the state peak at most that times its formula and at least 1/that; with
    `max_peak_gib`, the state peak at most that many GiB."""
    for r in rows:
        if not r["measured"] and r["note"].startswith("formula only: needs"):
            print(f"simulated {r['model']} N={r['world_size']}: not measured, does not fit this machine")
            continue
        if not r["measured"]:
            fail(f"simulated {r['model']} N={r['world_size']} not measured: {r['note']}")
        ratio = r["state_bytes_at_step"] / r["formula_at_step"]
        print(f"simulated {r['model']} N={r['world_size']}: state / {r['formula_at_step_text']} = {ratio:.4f}, "
              f"construction peak {r['construction_peak_bytes']:.0f}, whole model {4 * r['params']}")
        if abs(ratio - 1) > 0.05:
            fail(f"simulated {r['model']} N={r['world_size']}: {r['note']}, state {r['state_bytes_at_step']}")
        if not r["construction_peak_bytes"] < 4 * r["params"]:
            fail("the simulated rank held the whole model while it was built")
        if r.get("device") == "cuda" and not r["host_construction_peak_bytes"] < 4 * r["params"]:
            fail("the host held the whole model on its way to the GPU")
        check_ring_bytes(r)
        peak = r["state_bytes_peak"] / r["formula_peak"]
        print(f"simulated {r['model']} N={r['world_size']}: state peak {r['state_bytes_peak'] / 2**30:.3f} GiB, "
              f"/ ({r['formula_peak_text']}) = {peak:.4f}")
        if peak_ratio is not None and not 1 / peak_ratio <= peak <= peak_ratio:
            fail(f"simulated {r['model']} N={r['world_size']}: state peak / formula {peak:.4f} not within {peak_ratio}")
        if max_peak_gib is not None and r["state_bytes_peak"] > max_peak_gib * 2**30:
            fail(f"simulated {r['model']} N={r['world_size']}: state peak above {max_peak_gib} GiB")
    print("OK")


def check_ring_bytes(r):
    """fp32 without hybrid's second level: every collective is over all N ranks in 4-byte elements,
    so a ring sends (N-1)/N of 4 x the elements counted from the shapes (all-reduces counted twice
    there, and sending twice)."""
    if r.get("precision", "fp32") != "fp32" or r["strategy"] in ("hybrid", "diloco") or r["impl"] == "pytorch-fsdp2":
        return
    n = r["world_size"]
    want = 4 * (n - 1) / n * r["comm_expected"]
    if abs(r["comm_send_bytes"] - want) > 1e-9 * max(want, 1) or r["comm_recv_bytes"] != r["comm_send_bytes"]:
        fail(f"{r['impl']} {r['strategy']} N={n}: {r['comm_send_bytes']} bytes sent and {r['comm_recv_bytes']} "
             f"received per step, the shapes give {want:.0f}")


def check_collective_timeout(rows, seconds):
    """Each row's ranks (the largest value over them) report the collective timeout they were given."""
    for r in rows:
        got = r.get("collective_timeout_s")
        print(f"{r['impl']} {r['strategy']} N={r['world_size']}: collective timeout {got} s")
        if got is None or abs(got - seconds) > 1e-3:
            fail(f"{r['impl']} {r['strategy']} N={r['world_size']}: the ranks' collective timeout is {got} s, "
                 f"not the {seconds} s given to fsdp_bench --timeout")


def check(rows, strict, require_fsdp2, peak_ratio=None, max_peak_gib=None):
    if rows and all(r["impl"] == "simulated" for r in rows):
        return check_simulated(rows, peak_ratio, max_peak_gib)
    ours = {(r["strategy"], r["world_size"]): r for r in rows if r["impl"] == "libtorch-fsdp"}
    if not ours:
        fail("no libtorch-fsdp rows")
    n = max(w for s, w in ours if s == "full")
    full, rep = ours[("full", n)], ours.get(("replicate", n))
    # Every formula is the row's own, from the library's strategy traits (fsdp/strategy.h).
    ratio = full["state_bytes_at_step"] / full["formula_at_step"]
    print(f"full N={n}: state_bytes_at_step / ({full['formula_at_step_text']}) = {ratio:.4f}")
    if abs(ratio - 1) > 0.05:
        fail(f"full sharding at {n} ranks holds {full['state_bytes_at_step']} bytes, not within 5% of "
             f"{full['formula_at_step_text']}")
    if rep is not None:
        print(f"full N={n}: peak_bytes {full['peak_bytes']:.0f} vs replicate {rep['peak_bytes']:.0f}")
        if not full["peak_bytes"] < rep["peak_bytes"]:
            fail("full sharding's peak is not below replicated's")
    for (s, w), r in sorted(ours.items()):
        check_ring_bytes(r)
        if r["comm_elements"] != r["comm_expected"]:
            fail(f"{s} N={w}: {r['comm_elements']} elements sent, the units' shapes give {r['comm_expected']}")
        want = r["comm_formula"]
        rel = abs(r["comm_elements"] - want) / want
        print(f"{s:<9} N={w}: comm_elements {r['comm_elements']:.0f} = expected from shapes; vs ZeRO volume {rel:.4%}")
        if strict and rel > 0.01:
            fail(f"{s} N={w}: communication {r['comm_elements']} is {rel:.2%} off the ZeRO volume {want}")
        if r["formula_at_step"] and abs(r["state_bytes_at_step"] / r["formula_at_step"] - 1) > 0.05:
            fail(f"{s} N={w}: model state at the step {r['state_bytes_at_step']} vs formula {r['formula_at_step']}")
    for (s, w), r in sorted(ours.items()):
        if r["state_bytes_peak"] < r["state_bytes_at_step"]:
            fail(f"{s} N={w}: state peak {r['state_bytes_peak']} below the state at the step")
        # grad-op keeps every parameter gathered (param_dtype) from forward to the end of backward.
        gathered = (4 if r.get("precision", "fp32") == "fp32" else 2) * r["params"] + 12 * r["params"] / w
        if s == "grad-op" and w > 1 and r["state_bytes_peak"] < gathered:
            fail(f"grad-op N={w}: state peak {r['state_bytes_peak']} misses the gathered model ({gathered:.0f})")
        # With sharded gradients the peak formula counts what backward can hold at once (the root's
        # gradients in full): the measured peak stays within it.
        if s in ("full", "grad-op", "hybrid", "diloco") and r["state_bytes_peak"] > 1.01 * r["formula_peak"]:
            fail(f"{s} N={w}: state peak {r['state_bytes_peak']} above its formula {r['formula_peak_text']} "
                 f"= {r['formula_peak']:.0f}")
        if s == "full" and ("grad-op", w) in ours and w > 1:
            if not r["state_bytes_peak"] < ours[("grad-op", w)]["state_bytes_peak"]:
                fail(f"full N={w}: state peak not below grad-op's")
    # DiLoCo's row: hybrid's state plus the outer state, fp32 global shards and outer momentum (8Ψ/S).
    for (s, w), r in sorted(ours.items()):
        if s != "diloco":
            continue
        outer = 8 * r["params"] / r["shard_group_size"]
        if ("hybrid", w) in ours:
            extra = r["state_bytes_at_step"] - ours[("hybrid", w)]["state_bytes_at_step"]
            print(f"diloco N={w}: state at the step {r['formula_at_step_text']}; above hybrid's by "
                  f"{extra:.0f} = {extra / outer:.4f} x 8Ψ/S")
            if abs(extra / outer - 1) > 0.05:
                fail(f"diloco N={w}: the outer state is {extra:.0f} bytes, not within 5% of 8Ψ/S = {outer:.0f}")
    fsdp2 = [r for r in rows if r["impl"] == "pytorch-fsdp2"]
    if require_fsdp2 and not fsdp2:
        fail("no PyTorch FSDP2 rows")
    for r in fsdp2:
        rel = r["state_bytes_at_step"] / r["formula_at_step"]
        print(f"FSDP2 N={r['world_size']}: state_bytes_at_step / ({r['formula_at_step_text']}) = {rel:.4f}")
        if abs(rel - 1) > 0.01 or r["peak_bytes"] is None or r["peak_bytes"] <= 0:
            fail(f"FSDP2 N={r['world_size']}: state {r['state_bytes_at_step']}, allocator peak {r['peak_bytes']}")
    print("OK")


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)  # the rest goes to fsdp_bench as given
    ap.add_argument("--bench")
    ap.add_argument("--rows")
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--require-fsdp2", action="store_true")
    ap.add_argument("--expect-collective-timeout", type=float)
    ap.add_argument("--peak-ratio", type=float, help="simulated rows: state peak / formula within this ratio")
    ap.add_argument("--max-state-peak-gib", type=float, help="simulated rows: state peak at most this")
    a, rest = ap.parse_known_args()
    if a.rows:
        with open(a.rows) as f:
            rows = json.load(f)
    else:
        # Below ctest's 600 s, above the runs' own --run-timeout, so the innermost deadline reports first.
        p = subprocess.run([a.bench, "--json"] + rest, capture_output=True, text=True, timeout=540)
        sys.stderr.write(p.stderr)
        if p.returncode != 0:
            fail(f"fsdp_bench exited {p.returncode}\n{p.stdout}")
        rows = json.loads(p.stdout)
    if a.expect_collective_timeout is not None:
        check_collective_timeout(rows, a.expect_collective_timeout)
    check(rows, a.strict, a.require_fsdp2, a.peak_ratio, a.max_state_peak_gib)


if __name__ == "__main__":
    main()
