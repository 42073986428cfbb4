#include "pp/stage_mesh.h"

#include "fsdp/process_group.h"

#include <atomic>
#include <string>
#include <vector>

namespace fsdp::pp {

DeviceMesh stage_mesh(const DeviceMesh& mesh) {
  // pp is the first dimension: a stage's ranks are consecutive global ranks.
  const int per_stage = mesh.world_size() / mesh.size(kPipeDim);
  const int first = mesh.coordinate(kPipeDim) * per_stage;
  std::vector<int> members;
  for (int r = first; r < first + per_stage; ++r) members.push_back(r);
  std::vector<MeshDim> dims;
  for (const MeshDim& d : mesh.dims()) {
    if (d.name != kPipeDim) dims.push_back(d);
  }
  if (dims.empty()) dims.push_back({kShardDim, 1});
  // Every rank makes its stage meshes in the same order: the count names the subgroups alike.
  static std::atomic<int64_t> made{0};
  const std::string name = "fsdp-pp-stage-mesh-" + std::to_string(made++) + "-" + mesh.shape_text() + "-stage-" +
                           std::to_string(mesh.coordinate(kPipeDim));
  return DeviceMesh(new_subgroup(mesh.world(), members, name), dims);
}

}  // namespace fsdp::pp
