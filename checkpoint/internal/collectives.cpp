#include "checkpoint/internal/collectives.h"

#include "fsdp/internal/check.h"

namespace fsdp::checkpoint::detail {

using fsdp::detail::Call;
using fsdp::detail::Fingerprint;

namespace {

// What a phase's check raised, without the caller its message begins with: the phase's error
// names the call already ("fsdp::checkpoint::load (rank 0 of 2) of 'ck': checking ... failed on
// this rank: <this>"). A check of ours begins with its context's caller, or, in the checkpoint's
// own helpers, which also raise outside a save or load, with "fsdp::checkpoint: ".
std::string without_caller(const std::exception_ptr& raised) {
  constexpr const char* kCaller = "fsdp::checkpoint: ";
  std::string text = error_text(raised);
  try {
    std::rethrow_exception(raised);
  } catch (const fsdp::Error& e) {
    for (const std::string& caller :
         {e.api().empty() ? std::string() : fsdp::detail::error_caller(e.where()) + ": ", std::string(kCaller)}) {
      if (!caller.empty() && text.rfind(caller, 0) == 0) return text.substr(caller.size());
    }
  } catch (...) {
  }
  return text;
}

}  // namespace

const c10::intrusive_ptr<c10d::ProcessGroup>& checkpoint_group(const FSDPModule& model) {
  return fsdp::detail::checkpoint_group(model)->process_group();
}

std::vector<int> tensor_parallel_ranks(const FSDPModule& model) {
  const fsdp::detail::Comm* tp = fsdp::detail::tensor_parallel_group(model);
  return tp != nullptr ? tp->global_ranks() : std::vector<int>{};
}

Group Group::of(const FSDPModule& model) {
  Group g;
  g.model_ = &model;
  // The model's own communication context (not a copy): its statistics and call log.
  const fsdp::detail::Comm& dp = fsdp::detail::model_group(model);
  // Replicas that train apart keep part of their state in their LocalSGD or DiLoCo object: a
  // checkpoint without it is refused before anything happens (the same on every rank).
  FSDP_CHECK_IN(dp.error_in("fsdp::checkpoint"),
                !fsdp::detail::replicas_apart(model) || fsdp::detail::outer_state(model) != nullptr,
                "the model's replicas train apart, but the fsdp::optim::LocalSGD or DiLoCo object that drives "
                "them is gone, and with it the outer state: keep it alive while saving or loading (or make a new one "
                "first). Nothing was written or read.");
  // Over a mesh with tensor parallelism, or while replicas train apart (LocalSGD), the model's
  // step-boundary agreement spans fewer ranks than the checkpoint: the checkpoint's group agrees too.
  g.wider_than_step_ = fsdp::detail::checkpoint_wider_than_step(model);
  g.comm_ = fsdp::detail::checkpoint_group(model);
  return g;
}

Group Group::world(const DeviceMesh& mesh) {
  Group g;
  fsdp::detail::GroupInfo info;  // the world: group rank = global rank
  info.name = "the pipeline's world";
  g.comm_ = fsdp::detail::own_group(mesh.world(), mesh.timeout(), info);
  return g;
}

Group Group::own(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, std::chrono::milliseconds timeout) {
  Group g;
  // Its members by global rank: the Comm finds them when fsdp::new_subgroup made `pg`.
  fsdp::detail::GroupInfo info{"the asynchronous saver's group", {}};
  info.background = true;  // its agreements are not where the training hangs
  g.comm_ = fsdp::detail::own_group(pg, timeout, info);
  return g;
}

std::vector<int> Group::agree(const std::string& what, bool failed) const {
  const uint64_t payload = Fingerprint().add(what).value();
  std::vector<int64_t> votes;
  if (model_ == nullptr) {
    votes = comm_->agree(Call::kCheckpointPhase, payload, what, {}, failed ? 1 : 0);
  } else if (!wider_than_step_) {
    votes = fsdp::detail::agree(*model_, Call::kCheckpointPhase, payload, what, failed ? 1 : 0);
  } else {
    // The model's step-boundary check (its data-parallel group, or its shard group), then every
    // rank of the checkpoint; a rank whose check failed votes so, and every rank learns it before
    // this one throws.
    std::exception_ptr dp_error;
    try {
      fsdp::detail::agree(*model_, Call::kCheckpointPhase, payload, what, failed ? 1 : 0);
    } catch (...) {
      dp_error = std::current_exception();
    }
    votes = comm_->agree(Call::kCheckpointPhase, payload, what, {}, failed || dp_error ? 1 : 0);
    if (dp_error) std::rethrow_exception(dp_error);
  }
  std::vector<int> out;
  for (size_t r = 0; r < votes.size(); ++r) {
    if (votes[r] != 0) out.push_back(comm_->global_ranks().at(r));
  }
  return out;
}

std::vector<std::string> Group::gather_to_rank0(const std::string& text, const std::string& what) const {
  return exchange(text, what, /*root=*/0);
}

std::vector<std::string> Group::all_gather(const std::string& text, const std::string& what) const {
  return exchange(text, what, /*root=*/-1);
}

std::vector<std::string> Group::exchange(const std::string& text, const std::string& what, int root) const {
  if (model_ == nullptr) return comm_->exchange_strings(text, what, root);
  // Over the model's group: a failure leaves its ranks at different collectives.
  std::vector<std::string> out;
  fsdp::detail::breaks_on_failure(*model_, [&] { out = comm_->exchange_strings(text, what, root); });
  return out;
}

void agree(const Group& group, const std::string& call, const ErrorContext& caller, const std::string& phase,
           const std::string& consequence, const std::function<void()>& fn) {
  std::string error;
  try {
    fn();
  } catch (...) {
    error = without_caller(std::current_exception());
  }
  const std::vector<int> failed = group.agree(call + ": " + phase, !error.empty());
  ErrorContext context = group.error_in(call + ": " + phase, caller);
  FSDP_CHECK_IN(context, error.empty(), phase, " failed on this rank: ", error);
  if (failed.empty()) return;
  // The ranks whose errors say why, so that the log to read is known at once in a large job.
  FSDP_CHECK_IN(context.peer(failed.front()), false, phase,
                " failed on another rank: ", failed.size() == 1 ? "rank " : "ranks ", fsdp::detail::list_ranks(failed),
                " (its error says why); ", consequence, ".");
}

}  // namespace fsdp::checkpoint::detail
