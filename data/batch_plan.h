// A constant global batch across numbers of ranks: the micro-batch and the gradient accumulation
// that keep one optimizer step's samples, and so its update, the same on 1, 2, 3 or 64 ranks.
//
//   auto plan = fsdp::data::plan_batch(/*global_batch=*/256, world_size, /*max_rows=*/8);
//   // 4 ranks: 64 rows each, in plan.accumulation = 8 micro-batches of plan.micro_batch = 8 rows
//   for (int64_t m = 0; m < plan.accumulation; ++m) {
//     model.set_requires_gradient_sync(m == plan.accumulation - 1);
//     (loss_of(rows m*8 .. m*8+7 of this rank's share) / plan.accumulation).backward();
//   }
//
// With equal micro-batches everywhere, the mean of the micro-batches' mean losses over ranks and
// accumulation steps is the global batch's mean, so the gradient and the update are the global
// batch's whatever the split (up to the order of floating-point sums).
#pragma once

#include "fsdp/export.h"

#include <cstdint>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp::data {

struct BatchPlan {
  int64_t global_batch = 0;   ///< samples per optimizer step, over every data-parallel rank
  int ranks = 1;              ///< data-parallel ranks
  int64_t rows_per_rank = 0;  ///< global_batch / ranks: each rank's share of a step
  int64_t micro_batch = 0;    ///< rows per forward and backward on one rank
  int64_t accumulation = 1;   ///< micro-batches per step: micro_batch * accumulation == rows_per_rank
};

/// The fewest micro-batches (the largest micro-batch of at most `max_rows` rows) that split each
/// rank's share of `global_batch` into equal parts. Refused: a global batch `ranks` cannot divide
/// (the message lists the ones that work), max_rows < 1.
BatchPlan plan_batch(int64_t global_batch, int ranks, int64_t max_rows);

/// "global batch 256 = 4 rank(s) x 8 micro-batch(es) x 8 rows".
std::string to_string(const BatchPlan& plan);

}  // namespace fsdp::data

FSDP_PUBLIC_END
