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

void move_to_device(torch::nn::Module& m, const std::optional<at::Device>& device) {
  if (!device) return;
  at::NoGradGuard no_grad;
  // In place, as LibTorch's Module::to: each tensor keeps its identity (the model, a tie, the
  // optimizer built later all hold the same parameter), only its data moves.
  auto move = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    at::Tensor moved = t.data().to(*device);
    if (moved.device() != t.device()) const_cast<at::Tensor&>(t).set_data(moved);
  };
  for (const auto& kv : m.named_parameters(/*recurse=*/false)) {
    move(kv.value());
    move(kv.value().grad());
  }
  for (const auto& kv : m.named_buffers(/*recurse=*/false)) move(kv.value());
  for (const auto& kv : m.named_children()) {
    const auto* unit = dynamic_cast<const ShardedUnit*>(kv.value().get());
    if (unit != nullptr && unit->is_sharded()) continue;  // built in a scope: moved then
    move_to_device(*kv.value(), device);
  }
}

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
  move_to_device(module, state->options().device());  // FullyShardOptions::device: before it is sharded
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
    FSDP_CHECK_IN(state->comm().error_in("fsdp::ShardingScope").unit(label), !seen_before, "parameter '", name, "' of ",
                  label, " was sharded already, by ", earlier->second.second,
                  ": a weight shared by two modules built in a ShardingScope (a tied embedding and head) would be "
                  "sharded twice. Build the modules that share it outside the scope and make them one unit "
                  "(share_unit_with), or make them one fsdp::Sharded module.");
  }
  if (!unique.empty())
    check_offload(state->options(), unique.front().first, unique.front().second.device(),
                  state->comm().error_in("fsdp::ShardingScope").unit(label));
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
  check_same_model_on_all_ranks(state->comm(), desc.str(), "fsdp::ShardingScope", label);
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
  const ErrorContext context = state.comm().error_in("fsdp::ShardedUnit::share_unit_with");
  FSDP_CHECK_IN(context, &b->state() == &state, "'", b->label(), "' and '", a->label(),
                "' were sharded by different ShardingScopes; build the model within one scope.");
  FSDP_CHECK_IN(context, !a->wrapped() && !b->wrapped(), what,
                ", but the model is wrapped already: units are fixed by fsdp::fully_shard. Call share_unit_with "
                "before it (in the model's constructor).");
  if (!a->slots().empty() && !b->slots().empty()) {  // one flat buffer: checked before anything moves
    const at::Tensor& pa = a->slots().front().param;
    const at::Tensor& pb = b->slots().front().param;
    FSDP_CHECK_IN(context, pa.dtype() == pb.dtype() && pa.device() == pb.device(), what, ", but their parameters are ",
                  pa.dtype(), " on ", pa.device(), " and ", pb.dtype(), " on ", pb.device(),
                  ": a unit's parameters share one flat buffer. Give them one dtype and device, or keep two units.");
  }
  // The gathers below pair up only if every rank merges the same units now.
  check_same_model_on_all_ranks(state.comm(), what + "\n", "fsdp::ShardedUnit::share_unit_with");
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

namespace {

// What fully_shard cannot work with, refused before anything is built or any rank is waited for.
void check_arguments(const std::shared_ptr<torch::nn::Module>& root, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                     const FullyShardOptions& given_options, const std::shared_ptr<RunState>& scope_state) {
  FSDP_CHECK(root != nullptr, "fsdp::fully_shard: the model is null");
  FSDP_CHECK(pg, "fsdp::fully_shard: the process group is null; create one with fsdp::init_process_group()");
  check_options(scope_state ? scope_state->options() : given_options, "fsdp::fully_shard", *pg);
  FSDP_CHECK(dynamic_cast<ShardedUnit*>(root.get()) == nullptr,
             "fsdp::fully_shard: the root module is itself an fsdp::Sharded unit. Pass the plain root module: "
             "fully_shard makes it the root unit and returns its handle.");
}

// The state the model's units share: the scope's, or a new one over `pg` (the mesh's dp group),
// with the mesh's groups and the tensor-parallel splits recorded; the first parameter says where
// the model is, checked against the offload policy.
std::shared_ptr<RunState> open_state(torch::nn::Module& root, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                     const FullyShardOptions& given_options,
                                     const std::shared_ptr<RunState>& scope_state, const MeshState* mesh) {
  auto state = scope_state ? scope_state
                           : std::make_shared<RunState>(pg, given_options,
                                                        mesh != nullptr ? mesh->group_info(kDataDim) : GroupInfo{});
  if (mesh != nullptr) state->init_mesh(*mesh);
  record_tensor_splits(*state, root);
  for (const auto& kv : root.named_parameters()) {  // the first says where the model is
    check_offload(state->options(), kv.key(), kv.value().device(), state->comm().error_in("fsdp::fully_shard"));
    break;
  }
  return state;
}

// A unit's own setting: its modules', which must agree where more than one set it.
template <class Get, class Same>
auto setting_of(RunState& state, const FoundUnit& f, Get get, const char* what, Same same) {
  std::decay_t<decltype(get(*f.unit))> out;
  for (size_t m = 0; m < f.members.size(); ++m) {
    const auto& own = get(*f.members[m]);
    if (!own) continue;
    FSDP_CHECK_IN(state.comm().error_in("fsdp::fully_shard").unit(f.name), !out || same(*out, *own),
                  "the modules sharing unit '", f.name, "' (share_unit_with) set different ", what,
                  "; set it on one of them, or the same on each.");
    out = own;
  }
  return out;
}

// A unit's strategy and mixed-precision policy: its modules' setting, else the options'.
ShardingStrategy strategy_of(RunState& state, const FoundUnit& f) {
  return setting_of(
             state, f, [](const ShardedUnit& u) { return u.sharding_strategy(); }, "sharding strategies",
             std::equal_to<>())
      .value_or(state.options().strategy());
}

MixedPrecisionPolicy precision_of(RunState& state, const FoundUnit& f) {
  return setting_of(
             state, f, [](const ShardedUnit& u) { return u.mixed_precision(); }, "mixed-precision policies",
             [](const MixedPrecisionPolicy& x, const MixedPrecisionPolicy& y) { return to_string(x) == to_string(y); })
      .value_or(state.options().mixed_precision());
}

// Each parameter's unit as the model check names it: "<unit>' (<strategy>[, <policy>])".
std::unordered_map<const c10::TensorImpl*, std::string> unit_labels(RunState& state, const FoundUnits& units) {
  std::unordered_map<const c10::TensorImpl*, std::string> unit_of;
  for (const auto& f : units.found) {
    const MixedPrecisionPolicy& mp = f->built ? f->built->mixed_precision() : precision_of(state, *f);
    const bool mixed = mp.any_dtype();
    const std::string strategy = std::string(to_string(f->built ? f->built->strategy() : strategy_of(state, *f))) +
                                 (mixed ? ", " + to_string(mp) : std::string());
    for (const auto& np : f->params) {
      unit_of[np.second.unsafeGetTensorImpl()] = (f->unit ? f->name : "<root>") + "' (" + strategy + ")";
    }
    if (f->built) {
      for (const auto& s : f->built->slots()) unit_of[s.param.unsafeGetTensorImpl()] = f->name + "' (" + strategy + ")";
    }
  }
  return unit_of;
}

// Whether any unit shards over hybrid's groups, which are then made once for all of them.
bool any_hybrid(RunState& state, const FoundUnits& units) {
  bool hybrid = false;
  for (const auto& f : units.found) hybrid = hybrid || traits(strategy_of(state, *f)).shard_over == ShardOver::kGroup;
  return hybrid;
}

// The model check's text: everything that decides the collectives' sizes and order (names,
// shapes, dtypes, the unit each parameter is in, whether it trains, its device type), the
// buffers and the options.
std::string describe_model(torch::nn::Module& root, const FoundUnits& units,
                           std::unordered_map<const c10::TensorImpl*, std::string>& unit_of,
                           const FullyShardOptions& options) {
  std::ostringstream desc;
  desc << describe_options(options);
  for (const auto& kv : root.named_parameters()) {  // module order: the same on every rank
    const at::Tensor& p = kv.value();
    auto built = units.built_shape.find(p.unsafeGetTensorImpl());
    const std::vector<int64_t> shape = built != units.built_shape.end() ? built->second : p.sizes().vec();
    desc << "param " << kv.key() << ' ' << p.dtype() << ' ' << c10::IntArrayRef(shape) << " in unit '"
         << unit_of[p.unsafeGetTensorImpl()] << (p.requires_grad() ? "" : " frozen") << " ("
         << c10::DeviceTypeName(p.device().type(), true) << ")\n";
  }
  desc << describe_buffers(root) << describe_offload(options);
  return desc.str();
}

// Activation checkpointing: a unit's own setting, else every k-th unit that contains no other
// (a recompute in backward must not run another unit's forward), in module order.
std::vector<bool> checkpointed_units(RunState& state, const FoundUnits& units) {
  const auto& found = units.found;
  std::vector<bool> contains_units(found.size(), false), checkpointed(found.size(), false);
  for (size_t i = 1; i < found.size(); ++i) contains_units[found[i]->parent] = true;
  const int every = state.options().activation_checkpointing_every();
  int leaf = 0;
  for (size_t i = 1; i < found.size(); ++i) {
    const std::optional<bool> own = setting_of(
        state, *found[i], [](const ShardedUnit& u) { return u.activation_checkpointing(); }, "activation checkpointing",
        std::equal_to<>());
    const bool counted = !contains_units[i] && every > 0 && ++leaf % every == 0;
    checkpointed[i] = own.value_or(counted);
    FSDP_CHECK_IN(state.comm().error_in("fsdp::fully_shard").unit(found[i]->name),
                  !checkpointed[i] || !contains_units[i], "unit '", found[i]->name,
                  "' has set_activation_checkpointing(true) but contains other units: its recompute in backward "
                  "would run their forwards again. Checkpoint the units inside it instead.");
  }
  return checkpointed;
}

// The state's units, in module order: those built in a scope renamed to their paths, the others
// made and sharded one by one (each broadcasting rank 0's weights) and attached to their modules.
// Returns the root unit.
std::shared_ptr<Unit> make_units(const std::shared_ptr<RunState>& state, FoundUnits& units,
                                 const std::vector<bool>& checkpointed) {
  std::shared_ptr<Unit> root_group;
  state->units().clear();
  for (auto& f : units.found) {
    const bool checkpoints = checkpointed[state->units().size()];
    if (f->built) {
      f->built->rename(f->member_paths);
      f->built->set_checkpoints_activations(checkpoints);
      state->units().push_back(f->built);
      continue;
    }
    auto g = std::make_shared<Unit>(f->name, std::move(f->params), state, f->unit == nullptr, strategy_of(*state, *f),
                                    precision_of(*state, *f));
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

}  // namespace

std::shared_ptr<Unit> shard_model(const std::shared_ptr<torch::nn::Module>& root,
                                  const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                  const FullyShardOptions& given_options, const std::shared_ptr<RunState>& scope_state,
                                  const MeshState* mesh) {
  check_arguments(root, pg, given_options, scope_state);
  // FullyShardOptions::device: what is not sharded yet (all of it, or the root's own parameters
  // and buffers after a ShardingScope) moves before anything is described, checked or sharded.
  move_to_device(*root, (scope_state ? scope_state->options() : given_options).device());
  const std::shared_ptr<RunState> state = open_state(*root, pg, given_options, scope_state, mesh);
  const FullyShardOptions& options = state->options();
  FoundUnits units = find_units(*root, *state, scope_state != nullptr);
  auto unit_of = unit_labels(*state, units);
  const bool hybrid = any_hybrid(*state, units);
  // The collectives below (buffers, hybrid's groups, each unit's broadcast) pair up only if every
  // rank has the same model.
  check_same_model_on_all_ranks(state->comm(), describe_model(*root, units, unit_of, options));
  // Buffers (running statistics, masks, tables drawn from the RNG) start equal on every rank, as
  // in PyTorch's FSDP and DDP; parameters are broadcast unit by unit as they are sharded.
  if (options.sync_module_states()) broadcast_buffers(state->comm(), *root);
  if (hybrid) state->init_hybrid(options.shard_group_size());
  const std::vector<bool> checkpointed = checkpointed_units(*state, units);
  return make_units(state, units, checkpointed);
}

}  // namespace fsdp::detail
