// fsdp::ShardingScope: shard each unit the moment it is built, so that a model larger than one
// rank's memory can be constructed at all.
//
//   auto pg = fsdp::init_process_group();
//   fsdp::ShardingScope scope(pg, fsdp::FullyShardOptions().strategy(...));
//   auto net = GPT(cfg);                           // each fsdp::Sharded block is sharded as built
//   auto model = fsdp::fully_shard(net, scope);    // the root's own parameters, then training
//
// While a scope is open on this thread, every fsdp::Sharded<Impl> shards its parameters as soon as
// Impl's constructor returns: rank 0's values are broadcast (FullyShardOptions::sync_module_states),
// this rank keeps its rows, and the full parameters are freed. Peak memory while building is the
// shards so far plus one unit (plus the root's own parameters, which stay whole until
// fully_shard: wrap large ones, such as embeddings, in fsdp::Sharded too). Every rank builds every
// unit in full from the same random stream, so a seed gives the same weights at any rank count.
#pragma once

#include "fsdp/device_mesh.h"
#include "fsdp/export.h"
#include "fsdp/options.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>

FSDP_PUBLIC_BEGIN

namespace fsdp {
namespace detail {
class FSDP_HIDDEN RunState;
struct FSDP_HIDDEN Access;
}  // namespace detail

class ShardingScope {
 public:
  ShardingScope(c10::intrusive_ptr<c10d::ProcessGroup> pg, FullyShardOptions options = {});
  /// Over the data-parallel dimensions of `mesh`, as fsdp::fully_shard(model, mesh, options): a
  /// model of fsdp::tp layers built inside has each unit's tensor-parallel parts sharded over the
  /// ranks holding the same parts as soon as the unit is built.
  ShardingScope(const DeviceMesh& mesh, FullyShardOptions options = {});
  /// Closes the scope (if fully_shard did not already).
  ~ShardingScope();
  ShardingScope(const ShardingScope&) = delete;
  ShardingScope& operator=(const ShardingScope&) = delete;

  /// Units built from now on are no longer sharded on construction.
  void close();
  bool is_open() const { return open_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }

  /// The innermost open scope of this thread, or null.
  static ShardingScope* current();

 private:
  friend struct detail::Access;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<detail::RunState> state_;  // what the scope's units, then the model, share
  bool open_ = false;
};

}  // namespace fsdp

FSDP_PUBLIC_END
