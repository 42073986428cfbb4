// train_llama --pp P: the Llama trained as a pipeline of stages (examples/llama/pipelined.h) on a
// (pp, tp) mesh, each step one schedule of microbatches (fsdp::pp::Pipeline).
#pragma once

#include "examples/checkpoints.h"
#include "examples/llama/llama.h"
#include "fsdp/mixed_precision.h"
#include "pp/action.h"
#include "pp/stage_layout.h"
#include "programs/program.h"

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace llama {

/// What train_llama's flags ask of a pipelined run, checked.
struct PipelinedRun {
  Config cfg;
  int64_t pp = 2, tp = 1, microbatches = 0, stages_per_rank = 1;
  std::string schedule = "1f1b";
  std::string schedule_file;  // a CSV of action lists instead of `schedule`
  int64_t steps = 0, batch_size = 0;
  uint64_t seed = 1;
  double lr = 1e-3, weight_decay = 0.1, clip = 0;
  bool json = false;
  std::string data;
  double max_data_mb = 64;
  std::optional<std::chrono::milliseconds> timeout;
  /// --mixed-precision bf16 or fp16: each stage's FSDP policy; fp16 with the loss scaled (one
  /// fsdp::optim::ShardedGradScaler over the stages).
  fsdp::MixedPrecisionPolicy mixed_precision;
  bool fp16 = false;
  /// --save-dir, --save-every, --resume (synchronous saves: --async-save is refused with --pp).
  examples::CheckpointFlags ckpt;
  std::string export_hf;  // --export-hf OUT after training
  /// --build-sharded: each stage's layers sharded as they are built (llama::ShardAsBuilt).
  bool build_sharded = false;
  /// --from-hf DIR: each stage's weights read from DIR (`cfg` is DIR's config.json).
  std::string from_hf;
  /// --prompt with --logits-out: the prompt's logits through the stages before any step.
  std::vector<int64_t> prompt;
  std::string logits_out;
};

/// The run's stage layout (looped) and its action lists: make_schedule's, or the file's; both
/// validated (fsdp::pp::validate). A refusal exits 2 with the validator's or the schedule's
/// message (fsdp::programs::usage_error), before any process group exists.
std::pair<fsdp::pp::StageLayout, fsdp::pp::ActionLists> pipelined_schedule(const PipelinedRun& run);

/// --pp-schedule-dump: the lists, one line per rank, and the step and bubble the validator
/// simulates with equal times (a forward 1, an input and a weight gradient 1 each), on stdout.
void dump_schedule(const PipelinedRun& run);

/// Trains; rank 0 prints a row per step (--json: JSON with pp, pp_schedule, microbatches,
/// p2p_bytes and bubble). Returns the exit status.
int train_pipelined(const PipelinedRun& run, fsdp::programs::Program& program);

}  // namespace llama
