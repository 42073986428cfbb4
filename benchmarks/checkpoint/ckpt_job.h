// What ckpt_bench's modes share: the rank of a job they run as (save, load, async), the model and
// optimizer state they checkpoint, timing barrier to barrier, and their output, one JSON object per
// line through nlohmann (numbers rounded to the digits they are worth).
#pragma once

#include "benchmarks/checkpoint/ckpt_flags.h"
#include "examples/gpt.h"
#include "fsdp/fsdp.h"
#include "programs/json_row.h"

#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace ckpt {

using Clock = std::chrono::steady_clock;
using ordered_json = nlohmann::ordered_json;  // keys in the order written

/// This process as a rank of the job (torchrun's environment: fsdp::init_process_group).
struct Job {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int rank = 0, world = 1;
};

/// The model and optimizer a mode checkpoints.
struct State {
  fsdp::FullyShardedModule<gpt::GPTImpl<true>> model;
  std::unique_ptr<torch::optim::AdamW> opt;
};

/// The GPT of `f`, wrapped with f.strategy (hybrid: groups of 2), and AdamW after one step (so its
/// moments exist); `seed` fixes the weights.
State build(const Flags& f, const Job& j, uint64_t seed);

void barrier(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);
double max_over_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, double v);

/// Seconds of `fn` on all ranks, barrier to barrier.
template <typename Fn>
double timed(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, Fn&& fn) {
  barrier(pg);
  const auto t0 = Clock::now();
  fn();
  barrier(pg);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double seconds_since(Clock::time_point t0);
double median(std::vector<double> v);

/// `v` rounded to `digits` decimals (as the figures are read); NaN and infinities stay (null in JSON).
double round_to(double v, int digits);

}  // namespace ckpt
