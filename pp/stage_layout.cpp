#include "pp/stage_layout.h"

#include <stdexcept>

namespace fsdp::pp {

std::string to_string(StageOrder order) {
  return order == StageOrder::kLooped ? "looped" : "v-shape";
}

StageLayout::StageLayout(int64_t ranks, int64_t stages_per_rank, StageOrder order)
    : ranks_(ranks), per_rank_(stages_per_rank), order_(order) {
  if (ranks < 1 || stages_per_rank < 1) {
    throw std::invalid_argument("fsdp::pp::StageLayout: " + std::to_string(ranks) + " ranks of " +
                                std::to_string(stages_per_rank) + " stages each; both must be at least 1");
  }
}

int64_t StageLayout::rank_of(int64_t stage) const {
  if (stage < 0 || stage >= stages()) {
    throw std::invalid_argument("fsdp::pp::StageLayout: stage " + std::to_string(stage) + " is outside [0, " +
                                std::to_string(stages()) + ")");
  }
  const int64_t round = stage / ranks_, place = stage % ranks_;
  // V-shaped: the odd rounds run back up the ranks.
  return order_ == StageOrder::kVShape && round % 2 == 1 ? ranks_ - 1 - place : place;
}

std::vector<int64_t> StageLayout::stages_of(int64_t rank) const {
  std::vector<int64_t> mine;
  for (int64_t s = 0; s < stages(); ++s) {
    if (rank_of(s) == rank) mine.push_back(s);
  }
  return mine;
}

}  // namespace fsdp::pp
