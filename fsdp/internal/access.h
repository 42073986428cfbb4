// The library's own way into its public classes: what fully_shard, the sharding scope, fsdp::optim
// and fsdp::checkpoint need of a handle, a unit's module or a scope that is not the user's API
// (their run state, their unit), and the handle's collectives for the library's own functions.
// The classes name Access their friend. Internal to the library.
#pragma once

#include "fsdp/fully_shard.h"
#include "fsdp/internal/calls.h"
#include "fsdp/internal/comm.h"
#include "fsdp/sharded.h"
#include "fsdp/sharding_scope.h"

#include <ATen/core/Tensor.h>

#include <functional>
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
/// Which ranks detail::all_reduce spans: those of a training step (the data-parallel group, or
/// only the shard group while replicas train apart under LocalSGD / DiLoCo: RunState::step_comm),
/// or every data-parallel rank whatever the mode (a load's byte counts).
enum class Span { kStep, kModel };
/// Reduces `tensor` in place over the ranks of `model` that `span` says (over a mesh with tensor
/// parallelism, then over its tensor-parallel ranks too), after an agreement that every rank of the
/// step is at this call (`what`, equal on every rank): for what the library computes from shards
/// (a global norm, the scaler's overflow, a load's byte counts).
void all_reduce(const FSDPModule& model, at::Tensor& tensor, c10d::ReduceOp op, const std::string& what,
                Span span = Span::kStep);
/// Throws, naming `caller`, while gradients accumulated with gradient sync off wait unreduced
/// (see FSDPModule::set_requires_gradient_sync): stepping or clipping now would miss them.
void check_gradients_reduced(const FSDPModule& model, const char* caller);
/// fsdp::optim::LocalSGD and DiLoCo: from now on (for the model's lifetime) hybrid sharding's
/// replicas train apart between outer steps (RunState::replicas_apart), and the returned group is
/// this rank's replicate group (the ranks holding the same shard in the other replicas), for the
/// outer step. Throws, naming `caller`, unless every unit of `model` is hybrid-sharded (a model
/// without replicas has nothing to train apart), or between a forward and its backward. First
/// every data-parallel rank agrees on `settings` (a fingerprint of the caller's options, `text`
/// in words): a rank with other settings fails every rank at once.
Comm& train_replicas_apart(const FSDPModule& model, const std::string& caller, uint64_t settings,
                           const std::string& text);
/// Runs `fn`, collectives of the model's groups outside its steps (an outer step); a failure marks
/// the model broken (RunState::breaks_on_failure: its ranks no longer agree on the sequence of
/// collectives) and is rethrown.
void breaks_on_failure(const FSDPModule& model, const std::function<void()>& fn);
/// Whether the model's replicas train apart: its steps' sums span one replica.
bool replicas_apart(const FSDPModule& model);
/// The library rescaled the sharded gradients in place on purpose (clip_grad_norm, the scaler's
/// unscale_): not the program's habit the next forward warns about (internal/step_watch.h).
void gradients_rescaled(const FSDPModule& model);

}  // namespace fsdp::detail
