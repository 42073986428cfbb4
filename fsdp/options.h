// Options of fsdp::fully_shard, in LibTorch's chained-setter style:
//   fsdp::FullyShardOptions().timeout(std::chrono::seconds(60)).sync_module_states(false)
#pragma once

#include <torch/arg.h>

#include <chrono>

namespace fsdp {

/// How much of the model state is sharded (DeepSpeed's ZeRO stages, FSDP's names).
enum class ShardingStrategy {
  /// ZeRO-3: parameters, gradients and optimizer state sharded; each unit gathered for its forward
  /// and again for its backward. Model state 16Ψ/N with fp32 AdamW; 3Ψ communicated per step.
  kFullShard,
  /// ZeRO-2 in FSDP's sense: as kFullShard, but a unit stays gathered from its forward to the end
  /// of its backward (no second all-gather): model state peaks at 4Ψ + 12Ψ/N during the step,
  /// 16Ψ/N at the optimizer step; 2Ψ communicated per step.
  kShardGradOp,
};

struct FullyShardOptions {
  /// Bound on every collective the library issues; a peer that does not answer in time makes this
  /// rank throw an error naming the operation instead of hanging.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(10);
  /// Broadcast rank 0's initial weights to every rank when wrapping, so that ranks seeded
  /// differently still start from one model.
  TORCH_ARG(bool, sync_module_states) = true;
  /// See ShardingStrategy. The root unit always stays gathered from its forward to its backward.
  TORCH_ARG(ShardingStrategy, strategy) = ShardingStrategy::kFullShard;
  /// Units whose all-gather is issued ahead of use: the next units in forward order during
  /// forward, the previous ones during backward. 0 gathers each unit only when it runs. Each unit
  /// in flight costs its unsharded size in memory.
  TORCH_ARG(int, prefetch) = 1;
};

}  // namespace fsdp
