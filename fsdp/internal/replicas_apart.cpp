// Replicas that train apart (fsdp::optim::LocalSGD, DiLoCo): hybrid sharding without the
// all-reduce of gradients across replicas. Each shard group is then a replica that trains alone,
// and the outer step, every H inner steps, is the only traffic across replicas.
//
// Why a mode of the run state and not a strategy of its own: the units are laid out, gathered and
// reduce-scattered exactly as in hybrid sharding; only the step's reach changes (the replicate
// all-reduce is skipped, the mean is the shard group's, and the per-step agreements, clipping's
// norm and the scaler's overflow span the shard group: RunState::step_comm). The checkpoint keeps
// spanning every rank (checkpoint/internal/collectives.cpp).
#include "fsdp/internal/access.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"

namespace fsdp::detail {

Comm& train_replicas_apart(const FSDPModule& model, const std::string& caller, uint64_t settings,
                           const std::string& text) {
  RunState& state = Access::state(model);
  state.check_not_broken();
  const ErrorContext context = state.comm().error_in(caller);
  const char* remedy =
      " Wrap the model with hybrid sharding: FullyShardOptions().strategy(ShardingStrategy::kHybridShard)"
      ".shard_group_size(S) over a process group (each group of S consecutive ranks is a replica; S may be 1), "
      "or fully_shard over a DeviceMesh with dp_replicate and dp_shard both above one rank.";
  FSDP_CHECK_IN(context, state.replicate_comm() != nullptr, "the model is not hybrid-sharded, so it has no ",
                "replicas to train apart (",
                state.options().strategy() == ShardingStrategy::kHybridShard
                    ? "its mesh has no dp_replicate and dp_shard dimensions both above one rank"
                    : std::string("it is ") + to_string(state.options().strategy()) + " over its " +
                          std::to_string(state.comm().world_size()) + " data-parallel rank(s)",
                ").", remedy);
  state.for_each_unit([&](const Unit& u) {
    FSDP_CHECK_IN(context, u.strategy() == ShardingStrategy::kHybridShard, "unit '", u.label(), "' is ",
                  to_string(u.strategy()), " (set_sharding_strategy), so its gradients would still be reduced ",
                  "over every replica at each step. Every unit must be hybrid-sharded; remove the unit's override.");
  });
  FSDP_CHECK_IN(context, !model.step_in_progress(),
                "called between a forward and its backward; create it between steps.");
  state.check_no_unsynced_grads(caller.c_str());
  // The settings agreed over every data-parallel rank; when they differ, every rank names the first
  // rank whose settings are not rank 0's, with both (not only "the ranks took different paths").
  auto settings_of = [](const std::string& d) {
    const size_t body = d.find('\n');  // after "<caller> with <text>"
    return body == std::string::npos ? d : d.substr(body + 1);
  };
  auto explain = [&](const std::vector<std::string>& described) {
    for (size_t q = 1; q < described.size(); ++q) {
      FSDP_CHECK_IN(context, settings_of(described[q]) == settings_of(described[0]),
                    "the settings differ between the data-parallel ranks: rank 0 has ", settings_of(described[0]),
                    ", rank ", q, " has ", settings_of(described[q]),
                    ". Every rank must build it with the same options.");
    }
    FSDP_CHECK_IN(context, false,
                  "the settings differ between the data-parallel ranks. Every rank must build it with the same "
                  "options.");
  };
  state.breaks_on_failure([&] {
    state.comm().agree(
        Call::kOuterStep, settings, caller + " with " + text, [&] { return "\n" + text; }, 0, explain);
  });
  state.set_replicas_apart();
  return *state.replicate_comm();
}

}  // namespace fsdp::detail
