#include "fsdp/sharding_scope.h"

#include "fsdp/sharded.h"
#include "fsdp/state.h"

namespace fsdp {
namespace {
thread_local ShardingScope* g_current = nullptr;
}

ShardingScope::ShardingScope(c10::intrusive_ptr<c10d::ProcessGroup> pg, FullyShardOptions options)
    : pg_(std::move(pg)) {
  TORCH_CHECK(pg_, "fsdp::ShardingScope: the process group is null; create one with fsdp::init_process_group()");
  state_ = std::make_shared<detail::FSDPState>(pg_, options);
  previous_ = g_current;
  g_current = this;
  open_ = true;
}

ShardingScope::~ShardingScope() {
  close();
}

void ShardingScope::close() {
  if (!open_) return;
  open_ = false;
  // Scopes nest: the innermost is closed first (they are objects with automatic lifetime).
  if (g_current == this) g_current = previous_;
}

ShardingScope* ShardingScope::current() {
  return g_current;
}

namespace detail {

void on_unit_constructed(torch::nn::Module& module, ShardedUnit& unit) {
  ShardingScope* scope = ShardingScope::current();
  if (scope == nullptr || unit.fsdp_unit() != nullptr) return;
  shard_on_construction(scope->state(), module, unit);
}

}  // namespace detail
}  // namespace fsdp
