// The strategies besides full sharding (ZeRO-1, replicated, hybrid): parity with plain LibTorch at
// 1-4 ranks, gradient accumulation and clipping, units of different strategies in one model, and
// each strategy's collectives per step, computed here from shapes.
#include "tests/parity.h"

namespace fsdp::testing {
namespace {

struct StrategyCase {
  ShardingStrategy strategy;
  int world_size;
  int group = 0;  // kHybridShard: S
  Opt opt = Opt::kSGD;
};

std::string strategy_case_name(const ::testing::TestParamInfo<StrategyCase>& i) {
  const char* opts[] = {"SGD", "AdamW", "FusedAdamW"};
  return strategy_case_label(i.param.strategy, i.param.world_size, i.param.group) + "_" +
         opts[static_cast<int>(i.param.opt)];
}

FullyShardOptions strategy_options(const StrategyCase& c) {
  auto o = test_options(c.strategy, c.group);
  // Replicated: buckets of 256 bytes, so that every unit has several and most are all-reduced
  // while backward still runs.
  if (c.strategy == ShardingStrategy::kNoShard) o.bucket_bytes(256);
  return o;
}

constexpr auto kZero1 = ShardingStrategy::kShardOptimizerState;
constexpr auto kDDP = ShardingStrategy::kNoShard;
constexpr auto kHybrid = ShardingStrategy::kHybridShard;

class StrategyParity : public ::testing::TestWithParam<StrategyCase> {};

TEST_P(StrategyParity, GPT) {
  const StrategyCase c = GetParam();
  // Biases only with SGD: see Parity.GPT (Adam turns the key bias's zero gradient into noise).
  gpt::Config cfg{37, 8, 3, 2, 18, c.opt == Opt::kSGD};
  run_ranks(c.world_size, [&](Rank& r) { check_gpt_parity(r, c.opt, 4, cfg, 7000, strategy_options(c)); });
}

TEST_P(StrategyParity, UnevenMLP) {
  const StrategyCase c = GetParam();
  run_ranks(c.world_size, [&](Rank& r) {
    auto batch = [](int step) {
      torch::manual_seed(7100 + step);
      auto x = torch::randn({kGlobalBatch, 7});
      return std::make_pair(x, torch::randn({kGlobalBatch, 3}));
    };
    check_parity(
        r, c.opt, 4, [] { return std::make_shared<UnevenMLPImpl<false>>(); },
        [] { return std::make_shared<UnevenMLPImpl<true>>(); }, batch,
        [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); }, strategy_options(c));
  });
}

INSTANTIATE_TEST_SUITE_P(Cases, StrategyParity,
                         ::testing::Values(StrategyCase{kZero1, 1}, StrategyCase{kZero1, 2}, StrategyCase{kZero1, 3},
                                           StrategyCase{kZero1, 4}, StrategyCase{kZero1, 2, 0, Opt::kAdamW},
                                           StrategyCase{kZero1, 3, 0, Opt::kFusedAdamW}, StrategyCase{kDDP, 1},
                                           StrategyCase{kDDP, 2}, StrategyCase{kDDP, 3}, StrategyCase{kDDP, 4},
                                           StrategyCase{kDDP, 2, 0, Opt::kAdamW},
                                           StrategyCase{kDDP, 3, 0, Opt::kFusedAdamW}, StrategyCase{kHybrid, 1, 1},
                                           StrategyCase{kHybrid, 2, 1}, StrategyCase{kHybrid, 2, 2},
                                           StrategyCase{kHybrid, 4, 2}, StrategyCase{kHybrid, 4, 1},
                                           StrategyCase{kHybrid, 4, 2, Opt::kAdamW},
                                           StrategyCase{kHybrid, 4, 2, Opt::kFusedAdamW}),
                         strategy_case_name);

// Accumulation over 3 micro-batches, reducing every one or only the last: ZeRO-1 carries the
// reduced rows of its full gradients into the next backward, replicated units add to averaged
// gradients, hybrid reduces twice; all must equal plain LibTorch.
class StrategyAccumulation : public ::testing::TestWithParam<std::tuple<StrategyCase, bool>> {};
TEST_P(StrategyAccumulation, GPT) {
  const auto [c, sync_every] = GetParam();
  run_ranks(c.world_size, [&, c = c, sync_every = sync_every](Rank& r) {
    check_accumulation(r, strategy_options(c), sync_every, [](const auto& model, bool sync, int m) {
      const auto& s = model.comm_stats();
      if (!sync) EXPECT_EQ(s.reduce_scatters + s.all_reduces, 0) << "micro-batch " << m;
      if (sync) EXPECT_GT(s.reduce_scatters + s.all_reduces, 0) << "micro-batch " << m;
    });
  });
}
INSTANTIATE_TEST_SUITE_P(Cases, StrategyAccumulation,
                         ::testing::Combine(::testing::Values(StrategyCase{kZero1, 2}, StrategyCase{kDDP, 3},
                                                              StrategyCase{kHybrid, 4, 2}),
                                            ::testing::Bool()),
                         [](const auto& i) {
                           return strategy_case_name({std::get<0>(i.param), i.index}) +
                                  (std::get<1>(i.param) ? "_ReduceEveryMicroBatch" : "_ReduceLastOnly");
                         });

// The global norm counts a replicated gradient once, not once per rank holding it.
class StrategyClip : public ::testing::TestWithParam<StrategyCase> {};
TEST_P(StrategyClip, UnevenMLP) {
  const StrategyCase c = GetParam();
  run_ranks(c.world_size, [&](Rank& r) {
    auto batch = [](int step) {
      torch::manual_seed(7200 + step);
      auto x = torch::randn({kGlobalBatch, 7});
      return std::make_pair(x, torch::randn({kGlobalBatch, 3}));
    };
    check_parity(
        r, Opt::kSGD, 3, [] { return std::make_shared<UnevenMLPImpl<false>>(); },
        [] { return std::make_shared<UnevenMLPImpl<true>>(); }, batch,
        [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); }, strategy_options(c),
        /*clip=*/0.02);
  });
}
INSTANTIATE_TEST_SUITE_P(Cases, StrategyClip,
                         ::testing::Values(StrategyCase{kZero1, 3}, StrategyCase{kDDP, 2}, StrategyCase{kHybrid, 4, 2}),
                         strategy_case_name);

// Every strategy in one model at 4 ranks (hybrid with S = 2): the root fully sharded, the blocks
// ZeRO-2, ZeRO-1, replicated and hybrid. Parity with AdamW and the all-gathers of each step.
TEST(MixedStrategies, AllFiveInOneGPT) {
  gpt::Config cfg{31, 6, 4, 2, 12, false};
  run_ranks(4, [&](Rank& r) {
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(cfg);
    torch::manual_seed(0);
    auto net = gpt::make_gpt<true>(cfg);
    net->blocks[0]->set_sharding_strategy(ShardingStrategy::kShardGradOp);
    net->blocks[1]->set_sharding_strategy(kZero1);
    net->blocks[2]->set_sharding_strategy(kDDP);
    net->blocks[3]->set_sharding_strategy(kHybrid);
    auto model = fsdp::fully_shard(net, r.pg, test_options().shard_group_size(2).bucket_bytes(512));
    train_and_compare(
        r, Opt::kAdamW, 4, ref, model, [&](int step) { return gpt_batch(cfg, 8100 + step); }, gpt_loss,
        [&](int step) {
          // Root 1, ZeRO-2 block 1, ZeRO-1 block 1 (its shard was updated by the step before, or,
          // at the first step, may have been written since wrapping), replicated 0, hybrid 2
          // (forward and backward).
          EXPECT_EQ(model.comm_stats().all_gathers, 1 + 1 + 1 + 0 + 2) << "step " << step;
        });
  });
}

/// Padded elements per shard rank of every parameter sharded over `S` ranks: ceil(rows/S) * row.
int64_t padded(const torch::Tensor& p, int64_t S) {
  return row_layout(p.sizes(), S).padded_numel();
}

// What each strategy sends in one step, in the ZeRO paper's unit (all-gather outputs +
// reduce-scatter inputs + 2 x all-reduce elements), from the model's shapes: full sharding 3Ψ,
// ZeRO-1 and replicated 2Ψ, hybrid 3Ψ inside groups + 2Ψ/S across (padding included).
TEST(CollectivesPerStep, EveryStrategy) {
  const gpt::Config cfg{29, 6, 2, 2, 10, true};
  run_ranks(4, [&](Rank& r) {
    torch::manual_seed(0);
    auto full = gpt::make_gpt<false>(cfg);
    auto sum_padded = [&](int64_t S, bool blocks) {
      int64_t n = 0;
      for (const auto& kv : full->named_parameters()) {
        if ((kv.key().rfind("h.", 0) == 0) == blocks) n += padded(kv.value(), S);
      }
      return n;
    };
    const int64_t W = r.world_size;
    const int64_t U = cfg.n_layer;
    for (auto strategy : {kZero1, kDDP, kHybrid}) {
      SCOPED_TRACE(to_string(strategy));
      // Replicated: one bucket per parameter (1 byte), so the count of all-reduces is exact.
      auto opts = test_options().strategy(strategy).shard_group_size(2).bucket_bytes(1);
      auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, opts);
      torch::optim::SGD sgd(model.parameters(), 0.1);
      for (int step = 0; step < 3; ++step) {
        model.reset_comm_stats();
        sgd.zero_grad();
        auto [x, y] = gpt_batch(cfg, 7600 + step, /*rows=*/4);
        gpt_loss(model(x), y).backward();
        sgd.step();
        const auto& s = model.comm_stats();
        if (step == 0) continue;  // ZeRO-1 gathers updated parameters from the second step on
        if (strategy == kZero1) {
          EXPECT_EQ(s.all_gathers, 1 + U);
          EXPECT_EQ(s.reduce_scatters, 1 + U);
          EXPECT_EQ(s.all_reduces, 0);
          EXPECT_EQ(s.elements, 2 * W * (sum_padded(W, false) + sum_padded(W, true)));
        } else if (strategy == kDDP) {
          EXPECT_EQ(s.all_gathers, 0);
          EXPECT_EQ(s.reduce_scatters, 0);
          EXPECT_EQ(s.all_reduces, static_cast<int64_t>(full->parameters().size()));
          EXPECT_EQ(s.elements, 2 * (sum_padded(1, false) + sum_padded(1, true)));
        } else {
          const int64_t S = 2;
          EXPECT_EQ(s.all_gathers, 1 + 2 * U);
          EXPECT_EQ(s.reduce_scatters, 1 + U);
          EXPECT_EQ(s.all_reduces, 1 + U);  // across the W/S = 2 groups
          const int64_t root = sum_padded(S, false), blocks = sum_padded(S, true);
          EXPECT_EQ(s.elements, S * (2 * root + 3 * blocks) + 2 * (root + blocks));
        }
      }
    }
  });
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

/// A unit whose first parameters are not used by its forward: with one parameter per bucket, the
/// replicated unit's last bucket waits for gradients that never come.
template <bool kSharded>
struct PartlyUsedImpl : torch::nn::Module {
  PartlyUsedImpl()
      : unused(register_module("unused", torch::nn::Linear(5, 5))),
        used(register_module("used", torch::nn::Linear(5, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(used(x)); }
  torch::nn::Linear unused, used;
};
template <bool kSharded>
struct PartlyUsedNetImpl : torch::nn::Module {
  using Unit = std::conditional_t<kSharded, fsdp::Sharded<PartlyUsedImpl<kSharded>>,
                                  torch::nn::ModuleHolder<PartlyUsedImpl<kSharded>>>;
  PartlyUsedNetImpl() : body(register_module("body", Unit())), head(register_module("head", torch::nn::Linear(4, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(body(x)); }
  Unit body;
  torch::nn::Linear head;
};

class PartlyUsedUnit : public ::testing::TestWithParam<StrategyCase> {};
TEST_P(PartlyUsedUnit, MatchesPlainLibTorch) {
  const StrategyCase c = GetParam();
  run_ranks(c.world_size, [&](Rank& r) {
    auto batch = [](int step) {
      torch::manual_seed(7300 + step);
      auto x = torch::randn({kGlobalBatch, 5});
      return std::make_pair(x, torch::randn({kGlobalBatch, 2}));
    };
    check_parity(
        r, Opt::kSGD, 4, [] { return std::make_shared<PartlyUsedNetImpl<false>>(); },
        [] { return std::make_shared<PartlyUsedNetImpl<true>>(); }, batch,
        [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); },
        strategy_options(c).bucket_bytes(1));
  });
}
INSTANTIATE_TEST_SUITE_P(Cases, PartlyUsedUnit,
                         ::testing::Values(StrategyCase{kDDP, 2}, StrategyCase{kZero1, 2}, StrategyCase{kHybrid, 4, 2}),
                         strategy_case_name);

// ZeRO-1: a forward with gradients enabled between backward and the optimizer step (a logged
// validation loss) gathers the parameters before the step; the next forward must gather again.
TEST(ShardOptimizerState, ForwardBetweenBackwardAndStep) {
  gpt::Config cfg{29, 6, 2, 2, 12, true};
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(cfg);
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options().strategy(kZero1));
    auto batch = [&](int step) { return gpt_batch(cfg, 7400 + step); };
    train_and_compare(r, Opt::kSGD, 3, ref, model, batch, gpt_loss, [&](int step) {
      // With gradients enabled, never backpropagated.
      model(local_rows(batch(step).first, r.rank, r.world_size));
    });
  });
}

// A backward that throws midway, then zero_grad(): the next backward's gradients are exactly one
// backward's, whatever the failed one had in flight or carried over.
class FailedBackward : public ::testing::TestWithParam<StrategyCase> {};
TEST_P(FailedBackward, ThenZeroGradThenStep) {
  const StrategyCase c = GetParam();
  gpt::Config cfg{29, 6, 2, 2, 12, true};
  run_ranks(c.world_size, [&](Rank& r) {
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(cfg);
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, strategy_options(c));
    torch::optim::SGD opt(model.parameters(), 0.1);
    auto [x, y] = gpt_batch(cfg, 7500);
    auto mx = local_rows(x, r.rank, r.world_size), my = local_rows(y, r.rank, r.world_size);
    gpt_loss(model(mx), my).backward();  // gradients left in place (no zero_grad)
    auto logits = model(mx);
    // Fails once the head's gradient exists, with the blocks' reductions still to come.
    logits.register_hook([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("user hook failed"); });
    EXPECT_THROW(gpt_loss(logits, my).backward(), std::exception);
    opt.zero_grad();
    gpt_loss(model(mx), my).backward();
    gpt_loss(ref->forward(x), y).backward();
    expect_shards_match(r, model, *ref, /*grads=*/true);
  });
}
INSTANTIATE_TEST_SUITE_P(Cases, FailedBackward,
                         ::testing::Values(StrategyCase{ShardingStrategy::kFullShard, 2}, StrategyCase{kZero1, 2},
                                           StrategyCase{kDDP, 2}, StrategyCase{kHybrid, 4, 2}),
                         strategy_case_name);

}  // namespace
}  // namespace fsdp::testing
