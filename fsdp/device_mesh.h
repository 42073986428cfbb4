// fsdp::DeviceMesh: the job's ranks laid out as an N-dimensional array with named dimensions, as
// PyTorch's init_device_mesh and torchtitan's ("dp_replicate", "dp_shard", "tp"):
//
//   auto world = fsdp::init_process_group();                       // 4 ranks
//   fsdp::DeviceMesh mesh(world, {{"dp_shard", 2}, {"tp", 2}});    // FSDP 2 x TP 2
//   fsdp::tp::Group tp(mesh);                                      // the layers' TP group
//   ... build the model with fsdp::tp layers over `tp` ...
//   auto model = fsdp::fully_shard(net, mesh);                     // sharded over dp_shard
//
// Ranks fill the mesh row-major, the last dimension fastest: with {{"dp_shard", 2}, {"tp", 2}},
// global ranks 0 and 1 are one tensor-parallel pair (coordinates (0, 0) and (0, 1)), 2 and 3 the
// other, and 0 and 2 shard the same TP part over data parallelism. Put "tp" last, so that a TP
// group is consecutive ranks (one node under torchrun and Slurm): its collectives are per layer.
// A pipeline's "pp" dimension (fsdp::pp) comes first, outermost: its stages exchange only
// activations and their gradients, point to point, the traffic that suits the links between nodes.
//
// The subgroups, one along each dimension and the data-parallel group (dp_replicate x dp_shard),
// are created once, in the constructor, bounded by the world group's timeout; copies of a mesh
// share them. Errors of collectives over the mesh's groups name the mesh coordinates beside the
// global rank.
#pragma once

#include "fsdp/export.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {
class DeviceMesh;
namespace detail {
struct FSDP_HIDDEN MeshState;
const MeshState& mesh_state(const DeviceMesh& mesh);
}  // namespace detail

/// The dimension names the library gives a meaning to (torchtitan's).
inline constexpr const char* kReplicateDim = "dp_replicate";  ///< data parallel, replicated (hybrid's across groups)
inline constexpr const char* kShardDim = "dp_shard";          ///< data parallel, sharded (FSDP)
inline constexpr const char* kTensorDim = "tp";               ///< tensor parallel (fsdp::tp layers)
inline constexpr const char* kPipeDim = "pp";                 ///< pipeline parallel (fsdp::pp stages), first
/// Not a dimension of its own: dp_replicate x dp_shard flattened (DeviceMesh::group("dp")), the
/// ranks that see different data.
inline constexpr const char* kDataDim = "dp";

/// One dimension of a mesh: its name (one of the four above) and how many ranks it spans.
struct MeshDim {
  std::string name;
  int size = 1;
};

class DeviceMesh {
 public:
  /// Lays the ranks of `world` out as `dims` (row-major, the last dimension fastest) and creates
  /// the subgroups. Collective: every rank of `world` calls it with the same dims. The product of
  /// the sizes must be the world size, each name one of dp_replicate, dp_shard, tp and pp, at most
  /// once, pp (if present) first.
  DeviceMesh(const c10::intrusive_ptr<c10d::ProcessGroup>& world, std::vector<MeshDim> dims);

  const std::vector<MeshDim>& dims() const;
  /// Whether the mesh has dimension `name`.
  bool has(const std::string& name) const;
  /// Ranks along dimension `name` (1 for a dimension the mesh does not have); "dp": dp_replicate
  /// x dp_shard.
  int size(const std::string& name) const;
  /// This rank's coordinate along `name` (0 for a dimension the mesh does not have); "dp": its
  /// place among the data-parallel ranks, coordinate(dp_replicate) * size(dp_shard) +
  /// coordinate(dp_shard).
  int coordinate(const std::string& name) const;
  /// The ranks that differ from this one only along `name`, as a process group (group rank =
  /// coordinate along `name`); a one-rank group for a dimension the mesh does not have.
  const c10::intrusive_ptr<c10d::ProcessGroup>& group(const std::string& name) const;
  /// Their global ranks, in group-rank order.
  const std::vector<int>& group_ranks(const std::string& name) const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& world() const;
  int rank() const;
  int world_size() const;
  /// The bound on the mesh's collectives: the world group's timeout.
  std::chrono::milliseconds timeout() const;
  /// "(dp_shard 2, tp 2)".
  std::string shape_text() const;
  /// "(dp_shard 1, tp 0)": this rank's coordinates, as errors name them.
  std::string coordinates_text() const;

 private:
  friend const detail::MeshState& detail::mesh_state(const DeviceMesh& mesh);
  std::shared_ptr<detail::MeshState> state_;
};

}  // namespace fsdp

FSDP_PUBLIC_END
