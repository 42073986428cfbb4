// One sharding unit: the parameters of a module marked fsdp::Sharded (or of the root, minus its
// units), their dim-0 shards in one flat buffer, and the unshard / reshard / reduce-scatter steps.
// Internal to the library; see docs/design.md for the reasons behind the layout.
#pragma once

#include "fsdp/collectives.h"
#include "fsdp/options.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

class FSDPState;

/// Where one parameter lives in its unit. Sharded over S ranks (the world, a hybrid group, or 1 when
/// replicated) with c = ceil(rows / S), shard rank r owns rows [r*c, min((r+1)*c, rows)), possibly
/// none; its shard is padded to c rows in the flat buffer.
struct ParamSlot {
  std::string name;      ///< fully qualified name in the root module
  at::Tensor param;      ///< the user's parameter: a view into the unsharded buffer, or empty
  at::Tensor sharded;    ///< this rank's rows: a leaf that optimizers update in place
  at::Tensor unsharded;  ///< the view `param` points at while unsharded
  std::vector<int64_t> shape;
  int64_t rows = 0;        ///< dim 0 (1 for a scalar)
  int64_t row_numel = 0;   ///< elements per row
  int64_t chunk_rows = 0;  ///< c
  int64_t local_rows = 0;  ///< rows this rank owns
  int64_t offset = 0;      ///< start of this parameter's shard in the flat shard buffer
  int64_t padded_numel() const { return chunk_rows * row_numel; }
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
  bool is_unsharded() const { return unsharded_now_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  int64_t shard_numel() const { return shard_numel_; }
  /// This rank's rows of every parameter, padded: what the sharded parameters alias. Undefined for
  /// kShardOptimizerState, whose shards alias the full parameters.
  const at::Tensor& flat_shard() const { return flat_shard_; }

  /// Issues the all-gather without waiting (prefetch); unshard() completes it.
  void begin_unshard();
  /// All-gathers the parameters (or completes a prefetched gather) and points every user parameter
  /// at its full view.
  void unshard();
  /// Frees the unsharded storage (0 bytes) and points every user parameter at an empty tensor.
  void reshard();

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
  bool keeps_full_params() const {
    return strategy_ == ShardingStrategy::kShardOptimizerState || strategy_ == ShardingStrategy::kNoShard;
  }
  /// Whether an all-gather is due: sharded and not gathered, or (kShardOptimizerState) a shard
  /// was updated in place since the last gather.
  bool needs_gather() const;
  void make_buckets();
  void launch_buckets(bool all);
  void set_sharded_grads(const at::Tensor& flat_grad);
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
  int64_t shard_numel_ = 0;
  at::Tensor flat_shard_;   // [shard_numel]: this rank's rows of every parameter, padded
  at::Tensor unsharded_;    // [W * shard_numel], parameter-major; storage resized to 0 when resharded
  at::Tensor placeholder_;  // what parameters point at while resharded
  bool unsharded_now_ = true;
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
