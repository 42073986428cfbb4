// What all units of one wrapped model share: the process group, the options, the collective
// counts, and the end-of-backward callback. Internal to the library.
#pragma once

#include "fsdp/internal/buffer_pool.h"
#include "fsdp/internal/comm.h"
#include "fsdp/options.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace fsdp::detail {

class Unit;
}  // namespace fsdp::detail
namespace fsdp {
class ShardedUnit;
}
namespace fsdp::detail {

class RunState : public std::enable_shared_from_this<RunState> {
 public:
  RunState(c10::intrusive_ptr<c10d::ProcessGroup> pg, FullyShardOptions options);

  const FullyShardOptions options;
  Comm comm;
  /// kHybridShard only (null otherwise): the S consecutive ranks a unit is sharded over, and the
  /// N/S ranks, one per group, that hold the same shard. They share comm's statistics.
  std::unique_ptr<Comm> shard_comm, replicate_comm;
  /// The units' all-gather outputs, unsharded storage and packed gradients, reused step after step.
  BufferPool pool;
  /// Creates shard_comm and replicate_comm for groups of `group_size`; the same call on every rank.
  void init_hybrid(int group_size);
  /// Between the first pre-backward hook of a backward and its end-of-backward callback.
  bool in_backward() const { return callback_queued_; }
  /// False while accumulating gradients without communication (set_requires_gradient_sync).
  bool sync_gradients = true;
  /// Calls through the handle's operator-> in progress (model->...), and whether the handle's own
  /// forward runs: a unit's forward under the first but not the second was reached by calling the
  /// module's forward directly, around the wrapper.
  int direct_access = 0;
  /// Units sharded while they were built (ShardingScope), to name them until fully_shard does.
  int units_built = 0;
  bool in_root_forward = false;
  bool access_error_explained = false;  // the library's own error, raised under operator->, says enough
  /// Throws, naming `caller`, when units hold gradients accumulated with gradient sync off and never
  /// reduced: zeroing them, clipping or stepping now would silently drop those micro-batches.
  void check_no_unsynced_grads(const char* caller) const;

  /// Every unit, root first then in module order. Units are owned by their modules (and the root
  /// unit by the FullyShardedModule handle); the state only observes them.
  std::vector<std::weak_ptr<Unit>> groups;

  /// Called by the first pre-backward hook of a backward pass: queues finalize_backward() on the
  /// autograd engine, so that backward() returns with every sharded gradient final.
  void on_backward_begin();
  void finalize_backward();
  /// Called at the start of each root forward: if the last backward threw before its end (its
  /// queued callback then never runs), clear what it left half done.
  void begin_forward();
  /// Called at the end of each root forward: the units' order of this forward is what prefetch
  /// follows next time (and in this step's backward, reversed).
  void end_forward();

  /// The cross-rank checks at the boundaries of the step (see docs/design.md, "Ranks on the same
  /// path"): every rank must be at the same call, with the same collectives issued since the last
  /// check. A difference fails every rank, names what each was doing, and marks the model broken.
  enum class Boundary : int64_t {
    kForward = 101,
    kBackwardBegin = 102,
    kBackwardEnd = 103,
    kModelCollective = 104,
    kFullStateDict = 105
  };
  void check_boundary(Boundary b, int64_t a, int64_t c, const std::string& description);
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
  /// forward refuses to run (instead of pairing mismatched collectives).
  void mark_broken(const std::string& why);
  void check_not_broken() const;

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
  bool callback_queued_ = false;
  int64_t forwards_ = 0, backwards_ = 0;
  bool track_state_ = false;
  int64_t state_peak_ = 0;
  std::string broken_;
  std::vector<std::weak_ptr<Unit>> order_;      // units in the order of the last forward
  std::vector<std::weak_ptr<Unit>> recording_;  // ... and of the forward in progress
  std::vector<std::weak_ptr<Unit>> reducing_;   // reduce-scatters in flight, oldest first
};

}  // namespace fsdp::detail
