// The core's own way into its public classes: what fully_shard and the sharding scope need of a
// handle, a unit's module or a scope that is not the user's API (their run state, their unit). The
// classes name Access their friend. Internal to the core (fsdp/): the libraries around it reach a
// wrapped model through fsdp/internal/core_access.h, which is built on this.
#pragma once

#include "fsdp/fully_shard.h"
#include "fsdp/internal/core_access.h"
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

}  // namespace fsdp::detail
