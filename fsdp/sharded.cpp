#include "fsdp/sharded.h"

#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"

#include <c10/util/Exception.h>

namespace fsdp {

ShardedUnit& as_unit(const std::shared_ptr<torch::nn::Module>& module) {
  TORCH_CHECK(module != nullptr, "fsdp::as_unit: the module is null");
  auto* unit = dynamic_cast<ShardedUnit*>(module.get());
  TORCH_CHECK(unit != nullptr, "fsdp::as_unit: module '", module->name(),
              "' is not an fsdp::Sharded unit. Build it as fsdp::Sharded<ItsImpl>(...) to give it per-unit settings; "
              "a plain module belongs to the unit that contains it.");
  return *unit;
}

namespace detail {

ForwardCasts unit_pre_forward(Unit& unit) {
  unit.pre_forward();
  return {unit.input_cast(), unit.output_cast()};
}

void unit_post_forward(Unit& unit, const std::vector<at::Tensor>& outputs) {
  unit.post_forward(outputs);
}

namespace {
// Runs one of the library's checks reached through the handle's operator->: its error says
// enough, so no "was it model->forward?" hint follows it.
template <typename Check>
void explained_check(Unit& unit, Check&& check) {
  try {
    check();
  } catch (...) {
    unit.state().access_error_explained = true;
    throw;
  }
}
}  // namespace

void unit_zero_grad(Unit& unit) {
  explained_check(unit, [&] { unit.state().check_no_unsynced_grads("model->zero_grad()"); });
}

void unit_to(Unit& unit, const std::optional<at::Device>& device, const std::optional<at::ScalarType>& dtype) {
  explained_check(unit, [&] { unit.check_conversion(device, dtype); });
}

}  // namespace detail

void ShardedUnit::set_sharding_strategy(ShardingStrategy strategy) {
  if (fsdp_unit_) {
    detail::Unit& unit = *fsdp_unit_;
    detail::explained_check(unit, [&] {
      TORCH_CHECK(false, "fsdp (rank ", unit.state().comm.rank(), "): set_sharding_strategy(", to_string(strategy),
                  ") on unit '", unit.name(), "', which is sharded already (as ", to_string(unit.strategy()),
                  "). Call it before fsdp::fully_shard; a unit built inside an fsdp::ShardingScope is sharded as it "
                  "is built: give the strategy to the scope's options.");
    });
  }
  TORCH_CHECK(is_valid(strategy), "fsdp: set_sharding_strategy(", static_cast<int>(strategy),
              "): not a ShardingStrategy; use one of fsdp::ShardingStrategy's values (fsdp/strategy.h).");
  strategy_ = strategy;
}

void ShardedUnit::set_mixed_precision(const MixedPrecisionPolicy& policy) {
  if (fsdp_unit_) {
    detail::Unit& unit = *fsdp_unit_;
    detail::explained_check(unit, [&] {
      TORCH_CHECK(false, "fsdp (rank ", unit.state().comm.rank(), "): set_mixed_precision(", to_string(policy),
                  ") on unit '", unit.name(), "', which is sharded already (with ", to_string(unit.mixed_precision()),
                  "). Call it before fsdp::fully_shard; a unit built inside an fsdp::ShardingScope is sharded as it "
                  "is built: give the policy to the scope's options.");
    });
  }
  mixed_precision_ = policy;
}

}  // namespace fsdp
