// The sharding strategies by the command-line names train_gpt and the benchmarks share
// (`--strategy full`); fsdp::to_string() gives the library's own names ("full-shard", ...).
#pragma once

#include "fsdp/strategy.h"

#include <map>
#include <string>

namespace gpt {

/// --strategy value -> strategy: one name per ZeRO stage, short enough to type.
inline const std::map<std::string, fsdp::ShardingStrategy>& strategy_flags() {
  static const std::map<std::string, fsdp::ShardingStrategy> m{
      {"full", fsdp::ShardingStrategy::kFullShard},
      {"grad-op", fsdp::ShardingStrategy::kShardGradOp},
      {"optimizer", fsdp::ShardingStrategy::kShardOptimizerState},
      {"replicate", fsdp::ShardingStrategy::kNoShard},
      {"hybrid", fsdp::ShardingStrategy::kHybridShard},
  };
  return m;
}

}  // namespace gpt
