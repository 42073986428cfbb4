// One sharding unit: the parameters of a module marked fsdp::Sharded (or of the root, minus its
// units), their dim-0 shards in one flat buffer, and the unshard / reshard / reduce-scatter steps.
// Internal to the library; see docs/design.md for the reasons behind the layout.
#pragma once

#include "fsdp/collectives.h"
#include "fsdp/options.h"
#include "fsdp/shard_layout.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

class FSDPState;

/// Where one parameter lives in its unit, sharded over S ranks (the world, a hybrid group, or 1
/// when replicated) by the row layout of fsdp/shard_layout.h.
struct ParamSlot {
  std::string name;  ///< fully qualified name in the root module
  /// The user's parameter (the module's own tensor): between steps it points at `sharded` and its
  /// .grad is the sharded gradient (what an optimizer on model->parameters() updates); while its
  /// unit is unsharded (forward, backward) it points at `unsharded` and its .grad is the full one.
  at::Tensor param;
  at::Tensor sharded;    ///< this rank's rows (a plain alias of the unit's shard memory)
  at::Tensor unsharded;  ///< the full view `param` points at while unsharded
  /// Where the gradient of the other shape waits: the sharded gradient while `param` is full
  /// (forward, backward), the full gradient (accumulated without sync, or ZeRO-1's) while `param`
  /// is its shard.
  at::Tensor shard_grad, full_grad;
  std::vector<int64_t> shape;
  RowLayout layout;        ///< its rows over the unit's shard ranks (fsdp/shard_layout.h)
  int64_t local_rows = 0;  ///< rows this rank holds: layout.local_rows(shard rank)
  int64_t offset = 0;      ///< start of this parameter's c rows in the flat shard
  int64_t padded_numel() const { return layout.padded_numel(); }
  bool requires_grad = false;
  bool grad_ready = false;
  /// Kept alive on purpose: autograd holds a parameter's AccumulateGrad node only weakly, and a
  /// re-created node would have neither our hook nor the full shape it must validate against.
  std::shared_ptr<torch::autograd::Node> grad_accumulator;
};

class ParamGroup : public std::enable_shared_from_this<ParamGroup> {
 public:
  ParamGroup(std::string name, const std::vector<std::pair<std::string, at::Tensor>>& params,
             std::shared_ptr<FSDPState> state, bool is_root, ShardingStrategy strategy);

  /// Shards the parameters (after rank 0's values were broadcast), installs the hooks, frees the
  /// unsharded storage. Called once by fully_shard.
  void init();

  const std::string& name() const { return name_; }
  /// Gives a unit sharded while it was built its place in the model: module path and parameter names.
  void rename(const std::string& path);
  bool is_root() const { return is_root_; }
  ShardingStrategy strategy() const { return strategy_; }
  /// Ranks the unit is sharded over (S) and this rank's place among them.
  int64_t shard_world_size() const { return S_; }
  int64_t shard_rank() const { return shard_rank_; }
  /// How many ranks hold each element of the sharded gradients (1 unless replicated or hybrid).
  int64_t replication() const;
  /// Whether the parameters point at their full views now (forward, backward), not their shards.
  bool is_unsharded() const { return full_views_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  int64_t shard_numel() const { return shard_numel_; }
  /// This rank's rows of every parameter, padded: what the parameters alias between steps.
  /// Undefined for kShardOptimizerState, whose shards alias the full parameters.
  const at::Tensor& flat_shard() const { return flat_shard_; }

  /// Issues the all-gather without waiting (prefetch); unshard() completes it.
  void begin_unshard();
  /// All-gathers the parameters (or completes a prefetched gather) and points every user parameter
  /// at its full view.
  void unshard();
  /// Frees the unsharded storage (0 bytes, sharded strategies) and points every user parameter at
  /// its shard, with the sharded gradient.
  void reshard();
  /// The sharded gradient of a slot, wherever it is now (on the parameter between steps).
  at::Tensor& shard_grad(ParamSlot& s) { return full_views_ ? s.shard_grad : s.param.mutable_grad(); }
  const at::Tensor& shard_grad(const ParamSlot& s) const { return full_views_ ? s.shard_grad : s.param.grad(); }
  /// The sharded gradients as one flat buffer in the flat shard's layout, when every parameter
  /// with elements has its gradient there at its offset; undefined otherwise.
  at::Tensor flat_grad() const;
  /// Whether gradients accumulated with gradient sync off wait to be reduced.
  bool holds_unsynced_grads() const;
  /// Refuses a conversion of the unit's parameters to another dtype or device after wrapping.
  void check_conversion(const std::optional<at::Device>& device, const std::optional<at::ScalarType>& dtype) const;
  /// kShardOptimizerState: the shards were written by something the library cannot see (a loaded
  /// checkpoint): the next forward gathers them. Other strategies always gather from the shards.
  void mark_shards_written() { stale_ = shards_are_rows_of_full(); }
  /// Appends this unit's full parameters, gathered from the shards, as new tensors on `device`
  /// (one all-gather; needs the unit resharded). The same call on every rank of the unit.
  void gather_full(std::vector<at::Tensor>& out, const at::Device& device);

  // Forward: unshard before, reshard after (unless told otherwise) and hook the outputs so the
  // unit is gathered again when its backward begins.
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  FSDPState& state() const { return *state_; }

  // Backward.
  void pre_backward();
  void on_grad_ready(size_t slot);
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
  /// share storage (FSDPState::held_state_bytes counts each storage once).
  void append_held_tensors(std::vector<at::Tensor>& out) const;

 private:
  std::string describe(const char* op) const;
  void name_collectives();  // sets gather_what_ and reduce_what_ from the name and layout
  void wait_gather();
  void gather();  // completes (or issues and completes) the all-gather into the unsharded storage
  bool keeps_full_params() const { return !traits_.params_sharded; }
  /// kShardOptimizerState: full parameters kept, the shards are this rank's rows of them.
  bool shards_are_rows_of_full() const { return !traits_.params_sharded && traits_.shard_over != ShardOver::kNone; }
  /// kNoShard: gradients all-reduced in buckets.
  bool buckets() const { return traits_.reduction == GradReduction::kAllReduceBuckets; }
  /// Whether an all-gather is due: sharded and not gathered, or (kShardOptimizerState) a shard
  /// was updated in place since the last gather.
  bool needs_gather() const;
  void make_buckets();
  void launch_buckets(bool all);
  void set_sharded_grads(const at::Tensor& flat_grad);
  /// Points the parameters at their full views (moving the sharded gradients aside) or back at
  /// their shards (the full gradients aside). Only the pointers move; no memory is gathered.
  void use_full_views();
  void use_shard_views();
  /// Between steps: a parameter whose storage was replaced (torch::load uses set_) is copied into
  /// its shard and pointed back at it; one of another shape, dtype or device is refused.
  void adopt_replaced_shards();
  at::Tensor& full_grad(ParamSlot& s) { return full_views_ ? s.param.mutable_grad() : s.full_grad; }
  void set_full_grad_rows(const at::Tensor& flat_grad);
  Comm* shard_comm_ = nullptr;      // the S ranks this unit is sharded over
  Comm* replicate_comm_ = nullptr;  // kHybridShard: the N/S ranks holding the same shard
  int64_t S_ = 1, shard_rank_ = 0;
  std::string gather_what_, reduce_what_;  // descriptions of this unit's collectives
  void reduce_grads();

  std::string name_;
  std::vector<ParamSlot> slots_;
  std::shared_ptr<FSDPState> state_;
  bool is_root_;
  ShardingStrategy strategy_;
  const StrategyTraits& traits_;
  int64_t shard_numel_ = 0;
  at::Tensor flat_shard_;      // [shard_numel]: this rank's rows of every parameter, padded
  at::Tensor unsharded_;       // [W * shard_numel], parameter-major; storage resized to 0 when resharded
  bool unsharded_now_ = true;  // the unsharded storage holds the gathered parameters
  bool full_views_ = true;     // the parameters point at their full views
  // An all-gather in flight (prefetch): its output buffer stays alive until unshard() waits.
  Pending gather_;
  at::Tensor gathered_;
  bool gathering_ = false;
  // A reduce-scatter in flight: its input, its output and which parameters had a gradient.
  Pending reduce_;
  at::Tensor reduce_in_, reduce_out_;
  std::vector<bool> reduce_has_grad_;
  bool reducing_ = false;
  at::Tensor gather_in_;        // kShardOptimizerState: this rank's rows, packed for the all-gather
  bool stale_ = false;          // kShardOptimizerState: reduced; gathered by forwards until the next backward
  bool holds_reduced_ = false;  // kShardOptimizerState: the full gradients were reduced (or are being)
  // kNoShard: buckets are contiguous ranges of slots [first, last), in reverse order (the order
  // backward produces gradients); each is all-reduced in place in reduce_out_.
  struct Bucket {
    size_t first = 0, last = 0;
    int64_t offset = 0, numel = 0;
  };
  std::vector<Bucket> buckets_;
  std::vector<Pending> bucket_work_;
  size_t next_bucket_ = 0;
  bool awaiting_backward_ = false;  // outputs hooked, backward not yet begun
  bool in_backward_ = false;
  size_t grads_expected_ = 0;
  size_t grads_ready_ = 0;
};

}  // namespace fsdp::detail
