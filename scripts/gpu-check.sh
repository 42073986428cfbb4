#!/usr/bin/env bash
# The GPU check (docs/usage.md, "Running on GPUs"): one call on a machine with a CUDA device runs
# every GPU measurement the project needs and writes one JSON summary; without a device it runs the
# same programs on the CPU at small sizes and marks the GPU parts skipped, so that CI keeps it working.
#
#   scripts/gpu-check.sh [--build DIR] [--out DIR] [--quick] [--rounds N] [--only PART,PART,...]
#
# Uses the binaries of an existing build (default build/, from scripts/build.sh; built against the
# same torch 2.11.0 wheel as the GPU machine's python3), so the GPU machine needs no compiler, no
# GoogleTest, no fmt: carry build/tests/fsdp_tests, build/benchmarks/{overhead,fsdp}_bench, for the
# examples_gpu part build/examples/train_gpt and build/examples/train_llama, and the five
# libraries' .so files, stripped, in the same layout under a folder passed as --build: 9 MB,
# which scripts/gpu-carry.sh makes (build-gpu/).
# The torch libraries come from the python3 given by $PYTHON (default: the project's virtualenv
# when it exists, else python3). Writes OUT/gpu-check.json (default OUT: $OUT or /tmp/gpu-check)
# and each part's raw output beside it. Exit status 0 when every part that ran passed.
#
# Parts (each bounded by `timeout`, all of them in about 5 minutes on one H200):
#   1 cuda_tests      Cuda.* at world size 1 over NCCL: parity fp32 and bf16, allocator bytes, async save,
#                     collectives on the side streams and on NCCL's stream, CPU offload against none
#   2 overhead        a 406M-parameter GPT, wrapped vs plain LibTorch, fp32 and bf16 (ratio, MFU)
#   3 prefetch        the same in bf16 with prefetch 0 and 1 (step time ratio)
#   3b checkpointed   the same in bf16 with every block's activations checkpointed (peak and step
#                     time against overhead_bf16, where nothing is checkpointed)
#   4 simulated       rank 0 of 8, 64 and 1024 of a 7B model over the fake process group on the GPU
#                     (fsdp_bench --simulate --device cuda), against the formulas: the allocator's bytes,
#                     cuBLAS's workspace apart, the rank's step time, bytes sent per step from shapes
#   4b simulated_70b  the same for the 70B at 64 and 1024 ranks (at 8 it does not fit: formula only)
#   5 offload         the same GPT in bf16 with CPUOffloadPolicy and FusedAdamW on the CPU: step time
#                     against plain LibTorch on the GPU, device bytes between steps, step peak
#   6 cpu_tests       the CPU parity tests of mixed precision and of offload's CPU seam (run everywhere)
#   7 gloo_cuda       several ranks on cuda:0 over Gloo (FSDP_TEST_GLOO_CUDA=1): GlooCuda.* at 2 and 4 ranks,
#                     every strategy, prefetch 0/1/2, bf16, activation checkpointing, accumulation, offload,
#                     against plain LibTorch on the GPU, each with the race switch (FSDP_RACE_DELAY) on and off;
#                     a save at 2 ranks on the GPU (synchronous and background) loaded bit-exact at 1 rank
#                     on the GPU and at 3 on the CPU
#   8 examples_gpu    train_gpt (2 ranks; every strategy at 4) and train_llama at (dp_shard 2, tp 2) on the GPU
#                     over Gloo against one rank on the GPU, LocalSGD H = 4 against the CPU, a save at 2 ranks
#                     on the GPU resumed at 1 on the GPU and 3 on the CPU; race switch on and off (needs the
#                     two examples)
#   9 races_cpu       RaceDelay.*: the race switch's CPU tests (run everywhere)
#  10 llama           a 1.0B Llama (width 2048, 16 layers, 16 heads over 8 key-value heads, sequence 2048,
#                     vocabulary 256) in bf16: wrapped against plain LibTorch, and Hugging Face's
#                     LlamaForCausalLM under FSDP2 eager and compiled, side by side
#                     (benchmarks/fsdp/llama_side_by_side.py); on the CPU the small Llama, eager only
#  11 llama_profile   overhead_bench --profile on the same Llama: the trace and the per-step table
# --only PARTS runs those parts alone (their names above, comma-separated).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build
OUT=${OUT:-/tmp/gpu-check}
QUICK=0
ROUNDS_ARG=""
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --rounds) ROUNDS_ARG=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    *) echo "gpu-check: unknown argument '$1' (--build DIR, --out DIR, --quick, --rounds N, --only PARTS)" >&2; exit 2 ;;
  esac
done
for bin in "$BUILD/tests/fsdp_tests" "$BUILD/benchmarks/overhead_bench" "$BUILD/benchmarks/fsdp_bench"; do
  [ -x "$bin" ] || { echo "gpu-check: $bin is missing: build first (scripts/build.sh) or pass --build DIR" >&2; exit 2; }
done
mkdir -p "$OUT"
BUILD=$(cd "$BUILD" && pwd)  # absolute: the binaries' run path names this machine's build, not the copy's

VENV_PY="${HOME}/.cache/libtorch-fsdp/venv-torch-2.11.0/bin/python"
PYTHON=${PYTHON:-$([ -x "$VENV_PY" ] && echo "$VENV_PY" || echo python3)}
TORCH_LIB=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
# The binaries' run path names this machine's virtualenv and build; on another machine the torch
# libraries, the CUDA runtime the library links itself (nvidia/*/lib beside torch) and every one of
# the project's libraries must come from LD_LIBRARY_PATH.
NVIDIA_LIBS=$("$PYTHON" -c 'import glob, os, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
print(":".join(sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))))')
OUR_LIBS=$(for d in fsdp optim checkpoint tp data; do printf '%s:' "$BUILD/$d"; done)
export LD_LIBRARY_PATH="$TORCH_LIB:$NVIDIA_LIBS:$OUR_LIBS${LD_LIBRARY_PATH:-}"
GPU=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')
GPU_NAME=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")')
echo "gpu-check: torch from $TORCH_LIB, GPU: $GPU_NAME, output in $OUT" >&2

# One part: its command under a time limit, its output kept, its status recorded (with --only,
# only the parts named).
declare -A STATUS
wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
part() {
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  echo "gpu-check: [$name] $*" >&2
  local start=$SECONDS
  if timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.out" 2>&1; then
    STATUS[$name]="passed $((SECONDS - start))"
  else
    STATUS[$name]="failed $((SECONDS - start)) $?"
    echo "gpu-check: [$name] failed; the end of its output:" >&2
    tail -n 20 "$OUT/$name.out" >&2
  fi
}
skip() {
  wanted "$1" || return 0
  STATUS[$1]="skipped 0"
  echo "$2" > "$OUT/$1.out"
}

if [ "$GPU" = 1 ]; then
  part cuda_tests 240 "$BUILD/tests/fsdp_tests" --gtest_filter='Cuda.*'
  SIZE=350m ROUNDS=10 DEVICE=cuda PEAK="--peak-tflops 989"  # H200 dense bf16; fp32's MFU is against the same
else
  skip cuda_tests "no CUDA device: Cuda.* skip themselves"
  SIZE=small ROUNDS=5 DEVICE=cpu PEAK=""
fi
[ "$QUICK" = 1 ] && ROUNDS=3
[ -n "$ROUNDS_ARG" ] && ROUNDS=$ROUNDS_ARG
# shellcheck disable=SC2086
part overhead_fp32 300 "$BUILD/benchmarks/overhead_bench" --device $DEVICE --sizes $SIZE --rounds $ROUNDS --json $PEAK
# shellcheck disable=SC2086
part overhead_bf16 300 "$BUILD/benchmarks/overhead_bench" --device $DEVICE --sizes $SIZE --rounds $ROUNDS --json \
  --mixed-precision bf16 $PEAK
# shellcheck disable=SC2086
part prefetch0_bf16 300 "$BUILD/benchmarks/overhead_bench" --device $DEVICE --sizes $SIZE --rounds $ROUNDS --json \
  --mixed-precision bf16 --prefetch 0 $PEAK
# shellcheck disable=SC2086
part checkpointed_bf16 300 "$BUILD/benchmarks/overhead_bench" --device $DEVICE --sizes $SIZE --rounds $ROUNDS --json \
  --mixed-precision bf16 --activation-checkpointing $PEAK
if [ "$GPU" = 1 ] && [ "$QUICK" = 0 ]; then
  # Each model its own part, so that the 7B's rows are written even if the 70B's run out of time.
  part simulated 150 "$BUILD/benchmarks/fsdp_bench" --simulate --device cuda --sim-models 7b \
    --sim-world-sizes 8,64,1024 --json
  part simulated_70b 240 "$BUILD/benchmarks/fsdp_bench" --simulate --device cuda --sim-models 70b \
    --sim-world-sizes 8,64,1024 --json
else
  part simulated 120 "$BUILD/benchmarks/fsdp_bench" --simulate --sim-models tiny --sim-world-sizes 8 --json
fi
if [ "$GPU" = 1 ]; then
  # shellcheck disable=SC2086
  part offload 300 "$BUILD/benchmarks/overhead_bench" --device cuda --sizes $SIZE --rounds 5 --json \
    --mixed-precision bf16 --offload $PEAK
else
  skip offload "no CUDA device: offload needs one (its CPU seam runs in cpu_tests)"
fi
part cpu_tests 300 "$BUILD/tests/fsdp_tests" --gtest_filter='*MixedPrecision*:*Offload*'
if [ "$GPU" = 1 ]; then
  part gloo_cuda 180 "$BUILD/tests/fsdp_tests" --gtest_filter='GlooCuda.*'
  TORCHRUN=$(dirname "$PYTHON")/torchrun
  [ -x "$TORCHRUN" ] || TORCHRUN=$(command -v torchrun || echo torchrun)
  if [ -x "$BUILD/examples/train_gpt" ] && [ -x "$BUILD/examples/train_llama" ]; then
    part examples_gpu 300 "$PYTHON" tests/examples/check_race_and_device.py --device cuda --python "$PYTHON" \
      --train-gpt "$BUILD/examples/train_gpt" --train-llama "$BUILD/examples/train_llama" \
      --fsdp-bench "$BUILD/benchmarks/fsdp_bench" --torchrun "$TORCHRUN"
  else
    skip examples_gpu "the examples were not carried ($BUILD/examples/train_gpt, $BUILD/examples/train_llama)"
  fi
else
  skip gloo_cuda "no CUDA device: GlooCuda.* skip themselves"
  skip examples_gpu "no CUDA device: the examples' refusals of --device cuda run in CI (TrainGPT.RaceDelaysAndTheDeviceFlag)"
fi
part races_cpu 120 "$BUILD/tests/fsdp_tests" --gtest_filter='RaceDelay.*'
if [ "$GPU" = 1 ]; then
  # The batch that fills the device: two 1B models with their AdamW state are 32 GB; each row of
  # 2048 tokens takes about 4 GB of activations in bf16.
  GPU_GIB=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)')
  LLAMA_BATCH=$([ "$GPU_GIB" -ge 120 ] && echo 16 || echo 8)
  part llama 480 "$PYTHON" benchmarks/fsdp/llama_side_by_side.py --overhead-bench "$BUILD/benchmarks/overhead_bench" \
    --size llama1b --device cuda --batch-size "$LLAMA_BATCH" --rounds 8 --timeout 140 --out "$OUT/llama.json"
  part llama_profile 90 "$BUILD/benchmarks/overhead_bench" --device cuda --sizes llama1b --rounds 5 --json \
    --mixed-precision bf16 --batch-size "$LLAMA_BATCH" --profile "$OUT/llama_profile"
else
  part llama 240 "$PYTHON" benchmarks/fsdp/llama_side_by_side.py --overhead-bench "$BUILD/benchmarks/overhead_bench" \
    --size llama-small --device cpu --batch-size 2 --rounds 3 --sides ours,eager --timeout 100 --out "$OUT/llama.json"
  part llama_profile 60 "$BUILD/benchmarks/overhead_bench" --device cpu --sizes llama-small --rounds 5 --json \
    --profile "$OUT/llama_profile"
fi

# The summary: every part's status, and the figures the issue asks for.
export OUT GPU GPU_NAME
STATUS_LINES=""
for k in "${!STATUS[@]}"; do STATUS_LINES+="$k ${STATUS[$k]}"$'\n'; done
export STATUS_LINES
"$PYTHON" - <<'EOF'
import json, os, re
out, gpu = os.environ["OUT"], os.environ["GPU"] == "1"
parts = {}
for line in os.environ["STATUS_LINES"].strip().splitlines():
    name, status, seconds, *code = line.split()
    parts[name] = {"status": status, "seconds": int(seconds)}
    if status == "skipped":  # the reason is the part's whole output
        parts[name]["reason"] = open(os.path.join(out, name + ".out")).read().strip()
def rows(name):
    try:
        text = open(os.path.join(out, name + ".out")).read()
        start = re.search(r"^\[\s*$", text, re.M)  # the JSON array's own line, not a progress "[ 1/3]"
        end = re.compile(r"^\]\s*$", re.M).search(text, start.end())  # its own line: not a later warning's "]"
        return json.loads(text[start.start():end.end()])
    except (OSError, ValueError, AttributeError):
        return []
summary = {"gpu": os.environ["GPU_NAME"] if gpu else None, "parts": parts}
fp32, bf16, pf0 = rows("overhead_fp32"), rows("overhead_bf16"), rows("prefetch0_bf16")
if fp32 and bf16:
    summary["overhead"] = {
        "params": fp32[0]["params"], "device": fp32[0]["device"],
        "fp32_wrapped_over_plain": fp32[0]["ratio"], "bf16_wrapped_over_plain": bf16[0]["ratio"],
        "bf16_tflops": {"plain": bf16[0]["plain_tflops"], "wrapped": bf16[0]["wrapped_tflops"]},
        "bf16_mfu": {"plain": bf16[0]["plain_mfu"], "wrapped": bf16[0]["wrapped_mfu"]},
        "bf16_mfu_ours_over_plain": bf16[0]["mfu_ratio"] if bf16[0]["plain_mfu"] is not None else None,
        "goals": "wrapped/plain at most 1.03; MFU ours/plain at least 0.97",
    }
    if not gpu:
        summary["overhead"]["note"] = ("no GPU: a small model on the CPU, to keep the script working; the goals "
                                       "are the GPU run's and are not evaluated here")
    summary["memory"] = {
        p: {"plain_state_bytes": r[0]["plain_state_bytes"], "wrapped_state_bytes": r[0]["wrapped_state_bytes"],
            "plain_step_peak_bytes": r[0]["plain_step_peak_bytes"],
            "wrapped_step_peak_bytes": r[0]["wrapped_step_peak_bytes"],
            "step_peak_wrapped_over_plain": r[0]["wrapped_step_peak_bytes"] / max(r[0]["plain_step_peak_bytes"], 1)}
        for p, r in (("fp32", fp32), ("bf16", bf16))}
if bf16 and pf0:
    summary["prefetch"] = {"step_ms_prefetch1": bf16[0]["wrapped_ms"], "step_ms_prefetch0": pf0[0]["wrapped_ms"],
                           "off_over_on": pf0[0]["wrapped_ms"] / bf16[0]["wrapped_ms"]}
    if not gpu:
        summary["prefetch"]["note"] = "no GPU: two separate CPU runs of a few rounds, not comparable"
ck = rows("checkpointed_bf16")
if bf16 and ck:
    summary["activation_checkpointing"] = {
        "params": ck[0]["params"], "step_ms_off": bf16[0]["wrapped_ms"], "step_ms_every_block": ck[0]["wrapped_ms"],
        "step_on_over_off": ck[0]["wrapped_ms"] / bf16[0]["wrapped_ms"],
        "step_peak_bytes_off": bf16[0]["wrapped_step_peak_bytes"],
        "step_peak_bytes_every_block": ck[0]["wrapped_step_peak_bytes"],
        "peak_on_over_off": ck[0]["wrapped_step_peak_bytes"] / max(bf16[0]["wrapped_step_peak_bytes"], 1),
        "plain_libtorch_peak_on_over_off": ck[0]["plain_step_peak_bytes"] / max(bf16[0]["plain_step_peak_bytes"], 1)}
off = rows("offload")
if off:
    r = off[0]
    summary["offload"] = {
        "params": r["params"], "step_ms_plain": r["plain_ms"], "step_ms_offloaded": r["wrapped_ms"],
        "offloaded_over_plain": r["ratio"], "phases_ms_offloaded": r["wrapped_phases_ms"],
        "device_bytes_between_steps": r["wrapped_device_bytes_between_steps"],
        "device_step_peak_bytes": r["wrapped_step_peak_bytes"], "host_state_bytes": r["wrapped_state_bytes"],
        "plain_state_bytes": r["plain_state_bytes"]}
sim = rows("simulated") + rows("simulated_70b")
if sim:
    keys = ("model", "device", "world_size", "params", "measured", "note", "state_bytes_at_step", "formula_at_step",
            "state_bytes_peak", "formula_peak", "peak_bytes", "cublas_workspace_bytes", "construction_peak_bytes",
            "host_construction_peak_bytes", "step_ms", "comm_send_bytes", "comm_recv_bytes")
    summary["simulated"] = [dict({k: r.get(k) for k in keys},
                                 state_at_step_over_formula=r["state_bytes_at_step"] / r["formula_at_step"]
                                 if r.get("state_bytes_at_step") else None) for r in sim]
    at64 = [r for r in summary["simulated"] if r["model"] == "7b" and r["world_size"] == 64]
    summary["simulated_goal"] = {"goal": "7b at 64 ranks: state at the step within 1.01 of 16Ψ/N",
                                 "met": bool(at64 and at64[0]["state_at_step_over_formula"] is not None and
                                             abs(at64[0]["state_at_step_over_formula"] - 1) <= 0.01)}
try:
    llama = json.load(open(os.path.join(out, "llama.json")))
    wrapped = next((r for r in llama["rows"] if r["side"] == "libtorch_fsdp_wrapped"), {})
    summary["llama"] = dict(llama, goals="ours over FSDP2 eager at most 1.0, over compiled at most 1.15, over plain "
                            "LibTorch at most 1.02; MFU at least 0.35", wrapped_mfu=wrapped.get("mfu"))
    if not gpu:
        summary["llama"]["note"] = "no GPU: the small Llama on the CPU, to keep the script working"
except (OSError, ValueError):
    pass
try:
    text = open(os.path.join(out, "cuda_tests.out")).read()
    summary["cuda_lines"] = re.findall(r"^\[cuda\].*$", text, re.M)
except OSError:
    pass
json.dump(summary, open(os.path.join(out, "gpu-check.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
EOF
for k in "${!STATUS[@]}"; do
  case "${STATUS[$k]}" in failed*) echo "gpu-check: part $k failed (see $OUT/$k.out)" >&2; exit 1 ;; esac
done
echo "gpu-check: every part that ran passed; summary in $OUT/gpu-check.json" >&2
