// Wrapping: the walk over the user's module tree that finds the units (fsdp::Sharded modules and
// the root's remaining parameters), checks ties and that every rank built the same model, then
// creates and shards each unit. Used by fsdp::fully_shard and fsdp::ShardingScope.
#pragma once

#include "fsdp/export.h"
#include "fsdp/options.h"

#include <torch/nn/module.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// Public (fsdp/sharded.h), so never declared hidden first: declared here as a public header would.
FSDP_PUBLIC_BEGIN
namespace fsdp {
class ShardedUnit;
}  // namespace fsdp
FSDP_PUBLIC_END

namespace fsdp::detail {

class RunState;
class Unit;
struct MeshState;

/// Marks `root` sharded: one unit per module deriving from fsdp::ShardedUnit, one root unit for
/// the remaining parameters. Checks that every rank has the same model, broadcasts rank 0's
/// weights, shards, and returns the root unit (which also holds the shared state).
/// With `scope_state` (fsdp::ShardingScope), units sharded while the model was built join as they
/// are, and the options are the scope's.
/// With `mesh`, `pg` is its data-parallel group ("dp"): errors name the mesh coordinates, hybrid's
/// groups are the mesh's, and the model's tensor-parallel layers are checked against its tp group.
std::shared_ptr<Unit> shard_model(const std::shared_ptr<torch::nn::Module>& root,
                                  const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const FullyShardOptions& options,
                                  const std::shared_ptr<RunState>& scope_state = nullptr,
                                  const MeshState* mesh = nullptr);

/// Shards one unit right after its constructor returned (inside an fsdp::ShardingScope): checks
/// that every rank built the same unit, shards it with the scope's options and attaches it.
/// Inside an fsdp::ShardingScope, ShardedUnit::share_unit_with on two units sharded already: their
/// parameters gathered and sharded again as one unit, which every module of both then shares.
void merge_built_units(ShardedUnit& first, ShardedUnit& other);

/// The module whose unit `u` shares (ShardedUnit::share_unit_with), its chain of joins followed to
/// the end: the key of the group `u` is in (itself when it joined none).
ShardedUnit* group_lead(ShardedUnit* u);

/// A module's type as messages name it: "BlockImpl" for an fsdp::ShardedImpl<BlockImpl, ...>.
std::string module_type(const torch::nn::Module& module);

/// One unit shard_model's walk found (fsdp/internal/wrap_walk.cpp), before it is made.
struct FoundUnit {
  std::string name;
  ShardedUnit* unit;  // its first module (null: the root)
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::shared_ptr<Unit> built;  // sharded while the model was built (ShardingScope)
  size_t parent = 0;            // the unit containing it (the root: itself)
  // Its modules (more than one: ShardedUnit::share_unit_with), their paths, and the module each
  // parameter came from.
  std::vector<ShardedUnit*> members;
  std::vector<std::string> member_paths;
  std::vector<int> slot_member;
};

/// The units of a model in module order, the root's first.
struct FoundUnits {
  std::vector<std::unique_ptr<FoundUnit>> found;
  std::unordered_map<const c10::TensorImpl*, std::vector<int64_t>> built_shape;  // of parameters sharded already
};

/// shard_model's walk over `root`: the units (each fsdp::ShardedUnit module, those sharing a unit
/// grouped, units built in a scope as they are), each parameter in the one unit it is met in;
/// checks ties, modules met twice and that every module a unit was shared with is in the model.
/// `in_scope`: the model was built in an fsdp::ShardingScope (fsdp::fully_shard(model, scope)).
FoundUnits find_units(torch::nn::Module& root, RunState& state, bool in_scope);

void shard_on_construction(const std::shared_ptr<RunState>& state, torch::nn::Module& module, ShardedUnit& unit);

/// FullyShardOptions::device: the parameters (with any gradients) and buffers of `m` and its
/// submodules moved there in place, except those of units a ShardingScope sharded already (moved
/// as they were built). Nothing when `device` is unset.
void move_to_device(torch::nn::Module& m, const std::optional<at::Device>& device);

}  // namespace fsdp::detail
