// fsdp::pp::StageLayout: which pipeline rank holds which stage, with one or several stages per
// rank.
//
//   fsdp::pp::StageLayout layout(/*ranks=*/4, /*stages_per_rank=*/2, fsdp::pp::StageOrder::kLooped);
//   layout.stages_of(1);   // {1, 5}: rank r holds stages r, r + p, ... (interleaved 1F1B, looped BFS)
//   layout.rank_of(6);     // 2
//   StageLayout(4, 2, StageOrder::kVShape).stages_of(1);   // {1, 6}: r and 2p - 1 - r (ZBV, DualPipeV)
//
// Looped: the stages go round the ranks again and again, so each microbatch crosses every rank v
// times. V-shaped: down the ranks and back up, so rank 0 holds the first and the last stage (the
// embedding and the head on one rank, a tied weight in one place) and the turn at the last rank is
// local, without a transfer.
#pragma once

#include "fsdp/export.h"

#include <cstdint>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

enum class StageOrder { kLooped, kVShape };

/// "looped" or "v-shape".
std::string to_string(StageOrder order);

class StageLayout {
 public:
  /// `ranks` pipeline ranks (the mesh's pp size), each holding `stages_per_rank` stages. Throws
  /// std::invalid_argument for sizes below one.
  StageLayout(int64_t ranks, int64_t stages_per_rank = 1, StageOrder order = StageOrder::kLooped);

  int64_t ranks() const { return ranks_; }
  int64_t stages_per_rank() const { return per_rank_; }
  int64_t stages() const { return ranks_ * per_rank_; }
  StageOrder order() const { return order_; }
  /// The pipeline rank that holds stage `stage`.
  int64_t rank_of(int64_t stage) const;
  /// The stages pipeline rank `rank` holds, in increasing order.
  std::vector<int64_t> stages_of(int64_t rank) const;

 private:
  int64_t ranks_, per_rank_;
  StageOrder order_;
};

}  // namespace fsdp::pp

FSDP_PUBLIC_END
