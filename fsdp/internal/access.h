// The library's own way into its public classes: what fully_shard, the sharding scope, fsdp::optim
// and fsdp::checkpoint need of a handle, a unit's module or a scope that is not the user's API
// (their run state, their unit), and the handle's collectives for the library's own functions.
// The classes name Access their friend. Internal to the library.
#pragma once

#include "fsdp/fully_shard.h"
#include "fsdp/internal/calls.h"
#include "fsdp/sharded.h"
#include "fsdp/sharding_scope.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

class RunState;
class Unit;

struct Access {
  /// The run state of a wrapped model (what its units share).
  static RunState& state(const FSDPModule& model);
  /// The unit of a module marked fsdp::Sharded (null before it is sharded), and attaching one.
  static const std::shared_ptr<Unit>& unit(const ShardedUnit& module) { return module.fsdp_unit_; }
  /// `member`: the module's index among the unit's modules (ShardedUnit::share_unit_with).
  static void attach(ShardedUnit& module, std::shared_ptr<Unit> unit, int member = 0) {
    module.fsdp_unit_ = std::move(unit);
    module.fsdp_member_ = member;
  }
  static int member(const ShardedUnit& module) { return module.fsdp_member_; }
  /// The state a scope's units, and then the model built in it, share.
  static const std::shared_ptr<RunState>& state(const ShardingScope& scope) { return scope.state_; }
};

/// An agreement of every rank of `model` at a step boundary (RunState::check_boundary): the same
/// call `call` with the same `payload`, after the same collectives of the model. `what` names it
/// in errors; every rank's `vote` comes back. Between steps, on the training thread.
std::vector<int64_t> agree(const FSDPModule& model, Call call, uint64_t payload, const std::string& what,
                           int64_t vote = 0);
/// Reduces `tensor` in place over every rank of `model` (over a mesh with tensor parallelism, its
/// data-parallel ranks and then its tensor-parallel ones: the whole mesh), after an agreement that every rank is at
/// this call (`what`, equal on every rank): for what the library computes from shards (a global
/// norm, the scaler's overflow, a load's byte counts).
void all_reduce(const FSDPModule& model, at::Tensor& tensor, c10d::ReduceOp op, const std::string& what);
/// Throws, naming `caller`, while gradients accumulated with gradient sync off wait unreduced
/// (see FSDPModule::set_requires_gradient_sync): stepping or clipping now would miss them.
void check_gradients_reduced(const FSDPModule& model, const char* caller);
/// The library rescaled the sharded gradients in place on purpose (clip_grad_norm, the scaler's
/// unscale_): not the program's habit the next forward warns about (internal/step_watch.h).
void gradients_rescaled(const FSDPModule& model);

}  // namespace fsdp::detail
