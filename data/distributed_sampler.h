// A distributed sampler whose stream of samples does not depend on the number of ranks, and whose
// state, one global counter, resumes it exactly on any number of ranks.
//
//   auto dp = fsdp::init_process_group();
//   fsdp::data::DistributedSampler sampler(dataset.size().value(), dp,
//                                          fsdp::data::SamplerOptions(/*global_batch=*/256).seed(1234));
//   while (auto share = sampler.next_share()) {   // one epoch; nullopt at its end
//     ... train on share->indices (this rank's rows of the global batch) ...
//   }
//   fsdp::checkpoint::save(dir, model, opt, fsdp::checkpoint::SaveOptions().sampler_state(sampler.state()));
//   // later, on any number of ranks: load(dir, model, opt, LoadOptions().sampler(&sampler))
//
// Each epoch's order is fsdp::data::Permutation(size, seed, epoch): a function of (seed, epoch)
// only. The order is cut into global batches of `global_batch` samples, and each global batch into
// the data-parallel ranks' shares: rank r of D takes positions [r G/D, (r+1) G/D) of it, so the
// samples of a step are the same whatever D is, and only the number of ranks dividing them changes.
// The state is (epoch, position in the epoch, samples consumed in all): saved on N ranks and loaded
// on M, the remaining stream is the same, and every sample is seen once per epoch. Nothing is
// padded with repeated samples (PyTorch's DistributedSampler and LibTorch's repeat samples to
// even the ranks): the last global batch of an epoch, when shorter, is dropped or kept uneven.
//
// With torch::data's loader: fsdp::data::LoaderSampler (data/loader_sampler.h) over this sampler.
#pragma once

#include "fsdp/export.h"

#include <torch/arg.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::data {

enum class LastBatch {
  kDrop,   ///< an epoch's last global batch, when shorter than global_batch, is not used (training)
  kUneven  ///< it is used, split as evenly as the ranks allow, some with a row less (evaluation)
};

struct SamplerOptions {
  /* implicit */ SamplerOptions(int64_t global_batch) : global_batch_(global_batch) {}
  /// Samples per global batch (one optimizer step), over all data-parallel ranks; divisible by them.
  TORCH_ARG(int64_t, global_batch);
  /// The order's seed: the same seed gives the same order on any machine and number of ranks.
  TORCH_ARG(uint64_t, seed) = 0;
  /// false: the dataset's own order, every epoch.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(LastBatch, last_batch) = LastBatch::kDrop;
};

/// Where a sampler stands: all there is to resume it, on any number of ranks.
struct SamplerState {
  uint64_t seed = 0;
  bool shuffle = true;
  int64_t dataset_size = 0;
  int64_t epoch = 0;
  /// Samples of this epoch's order handed out (whole global batches): the next one starts here.
  int64_t position = 0;
  /// Samples handed out since the start of the run, over every epoch and rank (Megatron's
  /// consumed_samples).
  int64_t samples_consumed = 0;
};
bool operator==(const SamplerState& a, const SamplerState& b);
/// Whether a sampler can be in `s`: epoch and position >= 0, position <= dataset size, samples
/// consumed >= position.
bool possible(const SamplerState& s);
/// "epoch 2, position 768 of 10000, 20768 consumed (seed 1234, shuffled)".
std::string to_string(const SamplerState& s);

/// This rank's part of one global batch.
struct Share {
  std::vector<int64_t> indices;  ///< dataset indices, this rank's rows in order (possibly none: kUneven)
  int64_t epoch = 0;
  int64_t first = 0;        ///< position in the epoch's order of the global batch's first sample
  int64_t global_rows = 0;  ///< samples in this global batch (global_batch, or fewer for a kept last one)
  int64_t max_rows = 0;     ///< the largest share of it: the rows every rank's step must be ready for
};

class DistributedSampler {
 public:
  /// `rank` of `ranks` data-parallel ranks (not the world: the tensor-parallel ranks of one
  /// data-parallel group read the same samples). Refused: a global batch the ranks cannot divide
  /// (the message lists the global batches and rank counts that work), a global batch larger than
  /// the dataset.
  DistributedSampler(int64_t dataset_size, int rank, int ranks, SamplerOptions options);
  /// The same with the rank and size of `data_parallel_group`.
  DistributedSampler(int64_t dataset_size, const c10::intrusive_ptr<c10d::ProcessGroup>& data_parallel_group,
                     SamplerOptions options);

  /// This rank's share of the next global batch of the epoch, and the state moves past that global
  /// batch; nullopt once the epoch has no more (then the next call starts the next epoch).
  std::optional<Share> next_share();
  /// Global batches of one epoch (the last, shorter one included with kUneven).
  int64_t batches_per_epoch() const;

  SamplerState state() const { return state_; }
  /// Resumes at `state`, saved by a sampler over the same dataset with the same seed and shuffle, on
  /// any number of ranks; refused otherwise (the message says which differs and what to do).
  void load_state(const SamplerState& state);
  /// Starts `epoch` from its beginning (PyTorch's set_epoch), keeping samples_consumed; the current
  /// epoch keeps its position, so that the PyTorch loop `for e: set_epoch(e); ...` does not redo
  /// a resumed epoch from its start.
  void set_epoch(int64_t epoch);

  const SamplerOptions& options() const { return options_; }
  int64_t dataset_size() const { return state_.dataset_size; }
  int rank() const { return rank_; }
  int ranks() const { return ranks_; }

  /// state() into a torch::serialize archive, and back (load_state's checks).
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  static const c10d::ProcessGroup& checked(const c10::intrusive_ptr<c10d::ProcessGroup>& group);
  SamplerOptions options_;
  int rank_, ranks_;
  SamplerState state_;
};

/// The data-parallel rank counts that divide `global_batch` (its first 16 divisors), and the
/// multiples of `ranks` near it, as a sentence for error messages: "global batches that 5 rank(s)
/// divide: 10, 15; rank counts that divide 12: 1, 2, 3, 4, 6, 12".
std::string divisible_sizes(int64_t global_batch, int ranks);

}  // namespace fsdp::data

FSDP_PUBLIC_END
