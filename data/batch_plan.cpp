#include "data/batch_plan.h"

#include "data/distributed_sampler.h"
#include "fsdp/internal/check.h"

namespace fsdp::data {

BatchPlan plan_batch(int64_t global_batch, int ranks, int64_t max_rows) {
  FSDP_CHECK(ranks >= 1, "fsdp::data::plan_batch: ", ranks, " ranks; there must be at least one.");
  FSDP_CHECK(global_batch >= 1, "fsdp::data::plan_batch: global batch ", global_batch, "; it must be >= 1.");
  FSDP_CHECK(max_rows >= 1, "fsdp::data::plan_batch: at most ", max_rows,
             " rows per micro-batch; it must be >= 1 (the rows one rank's forward and backward can hold).");
  FSDP_CHECK(global_batch % ranks == 0, "fsdp::data::plan_batch: the global batch of ", global_batch,
             " samples cannot be split over ", ranks, " data-parallel ranks into equal shares; ",
             divisible_sizes(global_batch, ranks), ".");
  BatchPlan p;
  p.global_batch = global_batch;
  p.ranks = ranks;
  p.rows_per_rank = global_batch / ranks;
  // The smallest divisor k of the share with share / k <= max_rows (k = share always is one).
  for (int64_t k = 1; k <= p.rows_per_rank; ++k) {
    if (p.rows_per_rank % k == 0 && p.rows_per_rank / k <= max_rows) {
      p.accumulation = k;
      p.micro_batch = p.rows_per_rank / k;
      break;
    }
  }
  return p;
}

std::string to_string(const BatchPlan& p) {
  return "global batch " + std::to_string(p.global_batch) + " = " + std::to_string(p.ranks) + " rank(s) x " +
         std::to_string(p.accumulation) + " micro-batch(es) x " + std::to_string(p.micro_batch) + " rows";
}

}  // namespace fsdp::data
