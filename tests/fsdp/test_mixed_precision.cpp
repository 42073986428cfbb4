// Mixed precision (fsdp/mixed_precision.h) against plain LibTorch doing the same casts by hand: an
// fp32 master model, a copy cast to param_dtype for each step's forward and backward, each rank's
// gradients cast to reduce_dtype and summed in rank order, divided by the world size, cast back to
// fp32 for the optimizer. With fp32 reductions the sharded run equals it to the bit at every world
// size: the gradients are bf16 values, and a sum of a few of them is exact in fp32 (24 bits hold
// them unless their exponents are more than 16 apart), so the reduce-scatter's order does not
// matter. bf16 reductions round every partial sum: exact at 2 ranks (one addition), and at 4
// compared within a stated tolerance (the ring sums in another order than the reference).
#include "checkpoint/checkpoint.h"
#include "tests/mixed_reference.h"

#include <torch/nn/functional/linear.h>

#include <tuple>

namespace fsdp::testing {
namespace {

const gpt::Config kCfg{37, 8, 2, 2, 18, false};

struct Case {
  int world_size;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int group = 0;
  at::ScalarType reduce = at::kFloat;
};
std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return strategy_case_label(i.param.strategy, i.param.world_size, i.param.group) +
         (i.param.reduce == at::kFloat ? "_ReduceFp32" : "_ReduceBf16");
}

// The GPT in bf16 with fp32 master weights and AdamW, 5 steps: each rank's loss, the shards, the
// memory held after forward (fp32 shards plus the bf16 units gathered then, from shapes), and one
// reduction per unit at every step (the gradient hooks survive the parameters' dtype changes).
class MixedPrecisionParity : public ::testing::TestWithParam<Case> {};
TEST_P(MixedPrecisionParity, GPTBf16) {
  const Case c = GetParam();
  run_ranks(c.world_size, [&](Rank& r) {
    const int W = r.world_size;
    torch::manual_seed(0);
    auto master = gpt::make_gpt<false>(kCfg);
    auto compute = gpt::make_gpt<false>(kCfg);
    compute->to(torch::kBFloat16);
    auto whole = gpt::make_gpt<false>(kCfg);  // the 1-rank run: bf16 on the global batch
    auto whole_compute = gpt::make_gpt<false>(kCfg);
    whole_compute->to(torch::kBFloat16);
    torch::manual_seed(0);
    auto options = test_options(c.strategy, c.group)
                       .mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(c.reduce));
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, options);
    {
      torch::NoGradGuard no_grad;
      auto w = unique_params(*whole), m = unique_params(*master);
      for (size_t i = 0; i < w.size(); ++i) w[i].second.copy_(m[i].second);
    }
    torch::optim::AdamW ref_opt(master->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    torch::optim::AdamW whole_opt(whole->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    int64_t units = 0;
    for (const auto& u : model.units()) units += u.shard_numel > 0;
    const bool exact = c.reduce == at::kFloat || W <= 2;
    double worst_loss = 0, worst_whole = 0;

    for (int step = 0; step < 5; ++step) {
      torch::Tensor x, y;
      std::tie(x, y) = gpt_batch(kCfg, 3000 + step);
      cast_into(*compute, *master);
      auto ref_losses = reference_grads(*master, *compute, W, c.reduce, [&](int rr) {
        return gpt_loss(compute->forward(local_rows(x, rr, W)), local_rows(y, rr, W));
      });
      ref_opt.step();
      cast_into(*whole_compute, *whole);
      auto whole_loss = reference_grads(*whole, *whole_compute, 1, c.reduce,
                                        [&](int) { return gpt_loss(whole_compute->forward(x), y); })[0];
      whole_opt.step();

      opt.zero_grad();
      model.reset_comm_stats();
      auto logits = model(local_rows(x, r.rank, W));
      EXPECT_EQ(logits.scalar_type(), torch::kBFloat16) << "computed in param_dtype";
      if (step == 0) {
        int64_t expected = 0;
        for (const auto& u : model.units()) {
          expected += 4 * u.shard_numel;  // fp32 master shards
          const bool kept = u.name.empty() || !traits(u.strategy).reshard_after_forward;
          if (kept) expected += 2 * u.shard_world_size * u.shard_numel;  // gathered in bf16
        }
        EXPECT_EQ(model.held_state_bytes(), expected) << "bytes held after forward";
      }
      auto loss = gpt_loss(logits, local_rows(y, r.rank, W));
      loss.backward();
      EXPECT_EQ(model.comm_stats().reduce_scatters, units) << "one reduction per unit at step " << step;
      opt.step();

      if (exact) {
        EXPECT_TRUE(torch::equal(loss.detach(), ref_losses[r.rank])) << "loss at step " << step;
      }
      worst_loss = std::max(worst_loss, rel_diff(loss.detach(), ref_losses[r.rank]));
      auto global = loss.detach().to(torch::kFloat);
      all_reduce_sum(r, global);
      global.div_(W);
      worst_whole = std::max(worst_whole, rel_diff(global, whole_loss.to(torch::kFloat)));
    }
    // Tolerances where not exact (bf16 sums over 4 ranks in another order): 1% on the losses; on
    // the weights 2 x steps x lr (AdamW turns a rounding of a near-zero gradient into a step of up
    // to lr) of the largest, which the LayerNorm weights keep near 1. Against the 1-rank run, whose
    // bf16 means run over other rows: 2% on the global loss.
    EXPECT_LE(worst_loss, 1e-2) << "loss against the same casts, per rank";
    EXPECT_LE(worst_whole, 2e-2) << "global loss against the 1-rank bf16 run";
    const double worst_shard = expect_shards(r, model, *master, exact ? 0 : 2 * 5 * 1e-2);
    if (r.rank == 0) {
      std::cout << "[mixed precision] W=" << W << " worst loss diff " << worst_loss << ", shards " << worst_shard
                << ", vs 1-rank run " << worst_whole << '\n';
    }
  });
}
INSTANTIATE_TEST_SUITE_P(Cases, MixedPrecisionParity,
                         ::testing::Values(Case{1}, Case{2}, Case{3}, Case{4}, Case{2, ShardingStrategy::kShardGradOp},
                                           Case{4, ShardingStrategy::kHybridShard, 2},
                                           Case{2, ShardingStrategy::kFullShard, 0, at::kBFloat16},
                                           Case{4, ShardingStrategy::kFullShard, 0, at::kBFloat16}),
                         case_name);

// A policy per unit: fc2 computes in bf16 and hands fp32 back (output_dtype), the rest stays fp32;
// the reference casts around fc2 by hand. fc2's reduction is issued inside backward at every step,
// before the input's gradient is computed: its gradient hooks survive the parameters' trips
// between fp32 shards and bf16 full views (set_data to another dtype drops a parameter's
// AccumulateGrad; without the library restoring its own, fc2 is reduced only when backward ends).
TEST(MixedPrecision, PerUnitPolicy) {
  for (int W : {1, 2}) {
    run_ranks(W, [&](Rank& r) {
      torch::manual_seed(0);
      auto master = std::make_shared<UnevenMLPImpl<false>>();
      torch::manual_seed(0);
      auto plain = std::make_shared<UnevenMLPImpl<true>>();
      plain->fc2->set_mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16).output_dtype(torch::kFloat));
      auto model = fsdp::fully_shard(plain, r.pg, test_options());
      torch::optim::SGD ref_opt(master->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      auto ref_forward = [&](const torch::Tensor& x) {
        namespace F = torch::nn::functional;
        auto h = torch::tanh(master->fc1(x)).to(torch::kBFloat16);
        auto h2 = F::linear(h, master->fc2->weight.to(torch::kBFloat16), master->fc2->bias.to(torch::kBFloat16));
        return master->head(torch::tanh(h2.to(torch::kFloat))) * master->scale;
      };
      for (int step = 0; step < 4; ++step) {
        torch::manual_seed(500 + step);
        auto x = torch::randn({kGlobalBatch, 7}), y = torch::randn({kGlobalBatch, 3});
        auto ref_losses = reference_grads(*master, *master, W, at::kFloat, [&](int rr) {
          return torch::mse_loss(ref_forward(local_rows(x, rr, W)), local_rows(y, rr, W));
        });
        ref_opt.step();
        opt.zero_grad();
        model.reset_comm_stats();
        auto input = local_rows(x, r.rank, W).clone().requires_grad_(true);
        int64_t reduced_before_input_grad = -1;
        input.register_hook(
            [&](const torch::Tensor&) { reduced_before_input_grad = model.comm_stats().reduce_scatters; });
        auto out = model(input);
        EXPECT_EQ(out.scalar_type(), torch::kFloat);
        auto loss = torch::mse_loss(out, local_rows(y, r.rank, W));
        loss.backward();
        // The root (head, scale) and fc2, whose gradients are complete before the input's.
        EXPECT_GE(reduced_before_input_grad, 2) << "fc2 reduced inside backward at step " << step;
        opt.step();
        EXPECT_TRUE(torch::equal(loss.detach(), ref_losses[r.rank])) << "loss at step " << step;
      }
      expect_shards(r, model, *master, 0);
    });
  }
}

// fp16 with ShardedGradScaler: a scale that overflows at first, so the run skips steps and backs
// off before it trains; every step equals the reference doing the same with PyTorch's own scaler
// kernels, and both skip the same steps.
// Gradient accumulation without sync: each micro-batch's bf16 gradients are summed in fp32 (as plain
// LibTorch accumulating fp32 gradients would, and FSDP2 in its wider dtype), not in bf16: bit-exact
// against the reference that sums the micro-batches' fp32 casts in order. And the root casts an
// fp32 input passed as a plain local tensor (model(x)), as a temporary would be.
TEST(MixedPrecision, AccumulationWithoutSyncSumsInFp32) {
  run_ranks(2, [&](Rank& r) {
    const int W = r.world_size, M = 3;
    torch::manual_seed(0);
    auto master = gpt::make_gpt<false>(kCfg);
    auto compute = gpt::make_gpt<false>(kCfg);
    compute->to(torch::kBFloat16);
    torch::manual_seed(0);
    auto model =
        fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg,
                          test_options().mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16)));
    torch::optim::AdamW ref_opt(master->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      torch::Tensor x, y;
      std::tie(x, y) = gpt_batch(kCfg, 7000 + step, kGlobalBatch * M);
      cast_into(*compute, *master);
      auto m = unique_params(*master), c = unique_params(*compute);
      std::vector<torch::Tensor> total(m.size());
      for (int rr = 0; rr < W; ++rr) {
        std::vector<torch::Tensor> acc(m.size());
        auto mine_x = local_rows(x, rr, W), mine_y = local_rows(y, rr, W);
        for (int k = 0; k < M; ++k) {
          for (auto& [name, p] : c) p.mutable_grad() = torch::Tensor();
          (gpt_loss(compute->forward(local_rows(mine_x, k, M)), local_rows(mine_y, k, M)) / M).backward();
          for (size_t i = 0; i < c.size(); ++i) {
            const auto g = c[i].second.grad().to(torch::kFloat);
            acc[i] = k == 0 ? g : acc[i] + g;
          }
        }
        for (size_t i = 0; i < m.size(); ++i) total[i] = rr == 0 ? acc[i] : total[i] + acc[i];
      }
      for (size_t i = 0; i < m.size(); ++i) m[i].second.mutable_grad() = total[i] / W;
      ref_opt.step();

      opt.zero_grad();
      auto mine_x = local_rows(x, r.rank, W), mine_y = local_rows(y, r.rank, W);
      for (int k = 0; k < M; ++k) {
        model.set_requires_gradient_sync(k == M - 1);
        (gpt_loss(model(local_rows(mine_x, k, M)), local_rows(mine_y, k, M)) / M).backward();
      }
      opt.step();
    }
    expect_shards(r, model, *master, 0);

    // An fp32 activation passed as a plain local tensor into a bf16 root: cast like a temporary.
    torch::manual_seed(0);
    auto mlp = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg,
                                 test_options().mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16)));
    torch::Tensor in = torch::randn({4, 7});
    auto out = mlp(in);
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(out, mlp(in.clone())));
    EXPECT_EQ(in.scalar_type(), torch::kFloat) << "the caller's tensor is left as it was";
  });
}

// FusedAdamW on a bf16 model updates each unit's fp32 flat shard in one pass (the reduced gradients,
// cast back to fp32, keep the flat layout) and agrees with torch::optim::AdamW on the same run; a
// checkpoint of the mixed-precision model (fp32 shards) loads into an fp32 wrapped model bit-exact.
TEST(MixedPrecision, FusedAdamWAndCheckpoint) {
  run_ranks(2, [&](Rank& r) {
    const auto bf16 = test_options().mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
    torch::manual_seed(0);
    auto fused_model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, bf16);
    torch::manual_seed(0);
    auto plain_model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, bf16);
    fsdp::optim::FusedAdamW fused(fused_model, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    torch::optim::AdamW plain(plain_model.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    size_t units = 0;
    for (const auto& u : fused_model.units()) {
      units += u.shard_numel > 0;
      EXPECT_EQ(u.param_dtype, torch::kBFloat16) << "unit '" << u.name << "'";
      EXPECT_EQ(u.reduce_dtype, torch::kFloat) << "unit '" << u.name << "'";
    }
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = gpt_batch(kCfg, 6000 + step);
      for (auto* side : {&fused_model, &plain_model}) {
        gpt_loss((*side)(local_rows(x, r.rank, 2)), local_rows(y, r.rank, 2)).backward();
      }
      fused.step();
      plain.step();
      fused.zero_grad();
      plain.zero_grad();
      EXPECT_EQ(fused.tensors_last_step(), units) << "one flat fp32 update per unit at step " << step;
    }
    auto a = fused_model.parameters(), b = plain_model.parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(close(a[i].detach(), b[i].detach(), 1e-4)) << "parameter " << i;

    const std::string root = shared_dir() + "/mixed";
    checkpoint::save(root, fused_model, fused, checkpoint::SaveOptions().step(3));
    torch::manual_seed(1);
    auto fp32_model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    checkpoint::load(root, fp32_model);
    auto want = fused_model.named_parameters();
    for (const auto& kv : fp32_model.named_parameters()) {
      EXPECT_TRUE(torch::equal(kv.value(), want[kv.key()])) << kv.key() << " loaded from the mixed-precision model";
    }
  });
}

// What mixed precision refuses, each with its remedy.
TEST(MixedPrecision, Refusals) {
  run_ranks(1, [&](Rank& r) {
    const auto bf16 = MixedPrecisionPolicy().param_dtype(torch::kBFloat16);
    for (auto s : {ShardingStrategy::kNoShard, ShardingStrategy::kShardOptimizerState}) {
      expect_error(
          [&] { fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options().strategy(s).mixed_precision(bf16)); },
          "Mixed-precision compute needs a strategy that gathers the parameters from their shards");
    }
    expect_error(
        [&] {
          fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg,
                            test_options().mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kLong)));
        },
        "MixedPrecisionPolicy::param_dtype is Long, which mixed precision does not compute in");
    // CPU offload of a CPU model: nothing to offload.
    expect_error(
        [&] { fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options().offload_policy(CPUOffloadPolicy())); },
        "offload_policy keeps a CUDA model's shards, gradients and optimizer state in host memory, but this "
        "model's parameters are on cpu ('wte.weight')");
    auto plain = gpt::make_gpt<true>(kCfg);
    auto model = fsdp::fully_shard(plain, r.pg, test_options());
    expect_error([&] { plain->blocks[0]->set_mixed_precision(bf16); }, "which is sharded already");
    {  // A unit sharded as it was built is named by its type and order until fully_shard names it.
      ShardingScope scope(r.pg, test_options());
      auto net = gpt::make_gpt<true>(kCfg);
      expect_error([&] { net->blocks[1]->set_mixed_precision(bf16); },
                   "on unit 'gpt::BlockImpl #2 (built in a ShardingScope)', which is sharded already");
      fsdp::fully_shard(net, scope);
    }
    {  // A unit without a policy fed a bf16 unit's output: LibTorch's operator refuses, and the error
       // says in which unit, computing in which dtype.
      auto net = gpt::make_gpt<true>(kCfg);
      net->blocks[1]->set_mixed_precision(MixedPrecisionPolicy());
      auto mixed = fsdp::fully_shard(net, r.pg, test_options().mixed_precision(bf16));
      const torch::Tensor x = gpt_batch(kCfg, 2).first;
      const std::string msg = error_of([&] { mixed(x); });
      EXPECT_NE(
          msg.find("fsdp (rank 0 of 1): raised in the forward of unit 'h.1', whose parameters compute in Float (its "
                   "inputs are not cast)"),
          std::string::npos)
          << msg;
      EXPECT_NE(msg.find("give that unit MixedPrecisionPolicy::output_dtype"), std::string::npos) << msg;
      EXPECT_EQ(msg.find("unit 'h.0'"), std::string::npos) << "named once, by the innermost unit: " << msg;
    }
    {  // The same in the root's own layers: its head fed fp32 by a unit whose output_dtype says so.
      auto net = std::make_shared<UnevenMLPImpl<true>>();
      net->fc2->set_mixed_precision(MixedPrecisionPolicy(bf16).output_dtype(torch::kFloat));
      auto mlp = fsdp::fully_shard(net, r.pg, test_options().mixed_precision(bf16));
      const torch::Tensor in = torch::randn({4, 7});
      expect_error([&] { mlp(in); },
                   "fsdp (rank 0 of 1): raised in the forward of unit '<root>', whose parameters compute in BFloat16");
    }
    // reduce_dtype alone works with every strategy (here replicated, alone: the cast is all).
    auto replicated = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg,
                                        test_options(ShardingStrategy::kNoShard, 0)
                                            .mixed_precision(MixedPrecisionPolicy().reduce_dtype(torch::kBFloat16)));
    auto [x, y] = gpt_batch(kCfg, 1);
    gpt_loss(replicated(x), y).backward();
    for (const auto& p : replicated.parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::equal(p.grad(), p.grad().to(torch::kBFloat16).to(torch::kFloat))) << "rounded through bf16";
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
