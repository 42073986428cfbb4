#include "fsdp/internal/wrap.h"

#include "fsdp/internal/access.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/model_check.h"
#include "fsdp/internal/options_check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"
#include "fsdp/sharded.h"

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
  return type + " #" + std::to_string(index) + " (built in a ShardingScope)";
}
}  // namespace

void shard_on_construction(const std::shared_ptr<RunState>& state, torch::nn::Module& module, ShardedUnit& unit) {
  std::vector<std::pair<std::string, at::Tensor>> params;
  unit_parameters(module, "", params);
  // Tied inside the unit: sharded once.
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  std::vector<std::pair<std::string, at::Tensor>> unique;
  for (auto& np : params) {
    if (seen.emplace(np.second.unsafeGetTensorImpl(), true).second) unique.push_back(std::move(np));
  }
  if (!unique.empty())
    check_offload(state->options, unique.front().first, unique.front().second.device(), state->comm.rank());
  const ShardingStrategy strategy = state->options.strategy();
  // The collectives below (broadcast, hybrid groups) pair up only if every rank builds the same
  // unit now: check that first, by the unit's own description.
  std::ostringstream desc;
  desc << "option strategy " << to_string(strategy) << '\n' << describe_options(state->options);
  const MixedPrecisionPolicy& mp = state->options.mixed_precision();
  const bool mixed = mp.any_dtype();
  for (const auto& [name, p] : unique) {
    desc << "param " << name << ' ' << p.dtype() << ' ' << p.sizes() << (p.requires_grad() ? "" : " frozen") << " ("
         << c10::DeviceTypeName(p.device().type(), true) << ")" << (mixed ? " " + to_string(mp) : "") << "\n";
  }
  desc << describe_offload(state->options);
  check_same_model_on_all_ranks(state->comm, desc.str());
  if (traits(strategy).shard_over == ShardOver::kGroup) state->init_hybrid(state->options.shard_group_size());
  auto group = std::make_shared<Unit>("", std::move(unique), state, /*is_root=*/false, strategy,
                                      state->options.mixed_precision());
  group->set_built_label(built_label(module, ++state->units_built));
  group->init();
  Access::attach(unit, group);
}

std::shared_ptr<Unit> shard_model(const std::shared_ptr<torch::nn::Module>& root,
                                  const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                  const FullyShardOptions& given_options,
                                  const std::shared_ptr<RunState>& scope_state) {
  FSDP_CHECK(root != nullptr, "fsdp::fully_shard: the model is null");
  check_options(scope_state ? scope_state->options : given_options, "fsdp::fully_shard");
  FSDP_CHECK(pg, "fsdp::fully_shard: the process group is null; create one with fsdp::init_process_group()");
  FSDP_CHECK(dynamic_cast<ShardedUnit*>(root.get()) == nullptr,
             "fsdp::fully_shard: the root module is itself an fsdp::Sharded unit. Pass the plain root module: "
             "fully_shard makes it the root unit and returns its handle.");
  auto state = scope_state ? scope_state : std::make_shared<RunState>(pg, given_options);
  const FullyShardOptions& options = state->options;
  for (const auto& kv : root->named_parameters()) {  // the first says where the model is
    check_offload(options, kv.key(), kv.value().device(), state->comm.rank());
    break;
  }

  struct Found {
    std::string name;
    ShardedUnit* unit;
    std::vector<std::pair<std::string, at::Tensor>> params;
    std::shared_ptr<Unit> built;  // sharded while the model was built (ShardingScope)
    size_t parent = 0;            // the unit containing it (the root: itself)
  };
  std::vector<std::unique_ptr<Found>> found;
  found.push_back(std::make_unique<Found>(Found{"", nullptr, {}, nullptr}));
  std::unordered_map<const c10::TensorImpl*, std::vector<int64_t>> built_shape;      // of parameters sharded already
  std::unordered_map<const c10::TensorImpl*, std::pair<std::string, size_t>> owner;  // -> name, unit

  // Records which unit owns a parameter; a parameter met again must be in the same unit.
  auto claim = [&](const at::Tensor& p, const std::string& name, size_t unit) {
    auto [it, inserted] = owner.emplace(p.unsafeGetTensorImpl(), std::make_pair(name, unit));
    FSDP_CHECK(inserted || it->second.second == unit, "fsdp::fully_shard (rank ", state->comm.rank(), "): parameter '",
               it->second.first, "' is shared with '", name, "', which is in another unit ('",
               found[it->second.second]->name, "' vs '", found[unit]->name,
               "'). A shared parameter must live in one unit: move both modules into one fsdp::Sharded unit "
               "or leave them in the root.");
    return inserted;  // false: shared inside one unit, sharded once
  };

  // `built`: inside a unit sharded while the model was built (ShardingScope), whose parameters
  // are in it already; only units nested in it remain to be found.
  std::function<void(torch::nn::Module&, const std::string&, size_t, bool)> visit = [&](torch::nn::Module& m,
                                                                                        const std::string& prefix,
                                                                                        size_t unit, bool built) {
    if (!built) {
      for (const auto& kv : m.named_parameters(/*recurse=*/false)) {
        const std::string name = prefix.empty() ? kv.key() : prefix + "." + kv.key();
        if (claim(kv.value(), name, unit)) found[unit]->params.emplace_back(name, kv.value());
      }
    }
    for (const auto& kv : m.named_children()) {
      const std::string name = prefix.empty() ? kv.key() : prefix + "." + kv.key();
      size_t child_unit = unit;
      auto* u = dynamic_cast<ShardedUnit*>(kv.value().get());
      if (u != nullptr && u->is_sharded()) {
        const std::shared_ptr<Unit>& sharded = Access::unit(*u);
        FSDP_CHECK_IN(state->comm.error_context("fsdp::fully_shard").unit(name), scope_state != nullptr,
                      "fsdp::fully_shard (rank ", state->comm.rank(), "): module '", name,
                      "' is already sharded: either the model was wrapped before (wrap a model once) or it was "
                      "built inside an fsdp::ShardingScope (then wrap it with fsdp::fully_shard(model, scope)).");
        FSDP_CHECK(&sharded->state() == state.get(), "fsdp::fully_shard (rank ", state->comm.rank(), "): module '",
                   name, "' was sharded by another ShardingScope or model; build and wrap a model within one scope.");
        found.push_back(std::make_unique<Found>(Found{name, u, {}, sharded, unit}));
        for (const auto& s : sharded->slots()) {
          claim(s.param, name + "." + s.name, found.size() - 1);
          built_shape[s.param.unsafeGetTensorImpl()] = s.shape;
        }
        visit(*kv.value(), name, found.size() - 1, /*built=*/true);
        continue;
      }
      if (u != nullptr) {
        FSDP_CHECK(!built, "fsdp::fully_shard (rank ", state->comm.rank(), "): unit '", name,
                   "' was built outside the ShardingScope that sharded the unit containing it; build the whole "
                   "model inside the scope.");
        found.push_back(std::make_unique<Found>(Found{name, u, {}, nullptr, unit}));
        child_unit = found.size() - 1;
      }
      visit(*kv.value(), name, child_unit, built);
    }
  };
  visit(*root, "", 0, /*built=*/false);

  // Everything that decides the collectives' sizes and order: names, shapes, dtypes, the unit
  // each parameter is in, whether it trains, its device type.
  auto strategy_of = [&](const Found& f) {
    return f.unit && f.unit->sharding_strategy() ? *f.unit->sharding_strategy() : options.strategy();
  };
  auto precision_of = [&](const Found& f) {
    return f.unit && f.unit->mixed_precision() ? *f.unit->mixed_precision() : options.mixed_precision();
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
  check_same_model_on_all_ranks(state->comm, desc.str());
  // Buffers (running statistics, masks, tables drawn from the RNG) start equal on every rank, as
  // in PyTorch's FSDP and DDP; parameters are broadcast unit by unit as they are sharded.
  if (options.sync_module_states()) broadcast_buffers(state->comm, *root);
  if (hybrid) state->init_hybrid(options.shard_group_size());

  // Activation checkpointing: a unit's own setting, else every k-th unit that contains no other
  // (a recompute in backward must not run another unit's forward), in module order.
  std::vector<bool> contains_units(found.size(), false), checkpointed(found.size(), false);
  for (size_t i = 1; i < found.size(); ++i) contains_units[found[i]->parent] = true;
  const int every = options.activation_checkpointing_every();
  int leaf = 0;
  for (size_t i = 1; i < found.size(); ++i) {
    const std::optional<bool>& own = found[i]->unit->activation_checkpointing();
    const bool counted = !contains_units[i] && every > 0 && ++leaf % every == 0;
    checkpointed[i] = own.value_or(counted);
    FSDP_CHECK_IN(state->comm.error_context("fsdp::fully_shard").unit(found[i]->name),
                  !checkpointed[i] || !contains_units[i], "fsdp::fully_shard (rank ", state->comm.rank(), "): unit '",
                  found[i]->name,
                  "' has set_activation_checkpointing(true) but contains other units: its recompute in backward "
                  "would run their forwards again. Checkpoint the units inside it instead.");
  }
  std::shared_ptr<Unit> root_group;
  state->units.clear();
  for (auto& f : found) {
    const bool checkpoints = checkpointed[state->units.size()];
    if (f->built) {
      f->built->rename(f->name);
      f->built->set_checkpoints_activations(checkpoints);
      state->units.push_back(f->built);
      continue;
    }
    auto g = std::make_shared<Unit>(f->name, std::move(f->params), state, f->unit == nullptr, strategy_of(*f),
                                    precision_of(*f));
    g->set_checkpoints_activations(checkpoints);
    g->init();
    state->units.push_back(g);
    if (f->unit != nullptr) {
      Access::attach(*f->unit, g);
    } else {
      root_group = g;
    }
  }
  return root_group;
}

}  // namespace fsdp::detail
