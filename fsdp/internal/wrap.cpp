#include "fsdp/internal/wrap.h"

#include "fsdp/internal/access.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/mesh_state.h"
#include "fsdp/internal/model_check.h"
#include "fsdp/internal/options_check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/tensor_splits.h"
#include "fsdp/internal/unit.h"
#include "fsdp/sharded.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <functional>
#include <sstream>
#include <unordered_map>

namespace fsdp::detail {

namespace {

// A unit's own parameters: those of `m` and its submodules, minus those of nested units.
void unit_parameters(torch::nn::Module& m, const std::string& prefix,
                     std::vector<std::pair<std::string, at::Tensor>>& out) {
  for (const auto& kv : m.named_parameters(/*recurse=*/false)) {
    out.emplace_back(prefix.empty() ? kv.key() : prefix + "." + kv.key(), kv.value());
  }
  for (const auto& kv : m.named_children()) {
    if (dynamic_cast<ShardedUnit*>(kv.value().get()) != nullptr) continue;
    unit_parameters(*kv.value(), prefix.empty() ? kv.key() : prefix + "." + kv.key(), out);
  }
}

// "BlockImpl #3 (built in a ShardingScope)": the unit's Impl type and its order of construction,
// until fully_shard gives it its module path.
std::string built_label(const torch::nn::Module& module, int index) {
  return module_type(module) + " #" + std::to_string(index) + " (built in a ShardingScope)";
}

}  // namespace

ShardedUnit* group_lead(ShardedUnit* u) {
  for (int hops = 0; u->shares_unit_of() != nullptr && hops < 4096; ++hops) u = u->shares_unit_of();
  return u;
}

std::string module_type(const torch::nn::Module& module) {
  std::string type = module.name();  // "fsdp::ShardedImpl<BlockImpl, ...>" unless Impl named itself
  const std::string wrapper = "fsdp::ShardedImpl<";
  if (type.rfind(wrapper, 0) == 0) {
    type = type.substr(wrapper.size());
    int depth = 0;
    size_t end = 0;
    for (; end < type.size(); ++end) {
      if (type[end] == '<') ++depth;
      if (type[end] == '>' && depth-- == 0) break;
      if (type[end] == ',' && depth == 0) break;
    }
    type = type.substr(0, end);
  }
  return type;
}

void shard_on_construction(const std::shared_ptr<RunState>& state, torch::nn::Module& module, ShardedUnit& unit) {
  std::vector<std::pair<std::string, at::Tensor>> params;
  unit_parameters(module, "", params);
  // Tied inside the unit: sharded once.
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  std::vector<std::pair<std::string, at::Tensor>> unique;
  for (auto& np : params) {
    if (seen.emplace(np.second.unsafeGetTensorImpl(), true).second) unique.push_back(std::move(np));
  }
  // Before the check that every rank built the same unit: a tied shard has this rank's shape.
  const std::string label = built_label(module, state->units_built() + 1);
  for (const auto& [name, p] : unique) {
    auto earlier = state->built_params().find(p.unsafeGetTensorImpl());
    const bool seen_before = earlier != state->built_params().end() && !earlier->second.first.expired();
    FSDP_CHECK_IN(state->comm().error_context("fsdp::ShardingScope").unit(label), !seen_before,
                  "fsdp::ShardingScope (rank ", state->comm().rank(), "): parameter '", name, "' of ", label,
                  " was sharded already, by ", earlier->second.second,
                  ": a weight shared by two modules built in a ShardingScope (a tied embedding and head) would be "
                  "sharded twice. Build the modules that share it outside the scope and make them one unit "
                  "(share_unit_with), or make them one fsdp::Sharded module.");
  }
  if (!unique.empty())
    check_offload(state->options(), unique.front().first, unique.front().second.device(), state->comm().rank());
  const ShardingStrategy strategy = state->options().strategy();
  // The collectives below (broadcast, hybrid groups) pair up only if every rank builds the same
  // unit now: check that first, by the unit's own description.
  std::ostringstream desc;
  desc << "option strategy " << to_string(strategy) << '\n' << describe_options(state->options());
  const MixedPrecisionPolicy& mp = state->options().mixed_precision();
  const bool mixed = mp.any_dtype();
  for (const auto& [name, p] : unique) {
    desc << "param " << name << ' ' << p.dtype() << ' ' << p.sizes() << (p.requires_grad() ? "" : " frozen") << " ("
         << c10::DeviceTypeName(p.device().type(), true) << ")" << (mixed ? " " + to_string(mp) : "") << "\n";
  }
  desc << describe_offload(state->options());
  check_same_model_on_all_ranks(state->comm(), desc.str());
  if (traits(strategy).shard_over == ShardOver::kGroup) state->init_hybrid(state->options().shard_group_size());
  auto group = std::make_shared<Unit>("", std::move(unique), state, /*is_root=*/false, strategy,
                                      state->options().mixed_precision());
  group->set_built_label(label);
  ++state->units_built();
  for (const auto& s : group->slots()) {
    state->built_params().insert_or_assign(
        s.param.unsafeGetTensorImpl(),
        std::make_pair(c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(s.param.getIntrusivePtr()),
                       label));
  }
  group->init();
  Access::attach(unit, group);
}

void merge_built_units(ShardedUnit& first, ShardedUnit& other) {
  const std::shared_ptr<Unit> a = Access::unit(first), b = Access::unit(other);
  if (a == b) return;
  RunState& state = a->state();
  const std::string what = "share_unit_with: '" + b->label() + "' joins '" + a->label() + "'";
  const ErrorContext context = state.comm().error_context("fsdp::ShardedUnit::share_unit_with");
  FSDP_CHECK_IN(context, &b->state() == &state, "fsdp::ShardedUnit::share_unit_with (rank ", state.comm().rank(),
                "): '", b->label(), "' and '", a->label(),
                "' were sharded by different ShardingScopes; build the model within one scope.");
  FSDP_CHECK_IN(context, !a->wrapped() && !b->wrapped(), "fsdp::ShardedUnit::share_unit_with (rank ",
                state.comm().rank(), "): ", what,
                ", but the model is wrapped already: units are fixed by fsdp::fully_shard. Call share_unit_with "
                "before it (in the model's constructor).");
  if (!a->slots().empty() && !b->slots().empty()) {  // one flat buffer: checked before anything moves
    const at::Tensor& pa = a->slots().front().param;
    const at::Tensor& pb = b->slots().front().param;
    FSDP_CHECK_IN(context, pa.dtype() == pb.dtype() && pa.device() == pb.device(),
                  "fsdp::ShardedUnit::share_unit_with (rank ", state.comm().rank(), "): ", what,
                  ", but their parameters are ", pa.dtype(), " on ", pa.device(), " and ", pb.dtype(), " on ",
                  pb.device(),
                  ": a unit's parameters share one flat buffer. Give them one dtype and device, or keep two units.");
  }
  // The gathers below pair up only if every rank merges the same units now.
  check_same_model_on_all_ranks(state.comm(), what + "\n");
  // Each unit's modules, by member index (a unit merged before lists them all).
  auto modules_of = [&](const std::shared_ptr<Unit>& unit, ShardedUnit& module) {
    std::vector<std::shared_ptr<torch::nn::Module>> out;
    for (const auto& e : state.shared_built_units()) {
      if (e.unit.lock() != unit) continue;
      for (const auto& m : e.modules) out.push_back(m.lock());
      return out;
    }
    out.push_back(dynamic_cast<torch::nn::Module&>(module).shared_from_this());
    return out;
  };
  std::vector<std::shared_ptr<torch::nn::Module>> modules = modules_of(a, first);
  const auto more = modules_of(b, other);
  const int b_offset = static_cast<int>(modules.size());
  modules.insert(modules.end(), more.begin(), more.end());
  // Each unit's full parameters gathered once (a unit's size, as while it was built), then sharded
  // again as one unit: its parameters keep their tensors (and so the model's references to them).
  // Until the merged unit is sharded, what each parameter pointed at is kept, to be put back.
  std::vector<std::pair<at::Tensor, at::Tensor>> before;  // parameter, its shard view
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<int> slot_member;
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  std::shared_ptr<Unit> merged;
  try {
    for (const auto& [unit, offset] : {std::make_pair(a, 0), std::make_pair(b, b_offset)}) {
      if (unit->slots().empty()) continue;
      std::vector<at::Tensor> full;
      unit->gather_full(full, unit->compute_device());
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < full.size(); ++i) {
        const ParamSlot& slot = unit->slots()[i];
        at::Tensor param = slot.param;
        if (!seen.emplace(param.unsafeGetTensorImpl(), true).second) continue;  // tied across the two: once
        before.emplace_back(param, param.detach());
        param.set_data(full[i]);
        params.emplace_back(slot.name, param);
        slot_member.push_back(offset + unit->slot_member(i));
      }
    }
    merged = std::make_shared<Unit>("", std::move(params), a->run_state(), /*is_root=*/false, a->strategy(),
                                    a->mixed_precision());
    merged->set_members(static_cast<int>(modules.size()), std::move(slot_member));
    merged->set_built_label(a->label() + " + " + b->label());
    merged->init();
  } catch (...) {
    at::NoGradGuard no_grad;
    for (auto& [param, shard] : before) param.set_data(shard);  // the two units stay as they were
    throw;
  }
  std::vector<std::weak_ptr<torch::nn::Module>> held;
  for (size_t m = 0; m < modules.size(); ++m) {
    held.push_back(modules[m]);
    if (auto* u = dynamic_cast<ShardedUnit*>(modules[m].get())) Access::attach(*u, merged, static_cast<int>(m));
  }
  auto& list = state.shared_built_units();
  list.erase(std::remove_if(list.begin(), list.end(),
                            [&](const RunState::SharedBuiltUnit& e) {
                              auto u = e.unit.lock();
                              return !u || u == a || u == b;
                            }),
             list.end());
  list.push_back({merged, std::move(held)});
}

std::shared_ptr<Unit> shard_model(const std::shared_ptr<torch::nn::Module>& root,
                                  const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                  const FullyShardOptions& given_options, const std::shared_ptr<RunState>& scope_state,
                                  const MeshState* mesh) {
  FSDP_CHECK(root != nullptr, "fsdp::fully_shard: the model is null");
  check_options(scope_state ? scope_state->options() : given_options, "fsdp::fully_shard");
  FSDP_CHECK(pg, "fsdp::fully_shard: the process group is null; create one with fsdp::init_process_group()");
  FSDP_CHECK(dynamic_cast<ShardedUnit*>(root.get()) == nullptr,
             "fsdp::fully_shard: the root module is itself an fsdp::Sharded unit. Pass the plain root module: "
             "fully_shard makes it the root unit and returns its handle.");
  auto state = scope_state ? scope_state
                           : std::make_shared<RunState>(pg, given_options,
                                                        mesh != nullptr ? mesh->group_info(kDataDim) : GroupInfo{});
  if (mesh != nullptr) state->init_mesh(*mesh);
  record_tensor_splits(*state, *root);
  const FullyShardOptions& options = state->options();
  for (const auto& kv : root->named_parameters()) {  // the first says where the model is
    check_offload(options, kv.key(), kv.value().device(), state->comm().rank());
    break;
  }

  struct Found {
    std::string name;
    ShardedUnit* unit;  // its first module (null: the root)
    std::vector<std::pair<std::string, at::Tensor>> params;
    std::shared_ptr<Unit> built;  // sharded while the model was built (ShardingScope)
    size_t parent = 0;            // the unit containing it (the root: itself)
    // Its modules (more than one: ShardedUnit::share_unit_with), their paths, and the module each
    // parameter came from.
    std::vector<ShardedUnit*> members;
    std::vector<std::string> member_paths;
    std::vector<int> slot_member;
  };
  std::vector<std::unique_ptr<Found>> found;
  found.push_back(std::make_unique<Found>(Found{"", nullptr, {}, nullptr}));
  std::unordered_map<const ShardedUnit*, size_t> group_of;  // group lead -> its unit (share_unit_with)
  std::unordered_map<const Unit*, size_t> built_at;         // a unit sharded while built -> its entry
  // A module joining the unit of entry `f` (share_unit_with): met once (`earlier`: the path it was
  // met under before, if any), and a sibling of the unit's first module (both directly in one unit).
  auto check_join = [&](const Found& f, const std::string& name, size_t enclosing, const std::string& earlier) {
    FSDP_CHECK_IN(state->comm().error_context("fsdp::fully_shard").unit(name), earlier.empty(),
                  "fsdp::fully_shard (rank ", state->comm().rank(), "): module '", name,
                  "' is registered twice, also as '", earlier,
                  "'. Register a module once; hold it under another name without register_module.");
    FSDP_CHECK_IN(state->comm().error_context("fsdp::fully_shard").unit(name), f.parent == enclosing,
                  "fsdp::fully_shard (rank ", state->comm().rank(), "): modules '", f.name, "' and '", name,
                  "' share a unit (share_unit_with) but are not siblings: one is inside a unit the other is not in. "
                  "Modules sharing a unit must sit directly in the same unit (the root, or one fsdp::Sharded module).");
  };
  auto join = [&](size_t g, ShardedUnit* u, const std::string& name, size_t enclosing) {
    Found& f = *found[g];
    const auto again = std::find(f.members.begin(), f.members.end(), u);
    check_join(f, name, enclosing,
               again == f.members.end() ? std::string() : f.member_paths[again - f.members.begin()]);
    f.members.push_back(u);
    f.member_paths.push_back(name);
    return static_cast<int>(f.members.size()) - 1;
  };
  std::unordered_map<const c10::TensorImpl*, std::vector<int64_t>> built_shape;      // of parameters sharded already
  std::unordered_map<const c10::TensorImpl*, std::pair<std::string, size_t>> owner;  // -> name, unit

  // Records which unit owns a parameter; a parameter met again must be in the same unit.
  auto claim = [&](const at::Tensor& p, const std::string& name, size_t unit) {
    auto [it, inserted] = owner.emplace(p.unsafeGetTensorImpl(), std::make_pair(name, unit));
    FSDP_CHECK(inserted || it->second.second == unit, "fsdp::fully_shard (rank ", state->comm().rank(),
               "): parameter '", it->second.first, "' is shared with '", name, "', which is in another unit ('",
               found[it->second.second]->name, "' vs '", found[unit]->name,
               "'). A shared parameter must live in one unit: move both modules into one fsdp::Sharded unit "
               "or leave them in the root.");
    return inserted;  // false: shared inside one unit, sharded once
  };

  // `built`: inside a unit sharded while the model was built (ShardingScope), whose parameters
  // are in it already; only units nested in it remain to be found.
  // `member`: which of the unit's modules `m` is in.
  std::function<void(torch::nn::Module&, const std::string&, size_t, bool, int)> visit =
      [&](torch::nn::Module& m, const std::string& prefix, size_t unit, bool built, int member) {
        if (!built) {
          for (const auto& kv : m.named_parameters(/*recurse=*/false)) {
            const std::string name = prefix.empty() ? kv.key() : prefix + "." + kv.key();
            if (claim(kv.value(), name, unit)) {
              found[unit]->params.emplace_back(name, kv.value());
              found[unit]->slot_member.push_back(member);
            }
          }
        }
        for (const auto& kv : m.named_children()) {
          const std::string name = prefix.empty() ? kv.key() : prefix + "." + kv.key();
          size_t child_unit = unit;
          int child_member = member;
          auto* u = dynamic_cast<ShardedUnit*>(kv.value().get());
          if (u != nullptr && u->is_sharded()) {
            const std::shared_ptr<Unit>& sharded = Access::unit(*u);
            auto joined = built_at.find(sharded.get());
            if (joined != built_at.end()) {  // another module of a unit met already (share_unit_with)
              Found& f = *found[joined->second];
              check_join(f, name, unit, f.member_paths[Access::member(*u)]);
              f.member_paths[Access::member(*u)] = name;
              f.members.push_back(u);
              visit(*kv.value(), name, joined->second, /*built=*/true, Access::member(*u));
              continue;
            }
            FSDP_CHECK_IN(state->comm().error_context("fsdp::fully_shard").unit(name), scope_state != nullptr,
                          "fsdp::fully_shard (rank ", state->comm().rank(), "): module '", name,
                          "' is already sharded: either the model was wrapped before (wrap a model once) or it was "
                          "built inside an fsdp::ShardingScope (then wrap it with fsdp::fully_shard(model, scope)).");
            FSDP_CHECK(&sharded->state() == state.get(), "fsdp::fully_shard (rank ", state->comm().rank(),
                       "): module '", name,
                       "' was sharded by another ShardingScope or model; build and wrap a model within one scope.");
            found.push_back(std::make_unique<Found>(Found{name, u, {}, sharded, unit}));
            found.back()->member_paths.resize(sharded->members());
            found.back()->member_paths[Access::member(*u)] = name;
            found.back()->members = {u};
            built_at[sharded.get()] = found.size() - 1;
            for (const auto& s : sharded->slots()) {
              claim(s.param, name + "." + s.name, found.size() - 1);
              built_shape[s.param.unsafeGetTensorImpl()] = s.shape;
            }
            visit(*kv.value(), name, found.size() - 1, /*built=*/true, Access::member(*u));
            continue;
          }
          if (u != nullptr) {
            FSDP_CHECK(!built, "fsdp::fully_shard (rank ", state->comm().rank(), "): unit '", name,
                       "' was built outside the ShardingScope that sharded the unit containing it; build the whole "
                       "model inside the scope.");
            const ShardedUnit* lead = group_lead(u);
            auto group = group_of.find(lead);
            if (group != group_of.end()) {
              child_unit = group->second;
              child_member = join(child_unit, u, name, unit);
            } else {
              found.push_back(std::make_unique<Found>(Found{name, u, {}, nullptr, unit}));
              child_unit = found.size() - 1;
              found.back()->members = {u};
              found.back()->member_paths = {name};
              child_member = 0;
              group_of[lead] = child_unit;
            }
          }
          visit(*kv.value(), name, child_unit, built, child_member);
        }
      };
  visit(*root, "", 0, /*built=*/false, 0);
  // Every module a unit's module joined (share_unit_with) must be in the model, in that unit.
  for (const auto& f : found) {
    for (size_t m = 0; m < f->member_paths.size(); ++m) {
      FSDP_CHECK_IN(state->comm().error_context("fsdp::fully_shard").unit(f->name), !f->member_paths[m].empty(),
                    "fsdp::fully_shard (rank ", state->comm().rank(), "): unit '", f->name,
                    "' was joined (share_unit_with) ",
                    "with a module that is not part of this model. Share units among modules of the model you wrap.");
    }
    for (ShardedUnit* u : f->members) {
      ShardedUnit* lead = u->shares_unit_of();
      const bool in_group =
          lead == nullptr || std::find(f->members.begin(), f->members.end(), lead) != f->members.end();
      FSDP_CHECK_IN(state->comm().error_context("fsdp::fully_shard").unit(f->name), in_group,
                    "fsdp::fully_shard (rank ", state->comm().rank(), "): module '",
                    f->member_paths[std::find(f->members.begin(), f->members.end(), u) - f->members.begin()],
                    "' shares the unit of a module (share_unit_with) that is not part of this model. Share units "
                    "among modules of the model you wrap.");
    }
    if (f->members.size() > 1) f->name = unit_name(f->member_paths);
  }

  // Everything that decides the collectives' sizes and order: names, shapes, dtypes, the unit
  // each parameter is in, whether it trains, its device type.
  // A unit's own setting: its modules', which must agree where more than one set it.
  auto setting_of = [&](const Found& f, auto get, const char* what, auto same) {
    std::decay_t<decltype(get(*f.unit))> out;
    for (size_t m = 0; m < f.members.size(); ++m) {
      const auto& own = get(*f.members[m]);
      if (!own) continue;
      FSDP_CHECK_IN(state->comm().error_context("fsdp::fully_shard").unit(f.name), !out || same(*out, *own),
                    "fsdp::fully_shard (rank ", state->comm().rank(), "): the modules sharing unit '", f.name,
                    "' (share_unit_with) set different ", what, "; set it on one of them, or the same on each.");
      out = own;
    }
    return out;
  };
  auto strategy_of = [&](const Found& f) {
    return setting_of(
               f, [](const ShardedUnit& u) { return u.sharding_strategy(); }, "sharding strategies", std::equal_to<>())
        .value_or(options.strategy());
  };
  auto precision_of = [&](const Found& f) {
    return setting_of(
               f, [](const ShardedUnit& u) { return u.mixed_precision(); }, "mixed-precision policies",
               [](const MixedPrecisionPolicy& x, const MixedPrecisionPolicy& y) {
                 return to_string(x) == to_string(y);
               })
        .value_or(options.mixed_precision());
  };
  std::unordered_map<const c10::TensorImpl*, std::string> unit_of;
  for (const auto& f : found) {
    const MixedPrecisionPolicy& mp = f->built ? f->built->mixed_precision() : precision_of(*f);
    const bool mixed = mp.any_dtype();
    const std::string strategy = std::string(to_string(f->built ? f->built->strategy() : strategy_of(*f))) +
                                 (mixed ? ", " + to_string(mp) : std::string());
    for (const auto& np : f->params) {
      unit_of[np.second.unsafeGetTensorImpl()] = (f->unit ? f->name : "<root>") + "' (" + strategy + ")";
    }
    if (f->built) {
      for (const auto& s : f->built->slots()) unit_of[s.param.unsafeGetTensorImpl()] = f->name + "' (" + strategy + ")";
    }
  }
  bool hybrid = false;
  for (const auto& f : found) hybrid = hybrid || traits(strategy_of(*f)).shard_over == ShardOver::kGroup;
  std::ostringstream desc;
  desc << describe_options(options);
  for (const auto& kv : root->named_parameters()) {  // module order: the same on every rank
    const at::Tensor& p = kv.value();
    auto built = built_shape.find(p.unsafeGetTensorImpl());
    const std::vector<int64_t> shape = built != built_shape.end() ? built->second : p.sizes().vec();
    desc << "param " << kv.key() << ' ' << p.dtype() << ' ' << c10::IntArrayRef(shape) << " in unit '"
         << unit_of[p.unsafeGetTensorImpl()] << (p.requires_grad() ? "" : " frozen") << " ("
         << c10::DeviceTypeName(p.device().type(), true) << ")\n";
  }
  desc << describe_buffers(*root) << describe_offload(options);
  check_same_model_on_all_ranks(state->comm(), desc.str());
  // Buffers (running statistics, masks, tables drawn from the RNG) start equal on every rank, as
  // in PyTorch's FSDP and DDP; parameters are broadcast unit by unit as they are sharded.
  if (options.sync_module_states()) broadcast_buffers(state->comm(), *root);
  if (hybrid) state->init_hybrid(options.shard_group_size());

  // Activation checkpointing: a unit's own setting, else every k-th unit that contains no other
  // (a recompute in backward must not run another unit's forward), in module order.
  std::vector<bool> contains_units(found.size(), false), checkpointed(found.size(), false);
  for (size_t i = 1; i < found.size(); ++i) contains_units[found[i]->parent] = true;
  const int every = options.activation_checkpointing_every();
  int leaf = 0;
  for (size_t i = 1; i < found.size(); ++i) {
    const std::optional<bool> own = setting_of(
        *found[i], [](const ShardedUnit& u) { return u.activation_checkpointing(); }, "activation checkpointing",
        std::equal_to<>());
    const bool counted = !contains_units[i] && every > 0 && ++leaf % every == 0;
    checkpointed[i] = own.value_or(counted);
    FSDP_CHECK_IN(state->comm().error_context("fsdp::fully_shard").unit(found[i]->name),
                  !checkpointed[i] || !contains_units[i], "fsdp::fully_shard (rank ", state->comm().rank(), "): unit '",
                  found[i]->name,
                  "' has set_activation_checkpointing(true) but contains other units: its recompute in backward "
                  "would run their forwards again. Checkpoint the units inside it instead.");
  }
  std::shared_ptr<Unit> root_group;
  state->units().clear();
  for (auto& f : found) {
    const bool checkpoints = checkpointed[state->units().size()];
    if (f->built) {
      f->built->rename(f->member_paths);
      f->built->set_checkpoints_activations(checkpoints);
      state->units().push_back(f->built);
      continue;
    }
    auto g = std::make_shared<Unit>(f->name, std::move(f->params), state, f->unit == nullptr, strategy_of(*f),
                                    precision_of(*f));
    if (f->members.size() > 1) g->set_members(static_cast<int>(f->members.size()), std::move(f->slot_member));
    g->set_checkpoints_activations(checkpoints);
    g->init();
    state->units().push_back(g);
    if (f->unit != nullptr) {
      for (size_t m = 0; m < f->members.size(); ++m) Access::attach(*f->members[m], g, static_cast<int>(m));
    } else {
      root_group = g;
    }
  }
  return root_group;
}

}  // namespace fsdp::detail
