#include "optim/local_sgd.h"

#include "optim/internal/replica_sync.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <memory>
#include <string>

namespace fsdp::optim {

LocalSGD::LocalSGD(const FSDPModule& model, torch::optim::Optimizer& inner, const LocalSGDOptions& options)
    : inner_(inner),
      options_(options),
      sync_(std::make_unique<detail::ReplicaSync>(
          model, "fsdp::optim::LocalSGD", options.sync_every(), options.fragments(),
          "sync_every " + std::to_string(options.sync_every()) + ", fragments " + std::to_string(options.fragments()) +
              (options.overlap() ? ", overlapped" : ""))) {
  sync_->register_outer("LocalSGD", nullptr, nullptr, [this] { flush(); });
}

LocalSGD::~LocalSGD() = default;

int64_t LocalSGD::inner_steps() const {
  return sync_->inner_steps();
}
int LocalSGD::replicas() const {
  return sync_->replicas();
}
int LocalSGD::replica() const {
  return sync_->replica();
}

void LocalSGD::step() {
  step([this] { inner_.step(); });
}

void LocalSGD::step(const std::function<void()>& inner_step) {
  inner_step();
  const std::vector<size_t> due = sync_->count_inner_step();
  flush();  // the average begun at the previous step, after this step's inner step
  for (size_t f : due) {
    const auto& flats = sync_->fragments()[f].flats;
    if (options_.overlap()) {
      sync_->begin_average(f, flats, "LocalSGD's average of the parameters (overlapped)");
    } else {
      sync_->average(f, flats, "LocalSGD's average of the parameters");
      sync_->model().mark_shards_written();
    }
  }
}

void LocalSGD::flush() {
  auto done = sync_->finish_average();
  if (!done) return;
  at::NoGradGuard no_grad;
  const auto& flats = sync_->fragments()[done->fragment].flats;
  const auto change = sync_->split(done->fragment, done->mean.sub_(done->snapshot));
  for (size_t u = 0; u < flats.size(); ++u) flats[u].detach().add_(change[u]);
  sync_->model().mark_shards_written();
}

}  // namespace fsdp::optim
