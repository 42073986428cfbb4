// A unit's mixed precision (fsdp/mixed_precision.h): which dtypes its policy resolves to, what it
// refuses, and the copy that stands in for the all-gather over one rank. The casts themselves sit
// where the data moves: the shard is cast into the all-gather's input (Unit::copy_shard_in), the
// gradients into the reduce-scatter's packed input (Unit::reduce_grads), the sum back to the
// master dtype when the reduction completes (Unit::finish_reduce).
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/ScalarType.h>

namespace fsdp::detail {

void Unit::resolve_precision() {
  if (slots_.empty()) return;
  master_dtype_ = slots_.front().param.scalar_type();
  param_dtype_ = mp_.param_dtype().value_or(master_dtype_);
  reduce_dtype_ = mp_.reduce_dtype().value_or(master_dtype_);
  const int rank = run_->comm.rank();
  for (auto [what, dtype] : {std::pair<const char*, std::optional<at::ScalarType>>{"param_dtype", mp_.param_dtype()},
                             {"reduce_dtype", mp_.reduce_dtype()},
                             {"output_dtype", mp_.output_dtype()}}) {
    const bool usable =
        !dtype || *dtype == at::kBFloat16 || *dtype == at::kHalf || *dtype == at::kFloat || *dtype == at::kDouble;
    TORCH_CHECK(usable, "fsdp::fully_shard (rank ", rank, "): unit '", label(), "': MixedPrecisionPolicy::", what,
                " is ", *dtype,
                ", which mixed precision does not compute in. Use torch::kBFloat16, torch::kFloat16 or "
                "torch::kFloat32.");
  }
  if (!casts_grads()) return;
  TORCH_CHECK(at::isFloatingType(master_dtype_), "fsdp::fully_shard (rank ", rank, "): unit '", label(),
              "' has parameters of dtype ", master_dtype_, " ('", slots_.front().name,
              "'), which a MixedPrecisionPolicy cannot cast. Give this unit a policy without param_dtype and "
              "reduce_dtype (set_mixed_precision(fsdp::MixedPrecisionPolicy())).");
  TORCH_CHECK(!casts_params() || traits_.params_sharded, "fsdp::fully_shard (rank ", rank, "): unit '", label(),
              "' is ", to_string(strategy_), " with MixedPrecisionPolicy::param_dtype ", param_dtype_,
              " (its parameters are ", master_dtype_,
              "). Mixed-precision compute needs a strategy that gathers the parameters from their shards: "
              "kFullShard, kShardGradOp or kHybridShard (at world size 1 they cost what kNoShard does). "
              "reduce_dtype and output_dtype work with every strategy.");
}

std::optional<at::ScalarType> Unit::input_cast() const {
  if (!mp_.cast_forward_inputs() || !mp_.param_dtype() || slots_.empty()) return std::nullopt;
  return param_dtype_;
}

void Unit::copy_alone() {
  // Over one rank the gathered parameters would be the shard itself; with mixed precision they are
  // its cast copy, with offload its copy on the device, in the unsharded storage, which exists only
  // while the unit is gathered (from the moment the gather is issued, as a gather's output).
  unsharded_memory_ = run_->pool.take(shard_numel(), buffers_.unsharded.options());
  lend_memory(buffers_.unsharded, unsharded_memory_);
  copy_shard_in(buffers_.unsharded);
}

void Unit::accumulate_unsynced() {
  // FSDP2 likewise accumulates unsynced gradients in a wider dtype (its reduce_dtype); here the
  // master dtype, so that the sum of M micro-batches rounds once per addition in fp32, as plain
  // LibTorch accumulating fp32 gradients would, whatever reduce_dtype is.
  if (!casts_params()) return;
  at::NoGradGuard no_grad;
  for (auto& s : slots_) {
    at::Tensor& g = full_grad(s);
    if (!g.defined()) continue;
    if (s.unsynced.defined()) {
      s.unsynced.add_(g);
    } else {
      s.unsynced = g.to(master_dtype_);
    }
    g = at::Tensor();
  }
}

void Unit::merge_unsynced() {
  at::NoGradGuard no_grad;
  for (auto& s : slots_) {
    if (!s.unsynced.defined()) continue;
    at::Tensor& g = full_grad(s);
    g = g.defined() ? s.unsynced.add_(g) : s.unsynced;
    s.unsynced = at::Tensor();
  }
}

}  // namespace fsdp::detail
