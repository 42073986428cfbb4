#include "fsdp/state.h"

#include "fsdp/model_check.h"
#include "fsdp/param_group.h"
#include "fsdp/process_group.h"
#include "fsdp/sharded.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/engine.h>

#include <cstring>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace fsdp::detail {

FSDPState::FSDPState(c10::intrusive_ptr<c10d::ProcessGroup> pg, FullyShardOptions options)
    : options(options),
      comm(std::move(pg), this->options.timeout(), std::make_shared<CommShared>(), GroupInfo{},
           this->options.verify_collectives()) {}

void FSDPState::init_hybrid(int group_size) {
  if (shard_comm) return;
  const int W = comm.world_size();
  const int r = comm.rank();
  TORCH_CHECK(group_size >= 1 && W % group_size == 0, "fsdp::fully_shard (rank ", r, " of ", W,
              "): kHybridShard needs FullyShardOptions::shard_group_size to divide the world size, but it is ",
              group_size, ". Set it to the ranks of one group, e.g. the processes of one node.");
  // A fresh name per model: every rank wraps its models in the same order, so the counters agree.
  static int models = 0;
  const std::string name = "hybrid" + std::to_string(models++);
  std::vector<int> shard_ranks, replicate_ranks;
  for (int i = 0; i < group_size; ++i) shard_ranks.push_back(r / group_size * group_size + i);
  for (int g = 0; g < W / group_size; ++g) replicate_ranks.push_back(g * group_size + r % group_size);
  // Shard groups first on every rank, then replicate groups: no member waits for one busy elsewhere.
  auto shard_pg = new_subgroup(comm.process_group(), shard_ranks, name + "/shard" + std::to_string(r / group_size));
  auto replicate_pg =
      new_subgroup(comm.process_group(), replicate_ranks, name + "/replicate" + std::to_string(r % group_size));
  // Errors on these groups name global ranks: the groups' members are listed in their messages.
  shard_comm = std::make_unique<Comm>(shard_pg, comm.timeout(), comm.shared(),
                                      GroupInfo{"hybrid shard group " + std::to_string(r / group_size), shard_ranks, W},
                                      comm.verify());
  replicate_comm = std::make_unique<Comm>(
      replicate_pg, comm.timeout(), comm.shared(),
      GroupInfo{"hybrid replicate group " + std::to_string(r % group_size), replicate_ranks, W}, comm.verify());
}

void FSDPState::check_boundary(Boundary b, int64_t a, int64_t c, const std::string& description) {
  CallLog& log = comm.log();
  const std::array<int64_t, 6> code{static_cast<int64_t>(b), a, c, log.count, static_cast<int64_t>(log.hash), 0};
  try {
    comm.check_same_call(code, description, [&log] {
      std::ostringstream os;
      os << ", after " << log.count << " collective(s) of this model since the previous check";
      if (log.count > 0) os << " (" << log.summary() << ")";
      return os.str();
    });
  } catch (const std::exception& e) {
    mark_broken(error_text(e));
    throw;
  }
  log.reset();
}

void FSDPState::on_backward_begin() {
  if (callback_queued_) return;
  ++backwards_;
  check_boundary(Boundary::kBackwardBegin, backwards_, sync_gradients ? 1 : 0,
                 "the start of backward #" + std::to_string(backwards_) + " (gradient sync " +
                     (sync_gradients ? "on" : "off") + ")");
  callback_queued_ = true;
  std::weak_ptr<FSDPState> self = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    if (auto s = self.lock()) s->finalize_backward();
  });
}

void FSDPState::finalize_backward() {
  callback_queued_ = false;
  for (auto& w : groups) {
    if (auto g = w.lock()) g->finalize_backward();
  }
  finish_reduces();
  // Ranks whose backwards issued different collectives of equal sizes are stopped here, before an
  // optimizer uses what they reduced.
  check_boundary(Boundary::kBackwardEnd, backwards_, 0, "the end of backward #" + std::to_string(backwards_));
}

void FSDPState::end_forward() {
  if (!recording_.empty()) order_ = std::move(recording_);
  recording_.clear();
  // A unit prefetched but skipped by this forward must not keep reading its shard (which the
  // optimizer may update next) nor hold its gathered buffer.
  for (auto& w : groups) {
    if (auto g = w.lock()) g->drop_prefetch();
  }
}

int64_t FSDPState::held_state_bytes() const {
  std::vector<at::Tensor> held;
  for (const auto& w : groups) {
    if (auto g = w.lock()) g->append_held_tensors(held);
  }
  // Shards alias their unit's flat buffer, ZeRO-1's shards and gradients alias the full ones:
  // each storage is counted once, at its allocated size (padding included).
  std::unordered_set<const c10::StorageImpl*> seen;
  int64_t bytes = 0;
  for (const auto& t : held) {
    if (!t.defined() || !t.has_storage()) continue;
    const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    if (seen.insert(impl).second) bytes += static_cast<int64_t>(impl->nbytes());
  }
  return bytes;
}

void FSDPState::check_no_unsynced_grads(const char* caller) const {
  std::vector<std::string> units;
  for (const auto& w : groups) {
    auto g = w.lock();
    if (g && g->holds_unsynced_grads()) units.push_back(g->is_root() ? "<root>" : g->name());
  }
  if (units.empty()) return;
  std::ostringstream names;
  for (size_t i = 0; i < units.size() && i < 3; ++i) names << (i ? ", '" : "'") << units[i] << "'";
  if (units.size() > 3) names << " and " << units.size() - 3 << " more";
  TORCH_CHECK(false, caller, " (", comm.where(), "): ", units.size(),
              " unit(s) hold gradients accumulated with gradient sync off (", names.str(),
              ") that were never reduced into the sharded gradients, so the optimizer cannot see them: those "
              "micro-batches would train nothing. Turn sync back on before the backward of the last micro-batch "
              "of each step: model.set_requires_gradient_sync(true) (docs/usage.md, 'Gradient accumulation').");
}

void FSDPState::mark_broken(const std::string& why) {
  if (broken_.empty()) broken_ = why;
}

void FSDPState::check_not_broken() const {
  TORCH_CHECK(broken_.empty(), "fsdp (", comm.where(),
              "): an earlier collective of this model failed, so the ranks no longer agree on which collective "
              "comes next. Exit and restart the job from its last checkpoint (docs/usage.md, 'When a collective "
              "fails'). The first failure was:\n",
              broken_);
}

void FSDPState::after_unit_unsharded(ParamGroup& unit, bool backward) {
  if (!backward && !unit.is_root()) recording_.push_back(unit.weak_from_this());
  const int depth = options.prefetch();
  if (depth <= 0) return;
  // The root comes before the first unit in forward and after the last one in backward.
  std::ptrdiff_t i = backward ? static_cast<std::ptrdiff_t>(order_.size()) : -1;
  if (!unit.is_root()) {
    auto it = std::find_if(order_.begin(), order_.end(), [&](const auto& w) { return w.lock().get() == &unit; });
    if (it == order_.end()) return;  // not seen in the last forward: no order to follow yet
    i = it - order_.begin();
  }
  for (int k = 1; k <= depth; ++k) {
    const auto j = backward ? i - k : i + k;
    if (j < 0 || j >= static_cast<std::ptrdiff_t>(order_.size())) break;
    if (auto next = order_[j].lock()) next->begin_unshard();
  }
}

void FSDPState::after_reduce_issued(ParamGroup& unit) {
  while (!reducing_.empty()) {
    auto oldest = reducing_.front().lock();
    reducing_.erase(reducing_.begin());
    if (oldest && oldest.get() != &unit) oldest->finish_reduce();
  }
  reducing_.push_back(unit.weak_from_this());
}

void FSDPState::finish_reduces() {
  auto in_flight = std::move(reducing_);
  reducing_.clear();
  for (auto& w : in_flight) {
    if (auto g = w.lock()) g->finish_reduce();
  }
}

void FSDPState::begin_forward() {
  check_not_broken();
  ++forwards_;
  const bool grad = c10::GradMode::is_enabled();
  check_boundary(
      Boundary::kForward, forwards_, grad ? 1 : 0,
      "forward #" + std::to_string(forwards_) + " of the wrapped model (" + (grad ? "gradients on" : "no grad") + ")");
  recording_.clear();
  for (auto& w : groups) {
    if (auto g = w.lock()) g->drop_prefetch();  // left by a forward that threw
  }
  if (!callback_queued_) return;
  callback_queued_ = false;
  for (auto& w : groups) {
    if (auto g = w.lock()) g->reset_after_failed_backward();
  }
}

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

}  // namespace

void shard_on_construction(const std::shared_ptr<FSDPState>& state, torch::nn::Module& module, ShardedUnit& unit) {
  std::vector<std::pair<std::string, at::Tensor>> params;
  unit_parameters(module, "", params);
  // Tied inside the unit: sharded once.
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  std::vector<std::pair<std::string, at::Tensor>> unique;
  for (auto& np : params) {
    if (seen.emplace(np.second.unsafeGetTensorImpl(), true).second) unique.push_back(std::move(np));
  }
  const ShardingStrategy strategy = state->options.strategy();
  // The collectives below (broadcast, hybrid groups) pair up only if every rank builds the same
  // unit now: check that first, by the unit's own description.
  std::ostringstream desc;
  desc << "option strategy " << to_string(strategy) << '\n' << describe_options(state->options);
  for (const auto& [name, p] : unique) {
    desc << "param " << name << ' ' << p.dtype() << ' ' << p.sizes() << (p.requires_grad() ? "" : " frozen") << " ("
         << c10::DeviceTypeName(p.device().type(), true) << ")\n";
  }
  check_same_model_on_all_ranks(state->comm, desc.str());
  if (traits(strategy).shard_over == ShardOver::kGroup) state->init_hybrid(state->options.shard_group_size());
  auto group = std::make_shared<ParamGroup>("", std::move(unique), state, /*is_root=*/false, strategy);
  group->init();
  unit.fsdp_attach(group);
}

std::shared_ptr<ParamGroup> shard_model(const std::shared_ptr<torch::nn::Module>& root,
                                        const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                        const FullyShardOptions& given_options,
                                        const std::shared_ptr<FSDPState>& scope_state) {
  TORCH_CHECK(root != nullptr, "fsdp::fully_shard: the model is null");
  TORCH_CHECK(pg, "fsdp::fully_shard: the process group is null; create one with fsdp::init_process_group()");
  TORCH_CHECK(dynamic_cast<ShardedUnit*>(root.get()) == nullptr,
              "fsdp::fully_shard: the root module is itself an fsdp::Sharded unit. Pass the plain root module: "
              "fully_shard makes it the root unit and returns its handle.");
  auto state = scope_state ? scope_state : std::make_shared<FSDPState>(pg, given_options);
  const FullyShardOptions& options = state->options;

  struct Found {
    std::string name;
    ShardedUnit* unit;
    std::vector<std::pair<std::string, at::Tensor>> params;
    std::shared_ptr<ParamGroup> built;  // sharded while the model was built (ShardingScope)
  };
  std::vector<std::unique_ptr<Found>> found;
  found.push_back(std::make_unique<Found>(Found{"", nullptr, {}, nullptr}));
  std::unordered_map<const c10::TensorImpl*, std::vector<int64_t>> built_shape;      // of parameters sharded already
  std::unordered_map<const c10::TensorImpl*, std::pair<std::string, size_t>> owner;  // -> name, unit

  // Records which unit owns a parameter; a parameter met again must be in the same unit.
  auto claim = [&](const at::Tensor& p, const std::string& name, size_t unit) {
    auto [it, inserted] = owner.emplace(p.unsafeGetTensorImpl(), std::make_pair(name, unit));
    TORCH_CHECK(inserted || it->second.second == unit, "fsdp::fully_shard (rank ", state->comm.rank(), "): parameter '",
                it->second.first, "' is shared with '", name, "', which is in another unit ('",
                found[it->second.second]->name, "' vs '", found[unit]->name,
                "'). A shared parameter must live in one unit: move both modules into one fsdp::Sharded unit "
                "or leave them in the root.");
    return inserted;  // false: shared inside one unit, sharded once
  };

  // `built`: inside a unit sharded while the model was built (ShardingScope), whose parameters
  // are in it already; only units nested in it remain to be found.
  std::function<void(torch::nn::Module&, const std::string&, size_t, bool)> visit =
      [&](torch::nn::Module& m, const std::string& prefix, size_t unit, bool built) {
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
          if (u != nullptr && u->fsdp_unit() != nullptr) {
            TORCH_CHECK(scope_state != nullptr, "fsdp::fully_shard (rank ", state->comm.rank(), "): module '", name,
                        "' is already sharded: either the model was wrapped before (wrap a model once) or it was "
                        "built inside an fsdp::ShardingScope (then wrap it with fsdp::fully_shard(model, scope)).");
            TORCH_CHECK(&u->fsdp_unit()->state() == state.get(), "fsdp::fully_shard (rank ", state->comm.rank(),
                        "): module '", name,
                        "' was sharded by another ShardingScope or model; build and wrap a model within one scope.");
            found.push_back(std::make_unique<Found>(Found{name, u, {}, u->fsdp_unit()}));
            for (const auto& s : u->fsdp_unit()->slots()) {
              claim(s.param, name + "." + s.name, found.size() - 1);
              built_shape[s.param.unsafeGetTensorImpl()] = s.shape;
            }
            visit(*kv.value(), name, found.size() - 1, /*built=*/true);
            continue;
          }
          if (u != nullptr) {
            TORCH_CHECK(!built, "fsdp::fully_shard (rank ", state->comm.rank(), "): unit '", name,
                        "' was built outside the ShardingScope that sharded the unit containing it; build the whole "
                        "model inside the scope.");
            found.push_back(std::make_unique<Found>(Found{name, u, {}, nullptr}));
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
  std::unordered_map<const c10::TensorImpl*, std::string> unit_of;
  for (const auto& f : found) {
    const char* strategy = to_string(f->built ? f->built->strategy() : strategy_of(*f));
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
  desc << describe_buffers(*root);
  check_same_model_on_all_ranks(state->comm, desc.str());
  // Buffers (running statistics, masks, tables drawn from the RNG) start equal on every rank, as
  // in PyTorch's FSDP and DDP; parameters are broadcast unit by unit as they are sharded.
  if (options.sync_module_states()) broadcast_buffers(state->comm, *root);
  if (hybrid) state->init_hybrid(options.shard_group_size());

  std::shared_ptr<ParamGroup> root_group;
  state->groups.clear();
  for (auto& f : found) {
    if (f->built) {
      f->built->rename(f->name);
      state->groups.push_back(f->built);
      continue;
    }
    auto g = std::make_shared<ParamGroup>(f->name, std::move(f->params), state, f->unit == nullptr, strategy_of(*f));
    g->init();
    state->groups.push_back(g);
    if (f->unit != nullptr) {
      f->unit->fsdp_attach(g);
    } else {
      root_group = g;
    }
  }
  return root_group;
}

}  // namespace fsdp::detail
