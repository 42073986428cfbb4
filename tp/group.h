// fsdp::tp::Group: the tensor-parallel ranks a layer of fsdp::tp splits its weights over, with the
// statistics its collectives count into.
//
//   fsdp::DeviceMesh mesh(world, {{"dp_shard", 2}, {"tp", 2}});
//   fsdp::tp::Group blocks(mesh), vocab(mesh);   // one group of ranks, counted apart
//   ... layers built over `blocks` ...
//   blocks.comm_stats().all_reduces              // what those layers sent since the last reset
//
// Every collective of fsdp::tp is bounded by the mesh's timeout (the world group's, not a model's
// FullyShardOptions::timeout), recorded by the flight recorder, and fails with an error naming the
// global rank, the mesh coordinates, the operation and the layer's shapes. With
// $FSDP_VERIFY_COLLECTIVES=1 each is preceded by a cross-rank check of its size and description,
// as the model's are (fsdp/options.h, verify_collectives). Copies of a Group share its statistics; two Groups made from
// one mesh are the same ranks with separate statistics (a model's blocks apart from its
// embedding and loss, as train_llama's `tp_collectives` reports them).
#pragma once

#include "fsdp/comm_stats.h"
#include "fsdp/device_mesh.h"
#include "fsdp/export.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {
namespace detail {
class Comm;
}
namespace tp {
class Group;
}
namespace detail {
/// The Comm a Group's collectives go through (internal to the library).
Comm& tp_comm(const tp::Group& group);
}  // namespace detail

namespace tp {

class Group {
 public:
  /// The mesh's "tp" dimension (a one-rank group when the mesh has none: the layers are then plain
  /// LibTorch layers with no collective but the counting).
  explicit Group(const DeviceMesh& mesh);
  /// Every rank of `pg`: a job that is tensor parallel only, without a mesh.
  explicit Group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);

  /// This rank's place among the group's ranks (which part of each split weight it holds).
  int rank() const;
  int size() const;
  /// The group's global ranks, in group-rank order.
  std::vector<int> global_ranks() const;
  /// "global rank 3 of 4 at (dp_shard 1, tp 1) of mesh (dp_shard 2, tp 2) (rank 1 of tp group
  /// (dp_shard 1): global ranks 2, 3)": how errors name this rank.
  std::string where() const;

  /// The collectives the layers built over this group (and copies of it) issued since it was made
  /// or reset: by kind, and in elements (all-gather outputs + reduce-scatter inputs + 2 x
  /// all-reduced elements).
  const CommStats& comm_stats() const;
  void reset_comm_stats();

 private:
  friend detail::Comm& detail::tp_comm(const Group& group);
  std::shared_ptr<detail::Comm> comm_;
};

}  // namespace tp
}  // namespace fsdp

FSDP_PUBLIC_END
