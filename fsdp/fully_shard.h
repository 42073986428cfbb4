// fsdp::fully_shard: wraps a model for fully sharded (ZeRO-3) data-parallel training.
//
//   auto pg = fsdp::init_process_group();
//   auto model = fsdp::fully_shard(GPT(cfg), pg);
//   torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(3e-4));
//   auto loss = torch::nn::functional::cross_entropy(model(x), y);
//   loss.backward();   // gradients are reduce-scattered inside backward
//   opt.step();
//
// The returned handle is the root: call the model through it (its forward gathers the root's own
// parameters). Parameter names are those of the unwrapped model.
#pragma once

#include "fsdp/options.h"
#include "fsdp/param_group.h"
#include "fsdp/sharded.h"
#include "fsdp/sharding_scope.h"
#include "fsdp/state.h"

#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp {

/// A unit's layout on this rank, for inspection and tests.
struct UnitInfo {
  std::string name;  ///< module path of the unit ("" for the root unit)
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int64_t shard_numel = 0;       ///< elements of this rank's flat shard, padding included
  int64_t shard_rank = 0;        ///< this rank's place among the ranks the unit is sharded over
  int64_t shard_world_size = 1;  ///< those ranks: N, S (hybrid) or 1 (replicated)
  bool unsharded = false;
  std::vector<std::string> params;
};

namespace detail {
/// The non-template part of FullyShardedModule.
class RootHandle {
 public:
  RootHandle(std::shared_ptr<torch::nn::Module> module, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
             const FullyShardOptions& options);
  RootHandle(std::shared_ptr<torch::nn::Module> module, ShardingScope& scope);

  std::vector<at::Tensor> sharded_parameters() const;
  torch::OrderedDict<std::string, at::Tensor> named_sharded_parameters() const;
  std::vector<UnitInfo> units() const;
  /// Elements of all parameters of the full (unsharded) model.
  int64_t num_parameters() const;
  /// Drops (or zeroes) the sharded gradients, like an optimizer's zero_grad(). The model's own
  /// `model->zero_grad()` reaches only the unsharded parameters, which hold no gradient between
  /// steps.
  void zero_grad(bool set_to_none = true);

  /// Gradient accumulation without communication (FSDP2's set_requires_gradient_sync): while
  /// false, backward leaves each unit's unsharded gradients on its parameters (full size: memory
  /// grows by the model's size) and reduces nothing; the first backward with it true again
  /// reduce-scatters everything accumulated. With it always true, every backward reduces and the
  /// sharded gradients accumulate (less memory, more communication). Both equal plain LibTorch.
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;

  const CommStats& comm_stats() const;
  void reset_comm_stats();

  /// Bytes of model parameters and gradients this rank holds now: the shards, whatever is
  /// unsharded at the moment (gathered parameters, full gradients) and the library's buffers for
  /// collectives in flight, each storage once. Optimizer state is the optimizer's own (see
  /// fsdp::optim::state_bytes). Activations are not model state and are not counted.
  int64_t held_state_bytes() const;
  /// Peak of held_state_bytes() during forward and backward: when on, every unit samples it where
  /// its holdings are largest (after its gather completes, its prefetch issued; when its
  /// gradients are packed for reduction). Costs a walk over the units at each sample, so it is
  /// off unless asked for; track_state_peak(true) also restarts the peak from the current value,
  /// track_state_peak(false) keeps the peak seen.
  void track_state_peak(bool on);
  int64_t state_peak_bytes() const;
  int rank() const;
  int world_size() const;
  /// The shared state of all units (the library's own use: clipping, optimizers).
  FSDPState& state() const { return root_->state(); }

 protected:
  void root_pre_forward();
  void root_post_forward(const std::vector<at::Tensor>& outputs);

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ParamGroup> root_;
};
}  // namespace detail

template <typename Impl>
class FullyShardedModule : public detail::RootHandle {
 public:
  FullyShardedModule(std::shared_ptr<Impl> module, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                     const FullyShardOptions& options)
      : RootHandle(module, pg, options), impl_(std::move(module)) {}
  FullyShardedModule(std::shared_ptr<Impl> module, ShardingScope& scope)
      : RootHandle(module, scope), impl_(std::move(module)) {}

  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    root_pre_forward();
    auto out = impl_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(out, tensors);
    root_post_forward(tensors);
    return out;
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  Impl* operator->() const { return impl_.get(); }
  Impl& operator*() const { return *impl_; }
  const std::shared_ptr<Impl>& module() const { return impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

/// Shards `model` over `pg`. Every rank must build the same model; rank 0's initial weights are
/// broadcast (see FullyShardOptions::sync_module_states).
template <typename Impl>
FullyShardedModule<Impl> fully_shard(const torch::nn::ModuleHolder<Impl>& model,
                                     const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                     const FullyShardOptions& options = {}) {
  return FullyShardedModule<Impl>(model.ptr(), pg, options);
}
template <typename Impl>
FullyShardedModule<Impl> fully_shard(std::shared_ptr<Impl> model, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                     const FullyShardOptions& options = {}) {
  return FullyShardedModule<Impl>(std::move(model), pg, options);
}

/// Wraps a model built inside `scope` (see sharding_scope.h): its units are sharded already; the
/// root's own parameters are sharded now, with the scope's process group and options. Closes the
/// scope.
template <typename Impl>
FullyShardedModule<Impl> fully_shard(const torch::nn::ModuleHolder<Impl>& model, ShardingScope& scope) {
  return FullyShardedModule<Impl>(model.ptr(), scope);
}
template <typename Impl>
FullyShardedModule<Impl> fully_shard(std::shared_ptr<Impl> model, ShardingScope& scope) {
  return FullyShardedModule<Impl>(std::move(model), scope);
}

}  // namespace fsdp
