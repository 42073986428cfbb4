// Options of fsdp::fully_shard, in LibTorch's chained-setter style:
//   fsdp::FullyShardOptions().timeout(std::chrono::seconds(60)).sync_module_states(false)
#pragma once

#include <torch/arg.h>

#include <chrono>

namespace fsdp {

struct FullyShardOptions {
  /// Bound on every collective the library issues; a peer that does not answer in time makes this
  /// rank throw an error naming the operation instead of hanging.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(10);
  /// Broadcast rank 0's initial weights to every rank when wrapping, so that ranks seeded
  /// differently still start from one model.
  TORCH_ARG(bool, sync_module_states) = true;
  /// Free each unit's gathered parameters after its forward (ZeRO-3) and gather them again for its
  /// backward. The root unit always stays gathered from its forward to its backward.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Units whose all-gather is issued ahead of use: the next units in forward order during
  /// forward, the previous ones during backward. 0 gathers each unit only when it runs. Each unit
  /// in flight costs its unsharded size in memory.
  TORCH_ARG(int, prefetch) = 1;
};

}  // namespace fsdp
