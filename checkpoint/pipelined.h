// Checkpoints of a pipelined model (fsdp::pp): each rank's stages, each an FSDP model over its
// stage's ranks (pp/stage_mesh.h), saved together as one checkpoint of the whole model, its
// parameters under their names (model.layers.7.… whichever stage held layer 7), so that it loads
// on any other mesh: another number of stages, data-parallel or tensor-parallel ranks, one rank, or
// a plain module (checkpoint/checkpoint.h's load), and back.
//
//   std::vector<fsdp::checkpoint::StageState> mine;              // this rank's stages
//   for (size_t i = 0; i < stages.size(); ++i) mine.push_back({index[i], sharded[i], opts[i].get()});
//   fsdp::checkpoint::save("ckpts", mesh, mine, fsdp::checkpoint::SaveOptions().step(100));
//   fsdp::checkpoint::load("ckpts", mesh, mine);                  // on any (pp, dp, tp) mesh
//
// The checkpoint is the one a single model's save writes (docs/checkpoint-format.md): one file per
// rank, one manifest. A tensor two stages hold (a tied embedding and head on the first and last
// stage, under one name) is saved once, from the first of them, and loaded into both: keep the two
// one value (sum their gradients), as one model's one weight.
#pragma once

#include "checkpoint/checkpoint.h"
#include "fsdp/device_mesh.h"
#include "fsdp/export.h"
#include "fsdp/fully_shard.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::checkpoint {

/// One of this rank's pipeline stages: its index in the pipeline (fsdp::pp::Stage::index), its
/// wrapped model (over the stage's ranks) and the optimizer built on it (or none: then no stage has
/// one).
struct StageState {
  int64_t index = 0;
  FSDPModule model;
  torch::optim::Optimizer* optimizer = nullptr;
};

/// Saves the pipelined model under `root`, collectively over `mesh`'s world: every rank calls it
/// with its own stages (each rank at least one, in any order) and the same options, between steps.
/// Each rank writes its rows of each of its stages (each unique byte once over the world), its
/// generators, and rank 0 commits one manifest: a failure on any rank fails every rank and leaves
/// the previous checkpoint the latest, as fsdp::checkpoint::save. Each stage's optimizer state is
/// saved with it; the manifest's optimizer is the stages' together: their types equal, and param
/// group g the concatenation of every stage's group g in stage order (the stages' optimizers
/// built alike, each group's options equal), as one optimizer over the whole model would hold
/// them. Bounded by the mesh's timeout.
SaveResult save(const std::string& root, const DeviceMesh& mesh, const std::vector<StageState>& stages,
                const SaveOptions& options = {});

/// Loads the checkpoint at `path` (a checkpoint directory, or a root: its latest), saved by a
/// pipelined model or by one model on any mesh, into this rank's stages, collectively over `mesh`'s
/// world: each stage reads the rows of the tensors it holds, and its optimizer its part of each
/// saved param group (by name). Checked on every rank before anything changes: each stage's
/// tensors present with their dtypes and shapes; with LoadOptions::strict, every model tensor of
/// the checkpoint held by some stage. The generators, the sampler and in_place as
/// fsdp::checkpoint::load; LoadResult's totals are over the world.
LoadResult load(const std::string& path, const DeviceMesh& mesh, const std::vector<StageState>& stages,
                const LoadOptions& options = {});

}  // namespace fsdp::checkpoint

FSDP_PUBLIC_END
