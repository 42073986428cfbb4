// The fake process group (one rank of a job of any size, communicating nothing): a rank over it
// holds exactly what the same rank of a real job holds, so per-rank memory at 1024 ranks can be
// measured in one process.
#include "tests/parity.h"

namespace fsdp::testing {
namespace {

struct RankView {
  std::vector<std::vector<int64_t>> shapes;  // every sharded parameter's shape
  int64_t state_bytes = 0;                   // after one AdamW step
  CommStats comm;                            // of that step
};

RankView one_step(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, ShardingStrategy strategy) {
  gpt::Config cfg{37, 8, 3, 2, 18, true};
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), pg, test_options().strategy(strategy).shard_group_size(2));
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-3));
  torch::manual_seed(1);
  auto tok = torch::randint(cfg.vocab_size, {2, cfg.block_size + 1}, torch::kLong);
  model.reset_comm_stats();
  auto logits = model(tok.narrow(1, 0, cfg.block_size));
  torch::nn::functional::cross_entropy(logits.flatten(0, 1), tok.narrow(1, 1, cfg.block_size).flatten()).backward();
  opt.step();
  RankView v;
  for (const auto& p : model.parameters()) v.shapes.push_back(p.sizes().vec());
  v.state_bytes = fsdp::optim::state_bytes(model.parameters(), &opt).total();
  v.comm = model.comm_stats();
  return v;
}

TEST(Simulated, FakeRankHoldsWhatARealRankHolds) {
  run_ranks(4, [](Rank& r) {
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardOptimizerState,
                          ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
      SCOPED_TRACE(to_string(strategy));
      const RankView real = one_step(r.pg, strategy);
      const RankView fake = one_step(make_fake_process_group(r.rank, r.world_size), strategy);
      EXPECT_EQ(fake.shapes, real.shapes);
      EXPECT_EQ(fake.state_bytes, real.state_bytes);
      EXPECT_EQ(fake.comm.all_gathers, real.comm.all_gathers);
      EXPECT_EQ(fake.comm.reduce_scatters, real.comm.reduce_scatters);
      EXPECT_EQ(fake.comm.all_reduces, real.comm.all_reduces);
      EXPECT_EQ(fake.comm.elements, real.comm.elements);
    }
  });
}

// Rank 100 of 1024, the model built inside a ShardingScope: after an AdamW step, parameters and
// gradients take 4 bytes each per element of this rank's padded shards, Adam's two moments 8 per
// element this rank owns (a rank past a parameter's rows owns none of it), from shapes.
TEST(Simulated, RankOfAThousand) {
  const int W = 1024, rank = 100;
  gpt::Config cfg{256, 16, 2, 4, 64, true};
  int64_t root = 0, blocks = 0, owned = 0;  // padded elements per rank, owned elements, from shapes
  {
    auto full = gpt::make_gpt<false>(cfg);
    for (const auto& kv : full->named_parameters()) {
      const auto& p = kv.value();
      const int64_t rows = p.dim() == 0 ? 1 : p.size(0);
      const int64_t c = (rows + W - 1) / W, row = p.numel() / rows;
      (kv.key().rfind("h.", 0) == 0 ? blocks : root) += c * row;
      owned += std::max<int64_t>(0, std::min(c, rows - rank * c)) * row;
    }
  }
  const int64_t padded = root + blocks;
  auto pg = make_fake_process_group(rank, W);
  torch::manual_seed(0);
  ShardingScope scope(pg, test_options());
  auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), scope);
  EXPECT_EQ(model.world_size(), W);
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-3));
  auto tok = torch::randint(cfg.vocab_size, {1, cfg.block_size + 1}, torch::kLong);
  model.reset_comm_stats();
  auto logits = model(tok.narrow(1, 0, cfg.block_size));
  torch::nn::functional::cross_entropy(logits.flatten(0, 1), tok.narrow(1, 1, cfg.block_size).flatten()).backward();
  opt.step();
  EXPECT_GT(owned, 0);
  EXPECT_EQ(fsdp::optim::state_bytes(model.parameters(), &opt).total(), 8 * padded + 8 * owned);
  // What rank 100 of a real job would send: the root gathered once, each block twice, every unit
  // reduce-scattered once (3Ψ, padding included).
  EXPECT_EQ(model.comm_stats().elements, W * (2 * root + 3 * blocks));
}

/// Three units of Linear(16, 16) and nothing else: the root unit holds no parameters.
struct ThreeUnitsImpl : torch::nn::Module {
  ThreeUnitsImpl() {
    for (int i = 0; i < 3; ++i)
      units.push_back(register_module("u" + std::to_string(i), Sharded<torch::nn::LinearImpl>(16, 16)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& u : units) x = torch::tanh(u(x));
    return x;
  }
  std::vector<Sharded<torch::nn::LinearImpl>> units;
};

// held_state_bytes and its peak, in bytes from shapes, on rank 0 of 4 (fake group, no prefetch).
// A unit has 272 elements: 1088 bytes whole, a 272-byte shard (4 of its 16 rows, no padding).
// The peak is when the last unit of backward (u0) packs its gradients: every parameter shard,
// the gradient shards of u2 and u1 (u1's reduction completed before u0 packs), u0's gathered
// parameters, its gradients and their packed copy. Keeping u1's reduction in flight while u0
// packs would add its packed gradients, 1088 bytes (its output is already counted: it becomes
// u1's gradient shard).
TEST(Simulated, HeldStateBytesAndPeakFromShapes) {
  const int64_t U = 3, unit = 1088, shard = 272;
  torch::manual_seed(0);
  auto model =
      fsdp::fully_shard(std::make_shared<ThreeUnitsImpl>(), make_fake_process_group(0, 4), test_options().prefetch(0));
  EXPECT_EQ(model.held_state_bytes(), U * shard);  // the shards only
  torch::optim::SGD sgd(model.parameters(), 0.1);
  for (int step = 0; step < 2; ++step) {
    sgd.zero_grad();
    model.track_state_peak(true);
    model(torch::randn({5, 16})).sum().backward();
    model.track_state_peak(false);
    EXPECT_EQ(model.state_peak_bytes(), U * shard + (U - 1) * shard + 3 * unit) << "step " << step;
    EXPECT_EQ(model.held_state_bytes(), 2 * U * shard) << "step " << step;  // shards and gradient shards
    sgd.step();
  }
  // Off, the peak is no longer sampled.
  model(torch::randn({5, 16})).sum().backward();
  EXPECT_EQ(model.state_peak_bytes(), U * shard + (U - 1) * shard + 3 * unit);
}

}  // namespace
}  // namespace fsdp::testing
