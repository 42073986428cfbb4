// A unit's configuration, resolved once in its constructor: the dtypes its mixed-precision policy
// gives (master, gathered, reduction; fsdp/mixed_precision.h), whether it offloads its shards to
// host memory (CPUOffloadPolicy, fsdp/options.h), and what its strategy refuses of either. The
// data paths that use them are unit_unshard.cpp and unit_reduce.cpp.
#include "fsdp/internal/check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"
#include "fsdp/strategy.h"

#include <c10/core/ScalarType.h>

#include <utility>

namespace fsdp::detail {

void Unit::resolve_precision() {
  if (slots_.empty()) return;
  master_dtype_ = slots_.front().param.scalar_type();
  param_dtype_ = mp_.param_dtype().value_or(master_dtype_);
  reduce_dtype_ = mp_.reduce_dtype().value_or(master_dtype_);
  for (auto [what, dtype] : {std::pair<const char*, std::optional<at::ScalarType>>{"param_dtype", mp_.param_dtype()},
                             {"reduce_dtype", mp_.reduce_dtype()},
                             {"output_dtype", mp_.output_dtype()}}) {
    const bool usable =
        !dtype || *dtype == at::kBFloat16 || *dtype == at::kHalf || *dtype == at::kFloat || *dtype == at::kDouble;
    FSDP_CHECK_IN(error_in("fsdp::fully_shard"), usable, "unit '", label(), "': MixedPrecisionPolicy::", what, " is ",
                  *dtype,
                  ", which mixed precision does not compute in. Use torch::kBFloat16, torch::kFloat16 or "
                  "torch::kFloat32.");
  }
  if (!casts_grads()) return;
  FSDP_CHECK_IN(error_in("fsdp::fully_shard"), at::isFloatingType(master_dtype_), "unit '", label(),
                "' has parameters of dtype ", master_dtype_, " ('", slots_.front().name,
                "'), which a MixedPrecisionPolicy cannot cast. Give this unit a policy without param_dtype and "
                "reduce_dtype (set_mixed_precision(fsdp::MixedPrecisionPolicy())).");
  FSDP_CHECK_IN(error_in("fsdp::fully_shard"), !casts_params() || traits_.params_sharded, "unit '", label(), "' is ",
                to_string(strategy_), " with MixedPrecisionPolicy::param_dtype ", param_dtype_, " (its parameters are ",
                master_dtype_,
                "). Mixed-precision compute needs a strategy that gathers the parameters from their shards: "
                "kFullShard, kShardGradOp or kHybridShard (at world size 1 they cost what kNoShard does). "
                "reduce_dtype and output_dtype work with every strategy.");
}

std::optional<at::ScalarType> Unit::input_cast() const {
  if (!mp_.cast_forward_inputs() || !mp_.param_dtype() || slots_.empty()) return std::nullopt;
  return param_dtype_;
}

void Unit::resolve_offload() {
  const auto& policy = run_->options().offload_policy();
  if (!policy || slots_.empty()) return;
  const at::Device device = slots_.front().param.device();
  FSDP_CHECK_IN(error_in("fsdp::fully_shard"), traits_.params_sharded, "unit '", label(), "' is ", to_string(strategy_),
                " with FullyShardOptions::offload_policy; offload keeps the shards in host memory and gathers them "
                "to the device for each use, which needs a strategy that gathers the parameters from their shards: "
                "kFullShard, kShardGradOp or kHybridShard (at world size 1 they hold what kNoShard does). "
                "Choose one of those, or remove offload_policy.");
  offload_ = true;
  pin_ = policy->pin_memory() && device.is_cuda();
}

at::TensorOptions Unit::host_options(const at::TensorOptions& compute) const {
  return compute.device(at::kCPU).pinned_memory(pin_);
}

}  // namespace fsdp::detail
