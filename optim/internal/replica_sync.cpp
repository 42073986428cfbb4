#include "optim/internal/replica_sync.h"

#include "fsdp/internal/check.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <utility>

namespace fsdp::optim::detail {

using fsdp::detail::Call;
using fsdp::detail::Fingerprint;

ReplicaSync::ReplicaSync(const FSDPModule& model, std::string caller, int64_t sync_every, int64_t fragments,
                         const std::string& settings)
    : model_(model), caller_(std::move(caller)), sync_every_(sync_every) {
  const std::string where = fsdp::detail::error_caller(fsdp::detail::model_group(model).error_in(caller_));
  // One outer optimizer per model: a second would average on its own schedule, and a checkpoint
  // would keep only one of their states.
  if (auto other = fsdp::detail::outer_state(model)) {
    FSDP_CHECK(false, where, ": the model's replicas are already driven by a ", other->kind(),
               " made for it, which is still alive. One LocalSGD or DiLoCo per model: destroy the other first.");
  }
  FSDP_CHECK(sync_every >= 1, where, ": sync_every (H, the inner steps between outer steps) is ", sync_every,
             "; it must be at least 1.");
  FSDP_CHECK(fragments >= 1 && sync_every % fragments == 0, where, ": ", fragments,
             " fragment(s) do not divide sync_every = ", sync_every,
             ": a fragment is synchronized every H / F inner steps, in turn. Choose F dividing H.");
  // Units holding parameters, in units() order; a fragment is a run of consecutive ones.
  const std::vector<UnitInfo> units = model.units();
  const std::vector<ShardSpec> specs = model.shard_specs();
  std::vector<const UnitInfo*> holding;
  for (const auto& u : units) {
    if (!u.specs.empty() && u.flat_shard.defined()) holding.push_back(&u);
  }
  const auto n = static_cast<int64_t>(holding.size());
  FSDP_CHECK(fragments <= n, where, ": ", fragments, " fragments, but the model has ", n,
             " unit(s) holding parameters; a fragment is one or more whole units (fsdp::Sharded modules and the "
             "root's own parameters). Use at most ",
             n, " fragments, or mark more modules fsdp::Sharded.");
  fragments_.resize(static_cast<size_t>(fragments));
  std::vector<std::pair<std::string, std::string>> span(fragments_.size());  // first and last unit
  // Runs of consecutive units of about equal size: a unit goes to the next fragment when its middle
  // lies past the current fragment's share of the elements, or when the units left are just enough
  // for the fragments left. Flat shards have the same size on every rank: the same runs everywhere.
  int64_t total = 0, before = 0;
  for (const UnitInfo* u : holding) total += u->flat_shard.numel();
  size_t cur = 0;  // the fragment being filled
  for (int64_t i = 0; i < n; ++i) {
    const UnitInfo& u = *holding[static_cast<size_t>(i)];
    const auto F = static_cast<int64_t>(fragments), k = static_cast<int64_t>(cur);
    const bool started = !fragments_[cur].flats.empty();
    const bool past_share = 2 * before + u.flat_shard.numel() > 2 * (k + 1) * total / F;
    if (started && k + 1 < F && (past_share || n - i == F - 1 - k)) ++cur;
    before += u.flat_shard.numel();
    const std::string name = u.name.empty() ? "<root>" : u.name;
    if (span[cur].first.empty()) span[cur].first = name;
    span[cur].second = name;
    Fragment& frag = fragments_[cur];
    frag.flats.push_back(u.flat_shard);
    frag.numel += u.flat_shard.numel();
    frag.params.emplace_back();
    for (size_t s : u.specs) frag.params.back().push_back({specs[s].flat_offset, specs[s].local, s});
  }
  for (size_t f = 0; f < fragments_.size(); ++f) {
    const auto& [first, last] = span[f];
    fragments_[f].units = first == last ? "unit '" + first + "'" : "units '" + first + "' to '" + last + "'";
  }
  replicate_ = &fsdp::detail::train_replicas_apart(
      model, caller_, Fingerprint().add(caller_).add(settings).add(sync_every).add(fragments).value(), settings);
  // The replicas start from the same shards: the first replica's (a model trained apart before,
  // by an earlier LocalSGD, has diverged). One broadcast per fragment, counted across replicas.
  at::NoGradGuard no_grad;
  for (size_t f = 0; f < fragments_.size(); ++f) {
    at::Tensor flat = pack(fragments_[f].flats);
    fsdp::detail::breaks_on_failure(model_, [&] {
      replicate_->broadcast(flat, 0, caller_ + ": the first replica's shards of fragment " + std::to_string(f));
    });
    unpack(flat, fragments_[f].flats);
  }
  model_.mark_shards_written();
}

int ReplicaSync::replicas() const {
  return replicate_->world_size();
}

int ReplicaSync::replica() const {
  return replicate_->rank();
}

std::vector<size_t> ReplicaSync::count_inner_step() {
  ++inner_steps_;
  const auto F = static_cast<int64_t>(fragments_.size());
  const int64_t t = inner_steps_ % sync_every_;
  std::vector<size_t> due;
  for (int64_t f = 0; f < F; ++f) {
    if ((f + 1) * sync_every_ / F % sync_every_ == t) due.push_back(static_cast<size_t>(f));
  }
  return due;
}

std::string ReplicaSync::agree(size_t f, const at::Tensor& flat, const std::string& what) {
  const std::string name = caller_ + ": " + what + " of fragment " + std::to_string(f) + " (" + fragments_[f].units +
                           ") at inner step " + std::to_string(inner_steps_);
  fsdp::detail::breaks_on_failure(model_, [&] {
    // Replicas at different outer steps (other settings, or a replica that stepped more often)
    // would pair this all-reduce with another of another size: every replica must be here first.
    replicate_->agree(Call::kOuterStep,
                      Fingerprint().add(what).add(static_cast<int64_t>(f)).add(flat.numel()).add(outer_steps_).value(),
                      name);
  });
  ++outer_steps_;
  return name;
}

void ReplicaSync::average(size_t f, const std::vector<at::Tensor>& tensors, const std::string& what) {
  at::NoGradGuard no_grad;
  at::Tensor flat = pack(tensors);
  const std::string name = agree(f, flat, what);
  fsdp::detail::breaks_on_failure(model_, [&] { replicate_->all_reduce(flat, c10d::ReduceOp::SUM, name); });
  flat.div_(static_cast<double>(replicas()));
  unpack(flat, tensors);
}

void ReplicaSync::begin_average(size_t f, const std::vector<at::Tensor>& tensors, const std::string& what) {
  TORCH_INTERNAL_ASSERT(!in_flight_, "an outer exchange is in flight already");
  at::NoGradGuard no_grad;
  InFlight x;
  x.fragment = f;
  x.flat = pack(tensors);
  x.snapshot = pack(fragments_[f].flats);
  const std::string name = agree(f, x.flat, what);
  fsdp::detail::breaks_on_failure(model_,
                                  [&] { x.pending = replicate_->all_reduce_async(x.flat, c10d::ReduceOp::SUM, name); });
  in_flight_ = std::move(x);
}

std::optional<ReplicaSync::Finished> ReplicaSync::finish_average() {
  if (!in_flight_) return std::nullopt;
  InFlight x = std::move(*in_flight_);
  in_flight_.reset();
  fsdp::detail::breaks_on_failure(model_, [&] { replicate_->wait(x.pending); });
  x.flat.div_(static_cast<double>(replicas()));
  return Finished{x.fragment, x.flat, x.snapshot};
}

ReplicaSync::~ReplicaSync() {
  if (!in_flight_) return;
  try {
    replicate_->wait(in_flight_->pending);  // Gloo's thread may still write the buffer
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the next collective reports the failure
  }
}

namespace {

// OuterState (fsdp/internal/core_access.h) over the callbacks LocalSGD or DiLoCo give.
struct Registration : fsdp::detail::OuterState {
  ReplicaSync* sync = nullptr;
  std::string name;
  std::function<std::vector<at::Tensor>()> global;
  torch::optim::Optimizer* outer = nullptr;
  std::function<void()> apply;
  std::string kind() const override { return name; }
  int64_t sync_every() const override { return sync->sync_every(); }
  int64_t inner_steps() const override { return sync->inner_steps(); }
  void set_inner_steps(int64_t n) override { sync->set_inner_steps(n); }
  void flush() override { apply(); }
  std::vector<at::Tensor> global_shards() override { return global ? global() : sync->mean_now(); }
  torch::optim::Optimizer* outer_optimizer() override { return outer; }
};

}  // namespace

void ReplicaSync::register_outer(std::string kind, std::function<std::vector<at::Tensor>()> global,
                                 torch::optim::Optimizer* outer, std::function<void()> flush) {
  auto r = std::make_shared<Registration>();
  r->sync = this;
  r->name = std::move(kind);
  r->global = std::move(global);
  r->outer = outer;
  r->apply = std::move(flush);
  registration_ = r;
  fsdp::detail::set_outer_state(model_, registration_);
}

std::vector<at::Tensor> ReplicaSync::mean_now() {
  std::vector<at::Tensor> out(model_.shard_specs().size());
  for (size_t f = 0; f < fragments_.size(); ++f) {
    at::Tensor mean = pack(fragments_[f].flats);
    average(f, {mean}, "the replicas' mean of the parameters for a checkpoint");
    const auto parts = split(f, mean);
    for (size_t u = 0; u < parts.size(); ++u) {
      for (const auto& p : fragments_[f].params[u]) out[p.spec] = view_of(parts[u], p);
    }
  }
  return out;
}

at::Tensor ReplicaSync::view_of(const at::Tensor& flat, const Param& p) {
  return flat.narrow(0, p.offset, p.local.numel()).view(p.local.sizes());
}

std::vector<at::Tensor> ReplicaSync::split(size_t f, const at::Tensor& flat) const {
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const auto& t : fragments_[f].flats) {
    out.push_back(flat.narrow(0, offset, t.numel()));
    offset += t.numel();
  }
  return out;
}

at::Tensor ReplicaSync::pack(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.detach().reshape({-1}).to(at::kFloat));
  return at::cat(flat);
}

void ReplicaSync::unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

}  // namespace fsdp::optim::detail
