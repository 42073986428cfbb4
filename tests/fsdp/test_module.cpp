// The wrapped model as a LibTorch module (FSDP2's semantics): between steps its own parameters are
// this rank's shards with their sharded gradients, so a program written the plain LibTorch way
// (optimizer on model->parameters(), model->zero_grad(), torch::save / torch::load of the module)
// trains as plain LibTorch does; what cannot work is refused with a message.
#include "tests/parity.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/serialize.h>

namespace fsdp::testing {
namespace {

struct ModuleCase {
  ShardingStrategy strategy;
  int world_size;
  int group = 0;  // kHybridShard: S
};

std::string module_case_name(const ::testing::TestParamInfo<ModuleCase>& i) {
  return strategy_case_label(i.param.strategy, i.param.world_size, i.param.group);
}

const gpt::Config kCfg{31, 8, 2, 2, 12, true};
// Without biases for Adam: the attention key's bias has a zero gradient in exact arithmetic, which
// Adam's normalisation turns into noise of the reduction order (see test_parity.cpp).
const gpt::Config kAdamCfg{31, 8, 2, 2, 12, false};

// A per-rank file in the test's directory (removed with it).
std::string rank_file(const Rank& r, const char* what) {
  return shared_dir() + "/" + what + "-rank" + std::to_string(r.rank) + ".pt";
}

class PlainLibTorchProgram : public ::testing::TestWithParam<ModuleCase> {};

// The loop of a LibTorch user, unchanged but for fully_shard: AdamW on model->parameters(),
// model->zero_grad(), a grad-enabled forward whose result is dropped (a careless validation), and
// torch::save / torch::load of the module. Losses equal plain LibTorch's on the global batch.
TEST_P(PlainLibTorchProgram, TrainsAsPlainLibTorch) {
  const ModuleCase c = GetParam();
  run_ranks(c.world_size, [&](Rank& r) {
    const auto options = test_options(c.strategy, c.group);
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(kAdamCfg);
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kAdamCfg), r.pg, options);
    auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    torch::optim::AdamW ref_opt(ref->parameters(), adamw);
    torch::optim::AdamW opt(model->parameters(), adamw);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = gpt_batch(kAdamCfg, 300 + step);
      ref->zero_grad();
      auto ref_loss = gpt_loss(ref->forward(x), y);
      ref_loss.backward();
      ref_opt.step();

      model->zero_grad();
      auto mine = local_rows(x, r.rank, r.world_size);
      if (step == 1) (void)model(mine);  // gradients on, never backwarded
      auto loss = gpt_loss(model(mine), local_rows(y, r.rank, r.world_size));
      loss.backward();
      expect_between_steps(r, model, *ref);
      opt.step();
      auto global = loss.detach().clone();
      all_reduce_sum(r, global);
      global.div_(r.world_size);
      EXPECT_TRUE(close(global, ref_loss.detach())) << "loss at step " << step;
    }
    expect_shards_match(r, model, *ref);

    // Each rank saves its shards; a model built from another seed loads them and then computes
    // what the trained model computes (the loaded shards are gathered by its next forward).
    torch::save(model.module(), rank_file(r, "model"));
    torch::manual_seed(1);
    auto fresh = fsdp::fully_shard(gpt::make_gpt<true>(kAdamCfg), r.pg, options);
    auto module = fresh.module();
    torch::load(module, rank_file(r, "model"));
    expect_shards_match(r, fresh, *ref);
    torch::NoGradGuard no_grad;
    auto [x, y] = gpt_batch(kAdamCfg, 399);
    EXPECT_TRUE(close(fresh(x), ref->forward(x)));
    EXPECT_TRUE(close(model(x), ref->forward(x)));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PlainLibTorchProgram,
    ::testing::Values(ModuleCase{ShardingStrategy::kFullShard, 2}, ModuleCase{ShardingStrategy::kFullShard, 3},
                      ModuleCase{ShardingStrategy::kShardGradOp, 2}, ModuleCase{ShardingStrategy::kShardGradOp, 3},
                      ModuleCase{ShardingStrategy::kShardOptimizerState, 2},
                      ModuleCase{ShardingStrategy::kShardOptimizerState, 3}, ModuleCase{ShardingStrategy::kNoShard, 2},
                      ModuleCase{ShardingStrategy::kNoShard, 3}, ModuleCase{ShardingStrategy::kHybridShard, 2, 1},
                      ModuleCase{ShardingStrategy::kHybridShard, 3, 3},
                      ModuleCase{ShardingStrategy::kHybridShard, 4, 2}),
    module_case_name);

// A write through the parameters right after wrapping, before the first forward (under
// torch::NoGradGuard, as an initialization a program does itself), is what the first forward
// computes with, under every strategy, at 2 and 3 ranks: losses and shards as plain LibTorch's
// with the same write. (ZeRO-1 keeps full parameters; the write reaches only this rank's rows of
// them until its first forward gathers.)
TEST(ModuleSemantics, AWriteBeforeTheFirstForwardIsSeen) {
  for (const int W : {2, 3}) {
    run_ranks(W, [](Rank& r) {
      for (const ShardingStrategy s :
           {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kShardOptimizerState,
            ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
        const int group = s == ShardingStrategy::kHybridShard ? (r.world_size == 2 ? 1 : 3) : 0;
        SCOPED_TRACE(strategy_case_label(s, r.world_size, group));
        torch::manual_seed(0);
        auto ref = gpt::make_gpt<false>(kCfg);
        torch::manual_seed(0);
        auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options(s, group));
        {
          torch::NoGradGuard no_grad;
          for (auto& p : ref->parameters()) p.mul_(0.9);
          for (auto& p : model->parameters()) p.mul_(0.9);
        }
        torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
        for (int step = 0; step < 2; ++step) {
          auto [x, y] = gpt_batch(kCfg, 40 + step);
          ref_opt.zero_grad();
          auto ref_loss = gpt_loss(ref->forward(x), y);
          ref_loss.backward();
          ref_opt.step();
          opt.zero_grad();
          auto loss = gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size));
          loss.backward();
          opt.step();
          auto global = loss.detach().clone();
          all_reduce_sum(r, global);
          EXPECT_TRUE(close(global / r.world_size, ref_loss.detach())) << "loss at step " << step;
        }
        expect_shards_match(r, model, *ref);
      }
    });
  }
}

// A file that does not hold this rank's shards (here: the unwrapped model's full weights) is
// refused at the next forward, naming the parameter and both shapes.
TEST(ModuleSemantics, LoadingAnotherLayoutIsRefused) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    auto plain = gpt::make_gpt<false>(kCfg);
    if (r.rank == 0) torch::save(plain, rank_file(r, "full"));
    torch::Tensor t = torch::ones({1});
    all_reduce_sum(r, t);  // rank 0 has written the file
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    auto module = model.module();
    torch::load(module, rank_file(Rank{0, 2, {}}, "full"));
    auto [x, y] = gpt_batch(kCfg, 1);
    auto msg = error_of([&] { model(local_rows(x, r.rank, r.world_size)); });
    EXPECT_NE(msg.find("parameter 'wte.weight' of unit '<root>' has shape [31, 12], but this rank's shard is"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("torch::load of a file saved at another world size"), std::string::npos) << msg;
    // The shard's rows from the shape: 31 rows in chunks of ceil(31 / 2) = 16.
    const int64_t begin = std::min<int64_t>(16 * r.rank, 31), end = std::min<int64_t>(16 * (r.rank + 1), 31);
    EXPECT_NE(msg.find("(rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of 31, split over 2 ranks)"),
              std::string::npos)
        << msg;
  });
}

// Gradient sync turned off and never on again: the optimizer would see no gradient. Reported at
// zero_grad (the module's or the handle's) and by clipping and the fused optimizer.
TEST(ModuleSemantics, AccumulationNeverSyncedIsReported) {
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    fsdp::optim::FusedAdamW fused(model);
    auto [x, y] = gpt_batch(kCfg, 2);
    model.set_requires_gradient_sync(false);
    gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size)).backward();
    for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << "nothing reduced yet";
    for (auto& [what, call] : std::vector<std::pair<std::string, std::function<void()>>>{
             {"model->zero_grad()", [&] { model->zero_grad(); }},
             {"model.zero_grad()", [&] { model.zero_grad(); }},
             {"fsdp::optim::clip_grad_norm", [&] { fsdp::optim::clip_grad_norm(model, 1.0); }},
             {"fsdp::optim::FusedAdamW::step", [&] { fused.step(); }}}) {
      auto msg = error_of(call);
      EXPECT_EQ(msg.rfind(what + " (rank " + std::to_string(r.rank) + " of 2): 3 unit(s) hold gradients", 0), 0u)
          << msg;
      EXPECT_NE(msg.find("model.set_requires_gradient_sync(true)"), std::string::npos) << msg;
    }
    // The refusal through operator-> is the library's own message: no "was it model->forward?" hint.
    {
      WarningCapture capture;
      EXPECT_FALSE(error_of([&] { model->zero_grad(); }).empty());
      EXPECT_EQ(capture.text(), "");
    }
    // Dropping them on purpose: the micro-batch is gone, the next backward starts afresh.
    model.discard_unsynced_gradients();
    model->zero_grad();
    model.set_requires_gradient_sync(false);
    gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size)).backward();
    // Sync on for the last micro-batch: everything accumulated is reduced, and zero_grad works.
    model.set_requires_gradient_sync(true);
    gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size)).backward();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
    model->zero_grad();
    for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  });
}

// LibTorch's torch::nn::utils::clip_grad_norm_(model->parameters(), max) computes each rank's part
// of the norm only (between steps the parameters are shards): the next forward warns, once, on
// every rank, with the remedy. Not for fsdp::optim::clip_grad_norm, nor under kNoShard (whole
// gradients, whose per-rank norm is the global one), nor for gradients zeroed in place.
TEST(ModuleSemantics, LibTorchsClipGradNormIsWarnedOnce) {
  run_ranks(2, [](Rank& r) {
    enum class Clip { kLibTorch, kLibrary, kNone };
    struct Case {
      const char* name;
      ShardingStrategy strategy;
      Clip clip;
      bool warns;
    };
    for (const Case& c : {Case{"libtorch, full", ShardingStrategy::kFullShard, Clip::kLibTorch, true},
                          Case{"libtorch, optimizer", ShardingStrategy::kShardOptimizerState, Clip::kLibTorch, true},
                          Case{"library, full", ShardingStrategy::kFullShard, Clip::kLibrary, false},
                          Case{"libtorch, replicate", ShardingStrategy::kNoShard, Clip::kLibTorch, false},
                          Case{"zeroed in place", ShardingStrategy::kFullShard, Clip::kNone, false}}) {
      SCOPED_TRACE(c.name);
      torch::manual_seed(0);
      auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options(c.strategy, 0));
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
      WarningCapture capture;
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = gpt_batch(kCfg, 50 + step);
        opt.zero_grad();
        gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size)).backward();
        if (c.clip == Clip::kLibTorch) torch::nn::utils::clip_grad_norm_(model->parameters(), 1e-3);  // clips
        if (c.clip == Clip::kLibrary) fsdp::optim::clip_grad_norm(model, 1e-3);
        opt.step();
        if (c.clip == Clip::kNone) opt.zero_grad(/*set_to_none=*/false);
      }
      const std::string& text = capture.text();
      const std::string warning = "fsdp (rank " + std::to_string(r.rank) +
                                  " of 2): after the last backward, the sharded gradients were rescaled in place";
      if (!c.warns) {
        EXPECT_EQ(text, "");
        continue;
      }
      ASSERT_NE(text.find(warning), std::string::npos) << text;
      EXPECT_EQ(text.find(warning, text.find(warning) + 1), std::string::npos) << "warned more than once:\n" << text;
      EXPECT_NE(text.find("fsdp::optim::clip_grad_norm(model, max_norm)"), std::string::npos) << text;
    }
  });
}

// Gradient sync turned off and never on again, with torch::optim's own zero_grad (set_to_none
// false: gradients zeroed in place, so the optimizer still steps): the next forward after that
// step throws on every rank, whatever optimizer ran.
TEST(ModuleSemantics, AStepWhileUnsyncedGradientsWaitIsReportedAtTheNextForward) {
  run_ranks(2, [](Rank& r) {
    for (const bool adamw : {true, false}) {
      SCOPED_TRACE(adamw ? "AdamW" : "SGD with momentum");
      torch::manual_seed(0);
      auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
      std::unique_ptr<torch::optim::Optimizer> opt;
      if (adamw) {
        opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
      } else {
        opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      }
      auto step = [&](int i) {
        auto [x, y] = gpt_batch(kCfg, 60 + i);
        opt->zero_grad(/*set_to_none=*/false);
        gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size)).backward();
        opt->step();
      };
      step(0);                                  // synced
      model.set_requires_gradient_sync(false);  // ... and never on again
      step(1);
      const std::string msg = error_of([&] { step(2); });
      EXPECT_EQ(msg.rfind("fsdp (rank " + std::to_string(r.rank) + " of 2): the parameters were written", 0), 0u)
          << msg;
      EXPECT_NE(msg.find("while 3 unit(s) ('<root>', 'h.0', 'h.1') hold gradients accumulated without sync"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("model.set_requires_gradient_sync(true)"), std::string::npos) << msg;
      model.discard_unsynced_gradients();  // then training goes on
      model.set_requires_gradient_sync(true);
      EXPECT_EQ(error_of([&] { step(3); }), "");
    }
  });
}

// The handle forwards what a LibTorch module offers; a change of dtype or device after wrapping is
// refused, whether asked of the handle, of a unit, or done to the root's parameters by Module::to.
TEST(ModuleSemantics, HandleForwardsModuleCalls) {
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    model.eval();
    EXPECT_FALSE(model.is_training());
    EXPECT_FALSE(model->blocks[1]->is_training());
    model.train();
    EXPECT_TRUE(model->blocks[1]->is_training());
    const auto mine = model.parameters();
    const auto theirs = model->parameters();
    ASSERT_EQ(mine.size(), theirs.size());
    for (size_t i = 0; i < mine.size(); ++i) EXPECT_TRUE(mine[i].is_same(theirs[i]));
    EXPECT_EQ(model.named_parameters().keys(), model->named_parameters().keys());

    model.to(torch::kCPU);  // the model's own device and dtype: nothing to do
    model.to(torch::kFloat);
    auto msg = error_of([&] { model.to(torch::kDouble); });
    EXPECT_NE(msg.find("A wrapped model's dtype and device are fixed; nothing was converted"), std::string::npos)
        << msg;
    EXPECT_EQ(msg.find("convert them back"), std::string::npos) << "the handle's to() converts nothing: " << msg;
    msg = error_of([&] { model->blocks[0]->to(torch::kDouble); });
    EXPECT_NE(msg.find("convert the model before wrapping it"), std::string::npos) << msg;
    // Module::to converts the root's own parameters before its units refuse; the next forward
    // refuses the converted ones.
    msg = error_of([&] { model->to(torch::kDouble); });
    EXPECT_NE(msg.find("A wrapped model's dtype and device are fixed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("convert them back, model->to(torch::Device(\"cpu\"), torch::kFloat)"), std::string::npos)
        << msg;
    auto [x, y] = gpt_batch(kCfg, 3);
    msg = error_of([&] { model(local_rows(x, r.rank, r.world_size)); });
    EXPECT_NE(msg.find("of unit '<root>' was converted to double on cpu after fsdp::fully_shard"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("convert it back: model->to(torch::Device(\"cpu\"), torch::kFloat)"), std::string::npos) << msg;
    // What both messages say to do works: converted back, the model trains again.
    model->to(torch::Device("cpu"), torch::kFloat);
    model(local_rows(x, r.rank, r.world_size)).sum().backward();
  });
}

// Full weights gathered unit by unit onto CPU, on every rank or on rank 0 only: equal to the plain
// model's parameters and buffers after the same training, whatever the strategy.
TEST(ModuleSemantics, FullStateDict) {
  run_ranks(3, [](Rank& r) {
    for (auto strategy :
         {ShardingStrategy::kFullShard, ShardingStrategy::kShardOptimizerState, ShardingStrategy::kNoShard}) {
      torch::manual_seed(0);
      auto ref = gpt::make_gpt<false>(kCfg);
      torch::manual_seed(0);
      auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options().strategy(strategy));
      torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
      for (int step = 0; step < 2; ++step) {
        auto [x, y] = gpt_batch(kCfg, 500 + step);
        ref_opt.zero_grad();
        gpt_loss(ref->forward(x), y).backward();
        ref_opt.step();
        opt.zero_grad();
        gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size)).backward();
        opt.step();
      }
      const auto want = ref->named_parameters();
      for (bool rank0_only : {false, true}) {
        const auto full = model.full_state_dict(rank0_only);
        if (rank0_only && r.rank != 0) {
          EXPECT_EQ(full.size(), 0u);
          continue;
        }
        EXPECT_EQ(full.size(), want.size() + ref->named_buffers().size());
        for (const auto& kv : want) {
          ASSERT_TRUE(full.contains(kv.key())) << kv.key();
          EXPECT_TRUE(full[kv.key()].device().is_cpu());
          EXPECT_TRUE(close(full[kv.key()], kv.value().detach())) << kv.key() << " " << to_string(strategy);
        }
      }
      expect_between_steps(r, model, *ref);  // the shards are untouched
    }
  });
}

// Option values that cannot be used are refused when wrapping (or opening a scope), naming the
// caller, this rank and the option.
TEST(ModuleSemantics, BadOptionValuesAreRefused) {
  run_ranks(2, [](Rank& r) {
    auto wrap = [&](const FullyShardOptions& o) {
      return error_of([&] { fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, o); });
    };
    const std::string of = " (rank " + std::to_string(r.rank) + " of 2): ";
    std::string msg = wrap(test_options().prefetch(-1));
    EXPECT_EQ(msg.rfind("fsdp::fully_shard" + of + "FullyShardOptions::prefetch is -1", 0), 0u) << msg;
    msg = error_of([&] { fsdp::ShardingScope scope(r.pg, test_options().timeout(std::chrono::milliseconds(0))); });
    EXPECT_EQ(msg.rfind("fsdp::ShardingScope" + of + "FullyShardOptions::timeout is 0 ms", 0), 0u) << msg;
    EXPECT_NE(wrap(test_options().strategy(ShardingStrategy::kNoShard).bucket_bytes(0))
                  .find("FullyShardOptions::bucket_bytes is 0"),
              std::string::npos);
    EXPECT_NE(wrap(test_options().strategy(static_cast<ShardingStrategy>(7))).find("not a ShardingStrategy"),
              std::string::npos);
    // FullyShardOptions::device: refused before anything moves; the model stays where it was.
    msg = wrap(test_options().device(torch::Device(torch::kMeta)));
    EXPECT_EQ(msg.rfind("fsdp::fully_shard" + of +
                            "FullyShardOptions::device is meta; the library trains on the CPU "
                            "or on a CUDA device",
                        0),
              0u)
        << msg;
    msg = error_of([&] { fsdp::ShardingScope scope(r.pg, test_options().device(torch::Device(torch::kCUDA, 99))); });
    EXPECT_EQ(msg.rfind("fsdp::ShardingScope" + of + "FullyShardOptions::device is cuda:99, but this process sees ", 0),
              0u)
        << msg;
    auto net = std::make_shared<UnevenMLPImpl<true>>();
    EXPECT_NE(error_of([&] {
                net->fc1->set_sharding_strategy(static_cast<ShardingStrategy>(9));
              }).find("not a ShardingStrategy"),
              std::string::npos);
  });
}

// Per-unit settings of units held in a Sequential, without casts; a plain module is refused.
TEST(ModuleSemantics, PerUnitStrategyFromASequential) {
  run_ranks(2, [](Rank& r) {
    torch::nn::Sequential seq(fsdp::Sharded<torch::nn::LinearImpl>(4, 6), torch::nn::Functional(torch::tanh),
                              fsdp::Sharded<torch::nn::LinearImpl>(6, 2));
    fsdp::as_unit(seq->ptr(2)).set_sharding_strategy(ShardingStrategy::kNoShard);
    auto msg = error_of([&] { fsdp::as_unit(seq->ptr(1)); });
    EXPECT_NE(msg.find("is not an fsdp::Sharded unit"), std::string::npos) << msg;
    auto model = fsdp::fully_shard(seq, r.pg, test_options());
    std::map<std::string, ShardingStrategy> strategies;
    for (const auto& u : model.units()) strategies[u.name] = u.strategy;
    EXPECT_EQ(strategies.at("0"), ShardingStrategy::kFullShard);
    EXPECT_EQ(strategies.at("2"), ShardingStrategy::kNoShard);
  });
}

}  // namespace
}  // namespace fsdp::testing
