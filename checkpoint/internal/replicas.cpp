#include "checkpoint/internal/replicas.h"

#include "checkpoint/internal/optimizer_state.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <nlohmann/json.hpp>

#include <cstdlib>

namespace fsdp::checkpoint::detail {
namespace {

std::shared_ptr<fsdp::detail::OuterState> outer_of(const FSDPModule& model, const char* call) {
  auto outer = fsdp::detail::outer_state(model);
  FSDP_CHECK_IN(ErrorContext().api(call).rank(model.rank()), outer != nullptr,
                "the model's replicas train apart, but the fsdp::optim::LocalSGD or DiLoCo object that drives them is "
                "gone, and with it the outer state: keep it alive while saving or loading.");
  return outer;
}

int64_t number(const Metadata& md, const std::string& key, const std::string& dir) {
  const auto it = md.find(key);
  FSDP_CHECK(it != md.end(), "checkpoint '", dir, "' of replicas that trained apart has no '", key,
             "' in its metadata: the manifest was edited or written by another program.");
  char* end = nullptr;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  FSDP_CHECK(end != it->second.c_str() && *end == '\0' && v >= 0, "checkpoint '", dir, "': metadata '", key, "' is '",
             it->second, "', not a count.");
  return v;
}

}  // namespace

std::optional<ReplicaSave> replica_save(const FSDPModule& model, const std::vector<ShardSpec>& specs) {
  if (!fsdp::detail::replicas_apart(model)) return std::nullopt;
  auto outer = outer_of(model, "fsdp::checkpoint::save");
  outer->flush();  // the overlapped variant's exchange in flight belongs to the parameters
  ReplicaSave r;
  r.replicas = specs.empty() ? 1 : specs.front().replicas;
  r.replica = specs.empty() ? 0 : specs.front().replica_rank;
  r.prefix = "replica" + std::to_string(r.replica) + "/";
  r.global = outer->global_shards();
  r.metadata["fsdp/replicas"] = std::to_string(r.replicas);
  r.metadata["fsdp/inner_steps"] = std::to_string(outer->inner_steps());
  r.metadata["fsdp/sync_every"] = std::to_string(outer->sync_every());
  r.metadata["fsdp/outer"] = outer->kind();
  if (const torch::optim::Optimizer* o = outer->outer_optimizer()) {
    r.outer = o;
    r.outer_type = optimizer_type(*o, "fsdp::checkpoint::save (DiLoCo's outer optimizer)");
    nlohmann::ordered_json steps = nlohmann::ordered_json::object();
    for (size_t i = 0; i < specs.size(); ++i) {
      const ParamState st = param_state(*o, r.outer_type, r.global[i]);
      if (st.step >= 0) steps[specs[i].name] = st.step;
    }
    r.metadata["fsdp/outer_optimizer"] = r.outer_type;
    r.metadata["fsdp/outer_steps"] = steps.dump();
  }
  return r;
}

ReplicaLoad replica_load(const Manifest& m, FSDPModule& model, const std::vector<ShardSpec>& specs) {
  ReplicaLoad plan;
  if (m.metadata.count("fsdp/replicas") != 0)
    plan.saved_replicas = static_cast<int>(number(m.metadata, "fsdp/replicas", m.dir));
  const bool apart = fsdp::detail::replicas_apart(model);
  const int replicas = specs.empty() ? 1 : specs.front().replicas;
  const int replica = specs.empty() ? 0 : specs.front().replica_rank;
  if (plan.saved_replicas > 0) {
    // The inner optimizer's state: this replica's own, or with another number of replicas (or
    // none training apart now) replica r mod R's.
    const int from = apart ? replica % plan.saved_replicas : 0;
    plan.optim_prefix = "replica" + std::to_string(from) + "/optim/";
    plan.optim_kind = "replica-optimizer";
  }
  if (!apart) {
    // Said, since a LocalSGD or DiLoCo made after the load finds nothing of its replicas' state.
    if (plan.saved_replicas > 0) {
      plan.outcome = "the global state (saved by " + std::to_string(plan.saved_replicas) +
                     " replicas training apart; this model does not train apart: make its LocalSGD or DiLoCo "
                     "before the load to resume each replica's own state)";
    }
    return plan;
  }
  auto outer = outer_of(model, "fsdp::checkpoint::load");
  outer->flush();
  if (outer->kind() == "DiLoCo") plan.global = outer->global_shards();
  plan.outer = outer->outer_optimizer();
  const int64_t H = outer->sync_every();
  // Saved by the other kind, or with another H: loaded as it is, and said (the period restarts from
  // the saved inner step on the new H; the saved outer step was on the saved H).
  std::string other;
  int64_t saved_H = H, saved_steps = 0;
  if (plan.saved_replicas > 0) {
    const auto kind = m.metadata.find("fsdp/outer");
    saved_H = number(m.metadata, "fsdp/sync_every", m.dir);
    saved_steps = number(m.metadata, "fsdp/inner_steps", m.dir);
    const std::string saved_kind = kind == m.metadata.end() ? outer->kind() : kind->second;
    if (saved_kind != outer->kind() || saved_H != H) {
      other = "; saved by " + saved_kind + " every " + std::to_string(saved_H) + " steps, loaded by " + outer->kind() +
              " every " + std::to_string(H);
      if (saved_kind == "DiLoCo" && outer->kind() != "DiLoCo") other += ": DiLoCo's outer state is not used";
      if (saved_kind != "DiLoCo" && outer->kind() == "DiLoCo")
        other += ": the global shards start from the replicas' mean at the save, the outer optimizer from its start";
    }
  }
  if (plan.saved_replicas == replicas) {
    plan.own_state = true;
    plan.model_prefix = "replica" + std::to_string(replica) + "/model/";
    plan.model_kind = "replica";
    plan.inner_steps = saved_steps;
    plan.outcome = "each of the " + std::to_string(replicas) + " replicas its own state, at inner step " +
                   std::to_string(plan.inner_steps) + other;
  } else {
    // Every replica from the global state: the inner steps restart at the last outer step.
    plan.inner_steps = saved_steps - saved_steps % saved_H;
    plan.outcome = "restarted from the global state at inner step " + std::to_string(plan.inner_steps) + " (saved by " +
                   (plan.saved_replicas > 0 ? std::to_string(plan.saved_replicas) + " replicas training apart"
                                            : std::string("replicas that did not train apart")) +
                   ", loaded on " + std::to_string(replicas) + ")" + other;
  }
  const auto type = m.metadata.find("fsdp/outer_optimizer");
  if (plan.outer != nullptr && type != m.metadata.end()) {
    plan.outer_type = optimizer_type(*plan.outer, "fsdp::checkpoint::load (DiLoCo's outer optimizer)");
    FSDP_CHECK(plan.outer_type == type->second, "checkpoint '", m.dir, "' holds DiLoCo's outer optimizer state of ",
               type->second, ", but the outer optimizer is ", plan.outer_type,
               ": build DiLoCo with the outer optimizer it was saved with.");
    const auto steps = nlohmann::json::parse(m.metadata.at("fsdp/outer_steps"));
    for (const auto& [name, step] : steps.items()) plan.outer_steps[name] = step.get<int64_t>();
  }
  return plan;
}

void finish_replica_load(const ReplicaLoad& plan, FSDPModule& model) {
  if (plan.inner_steps < 0) return;
  fsdp::detail::outer_state(model)->set_inner_steps(plan.inner_steps);
}

}  // namespace fsdp::checkpoint::detail
