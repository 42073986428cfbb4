// Reducing a unit's gradients, as functions of its slots (the collective itself is the caller's):
// pack the full gradients for a reduce-scatter, keep them in place over one rank, and put the
// reduced result where the sharded gradients live. (kNoShard's buckets: bucket_reducer.h.)
#pragma once

#include "fsdp/internal/unit_buffers.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace fsdp::detail {

/// Packs every full gradient (zeros where a parameter has none) into `packed`, rank-major
/// [W * shard_numel] (each parameter's chunks padded), for one reduce-scatter; `has_grad[i]` says
/// which had one.
void pack_grads(const std::vector<ParamSlot>& slots, bool full_views, int64_t W, int64_t shard_numel,
                const at::Tensor& packed, std::vector<bool>& has_grad);

/// One rank holds everything (world size 1): each full gradient becomes the sharded one (added to
/// it if there is one), with no copy, for slots [first, last).
void keep_local_grads(std::vector<ParamSlot>& slots, bool full_views, size_t first, size_t last);

/// The reduced (averaged) flat shard of gradients, added to each sharded gradient that exists, or
/// (the usual case) the sharded gradient becomes a view of it.
void add_to_sharded_grads(std::vector<ParamSlot>& slots, bool full_views, const at::Tensor& reduced,
                          const std::vector<bool>& has_grad);

/// ZeRO-1: the reduced rows go back into the full gradients (which every rank keeps), plus any
/// sharded gradient carried over; the sharded gradients become views of those rows.
void write_rows_into_full_grads(std::vector<ParamSlot>& slots, bool full_views, const at::Tensor& reduced,
                                const std::vector<bool>& has_grad, int64_t shard_rank);

}  // namespace fsdp::detail
