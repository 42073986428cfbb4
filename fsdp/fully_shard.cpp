#include "fsdp/fully_shard.h"

#include <c10/core/GradMode.h>

#include <unordered_map>
#include <unordered_set>

namespace fsdp::detail {

RootHandle::RootHandle(std::shared_ptr<torch::nn::Module> module, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                       const FullyShardOptions& options)
    : module_(std::move(module)), root_(shard_model(module_, pg, options)) {}

RootHandle::RootHandle(std::shared_ptr<torch::nn::Module> module, ShardingScope& scope) : module_(std::move(module)) {
  TORCH_CHECK(scope.state() != nullptr, "fsdp::fully_shard: the ShardingScope has no state");
  TORCH_CHECK(scope.state()->groups.empty(), "fsdp::fully_shard (rank ", scope.state()->comm.rank(),
              "): this ShardingScope already wrapped a model; open one scope per model.");
  scope.close();
  root_ = shard_model(module_, scope.process_group(), scope.state()->options, scope.state());
}

void RootHandle::root_pre_forward() {
  root_->state().begin_forward();
  root_->pre_forward();
}

void RootHandle::root_post_forward(const std::vector<at::Tensor>& outputs) {
  root_->post_forward(outputs);
  root_->state().end_forward();
}

torch::OrderedDict<std::string, at::Tensor> RootHandle::named_sharded_parameters() const {
  std::unordered_map<const c10::TensorImpl*, at::Tensor> sharded;
  for (auto& w : root_->state().groups) {
    if (auto g = w.lock()) {
      for (const auto& s : g->slots()) sharded.emplace(s.param.unsafeGetTensorImpl(), s.sharded);
    }
  }
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& kv : module_->named_parameters()) {
    auto it = sharded.find(kv.value().unsafeGetTensorImpl());
    TORCH_INTERNAL_ASSERT(it != sharded.end(), "parameter ", kv.key(), " has no shard");
    out.insert(kv.key(), it->second);
  }
  return out;
}

std::vector<at::Tensor> RootHandle::sharded_parameters() const {
  // Once each: a weight tied inside a unit appears under two names but is one tensor, and an
  // optimizer given it twice would step it twice.
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& t : named_sharded_parameters().values()) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

std::vector<UnitInfo> RootHandle::units() const {
  std::vector<UnitInfo> out;
  for (auto& w : root_->state().groups) {
    if (auto g = w.lock()) {
      UnitInfo u;
      u.name = g->name();
      u.strategy = g->strategy();
      u.shard_numel = g->shard_numel();
      u.shard_rank = g->shard_rank();
      u.shard_world_size = g->shard_world_size();
      u.unsharded = g->is_unsharded();
      for (const auto& s : g->slots()) u.params.push_back(s.name);
      out.push_back(std::move(u));
    }
  }
  return out;
}

void RootHandle::zero_grad(bool set_to_none) {
  for (auto& p : sharded_parameters()) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      g = at::Tensor();
    } else {
      g.detach_();
      g.zero_();
    }
  }
}

void RootHandle::set_requires_gradient_sync(bool sync) {
  root_->state().sync_gradients = sync;
}
bool RootHandle::requires_gradient_sync() const {
  return root_->state().sync_gradients;
}

int64_t RootHandle::num_parameters() const {
  int64_t n = 0;
  for (auto& w : root_->state().groups) {
    if (auto g = w.lock()) {
      for (const auto& s : g->slots()) n += s.rows * s.row_numel;
    }
  }
  return n;
}

const CommStats& RootHandle::comm_stats() const {
  return root_->state().comm.stats();
}
int64_t RootHandle::held_state_bytes() const {
  return root_->state().held_state_bytes();
}
void RootHandle::track_state_peak(bool on) {
  root_->state().track_state_peak(on);
}
int64_t RootHandle::state_peak_bytes() const {
  return root_->state().state_peak();
}
void RootHandle::reset_comm_stats() {
  root_->state().comm.stats() = CommStats{};
}
int RootHandle::rank() const {
  return root_->state().comm.rank();
}
int RootHandle::world_size() const {
  return root_->state().comm.world_size();
}

}  // namespace fsdp::detail
