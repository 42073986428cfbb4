#include "fsdp/strategy.h"

#include "fsdp/options.h"

#include <c10/util/Exception.h>

namespace fsdp {
namespace {

// The ranks a strategy's sharded bytes are divided over.
double divisor(const StrategyTraits& t, const FormulaInputs& in) {
  switch (t.shard_over) {
    case ShardOver::kWorld:
      return in.world_size;
    case ShardOver::kGroup:
      return in.group_size;
    case ShardOver::kNone:
      return 1;
  }
  return 1;
}

double bytes(const StateCoefficients& c, double psi, double d) {
  return c.full * psi + c.sharded * psi / d;
}

}  // namespace

namespace detail {
void check_options(const FullyShardOptions& o, const char* caller) {
  TORCH_CHECK(is_valid(o.strategy()), caller, ": FullyShardOptions::strategy is ", static_cast<int>(o.strategy()),
              ", not a ShardingStrategy; use one of fsdp::ShardingStrategy's values (fsdp/strategy.h).");
  TORCH_CHECK(o.prefetch() >= 0, caller, ": FullyShardOptions::prefetch is ", o.prefetch(),
              "; it is the number of units gathered ahead, 0 or more (0 turns prefetch off).");
  TORCH_CHECK(o.bucket_bytes() > 0, caller, ": FullyShardOptions::bucket_bytes is ", o.bucket_bytes(),
              "; replicated units all-reduce their gradients in buckets of that many bytes, so it must be "
              "positive (PyTorch DDP's default is 25 MiB).");
}
}  // namespace detail

bool strategy_from_string(const std::string& text, ShardingStrategy& out) {
  for (const auto& t : kStrategies) {
    if (text == t.flag || text == t.name) {
      out = t.strategy;
      return true;
    }
  }
  return false;
}

double state_bytes_at_step(ShardingStrategy s, const FormulaInputs& in) {
  const StrategyTraits& t = traits(s);
  return bytes(t.at_step, in.psi, divisor(t, in));
}

double state_bytes_peak(ShardingStrategy s, const FormulaInputs& in) {
  const StrategyTraits& t = traits(s);
  const double gathered = t.peak_adds_gathered ? 4.0 * (in.root + 2.0 * in.largest_unit) : 0.0;
  return bytes(t.peak, in.psi, divisor(t, in)) + gathered;
}

double comm_elements(ShardingStrategy s, const FormulaInputs& in) {
  const StrategyTraits& t = traits(s);
  const bool across = t.comm_across_groups && in.world_size > in.group_size;
  return t.comm_psi * in.psi + (across ? 2.0 * in.psi / in.group_size : 0.0);
}

}  // namespace fsdp
