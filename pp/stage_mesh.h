// fsdp::pp::stage_mesh: the mesh of one pipeline stage's ranks, what its FSDP and tensor-parallel
// layers are built over.
//
//   fsdp::DeviceMesh mesh(world, {{"pp", 2}, {"dp_shard", 2}, {"tp", 2}});
//   fsdp::DeviceMesh stage = fsdp::pp::stage_mesh(mesh);   // (dp_shard 2, tp 2) of this rank's stage
//   fsdp::tp::Group blocks(stage);
//   auto model = fsdp::fully_shard(stage_model, stage);    // FSDP over the stage's ranks only
//
// Why a mesh of its own: the library's agreements at every forward and backward run over the
// model's ranks; a model wrapped across pp would block a stage in such an agreement while its
// neighbour waits on a receive. Over the stage's (dp, tp) ranks, only the pipeline's transfers
// cross stages.
#pragma once

#include "fsdp/device_mesh.h"
#include "fsdp/export.h"

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

/// The ranks of `mesh` at this rank's pp coordinate, as a mesh of `mesh`'s other dimensions (in
/// their order; a mesh without them is (dp_shard 1)). Collective over `mesh`'s world: every rank
/// calls it, in the same order relative to the other stage meshes it makes (the subgroups are
/// named by that order); bounded by the world group's timeout.
DeviceMesh stage_mesh(const DeviceMesh& mesh);

}  // namespace fsdp::pp

FSDP_PUBLIC_END
