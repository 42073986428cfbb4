// fsdp::optim::FusedAdamW against torch::optim::AdamW on the same shards: two copies of one wrapped
// GPT, built from one seed and fed the same batches, so that their gradients are the same bits; one
// steps with torch::optim::AdamW (a loop per parameter), the other with FusedAdamW (one fused pass
// per unit). After every step each shard agrees to 1e-6 relative (the moments too, at the first
// step; 1e-5 after, as the gradients then come from parameters 1e-7 apart), over full
// sharding, ZeRO-2 with a frozen parameter (its unit updated per parameter), ZeRO-1, replication
// and bf16 compute with fp32 master weights, with a learning-rate change halfway. On the CPU at 2
// ranks; on a GPU (GlooCuda: both ranks on cuda:0) in scripts/gpu-check.sh.
#include "tests/parity.h"

#include <torch/cuda.h>

namespace fsdp::testing {
namespace {

struct FusedCase {
  ShardingStrategy strategy;
  bool bf16 = false;
  bool frozen = false;  // block 0's attention weight takes no gradient
};

const gpt::Config kCfg{37, 8, 2, 2, 18, /*bias=*/false};

auto build(Rank& r, const FusedCase& c, const torch::Device& dev) {
  torch::manual_seed(7);
  auto net = gpt::make_gpt<true>(kCfg);
  if (c.frozen) net->blocks[0]->attn->c_attn->weight.requires_grad_(false);
  net->to(dev);
  auto options = test_options(c.strategy, 0);
  if (c.bf16) options.mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
  return fully_shard(net, r.pg, options);
}

const torch::optim::AdamWParamState& state_of(torch::optim::Optimizer& opt, const at::Tensor& p) {
  return static_cast<const torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

void check_fused_matches(Rank& r, const torch::Device& dev) {
  const std::vector<FusedCase> cases{{ShardingStrategy::kFullShard},
                                     {ShardingStrategy::kFullShard, /*bf16=*/true},
                                     {ShardingStrategy::kShardGradOp, false, /*frozen=*/true},
                                     {ShardingStrategy::kShardOptimizerState},
                                     {ShardingStrategy::kNoShard}};
  for (const FusedCase& c : cases) {
    SCOPED_TRACE(std::string(to_string(c.strategy)) + (c.bf16 ? " bf16" : "") + (c.frozen ? " frozen" : ""));
    auto plain = build(r, c, dev), fused = build(r, c, dev);
    const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas({0.9, 0.95});
    torch::optim::AdamW plain_opt(plain.parameters(), options);
    fsdp::optim::FusedAdamW fused_opt(fused, options);
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {  // a schedule's change: both read it from param_groups()[0]
        for (auto* o : std::initializer_list<torch::optim::Optimizer*>{&plain_opt, &fused_opt}) {
          static_cast<torch::optim::AdamWOptions&>(o->param_groups()[0].options()).lr(3e-3);
        }
      }
      auto [x, y] = gpt_batch(kCfg, 100 + step);
      x = local_rows(x, r.rank, r.world_size).to(dev);
      y = local_rows(y, r.rank, r.world_size).to(dev);
      for (auto* side : {&plain, &fused}) {
        auto& opt = side == &plain ? static_cast<torch::optim::Optimizer&>(plain_opt) : fused_opt;
        opt.zero_grad();
        gpt_loss((*side)(x), y).backward();
        opt.step();
      }
      if (c.strategy == ShardingStrategy::kFullShard) {
        size_t units = 0;
        for (const auto& u : fused.units()) units += u.shard_numel > 0;
        EXPECT_EQ(fused_opt.tensors_last_step(), units) << "every unit updated as one flat tensor at step " << step;
      }
      const auto a = plain.parameters(), b = fused.parameters();
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        const std::string where = "parameter " + std::to_string(i) + " after step " + std::to_string(step);
        EXPECT_TRUE(close(b[i].detach().cpu(), a[i].detach().cpu(), 1e-6)) << where;
        if (!a[i].requires_grad() || a[i].numel() == 0) continue;
        const auto &sa = state_of(plain_opt, a[i]), &sb = state_of(fused_opt, b[i]);
        EXPECT_EQ(sb.step(), sa.step()) << where;
        // The moments follow the gradients, which after the first step come from parameters 1e-7
        // apart: 1e-6 at the first step (the same gradients), 1e-5 after.
        const double rtol = step == 0 ? 1e-6 : 1e-5;
        EXPECT_TRUE(close(sb.exp_avg().cpu(), sa.exp_avg().cpu(), rtol)) << "exp_avg of " << where;
        EXPECT_TRUE(close(sb.exp_avg_sq().cpu(), sa.exp_avg_sq().cpu(), rtol)) << "exp_avg_sq of " << where;
      }
    }
    if (c.frozen) {
      const auto frozen = fused.parameters();
      const bool any_frozen =
          std::any_of(frozen.begin(), frozen.end(), [](const at::Tensor& p) { return !p.requires_grad(); });
      EXPECT_TRUE(any_frozen) << "the frozen parameter stays frozen";
    }
  }
}

TEST(FusedAdamW, MatchesTorchAdamW) {
  run_ranks(2, [](Rank& r) { check_fused_matches(r, torch::kCPU); });
}

TEST(GlooCuda, FusedAdamWMatchesTorchAdamW) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  run_ranks(
      2, [](Rank& r) { check_fused_matches(r, fsdp::cuda_device()); }, on_one_gpu());
}

}  // namespace
}  // namespace fsdp::testing
