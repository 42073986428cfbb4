// What fsdp::optim::LocalSGD and DiLoCo share: the model's replicas set to train apart, this
// rank's parameter shards grouped into fragments, the count of inner steps and which fragment's
// outer step is due after each, and the one exchange across replicas (a mean over the replicate
// group of a flat fp32 copy of some tensors). Internal to fsdp::optim.
#pragma once

#include "fsdp/fully_shard.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "fsdp/internal/core_access.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::optim::detail {

class ReplicaSync {
 public:
  /// A parameter of a unit: this rank's rows (the model's own tensor) at `offset` in the flat shard.
  struct Param {
    int64_t offset = 0;
    at::Tensor local;
    size_t spec = 0;  ///< its index in shard_specs()
  };
  /// One fragment: consecutive units of the model (units() order), synchronized together; the
  /// fragments are runs of about equal size. What
  /// crosses replicas is the units' flat shards, padding included: their sizes are equal on every
  /// rank of a shard group (a parameter's rows are not), so that the group's call logs agree.
  struct Fragment {
    std::vector<at::Tensor> flats;           ///< each unit's flat shard (UnitInfo::flat_shard)
    std::vector<std::vector<Param>> params;  ///< each unit's parameters, at their offsets
    std::string units;                       ///< "units '<root>' to 'h.1'", for messages
    int64_t numel = 0;                       ///< elements of `flats`
  };

  /// Sets the replicas of `model` to train apart (refused, naming `caller`, unless the model is
  /// hybrid-sharded), checks the schedule (`fragments` must divide `sync_every`, and be at most the
  /// units holding parameters), agrees on `settings` (its fingerprint: every data-parallel rank the
  /// same) and gives every replica the first replica's shards (one broadcast per fragment), so that
  /// the replicas start equal.
  ReplicaSync(const FSDPModule& model, std::string caller, int64_t sync_every, int64_t fragments,
              const std::string& settings);

  /// Counts one inner step and returns the fragments whose outer step is due after it: fragment f
  /// after inner steps t with t % H == (f + 1) * H / F (mod H). With one fragment, every H steps.
  std::vector<size_t> count_inner_step();
  /// Inner steps since construction (or as set_inner_steps left them).
  int64_t inner_steps() const { return inner_steps_; }
  void set_inner_steps(int64_t n) { inner_steps_ = n; }
  int64_t sync_every() const { return sync_every_; }

  const std::vector<Fragment>& fragments() const { return fragments_; }
  /// Replicas (the replicate group's size) and this rank's replica.
  int replicas() const;
  int replica() const;

  /// Every replica's `tensors` (fragment `f`'s flat shards, or tensors shaped like them) replaced
  /// by their mean over the replicas: one all-reduce of a flat fp32 copy (sum, then
  /// divided by the replicas), after an agreement over the replicate group that every replica is at
  /// this outer step of this fragment. `what` names it ("LocalSGD's average of the parameters").
  void average(size_t f, const std::vector<at::Tensor>& tensors, const std::string& what);

  /// The overlapped variant: the same exchange begun now and left in flight (one at a time), with
  /// `snapshot`, the fragment's flat shards as they are now (flat fp32). finish_average() waits for
  /// it (bounded by the model's timeout) and returns the mean, flat (nullopt when none is in flight).
  void begin_average(size_t f, const std::vector<at::Tensor>& tensors, const std::string& what);
  struct Finished {
    size_t fragment = 0;
    at::Tensor mean;      ///< laid out as the fragment's flat shards, one after the other
    at::Tensor snapshot;  ///< the fragment's flat shards when the exchange began
  };
  std::optional<Finished> finish_average();
  bool in_flight() const { return in_flight_.has_value(); }
  /// Fragment f's units' parts of `flat` (laid out as their flat shards, one after the other).
  std::vector<at::Tensor> split(size_t f, const at::Tensor& flat) const;
  /// Waits for an exchange still in flight (its tensors must outlive it); never throws.
  ~ReplicaSync();
  ReplicaSync(const ReplicaSync&) = delete;
  ReplicaSync& operator=(const ReplicaSync&) = delete;

  /// For checkpoints (fsdp::detail::outer_state, fsdp/internal/core_access.h): `kind` ("LocalSGD", "DiLoCo"),
  /// `global` the global shards per parameter in shard_specs() order (null: the replicas' mean
  /// now, mean_now()), `outer` the outer optimizer (null: none), `flush` what applies an exchange
  /// in flight. The callbacks' object must not move (LocalSGD and DiLoCo cannot).
  void register_outer(std::string kind, std::function<std::vector<at::Tensor>()> global, torch::optim::Optimizer* outer,
                      std::function<void()> flush);
  /// Every parameter's rows, fp32, averaged over the replicas now (one exchange per fragment), in
  /// shard_specs() order; the parameters stay as they are.
  std::vector<at::Tensor> mean_now();
  /// Parameter `p`'s rows in a flat tensor laid out as its unit's flat shard.
  static at::Tensor view_of(const at::Tensor& flat, const Param& p);

  FSDPModule& model() { return model_; }
  const std::string& caller() const { return caller_; }

 private:
  /// Packs `tensors` into one flat fp32 tensor on their device.
  static at::Tensor pack(const std::vector<at::Tensor>& tensors);
  static void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);

  FSDPModule model_;  // shares the model
  std::string caller_;
  fsdp::detail::Comm* replicate_ = nullptr;  // the model's replicate group (owned by its run state)
  int64_t sync_every_;
  int64_t inner_steps_ = 0;
  int64_t outer_steps_ = 0;  // outer exchanges so far, any fragment (named in the agreement)
  std::vector<Fragment> fragments_;
  struct InFlight {
    size_t fragment = 0;
    at::Tensor flat, snapshot;
    fsdp::detail::Pending pending;
  };
  std::optional<InFlight> in_flight_;
  std::shared_ptr<fsdp::detail::OuterState> registration_;  // the model observes it (set_outer_state)
  /// The agreement over the replicate group before an exchange, and the exchange's name.
  std::string agree(size_t f, const at::Tensor& flat, const std::string& what);
};

}  // namespace fsdp::optim::detail
