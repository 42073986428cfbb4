// What this rank writes of each parameter in a checkpoint, and of each optimizer moment, which has
// its parameter's layout (fsdp/shard_spec.h): every unique byte once over all ranks, spread over
// the ranks that hold it, so that per-rank bytes stay balanced however the model is replicated.
#pragma once

#include "fsdp/shard_spec.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace fsdp::checkpoint {

/// Rows [row_begin, row_end) of parameter `spec` (an index into FSDPModule::shard_specs()) that
/// this rank writes: rows it holds, `local_row` rows into its local tensor.
struct WriteChunk {
  size_t spec = 0;
  int64_t row_begin = 0, row_end = 0;  ///< global rows
  int64_t local_row = 0;               ///< row_begin - the spec's row_begin
  /// Bytes of these rows of `s`.
  int64_t bytes(const ShardSpec& s) const {
    return (row_end - row_begin) * s.layout.row_numel * static_cast<int64_t>(c10::elementSize(s.dtype));
  }
};

/// Which rows of each parameter this rank writes, in `specs`' order. Rows held by one rank are
/// written by it; rows held by R replicas (replicated units, hybrid's groups) are split into R
/// contiguous parts of equal size (give or take a row), one per replica, the parts rotating with
/// the parameter's index so that tensors of a row or a few spread over the replicas too. The same
/// call on every rank gives each row of each parameter to exactly one rank. No chunk for a
/// parameter (or a part) with no rows here.
std::vector<WriteChunk> plan_writes(const std::vector<ShardSpec>& specs);

/// Throws, naming `operation`, when `specs` describe a tensor-parallel model (ShardSpec::tp_size >
/// 1): this format records each tensor's rows, not a part along another dimension, so the ranks'
/// parts would overwrite each other. Checkpoints of tensor-parallel models come with N-dimensional
/// chunks (docs/roadmap.md, issue 27).
void refuse_tensor_parallel(const std::vector<ShardSpec>& specs, const std::string& operation);

/// The rows [first, last) out of `rows` held alike by `replicas` ranks that replica `replica_rank`
/// writes, for the `index`-th tensor: part (replica_rank + index) % replicas of `replicas` equal
/// contiguous parts. plan_writes uses it; so do tensors every rank holds whole (buffers).
std::pair<int64_t, int64_t> replica_part(int64_t rows, int64_t replicas, int64_t replica_rank, size_t index);

}  // namespace fsdp::checkpoint
