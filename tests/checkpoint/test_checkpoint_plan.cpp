// The save plan (checkpoint/plan.h): over all ranks, every row of every parameter is written
// exactly once, whatever the strategy (replicated, hybrid, ZeRO-1, mixed per unit), and the bytes
// add up to the model's from its shapes. One launch per world size covers every strategy.
#include "checkpoint/plan.h"
#include "tests/models.h"

#include <iostream>

namespace fsdp::testing {
namespace {

struct PlanCase {
  ShardingStrategy strategy;
  int group;   // hybrid's S (0: not hybrid)
  bool mixed;  // fc1 replicated, the rest as `strategy`
};

void check_plan(Rank& r, const PlanCase& c) {
  SCOPED_TRACE(strategy_case_label(c.strategy, r.world_size, c.group) + (c.mixed ? "_Mixed" : ""));
  auto net = std::make_shared<UnevenMLPImpl<true>>();
  if (c.mixed) net->fc1->set_sharding_strategy(ShardingStrategy::kNoShard);
  auto model = fsdp::fully_shard(net, r.pg, test_options(c.strategy, c.group));
  const auto specs = model.shard_specs();
  const auto chunks = checkpoint::plan_writes(specs);

  // How often each row of each parameter is written, summed over ranks: once, every one.
  int64_t bytes = 0, model_bytes = 0, rows_total = 0;
  std::vector<int64_t> row_offset;
  for (const auto& s : specs) {
    row_offset.push_back(rows_total);
    rows_total += s.layout.rows;
    model_bytes += s.layout.numel() * static_cast<int64_t>(c10::elementSize(s.dtype));
  }
  auto written = torch::zeros({rows_total}, torch::kLong);
  size_t last_spec = 0;
  for (const auto& w : chunks) {
    const ShardSpec& s = specs[w.spec];
    ASSERT_TRUE(w.spec >= last_spec) << "chunks in the specs' order";
    last_spec = w.spec;
    ASSERT_LT(w.row_begin, w.row_end) << s.name;
    ASSERT_GE(w.row_begin, s.row_begin) << s.name << ": only rows this rank holds";
    ASSERT_LE(w.row_end, s.row_end) << s.name;
    EXPECT_EQ(w.local_row, w.row_begin - s.row_begin) << s.name;
    written.narrow(0, row_offset[w.spec] + w.row_begin, w.row_end - w.row_begin).add_(1);
    bytes += w.bytes(s);
  }
  all_reduce_sum(r, written);
  EXPECT_TRUE(torch::equal(written, torch::ones_like(written))) << "rows written " << written;
  auto per_rank = torch::zeros({r.world_size}, torch::kLong);
  per_rank[r.rank] = bytes;
  all_reduce_sum(r, per_rank);
  EXPECT_EQ(per_rank.sum().item<int64_t>(), model_bytes) << "each unique byte once";
  const double mean = static_cast<double>(model_bytes) / r.world_size;
  if (r.rank == 0) {
    std::cout << strategy_case_label(c.strategy, r.world_size, c.group) << (c.mixed ? "_Mixed" : "")
              << ": bytes per rank " << per_rank << "max/mean " << per_rank.max().item<int64_t>() / mean << std::endl;
  }
}

void check_all_strategies(Rank& r) {
  const int W = r.world_size;
  std::vector<PlanCase> cases = {
      {ShardingStrategy::kFullShard, 0, false},           {ShardingStrategy::kShardGradOp, 0, false},
      {ShardingStrategy::kShardOptimizerState, 0, false}, {ShardingStrategy::kNoShard, 0, false},
      {ShardingStrategy::kHybridShard, 1, false},         {ShardingStrategy::kFullShard, 0, true}};
  if (W % 2 == 0 && W > 2) cases.push_back({ShardingStrategy::kHybridShard, 2, false});
  for (const auto& c : cases) check_plan(r, c);
}

TEST(CheckpointPlan, EveryRowWrittenOnceAtOneRank) {
  run_ranks(1, check_all_strategies);
}
TEST(CheckpointPlan, EveryRowWrittenOnceAtTwoRanks) {
  run_ranks(2, check_all_strategies);
}
TEST(CheckpointPlan, EveryRowWrittenOnceAtThreeRanks) {
  run_ranks(3, check_all_strategies);
}
TEST(CheckpointPlan, EveryRowWrittenOnceAtFourRanks) {
  run_ranks(4, check_all_strategies);
}

}  // namespace
}  // namespace fsdp::testing
