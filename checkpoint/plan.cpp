#include "checkpoint/plan.h"

namespace fsdp::checkpoint {

std::vector<WriteChunk> plan_writes(const std::vector<ShardSpec>& specs) {
  std::vector<WriteChunk> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ShardSpec& s = specs[i];
    const int64_t n = s.row_end - s.row_begin;  // rows this rank holds, as do its replicas
    const auto R = static_cast<int64_t>(s.replicas);
    // This replica's part: part k of R covers rows [k * n / R, (k + 1) * n / R) of the held ones.
    const int64_t k = (s.replica_rank + static_cast<int64_t>(i)) % R;
    const int64_t first = k * n / R, last = (k + 1) * n / R;
    if (last == first) continue;
    out.push_back(WriteChunk{i, s.row_begin + first, s.row_begin + last, first});
  }
  return out;
}

}  // namespace fsdp::checkpoint
