// --profile DIR of train_gpt, train_llama and overhead_bench: a Chrome / Perfetto trace of a few
// steps (Kineto through LibTorch's profiler, CPU and, on a GPU, CUDA activities), written to
// DIR/trace.json (rank R > 0: DIR/trace-rank-R.json), and a table of each profiled step:
//   step       the step's span (its "fsdp.step" annotation): what the program times as a step
//   forward, backward, optimizer
//              the spans of the program's "fsdp.forward", "fsdp.backward" and "fsdp.optimizer"
//              annotations in it, summed over micro-batches; on a GPU the device time (the union)
//              of the kernels, copies and memsets launched inside them, from any thread, each
//              tied to its launch by Kineto's correlation id
//   wait AG / RS / AR / other
//              CPU time in the library's waits ("fsdp.wait.<op>", any thread) for all-gathers,
//              reduce-scatters, all-reduces (FSDP's, tensor parallelism's, the gradient norm's) and
//              the rest (the ranks' agreements at step boundaries, broadcasts); on a GPU a wait only
//              queues the stream's wait, whose cost shows as GPU idle time instead
//   GPU busy, GPU idle
//              the union of the step's kernels, copies and memsets on the device (NCCL's kernels
//              among them, busy while they wait for peers), and the rest of the step's span (a host
//              synchronisation, a launch-bound stretch, a stream waiting on an event); "-" on the
//              CPU
// The same rows go to DIR/steps.json, one JSON object per step.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace at {
class RecordFunction;
}

namespace fsdp::programs {

/// Which of a run's `n` steps (counted from 0) are profiled: all of them when n < 5, else steps 2,
/// 3 and 4 (two warm-up steps first).
bool profiled_step(int64_t i, int64_t n);

/// One profiled step's figures, in milliseconds (gpu_busy_ms and gpu_idle_ms negative on the CPU).
struct ProfiledStep {
  std::string label;
  double step_ms = 0, forward_ms = 0, backward_ms = 0, optimizer_ms = 0;
  double wait_all_gather_ms = 0, wait_reduce_scatter_ms = 0, wait_all_reduce_ms = 0, wait_other_ms = 0;
  double gpu_busy_ms = -1, gpu_idle_ms = -1;
  /// The phases are device time (their kernels tied to their launches), not CPU spans.
  bool phases_on_device = false;
};

/// A span of the program in the trace ("fsdp.forward", ...), while the profiler is on: a
/// RecordFunction of the user scope, nothing when no profiler runs.
class Phase {
 public:
  explicit Phase(const char* name);
  ~Phase();
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  std::unique_ptr<at::RecordFunction> span_;
};

class StepProfiler {
 public:
  /// Off when `dir` is empty; else creates `dir` (a UsageError, exit 2, when it cannot: call it
  /// before any training).
  explicit StepProfiler(const std::string& dir);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  bool on() const { return !dir_.empty(); }
  /// A step begins: when `profiled`, it is a span labelled `label` in the trace and a row of the
  /// table, and the profiler starts if it is not running (once a run: after it stopped, nothing).
  void begin(bool profiled, const std::string& label, const c10::Device& device);
  /// The step ends (after the program synchronised the device); with `stop`, a running profiler
  /// stops and writes the trace and, on rank 0, steps.json and the table on `out`. A loop over
  /// steps i of n: begin(profiled_step(i, n), ...), end(!profiled_step(i + 1, n), ...).
  void end(bool stop, int rank, std::ostream& out);

  const std::vector<ProfiledStep>& steps() const { return rows_; }

 private:
  void stop(int rank, std::ostream& out);

  std::string dir_;
  bool running_ = false, done_ = false, cuda_ = false;
  std::unique_ptr<at::RecordFunction> step_span_;
  std::vector<std::string> labels_;
  std::vector<ProfiledStep> rows_;
};

/// The table, one row per step, as --profile prints it.
void print_profile_table(const std::vector<ProfiledStep>& rows, std::ostream& out);

}  // namespace fsdp::programs
