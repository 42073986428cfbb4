#include "checkpoint/plan.h"

#include "fsdp/internal/check.h"

#include <string>

namespace fsdp::checkpoint {

std::pair<int64_t, int64_t> replica_part(int64_t rows, int64_t replicas, int64_t replica_rank, size_t index) {
  // Part k of R covers rows [k * n / R, (k + 1) * n / R).
  const int64_t k = (replica_rank + static_cast<int64_t>(index % static_cast<size_t>(replicas))) % replicas;
  return {k * rows / replicas, (k + 1) * rows / replicas};
}

std::vector<WriteChunk> plan_writes(const std::vector<ShardSpec>& specs) {
  std::vector<WriteChunk> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ShardSpec& s = specs[i];
    // Rows this rank holds, as do its replicas.
    const auto [first, last] = replica_part(s.row_end - s.row_begin, s.replicas, s.replica_rank, i);
    if (last == first) continue;
    out.push_back(WriteChunk{i, s.row_begin + first, s.row_begin + last, first});
  }
  return out;
}

void refuse_tensor_parallel(const std::vector<ShardSpec>& specs, const std::string& operation) {
  for (const ShardSpec& s : specs) {
    FSDP_CHECK(s.tp_size <= 1, operation, ": the model is tensor parallel (over ", s.tp_size,
               " ranks), and this checkpoint format cannot hold tensor-parallel parts yet (parameter '", s.name,
               "' is ", s.tp.split() ? "split along dimension " + std::to_string(s.tp.dim) : std::string("replicated"),
               " over them). Until it can, save a model wrapped without tensor parallelism.");
  }
}

}  // namespace fsdp::checkpoint
