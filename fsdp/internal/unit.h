// One sharding unit: the parameters of a module marked fsdp::Sharded (or of the root, minus its
// units) and their lifecycle: gathered before forward and backward, resharded after, gradients
// reduced as soon as backward has produced them. Its code goes by direction, as FSDP2's
// foreach_all_gather / foreach_reduce do, each path reading the strategy's traits
// (fsdp/strategy.h):
//   unit.cpp          the lifecycle: wrapping, forward and backward hooks, resharding;
//   unit_config.cpp   what its strategy, mixed-precision policy and offload resolve to, and refuse;
//   unit_unshard.cpp  the unshard path: the shard cast (mixed precision) and copied to the device
//                     (offload), all-gathered, copied out into the parameters' full views;
//   unit_reduce.cpp   the reduce path: gradients packed (cast), reduce-scattered (all-reduced in
//                     buckets for kNoShard, bucket_reducer.h; across groups for hybrid), divided,
//                     cast back and copied to the host (offload) as the sharded gradients.
// Its buffers are in unit_buffers.h, what goes into and out of its collectives in gather.h and
// reduce.h, its states in lifecycle.h.
#pragma once

#include "fsdp/internal/bucket_reducer.h"
#include "fsdp/internal/comm.h"
#include "fsdp/internal/cuda_backend.h"
#include "fsdp/internal/lifecycle.h"
#include "fsdp/internal/reduce.h"
#include "fsdp/internal/unit_buffers.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/options.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

class RunState;

/// The name of a unit of several modules: their paths joined with '+' ("ln_f+lm_head").
std::string unit_name(const std::vector<std::string>& member_paths);

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(std::string name, const std::vector<std::pair<std::string, at::Tensor>>& params, std::shared_ptr<RunState> run,
       bool is_root, ShardingStrategy strategy, const MixedPrecisionPolicy& mixed_precision = {});

  /// Shards the parameters (after rank 0's values were broadcast), installs the hooks, frees the
  /// unsharded storage. Called once by fully_shard.
  void init();

  const std::string& name() const { return name_; }
  /// How messages name the unit: its module path, "<root>", or, for a unit sharded while it was
  /// built and not yet given its place by fully_shard, what set_built_label gave.
  std::string label() const;
  /// Gives a unit sharded while it was built its place in the model: the paths of its modules (one
  /// unless modules share it), which prefix their parameters' names; the unit is named by them
  /// joined with '+' ("ln_f+lm_head").
  void rename(const std::vector<std::string>& member_paths);
  /// Modules sharing this unit (ShardedUnit::share_unit_with): how many, and which one each slot's
  /// parameter came from (empty: all from module 0). Before init().
  void set_members(int count, std::vector<int> slot_member);
  int members() const { return members_; }
  /// Which module slot `i`'s parameter came from.
  int slot_member(size_t i) const { return slot_member_.empty() ? 0 : slot_member_[i]; }
  /// The device of the gathered parameters (with offload, not the shards').
  at::Device compute_device() const { return buffers_.unsharded.device(); }
  const std::shared_ptr<RunState>& run_state() const { return run_; }
  /// Until rename: e.g. "BlockImpl #3 (built in a ShardingScope)".
  void set_built_label(std::string label) { built_label_ = std::move(label); }
  bool is_root() const { return is_root_; }
  /// Activation checkpointing (fsdp/activation_checkpoint.h): its forward keeps no activations and
  /// is recomputed in backward, once pre_backward has gathered it. Decided by fully_shard.
  bool checkpoints_activations() const { return checkpoints_activations_; }
  void set_checkpoints_activations(bool on) { checkpoints_activations_ = on; }
  /// What an error about this unit carries: this rank, `operation`, the unit (fsdp/error.h).
  ErrorContext error_context(const std::string& operation = "") const;
  /// The same for an error raised by the library call `api`: its message begins "<api> (rank r): ".
  ErrorContext error_in(const std::string& api) const { return error_context(api).api(api); }
  ShardingStrategy strategy() const { return strategy_; }
  /// Its mixed-precision policy, and the dtypes it resolves to: the shards' (the master weights'),
  /// the gathered parameters' (forward and backward) and the reduction's.
  const MixedPrecisionPolicy& mixed_precision() const { return mp_; }
  at::ScalarType master_dtype() const { return master_dtype_; }
  at::ScalarType param_dtype() const { return param_dtype_; }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }
  /// CPU offload (fsdp/options.h: CPUOffloadPolicy): the shards and sharded gradients live in host
  /// memory, the gathered parameters on the model's device.
  bool offloads() const { return offload_; }
  /// Offload: blocks until the copies this unit queued between host and device have passed, so
  /// that the CPU may read the gradients and write the shards (end of backward, end of a forward
  /// without gradients).
  void wait_host_copies();
  /// What the unit's forward casts its floating-point inputs and outputs to (unset: nothing).
  std::optional<at::ScalarType> input_cast() const;
  std::optional<at::ScalarType> output_cast() const { return mp_.output_dtype(); }
  /// Ranks the unit is sharded over (S) and this rank's place among them.
  int64_t shard_world_size() const { return S_; }
  int64_t shard_rank() const { return shard_rank_; }
  /// How many ranks hold each element of the sharded gradients (1 unless replicated or hybrid).
  int64_t replication() const { return world_size_ / S_; }
  /// Whether the parameters point at their full views now (forward, backward), not their shards.
  bool is_unsharded() const { return state_ == UnitState::kUnsharded; }
  /// Its forward ran with gradients and its backward has not finished (FSDPModule::step_in_progress).
  bool backward_pending() const { return backward_ == BackwardPhase::kRunning || awaits_backward(); }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  int64_t shard_numel() const { return buffers_.shard_numel; }
  /// This rank's rows of every parameter, padded: what the parameters alias between steps.
  /// Undefined for kShardOptimizerState, whose shards alias the full parameters.
  const at::Tensor& flat_shard() const { return buffers_.flat_shard; }
  /// The sharded gradients as one flat buffer (see unit_buffers.h: flat_grad).
  at::Tensor flat_grad() const { return detail::flat_grad(slots_, buffers_.flat_shard, shard_numel(), is_unsharded()); }
  /// The sharded gradient of a slot, wherever it is now (on the parameter between steps).
  const at::Tensor& shard_grad(const ParamSlot& s) const { return shard_grad_of(s, is_unsharded()); }
  /// Whether gradients accumulated with gradient sync off wait to be reduced.
  bool holds_unsynced_grads() const;
  /// Drops them (FSDPModule::discard_unsynced_gradients); ZeRO-1's reduced full gradients stay.
  void drop_unsynced_grads() {
    if (holds_reduced_) return;
    for (auto& s : slots_) {
      full_grad(s) = at::Tensor();
      s.unsynced = at::Tensor();
    }
  }
  /// Refuses a conversion of the unit's parameters to another dtype or device after wrapping.
  /// `converting`: called from the module's own to(), which has converted earlier modules already
  /// (the error then says how to convert them back); false from the handle's, which only checks.
  void check_conversion(const std::optional<at::Device>& device, const std::optional<at::ScalarType>& dtype,
                        bool converting) const;
  /// kShardOptimizerState: the shards were written by something the library cannot see (a loaded
  /// checkpoint): the next forward gathers them. Other strategies always gather from the shards.
  void mark_shards_written() { stale_ = shards_are_rows_of_full(); }
  /// Appends this unit's full parameters, gathered from the shards, as new tensors on `device`
  /// (one all-gather; needs the unit resharded). The same call on every rank of the unit.
  void gather_full(std::vector<at::Tensor>& out, const at::Device& device);
  RunState& state() const { return *run_; }

  /// Issues the all-gather without waiting (prefetch); unshard() completes it.
  void begin_unshard();
  /// All-gathers the parameters (or completes a prefetched gather) and points every user parameter
  /// at its full view.
  void unshard();
  /// Frees the unsharded storage (0 bytes, sharded strategies) and points every user parameter at
  /// its shard, with the sharded gradient.
  void reshard();
  /// After the unit's backward: reshard, or keep the gathered memory while the pipeline's control
  /// says so (FSDPModule::set_reshard_after_backward(false)), the parameters back at their shards.
  void reshard_after_backward();
  /// Keeps the gathered memory (kKeptForBackward) with the parameters back at their shards; a
  /// unit not gathered now stays as it is.
  void keep_gathered();

  // Forward: unshard before, reshard after (or keep the memory for backward) and hook the
  // outputs so the unit is gathered again when its backward begins. `member`: which of the unit's
  // modules runs; a unit of several is gathered before the first of them and resharded after the
  // last (each counted once), as FSDP2's group forward hooks do.
  void pre_forward(int member = 0);
  void post_forward(const std::vector<at::Tensor>& outputs, int member = 0);
  /// A unit some of whose modules did not run in this forward (post_forward waits for all of
  /// them): finished at the end of the model's forward as after its last module.
  bool forward_unfinished() const { return members_run_ != 0; }
  void finish_forward();

  // Backward.
  /// One forward of the unit whose backward is to come (its output hooks hold it).
  struct ForwardToken {
    bool started = false;  // its backward began (one of its outputs' hooks fired)
  };
  void pre_backward(ForwardToken& token);
  void on_grad_ready(size_t slot);
  /// Activation checkpointing: a checkpointed forward of this unit ran; its recompute's backward
  /// ended. Gradients count as complete only once every recompute of this backward has run (a
  /// reentrant recompute accumulates in a nested backward of its own, so a weight used by two
  /// checkpointed forwards sees its gradient hook fire once per forward).
  void checkpoint_began() { ++checkpoints_pending_; }
  void checkpoint_backward_done();
  /// Whether fsdp::fully_shard made this unit part of a model (its settings are then fixed).
  bool wrapped() const;
  /// A checkpointed forward whose graph was dropped before its backward (a forward thrown away):
  /// its recompute will not come.
  void checkpoint_dropped() {
    if (checkpoints_pending_ > 0) --checkpoints_pending_;
  }
  /// At the end of backward: reduce what a partly used unit has, reshard, clear the flags.
  void finalize_backward();
  /// A backward that threw never reached its end: drop its half-done state (next forward).
  void reset_after_failed_backward();
  /// Waits for this unit's reduce-scatter in flight, if any, and sets the sharded gradients.
  void finish_reduce();
  /// Waits for and drops an all-gather prefetched but not used (the unit stays sharded).
  void drop_prefetch();

  /// Appends every tensor of this unit's parameters and gradients that holds memory now: shards,
  /// unsharded parameters and gradients, and the buffers of collectives in flight. Tensors may
  /// share storage (RunState::held_state_bytes counts each storage once).
  void append_held_tensors(std::vector<at::Tensor>& out) const;

 private:
  std::string describe(const char* op) const;
  void name_collectives();  // sets gather_what_ and reduce_what_ from the name and layout
  void enter(UnitState to) { transition(state_, to, label()); }
  // What the strategy's traits say, for this unit.
  bool keeps_full_params() const { return !traits_.params_sharded; }
  /// kShardOptimizerState: full parameters kept, the shards are this rank's rows of them.
  bool shards_are_rows_of_full() const { return !traits_.params_sharded && traits_.shard_over != ShardOver::kNone; }
  /// kNoShard: gradients all-reduced in buckets.
  bool buckets() const { return traits_.reduction == GradReduction::kAllReduceBuckets; }
  /// Mixed precision: the gathered parameters are a cast copy of the shards (even over one rank).
  bool casts_params() const { return param_dtype_ != master_dtype_; }
  /// The gradients go through a cast on their way to the shards (so even alone they are packed).
  bool casts_grads() const { return param_dtype_ != master_dtype_ || reduce_dtype_ != master_dtype_; }

  // Configuration (unit_config.cpp), from the constructor.
  /// Sets the dtypes from the policy and the parameters; refuses what cannot be done.
  void resolve_precision();
  /// Offload: whether the unit offloads, and whether its strategy allows it.
  void resolve_offload();
  /// Offload: the options of the shards' host memory.
  at::TensorOptions host_options(const at::TensorOptions& compute) const;

  // The unshard path (unit_unshard.cpp).
  /// Whether the unsharded buffer holds the parameters now.
  bool memory_gathered() const {
    return keeps_full_params() || state_ == UnitState::kUnsharded || state_ == UnitState::kKeptForBackward;
  }
  /// Whether an all-gather is due: sharded and not gathered, or (kShardOptimizerState) a shard
  /// was updated in place since the last gather.
  bool needs_gather() const;
  /// The all-gather's input: the flat shard itself, or a buffer it is copied into first: ZeRO-1's
  /// rows packed, the shard cast to param_dtype (mixed precision), copied to the device (offload).
  at::Tensor gather_input();
  /// Fills `dst` (on the device, param_dtype) from the flat shard: cast with mixed precision,
  /// copied from the host with offload, on the all-gather's side stream when pinned.
  void copy_shard_in(const at::Tensor& dst);
  /// Over one rank with mixed precision or offload: the copy that stands in for the all-gather,
  /// straight into the unsharded storage (when the gather is issued, so a prefetch overlaps it).
  void copy_alone();
  /// The current stream waits for copy_shard_in's copy (before the gathered parameters are used).
  void wait_shard_in();
  void wait_gather();
  void gather();  // completes (or issues and completes) the all-gather into the unsharded storage
  void use_full_views();
  void use_shard_views();
  /// Takes back the memory lent to the unsharded storage, if any (reshard, a dropped prefetch).
  void free_unsharded_memory();
  /// Between steps: a parameter whose storage was replaced (torch::load uses set_) is copied into
  /// its shard and pointed back at it; one of another shape, dtype or device is refused.
  void adopt_replaced_shards();

  // The reduce path (unit_reduce.cpp).
  at::Tensor& full_grad(ParamSlot& s) { return full_grad_of(s, is_unsharded()); }
  at::Tensor& shard_grad(ParamSlot& s) { return shard_grad_of(s, is_unsharded()); }
  /// Packs the gradients and issues their reduction (or, kNoShard, the buckets still to go).
  void reduce_grads();
  /// kNoShard: launches the buckets that are ready (`all`: every remaining one).
  void launch_buckets(bool all);
  /// The unit's reduction is in flight: the run state bounds how many are.
  void reduction_issued();
  /// The reduction's result, in reduce_dtype, becomes the sharded gradients: divided by the world
  /// size, cast to the master dtype, copied to the host (offload), then added or aliased.
  void place_reduced(at::Tensor reduced);
  /// Offload: the reduced gradients (on the device, master dtype) copied into a new host buffer,
  /// which the sharded gradients then alias; asynchronous from pinned memory until wait_host_copies.
  at::Tensor copy_grads_out(const at::Tensor& reduced);
  /// Drops a reduction of a failed backward (after waiting for it, or failing to).
  void abandon_reduction();
  /// Mixed precision, gradient sync off: moves this backward's full gradients (param_dtype) into
  /// the slots' sums in the master dtype, so that micro-batches accumulate without bf16 rounding.
  void accumulate_unsynced();
  /// Every gradient is there (and every recompute done): reduce (or accumulate without sync), and
  /// reshard unless a frozen parameter's reader may still be ahead.
  void grads_complete();
  /// After a gradient or a recompute: launches kNoShard's ready buckets and completes the unit's
  /// gradients once all are in, unless a recompute is still to come.
  void advance_backward();
  /// Before a reduction: the sums become the full gradients again, plus this backward's.
  void merge_unsynced();

  std::string name_;
  std::string built_label_;
  std::vector<ParamSlot> slots_;
  std::shared_ptr<RunState> run_;
  bool is_root_;
  bool checkpoints_activations_ = false;
  int members_ = 1;
  std::vector<int> slot_member_;  // empty: every slot from module 0
  uint64_t members_run_ = 0;      // bit m: module m ran its forward since the unit was gathered
  ShardingStrategy strategy_;
  const StrategyTraits& traits_;
  MixedPrecisionPolicy mp_;
  at::ScalarType master_dtype_ = at::kFloat, param_dtype_ = at::kFloat, reduce_dtype_ = at::kFloat;
  bool offload_ = false;  // CPU offload: the shards and sharded gradients in host memory
  bool pin_ = false;      // offload to a CUDA device with pinned memory: copies are asynchronous
  // Offload: the last copies queued between the host buffers and the device (the CPU waits for
  // these), the ends of those on side streams (a stream waits for these), and the device buffer
  // the gradients' copy reads, kept until the copy has passed.
  std::unique_ptr<HostSync> shard_copied_, grads_copied_;
  std::unique_ptr<StreamEvent> shard_in_, grads_out_;
  at::Tensor grads_src_;
  Comm* shard_comm_ = nullptr;      // the S ranks this unit is sharded over
  Comm* replicate_comm_ = nullptr;  // kHybridShard: the N/S ranks holding the same shard
  int64_t S_ = 1, shard_rank_ = 0, world_size_ = 1;
  std::string gather_what_, reduce_what_;  // descriptions of this unit's collectives
  UnitBuffers buffers_;
  BufferKind kind_ = BufferKind::kShards;
  at::Tensor unsharded_memory_;  // kShards, while gathered: the pool's buffer lent to the unsharded storage

  UnitState state_ = UnitState::kUnsharded;  // at wrap time the parameters are full
  BackwardPhase backward_ = BackwardPhase::kIdle;
  // The forwards whose backward is still to come, one token each: several, when a pipeline runs
  // the forwards of several microbatches before their backwards (fsdp::pp). A token lives as long
  // as its forward's graph (the output hooks hold it), so a forward whose graph was dropped
  // without a backward no longer counts.
  std::shared_ptr<ForwardToken> forward_token_;        // the current forward's, until finish_forward
  std::vector<std::weak_ptr<ForwardToken>> awaiting_;  // every forward's since, backward not begun
  bool awaits_backward() const;
  /// After this unit's backward: kAwaiting while another forward's backward is still to come.
  BackwardPhase idle_or_awaiting() const { return awaits_backward() ? BackwardPhase::kAwaiting : BackwardPhase::kIdle; }
  // An all-gather in flight (prefetch): its output buffer stays alive until unshard() waits.
  at::Tensor gathered_;
  at::Tensor gather_in_;  // kShardOptimizerState: this rank's rows, packed for the all-gather
  // A reduction in flight: its input, its output and which parameters had a gradient.
  at::Tensor reduce_in_, reduce_out_;
  std::vector<bool> reduce_has_grad_;
  bool reducing_ = false;
  // kShardOptimizerState: the shards may hold values the full parameters do not (an optimizer's
  // step after a reduction, a write before the first forward): forwards gather until the next
  // backward. Set by init() (so that a write before the first forward is seen) and by a reduction.
  bool stale_ = false;
  bool holds_reduced_ = false;  // kShardOptimizerState: the full gradients were reduced (or are being)
  BucketReducer buckets_;       // kNoShard
  size_t grads_expected_ = 0;
  size_t grads_ready_ = 0;
  int checkpoints_pending_ = 0;  // checkpointed forwards whose recompute's backward has not ended
  // The collectives in flight, declared last so that they are destroyed first: a CUDA collective
  // dropped without its wait makes the current stream wait for it as it goes, before its buffers
  // above are freed.
  Pending gather_;
  Pending reduce_;
};

}  // namespace fsdp::detail
