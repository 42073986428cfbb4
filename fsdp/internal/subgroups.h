// The members of the process groups fsdp::new_subgroup made, by global rank: a Comm over a group a
// user made (fully_shard(model, sub), a DeviceMesh over it) names its ranks as the job knows them
// ("global rank 3 of 4"), not by their ranks in the group. Kept per group, weakly: a group freed
// is forgotten, and a new one at its address is not mistaken for it.
#pragma once

#include "fsdp/internal/comm.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Records that rank r of `pg` (named `name`) is global rank global_ranks[r] of `world_size`.
void remember_subgroup(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& name,
                       std::vector<int> global_ranks, int world_size);

/// What remember_subgroup recorded of `pg` (its name, global ranks and the job's size); nullopt
/// for any other group (the world's, or one made without fsdp::new_subgroup).
std::optional<GroupInfo> subgroup_info(const c10d::ProcessGroup* pg);

}  // namespace fsdp::detail
