// fp16 with fsdp::optim::ShardedGradScaler (optim/grad_scaler.h): against plain LibTorch scaling by
// hand with PyTorch's kernels; an overflow on one rank skips the step on all, and over a pipeline's
// stages an overflow in one stage skips the step on every rank of every stage; its state through a
// checkpoint's metadata, exact; what it refuses.
#include "checkpoint/checkpoint.h"
#include "pp/stage_mesh.h"
#include "tests/mixed_reference.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>

#include <limits>
#include <tuple>

namespace fsdp::testing {
namespace {

const gpt::Config kCfg{37, 8, 2, 2, 18, false};

const FullyShardOptions fp16_options() {
  return test_options().mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kHalf));
}

// fp16 compute with the scaler against the reference doing the same scaling, unscaling and scale
// updates with PyTorch's kernels: the same steps skipped, the same scale, the same shards.
TEST(GradScaler, Fp16TracksPlainLibTorch) {
  for (int W : {1, 2}) {
    run_ranks(W, [&](Rank& r) {
      torch::manual_seed(0);
      auto master = gpt::make_gpt<false>(kCfg);
      auto compute = gpt::make_gpt<false>(kCfg);
      compute->to(torch::kFloat16);
      torch::manual_seed(0);
      auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg,
                                     test_options().mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kHalf)));
      const double init_scale = 1 << 22;
      fsdp::optim::ShardedGradScaler scaler(model, fsdp::optim::GradScalerOptions().init_scale(init_scale));
      torch::optim::AdamW ref_opt(master->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
      auto ref_scale = torch::full({1}, init_scale, torch::kFloat);
      auto ref_tracker = torch::zeros({1}, torch::kInt);
      int skipped = 0, stepped = 0;
      for (int step = 0; step < 10; ++step) {
        torch::Tensor x, y;
        std::tie(x, y) = gpt_batch(kCfg, 4000 + step);
        cast_into(*compute, *master);
        std::vector<torch::Tensor> ref_losses;  // unscaled
        reference_grads(*master, *compute, W, at::kFloat, [&](int rr) {
          auto l = gpt_loss(compute->forward(local_rows(x, rr, W)), local_rows(y, rr, W));
          ref_losses.push_back(l.detach());
          return l * ref_scale;
        });
        std::vector<torch::Tensor> grads;
        for (auto& p : master->parameters()) grads.push_back(p.grad());
        auto found = torch::zeros({1}, torch::kFloat);
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found,
                                                       ref_scale.to(torch::kDouble).reciprocal().to(torch::kFloat));
        const bool ref_skip = found.item<float>() > 0;
        if (!ref_skip) ref_opt.step();
        at::_amp_update_scale_(ref_scale, ref_tracker, found, 2.0, 0.5, 2000);

        opt.zero_grad();
        auto loss = gpt_loss(model(local_rows(x, r.rank, W)), local_rows(y, r.rank, W));
        scaler.scale(loss).backward();
        const bool did_step = scaler.step(opt);
        scaler.update();
        EXPECT_EQ(did_step, !ref_skip) << "step " << step;
        EXPECT_EQ(scaler.get_scale(), ref_scale.item<double>()) << "scale after step " << step;
        EXPECT_EQ(loss.scalar_type(), torch::kHalf);
        EXPECT_TRUE(torch::equal(loss.detach(), ref_losses[r.rank])) << "loss at step " << step;
        (did_step ? stepped : skipped) += 1;
      }
      EXPECT_GT(skipped, 0) << "the test should overflow at first";
      EXPECT_GT(stepped, 0) << "and then train";
      expect_shards(r, model, *master, 0);
    });
  }
}

// An inf in one rank's rows only: every rank skips the step and backs the scale off alike.
TEST(GradScaler, AnOverflowOnOneRankSkipsTheStepOnAll) {
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg,
                                   test_options().mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kHalf)));
    fsdp::optim::ShardedGradScaler scaler(model, fsdp::optim::GradScalerOptions().init_scale(1024));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
    auto [x, y] = gpt_batch(kCfg, 4100);
    auto loss = gpt_loss(model(local_rows(x, r.rank, 2)), local_rows(y, r.rank, 2));
    scaler.scale(loss).backward();
    std::vector<torch::Tensor> before;
    for (const auto& p : model.parameters()) before.push_back(p.detach().clone());
    if (r.rank == 1) {
      for (const auto& p : model.parameters()) {
        if (p.grad().defined() && p.grad().numel() > 0) {
          p.grad().view({-1})[0] = std::numeric_limits<float>::infinity();
          break;
        }
      }
    }
    EXPECT_FALSE(scaler.step(opt)) << "rank " << r.rank << " must skip: rank 1 overflowed";
    EXPECT_TRUE(scaler.found_inf());
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0);
    auto params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i])) << "parameter " << i;
    // The next clean step steps everywhere.
    opt.zero_grad();
    loss = gpt_loss(model(local_rows(x, r.rank, 2)), local_rows(y, r.rank, 2));
    scaler.scale(loss).backward();
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
  });
}

// Over a pipeline (pp 2, dp_shard 2): each stage a model over its own two ranks, one scaler over the
// stages. An inf in one rank of the second stage skips the step on all four; the next clean step
// steps all.
TEST(GradScaler, AnOverflowInOneStageSkipsTheStepOnEveryStage) {
  run_ranks(4, [&](Rank& r) {
    DeviceMesh mesh(r.pg, {{kPipeDim, 2}, {kShardDim, 2}});
    const DeviceMesh stage = pp::stage_mesh(mesh);
    torch::manual_seed(static_cast<uint64_t>(mesh.coordinate(kPipeDim)));  // the stages differ
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), stage, fp16_options());
    fsdp::optim::ShardedGradScaler scaler({model}, mesh.group(kPipeDim),
                                          fsdp::optim::GradScalerOptions().init_scale(1024));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
    auto [x, y] = gpt_batch(kCfg, 4100);
    const int d = mesh.coordinate(kShardDim);
    auto backward = [&] {
      opt.zero_grad();
      scaler.scale(gpt_loss(model(local_rows(x, d, 2)), local_rows(y, d, 2))).backward();
    };
    backward();
    std::vector<torch::Tensor> before;
    for (const auto& p : model.parameters()) before.push_back(p.detach().clone());
    if (r.rank == 3) {  // stage 1's second rank
      for (const auto& p : model.parameters()) {
        if (p.grad().defined() && p.grad().numel() > 0) {
          p.grad().view({-1})[0] = std::numeric_limits<float>::infinity();
          break;
        }
      }
    }
    EXPECT_FALSE(scaler.step({&opt})) << "rank " << r.rank << " must skip: a rank of stage 1 overflowed";
    EXPECT_TRUE(scaler.found_inf());
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0);
    auto params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i])) << "parameter " << i;
    backward();
    EXPECT_TRUE(scaler.step({&opt})) << "rank " << r.rank;
    scaler.update();
  });
}

// The scaler's state saved in a checkpoint's metadata and loaded into a new scaler with other
// options: the same scale, growth count and options, to the bit (a scale that is no power of two
// included); the user's own keys beside it are left alone.
TEST(GradScaler, StateRoundTripsThroughACheckpoint) {
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, fp16_options());
    fsdp::optim::ShardedGradScaler scaler(
        model, fsdp::optim::GradScalerOptions().init_scale(1 << 22).growth_interval(2).backoff_factor(0.25));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
    int skipped = 0;
    for (int step = 0; step < 7; ++step) {
      auto [x, y] = gpt_batch(kCfg, 4200 + step);
      opt.zero_grad();
      scaler.scale(gpt_loss(model(local_rows(x, r.rank, 2)), local_rows(y, r.rank, 2))).backward();
      skipped += scaler.step(opt) ? 0 : 1;
      scaler.update();
    }
    EXPECT_GT(skipped, 0) << "the scale should have backed off";
    const auto saved = scaler.state_dict();
    EXPECT_EQ(saved.size(), 5u);
    auto meta = saved;
    meta["user.note"] = "kept";
    const std::string root = shared_dir() + "/scaler";
    checkpoint::save(root, model, opt, checkpoint::SaveOptions().step(7).metadata(meta));

    fsdp::optim::ShardedGradScaler fresh(model);  // defaults: 65536, interval 2000
    const auto loaded = checkpoint::load(root, model, opt);
    EXPECT_EQ(loaded.metadata.at("user.note"), "kept");
    fresh.load_state_dict(loaded.metadata);
    EXPECT_EQ(fresh.state_dict(), saved);
    EXPECT_EQ(fresh.get_scale(), scaler.get_scale());
    EXPECT_EQ(fresh.options().growth_interval(), 2);
    EXPECT_EQ(fresh.options().backoff_factor(), 0.25);

    // Exact for any fp32 scale, not just powers of two.
    fsdp::optim::ShardedGradScaler odd(model, fsdp::optim::GradScalerOptions().init_scale(12345.678));
    fsdp::optim::ShardedGradScaler back(model);
    back.load_state_dict(odd.state_dict());
    EXPECT_EQ(back.get_scale(), odd.get_scale());
    EXPECT_EQ(back.get_scale(), static_cast<double>(static_cast<float>(12345.678)));
  });
}

// step() with no gradient on any rank (no backward since zero_grad) is refused on every rank, as
// PyTorch's "No inf checks were recorded"; the scaler is left usable for the next backward.
// load_state_dict names a missing or malformed key, and refuses a disabled scaler.
TEST(GradScaler, Refusals) {
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, fp16_options());
    fsdp::optim::ShardedGradScaler scaler(model, fsdp::optim::GradScalerOptions().init_scale(1024));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
    expect_error([&] { scaler.step(opt); }, "no parameter of the optimizer has a gradient on any rank");
    scaler.unscale_(opt);  // no gradient anywhere: nothing checked, so no update either
    expect_error([&] { scaler.update(); }, "No inf checks were recorded prior to update");
    auto [x, y] = gpt_batch(kCfg, 4300);
    scaler.scale(gpt_loss(model(local_rows(x, r.rank, 2)), local_rows(y, r.rank, 2))).backward();
    EXPECT_TRUE(scaler.step(opt));
    expect_error([&] { scaler.step(opt); }, "step() was called already since the last update()");
    expect_error([&] { scaler.unscale_(opt); }, "called after step(), which unscales");
    scaler.update();

    auto state = scaler.state_dict();
    state.erase("grad_scaler.growth_tracker");
    expect_error([&] { scaler.load_state_dict(state); }, "'grad_scaler.growth_tracker' is missing");
    state = scaler.state_dict();
    state["grad_scaler.scale"] = "12x";
    expect_error([&] { scaler.load_state_dict(state); }, "'grad_scaler.scale' is '12x', not a finite decimal number");
    // Whatever reads as a double but not as a usable scale or count: refused, naming the key.
    for (const char* bad : {"-1", "1e39", "1e-300", "0"}) {
      state["grad_scaler.scale"] = bad;
      expect_error([&] { scaler.load_state_dict(state); }, "a scale is a positive number that fp32 holds");
    }
    state["grad_scaler.scale"] = "0x10";
    expect_error([&] { scaler.load_state_dict(state); }, "'grad_scaler.scale' is '0x10', not a finite decimal number");
    state = scaler.state_dict();
    for (const char* bad : {"99999999999", "2000", "1.5", "-1"}) {
      state["grad_scaler.growth_tracker"] = bad;
      expect_error([&] { scaler.load_state_dict(state); }, "a whole number below the interval (2000)");
    }
    state = scaler.state_dict();
    state["grad_scaler._growth_tracker"] = "1";
    expect_error([&] { scaler.load_state_dict(state); }, "unknown key 'grad_scaler._growth_tracker'");
    EXPECT_EQ(scaler.get_scale(), 1024.0) << "a refused load changes nothing";
    fsdp::optim::ShardedGradScaler off(model, fsdp::optim::GradScalerOptions().enabled(false));
    EXPECT_TRUE(off.state_dict().empty());
    expect_error([&] { off.load_state_dict(scaler.state_dict()); }, "the scaler is disabled");
  });
}

}  // namespace
}  // namespace fsdp::testing
