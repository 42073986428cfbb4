// Reducing a unit's gradients, as functions of its slots (the collective itself is the caller's):
// pack the full gradients for a reduce-scatter or into all-reduce buckets, and put the reduced
// result where the sharded gradients live.
#pragma once

#include "fsdp/internal/unit_buffers.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace fsdp::detail {

/// kNoShard's all-reduce buckets: contiguous ranges of slots [first, last) at [offset, offset +
/// numel) of the flat gradient, in reverse parameter order (the order backward produces them),
/// each at most `cap` elements unless one parameter alone is larger.
struct Bucket {
  size_t first = 0, last = 0;
  int64_t offset = 0, numel = 0;
};
std::vector<Bucket> make_buckets(const std::vector<ParamSlot>& slots, int64_t cap);

/// Packs every full gradient (zeros where a parameter has none) into `packed`, rank-major
/// [W * shard_numel] (each parameter's chunks padded), for one reduce-scatter; `has_grad[i]` says
/// which had one.
void pack_grads(const std::vector<ParamSlot>& slots, bool full_views, int64_t W, int64_t shard_numel,
                const at::Tensor& packed, std::vector<bool>& has_grad);

/// One rank holds everything (world size 1): each full gradient becomes the sharded one (added to
/// it if there is one), with no copy, for slots [first, last).
void keep_local_grads(std::vector<ParamSlot>& slots, bool full_views, size_t first, size_t last);

/// Copies bucket `b`'s full gradients into `flat` at their offsets (zeros where none), recording
/// which had one.
void pack_bucket(const std::vector<ParamSlot>& slots, bool full_views, const Bucket& b, const at::Tensor& flat,
                 std::vector<bool>& has_grad);

/// The reduced (averaged) flat shard of gradients, added to each sharded gradient that exists, or
/// (the usual case) the sharded gradient becomes a view of it.
void add_to_sharded_grads(std::vector<ParamSlot>& slots, bool full_views, const at::Tensor& reduced,
                          const std::vector<bool>& has_grad);

/// ZeRO-1: the reduced rows go back into the full gradients (which every rank keeps), plus any
/// sharded gradient carried over; the sharded gradients become views of those rows.
void write_rows_into_full_grads(std::vector<ParamSlot>& slots, bool full_views, const at::Tensor& reduced,
                                const std::vector<bool>& has_grad, int64_t shard_rank);

}  // namespace fsdp::detail
