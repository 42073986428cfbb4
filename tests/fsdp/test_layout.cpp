// The row layout's pure functions (fsdp/shard_layout.h) against cases worked out by hand.
#include "fsdp/shard_layout.h"

#include <gtest/gtest.h>

namespace fsdp {
namespace {

std::vector<int64_t> rows_per_rank(const RowLayout& l) {
  std::vector<int64_t> out;
  for (int64_t r = 0; r < l.shards; ++r) out.push_back(l.local_rows(r));
  return out;
}

TEST(Layout, RowsPerRank) {
  // 13 rows over 4 ranks: c = 4, so 4, 4, 4 and the last row alone.
  const RowLayout a = row_layout({13, 7}, 4);
  EXPECT_EQ(a.chunk_rows(), 4);
  EXPECT_EQ(a.row_numel, 7);
  EXPECT_EQ(rows_per_rank(a), (std::vector<int64_t>{4, 4, 4, 1}));
  EXPECT_EQ(a.begin(3), 12);
  EXPECT_EQ(a.end(3), 13);
  EXPECT_EQ(a.padded_numel(), 28);
  // 5 rows over 4: c = 2, so 2, 2, 1, 0; rank 3 starts past the end and holds nothing.
  const RowLayout b = row_layout({5}, 4);
  EXPECT_EQ(rows_per_rank(b), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(b.begin(3), 5);
  EXPECT_EQ(b.end(3), 5);
  // 3 rows over 4: c = 1; the fourth rank holds none.
  EXPECT_EQ(rows_per_rank(row_layout({3, 5}, 4)), (std::vector<int64_t>{1, 1, 1, 0}));
  // Even: 6 over 3.
  EXPECT_EQ(rows_per_rank(row_layout({6, 2, 2}, 3)), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(row_layout({6, 2, 2}, 3).row_numel, 4);
  // Replicated (S = 1): everything on the one shard rank, no padding.
  const RowLayout d = row_layout({13, 7}, 1);
  EXPECT_EQ(rows_per_rank(d), (std::vector<int64_t>{13}));
  EXPECT_EQ(d.padded_numel(), 91);
  // No rows: nothing anywhere.
  EXPECT_EQ(rows_per_rank(row_layout({0, 3}, 2)), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(row_layout({0, 3}, 2).padded_numel(), 0);
}

TEST(Layout, ScalarsAndLocalShapes) {
  // A scalar is one row of one element: rank 0 holds it, the others hold [0].
  const RowLayout s = row_layout({}, 3);
  EXPECT_EQ(s.rows, 1);
  EXPECT_EQ(s.padded_numel(), 1);
  EXPECT_EQ(local_shape({}, s, 0), (std::vector<int64_t>{}));
  EXPECT_EQ(local_shape({}, s, 1), (std::vector<int64_t>{0}));
  const RowLayout w = row_layout({5, 3}, 4);
  EXPECT_EQ(local_shape({5, 3}, w, 0), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(local_shape({5, 3}, w, 3), (std::vector<int64_t>{0, 3}));
}

TEST(Layout, FlatOffsetsArePaddedChunksInOrder) {
  // Linear(7, 13) over 4 ranks: weight c = 4 rows of 7 (28), bias c = 4 rows of 1 (4); then a
  // scalar (1): offsets 0, 28, 32 and a 33-element flat shard per rank.
  const std::vector<RowLayout> unit{row_layout({13, 7}, 4), row_layout({13}, 4), row_layout({}, 4)};
  EXPECT_EQ(flat_offsets(unit), (std::vector<int64_t>{0, 28, 32, 33}));
  EXPECT_EQ(flat_offsets({}), (std::vector<int64_t>{0}));
}

}  // namespace
}  // namespace fsdp

#include "fsdp/internal/lifecycle.h"

namespace fsdp::detail {
namespace {

// The unit's lifecycle table: the transitions the library takes are allowed, the others are an
// internal error naming the unit and both states.
TEST(Lifecycle, AllowedTransitions) {
  using S = UnitState;
  EXPECT_TRUE(allowed(S::kSharded, S::kGathering));
  EXPECT_TRUE(allowed(S::kSharded, S::kUnsharded));
  EXPECT_TRUE(allowed(S::kGathering, S::kUnsharded));
  EXPECT_TRUE(allowed(S::kGathering, S::kSharded));  // a prefetch dropped
  EXPECT_TRUE(allowed(S::kUnsharded, S::kKeptForBackward));
  EXPECT_TRUE(allowed(S::kKeptForBackward, S::kUnsharded));
  EXPECT_TRUE(allowed(S::kKeptForBackward, S::kSharded));
  EXPECT_FALSE(allowed(S::kUnsharded, S::kGathering));      // gathered already
  EXPECT_FALSE(allowed(S::kSharded, S::kKeptForBackward));  // nothing gathered to keep
  EXPECT_FALSE(allowed(S::kGathering, S::kKeptForBackward));
  S s = S::kSharded;
  transition(s, S::kGathering, "h.0");
  EXPECT_EQ(s, S::kGathering);
  try {
    transition(s, S::kKeptForBackward, "h.0");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unit 'h.0' cannot go from gathering to kept for backward"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace fsdp::detail
