// Parity: N ranks of fully sharded training equal plain LibTorch on the concatenated batch, every
// step (losses) and after training (every parameter), within 1e-5 relative (reduction order alone).
#include "tests/parity.h"

namespace fsdp::testing {
namespace {

struct Case {
  int world_size;
  Opt opt;
};
std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  const char* names[] = {"SGD", "AdamW", "FusedAdamW"};
  return std::string(names[static_cast<int>(i.param.opt)]) + "_W" + std::to_string(i.param.world_size);
}
const auto kCases = ::testing::Values(Case{1, Opt::kSGD}, Case{2, Opt::kSGD}, Case{3, Opt::kSGD}, Case{4, Opt::kSGD},
                                      Case{1, Opt::kAdamW}, Case{2, Opt::kAdamW}, Case{3, Opt::kAdamW},
                                      Case{4, Opt::kAdamW}, Case{1, Opt::kFusedAdamW}, Case{2, Opt::kFusedAdamW},
                                      Case{3, Opt::kFusedAdamW}, Case{4, Opt::kFusedAdamW});

class Parity : public ::testing::TestWithParam<Case> {};

TEST_P(Parity, UnevenMLP) {
  const Case c = GetParam();
  run_ranks(c.world_size, [&](Rank& r) {
    auto batch = [](int step) {
      torch::manual_seed(1000 + step);
      auto x = torch::randn({kGlobalBatch, 7});
      return std::make_pair(x, torch::randn({kGlobalBatch, 3}));
    };
    check_parity(
        r, c.opt, 6, [] { return std::make_shared<UnevenMLPImpl<false>>(); },
        [] { return std::make_shared<UnevenMLPImpl<true>>(); }, batch,
        [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); });
  });
}

TEST_P(Parity, GPT) {
  const Case c = GetParam();
  gpt::Config cfg;
  cfg.vocab_size = 37;
  cfg.block_size = 8;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 18;
  // The key part of c_attn's bias has a true gradient of exactly 0 (softmax ignores a constant
  // added to every key score), so its computed gradient is rounding noise, which Adam normalises
  // into full-size steps whose sign depends on reduction order. SGD keeps the biases; AdamW runs
  // without them (every other bias path is covered by UnevenMLP).
  cfg.bias = c.opt == Opt::kSGD;
  run_ranks(c.world_size, [&](Rank& r) { check_gpt_parity(r, c.opt, 5, cfg, 2000); });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Parity, kCases, case_name);

// Prefetch changes when gathers are issued, never the numbers: off, and two units deep.
class PrefetchParity : public ::testing::TestWithParam<int> {};
TEST_P(PrefetchParity, GPT) {
  const int depth = GetParam();
  gpt::Config cfg{37, 8, 3, 2, 18, true};
  run_ranks(3, [&](Rank& r) { check_gpt_parity(r, Opt::kSGD, 4, cfg, 3000, test_options().prefetch(depth)); });
}
INSTANTIATE_TEST_SUITE_P(Depths, PrefetchParity, ::testing::Values(0, 2));

// SHARD_GRAD_OP (ZeRO-2): units stay gathered from forward to backward; same numbers. SGD with
// momentum checks the gradients themselves (AdamW would also amplify rounding noise in
// near-zero gradients; the Parity suite covers it).
class ShardGradOpParity : public ::testing::TestWithParam<int> {};
TEST_P(ShardGradOpParity, GPT) {
  const int world = GetParam();
  gpt::Config cfg{37, 8, 3, 2, 18, true};
  run_ranks(world, [&](Rank& r) {
    check_gpt_parity(r, Opt::kSGD, 4, cfg, 6000, test_options().strategy(ShardingStrategy::kShardGradOp));
  });
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, ShardGradOpParity, ::testing::Values(1, 2, 3, 4));

// Units of different strategies in one model: block 1 SHARD_GRAD_OP, the others full sharding.
TEST(MixedStrategies, GPT) {
  gpt::Config cfg{31, 6, 3, 2, 12, true};
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(cfg);
    torch::manual_seed(0);
    auto net = gpt::make_gpt<true>(cfg);
    net->blocks[1]->set_sharding_strategy(ShardingStrategy::kShardGradOp);
    auto model = fsdp::fully_shard(net, r.pg, test_options());
    train_and_compare(
        r, Opt::kSGD, 3, ref, model, [&](int step) { return gpt_batch(cfg, 8000 + step); }, gpt_loss,
        [&](int) {
          // Root once, two full-sharding blocks twice, the SHARD_GRAD_OP block once.
          EXPECT_EQ(model.comm_stats().all_gathers, 1 + 2 * 2 + 1);
        });
  });
}

// Clipping by the global norm over shards equals clip_grad_norm_ on the unsharded model: the
// returned norm every step and the parameters after (which the clipped gradients produced).
class ClipParity : public ::testing::TestWithParam<int> {};
TEST_P(ClipParity, UnevenMLP) {
  const int world = GetParam();
  run_ranks(world, [&](Rank& r) {
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      auto batch = [](int step) {
        torch::manual_seed(4000 + step);
        auto x = torch::randn({kGlobalBatch, 7});
        return std::make_pair(x, torch::randn({kGlobalBatch, 3}));
      };
      check_parity(
          r, Opt::kSGD, 4, [] { return std::make_shared<UnevenMLPImpl<false>>(); },
          [] { return std::make_shared<UnevenMLPImpl<true>>(); }, batch,
          [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); }, test_options(),
          /*clip=*/0.02, norm_type);
    }
  });
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, ClipParity, ::testing::Values(1, 2, 3, 4));

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

// Gradient accumulation over 3 micro-batches equals plain LibTorch with the same total batch,
// whether every micro-batch reduces (sharded gradients accumulate) or only the last one does
// (unsharded gradients accumulate, nothing is communicated before).
class AccumulationParity : public ::testing::TestWithParam<std::tuple<int, bool>> {};
TEST_P(AccumulationParity, GPT) {
  const auto [world, sync_every] = GetParam();
  run_ranks(world, [&, sync_every = sync_every](Rank& r) {
    check_accumulation(r, test_options(), sync_every, [&](const auto& model, bool sync, int m) {
      EXPECT_EQ(model.comm_stats().reduce_scatters, sync ? 1 + kAccumulationConfig.n_layer : 0) << "micro-batch " << m;
      if (!sync) {
        for (const auto& p : model.parameters()) EXPECT_FALSE(p.grad().defined());
      }
    });
  });
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, AccumulationParity,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool()), [](const auto& i) {
                           return "W" + std::to_string(std::get<0>(i.param)) +
                                  (std::get<1>(i.param) ? "_ReduceEveryMicroBatch" : "_ReduceLastOnly");
                         });

}  // namespace
}  // namespace fsdp::testing
