// What all units of one wrapped model share: the process group, the options, the collective
// counts, and the end-of-backward callback. Internal to the core: its data is private, the core's
// files use it through the accessors below, and the libraries around the core never see it (they
// reach a wrapped model through fsdp/internal/core_access.h).
#pragma once

#include "fsdp/export.h"
#include "fsdp/internal/buffer_pool.h"
#include "fsdp/internal/comm.h"
#include "fsdp/internal/step_watch.h"
#include "fsdp/options.h"
#include "fsdp/tensor_split.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

namespace torch::optim {
class Optimizer;
}
namespace fsdp::detail {

class Unit;
struct MeshState;
struct OuterState;  // fsdp/internal/core_access.h
}  // namespace fsdp::detail
// Public (fsdp/sharded.h), so never declared hidden first: declared here as a public header would.
FSDP_PUBLIC_BEGIN
namespace fsdp {
class ShardedUnit;
}  // namespace fsdp
FSDP_PUBLIC_END
namespace fsdp::detail {

class RunState : public std::enable_shared_from_this<RunState> {
 public:
  /// `group`: how errors name `pg` (a mesh's data-parallel group: its members and coordinates).
  RunState(c10::intrusive_ptr<c10d::ProcessGroup> pg, FullyShardOptions options, GroupInfo group = {});

  const FullyShardOptions& options() const { return options_; }
  /// The data-parallel group: every rank holding a shard of the units.
  Comm& comm() { return comm_; }
  const Comm& comm() const { return comm_; }
  /// kHybridShard only (null otherwise): the S consecutive ranks a unit is sharded over, and the
  /// N/S ranks, one per group, that hold the same shard. They share comm's statistics.
  Comm* shard_comm() const { return shard_comm_.get(); }
  Comm* replicate_comm() const { return replicate_comm_.get(); }
  /// The units' all-gather outputs, unsharded storage and packed gradients, reused step after step.
  BufferPool& pool() { return pool_; }
  const BufferPool& pool() const { return pool_; }
  /// Creates shard_comm and replicate_comm for groups of `group_size`; the same call on every rank.
  void init_hybrid(int group_size);
  /// Wrapped over a DeviceMesh (comm: its "dp" group): hybrid's groups are the mesh's dp_shard and
  /// dp_replicate groups (when both have more than one rank), and tp_comm its tp group.
  void init_mesh(const MeshState& mesh);
  /// Wrapped over a DeviceMesh with a tensor-parallel dimension of more than one rank: the mesh's
  /// tp group (sharing comm's statistics; null otherwise), for what is summed over the whole model
  /// (clipping's norm, the scaler's overflow).
  Comm* tp_comm() const { return tp_comm_.get(); }
  /// With tp_comm: the mesh's whole world (sharing comm's statistics), which a checkpoint spans,
  /// since its tensor-parallel ranks hold different parts of the model.
  Comm* mesh_comm() const { return mesh_comm_.get(); }
  /// Each split parameter's TensorSplit (by TensorImpl, fsdp/internal/tensor_splits.cpp).
  using TensorSplits = std::unordered_map<const c10::TensorImpl*, TensorSplit>;
  TensorSplits& tp_splits() { return tp_splits_; }
  const TensorSplits& tp_splits() const { return tp_splits_; }
  int tp_size() const { return tp_comm_ ? tp_comm_->world_size() : 1; }
  /// Set by fsdp::optim::LocalSGD and DiLoCo (through detail::train_replicas_apart), never cleared:
  /// hybrid sharding's replicas (its shard groups) train apart between outer steps. Gradients are
  /// then reduced within the shard group only (its mean: divided by S, not N), and the per-step
  /// agreements and sums (agree, detail::all_reduce: clipping's norm, the scaler's overflow) span
  /// the shard group: nothing crosses replicas until the outer step.
  bool replicas_apart() const { return replicas_apart_; }
  void set_replicas_apart() { replicas_apart_ = true; }
  /// What a checkpoint of replicas that train apart needs of fsdp::optim::LocalSGD / DiLoCo beyond
  /// the model (fsdp/internal/core_access.h; expired once the object is gone).
  const std::weak_ptr<OuterState>& outer() const { return outer_; }
  void set_outer(std::weak_ptr<OuterState> outer) { outer_ = std::move(outer); }
  /// The group a step's agreements and sums span: the shard group when replicas train apart, else
  /// the whole data-parallel group.
  Comm& step_comm() { return replicas_apart_ ? *shard_comm_ : comm_; }
  const Comm& step_comm() const { return replicas_apart_ ? *shard_comm_ : comm_; }
  /// Between the first pre-backward hook of a backward and its end-of-backward callback.
  bool in_backward() const { return callback_queued_; }
  /// False while accumulating gradients without communication (set_requires_gradient_sync).
  bool sync_gradients() const { return sync_gradients_; }
  void set_sync_gradients(bool sync) { sync_gradients_ = sync; }
  /// FSDPModule's pipeline controls: whether units reshard after their forward (when their
  /// strategy does) and after their backward; every unit gathered or resharded now; what sync off
  /// accumulated reduced now, every unit resharded (collective, between forwards and backwards).
  bool reshard_after_forward() const { return reshard_after_forward_; }
  void set_reshard_after_forward(bool on) { reshard_after_forward_ = on; }
  bool reshard_after_backward() const { return reshard_after_backward_; }
  void set_reshard_after_backward(bool on) { reshard_after_backward_ = on; }
  void unshard_all(const char* api);
  void reshard_all(const char* api);
  void reduce_gradients();
  /// Refuses, naming `api`, a call inside a forward or backward.
  void check_between_passes(const char* api) const;
  /// Calls through the handle's operator-> in progress (model->...), and whether the handle's own
  /// forward runs: a unit's forward under the first but not the second was reached by calling the
  /// module's forward directly, around the wrapper.
  int& direct_access() { return direct_access_; }
  bool& in_root_forward() { return in_root_forward_; }
  bool in_root_forward() const { return in_root_forward_; }
  /// The library's own error, raised under operator->, says enough.
  bool& access_error_explained() { return access_error_explained_; }
  /// Units sharded while they were built (ShardingScope), to name them until fully_shard does.
  int& units_built() { return units_built_; }
  /// Units built in a ShardingScope that modules share (ShardedUnit::share_unit_with): their
  /// modules, by member index, for a later merge to attach them all again.
  struct SharedBuiltUnit {
    std::weak_ptr<Unit> unit;
    std::vector<std::weak_ptr<torch::nn::Module>> modules;  // by member index
  };
  std::vector<SharedBuiltUnit>& shared_built_units() { return shared_built_units_; }
  /// The parameters units built in a ShardingScope sharded (TensorImpl), and which unit: one met
  /// again in a later unit (a tie across units) is refused instead of sharded twice.
  /// Weak: a parameter freed since (a model dropped) must not match a new one at its address.
  using BuiltParams =
      std::map<const void*, std::pair<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>, std::string>>;
  BuiltParams& built_params() { return built_params_; }
  /// Within one root forward: the error a unit named last (an outer unit, and the root, leave it
  /// as it is: the same exception object passes through them), and the floating-point dtypes of
  /// the units' outputs (a bit per ScalarType), which the root's own layers then take.
  const void*& named_error() { return named_error_; }
  uint64_t& unit_output_dtypes() { return unit_output_dtypes_; }
  /// Throws, naming `caller`, when units hold gradients accumulated with gradient sync off and never
  /// reduced: zeroing them, clipping or stepping now would silently drop those micro-batches.
  void check_no_unsynced_grads(const char* caller) const;
  /// The units holding gradients accumulated with sync off: how many, and "'h.0', 'h.1', 'h.2' and
  /// 5 more" (empty if none).
  std::pair<size_t, std::string> units_holding_unsynced_grads() const;
  /// Whether any unit holds them (no names: for every step's checks).
  bool holds_unsynced_grads() const;
  /// What the program does between a backward and the next forward (step_watch.h); the library's
  /// own rescaling of the gradients (clipping, the scaler) tells it.
  StepWatch& watch() { return watch_; }

  /// Every unit, root first then in module order. Units are owned by their modules (and the root
  /// unit by the FullyShardedModule handle); the state only observes them.
  std::vector<std::weak_ptr<Unit>>& units() { return units_; }
  const std::vector<std::weak_ptr<Unit>>& units() const { return units_; }
  /// Calls `fn` on every unit still alive, in that order.
  template <typename Fn>
  void for_each_unit(Fn&& fn) const {
    for (const auto& w : units_) {
      if (auto u = w.lock()) fn(*u);
    }
  }

  /// Called by the first pre-backward hook of a backward pass: queues finalize_backward() on the
  /// autograd engine, so that backward() returns with every sharded gradient final.
  void on_backward_begin();
  void finalize_backward();
  /// Called at the start of each root forward: if the last backward threw before its end (its
  /// queued callback then never runs), clear what it left half done.
  void begin_forward();
  /// Every unit's shards (this rank's rows of each parameter, whatever the parameters point at now:
  /// the full views after FSDPModule::unshard), in unit order: what the step watch samples.
  std::vector<at::Tensor> shards() const;
  /// Called at the end of each root forward: the units' order of this forward is what prefetch
  /// follows next time (and in this step's backward, reversed).
  void end_forward();
  /// The units (not the root) whose forward has not run in the root forward under way.
  std::vector<const Unit*> units_not_run_in_this_forward() const;

  /// The model's agreement at a boundary of the step (see docs/design.md, "Ranks on the same
  /// path"; detail::agree in fsdp/internal/core_access.h): every rank must be at the same call (`call`, with `args`
  /// fingerprinting its arguments), with the same collectives of this model issued since the last boundary (the call
  /// log's count and hash). A difference fails every rank, names what each was doing, and marks the
  /// model broken. `vote`: each rank's number, returned for every rank (Comm::agree).
  std::vector<int64_t> agree(Call call, Fingerprint args, const std::string& description, int64_t vote = 0);
  /// Records the unit's place in the forward order and issues the prefetch of the next units
  /// (forward order in forward, reverse order in backward), at most options.prefetch() of them.
  void after_unit_unsharded(Unit& unit, bool backward);
  /// Records `unit`'s reduction in flight (any other was completed before it was packed).
  void after_reduce_issued(Unit& unit);
  /// Completes every reduce-scatter still in flight.
  void finish_reduces();
  /// CPU offload: waits until the units' copies between host and device have passed (see
  /// Unit::wait_host_copies).
  void wait_host_copies();
  /// A collective failed: ranks no longer agree on the sequence of collectives, so every later
  /// forward refuses to run (instead of pairing mismatched collectives). `remedy`, when given,
  /// replaces that explanation in the refusal (another cause: a load in place that failed).
  void mark_broken(const std::string& why, const std::string& remedy = "");
  void check_not_broken() const;
  /// The one place where a failure marks the model broken: runs `fn`; if it throws, runs `undo`
  /// (which drops what the failure left half done, such as buffers a collective may still write),
  /// marks the model broken with the error's text and rethrows it (kNo: swallows it, for the
  /// clean-up of a backward that failed already).
  enum class Rethrow { kYes, kNo };
  template <typename Fn>
  void breaks_on_failure(Fn&& fn, const std::function<void()>& undo = {}, Rethrow rethrow = Rethrow::kYes) {
    try {
      fn();
    } catch (...) {
      if (undo) undo();
      mark_broken(error_text(std::current_exception()));
      if (rethrow == Rethrow::kYes) throw;
    }
  }

  /// Bytes of parameters and gradients all units hold now (each storage once); see
  /// FSDPModule::held_state_bytes.
  int64_t held_state_bytes() const;
  /// While tracking, units call this where their holdings are largest: right after a unit is
  /// gathered (its prefetch issued) and when its gradients are packed for reduction.
  void sample_state() {
    if (track_state_) state_peak_ = std::max(state_peak_, held_state_bytes());
  }
  void track_state_peak(bool on) {
    track_state_ = on;
    if (on) state_peak_ = held_state_bytes();
  }
  int64_t state_peak() const { return state_peak_; }

 private:
  /// The step watch's samples (step_watch.h) at the end of a backward or of reduce_gradients.
  void watch_after_backward();
  const FullyShardOptions options_;
  Comm comm_;
  std::unique_ptr<Comm> shard_comm_, replicate_comm_, tp_comm_, mesh_comm_;
  BufferPool pool_;
  TensorSplits tp_splits_;
  bool replicas_apart_ = false;
  std::weak_ptr<OuterState> outer_;
  bool warned_no_outer_ = false;  // begin_forward's warning, once
  bool sync_gradients_ = true;
  bool reshard_after_forward_ = true, reshard_after_backward_ = true;
  int64_t reductions_ = 0;  // reduce_gradients calls, for their agreements
  int direct_access_ = 0;
  bool in_root_forward_ = false;
  bool access_error_explained_ = false;
  int units_built_ = 0;
  std::vector<SharedBuiltUnit> shared_built_units_;
  BuiltParams built_params_;
  const void* named_error_ = nullptr;
  uint64_t unit_output_dtypes_ = 0;
  StepWatch watch_;
  std::vector<std::weak_ptr<Unit>> units_;
  bool callback_queued_ = false;
  int64_t forwards_ = 0, backwards_ = 0;
  bool track_state_ = false;
  int64_t state_peak_ = 0;
  std::string broken_;
  std::string broken_remedy_;
  std::vector<std::weak_ptr<Unit>> order_;      // units in the order of the last forward
  std::vector<std::weak_ptr<Unit>> recording_;  // ... and of the forward in progress
  std::vector<std::weak_ptr<Unit>> reducing_;   // reduce-scatters in flight, oldest first
};

}  // namespace fsdp::detail
