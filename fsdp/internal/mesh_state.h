// What a DeviceMesh's copies share: the layout, this rank's coordinates and the subgroups, created
// once. Internal to the library: fully_shard and fsdp::tp build their Comms from it.
#pragma once

#include "fsdp/device_mesh.h"
#include "fsdp/internal/comm.h"
#include "fsdp/options.h"

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace fsdp::detail {

struct MeshGroup {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::vector<int> global_ranks;  ///< in group-rank order
  std::string name;               ///< "tp group (dp_shard 1)", for messages
};

struct MeshState {
  c10::intrusive_ptr<c10d::ProcessGroup> world;
  std::vector<MeshDim> dims;
  std::vector<int> coordinates;             ///< this rank's, one per dimension
  std::map<std::string, MeshGroup> groups;  ///< by dimension name, and "dp"
  std::chrono::milliseconds timeout{0};

  /// Index of dimension `name` in dims, or -1.
  int index(const std::string& name) const;
  /// The group along `name` (a dimension or "dp"); throws naming the mesh for another name.
  const MeshGroup& group(const std::string& name) const;
  /// "(dp_shard 1, tp 0) of mesh (dp_shard 2, tp 2)": GroupInfo::mesh.
  std::string where() const;
  /// What a Comm over group `name` names in its messages (GroupInfo).
  GroupInfo group_info(const std::string& name) const;
};

/// A DeviceMesh's shared state (declared in fsdp/device_mesh.h, its friend).
const MeshState& mesh_state(const DeviceMesh& mesh);

/// The options a mesh implies for fully_shard and ShardingScope: hybrid sharding when both
/// data-parallel dimensions have more than one rank (the given strategy must then be full or hybrid
/// sharding, shard_group_size unset or the dp_shard size). Defined in fsdp/fully_shard.cpp.
FullyShardOptions options_for_mesh(const DeviceMesh& mesh, FullyShardOptions options);

}  // namespace fsdp::detail
