// shard_model's walk over the module tree (declared in fsdp/internal/wrap.h): the units it finds,
// in module order, with the parameters each owns and the modules that share it.
#include "fsdp/internal/wrap.h"

#include "fsdp/internal/access.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"
#include "fsdp/sharded.h"

#include <algorithm>
#include <tuple>
#include <utility>

namespace fsdp::detail {

namespace {

// The walk's state: the units found so far (the root's first) and what maps modules and
// parameters to them, so that a module met again, a unit shared by several modules and a
// parameter tied across modules are each found where they are first met.
class UnitWalk {
 public:
  UnitWalk(RunState& state, bool in_scope) : state_(state), in_scope_(in_scope) {
    units_.found.push_back(std::make_unique<FoundUnit>(FoundUnit{"", nullptr, {}, nullptr}));
  }

  // `built`: inside a unit sharded while the model was built (ShardingScope), whose parameters
  // are in it already; only units nested in it remain to be found.
  // `member`: which of the unit's modules `m` is in.
  void visit(torch::nn::Module& m, const std::string& prefix, size_t unit, bool built, int member);

  // Every module a unit's module joined (share_unit_with) must be in the model, in that unit;
  // a unit of several modules is then named for all of them.
  void check_members();

  FoundUnits take() { return std::move(units_); }

 private:
  // A module deriving from fsdp::ShardedUnit, not sharded yet: a unit of its own, or a module
  // joining the unit its group's lead (share_unit_with) is in. Returns that unit and which of its
  // modules this one is.
  std::pair<size_t, int> enter_unit(ShardedUnit* u, const std::string& name, size_t unit, bool built);

  // A module sharded while the model was built (ShardingScope): its unit joins as it is, its
  // parameters claimed and their shapes as built kept for the model check.
  void visit_built(torch::nn::Module& m, ShardedUnit* u, const std::string& name, size_t unit);

  // A module joining the unit of entry `f` (share_unit_with): met once (`earlier`: the path it was
  // met under before, if any), and a sibling of the unit's first module (both directly in one unit).
  void check_join(const FoundUnit& f, const std::string& name, size_t enclosing, const std::string& earlier);
  int join(size_t g, ShardedUnit* u, const std::string& name, size_t enclosing);

  // Records which unit owns a parameter; a parameter met again must be in the same unit.
  bool claim(const at::Tensor& p, const std::string& name, size_t unit);

  RunState& state_;
  const bool in_scope_;
  FoundUnits units_;
  std::unordered_map<const ShardedUnit*, size_t> group_of_;  // group lead -> its unit (share_unit_with)
  std::unordered_map<const Unit*, size_t> built_at_;         // a unit sharded while built -> its entry
  std::unordered_map<const c10::TensorImpl*, std::pair<std::string, size_t>> owner_;  // -> name, unit
};

void UnitWalk::check_join(const FoundUnit& f, const std::string& name, size_t enclosing, const std::string& earlier) {
  FSDP_CHECK_IN(state_.comm().error_in("fsdp::fully_shard").unit(name), earlier.empty(), "module '", name,
                "' is registered twice, also as '", earlier,
                "'. Register a module once; hold it under another name without register_module.");
  FSDP_CHECK_IN(state_.comm().error_in("fsdp::fully_shard").unit(name), f.parent == enclosing, "modules '", f.name,
                "' and '", name,
                "' share a unit (share_unit_with) but are not siblings: one is inside a unit the other is not in. "
                "Modules sharing a unit must sit directly in the same unit (the root, or one fsdp::Sharded module).");
}

int UnitWalk::join(size_t g, ShardedUnit* u, const std::string& name, size_t enclosing) {
  FoundUnit& f = *units_.found[g];
  const auto again = std::find(f.members.begin(), f.members.end(), u);
  check_join(f, name, enclosing, again == f.members.end() ? std::string() : f.member_paths[again - f.members.begin()]);
  f.members.push_back(u);
  f.member_paths.push_back(name);
  return static_cast<int>(f.members.size()) - 1;
}

bool UnitWalk::claim(const at::Tensor& p, const std::string& name, size_t unit) {
  auto [it, inserted] = owner_.emplace(p.unsafeGetTensorImpl(), std::make_pair(name, unit));
  FSDP_CHECK_IN(state_.comm().error_in("fsdp::fully_shard"), inserted || it->second.second == unit, "parameter '",
                it->second.first, "' is shared with '", name, "', which is in another unit ('",
                units_.found[it->second.second]->name, "' vs '", units_.found[unit]->name,
                "'). A shared parameter must live in one unit: move both modules into one fsdp::Sharded unit "
                "or leave them in the root.");
  return inserted;  // false: shared inside one unit, sharded once
}

void UnitWalk::visit(torch::nn::Module& m, const std::string& prefix, size_t unit, bool built, int member) {
  if (!built) {
    for (const auto& kv : m.named_parameters(/*recurse=*/false)) {
      const std::string name = prefix.empty() ? kv.key() : prefix + "." + kv.key();
      if (claim(kv.value(), name, unit)) {
        units_.found[unit]->params.emplace_back(name, kv.value());
        units_.found[unit]->slot_member.push_back(member);
      }
    }
  }
  for (const auto& kv : m.named_children()) {
    const std::string name = prefix.empty() ? kv.key() : prefix + "." + kv.key();
    size_t child_unit = unit;
    int child_member = member;
    auto* u = dynamic_cast<ShardedUnit*>(kv.value().get());
    if (u != nullptr && u->is_sharded()) {
      visit_built(*kv.value(), u, name, unit);
      continue;
    }
    if (u != nullptr) std::tie(child_unit, child_member) = enter_unit(u, name, unit, built);
    visit(*kv.value(), name, child_unit, built, child_member);
  }
}

std::pair<size_t, int> UnitWalk::enter_unit(ShardedUnit* u, const std::string& name, size_t unit, bool built) {
  FSDP_CHECK_IN(state_.comm().error_in("fsdp::fully_shard"), !built, "unit '", name,
                "' was built outside the ShardingScope that sharded the unit containing it; build the whole "
                "model inside the scope.");
  const ShardedUnit* lead = group_lead(u);
  auto group = group_of_.find(lead);
  if (group != group_of_.end()) {
    const size_t child_unit = group->second;
    return {child_unit, join(child_unit, u, name, unit)};
  }
  auto& found = units_.found;
  found.push_back(std::make_unique<FoundUnit>(FoundUnit{name, u, {}, nullptr, unit}));
  const size_t child_unit = found.size() - 1;
  found.back()->members = {u};
  found.back()->member_paths = {name};
  group_of_[lead] = child_unit;
  return {child_unit, 0};
}

void UnitWalk::visit_built(torch::nn::Module& m, ShardedUnit* u, const std::string& name, size_t unit) {
  auto& found = units_.found;
  const std::shared_ptr<Unit>& sharded = Access::unit(*u);
  auto joined = built_at_.find(sharded.get());
  if (joined != built_at_.end()) {  // another module of a unit met already (share_unit_with)
    FoundUnit& f = *found[joined->second];
    check_join(f, name, unit, f.member_paths[Access::member(*u)]);
    f.member_paths[Access::member(*u)] = name;
    f.members.push_back(u);
    visit(m, name, joined->second, /*built=*/true, Access::member(*u));
    return;
  }
  FSDP_CHECK_IN(state_.comm().error_in("fsdp::fully_shard").unit(name), in_scope_, "module '", name,
                "' is already sharded: either the model was wrapped before (wrap a model once) or it was "
                "built inside an fsdp::ShardingScope (then wrap it with fsdp::fully_shard(model, scope)).");
  FSDP_CHECK_IN(state_.comm().error_in("fsdp::fully_shard"), &sharded->state() == &state_, "module '", name,
                "' was sharded by another ShardingScope or model; build and wrap a model within one scope.");
  found.push_back(std::make_unique<FoundUnit>(FoundUnit{name, u, {}, sharded, unit}));
  found.back()->member_paths.resize(sharded->members());
  found.back()->member_paths[Access::member(*u)] = name;
  found.back()->members = {u};
  built_at_[sharded.get()] = found.size() - 1;
  for (const auto& s : sharded->slots()) {
    claim(s.param, name + "." + s.name, found.size() - 1);
    units_.built_shape[s.param.unsafeGetTensorImpl()] = s.shape;
  }
  visit(m, name, found.size() - 1, /*built=*/true, Access::member(*u));
}

void UnitWalk::check_members() {
  for (const auto& f : units_.found) {
    for (size_t m = 0; m < f->member_paths.size(); ++m) {
      FSDP_CHECK_IN(state_.comm().error_in("fsdp::fully_shard").unit(f->name), !f->member_paths[m].empty(), "unit '",
                    f->name, "' was joined (share_unit_with) ",
                    "with a module that is not part of this model. Share units among modules of the model you wrap.");
    }
    for (ShardedUnit* u : f->members) {
      ShardedUnit* lead = u->shares_unit_of();
      const bool in_group =
          lead == nullptr || std::find(f->members.begin(), f->members.end(), lead) != f->members.end();
      FSDP_CHECK_IN(state_.comm().error_in("fsdp::fully_shard").unit(f->name), in_group, "module '",
                    f->member_paths[std::find(f->members.begin(), f->members.end(), u) - f->members.begin()],
                    "' shares the unit of a module (share_unit_with) that is not part of this model. Share units "
                    "among modules of the model you wrap.");
    }
    if (f->members.size() > 1) f->name = unit_name(f->member_paths);
  }
}

}  // namespace

FoundUnits find_units(torch::nn::Module& root, RunState& state, bool in_scope) {
  UnitWalk walk(state, in_scope);
  walk.visit(root, "", 0, /*built=*/false, 0);
  walk.check_members();
  return walk.take();
}

}  // namespace fsdp::detail
