// The strategy traits (fsdp/strategy.h): the formulas against values worked out by hand, and
// docs/strategies.md's table against the traits.
#include "fsdp/strategy.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp {
namespace {

TEST(StrategyTraits, FormulasByHand) {
  // Ψ = 1000 parameters on N = 4 ranks, hybrid groups of S = 2; root 100, largest unit 200.
  const FormulaInputs in{1000, 100, 200, 4, 2};
  EXPECT_DOUBLE_EQ(state_bytes_at_step(ShardingStrategy::kFullShard, in), 16.0 * 1000 / 4);
  EXPECT_DOUBLE_EQ(state_bytes_at_step(ShardingStrategy::kShardGradOp, in), 16.0 * 1000 / 4);
  EXPECT_DOUBLE_EQ(state_bytes_at_step(ShardingStrategy::kShardOptimizerState, in), 8.0 * 1000 + 8.0 * 1000 / 4);
  EXPECT_DOUBLE_EQ(state_bytes_at_step(ShardingStrategy::kNoShard, in), 16.0 * 1000);
  EXPECT_DOUBLE_EQ(state_bytes_at_step(ShardingStrategy::kHybridShard, in), 16.0 * 1000 / 2);
  // Peaks: the gathered root and two units (4 bytes each) for full and hybrid; grad-op's whole
  // gathered model; and with sharded gradients the root's and a unit's full gradients plus a
  // unit's packed ones (4 bytes each).
  const double grads = 4.0 * (100 + 200) + 4.0 * 200;
  EXPECT_DOUBLE_EQ(state_bytes_peak(ShardingStrategy::kFullShard, in), 4000 + 4.0 * (100 + 2 * 200) + grads);
  EXPECT_DOUBLE_EQ(state_bytes_peak(ShardingStrategy::kHybridShard, in), 8000 + 4.0 * (100 + 2 * 200) + grads);
  EXPECT_DOUBLE_EQ(state_bytes_peak(ShardingStrategy::kShardGradOp, in), 4.0 * 1000 + 12.0 * 1000 / 4 + grads);
  EXPECT_DOUBLE_EQ(state_bytes_peak(ShardingStrategy::kShardOptimizerState, in), 8.0 * 1000 + 8.0 * 1000 / 4);
  EXPECT_DOUBLE_EQ(state_bytes_peak(ShardingStrategy::kNoShard, in), 16000);
  // Mixed precision (2-byte param_dtype): the same state at the step; what is gathered halves.
  FormulaInputs mixed = in;
  mixed.param_bytes = 2;
  EXPECT_DOUBLE_EQ(state_bytes_at_step(ShardingStrategy::kFullShard, mixed), 16.0 * 1000 / 4);
  // The full gradients are param_dtype too; the packed ones reduce_dtype (fp32 here).
  const double mixed_grads = 2.0 * (100 + 200) + 4.0 * 200;
  EXPECT_DOUBLE_EQ(state_bytes_peak(ShardingStrategy::kFullShard, mixed), 4000 + 2.0 * (100 + 2 * 200) + mixed_grads);
  EXPECT_DOUBLE_EQ(state_bytes_peak(ShardingStrategy::kHybridShard, mixed), 8000 + 2.0 * (100 + 2 * 200) + mixed_grads);
  EXPECT_DOUBLE_EQ(state_bytes_peak(ShardingStrategy::kShardGradOp, mixed), 2.0 * 1000 + 12.0 * 1000 / 4 + mixed_grads);
  // Communication: 3Ψ when gathered twice, 2Ψ otherwise; hybrid adds 2Ψ/S across its groups, only
  // when there are several groups.
  EXPECT_DOUBLE_EQ(comm_elements(ShardingStrategy::kFullShard, in), 3000);
  EXPECT_DOUBLE_EQ(comm_elements(ShardingStrategy::kShardGradOp, in), 2000);
  EXPECT_DOUBLE_EQ(comm_elements(ShardingStrategy::kNoShard, in), 2000);
  EXPECT_DOUBLE_EQ(comm_elements(ShardingStrategy::kHybridShard, in), 3000 + 2.0 * 1000 / 2);
  EXPECT_DOUBLE_EQ(comm_elements(ShardingStrategy::kHybridShard, FormulaInputs{1000, 0, 0, 2, 2}), 3000);
}

TEST(StrategyTraits, NamesAndFlags) {
  for (const auto& t : kStrategies) {
    EXPECT_EQ(&traits(t.strategy), &t) << t.name;  // the table is indexed by the enum
    ShardingStrategy s{};
    ASSERT_TRUE(strategy_from_string(t.name, s)) << t.name;
    EXPECT_EQ(s, t.strategy);
  }
  ShardingStrategy s{};
  EXPECT_FALSE(strategy_from_string("zero3", s));
}

// Each strategy's row of docs/strategies.md holds the traits' formulas, cell for cell.
TEST(StrategyTraits, DocsTableIsTheTraits) {
  std::ifstream f(FSDP_SOURCE_DIR "/docs/strategies.md");
  ASSERT_TRUE(f) << "docs/strategies.md";
  const char* names[] = {"kFullShard", "kShardGradOp", "kShardOptimizerState", "kNoShard", "kHybridShard"};
  std::vector<std::vector<std::string>> rows(kStrategies.size());
  for (std::string line; std::getline(f, line);) {
    for (size_t i = 0; i < kStrategies.size(); ++i) {
      if (line.rfind(std::string("| `") + names[i] + "`", 0) != 0) continue;
      std::istringstream cells(line);
      for (std::string cell; std::getline(cells, cell, '|');) {
        const auto b = cell.find_first_not_of(' '), e = cell.find_last_not_of(' ');
        rows[i].push_back(b == std::string::npos ? "" : cell.substr(b, e - b + 1));
      }
    }
  }
  for (size_t i = 0; i < kStrategies.size(); ++i) {
    const StrategyTraits& t = traits(static_cast<ShardingStrategy>(i));
    ASSERT_GE(rows[i].size(), 6u) << "no table row for " << names[i];
    // cells: "", strategy, names, at the step, peak, communication, ...
    EXPECT_EQ(rows[i][3], t.formula_at_step) << names[i];
    EXPECT_EQ(rows[i][4], t.formula_peak) << names[i];
    EXPECT_EQ(rows[i][5], t.formula_comm) << names[i];
  }
  // The mixed-precision table: rows named by the strategies' names, for those that allow it.
  f.clear();
  f.seekg(0);
  std::map<std::string, std::vector<std::string>> mixed;
  for (std::string line; std::getline(f, line);) {
    for (const auto& t : kStrategies) {
      if (line.rfind(std::string("| ") + t.name + " |", 0) != 0) continue;
      std::istringstream cells(line);
      for (std::string cell; std::getline(cells, cell, '|');) {
        const auto b = cell.find_first_not_of(' '), e = cell.find_last_not_of(' ');
        mixed[t.name].push_back(b == std::string::npos ? "" : cell.substr(b, e - b + 1));
      }
    }
  }
  for (const auto& t : kStrategies) {
    if (std::string(t.formula_peak_mixed).empty()) {
      EXPECT_EQ(mixed.count(t.name), 0u) << t.name << " refuses mixed precision";
      continue;
    }
    ASSERT_GE(mixed[t.name].size(), 4u) << "no mixed-precision row for " << t.name;
    EXPECT_EQ(mixed[t.name][2], t.formula_at_step) << t.name;
    EXPECT_EQ(mixed[t.name][3], t.formula_peak_mixed) << t.name;
  }
}

}  // namespace
}  // namespace fsdp
