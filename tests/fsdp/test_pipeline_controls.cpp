// FSDPModule's pipeline controls (FSDP2's set_reshard_after_forward / set_reshard_after_backward,
// unshard, reshard, and the post-backward by hand, reduce_gradients): with resharding off and sync
// off, M microbatches' forwards and backwards in a pipeline's order (two forwards before their
// backwards) gather each unit once and reduce-scatter it once, and give the gradients of the
// model's ordinary accumulation; unshard and reshard gather and free on demand; a call inside a
// backward is refused naming it. The same accumulation under every strategy: sync off reduces
// nothing, reduce_gradients then reduces each unit once and gives the ordinary accumulation's
// gradients (ZeRO-2, ZeRO-1, replicated and hybrid, at 4 ranks).
#include "tests/parity.h"

#include <functional>
#include <string>

namespace fsdp::testing {
namespace {

const gpt::Config kCfg{31, 8, 2, 2, 12, false};
constexpr int64_t kMicro = 4;

using Model = decltype(fsdp::fully_shard(gpt::make_gpt<true>(kCfg), c10::intrusive_ptr<c10d::ProcessGroup>(),
                                         FullyShardOptions()));

torch::Tensor micro(const torch::Tensor& t, int64_t m) {
  return t.narrow(0, m, 1);
}

// One GPT, `plain`, accumulating kMicro microbatches the model's own way (a backward each, each
// reducing), and its twin `piped` for the pipeline's order; x and y this rank's rows of one batch.
struct Twins {
  Twins(Rank& r, const FullyShardOptions& options, int64_t seed, int64_t rows)
      : plain(make(r, options)), piped(make(r, options)) {
    auto [bx, by] = gpt_batch(kCfg, seed, rows);
    x = local_rows(bx, r.rank, r.world_size);
    y = local_rows(by, r.rank, r.world_size);
    for (int64_t m = 0; m < kMicro; ++m) (gpt_loss(plain(micro(x, m)), micro(y, m)) / kMicro).backward();
  }
  static Model make(Rank& r, const FullyShardOptions& options) {
    torch::manual_seed(0);
    return fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, options);
  }
  /// piped's units holding parameters on this rank.
  int64_t units() const {
    int64_t n = 0;
    for (const auto& u : piped.units()) n += u.shard_numel > 0 ? 1 : 0;
    return n;
  }
  /// Two forwards of piped, then their backwards, twice (1F1B's warm-up on a stage); `between`
  /// after each pair.
  void pipeline_order(const std::function<void()>& between = {}) {
    for (int64_t m = 0; m < kMicro; m += 2) {
      auto l0 = gpt_loss(piped(micro(x, m)), micro(y, m)) / kMicro;
      auto l1 = gpt_loss(piped(micro(x, m + 1)), micro(y, m + 1)) / kMicro;
      l0.backward();
      l1.backward();
      if (between) between();
    }
  }
  /// piped's gradients are plain's.
  void expect_same_gradients(const std::string& label) {
    const auto want = plain->named_parameters();
    for (const auto& p : piped->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << label << ": " << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), want[p.key()].grad(), 1e-5, 1e-7)) << label << ": " << p.key();
    }
  }
  Model plain, piped;
  torch::Tensor x, y;
};

TEST(PipelineControls, GatherOnceReduceOnceAsAccumulationDoes) {
  run_ranks(2, [](Rank& r) {
    Twins t(r, test_options(), 2 * kMicro, kGlobalBatch);
    auto& piped = t.piped;
    const int64_t units = t.units();
    ASSERT_GE(units, 3) << "the root and the blocks";
    const CommStats before = piped.comm_stats();
    piped.set_reshard_after_forward(false);
    piped.set_reshard_after_backward(false);
    piped.set_requires_gradient_sync(false);
    // Gathered on demand between the pairs (the parameters full then, which the next forward must
    // not take for a step).
    t.pipeline_order([&] { piped.unshard(); });
    EXPECT_EQ(piped.comm_stats().reduce_scatters - before.reduce_scatters, 0) << "sync off: nothing reduced";
    const int64_t kept = piped.held_state_bytes();
    piped.reduce_gradients();
    EXPECT_LT(piped.held_state_bytes(), kept) << "the gathered memory kept until reduce_gradients resharded";
    const CommStats& after = piped.comm_stats();
    EXPECT_EQ(after.all_gathers - before.all_gathers, units) << "each unit gathered once";
    EXPECT_EQ(after.reduce_scatters - before.reduce_scatters, units) << "each unit reduce-scattered once";
    EXPECT_FALSE(piped.step_in_progress());
    t.expect_same_gradients("pipeline order");
    // On demand: gathered (the full parameters) and freed again; nothing is communicated to free.
    piped.set_reshard_after_forward(true);
    piped.set_reshard_after_backward(true);
    const int64_t held = piped.held_state_bytes();
    piped.unshard();
    for (const auto& u : piped.units()) EXPECT_TRUE(u.unsharded) << u.name;
    EXPECT_GT(piped.held_state_bytes(), held);
    EXPECT_EQ(piped->named_parameters()["wte.weight"].sizes(), (std::vector<int64_t>{31, 12})) << "the full weight";
    piped.reshard();
    EXPECT_EQ(piped->named_parameters()["wte.weight"].size(0), r.rank == 0 ? 16 : 15) << "this rank's rows again";
    for (const auto& u : piped.units()) EXPECT_FALSE(u.unsharded) << u.name;
    EXPECT_EQ(piped.held_state_bytes(), held);
    // Inside a backward: refused, naming the call.
    auto out = piped(micro(t.x, 0));
    out.register_hook([&](const torch::Tensor& g) {
      piped.reduce_gradients();
      return g;
    });
    const auto msg = error_of([&] { gpt_loss(out, micro(t.y, 0)).backward(); });
    EXPECT_NE(msg.find("fsdp::FSDPModule::reduce_gradients (rank " + std::to_string(r.rank) +
                       " of 2): called inside the model's forward or backward"),
              std::string::npos)
        << msg;
  });
}

TEST(PipelineControls, ReduceGradientsUnderEveryStrategy) {
  run_ranks(4, [](Rank& r) {
    for (const auto strategy : {ShardingStrategy::kShardGradOp, ShardingStrategy::kShardOptimizerState,
                                ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
      const std::string label = to_string(strategy);
      Twins t(r, test_options().strategy(strategy).shard_group_size(2), /*seed=*/8, /*rows=*/4 * kMicro);
      auto& piped = t.piped;
      const int64_t units = t.units();
      piped.set_reshard_after_forward(false);
      piped.set_reshard_after_backward(false);
      piped.set_requires_gradient_sync(false);
      const CommStats before = piped.comm_stats();
      auto reductions = [&] {
        const CommStats& s = piped.comm_stats();
        return s.reduce_scatters - before.reduce_scatters + s.all_reduces - before.all_reduces;
      };
      t.pipeline_order();
      EXPECT_EQ(reductions(), 0) << label << ": sync off, nothing reduced";
      piped.reduce_gradients();
      // One reduction per unit: a reduce-scatter, or the replicated strategies' all-reduce (hybrid:
      // a reduce-scatter inside the group and an all-reduce across the groups).
      const int64_t per_unit = strategy == ShardingStrategy::kHybridShard ? 2 : 1;
      EXPECT_EQ(reductions(), per_unit * units) << label;
      EXPECT_FALSE(piped.step_in_progress()) << label;
      t.expect_same_gradients(label);
      piped.set_requires_gradient_sync(true);
      piped.set_reshard_after_forward(true);
      piped.set_reshard_after_backward(true);
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
