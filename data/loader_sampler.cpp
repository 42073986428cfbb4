#include "data/loader_sampler.h"

#include "fsdp/internal/check.h"

#include <algorithm>

namespace fsdp::data {

LoaderSampler::LoaderSampler(DistributedSampler& sampler) : sampler_(&sampler) {
  FSDP_CHECK_IN(ErrorContext().api("fsdp::data::LoaderSampler").rank(sampler.rank()),
                sampler.options().last_batch() == LastBatch::kDrop,
                "a sampler with LastBatch::kUneven gives the ranks shares of different sizes, so their loaders would "
                "run different numbers of micro-batches (each a collective step of the model). Use next_share() and "
                "Share::max_rows for an uneven evaluation, or LastBatch::kDrop.");
}

void LoaderSampler::reset(std::optional<size_t> new_size) {
  FSDP_CHECK_IN(ErrorContext().api("fsdp::data::LoaderSampler::reset").rank(sampler_->rank()),
                !new_size || static_cast<int64_t>(*new_size) == sampler_->dataset_size(), "a dataset of ", *new_size,
                " samples, but the sampler was built for ", sampler_->dataset_size(),
                ": its order and state are for that size. Build a new sampler for the new dataset.");
  ended_ = false;  // the next epoch, or the rest of this one: the position is kept
}

std::optional<std::vector<size_t>> LoaderSampler::next(size_t batch_size) {
  if (ended_) return std::nullopt;
  if (!current_ || handed_ >= current_->indices.size()) {
    current_ = sampler_->next_share();
    handed_ = 0;
    if (!current_) {
      ended_ = true;
      return std::nullopt;
    }
  }
  const size_t share = current_->indices.size();
  FSDP_CHECK_IN(
      ErrorContext().api("fsdp::data::LoaderSampler").rank(sampler_->rank()),
      batch_size >= 1 && share % batch_size == 0, "the loader's batch size ", batch_size,
      " does not divide this rank's share of each global batch (", share, " rows of ", current_->global_rows,
      "): micro-batches must be equal. Use fsdp::data::plan_batch(global_batch, ranks, max_rows).micro_batch as "
      "the batch size.");
  std::vector<size_t> out(batch_size);
  for (size_t i = 0; i < batch_size; ++i) out[i] = static_cast<size_t>(current_->indices[handed_ + i]);
  handed_ += batch_size;
  return out;
}

void LoaderSampler::save(torch::serialize::OutputArchive& archive) const {
  sampler_->save(archive);
}

void LoaderSampler::load(torch::serialize::InputArchive& archive) {
  sampler_->load(archive);
  current_.reset();
  handed_ = 0;
  ended_ = false;
}

}  // namespace fsdp::data
