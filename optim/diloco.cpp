#include "optim/diloco.h"

#include "optim/internal/replica_sync.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <sstream>
#include <string>

namespace fsdp::optim {
namespace {

// The options in words (compared across ranks), after checking them: nothing is set up or sent
// for options that are refused.
std::string checked_settings(const DiLoCoOptions& o, const FSDPModule& model) {
  const ErrorContext in = fsdp::detail::model_group(model).error_in("fsdp::optim::DiLoCo");
  std::ostringstream os;
  os << "sync_every " << o.sync_every() << ", fragments " << o.fragments() << (o.overlap() ? ", overlapped" : "");
  if (o.outer_optimizer()) {
    os << ", an outer optimizer of the program's";
    return os.str();
  }
  FSDP_CHECK_IN(in, o.outer_lr() > 0 && std::isfinite(o.outer_lr()), "outer_lr is ", o.outer_lr(),
                "; it must be positive and finite (the paper's is 0.7).");
  FSDP_CHECK_IN(in, o.outer_momentum() >= 0 && o.outer_momentum() < 1, "outer_momentum is ", o.outer_momentum(),
                "; it must be in [0, 1) (the paper's is 0.9; 0 means plain SGD).");
  os << ", outer SGD lr " << o.outer_lr() << " momentum " << o.outer_momentum();
  return os.str();
}

}  // namespace

DiLoCo::DiLoCo(const FSDPModule& model, torch::optim::Optimizer& inner, const DiLoCoOptions& options)
    : inner_(inner),
      options_(options),
      sync_(std::make_unique<detail::ReplicaSync>(model, "fsdp::optim::DiLoCo", options.sync_every(),
                                                  options.fragments(), checked_settings(options, model))) {
  // The global shards: fp32 whatever the parameters' dtype (the outer step accumulates small
  // differences of the replicas' parameters), one flat copy per unit, padding included (it stays
  // 0), and each parameter's a view of it, as the parameters are of the flat shard.
  global_.resize(model.shard_specs().size());
  for (const auto& f : sync_->fragments()) {
    global_flats_.emplace_back();
    for (size_t u = 0; u < f.flats.size(); ++u) {
      global_flats_.back().push_back(f.flats[u].detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
      for (const auto& p : f.params[u]) global_[p.spec] = detail::ReplicaSync::view_of(global_flats_.back().back(), p);
    }
  }
  if (options.outer_optimizer()) {
    outer_ = options.outer_optimizer()(global_);
    FSDP_CHECK_IN(fsdp::detail::model_group(model).error_in("fsdp::optim::DiLoCo"), outer_ != nullptr,
                  "DiLoCoOptions::outer_optimizer returned no optimizer.");
  } else {
    auto sgd = torch::optim::SGDOptions(options.outer_lr());
    if (options.outer_momentum() > 0) sgd.momentum(options.outer_momentum()).nesterov(true);
    outer_ = std::make_unique<torch::optim::SGD>(global_, sgd);
  }
  sync_->register_outer(
      "DiLoCo", [this] { return global_; }, outer_.get(), [this] { flush(); });
}

DiLoCo::~DiLoCo() = default;

int64_t DiLoCo::inner_steps() const {
  return sync_->inner_steps();
}
int DiLoCo::replicas() const {
  return sync_->replicas();
}
int DiLoCo::replica() const {
  return sync_->replica();
}

void DiLoCo::step() {
  step([this] { inner_.step(); });
}

void DiLoCo::step(const std::function<void()>& inner_step) {
  inner_step();
  const std::vector<size_t> due = sync_->count_inner_step();
  flush();  // the outer step begun at the previous step, after this step's inner step
  for (size_t f : due) {
    std::vector<at::Tensor> delta = pseudo_gradient(f);
    if (options_.overlap()) {
      sync_->begin_average(f, delta, "DiLoCo's mean pseudo-gradient (overlapped)");
      continue;
    }
    sync_->average(f, delta, "DiLoCo's mean pseudo-gradient");
    outer_step(f, delta);
    at::NoGradGuard no_grad;
    const auto& flats = sync_->fragments()[f].flats;
    for (size_t u = 0; u < flats.size(); ++u) flats[u].detach().copy_(global_flats_[f][u]);
    sync_->model().mark_shards_written();
  }
}

void DiLoCo::flush() {
  auto done = sync_->finish_average();
  if (!done) return;
  const size_t f = done->fragment;
  outer_step(f, sync_->split(f, done->mean));
  // The new global shards, plus what this replica's inner step did meanwhile.
  at::NoGradGuard no_grad;
  const auto& flats = sync_->fragments()[f].flats;
  const auto then = sync_->split(f, done->snapshot);
  for (size_t u = 0; u < flats.size(); ++u) flats[u].detach().add_(global_flats_[f][u] - then[u]);
  sync_->model().mark_shards_written();
}

std::vector<at::Tensor> DiLoCo::pseudo_gradient(size_t f) {
  at::NoGradGuard no_grad;
  const auto& flats = sync_->fragments()[f].flats;
  std::vector<at::Tensor> delta;
  delta.reserve(flats.size());
  for (size_t u = 0; u < flats.size(); ++u) delta.push_back(global_flats_[f][u] - flats[u].detach().to(at::kFloat));
  return delta;
}

void DiLoCo::outer_step(size_t f, const std::vector<at::Tensor>& mean) {
  at::NoGradGuard no_grad;
  const auto& frag = sync_->fragments()[f];
  // The outer optimizer steps this fragment's global shards only: the others have no gradient,
  // which torch::optim's optimizers skip (their state untouched).
  for (auto& g : global_) g.mutable_grad() = at::Tensor();
  for (size_t u = 0; u < frag.flats.size(); ++u) {
    for (const auto& p : frag.params[u]) global_[p.spec].mutable_grad() = detail::ReplicaSync::view_of(mean[u], p);
  }
  outer_->step();
  for (auto& g : global_) g.mutable_grad() = at::Tensor();
}

}  // namespace fsdp::optim
