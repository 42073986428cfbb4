// The sharding strategies by the command-line names train_gpt and fsdp_bench share (`--strategy
// full`); fsdp::to_string() gives the library's own names ("full-shard", ...).
#pragma once

#include "fsdp/options.h"

#include <map>
#include <string>

namespace gpt {

/// Flag -> strategy, from the strategies' traits (fsdp/strategy.h).
inline const std::map<std::string, fsdp::ShardingStrategy>& strategy_flags() {
  static const std::map<std::string, fsdp::ShardingStrategy> m = [] {
    std::map<std::string, fsdp::ShardingStrategy> out;
    for (const auto& t : fsdp::kStrategies) out[t.flag] = t.strategy;
    return out;
  }();
  return m;
}

}  // namespace gpt
