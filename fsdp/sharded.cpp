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

namespace {
// A per-unit setting given after the unit was sharded: refused, naming the call, what the unit
// has and where the setting belongs.
void refuse_when_sharded(const std::shared_ptr<detail::Unit>& unit, const std::string& call, const std::string& has,
                         const char* setting) {
  if (!unit) return;
  detail::explained_check(*unit, [&] {
    TORCH_CHECK(false, "fsdp (rank ", unit->state().comm.rank(), "): ", call, " on unit '", unit->name(),
                "', which is sharded already (", has,
                "). Call it before fsdp::fully_shard; a unit built inside an fsdp::ShardingScope is sharded as it "
                "is built: give the ",
                setting, " to the scope's options.");
  });
}
}  // namespace

void ShardedUnit::set_sharding_strategy(ShardingStrategy strategy) {
  if (fsdp_unit_) {
    refuse_when_sharded(fsdp_unit_, std::string("set_sharding_strategy(") + to_string(strategy) + ")",
                        std::string("as ") + to_string(fsdp_unit_->strategy()), "strategy");
  }
  TORCH_CHECK(is_valid(strategy), "fsdp: set_sharding_strategy(", static_cast<int>(strategy),
              "): not a ShardingStrategy; use one of fsdp::ShardingStrategy's values (fsdp/strategy.h).");
  strategy_ = strategy;
}

void ShardedUnit::set_mixed_precision(const MixedPrecisionPolicy& policy) {
  if (fsdp_unit_) {
    refuse_when_sharded(fsdp_unit_, "set_mixed_precision(" + to_string(policy) + ")",
                        "with " + to_string(fsdp_unit_->mixed_precision()), "policy");
  }
  mixed_precision_ = policy;
}

}  // namespace fsdp
