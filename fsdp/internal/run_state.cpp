#include "fsdp/internal/run_state.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/mesh_state.h"
#include "fsdp/internal/model_check.h"
#include "fsdp/internal/unit.h"
#include "fsdp/process_group.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/engine.h>

#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace fsdp::detail {

RunState::RunState(c10::intrusive_ptr<c10d::ProcessGroup> pg, FullyShardOptions options, GroupInfo group)
    : options_(std::move(options)),
      comm_(std::move(pg), options_.timeout(), std::make_shared<CommShared>(), std::move(group),
            options_.verify_collectives()),
      // Each unit in flight (the root, kept gathered, the one computing and those prefetched)
      // holds at most two buffers.
      pool_(2 * (2 + static_cast<int64_t>(options_.prefetch()))) {
  // Blocking wait makes ProcessGroupNCCL track no collective in its watchdog, and a collective on
  // a side stream returns no work to wait on: the timeout would be lost (docs/design.md).
  comm_.shared()->side_streams = options_.comm_streams() && !nccl_blocking_wait();
}

void RunState::init_hybrid(int group_size) {
  if (shard_comm_) return;
  const int W = comm_.world_size();
  const int r = comm_.rank();
  FSDP_CHECK_IN(ErrorContext().api("fsdp::fully_shard").rank(r).world_size(W), group_size >= 1 && W % group_size == 0,
                "kHybridShard needs FullyShardOptions::shard_group_size to divide the world size, but it is ",
                group_size, ". Set it to the ranks of one group, e.g. the processes of one node.");
  // A fresh name per model for the subgroups' store keys: rank 0's random id, broadcast (no
  // process-wide counter that would have to agree between ranks).
  at::Tensor id = at::empty({1}, at::kLong);
  id[0] = static_cast<int64_t>(std::random_device{}() >> 1) << 31 ^ static_cast<int64_t>(std::random_device{}());
  comm_.broadcast(id, 0, "broadcast of the hybrid subgroups' name");
  const std::string name = "hybrid-" + std::to_string(id.item<int64_t>());
  std::vector<int> shard_ranks, replicate_ranks;
  for (int i = 0; i < group_size; ++i) shard_ranks.push_back(r / group_size * group_size + i);
  for (int g = 0; g < W / group_size; ++g) replicate_ranks.push_back(g * group_size + r % group_size);
  // Shard groups first on every rank, then replicate groups: no member waits for one busy elsewhere.
  auto shard_pg = new_subgroup(comm_.process_group(), shard_ranks, name + "/shard" + std::to_string(r / group_size));
  auto replicate_pg =
      new_subgroup(comm_.process_group(), replicate_ranks, name + "/replicate" + std::to_string(r % group_size));
  // Errors on these groups name global ranks: the groups' members are listed in their messages.
  shard_comm_ = std::make_unique<Comm>(
      shard_pg, comm_.timeout(), comm_.shared(),
      GroupInfo{"hybrid shard group " + std::to_string(r / group_size), shard_ranks, W}, comm_.verify());
  GroupInfo replicas{"hybrid replicate group " + std::to_string(r % group_size), replicate_ranks, W};
  replicas.across_replicas = true;
  replicate_comm_ = std::make_unique<Comm>(replicate_pg, comm_.timeout(), comm_.shared(), replicas, comm_.verify());
}

void RunState::init_mesh(const MeshState& mesh) {
  auto comm_over = [&](const char* dim) {
    GroupInfo info = mesh.group_info(dim);
    info.across_replicas = std::string(dim) == kReplicateDim;
    return std::make_unique<Comm>(mesh.group(dim).pg, comm_.timeout(), comm_.shared(), info, comm_.verify());
  };
  if (mesh.group(kReplicateDim).global_ranks.size() > 1 && mesh.group(kShardDim).global_ranks.size() > 1) {
    shard_comm_ = comm_over(kShardDim);
    replicate_comm_ = comm_over(kReplicateDim);
  }
  if (mesh.group(kTensorDim).global_ranks.size() > 1) {
    tp_comm_ = comm_over(kTensorDim);
    GroupInfo world{"the mesh's world", {}, mesh.world->getSize()};
    world.mesh = mesh.where();
    mesh_comm_ = std::make_unique<Comm>(mesh.world, comm_.timeout(), comm_.shared(), world, comm_.verify());
  }
}

std::vector<int64_t> RunState::agree(Call call, Fingerprint args, const std::string& description, int64_t vote) {
  CallLog& log = comm_.log();
  std::vector<int64_t> votes;
  breaks_on_failure([&] {
    votes = step_comm().agree(
        call, args.add(log.count).add(log.hash.value()).value(), description,
        [&log] {
          std::ostringstream os;
          os << ", after " << log.count << " collective(s) of this model since the previous check";
          if (log.count > 0) os << " (" << log.summary() << ")";
          return os.str();
        },
        vote);
  });
  log.reset();
  return votes;
}

void RunState::on_backward_begin() {
  if (callback_queued_) return;
  ++backwards_;
  agree(Call::kBackwardBegin, Fingerprint().add(backwards_).add(sync_gradients_ ? 1 : 0),
        "the start of backward #" + std::to_string(backwards_) + " (gradient sync " + (sync_gradients_ ? "on" : "off") +
            ")");
  callback_queued_ = true;
  std::weak_ptr<RunState> self = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    if (auto s = self.lock()) s->finalize_backward();
  });
}

void RunState::finalize_backward() {
  callback_queued_ = false;
  for_each_unit([](Unit& u) { u.finalize_backward(); });
  finish_reduces();
  // Offload: the gradients copied to the host are there before backward returns, and the shards'
  // copies to the device have passed, before an optimizer reads the one or writes the other.
  wait_host_copies();
  // Ranks whose backwards issued different collectives of equal sizes are stopped here, before an
  // optimizer uses what they reduced.
  agree(Call::kBackwardEnd, Fingerprint().add(backwards_), "the end of backward #" + std::to_string(backwards_));
  watch_after_backward();
}

void RunState::watch_after_backward() {
  // What the program does with the gradients and parameters until the next forward (step_watch.h):
  // the sharded gradients of units sharded over more than one rank (a replicated unit's gradient
  // is whole, and a per-rank norm of it is the global one).
  auto sharded_grads = [this] {
    std::vector<at::Tensor> grads;
    for_each_unit([&](const Unit& u) {
      if (u.shard_world_size() < 2) return;
      for (const auto& s : u.slots()) grads.push_back(u.shard_grad(s));
    });
    return grads;
  };
  watch_.after_backward(
      sharded_grads, [this] { return shards(); }, holds_unsynced_grads());
}

void RunState::unshard_all(const char* api) {
  check_between_passes(api);
  for_each_unit([](Unit& u) { u.unshard(); });
}

void RunState::reshard_all(const char* api) {
  check_between_passes(api);
  for_each_unit([](Unit& u) { u.reshard(); });
}

void RunState::reduce_gradients() {
  check_between_passes("fsdp::FSDPModule::reduce_gradients");
  // What the end of a backward with sync on does (Unit::finalize_backward), for every unit at
  // once, then every unit resharded: FSDP2's post-backward, called by hand.
  struct SyncOn {  // for the reduction only, also when it throws
    bool& flag;
    bool before;
    ~SyncOn() { flag = before; }
  } sync_on{sync_gradients_, sync_gradients_};
  sync_gradients_ = true;
  breaks_on_failure([&] {
    for_each_unit([](Unit& u) {
      u.finalize_backward();
      u.reshard();
    });
    finish_reduces();
  });
  wait_host_copies();
  ++reductions_;
  agree(Call::kReduceGradients, Fingerprint().add(backwards_).add(reductions_),
        "reduce_gradients #" + std::to_string(reductions_));
  watch_after_backward();  // the sharded gradients the program may read now are these
}

void RunState::check_between_passes(const char* api) const {
  FSDP_CHECK_IN(comm_.error_in(api), !in_backward() && !in_root_forward_,
                "called inside the model's forward or backward: call it between them (a pipeline stage calls it "
                "between its microbatches' passes, or after its last backward of the step).");
}

bool RunState::holds_unsynced_grads() const {
  bool any = false;
  for_each_unit([&](const Unit& u) { any = any || u.holds_unsynced_grads(); });
  return any;
}

std::vector<at::Tensor> RunState::shards() const {
  std::vector<at::Tensor> out;
  for_each_unit([&](const Unit& u) {
    for (const auto& s : u.slots()) out.push_back(s.sharded);
  });
  return out;
}

void RunState::end_forward() {
  // A unit shared by modules some of which did not run: finished now, not left gathered.
  for_each_unit([](Unit& u) {
    if (u.forward_unfinished()) u.finish_forward();
  });
  if (!recording_.empty()) order_ = std::move(recording_);
  recording_.clear();
  // A unit prefetched but skipped by this forward must not keep reading its shard (which the
  // optimizer may update next) nor hold its gathered buffer.
  for_each_unit([](Unit& u) { u.drop_prefetch(); });
  // Offload, no backward to come: the shards' copies to the device pass before the caller may
  // write the shards (with gradients, backward's end waits).
  if (!c10::GradMode::is_enabled()) wait_host_copies();
}

std::vector<const Unit*> RunState::units_not_run_in_this_forward() const {
  std::vector<const Unit*> out;
  for_each_unit([&](const Unit& u) {
    const bool ran =
        std::any_of(recording_.begin(), recording_.end(), [&](const auto& w) { return w.lock().get() == &u; });
    if (!u.is_root() && !ran) out.push_back(&u);
  });
  return out;
}

void RunState::wait_host_copies() {
  for_each_unit([](Unit& u) { u.wait_host_copies(); });
}

int64_t RunState::held_state_bytes() const {
  std::vector<at::Tensor> held;
  for_each_unit([&](const Unit& u) { u.append_held_tensors(held); });
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

std::pair<size_t, std::string> RunState::units_holding_unsynced_grads() const {
  std::vector<std::string> pending;
  for_each_unit([&](const Unit& u) {
    if (u.holds_unsynced_grads()) pending.push_back(u.label());
  });
  std::ostringstream names;
  for (size_t i = 0; i < pending.size() && i < 3; ++i) names << (i ? ", '" : "'") << pending[i] << "'";
  if (pending.size() > 3) names << " and " << pending.size() - 3 << " more";
  return {pending.size(), names.str()};
}

void RunState::check_no_unsynced_grads(const char* caller) const {
  const auto [count, names] = units_holding_unsynced_grads();
  if (count == 0) return;
  FSDP_CHECK_IN(comm_.error_in(caller), false, count, " unit(s) hold gradients accumulated with gradient sync off (",
                names,
                ") that were never reduced into the sharded gradients, so the optimizer cannot see them: those "
                "micro-batches would train nothing. Turn sync back on before the backward of the last micro-batch "
                "of each step: model.set_requires_gradient_sync(true); to drop them on purpose, call "
                "model.discard_unsynced_gradients() (docs/usage.md, 'Gradient accumulation').");
}

void RunState::mark_broken(const std::string& why, const std::string& remedy) {
  if (!broken_.empty()) return;
  broken_ = why;
  broken_remedy_ = remedy;
}

void RunState::check_not_broken() const {
  FSDP_CHECK_IN(
      comm_.error_context(broken_remedy_.empty() ? "a step after a failed collective" : "a use after a failure")
          .api("fsdp"),
      broken_.empty(),
      broken_remedy_.empty()
          ? "an earlier collective of this model failed, so the ranks no longer agree on which collective "
            "comes next. Exit and restart the job from its last checkpoint (docs/usage.md, 'When a "
            "collective fails')"
          : broken_remedy_,
      ". The first failure was:\n", broken_);
}

void RunState::after_unit_unsharded(Unit& unit, bool backward) {
  if (!backward && !unit.is_root()) recording_.push_back(unit.weak_from_this());
  const int depth = options_.prefetch();
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

void RunState::after_reduce_issued(Unit& unit) {
  while (!reducing_.empty()) {
    auto oldest = reducing_.front().lock();
    reducing_.erase(reducing_.begin());
    if (oldest && oldest.get() != &unit) oldest->finish_reduce();
  }
  reducing_.push_back(unit.weak_from_this());
}

void RunState::finish_reduces() {
  auto in_flight = std::move(reducing_);
  reducing_.clear();
  for (auto& w : in_flight) {
    if (auto g = w.lock()) g->finish_reduce();
  }
}

void RunState::begin_forward() {
  check_not_broken();
  if (replicas_apart_ && outer_.expired() && !warned_no_outer_) {
    warned_no_outer_ = true;
    TORCH_WARN(error_caller(comm_.error_in("fsdp")),
               ": the model's replicas train apart, but the fsdp::optim::LocalSGD or DiLoCo that averaged them is "
               "gone: from now on nothing brings them together, and they drift apart for good. Make a new one "
               "(it starts every replica from the first replica's weights).");
  }
  ++forwards_;
  const bool grad = c10::GradMode::is_enabled();
  const std::vector<int64_t> votes = agree(
      Call::kForward, Fingerprint().add(forwards_).add(grad ? 1 : 0),
      "forward #" + std::to_string(forwards_) + " of the wrapped model (" + (grad ? "gradients on" : "no grad") + ")",
      watch_.vote([this] { return shards(); }, holds_unsynced_grads()));
  watch_.act(votes, comm_.error_in("fsdp"), [this] {
    const auto [count, names] = units_holding_unsynced_grads();
    return std::to_string(count) + " unit(s) (" + names + ")";
  });
  recording_.clear();
  named_error_ = nullptr;
  unit_output_dtypes_ = 0;
  for_each_unit([](Unit& u) { u.drop_prefetch(); });  // left by a forward that threw
  if (!callback_queued_) return;
  callback_queued_ = false;
  for_each_unit([](Unit& u) { u.reset_after_failed_backward(); });
}

}  // namespace fsdp::detail
