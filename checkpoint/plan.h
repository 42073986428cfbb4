// What this rank writes of each parameter in a checkpoint, and of each optimizer moment, which has
// its parameter's layout (fsdp/shard_spec.h): every unique byte once over all ranks, spread over
// the ranks that hold it, so that per-rank bytes stay balanced however the model is replicated.
#pragma once

#include "checkpoint/manifest.h"
#include "fsdp/export.h"
#include "fsdp/shard_spec.h"

#include <cstdint>
#include <utility>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::checkpoint {

/// Where a parameter's rows on this rank lie in the whole tensor a checkpoint holds. Without tensor
/// parallelism, its global_shape and rows. A tensor-parallel part (ShardSpec::tp) split along
/// dimension 0 (a column-parallel weight, a vocabulary-parallel embedding) is rows shifted by
/// part x its rows; one split along dimension d >= 1 (a row-parallel weight) is every row, within
/// [part x n, (part + 1) x n) along d: an InnerBox.
struct TensorPlace {
  std::vector<int64_t> shape;  ///< the whole tensor's
  int64_t row_offset = 0;      ///< added to the spec's global rows
  InnerBox inner;              ///< along dimensions 1 and on (whole unless split along one)
};
TensorPlace place_of(const ShardSpec& s);

/// Rows [row_begin, row_end) of parameter `spec` (an index into FSDPModule::shard_specs()), within
/// `inner`, that this rank writes: rows it holds, `local_row` rows into its local tensor.
struct WriteChunk {
  size_t spec = 0;
  int64_t row_begin = 0, row_end = 0;  ///< rows of the whole tensor (TensorPlace)
  int64_t local_row = 0;               ///< into the spec's local rows
  InnerBox inner;
  /// Bytes of these rows of `s`.
  int64_t bytes(const ShardSpec& s) const {
    return (row_end - row_begin) * s.layout.row_numel * static_cast<int64_t>(c10::elementSize(s.dtype));
  }
};

/// Which rows of each parameter this rank writes, in `specs`' order. Rows held by one rank are
/// written by it; rows held by R replicas (replicated units, hybrid's groups, and the T
/// tensor-parallel ranks for a parameter they do not split) are split into R contiguous parts of
/// equal size (give or take a row), one per replica, the parts rotating with the parameter's index
/// so that tensors of a row or a few spread over the replicas too. The same call on every rank of
/// the mesh gives each element of each parameter to exactly one rank. No chunk for a parameter (or
/// a part) with no rows here.
std::vector<WriteChunk> plan_writes(const std::vector<ShardSpec>& specs);

/// The rows [first, last) out of `rows` held alike by `replicas` ranks that replica `replica_rank`
/// writes, for the `index`-th tensor: part (replica_rank + index) % replicas of `replicas` equal
/// contiguous parts. plan_writes uses it; so do tensors every rank holds whole (buffers).
std::pair<int64_t, int64_t> replica_part(int64_t rows, int64_t replicas, int64_t replica_rank, size_t index);

}  // namespace fsdp::checkpoint

FSDP_PUBLIC_END
