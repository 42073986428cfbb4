#include "optim/local_sgd.h"

#include "optim/internal/replica_sync.h"

#include <memory>
#include <string>

namespace fsdp::optim {

LocalSGD::LocalSGD(const FSDPModule& model, torch::optim::Optimizer& inner, const LocalSGDOptions& options)
    : inner_(inner),
      options_(options),
      sync_(std::make_unique<detail::ReplicaSync>(model, "fsdp::optim::LocalSGD", options.sync_every(),
                                                  options.fragments(),
                                                  "sync_every " + std::to_string(options.sync_every()) +
                                                      ", fragments " + std::to_string(options.fragments()))) {}

LocalSGD::~LocalSGD() = default;
LocalSGD::LocalSGD(LocalSGD&&) noexcept = default;

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
  for (size_t f : sync_->count_inner_step()) {
    sync_->average(f, sync_->fragments()[f].flats, "LocalSGD's average of the parameters");
    sync_->model().mark_shards_written();
  }
}

}  // namespace fsdp::optim
