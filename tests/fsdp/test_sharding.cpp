// Sharding really happens: rows per rank per parameter, unsharded storage at 0 bytes between
// units, and the number and size of the collectives per step. Expected values are computed here
// from shapes, not read back from the library's bookkeeping.
#include "fsdp/internal/access.h"
#include "tests/parity.h"

#include "fsdp/internal/unit.h"  // the unsharded storage, to see it freed

#include <torch/nn/functional/loss.h>

namespace fsdp::testing {
namespace {

int64_t expected_rows(int64_t rows, int rank, int world) {
  return row_layout({rows}, world).local_rows(rank);
}

TEST(Sharding, RowsPerRankIncludingEmptyShards) {
  run_ranks(4, [](Rank& r) {
    torch::manual_seed(0);
    auto full = std::make_shared<UnevenMLPImpl<false>>();
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& kv : full->named_parameters()) shapes[kv.key()] = kv.value().sizes().vec();

    auto model = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
    int64_t flat_bytes_expected = 0;
    for (const auto& kv : model.named_parameters()) {
      const auto& shape = shapes.at(kv.key());
      const auto& sharded = kv.value();
      if (shape.empty()) {  // the scalar: rank 0 owns it, the others hold 0 elements
        EXPECT_EQ(sharded.numel(), r.rank == 0 ? 1 : 0) << kv.key();
        flat_bytes_expected += 4;
        continue;
      }
      std::vector<int64_t> want = shape;
      want[0] = expected_rows(shape[0], r.rank, r.world_size);
      EXPECT_EQ(sharded.sizes().vec(), want) << kv.key() << " on rank " << r.rank;
      const int64_t c = (shape[0] + r.world_size - 1) / r.world_size;
      flat_bytes_expected += c * (shape.size() > 1 ? shape[1] : 1) * 4;
      EXPECT_TRUE(sharded.is_leaf());
      EXPECT_TRUE(sharded.requires_grad());
    }
    // fc2.weight has 5 rows: rank 3 owns none (c = 2: 2, 2, 1, 0).
    EXPECT_EQ(model.named_parameters()["fc2.weight"].size(0), expected_rows(5, r.rank, 4));
    // Every unit's shards share one flat buffer, padded per parameter to c rows.
    EXPECT_EQ(fsdp::optim::state_bytes(model.parameters()).params, flat_bytes_expected);
    // Between steps the module's own parameters are those shards.
    const auto named = model->named_parameters();
    for (const auto& kv : model.named_parameters()) {
      EXPECT_TRUE(named[kv.key()].is_same(kv.value())) << kv.key();
    }
  });
}

/// A Linear that calls `probe` at the start of its forward (inside the unit's gathered window).
struct ProbeImpl : torch::nn::Module {
  ProbeImpl(int64_t in, int64_t out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (probe) probe();
    return torch::relu(fc(x));
  }
  torch::nn::Linear fc;
  std::function<void()> probe;
};

struct ChainImpl : torch::nn::Module {
  ChainImpl() : head(register_module("head", torch::nn::Linear(6, 2))) {
    for (int i = 0; i < 3; ++i)
      units.push_back(register_module("u" + std::to_string(i), fsdp::Sharded<ProbeImpl>(i == 0 ? 4 : 6, 6)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& u : units) x = u(x);
    return head(x);
  }
  std::vector<fsdp::Sharded<ProbeImpl>> units;
  torch::nn::Linear head;
};

TEST(Sharding, UnshardedStorageIsFreedBetweenUnits) {
  run_ranks(2, [](Rank& r) {
    auto chain = std::make_shared<ChainImpl>();
    auto model = fsdp::fully_shard(chain, r.pg, test_options());
    std::vector<std::vector<std::pair<int, size_t>>> seen(3);  // per unit: (other unit, bytes)
    for (int i = 0; i < 3; ++i) {
      chain->units[i]->probe = [&, i] {
        for (int j = 0; j < 3; ++j) {
          seen[i].emplace_back(j,
                               fsdp::detail::Access::unit(*chain->units[j])->slots()[0].unsharded.storage().nbytes());
        }
      };
    }
    auto x = torch::randn({4, 4});
    auto loss = model(x).square().mean();
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(seen[i].size(), 3u);
      for (auto [j, bytes] : seen[i]) {
        if (j == i) {
          // Its own parameters are gathered: the unit's whole unsharded buffer (both parameters).
          const int64_t in = i == 0 ? 4 : 6;
          const int64_t c_w = 3, c_b = 3;  // 6 rows over 2 ranks
          EXPECT_EQ(bytes, static_cast<size_t>(2 * (c_w * in + c_b) * 4)) << "unit " << i;
        } else {
          EXPECT_EQ(bytes, 0u) << "unit " << j << " seen from unit " << i;
        }
      }
    }
    // After forward only the root keeps its gathered memory (for backward), though its parameters
    // are the shards again; after backward nothing is gathered, and every parameter is its shard,
    // with a sharded gradient.
    auto unsharded_bytes = [](auto& u) {
      return fsdp::detail::Access::unit(*u)->slots()[0].unsharded.storage().nbytes();
    };
    for (auto& u : chain->units) EXPECT_EQ(unsharded_bytes(u), 0u);
    EXPECT_EQ(chain->head->weight.size(0), 1);
    loss.backward();
    for (auto& u : chain->units) EXPECT_EQ(unsharded_bytes(u), 0u);
    EXPECT_EQ(chain->head->weight.size(0), 1);  // 2 rows over 2 ranks
    for (const auto& p : chain->parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().sizes(), p.sizes()) << "the sharded gradient";
    }
  });
}

class CollectivesPerStep : public ::testing::TestWithParam<ShardingStrategy> {};
TEST_P(CollectivesPerStep, GPT) {
  const ShardingStrategy strategy = GetParam();
  const bool full_shard = strategy == ShardingStrategy::kFullShard;
  run_ranks(3, [&](Rank& r) {
    gpt::Config cfg;
    cfg.vocab_size = 29;
    cfg.block_size = 8;
    cfg.n_layer = 3;
    cfg.n_head = 2;
    cfg.n_embd = 10;
    torch::manual_seed(0);
    auto full = gpt::make_gpt<false>(cfg);
    // Padded elements per rank of each unit, from shapes: sum over parameters of ceil(rows/W) * row.
    const int W = r.world_size;
    int64_t root = 0, blocks = 0;
    for (const auto& kv : full->named_parameters()) {
      (kv.key().rfind("h.", 0) == 0 ? blocks : root) += row_layout(kv.value().sizes(), W).padded_numel();
    }
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options().strategy(strategy));
    for (int step = 0; step < 2; ++step) {
      model.reset_comm_stats();
      auto tok = torch::randint(cfg.vocab_size, {4, cfg.block_size + 1}, torch::kLong);
      auto logits = model(tok.narrow(1, 0, cfg.block_size));
      auto loss =
          torch::nn::functional::cross_entropy(logits.flatten(0, 1), tok.narrow(1, 1, cfg.block_size).flatten());
      loss.backward();
      const auto& s = model.comm_stats();
      // Root: gathered once (kept from forward into backward). Each block: forward + backward
      // with full sharding, forward only with SHARD_GRAD_OP (kept gathered into backward).
      EXPECT_EQ(s.all_gathers, 1 + (full_shard ? 2 : 1) * cfg.n_layer);
      EXPECT_EQ(s.reduce_scatters, 1 + cfg.n_layer);
      EXPECT_EQ(s.all_reduces, 0);
      // Volume: all-gather outputs + reduce-scatter inputs = 3Ψ (ZeRO-3) or 2Ψ (ZeRO-2) padded
      // per step; the root is gathered once either way.
      EXPECT_EQ(s.elements, W * (2 * root + (full_shard ? 3 : 2) * blocks));
    }
  });
}
INSTANTIATE_TEST_SUITE_P(Strategies, CollectivesPerStep,
                         ::testing::Values(ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp),
                         [](const auto& i) {
                           return i.param == ShardingStrategy::kFullShard ? "FullShard" : "ShardGradOp";
                         });

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

/// A unit with a frozen base weight and a trainable low-rank update (LoRA-style), plus a
/// parameter with no elements: the frozen weight is still read by backward after the trainable
/// ones have their gradients, and the empty one takes part in no collective.
template <bool kSharded>
struct LowRankImpl : torch::nn::Module {
  LowRankImpl() {
    base = register_parameter("base", torch::randn({6, 5}), /*requires_grad=*/false);
    a = register_parameter("a", torch::randn({2, 5}) * 0.1);
    b = register_parameter("b", torch::randn({6, 2}) * 0.1);
    empty = register_parameter("empty", torch::empty({0, 3}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::tanh(x.matmul(base.t()) + x.matmul(a.t()).matmul(b.t())) + empty.sum();
  }
  torch::Tensor base, a, b, empty;
};

template <bool kSharded>
struct LowRankNetImpl : torch::nn::Module {
  using Unit = std::conditional_t<kSharded, fsdp::Sharded<LowRankImpl<kSharded>>,
                                  torch::nn::ModuleHolder<LowRankImpl<kSharded>>>;
  LowRankNetImpl() : in(register_module("in", torch::nn::Linear(4, 5))), lr(register_module("lr", Unit())) {}
  torch::Tensor forward(const torch::Tensor& x) { return lr(in(x)); }
  torch::nn::Linear in;
  Unit lr;
};

TEST(Sharding, FrozenAndEmptyParametersInAUnit) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(3);
    auto ref = std::make_shared<LowRankNetImpl<false>>();
    torch::manual_seed(3);
    auto model = fsdp::fully_shard(std::make_shared<LowRankNetImpl<true>>(), r.pg, test_options());
    std::vector<torch::Tensor> ref_trainable;
    for (const auto& p : ref->parameters()) {
      if (p.requires_grad()) ref_trainable.push_back(p);
    }
    std::vector<torch::Tensor> trainable;
    for (const auto& p : model.parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    torch::optim::SGD ref_opt(ref_trainable, 0.1), opt(trainable, 0.1);
    compare_steps(
        r, ref, model, ref_opt, opt, 3,
        [&](auto forward, auto rows, int step, bool /*wrapped*/) {
          torch::manual_seed(50 + step);
          return forward(rows(torch::randn({kGlobalBatch, 4}))).square().mean();
        },
        [](int) {});
    expect_shards_match(r, model, *ref);
    EXPECT_FALSE(model.named_parameters()["lr.base"].grad().defined());
    expect_between_steps(r, model, *ref);  // resharded at the end of backward
  });
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

// A backward that throws midway (here: a user hook) never reaches its end-of-backward callback;
// the next step must still produce every sharded gradient, equal to plain LibTorch's, and free
// everything at its end (the LowRank unit, with a frozen weight, is freed only by that callback).
TEST(Sharding, StepAfterAFailedBackward) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(5);
    auto ref = std::make_shared<LowRankNetImpl<false>>();
    torch::manual_seed(5);
    auto model = fsdp::fully_shard(std::make_shared<LowRankNetImpl<true>>(), r.pg, test_options());
    auto x = torch::randn({kGlobalBatch, 4});
    auto mine = local_rows(x, r.rank, r.world_size);

    auto out = model(mine);
    out.register_hook([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("user hook failed"); });
    EXPECT_THROW(out.sum().backward(), std::exception);

    for (const auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
    model(mine).square().mean().backward();
    ref->forward(x).square().mean().backward();
    auto want = ref->named_parameters();
    for (const auto& kv : model.named_parameters()) {
      if (!kv.value().requires_grad()) continue;
      ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
      EXPECT_TRUE(close(kv.value().grad(), owned_rows(want[kv.key()].grad(), r.rank, r.world_size))) << kv.key();
    }
    expect_between_steps(r, model, *ref);
  });
}

}  // namespace
}  // namespace fsdp::testing
