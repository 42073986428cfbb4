// CPU offload (fsdp/options.h: CPUOffloadPolicy) through its CPU test seam: with
// $FSDP_TEST_OFFLOAD_ON_CPU=1 a CPU model takes the policy and keeps its shards and sharded
// gradients in separate host buffers, as a CUDA model does in pinned memory, so every copy in (host
// shard to the gathered parameters), every copy out (reduced gradients to a new host buffer) and
// every pointer switch of the CUDA path runs here. The copies are exact, so an offloaded model
// trains to the bit as the same model without offload, which the parity tests compare with plain
// LibTorch. Tests/test_cuda.cpp runs it on a GPU where there is one.
#include "tests/mixed_reference.h"

#include "optim/clip_grad_norm.h"
#include "optim/fused_adamw.h"

#include <tuple>

namespace fsdp::testing {
namespace {

const gpt::Config kCfg{37, 8, 2, 2, 18, false};

RunOptions seam() {
  RunOptions o;
  o.env["FSDP_TEST_OFFLOAD_ON_CPU"] = "1";
  return o;
}

struct Case {
  int world_size;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int group = 0;
  bool bf16 = false;
};
std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return strategy_case_label(i.param.strategy, i.param.world_size, i.param.group) + (i.param.bf16 ? "_Bf16" : "");
}

// The GPT with AdamW, 3 steps of 2 micro-batches (the second adds to the host gradients the first
// left) and clipping, offloaded and not, side by side: losses, gradients and shards equal to the
// bit; the memory held after forward from shapes (the host shards, plus a separate gathered copy
// for the units kept for backward even over one rank); each unit's gradients in one host buffer.
class OffloadParity : public ::testing::TestWithParam<Case> {};
TEST_P(OffloadParity, TrainsToTheBitAsWithoutOffload) {
  const Case c = GetParam();
  run_ranks(
      c.world_size,
      [&](Rank& r) {
        const int W = r.world_size;
        auto options = test_options(c.strategy, c.group);
        if (c.bf16) options.mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
        torch::manual_seed(0);
        auto plain = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, options);
        torch::manual_seed(0);
        auto off = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, options.offload_policy(CPUOffloadPolicy()));
        torch::optim::AdamW plain_opt(plain.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        torch::optim::AdamW off_opt(off.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        const int64_t elem = c.bf16 ? 2 : 4;

        for (int step = 0; step < 3; ++step) {
          plain_opt.zero_grad();
          off_opt.zero_grad();
          for (int m = 0; m < 2; ++m) {
            torch::Tensor x, y;
            std::tie(x, y) = gpt_batch(kCfg, 7000 + 2 * step + m);
            x = local_rows(x, r.rank, W);
            y = local_rows(y, r.rank, W);
            auto plain_loss = gpt_loss(plain(x), y);
            auto off_logits = off(x);
            if (step == 0 && m == 0) {
              int64_t expected = 0;
              for (const auto& u : off.units()) {
                expected += 4 * u.shard_numel;  // the host shards (fp32 master weights)
                const bool kept = u.name.empty() || !traits(u.strategy).reshard_after_forward;
                if (kept) expected += elem * u.shard_world_size * u.shard_numel;  // gathered apart, even at S = 1
              }
              EXPECT_EQ(off.held_state_bytes(), expected) << "bytes held after forward";
            }
            auto off_loss = gpt_loss(off_logits, y);
            EXPECT_TRUE(torch::equal(off_loss.detach(), plain_loss.detach())) << "loss at step " << step;
            plain_loss.backward();
            off_loss.backward();
          }
          // The reduced gradients are copied out into one host buffer per unit, which the
          // parameters' gradients alias, even over one rank (where without offload each parameter
          // keeps the gradient autograd made).
          std::map<std::string, size_t> unit_of;
          for (const auto& spec : off.shard_specs()) unit_of[spec.name] = spec.unit;
          std::map<size_t, const c10::StorageImpl*> unit_grads;
          const auto plain_params = plain.named_parameters();
          for (const auto& kv : off.named_parameters()) {
            const auto& g = kv.value().grad();
            ASSERT_TRUE(g.defined()) << kv.key();
            EXPECT_TRUE(torch::equal(g, plain_params[kv.key()].grad())) << "gradient of " << kv.key();
            EXPECT_EQ(g.device(), kv.value().device());
            auto [it, first] = unit_grads.emplace(unit_of.at(kv.key()), g.storage().unsafeGetStorageImpl());
            if (!first) EXPECT_EQ(it->second, g.storage().unsafeGetStorageImpl()) << kv.key() << "'s gradient";
            EXPECT_NE(g.storage().unsafeGetStorageImpl(), kv.value().storage().unsafeGetStorageImpl());
          }
          const double plain_norm = fsdp::optim::clip_grad_norm(plain, 0.5);
          EXPECT_EQ(fsdp::optim::clip_grad_norm(off, 0.5), plain_norm) << "clipping at step " << step;
          plain_opt.step();
          off_opt.step();
        }
        const auto plain_params = plain.named_parameters();
        for (const auto& kv : off.named_parameters()) {
          EXPECT_TRUE(torch::equal(kv.value(), plain_params[kv.key()])) << "shard of " << kv.key();
        }
        // The full weights, gathered from the host shards.
        const auto full = off.full_state_dict();
        const auto want = plain.full_state_dict();
        for (const auto& kv : want) EXPECT_TRUE(torch::equal(full[kv.key()], kv.value())) << kv.key();
      },
      seam());
}
INSTANTIATE_TEST_SUITE_P(Cases, OffloadParity,
                         ::testing::Values(Case{1}, Case{2}, Case{2, ShardingStrategy::kShardGradOp},
                                           Case{4, ShardingStrategy::kHybridShard, 2}, Case{1, {}, 0, true},
                                           Case{2, {}, 0, true}),
                         case_name);

// Gradient accumulation without sync, FusedAdamW over the host shards, a forward without gradients.
TEST(Offload, AccumulationWithoutSyncAndInference) {
  run_ranks(
      2,
      [](Rank& r) {
        torch::manual_seed(0);
        auto plain = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
        torch::manual_seed(0);
        auto off = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg,
                                     test_options().offload_policy(CPUOffloadPolicy().pin_memory(false)));
        fsdp::optim::FusedAdamW plain_opt(plain);
        fsdp::optim::FusedAdamW off_opt(off);  // the CPU step of offload: one fused pass per unit
        for (int step = 0; step < 2; ++step) {
          for (int m = 0; m < 3; ++m) {
            plain.set_requires_gradient_sync(m == 2);
            off.set_requires_gradient_sync(m == 2);
            auto [x, y] = gpt_batch(kCfg, 8000 + 3 * step + m);
            gpt_loss(plain(local_rows(x, r.rank, 2)), local_rows(y, r.rank, 2)).backward();
            gpt_loss(off(local_rows(x, r.rank, 2)), local_rows(y, r.rank, 2)).backward();
          }
          plain_opt.step();
          off_opt.step();
          EXPECT_EQ(off_opt.tensors_last_step(), off.units().size()) << "the gradients of each unit in one buffer";
          plain_opt.zero_grad();
          off_opt.zero_grad();
        }
        torch::NoGradGuard no_grad;
        auto [x, y] = gpt_batch(kCfg, 9000);
        EXPECT_TRUE(torch::equal(off(x), plain(x))) << "inference after training";
      },
      seam());
}

// Ranks that differ in offload would gather full weights over different backends: refused when
// wrapping, naming the option.
TEST(Offload, RanksThatDifferInOffloadAreRefused) {
  run_ranks(
      2,
      [](Rank& r) {
        auto options = test_options();
        if (r.rank == 0) options.offload_policy(CPUOffloadPolicy());
        expect_error([&] { fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, options); },
                     "rank 0 has option 'offload_policy' that rank 1 does not have");
      },
      seam());
}

TEST(Offload, Refusals) {
  run_ranks(
      1,
      [](Rank& r) {
        for (auto s : {ShardingStrategy::kNoShard, ShardingStrategy::kShardOptimizerState}) {
          expect_error(
              [&] {
                fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg,
                                  test_options().strategy(s).offload_policy(CPUOffloadPolicy()));
              },
              "with FullyShardOptions::offload_policy; offload keeps the shards in host memory and gathers them to "
              "the device for each use, which needs a strategy that gathers the parameters from their shards");
        }
      },
      seam());
}

}  // namespace
}  // namespace fsdp::testing
