#include "checkpoint/plan.h"

#include "fsdp/internal/check.h"

#include <string>

namespace fsdp::checkpoint {

std::pair<int64_t, int64_t> replica_part(int64_t rows, int64_t replicas, int64_t replica_rank, size_t index) {
  // Part k of R covers rows [k * n / R, (k + 1) * n / R).
  const int64_t k = (replica_rank + static_cast<int64_t>(index % static_cast<size_t>(replicas))) % replicas;
  return {k * rows / replicas, (k + 1) * rows / replicas};
}

TensorPlace place_of(const ShardSpec& s) {
  TensorPlace place;
  place.shape = s.global_shape;
  if (!s.tp.split()) return place;
  const auto dim = static_cast<size_t>(s.tp.dim);
  FSDP_CHECK(dim < s.global_shape.size(), "parameter '", s.name, "' is split along dimension ", s.tp.dim, " but has ",
             s.global_shape.size(), " dimension(s).");
  const int64_t n = s.global_shape[dim];  // every part alike (the layers split evenly)
  place.shape[dim] = n * s.tp.parts;
  if (dim == 0) {
    place.row_offset = n * s.tp.part;
  } else {
    place.inner.offsets.assign(s.global_shape.size() - 1, 0);
    place.inner.lengths.assign(s.global_shape.begin() + 1, s.global_shape.end());
    place.inner.offsets[dim - 1] = n * s.tp.part;
  }
  return place;
}

std::vector<WriteChunk> plan_writes(const std::vector<ShardSpec>& specs) {
  std::vector<WriteChunk> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ShardSpec& s = specs[i];
    // Rows this rank holds, as do its replicas: a parameter that tensor parallelism does not split
    // has tp_size times as many, the tensor-parallel ranks of each replica group.
    const bool alike_over_tp = !s.tp.split() && s.tp_size > 1;
    const int64_t replicas = alike_over_tp ? int64_t{s.replicas} * s.tp_size : s.replicas;
    const int64_t replica_rank = alike_over_tp ? int64_t{s.replica_rank} * s.tp_size + s.tp_rank : s.replica_rank;
    const auto [first, last] = replica_part(s.row_end - s.row_begin, replicas, replica_rank, i);
    if (last == first) continue;
    const TensorPlace place = place_of(s);
    out.push_back(WriteChunk{i, place.row_offset + s.row_begin + first, place.row_offset + s.row_begin + last, first,
                             place.inner});
  }
  return out;
}

}  // namespace fsdp::checkpoint
