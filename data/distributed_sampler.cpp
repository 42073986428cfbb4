#include "data/distributed_sampler.h"

#include "data/permutation.h"
#include "fsdp/internal/check.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace fsdp::data {

bool operator==(const SamplerState& a, const SamplerState& b) {
  return a.seed == b.seed && a.shuffle == b.shuffle && a.dataset_size == b.dataset_size && a.epoch == b.epoch &&
         a.position == b.position && a.samples_consumed == b.samples_consumed;
}

bool possible(const SamplerState& s) {
  return s.dataset_size >= 0 && s.epoch >= 0 && s.position >= 0 && s.position <= s.dataset_size &&
         s.samples_consumed >= s.position;
}

std::string to_string(const SamplerState& s) {
  std::ostringstream o;
  o << "epoch " << s.epoch << ", position " << s.position << " of " << s.dataset_size << ", " << s.samples_consumed
    << " consumed (seed " << s.seed << (s.shuffle ? ", shuffled)" : ", in order)");
  return o.str();
}

std::string divisible_sizes(int64_t global_batch, int ranks) {
  std::ostringstream o;
  o << "global batches that " << ranks << " rank(s) divide: ";
  const int64_t below = global_batch / ranks * ranks, above = below + ranks;
  if (below > 0) o << below << ", ";
  o << above << "; rank counts that divide " << global_batch << ":";
  // The first 16 divisors of the global batch, then "...": a list a reader can use.
  int listed = 0;
  for (int64_t d = 1; d <= global_batch && listed < 16; ++d) {
    if (global_batch % d == 0) {
      o << (listed ? ", " : " ") << d;
      ++listed;
    }
  }
  if (listed == 16) o << ", ...";
  return o.str();
}

const c10d::ProcessGroup& DistributedSampler::checked(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  FSDP_CHECK(group,
             "fsdp::data::DistributedSampler: the data-parallel process group is null; pass the group from "
             "fsdp::init_process_group() (or rank and ranks).");
  return *group;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int ranks, SamplerOptions options)
    : options_(std::move(options)), rank_(rank), ranks_(ranks) {
  const int64_t g = options_.global_batch();
  FSDP_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "fsdp::data::DistributedSampler: rank ", rank, " of ", ranks,
             " data-parallel ranks; the rank must be in [0, ranks).");
  const ErrorContext in = ErrorContext().api("fsdp::data::DistributedSampler").rank(rank).world_size(ranks);
  FSDP_CHECK_IN(in, dataset_size > 0, "a dataset of ", dataset_size,
                " samples: pass the dataset's size (dataset.size().value()), at least 1.");
  FSDP_CHECK_IN(in, g >= 1, "global batch ", g, "; it must be >= 1.");
  FSDP_CHECK_IN(
      in, g % ranks == 0, "the global batch of ", g, " samples cannot be split over ", ranks,
      " data-parallel ranks into equal shares (", g, " % ", ranks, " = ", g % ranks, "); ", divisible_sizes(g, ranks),
      ". Pass a global batch the ranks divide (fsdp::data::plan_batch keeps it constant across rank counts).");
  FSDP_CHECK_IN(in, g <= dataset_size || (options_.last_batch() == LastBatch::kUneven && dataset_size > 0),
                "the global batch of ", g, " samples is larger than the dataset (", dataset_size,
                " samples), so an epoch has no whole global batch; lower the global batch, or keep the last uneven one "
                "(LastBatch::kUneven).");
  state_.seed = options_.seed();
  state_.shuffle = options_.shuffle();
  state_.dataset_size = dataset_size;
}

DistributedSampler::DistributedSampler(int64_t dataset_size,
                                       const c10::intrusive_ptr<c10d::ProcessGroup>& data_parallel_group,
                                       SamplerOptions options)
    : DistributedSampler(dataset_size, checked(data_parallel_group).getRank(), checked(data_parallel_group).getSize(),
                         std::move(options)) {}

int64_t DistributedSampler::batches_per_epoch() const {
  const int64_t n = state_.dataset_size, g = options_.global_batch();
  return options_.last_batch() == LastBatch::kDrop ? n / g : (n + g - 1) / g;
}

std::optional<Share> DistributedSampler::next_share() {
  const int64_t n = state_.dataset_size, g = options_.global_batch();
  const int64_t left = n - state_.position;
  if (left <= 0 || (left < g && options_.last_batch() == LastBatch::kDrop)) {
    // The epoch is over (its dropped tail, if any, is not consumed): the next call starts the next.
    state_.epoch += 1;
    state_.position = 0;
    return std::nullopt;
  }
  Share s;
  s.epoch = state_.epoch;
  s.first = state_.position;
  s.global_rows = std::min(g, left);
  // Rank r takes positions [begin, begin + rows) of the global batch: equal shares, or for a
  // shorter last batch the first (rows % ranks) ranks one row more.
  const int64_t q = s.global_rows / ranks_, extra = s.global_rows % ranks_;
  const int64_t rows = q + (rank_ < extra ? 1 : 0), begin = rank_ * q + std::min<int64_t>(rank_, extra);
  s.max_rows = q + (extra > 0 ? 1 : 0);
  const Permutation order(n, state_.seed, state_.epoch, state_.shuffle);
  s.indices.reserve(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) s.indices.push_back(order(s.first + begin + i));
  state_.position += s.global_rows;
  state_.samples_consumed += s.global_rows;
  return s;
}

void DistributedSampler::load_state(const SamplerState& saved) {
  const ErrorContext context = ErrorContext().api("fsdp::data::DistributedSampler::load_state").rank(rank_);
  FSDP_CHECK_IN(context, saved.dataset_size == state_.dataset_size, "the state was saved over a dataset of ",
                saved.dataset_size, " samples, this sampler's has ", state_.dataset_size,
                ": the dataset changed since the save, so its order and position mean other samples. Resume with the "
                "same dataset, or start a new run without the saved data state.");
  FSDP_CHECK_IN(context, saved.seed == state_.seed, "the state was saved with seed ", saved.seed,
                ", this sampler has seed ", state_.seed,
                ": another seed is another order. Build the sampler with SamplerOptions::seed(", saved.seed,
                "), as the saved run did.");
  FSDP_CHECK_IN(context, saved.shuffle == state_.shuffle, "the state was saved with shuffle ",
                saved.shuffle ? "on" : "off", ", this sampler has it ", state_.shuffle ? "on" : "off",
                ". Build the sampler with the saved run's shuffle option.");
  FSDP_CHECK_IN(context, possible(saved), "the state (", to_string(saved),
                ") is not one a sampler can be in (epoch and position >= 0, position <= dataset size, samples consumed "
                ">= position): pass a state from DistributedSampler::state() or a checkpoint.");
  state_ = saved;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  FSDP_CHECK_IN(ErrorContext().api("fsdp::data::DistributedSampler::set_epoch").rank(rank_), epoch >= 0, "epoch ",
                epoch, "; epochs count from 0.");
  if (epoch == state_.epoch) return;
  state_.epoch = epoch;
  state_.position = 0;
}

namespace {
// The seed is unsigned 64-bit; an archive holds signed integers: the same bits.
int64_t as_signed(uint64_t v) {
  int64_t s;
  std::memcpy(&s, &v, sizeof s);
  return s;
}
uint64_t as_unsigned(int64_t v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}
}  // namespace

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("seed", c10::IValue(as_signed(state_.seed)));
  archive.write("shuffle", c10::IValue(state_.shuffle));
  archive.write("dataset_size", c10::IValue(state_.dataset_size));
  archive.write("epoch", c10::IValue(state_.epoch));
  archive.write("position", c10::IValue(state_.position));
  archive.write("samples_consumed", c10::IValue(state_.samples_consumed));
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  // Each field an integer (a bool for shuffle), or the archive holds no sampler's state.
  auto field = [&](const char* key) {
    c10::IValue v;
    FSDP_CHECK_IN(ErrorContext().api("fsdp::data::DistributedSampler::load").rank(rank_),
                  archive.try_read(key, v) && (v.isInt() || v.isBool()), "the archive has no '", key,
                  "': it does not hold a sampler's state (DistributedSampler::save writes one).");
    return v;
  };
  SamplerState s;
  s.seed = as_unsigned(field("seed").toInt());
  s.shuffle = field("shuffle").toBool();
  s.dataset_size = field("dataset_size").toInt();
  s.epoch = field("epoch").toInt();
  s.position = field("position").toInt();
  s.samples_consumed = field("samples_consumed").toInt();
  load_state(s);
}

}  // namespace fsdp::data
