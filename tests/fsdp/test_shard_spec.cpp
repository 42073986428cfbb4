// The shard contract (fsdp/shard_spec.h) against what it describes: at 1-4 ranks and every
// strategy, the ranks' row ranges cover each parameter exactly once per replica, the local tensors
// put together by hand are the full weights, and the flat buffers hold what the specs say.
#include "tests/parity.h"

#include <torch/serialize.h>

namespace fsdp::testing {
namespace {

struct SpecCase {
  ShardingStrategy strategy;
  int world_size;
  int group = 0;       // kHybridShard: S
  bool mixed = false;  // fc1 replicated, whatever the model's strategy
};

std::string spec_case_name(const ::testing::TestParamInfo<SpecCase>& i) {
  return strategy_case_label(i.param.strategy, i.param.world_size, i.param.group) + (i.param.mixed ? "_Mixed" : "");
}

class ShardContract : public ::testing::TestWithParam<SpecCase> {};

TEST_P(ShardContract, DescribesWhatEachRankHolds) {
  const SpecCase c = GetParam();
  run_ranks(c.world_size, [&](Rank& r) {
    const auto options = test_options(c.strategy, c.group);
    torch::manual_seed(0);
    auto ref = std::make_shared<UnevenMLPImpl<false>>();
    torch::manual_seed(0);
    auto net = std::make_shared<UnevenMLPImpl<true>>();
    if (c.mixed) net->fc1->set_sharding_strategy(ShardingStrategy::kNoShard);
    auto model = fsdp::fully_shard(net, r.pg, options);
    // One step, so that weights and gradients are not the initial ones.
    torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
    torch::manual_seed(9);
    auto x = torch::randn({kGlobalBatch, 7});
    ref->forward(x).square().mean().backward();
    model(local_rows(x, r.rank, r.world_size)).square().mean().backward();
    ref_opt.step();
    opt.step();
    ref->forward(x).square().mean().backward();
    model(local_rows(x, r.rank, r.world_size)).square().mean().backward();

    const auto specs = model.shard_specs();
    const auto units = model.units();
    const auto want = ref->named_parameters();
    const auto named = model->named_parameters();
    ASSERT_EQ(specs.size(), want.size());  // no tied weights here: every parameter once
    for (const auto& p : specs) {
      SCOPED_TRACE(p.name + " on rank " + std::to_string(r.rank));
      const torch::Tensor& full = want[p.name];
      EXPECT_EQ(p.global_shape, full.sizes().vec());
      EXPECT_EQ(p.dtype, full.scalar_type());
      EXPECT_EQ(p.shard_world_size * p.replicas, r.world_size);
      EXPECT_EQ(p.shard_rank, r.rank % p.shard_world_size);
      EXPECT_EQ(p.replica_rank, r.rank / p.shard_world_size);
      EXPECT_EQ(p.layout.shards, p.shard_world_size);
      EXPECT_TRUE(p.local.is_same(named[p.name])) << "the module's own parameter";
      EXPECT_EQ(p.local.sizes().vec(), local_shape(p.global_shape, p.layout, p.shard_rank));
      EXPECT_EQ(p.row_end - p.row_begin, p.layout.local_rows(p.shard_rank));
      EXPECT_EQ(units[p.unit].strategy, p.strategy);

      // Coverage: every row held once per replica group, so replicas times over all ranks.
      const int64_t rows = p.layout.rows;
      auto count = torch::zeros({rows});
      count.narrow(0, p.row_begin, p.row_end - p.row_begin).add_(1);
      all_reduce_sum(r, count);
      EXPECT_TRUE(torch::equal(count, torch::full({rows}, static_cast<float>(p.replicas))));

      // Gathered by hand (one replica group contributes): the full weights and gradients.
      for (bool grad : {false, true}) {
        const torch::Tensor local = grad ? p.local.grad() : p.local.detach();
        ASSERT_TRUE(local.defined());
        auto rebuilt = torch::zeros({rows, p.layout.row_numel});
        if (p.replica_rank == 0) {
          rebuilt.narrow(0, p.row_begin, p.row_end - p.row_begin).copy_(local.reshape({-1, p.layout.row_numel}));
        }
        all_reduce_sum(r, rebuilt);
        const torch::Tensor& expect = grad ? full.grad() : full.detach();
        EXPECT_TRUE(close(rebuilt.view(full.sizes()), expect)) << (grad ? "gradient" : "weight");
      }
    }
    // Each unit's flat buffers hold its parameters' rows at their offsets.
    for (const auto& u : units) {
      SCOPED_TRACE("unit '" + u.name + "'");
      EXPECT_FALSE(u.unsharded);
      if (u.shard_numel == 0) continue;
      if (u.strategy == ShardingStrategy::kShardOptimizerState) {  // rows of the full buffers: no flat shard
        EXPECT_FALSE(u.flat_shard.defined());
        EXPECT_FALSE(u.flat_grad.defined());
        continue;
      }
      ASSERT_TRUE(u.flat_shard.defined());
      EXPECT_EQ(u.flat_shard.numel(), u.shard_numel);
      if (r.world_size == 1) {
        // Alone, nothing is reduced: each gradient stays the tensor autograd produced, not a view of
        // one flat buffer (docs/design.md, "Buffers reused, and one rank").
        EXPECT_FALSE(u.flat_grad.defined());
        for (size_t i : u.specs) {
          const ShardSpec& p = specs[i];
          EXPECT_TRUE(
              torch::equal(u.flat_shard.narrow(0, p.flat_offset, p.local.numel()), p.local.detach().reshape({-1})));
          EXPECT_TRUE(p.local.is_alias_of(u.flat_shard));
          if (p.local.grad().defined()) EXPECT_FALSE(p.local.grad().is_alias_of(u.flat_shard));
        }
        continue;
      }
      ASSERT_TRUE(u.flat_grad.defined()) << "every gradient landed in the flat gradient buffer";
      EXPECT_EQ(u.flat_grad.numel(), u.shard_numel);
      for (size_t i : u.specs) {
        const ShardSpec& p = specs[i];
        const int64_t n = p.local.numel();
        EXPECT_TRUE(torch::equal(u.flat_grad.narrow(0, p.flat_offset, n), p.local.grad().reshape({-1})));
        EXPECT_TRUE(torch::equal(u.flat_shard.narrow(0, p.flat_offset, n), p.local.detach().reshape({-1})));
        EXPECT_TRUE(p.local.is_alias_of(u.flat_shard));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ShardContract,
    ::testing::Values(SpecCase{ShardingStrategy::kFullShard, 1}, SpecCase{ShardingStrategy::kFullShard, 2},
                      SpecCase{ShardingStrategy::kFullShard, 3}, SpecCase{ShardingStrategy::kFullShard, 4},
                      SpecCase{ShardingStrategy::kShardGradOp, 3}, SpecCase{ShardingStrategy::kShardOptimizerState, 2},
                      SpecCase{ShardingStrategy::kShardOptimizerState, 4}, SpecCase{ShardingStrategy::kNoShard, 3},
                      SpecCase{ShardingStrategy::kHybridShard, 2, 1}, SpecCase{ShardingStrategy::kHybridShard, 4, 2},
                      SpecCase{ShardingStrategy::kFullShard, 4, 0, true}),
    spec_case_name);

// FusedAdamW's state is AdamW's: per-parameter moments in the contract's layout (views of its flat
// buffers), saved and loaded with torch::save / torch::load; a restored optimizer continues exactly.
TEST(FusedAdamWState, SavedAndLoadedLikeAdamW) {
  run_ranks(2, [](Rank& r) {
    const gpt::Config cfg{23, 6, 2, 2, 12, false};
    auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    torch::manual_seed(0);
    auto a = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options());
    fsdp::optim::FusedAdamW opt_a(a, adamw);
    auto train = [&](auto& model, torch::optim::Optimizer& opt, int seed) {
      auto [x, y] = gpt_batch(cfg, seed);
      opt.zero_grad();
      gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size)).backward();
      opt.step();
    };
    train(a, opt_a, 10);
    train(a, opt_a, 11);
    // The moments are AdamW's state, one entry per parameter, in the parameter's (local) shape.
    for (const auto& p : a.shard_specs()) {
      auto it = opt_a.state().find(p.local.unsafeGetTensorImpl());
      ASSERT_NE(it, opt_a.state().end()) << p.name;
      auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
      EXPECT_EQ(st.step(), 2) << p.name;
      EXPECT_EQ(st.exp_avg().sizes(), p.local.sizes()) << p.name;
    }
    // Its state in bytes, as fsdp::optim::state_bytes counts AdamW's: two flat fp32 moments per unit,
    // padding included.
    int64_t moments = 0;
    for (const auto& u : a.units()) moments += 2 * u.shard_numel * 4;
    EXPECT_EQ(fsdp::optim::state_bytes(a.parameters(), &opt_a).optimizer, moments);
    const std::string model_file = shared_dir() + "/model" + std::to_string(r.rank) + ".pt";
    const std::string opt_file = shared_dir() + "/opt" + std::to_string(r.rank) + ".pt";
    torch::save(a.module(), model_file);
    torch::save(opt_a, opt_file);

    // Another model and optimizer, restored from the files, take the same next steps.
    torch::manual_seed(1);
    auto b = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options());
    fsdp::optim::FusedAdamW opt_b(b, adamw);
    auto mb = b.module();
    torch::load(mb, model_file);
    torch::load(opt_b, opt_file);
    for (int s = 12; s < 14; ++s) {
      train(a, opt_a, s);
      train(b, opt_b, s);
    }
    const auto pa = a.named_parameters(), pb = b.named_parameters();
    for (const auto& kv : pa) EXPECT_TRUE(torch::equal(kv.value(), pb[kv.key()])) << kv.key();
    EXPECT_EQ(opt_b.tensors_last_step(), 3u) << "flat path after the load";
  });
}

}  // namespace
}  // namespace fsdp::testing
