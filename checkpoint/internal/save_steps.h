// The two halves of a save (docs/checkpoint-format.md, "Commit"). prepare_save runs on the caller's
// thread, between steps: what this rank writes (the plan's rows of each parameter, of each
// optimizer state and of each buffer, and its generators), as views of the live tensors, and on
// rank 0 what the manifest says of the model and the optimizer. write_and_commit then writes this
// rank's file, agrees, gathers the manifest's parts and commits: fsdp::checkpoint::save runs it
// at once on the model's process group; AsyncSaver on its own thread, over a side group, after
// copying the views into its snapshot (so that training may change the live tensors meanwhile).
// Internal to the checkpoint library.
#pragma once

#include "checkpoint/checkpoint.h"
#include "checkpoint/internal/collectives.h"
#include "checkpoint/internal/manifest_builder.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::checkpoint::detail {

struct PreparedSave {
  std::string root, name;
  int rank = 0, world_size = 1;
  SaveOptions options;
  /// This rank's file, in order: each entry's manifest key, global rows, inner box (along the
  /// dimensions from 1: a tensor-parallel part), file entry name and data.
  std::vector<std::string> keys;
  std::vector<std::pair<int64_t, int64_t>> rows;
  std::vector<InnerBox> inners;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  /// Kind, dtype and shape of the optimizer and generator tensors this rank writes; the optimizer
  /// steps of the parameters it has state for.
  std::vector<TensorMeta> extra_tensors;
  std::vector<std::pair<std::string, int64_t>> steps;
  /// Rank 0 only: every model tensor's kind, dtype and shape; each unit's strategy; the
  /// optimizer's record (type, param groups), or null.
  std::vector<TensorMeta> model_tensors;
  nlohmann::ordered_json strategies = nlohmann::ordered_json::object();
  nlohmann::ordered_json optimizer = nullptr;
  /// Tensor parallelism: the global ranks of this rank's tensor-parallel group, and a line
  /// "<name> <fingerprint>" per parameter they hold alike (not split), which the save compares
  /// across them before writing: rows of such a parameter are written by one of them for all.
  std::vector<int> tp_ranks;
  std::string alike;
  /// Bytes of this rank's tensors (its file's data).
  int64_t bytes() const;
};

/// The checkpoint's directory name under the root: SaveOptions::name, else step_name(step).
std::string checkpoint_name(const SaveOptions& options);

/// What this rank saves of `model` (and `optimizer`, when not null) under `root`, as rank `rank` of
/// the `world_size` ranks the save spans (checkpoint_group). Refuses an optimizer the format cannot
/// hold and one built on other parameters. Reads the live tensors' metadata only; their bytes are
/// read when the file is written.
PreparedSave prepare_save(const std::string& root, const FSDPModule& model, const torch::optim::Optimizer* optimizer,
                          const SaveOptions& options, int rank, int world_size);

/// Adds this rank's generator states to `p`'s file, as global rank p.rank (what prepare_save does
/// with SaveOptions::rng_states; a pipelined save adds them once for all its stages).
void add_generators(PreparedSave& p);

/// Writes this rank's file into the staging directory, agrees with every rank of `group` after
/// each phase, gathers the parts and (rank 0) writes the manifest and commits. `first` runs in the
/// first phase, before anything is on disk (the synchronous save prepares there, so that a rank
/// that cannot prepare fails every rank). `who` names the call in errors ("fsdp::checkpoint::save").
SaveResult write_and_commit(PreparedSave& save, const Group& group, const std::string& who,
                            const std::function<void()>& first = {});

}  // namespace fsdp::checkpoint::detail
