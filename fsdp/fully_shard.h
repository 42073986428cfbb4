// fsdp::fully_shard: wraps a model for fully sharded (ZeRO-3) data-parallel training.
//
//   auto pg = fsdp::init_process_group();
//   auto model = fsdp::fully_shard(GPT(cfg), pg);
//   torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4));
//   auto loss = torch::nn::functional::cross_entropy(model(x), y);
//   loss.backward();   // gradients are reduce-scattered inside backward
//   opt.step();
//   opt.zero_grad();
//
// The returned handle is the root: call the model through it (its forward gathers the root's own
// parameters). Between steps the module's parameters are this rank's shards, with the sharded
// gradients (PyTorch FSDP2's semantics): optimizers, zero_grad, torch::save / torch::load of the
// module work on them as on any LibTorch module. Parameter names are those of the unwrapped model.
#pragma once

#include "fsdp/comm_stats.h"
#include "fsdp/device_mesh.h"
#include "fsdp/export.h"
#include "fsdp/options.h"
#include "fsdp/shard_spec.h"
#include "fsdp/sharded.h"
#include "fsdp/sharding_scope.h"

#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <exception>
#include <memory>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {
namespace detail {
class FSDP_HIDDEN Unit;
struct FSDP_HIDDEN Access;
}  // namespace detail

/// The handle of a wrapped model, the non-template part of FullyShardedModule<Impl>: what the
/// library's functions (fsdp::optim) and the user's code take to mean "the wrapped model". Copies
/// share the model.
class FSDPModule {
 public:
  FSDPModule(std::shared_ptr<torch::nn::Module> module, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
             const FullyShardOptions& options);
  FSDPModule(std::shared_ptr<torch::nn::Module> module, ShardingScope& scope);
  FSDPModule(std::shared_ptr<torch::nn::Module> module, const DeviceMesh& mesh, const FullyShardOptions& options);

  /// This rank's parameters, each once (a tied weight is one tensor): between steps, each is
  /// this rank's rows of the module's parameter, and its .grad the sharded gradient. The same
  /// tensors as model->parameters(), which lists a tied weight under each of its names.
  std::vector<at::Tensor> parameters(bool recurse = true) const;
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const;
  std::vector<at::Tensor> buffers(bool recurse = true) const;
  torch::OrderedDict<std::string, at::Tensor> named_buffers(bool recurse = true) const;
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const;
  /// A wrapped model's dtype and device are fixed (its shards and collectives are laid out for
  /// them): these accept the model's own device and dtype and refuse any other with an error.
  /// Convert the model before fsdp::fully_shard.
  void to(at::Device device, at::ScalarType dtype);
  void to(at::ScalarType dtype);
  void to(at::Device device);
  /// Every unit, root first then in module order, with its flat buffers (fsdp/shard_spec.h).
  std::vector<UnitInfo> units() const;
  /// What this rank holds of every parameter, units in units() order and each unit's parameters in
  /// flat-shard order (fsdp/shard_spec.h). Between steps.
  std::vector<ShardSpec> shard_specs() const;
  /// Elements of all parameters of the full (unsharded) model: with tensor parallelism, every
  /// rank's part of each split parameter (Ψ of the whole model, as the formulas take it).
  int64_t num_parameters() const;
  /// Drops (or zeroes) the sharded gradients: model->zero_grad() and an optimizer's zero_grad()
  /// do the same. Throws when gradients accumulated with sync off were never reduced (see
  /// set_requires_gradient_sync).
  void zero_grad(bool set_to_none = true);
  /// The full (unsharded) parameters and the buffers, by name, as new CPU tensors (with tensor
  /// parallelism, this rank's parts: gathered over the data-parallel ranks only): gathered unit by
  /// unit, so this rank holds at most one unit's gathered buffer beyond the result. Collective:
  /// every rank calls it, between steps. With `rank0_only`, ranks other than 0 get an empty dict
  /// (and keep no more than one unit at a time).
  torch::OrderedDict<std::string, at::Tensor> full_state_dict(bool rank0_only = false) const;
  /// Drops the gradients accumulated with gradient sync off and not reduced yet (they live inside
  /// the library, not in the parameters' .grad, so an optimizer's zero_grad() does not reach them):
  /// the micro-batches since the last backward with sync on are discarded. Between steps.
  void discard_unsynced_gradients();
  /// Tells the library that the shards were written in a way it cannot see (for example values
  /// copied into the parameters' data by a checkpoint loader): the next forward gathers them.
  /// Writes through the parameters (optimizers) and torch::load of the module are noticed without it.
  void mark_shards_written();

  /// Gradient accumulation without communication (FSDP2's set_requires_gradient_sync): while
  /// false, backward leaves each unit's unsharded gradients on its parameters (full size: memory
  /// grows by the model's size) and reduces nothing; the first backward with it true again
  /// reduce-scatters everything accumulated. With it always true, every backward reduces and the
  /// sharded gradients accumulate (less memory, more communication). Both equal plain LibTorch.
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;

  /// A pipeline's controls (FSDP2's, for fsdp::pp): a stage runs the forwards and backwards of
  /// several microbatches per step, and gathering its weights for each of them, or reducing its
  /// gradients after each, would multiply the step's communication by the microbatches.
  ///   set_reshard_after_forward(false): units stay gathered after their forward (the memory of
  ///     ZeRO-2) instead of being gathered again for backward or the next microbatch's forward.
  ///   set_reshard_after_backward(false): units stay gathered after their backward, too.
  ///   unshard() / reshard(): gathers every unit now (the parameters are then the full ones until
  ///     the next forward, backward or reshard) / frees every unit's gathered memory now.
  ///   reduce_gradients(): reduces now what backwards accumulated with gradient sync off (as the
  ///     next backward with sync on would) and reshards every unit: a stage's one reduce-scatter
  ///     per step, after its last microbatch. Then the sharded gradients are the step's.
  /// With both resharding controls off and sync off, a stage's step gathers each unit once and
  /// reduce_gradients reduce-scatters it once. Each is collective (every rank of the model, at the
  /// same point) and called between forwards and backwards, never inside one; defaults: on.
  void set_reshard_after_forward(bool on);
  void set_reshard_after_backward(bool on);
  void unshard();
  void reshard();
  void reduce_gradients();

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
  /// The buffers the library keeps for reuse, beyond held_state_bytes(): all-gather outputs,
  /// unsharded storage and packed gradients of units no longer in flight, kept so that the next
  /// step does not allocate them again (see BufferCacheStats).
  BufferCacheStats buffer_cache_stats() const;
  /// Frees the kept buffers (the next step allocates again), as torch.cuda.empty_cache() does.
  void release_cached_buffers();
  int rank() const;
  int world_size() const;
  /// Whether a step is under way: inside the forward or the backward, or after a forward with
  /// gradients whose backward has not run. What writes the parameters from outside (a checkpoint
  /// load) is refused then: the pending backward would find them changed.
  bool step_in_progress() const;
  /// The process group the model was wrapped over, and the options it was wrapped with (their
  /// timeout bounds every wait): for what works beside the model on the same ranks (checkpoints).
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const;
  const FullyShardOptions& options() const;

 protected:
  friend struct detail::Access;
  /// Returns what the root's mixed-precision policy casts (its forward's inputs and outputs).
  detail::ForwardCasts root_pre_forward();
  void root_post_forward(const std::vector<at::Tensor>& outputs);
  /// Ends the root forward (also when it threw).
  void root_forward_ended();
  /// The handle's operator-> in progress (see RunState::direct_access); `threw`: the call is
  /// ending with an exception, which a direct call of the module's forward causes (a warning then
  /// names the likely cause).
  void begin_access() const;
  void end_access(bool threw) const;

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<detail::Unit> root_;
};

template <typename Impl>
class FullyShardedModule : public FSDPModule {
 public:
  FullyShardedModule(std::shared_ptr<Impl> module, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                     const FullyShardOptions& options)
      : FSDPModule(module, pg, options), impl_(std::move(module)) {}
  FullyShardedModule(std::shared_ptr<Impl> module, ShardingScope& scope)
      : FSDPModule(module, scope), impl_(std::move(module)) {}
  FullyShardedModule(std::shared_ptr<Impl> module, const DeviceMesh& mesh, const FullyShardOptions& options)
      : FSDPModule(module, mesh, options), impl_(std::move(module)) {}

  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    detail::ForwardCasts casts = root_pre_forward();
    struct Ended {
      FullyShardedModule* handle;
      ~Ended() { handle->root_forward_ended(); }
    } ended{this};
    auto out = detail::forward_naming_unit(*root_, casts, [&] {  // errors in the root's own layers name it
      return detail::forward_with_casts(*impl_, casts, std::index_sequence_for<Args...>(), std::forward<Args>(args)...);
    });
    detail::cast_output(out, casts.output);  // mixed precision (fsdp/mixed_precision.h)
    root_post_forward(detail::tensors_of(out));
    return out;
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// What operator-> returns: the module, with the call marked so that a unit reached by calling
  /// the module's forward directly (model->forward(x), around the wrapper) is refused with a hint.
  class Access {
   public:
    Access(Impl* impl, const FullyShardedModule& handle)
        : impl_(impl), handle_(handle), exceptions_(std::uncaught_exceptions()) {
      handle_.begin_access();
    }
    ~Access() { handle_.end_access(std::uncaught_exceptions() > exceptions_); }
    Access(const Access&) = delete;
    Access& operator=(const Access&) = delete;
    Impl* operator->() const { return impl_; }

   private:
    Impl* impl_;
    const FullyShardedModule& handle_;
    int exceptions_;
  };
  Access operator->() const { return Access(impl_.get(), *this); }
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

/// Shards `model` over the data-parallel dimensions of `mesh` (fsdp/device_mesh.h): over its
/// dp_shard ranks, and with dp_replicate too, hybrid sharding (kHybridShard: shard groups are the
/// dp_shard groups, replicated across dp_replicate). options.strategy() applies to those ranks:
/// kFullShard (the default) or kHybridShard with both dimensions above one rank (both mean hybrid
/// then, and shard_group_size must be unset or the dp_shard size); any strategy with only one of
/// them. A model built with fsdp::tp layers over the mesh's "tp" dimension is sharded part by part:
/// each rank's tensor-parallel part over the ranks holding the same part (docs/tensor-parallel.md).
/// rank(), world_size() and process_group() of the handle are then those of the data-parallel
/// group.
template <typename Impl>
FullyShardedModule<Impl> fully_shard(const torch::nn::ModuleHolder<Impl>& model, const DeviceMesh& mesh,
                                     const FullyShardOptions& options = {}) {
  return FullyShardedModule<Impl>(model.ptr(), mesh, options);
}
template <typename Impl>
FullyShardedModule<Impl> fully_shard(std::shared_ptr<Impl> model, const DeviceMesh& mesh,
                                     const FullyShardOptions& options = {}) {
  return FullyShardedModule<Impl>(std::move(model), mesh, options);
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

FSDP_PUBLIC_END
