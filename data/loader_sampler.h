// torch::data's loader over a DistributedSampler, by reference: the loader advances the caller's
// sampler, whose state() is then what the loop has taken (torch::data::make_data_loader keeps its
// sampler by value, so a sampler passed itself would advance a copy the caller cannot see).
//
//   fsdp::data::DistributedSampler sampler(dataset.size().value(), pg, SamplerOptions(256).seed(1));
//   const auto plan = fsdp::data::plan_batch(256, pg->getSize(), /*max_rows=*/8);
//   auto loader = torch::data::make_data_loader(
//       dataset.map(torch::data::transforms::Stack<>()), fsdp::data::LoaderSampler(sampler),
//       torch::data::DataLoaderOptions().batch_size(plan.micro_batch));
//   for (auto& micro_batch : *loader) ...        // one epoch: plan.accumulation micro-batches per step
//   save(..., SaveOptions().sampler_state(sampler.state()));
//
// Each request is batch_size rows of this rank's share of the current global batch, never across
// two; the batch size must divide the share (equal micro-batches, so that every rank runs the same
// number and the update is the global batch's). The loop ends at the epoch's end, and keeps ending
// until the loader's next begin() (reset()), which continues with the next epoch: the position is
// the state, never rewound. Refused: LastBatch::kUneven (its shares differ between ranks, and each
// micro-batch is a collective step: use next_share() and Share::max_rows), and a reset() to another
// dataset size. LibTorch's loader with workers > 0 requests up to max_jobs batches ahead of the
// loop, which state() counts as taken: keep workers = 0 (the default) where the state is saved.
#pragma once

#include "data/distributed_sampler.h"
#include "fsdp/export.h"

#include <torch/data/samplers/base.h>

#include <cstddef>
#include <optional>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::data {

class LoaderSampler : public torch::data::samplers::Sampler<> {
 public:
  /// `sampler` must outlive the loader.
  explicit LoaderSampler(DistributedSampler& sampler);

  void reset(std::optional<size_t> new_size = std::nullopt) override;
  std::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  DistributedSampler* sampler_;
  std::optional<Share> current_;  // the share being handed out
  size_t handed_ = 0;             // its rows handed out
  bool ended_ = false;            // the epoch ended: nullopt until reset()
};

}  // namespace fsdp::data

FSDP_PUBLIC_END
