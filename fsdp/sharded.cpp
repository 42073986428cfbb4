#include "fsdp/sharded.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"
#include "fsdp/internal/wrap.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp {

ShardedUnit& as_unit(const std::shared_ptr<torch::nn::Module>& module) {
  FSDP_CHECK(module != nullptr, "fsdp::as_unit: the module is null");
  auto* unit = dynamic_cast<ShardedUnit*>(module.get());
  FSDP_CHECK(unit != nullptr, "fsdp::as_unit: module '", module->name(),
             "' is not an fsdp::Sharded unit. Build it as fsdp::Sharded<ItsImpl>(...) to give it per-unit settings; "
             "a plain module belongs to the unit that contains it.");
  return *unit;
}

namespace detail {
namespace {

// Whether `text` holds `token` with no digit on either side ("[4]" in "[4, 8]" is not "[4]"; "8x2"
// in "18x2" is not "8x2").
bool names_token(const std::string& text, const std::string& token) {
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  for (size_t at = text.find(token); at != std::string::npos; at = text.find(token, at + 1)) {
    const bool before = at > 0 && digit(text[at - 1]);
    const bool after = at + token.size() < text.size() && digit(text[at + token.size()]);
    if (!before && !after) return true;
  }
  return false;
}

// "[4], the shape of this rank's shard of 'ln.weight' (full [8]), 'ln.bias' (full [8])" when
// LibTorch's message names the shape of one of the unit's shards that differs from the full one,
// as ATen prints a shape ("[4]", "[2, 8]") or a matrix operand ("2x8", or "8x2" transposed, as
// linear's weight is): the trace an Impl::forward called around its wrapper leaves. Every
// parameter whose shard has that shape is named, the message cannot tell which one it was. Empty
// otherwise, so that an error in the root's own layers raised before the units ran gets no hint
// about them.
std::string shard_shape_named(const Unit& unit, const std::string& message) {
  const auto named = [&](c10::IntArrayRef shard) {
    std::vector<std::string> forms{c10::str(shard)};
    if (shard.size() == 2) {
      forms.push_back(c10::str(shard[0], "x", shard[1]));
      forms.push_back(c10::str(shard[1], "x", shard[0]));
    }
    return std::any_of(forms.begin(), forms.end(), [&](const auto& f) { return names_token(message, f); });
  };
  std::optional<std::vector<int64_t>> shape;  // the first shard shape the message names
  std::vector<std::string> names;
  for (const ParamSlot& s : unit.slots()) {
    const c10::IntArrayRef shard = s.sharded.sizes();
    if (shard == c10::IntArrayRef(s.shape) || (shape ? shard != c10::IntArrayRef(*shape) : !named(shard))) continue;
    if (!shape) shape = shard.vec();
    names.push_back(c10::str("'", s.name, "' (full ", c10::IntArrayRef(s.shape), ")"));
  }
  if (!shape) return {};
  constexpr size_t kListed = 3;
  std::string text = c10::str(c10::IntArrayRef(*shape), ", the shape of this rank's shard of ");
  for (size_t i = 0; i < std::min(names.size(), kListed); ++i) text += (i > 0 ? ", " : "") + names[i];
  if (names.size() > kListed) text += c10::str(" and ", names.size() - kListed, " more");
  return text;
}

}  // namespace

ForwardCasts unit_pre_forward(Unit& unit, int member) {
  unit.pre_forward(member);
  ForwardCasts casts;
  casts.input = unit.input_cast();
  casts.output = unit.output_cast();
  casts.compute = unit.param_dtype();
  return casts;
}

void unit_post_forward(Unit& unit, int member, const std::vector<at::Tensor>& outputs) {
  for (const auto& t : outputs) {
    if (t.defined() && t.is_floating_point()) {
      unit.state().unit_output_dtypes() |= uint64_t{1} << static_cast<int>(t.scalar_type());
    }
  }
  unit.post_forward(outputs, member);
}

bool unit_checkpoints_activations(const Unit& unit) {
  return unit.checkpoints_activations();
}

std::string checkpoint_label(const Unit* unit) {
  if (unit == nullptr) return "fsdp::activation_checkpoint of an fsdp::Sharded module";
  return "fsdp::activation_checkpoint of unit '" + unit->label() + "'";
}

std::function<void(bool)> unit_checkpoint_began(Unit* unit) {
  if (unit == nullptr) return nullptr;
  unit->checkpoint_began();
  return [weak = std::weak_ptr<Unit>(unit->shared_from_this())](bool backward_ran) {
    auto u = weak.lock();
    if (!u) return;
    if (backward_ran) {
      u->checkpoint_backward_done();
    } else {
      u->checkpoint_dropped();
    }
  };
}

void refuse_checkpointed_output(const Unit* unit) {
  const std::string where = unit != nullptr ? "unit '" + unit->label() + "'" : std::string("an fsdp::Sharded module");
  const ErrorContext context = unit != nullptr ? unit->error_context("activation checkpointing") : ErrorContext();
  FSDP_CHECK_IN(context, false, "fsdp: ", where,
                " is checkpointed but its forward returns a type whose tensors the checkpoint cannot see (a struct, "
                "array or map: their gradients would be lost). Return a tensor, a std::vector or std::optional of "
                "tensors, or a std::tuple / std::pair of those, numbers and strings; or do not checkpoint this unit.");
  TORCH_INTERNAL_ASSERT(false);
}

void name_unit_in_error(const Unit& unit, const ForwardCasts& casts, c10::Error& e) {
  if (dynamic_cast<const fsdp::Error*>(&e) != nullptr) return;  // the library's own says enough
  RunState& state = unit.state();
  if (state.named_error() == &e) return;  // an inner unit's (the same exception, passing through)
  state.named_error() = &e;
  std::ostringstream os;
  // Seen as the forward ran, not read from ATen's text: an input of another dtype, or (the root's
  // own layers) a unit's output of another dtype than the root computes in.
  const uint64_t compute_bit = uint64_t{1} << static_cast<int>(unit.param_dtype());
  const bool other_dtype =
      casts.other_input.has_value() || (unit.is_root() && (state.unit_output_dtypes() & ~compute_bit) != 0);
  os << detail::error_caller(state.comm().error_in("fsdp")) << ": raised in the forward of unit '" << unit.label()
     << "'";
  // The dtypes where they may be the cause: other dtypes met, or inputs cast.
  if (other_dtype || unit.input_cast()) {
    os << ", whose parameters compute in " << unit.param_dtype();
    if (const auto in = unit.input_cast()) {
      os << " and whose floating-point inputs are cast to " << *in;
    } else {
      os << " (its inputs are not cast)";
    }
  }
  if (other_dtype) {
    os << ". If the operands' dtypes differ, an input may come from a unit that computes in another dtype: give "
          "that unit MixedPrecisionPolicy::output_dtype, or this one the same param_dtype (its inputs are then "
          "cast, cast_forward_inputs). Or from a unit whose output_dtype differs from this one's param_dtype: a "
          "model-wide output_dtype casts every unit's output, and only a unit's own forward inputs are cast back, "
          "not what the root's layers take from a unit; for an fp32 loss cast the model's output instead "
          "(model(x).to(torch::kFloat))";
  }
  if (unit.is_root()) {
    for (const Unit* skipped : state.units_not_run_in_this_forward()) {
      const std::string named = shard_shape_named(*skipped, e.msg());
      if (named.empty()) continue;
      os << ". Unit '" << skipped->label() << "' had not run through the fsdp::Sharded wrapper when this was "
         << "raised, and the message names " << named
         << ": if the model's forward called the unit's Impl::forward directly (block->BlockImpl::forward(x)), "
            "it ran on this rank's shards; call the unit itself (block(x) or block->forward(x))";
      break;
    }
  }
  e.add_context(os.str());
}

namespace {
// Runs one of the library's checks reached through the handle's operator->: its error says
// enough, so no "was it model->forward?" hint follows it.
template <typename Check>
void explained_check(Unit& unit, Check&& check) {
  try {
    check();
  } catch (...) {
    unit.state().access_error_explained() = true;
    throw;
  }
}
}  // namespace

void unit_zero_grad(Unit& unit) {
  explained_check(unit, [&] { unit.state().check_no_unsynced_grads("model->zero_grad()"); });
}

void unit_to(Unit& unit, const std::optional<at::Device>& device, const std::optional<at::ScalarType>& dtype) {
  explained_check(unit, [&] { unit.check_conversion(device, dtype, /*converting=*/true); });
}

}  // namespace detail

namespace {
// A per-unit setting given after the unit was sharded: refused, naming the call, what the unit
// has and where the setting belongs.
void refuse_when_sharded(const std::shared_ptr<detail::Unit>& unit, const std::string& call, const std::string& has,
                         const char* setting) {
  if (!unit) return;
  detail::explained_check(*unit, [&] {
    FSDP_CHECK_IN(unit->error_context(call).api("fsdp"), false, call, " on unit '", unit->label(),
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
  FSDP_CHECK(is_valid(strategy), "fsdp: set_sharding_strategy(", static_cast<int>(strategy),
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

void ShardedUnit::set_activation_checkpointing(bool on) {
  // A unit sharded as it was built (ShardingScope) takes it until fully_shard, which decides it.
  if (fsdp_unit_ && fsdp_unit_->wrapped()) {
    refuse_when_sharded(fsdp_unit_, std::string("set_activation_checkpointing(") + (on ? "true" : "false") + ")",
                        fsdp_unit_->checkpoints_activations() ? "checkpointed" : "not checkpointed",
                        "activation_checkpointing_every");
  }
  activation_checkpointing_ = on;
}

void ShardedUnit::share_unit_with(ShardedUnit& first) {
  auto* self = dynamic_cast<torch::nn::Module*>(this);
  auto* other = dynamic_cast<torch::nn::Module*>(&first);
  TORCH_INTERNAL_ASSERT(self != nullptr && other != nullptr, "an fsdp::ShardedUnit that is not a module");
  const std::string me = detail::module_type(*self), them = detail::module_type(*other);
  FSDP_CHECK(&first != this, "fsdp::ShardedUnit::share_unit_with: a ", me,
             " module was given itself; give it the module whose unit it joins.");
  ShardedUnit* lead = detail::group_lead(&first);
  FSDP_CHECK(lead != this, "fsdp::ShardedUnit::share_unit_with: the ", them, " module given to a ", me,
             " module already shares that module's unit (share_unit_with in both directions); call it on one of them.");
  const ShardedUnit* current = shares_unit_of();
  FSDP_CHECK(current == nullptr || current == &first, "fsdp::ShardedUnit::share_unit_with: this ", me,
             " module shares the unit of another module already; a module is in one unit.");
  std::shared_ptr<torch::nn::Module> held;
  try {
    held = other->shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    FSDP_CHECK(false, "fsdp::ShardedUnit::share_unit_with: the ", them,
               " module given is not held by a std::shared_ptr; build it as fsdp::Sharded<", them, ">(...).");
  }
  if (is_sharded() || first.is_sharded()) {  // built in an fsdp::ShardingScope (or wrapped already)
    FSDP_CHECK(is_sharded() && first.is_sharded(), "fsdp::ShardedUnit::share_unit_with: the ", is_sharded() ? me : them,
               " module is sharded but the ", is_sharded() ? them : me,
               " module is not: build both inside the fsdp::ShardingScope, or both outside it.");
    detail::merge_built_units(*lead, *this);
  }
  unit_of_ = held;
}

ShardedUnit* ShardedUnit::shares_unit_of() const {
  auto held = unit_of_.lock();
  return held ? dynamic_cast<ShardedUnit*>(held.get()) : nullptr;
}

}  // namespace fsdp
