// Sharded checkpoints of a wrapped model: every rank writes its own file in parallel, each unique
// byte once, and one rank commits the checkpoint atomically (docs/checkpoint-format.md).
//
//   auto r = fsdp::checkpoint::save("ckpts", model, fsdp::checkpoint::SaveOptions().step(100));
//   // ckpts/step-000100/{rank-00000.safetensors, ..., manifest.json}, ckpts/latest
//
// Written so far: the model's parameters and buffers, the step and the user's metadata. Not yet
// (issue 12, docs/roadmap.md): optimizer state, RNG states, loading.
#pragma once

#include "fsdp/fully_shard.h"

#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <string>

namespace fsdp::checkpoint {

using Metadata = std::map<std::string, std::string>;

struct SaveOptions {
  /// The training step, recorded in the manifest; the default name is step_name(step).
  TORCH_ARG(int64_t, step) = 0;
  /// The checkpoint's directory name under the root (default "step-NNNNNN"). Must not exist yet.
  TORCH_ARG(std::string, name) = "";
  /// Keep only the newest K committed checkpoints under the root after this one (0: keep all).
  TORCH_ARG(int, keep_last) = 0;
  /// Each tensor's CRC32C is taken per block of at most this many bytes.
  TORCH_ARG(uint64_t, block_bytes) = uint64_t{1} << 20;
  /// The user's own key/values, kept in the manifest.
  TORCH_ARG(Metadata, metadata);
};

struct SaveResult {
  std::string path;           ///< the committed checkpoint's directory
  int64_t bytes_written = 0;  ///< by this rank: its file's tensor bytes
  int64_t bytes_total = 0;    ///< by all ranks (rank 0 only; 0 elsewhere)
  double seconds = 0;         ///< this rank, from the call to its return
};

/// Saves `model` under `root` (a directory every rank sees: a parallel filesystem, or a local disk
/// for one host), collectively: every rank calls it with the same arguments, between steps. Each
/// rank writes its rows (checkpoint/plan.h) to its own safetensors file in a staging directory and
/// fsyncs it; rank 0 then writes the manifest and commits (checkpoint/commit.h). Every wait is
/// bounded by the model's timeout; a failure on any rank fails every rank with its reason, and
/// leaves the previous checkpoint the latest.
SaveResult save(const std::string& root, const FSDPModule& model, const SaveOptions& options = {});

}  // namespace fsdp::checkpoint
