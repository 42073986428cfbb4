#include "fsdp/strategy.h"

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

bool strategy_from_string(const std::string& text, ShardingStrategy& out) {
  for (const auto& t : kStrategies) {
    if (text == t.name) {
      out = t.strategy;
      return true;
    }
  }
  return false;
}

double state_bytes_at_step(ShardingStrategy s, const FormulaInputs& in) {
  const StrategyTraits& t = traits(s);
  return bytes(t.at_step, in.psi, divisor(t, in)) + in.outer_bytes * in.psi / divisor(t, in);
}

double state_bytes_peak(ShardingStrategy s, const FormulaInputs& in) {
  const StrategyTraits& t = traits(s);
  const double gathered = t.peak_adds_gathered ? in.param_bytes * (in.root + 2.0 * in.largest_unit) : 0.0;
  StateCoefficients c = t.peak;
  // A sharded strategy's full term is its gathered parameters (kShardGradOp's, kept from forward
  // to backward); the others' full parameters and gradients are the model's dtype (no cast copy).
  if (t.params_sharded) c.full *= in.param_bytes / 4.0;
  // Sharded gradients: before their reduction, the root's and the computing unit's full gradients,
  // and one unit's packed (or in flight). Other strategies count full gradients in their 4Ψ already.
  const double grads =
      t.grads_sharded ? in.param_bytes * (in.root + in.largest_unit) + in.reduce_bytes * in.largest_unit : 0.0;
  return bytes(c, in.psi, divisor(t, in)) + gathered + grads + in.outer_bytes * in.psi / divisor(t, in);
}

double comm_elements(ShardingStrategy s, const FormulaInputs& in) {
  const StrategyTraits& t = traits(s);
  const bool across = t.comm_across_groups && in.world_size > in.group_size;
  return t.comm_psi * in.psi + (across ? 2.0 * in.psi / in.group_size : 0.0);
}

}  // namespace fsdp
