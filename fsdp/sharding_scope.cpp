#include "fsdp/sharding_scope.h"

#include "fsdp/internal/access.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/mesh_state.h"
#include "fsdp/internal/options_check.h"
#include "fsdp/internal/wrap.h"

#include "fsdp/internal/run_state.h"
#include "fsdp/sharded.h"

#include <algorithm>
#include <vector>

namespace fsdp {
namespace {
// Open scopes of this thread, innermost last. Closing one removes it wherever it is, so scopes
// closed out of order (fully_shard closes them) never leave a closed one current.
thread_local std::vector<ShardingScope*> g_open;
}  // namespace

ShardingScope::ShardingScope(c10::intrusive_ptr<c10d::ProcessGroup> pg, FullyShardOptions options)
    : pg_(std::move(pg)) {
  FSDP_CHECK(pg_, "fsdp::ShardingScope: the process group is null; create one with fsdp::init_process_group()");
  detail::check_options(options, "fsdp::ShardingScope", *pg_);
  state_ = std::make_shared<detail::RunState>(pg_, options);
  g_open.push_back(this);
  open_ = true;
}

ShardingScope::ShardingScope(const DeviceMesh& mesh, FullyShardOptions options) : pg_(mesh.group(kDataDim)) {
  const detail::MeshState& m = detail::mesh_state(mesh);
  options = detail::options_for_mesh(mesh, options);
  detail::check_options(options, "fsdp::ShardingScope", *pg_);
  state_ = std::make_shared<detail::RunState>(pg_, options, m.group_info(kDataDim));
  state_->init_mesh(m);
  g_open.push_back(this);
  open_ = true;
}

ShardingScope::~ShardingScope() {
  close();
}

void ShardingScope::close() {
  if (!open_) return;
  open_ = false;
  g_open.erase(std::remove(g_open.begin(), g_open.end(), this), g_open.end());
}

ShardingScope* ShardingScope::current() {
  return g_open.empty() ? nullptr : g_open.back();
}

namespace detail {

void on_unit_constructed(torch::nn::Module& module, ShardedUnit& unit) {
  ShardingScope* scope = ShardingScope::current();
  if (scope == nullptr || unit.is_sharded()) return;
  shard_on_construction(Access::state(*scope), module, unit);
}

}  // namespace detail
}  // namespace fsdp
