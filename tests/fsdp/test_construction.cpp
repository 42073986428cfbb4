// Models larger than one rank: units sharded as they are built (fsdp::ShardingScope). The peak
// while building is the shards so far plus one unit, in bytes from shapes; the same seed gives the
// same full weights at 1, 2 and 4 ranks; such a model trains like plain LibTorch.
#include "tests/parity.h"

#include <thread>

namespace fsdp::testing {
namespace {

/// Units of different sizes and no parameters of the root's own, so that every byte of the model
/// is in a unit.
template <bool kSharded>
struct TowerImpl : torch::nn::Module {
  template <typename M>
  using Unit = std::conditional_t<kSharded, fsdp::Sharded<typename M::Impl>, M>;
  static constexpr int64_t kWidth[5] = {24, 40, 56, 40, 8};
  TowerImpl() {
    for (int i = 0; i < 4; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), Unit<torch::nn::Linear>(kWidth[i], kWidth[i + 1])));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l(x));
    return x;
  }
  std::vector<Unit<torch::nn::Linear>> layers;
};

/// Bytes of a Linear(in, out) unit: whole, and one rank's padded shard over `world` ranks.
int64_t unit_bytes(int64_t in, int64_t out) {
  return (out * in + out) * 4;
}
int64_t shard_bytes(int64_t in, int64_t out, int world) {
  const int64_t c = (out + world - 1) / world;  // rows per rank, for the weight and the bias alike
  return (c * in + c) * 4;
}

class Construction : public ::testing::TestWithParam<int> {};

TEST_P(Construction, PeakIsShardsSoFarPlusOneUnit) {
  run_ranks(GetParam(), [](Rank& r) {
    fsdp::memory::enable_cpu_counting();
    const int W = r.world_size;
    const auto& w = TowerImpl<true>::kWidth;
    int64_t shards = 0, largest = 0, whole = 0, bound = 0;
    for (int i = 0; i < 4; ++i) {
      shards += shard_bytes(w[i], w[i + 1], W);
      largest = std::max(largest, unit_bytes(w[i], w[i + 1]));
      whole += unit_bytes(w[i], w[i + 1]);
      // While unit i is built: the shards of units 0..i-1, unit i whole, and its own shard.
      int64_t before = 0;
      for (int j = 0; j < i; ++j) before += shard_bytes(w[j], w[j + 1], W);
      bound = std::max(bound, before + unit_bytes(w[i], w[i + 1]) + shard_bytes(w[i], w[i + 1], W));
    }

    const int64_t base = fsdp::memory::stats().current_bytes;
    fsdp::memory::reset_peak();
    std::shared_ptr<TowerImpl<true>> net;
    {
      ShardingScope scope(r.pg, test_options());
      net = std::make_shared<TowerImpl<true>>();
      const int64_t peak = fsdp::memory::stats().peak_bytes - base;
      std::cout << "rank " << r.rank << " of " << W << ": construction peak " << peak << " bytes; shards so far + one "
                << "unit " << bound << ", whole model " << whole << std::endl;
      // Exactly: each unit exists whole once, right after its constructor, next to its new shard
      // (the cross-rank check of the unit, a few hundred bytes, comes before the shard exists).
      EXPECT_EQ(peak, bound);
      if (W > 1) EXPECT_LT(peak, whole) << "the model never existed whole on this rank";
      // Built: only the shards are left.
      EXPECT_EQ(fsdp::memory::stats().current_bytes - base, shards);
      auto model = fsdp::fully_shard(net, scope);
      EXPECT_EQ(fsdp::memory::stats().current_bytes - base, shards);
      EXPECT_EQ(fsdp::optim::state_bytes(model.parameters()).params, shards);
    }
  });
}
auto world_name = [](const ::testing::TestParamInfo<int>& i) { return "W" + std::to_string(i.param); };
INSTANTIATE_TEST_SUITE_P(WorldSizes, Construction, ::testing::Values(1, 2, 4), world_name);

// Every rank draws every unit in full from the same random stream, so the seed alone decides the
// weights: without the broadcast (sync_module_states off), each rank's shards at 1, 2 and 4 ranks
// are the rows of the model built unsharded from that seed.
class SameWeightsAtAnyRankCount : public ::testing::TestWithParam<int> {};
TEST_P(SameWeightsAtAnyRankCount, GPT) {
  gpt::Config cfg{37, 8, 3, 2, 18, true};
  run_ranks(GetParam(), [&](Rank& r) {
    torch::manual_seed(7);
    auto ref = gpt::make_gpt<false>(cfg);
    torch::manual_seed(7);
    ShardingScope scope(r.pg, test_options().sync_module_states(false));
    auto net = gpt::make_gpt<true>(cfg);
    for (auto& block : net->blocks) ASSERT_TRUE(block->is_sharded()) << "sharded when built";
    auto model = fsdp::fully_shard(net, scope);
    expect_shards_match(r, model, *ref);
  });
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, SameWeightsAtAnyRankCount, ::testing::Values(1, 2, 4), world_name);

// A model built inside a scope trains like plain LibTorch (full sharding at 3 ranks, hybrid at 4).
struct BuiltCase {
  int world_size;
  ShardingStrategy strategy;
};
class BuiltInScopeParity : public ::testing::TestWithParam<BuiltCase> {};
TEST_P(BuiltInScopeParity, GPT) {
  const BuiltCase c = GetParam();
  gpt::Config cfg{37, 8, 3, 2, 18, true};
  run_ranks(c.world_size, [&](Rank& r) {
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(cfg);
    torch::manual_seed(0);
    ShardingScope scope(r.pg, test_options().strategy(c.strategy).shard_group_size(2));
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), scope);
    EXPECT_EQ(model.units().size(), 1u + cfg.n_layer);
    EXPECT_EQ(model.units()[1].name, "h.0");
    train_and_compare(
        r, Opt::kSGD, 3, ref, model, [&](int step) { return gpt_batch(cfg, 9100 + step); }, gpt_loss, [](int) {});
  });
}
INSTANTIATE_TEST_SUITE_P(Cases, BuiltInScopeParity,
                         ::testing::Values(BuiltCase{3, ShardingStrategy::kFullShard},
                                           BuiltCase{4, ShardingStrategy::kHybridShard}),
                         [](const auto& i) { return "W" + std::to_string(i.param.world_size); });

/// A unit holding a unit: both are sharded while built (the inner one first).
template <bool kSharded>
struct InnerImpl : torch::nn::Module {
  InnerImpl() : fc(register_module("fc", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
template <bool kSharded>
struct OuterImpl : torch::nn::Module {
  using Inner =
      std::conditional_t<kSharded, fsdp::Sharded<InnerImpl<kSharded>>, torch::nn::ModuleHolder<InnerImpl<kSharded>>>;
  OuterImpl() : in(register_module("in", torch::nn::Linear(4, 6))), inner(register_module("inner", Inner())) {}
  torch::Tensor forward(const torch::Tensor& x) { return inner(in(x)); }
  torch::nn::Linear in;
  Inner inner;
};
template <bool kSharded>
struct NestedNetImpl : torch::nn::Module {
  using Outer =
      std::conditional_t<kSharded, fsdp::Sharded<OuterImpl<kSharded>>, torch::nn::ModuleHolder<OuterImpl<kSharded>>>;
  NestedNetImpl() : outer(register_module("outer", Outer())), head(register_module("head", torch::nn::Linear(6, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(outer(x)); }
  Outer outer;
  torch::nn::Linear head;
};

TEST(Construction, NestedUnitsBuiltInAScope) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(3);
    auto ref = std::make_shared<NestedNetImpl<false>>();
    torch::manual_seed(3);
    ShardingScope scope(r.pg, test_options());
    auto model = fsdp::fully_shard(std::make_shared<NestedNetImpl<true>>(), scope);
    std::vector<std::string> names;
    for (const auto& u : model.units()) names.push_back(u.name);
    EXPECT_EQ(names, (std::vector<std::string>{"", "outer", "outer.inner"}));
    auto batch = [](int step) {
      torch::manual_seed(60 + step);
      auto x = torch::randn({kGlobalBatch, 4});
      return std::make_pair(x, x);  // the loss needs no target
    };
    auto loss = [](const torch::Tensor& out, const torch::Tensor&) { return out.square().mean(); };
    train_and_compare(r, Opt::kSGD, 3, ref, model, batch, loss, [](int) {});  // ends with expect_shards_match
  });
}

// Scopes closed out of order (fully_shard closes its scope) never leave a closed one current.
TEST(Construction, ScopesClosedOutOfOrder) {
  run_ranks(1, [](Rank& r) {
    auto a = std::make_unique<ShardingScope>(r.pg, test_options());
    auto b = std::make_unique<ShardingScope>(r.pg, test_options());
    EXPECT_EQ(ShardingScope::current(), b.get());
    a->close();
    EXPECT_EQ(ShardingScope::current(), b.get());
    b->close();
    EXPECT_EQ(ShardingScope::current(), nullptr);
    auto plain = fsdp::Sharded<torch::nn::LinearImpl>(3, 4);
    EXPECT_FALSE(plain->is_sharded()) << "built after every scope closed";
  });
}

TEST(Construction, Misuse) {
  run_ranks(2, [](Rank& r) {
    std::shared_ptr<TowerImpl<true>> net;
    {
      ShardingScope scope(r.pg, test_options());
      net = std::make_shared<TowerImpl<true>>();
      // Sharded already: a strategy can no longer be chosen per unit.
      EXPECT_NE(error_of([&] {
                  net->layers[0]->set_sharding_strategy(ShardingStrategy::kNoShard);
                }).find("give the strategy to the scope's options"),
                std::string::npos);
    }
    // Built in a scope, wrapped without it.
    EXPECT_NE(error_of([&] { fsdp::fully_shard(net, r.pg, test_options()); }).find("fully_shard(model, scope)"),
              std::string::npos);
    // Outside any scope, units are built whole.
    auto plain = fsdp::Sharded<torch::nn::LinearImpl>(3, 4);
    EXPECT_FALSE(plain->is_sharded());
    EXPECT_EQ(plain->weight.numel(), 12);
  });
}

}  // namespace
}  // namespace fsdp::testing
