// fsdp::data: the order (a permutation of every index, the same as the Python transcription of its
// specification, and hand-checked values), the sampler's stream (the same samples per global batch
// on 1-4 ranks, every sample once per epoch after a save on N ranks and a resume on M, across epoch
// boundaries), the last batch dropped or kept uneven without a repeated sample, the torch::data
// loader, the constant global batch, and every refusal with its message.
#include "data/batch_plan.h"
#include "data/distributed_sampler.h"
#include "data/loader_sampler.h"
#include "data/permutation.h"
#include "tests/models.h"
#include "tests/temp_dir.h"

#include <gtest/gtest.h>
#include <torch/data.h>
#include <torch/serialize.h>

#include <unistd.h>

#include <cstdio>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp::testing {
namespace {

using data::DistributedSampler;
using data::LastBatch;
using data::Permutation;
using data::SamplerOptions;
using data::SamplerState;

std::vector<int64_t> order_of(int64_t n, uint64_t seed, int64_t epoch) {
  const Permutation p(n, seed, epoch);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(p(i));
  return out;
}

// Worked out by hand from docs/data.md's steps with tests/data/data_order_reference.py.
TEST(DataOrder, ReferenceValues) {
  EXPECT_EQ(order_of(10, 0, 0), (std::vector<int64_t>{7, 4, 9, 6, 0, 5, 1, 2, 8, 3}));
  EXPECT_EQ(order_of(10, 0, 1), (std::vector<int64_t>{0, 9, 5, 4, 8, 1, 3, 7, 6, 2}));
  EXPECT_EQ(order_of(10, 1234, 0), (std::vector<int64_t>{7, 9, 1, 0, 3, 6, 5, 2, 8, 4}));
  EXPECT_EQ(order_of(5, UINT64_MAX, 3), (std::vector<int64_t>{0, 1, 4, 2, 3}));
  EXPECT_EQ(order_of(1, 5, 5), (std::vector<int64_t>{0}));
  EXPECT_TRUE(order_of(0, 1, 0).empty());
  const Permutation in_order(7, 99, 4, /*shuffle=*/false);
  for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(in_order(i), i);
}

TEST(DataOrder, EveryIndexOnceAndEpochsDiffer) {
  for (int64_t n : {2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097}) {
    for (uint64_t seed : {0ULL, 1ULL, 0xdeadbeefULL}) {
      std::vector<std::vector<int64_t>> epochs;
      for (int64_t e = 0; e < 3; ++e) {
        auto o = order_of(n, seed, e);
        std::set<int64_t> seen(o.begin(), o.end());
        ASSERT_EQ(static_cast<int64_t>(seen.size()), n) << "n " << n << " seed " << seed << " epoch " << e;
        EXPECT_EQ(*seen.begin(), 0);
        EXPECT_EQ(*seen.rbegin(), n - 1);
        epochs.push_back(std::move(o));
      }
      if (n >= 16) EXPECT_NE(epochs[0], epochs[1]) << n;
      if (n >= 16) EXPECT_NE(epochs[0], order_of(n, seed + 1, 0)) << n;
    }
  }
  // Any position on its own: the 10^12-sample epoch's last position needs nothing before it.
  const Permutation big(int64_t{1} << 40, 7, 0);
  const int64_t last = big((int64_t{1} << 40) - 1);
  EXPECT_GE(last, 0);
  EXPECT_LT(last, int64_t{1} << 40);
}

// The virtualenv's python (FSDP_PYTHON, set where the build found the virtualenv), or empty when
// there is none: the test that needs it then says so as a skip instead of vanishing.
std::string venv_python() {
#ifdef FSDP_PYTHON
  if (::access(FSDP_PYTHON, X_OK) == 0) return FSDP_PYTHON;
#endif
  return {};
}

// The Python transcription of the specification gives the same orders (seeds past 2^63 included).
TEST(DataOrder, SameAsThePythonTranscription) {
  const std::string python = venv_python();
  if (python.empty())
    GTEST_SKIP() << "the virtualenv's python is missing, so tests/data/data_order_reference.py cannot run "
                    "(scripts/setup.sh makes the virtualenv, scripts/build.sh passes it as -DFSDP_VENV)";
  for (const auto& [n, seed, epoch] : std::vector<std::tuple<int64_t, uint64_t, int64_t>>{
           {1, 0, 0}, {2, 3, 1}, {37, 42, 0}, {37, 42, 9}, {1000, 0xfedcba9876543210ULL, 2}, {4097, 1, 123}}) {
    const std::string cmd = python + " " + FSDP_SOURCE_DIR + "/tests/data/data_order_reference.py " +
                            std::to_string(n) + " " + std::to_string(seed) + " " + std::to_string(epoch);
    FILE* f = ::popen(cmd.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string out;
    char buf[4096];
    while (size_t k = std::fread(buf, 1, sizeof buf, f)) out.append(buf, k);
    ASSERT_EQ(::pclose(f), 0) << cmd;
    std::istringstream in(out);
    std::vector<int64_t> reference;
    for (int64_t v; in >> v;) reference.push_back(v);
    EXPECT_EQ(reference, order_of(n, seed, epoch)) << cmd;
  }
}

// The global stream: each global batch's samples in rank order, as ranks 0..D-1 take them.
struct Step {
  int64_t epoch, first;
  std::vector<int64_t> samples;
  bool operator==(const Step& o) const { return epoch == o.epoch && first == o.first && samples == o.samples; }
};

// `steps` global batches taken by D samplers in lockstep (nullopt: an epoch's end, not a step),
// from `state` when given; every rank's state is the same after each.
std::vector<Step> take(int64_t n, const SamplerOptions& o, int D, int steps, std::optional<SamplerState>& state) {
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < D; ++r) {
    ranks.emplace_back(n, r, D, o);
    if (state) ranks.back().load_state(*state);
  }
  std::vector<Step> out;
  while (static_cast<int>(out.size()) < steps) {
    Step s{};
    bool end = false;
    for (int r = 0; r < D; ++r) {
      auto share = ranks[r].next_share();
      if (!share) {
        end = true;
        continue;
      }
      EXPECT_LE(static_cast<int64_t>(share->indices.size()), share->max_rows);
      s.epoch = share->epoch;
      s.first = share->first;
      s.samples.insert(s.samples.end(), share->indices.begin(), share->indices.end());
    }
    for (int r = 1; r < D; ++r) EXPECT_EQ(ranks[r].state(), ranks[0].state());
    if (!end) out.push_back(std::move(s));
  }
  state = ranks[0].state();
  return out;
}

TEST(DistributedSampler, GlobalBatchesDoNotDependOnTheRanks) {
  std::optional<SamplerState> none;
  const auto one = take(50, SamplerOptions(12).seed(3), 1, 9, none);
  for (int D : {2, 3, 4, 6}) {
    std::optional<SamplerState> s;
    EXPECT_EQ(take(50, SamplerOptions(12).seed(3), D, 9, s), one) << D << " ranks";
  }
  // 50 samples, global batch 12: 4 steps per epoch, the last 2 samples dropped.
  EXPECT_EQ(one[3].first, 36);
  EXPECT_EQ(one[4].epoch, 1);
  EXPECT_EQ(one[4].first, 0);
  const auto order = order_of(50, 3, 1);
  EXPECT_EQ(one[4].samples, std::vector<int64_t>(order.begin(), order.begin() + 12));
}

// Saved after k steps on N ranks (past an epoch boundary or not), resumed on M: the stream is the
// uninterrupted one; each epoch's samples are distinct, the first 48 of its order.
TEST(DistributedSampler, ResumedOnAnyRanksEverySampleOncePerEpoch) {
  const int64_t n = 50;
  const SamplerOptions o = SamplerOptions(12).seed(11);
  std::optional<SamplerState> none;
  const auto whole = take(n, o, 1, 12, none);  // 3 epochs of 4 steps
  EXPECT_EQ(none->samples_consumed, 12 * 12);
  for (int N = 1; N <= 4; ++N) {
    for (int M = 1; M <= 4; ++M) {
      for (int k : {2, 4, 5, 7}) {
        std::optional<SamplerState> s;
        auto got = take(n, o, N, k, s);
        EXPECT_EQ(s->samples_consumed, 12 * k);
        auto rest = take(n, o, M, 12 - k, s);
        got.insert(got.end(), rest.begin(), rest.end());
        ASSERT_EQ(got, whole) << N << " -> " << M << " after " << k;
      }
    }
  }
  for (int64_t e = 0; e < 3; ++e) {
    std::multiset<int64_t> seen;
    for (const auto& s : whole) {
      if (s.epoch == e) seen.insert(s.samples.begin(), s.samples.end());
    }
    const auto order = order_of(n, 11, e);
    EXPECT_EQ(seen, std::multiset<int64_t>(order.begin(), order.begin() + 48)) << "epoch " << e;
  }
}

TEST(DistributedSampler, LastBatchUnevenHasEverySampleOnceAndNoRepeat) {
  const int64_t n = 50;  // global batch 12: 4 whole, then 2 samples over 3 ranks
  for (int D : {1, 3, 4}) {
    std::vector<DistributedSampler> ranks;
    for (int r = 0; r < D; ++r) ranks.emplace_back(n, r, D, SamplerOptions(12).seed(5).last_batch(LastBatch::kUneven));
    EXPECT_EQ(ranks[0].batches_per_epoch(), 5);
    std::multiset<int64_t> seen;
    for (int step = 0; step < 5; ++step) {
      for (int r = 0; r < D; ++r) {
        auto share = ranks[r].next_share();
        ASSERT_TRUE(share.has_value());
        if (step == 4) {
          EXPECT_EQ(share->global_rows, 2);
          EXPECT_EQ(share->max_rows, D == 1 ? 2 : 1);
          EXPECT_EQ(share->indices.size(), D == 1 ? 2u : r < 2 ? 1u : 0u) << "rank " << r;
        }
        seen.insert(share->indices.begin(), share->indices.end());
      }
    }
    for (auto& s : ranks) EXPECT_FALSE(s.next_share().has_value());
    std::multiset<int64_t> all;
    for (int64_t i = 0; i < n; ++i) all.insert(i);
    EXPECT_EQ(seen, all) << D << " ranks";
    EXPECT_EQ(ranks[0].state().epoch, 1);
    EXPECT_EQ(ranks[0].state().samples_consumed, n);
  }
}

// A dataset whose sample i is the tensor {i}.
struct Indices : torch::data::datasets::Dataset<Indices, torch::data::TensorExample> {
  torch::data::TensorExample get(size_t i) override { return {torch::tensor({static_cast<int64_t>(i)})}; }
  std::optional<size_t> size() const override { return 40; }
};

// Through torch::data's loader (LoaderSampler): the caller's sampler advances; each pass is one
// epoch of this rank's shares in micro-batches that never cross a global batch, with 0 or 2 worker
// threads; the next pass continues with the next epoch.
TEST(DistributedSampler, TorchDataLoaderTakesMicroBatchesOfTheShare) {
  DistributedSampler reference(40, 1, 2, SamplerOptions(16).seed(9));
  std::vector<int64_t> want;  // rank 1's shares of epochs 0, 1 and 2: 2 global batches each
  for (int i = 0; i < 3; ++i) {
    while (auto s = reference.next_share()) want.insert(want.end(), s->indices.begin(), s->indices.end());
  }
  for (size_t workers : {0, 2}) {
    DistributedSampler sampler(40, 1, 2, SamplerOptions(16).seed(9));
    auto loader = torch::data::make_data_loader(
        Indices().map(torch::data::transforms::Stack<torch::data::TensorExample>()), data::LoaderSampler(sampler),
        torch::data::DataLoaderOptions().batch_size(4).workers(workers));
    std::vector<int64_t> got;
    for (int epoch = 0; epoch < 3; ++epoch) {
      int64_t batches = 0;
      for (auto& batch : *loader) {  // begin() continues where the sampler is: the next epoch
        EXPECT_EQ(batch.data.size(0), 4);
        ++batches;
        for (int64_t i = 0; i < batch.data.size(0); ++i) got.push_back(batch.data[i][0].item<int64_t>());
      }
      EXPECT_EQ(batches, 4) << "one epoch per pass: 2 global batches x 2 micro-batches of 4, workers " << workers;
      if (workers == 0) EXPECT_EQ(sampler.state().samples_consumed, 32 * (epoch + 1)) << "the caller's sampler";
    }
    if (workers == 0) {
      EXPECT_EQ(got, want);
    } else {  // the workers return batches in request order, each batch's rows in any order
      std::multiset<int64_t> a(got.begin(), got.end()), b(want.begin(), want.end());
      EXPECT_EQ(a, b);
    }
  }
  // A batch size that does not divide the share (8 rows), and an uneven last batch: refused.
  DistributedSampler sampler(40, 1, 2, SamplerOptions(16).seed(9));
  data::LoaderSampler ls(sampler);
  auto msg = error_of([&] { ls.next(3); });
  EXPECT_NE(msg.find("the loader's batch size 3 does not divide this rank's share of each global batch (8 rows of 16)"),
            std::string::npos)
      << msg;
  DistributedSampler uneven(40, 1, 2, SamplerOptions(16).last_batch(LastBatch::kUneven));
  msg = error_of([&] { data::LoaderSampler{uneven}; });
  EXPECT_NE(msg.find("LastBatch::kUneven gives the ranks shares of different sizes"), std::string::npos) << msg;
  msg = error_of([&] { ls.reset(99); });
  EXPECT_NE(msg.find("a dataset of 99 samples, but the sampler was built for 40"), std::string::npos) << msg;
}

// PyTorch's loop calls set_epoch(e) every epoch: after a resume inside epoch e it keeps the position.
TEST(DistributedSampler, SetEpochKeepsAResumedEpochsPosition) {
  DistributedSampler a(100, 0, 2, SamplerOptions(10).seed(1));
  for (int i = 0; i < 3; ++i) a.next_share();
  DistributedSampler b(100, 1, 2, SamplerOptions(10).seed(1));
  b.load_state(a.state());
  b.set_epoch(0);
  EXPECT_EQ(b.state().position, 30);
  b.set_epoch(1);
  EXPECT_EQ(b.state().position, 0);
  EXPECT_EQ(b.state().epoch, 1);
  EXPECT_EQ(b.state().samples_consumed, 30);
}

TEST(DistributedSampler, StateThroughTorchArchives) {
  TempDir dir;
  DistributedSampler a(100, 0, 4, SamplerOptions(20).seed(0xfedcba9876543210ULL));
  for (int i = 0; i < 7; ++i) a.next_share();
  torch::serialize::OutputArchive out;
  a.save(out);
  out.save_to(dir.path + "/sampler.pt");
  DistributedSampler b(100, 2, 5, SamplerOptions(20).seed(0xfedcba9876543210ULL));
  torch::serialize::InputArchive in;
  in.load_from(dir.path + "/sampler.pt");
  b.load(in);
  EXPECT_EQ(b.state(), a.state());
  EXPECT_EQ(b.state().epoch, 1);
  EXPECT_EQ(b.state().position, 20);  // 5 global batches per epoch, then an end, then 1
}

TEST(DistributedSampler, Refusals) {
  auto msg = error_of([] { DistributedSampler(100, 0, 5, SamplerOptions(12)); });
  EXPECT_NE(msg.find("global batch of 12 samples cannot be split over 5 data-parallel ranks"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("global batches that 5 rank(s) divide: 10, 15; rank counts that divide 12: 1, 2, 3, 4, 6, 12"),
            std::string::npos)
      << msg;
  msg = error_of([] { DistributedSampler(10, 0, 2, SamplerOptions(12)); });
  EXPECT_NE(msg.find("larger than the dataset (10 samples)"), std::string::npos) << msg;
  EXPECT_EQ(error_of([] { DistributedSampler(10, 1, 2, SamplerOptions(12).last_batch(LastBatch::kUneven)); }), "");
  msg = error_of([] { DistributedSampler(10, 2, 2, SamplerOptions(2)); });
  EXPECT_NE(msg.find("rank 2 of 2 data-parallel ranks"), std::string::npos) << msg;

  DistributedSampler saved(100, 0, 2, SamplerOptions(10).seed(4));
  saved.next_share();
  const SamplerState s = saved.state();
  DistributedSampler other_seed(100, 0, 2, SamplerOptions(10).seed(5));
  msg = error_of([&] { other_seed.load_state(s); });
  EXPECT_NE(msg.find("saved with seed 4, this sampler has seed 5"), std::string::npos) << msg;
  EXPECT_EQ(other_seed.state().position, 0) << "unchanged";
  DistributedSampler other_size(99, 0, 2, SamplerOptions(10).seed(4));
  msg = error_of([&] { other_size.load_state(s); });
  EXPECT_NE(msg.find("saved over a dataset of 100 samples, this sampler's has 99: the dataset changed"),
            std::string::npos)
      << msg;
  DistributedSampler in_order(100, 0, 2, SamplerOptions(10).seed(4).shuffle(false));
  msg = error_of([&] { in_order.load_state(s); });
  EXPECT_NE(msg.find("saved with shuffle on, this sampler has it off"), std::string::npos) << msg;
  msg = error_of([] { DistributedSampler(10, c10::intrusive_ptr<c10d::ProcessGroup>(), SamplerOptions(2)); });
  EXPECT_NE(msg.find("the data-parallel process group is null"), std::string::npos) << msg;
}

TEST(BatchPlan, ConstantGlobalBatch) {
  auto p = data::plan_batch(256, 4, 8);
  EXPECT_EQ(p.rows_per_rank, 64);
  EXPECT_EQ(p.micro_batch, 8);
  EXPECT_EQ(p.accumulation, 8);
  EXPECT_EQ(data::to_string(p), "global batch 256 = 4 rank(s) x 8 micro-batch(es) x 8 rows");
  p = data::plan_batch(12, 3, 3);  // a share of 4 rows: 2 x 2, not 3 + 1
  EXPECT_EQ(p.micro_batch, 2);
  EXPECT_EQ(p.accumulation, 2);
  p = data::plan_batch(14, 1, 5);  // 14 = 7 x 2: micro-batches of 2
  EXPECT_EQ(p.micro_batch, 2);
  // Every plan: equal micro-batches that make up the global batch, within the limit, the fewest.
  for (int64_t g = 1; g <= 48; ++g) {
    for (int ranks = 1; ranks <= 6; ++ranks) {
      if (g % ranks != 0) continue;
      for (int64_t max_rows = 1; max_rows <= 10; ++max_rows) {
        p = data::plan_batch(g, ranks, max_rows);
        ASSERT_EQ(p.micro_batch * p.accumulation * ranks, g);
        ASSERT_LE(p.micro_batch, max_rows);
        for (int64_t k = 1; k < p.accumulation; ++k) {
          ASSERT_FALSE(p.rows_per_rank % k == 0 && p.rows_per_rank / k <= max_rows) << g << " " << ranks;
        }
      }
    }
  }
  auto msg = error_of([] { data::plan_batch(12, 5, 4); });
  EXPECT_NE(msg.find("rank counts that divide 12: 1, 2, 3, 4, 6, 12"), std::string::npos) << msg;
  msg = error_of([] { data::plan_batch(12, 2, 0); });
  EXPECT_NE(msg.find("at most 0 rows per micro-batch"), std::string::npos) << msg;
}

}  // namespace
}  // namespace fsdp::testing
