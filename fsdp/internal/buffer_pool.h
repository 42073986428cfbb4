// Where a unit's temporary buffers come from: the all-gather's output, the unsharded storage while
// the unit is gathered, and the packed gradients of a reduce-scatter. Each step needs the same
// sizes again, so they are kept and reused instead of being freed and allocated anew (on CPU,
// buffers above glibc's mmap threshold come back as fresh pages that fault in, zeroed, one by one:
// that cost more than the copies themselves). Internal to the library.
//
// Bounded: a buffer is kept only while the free bytes stay within the cap, the buffers of the units
// that can be in flight at once (the root, kept gathered through the step, the unit computing and
// FullyShardOptions::prefetch more, each with an all-gather output and its unsharded storage, or
// its packed gradients, of the largest unit's size). A strategy that keeps every unit gathered
// from forward to backward (kShardGradOp) holds more than that live and allocates the excess.
// Buffers are matched by exact size, so live bytes stay exact; a model whose units have many
// different sizes keeps those that fit and allocates the others each step.
// Kept bytes are not live model state: FSDPModule::held_state_bytes leaves them out and
// FSDPModule::buffer_cache_stats reports them.
#pragma once

#include "fsdp/comm_stats.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdp::detail {

class BufferPool {
 public:
  /// Keeps at most `buffers_per_unit` buffers of the largest unit free.
  explicit BufferPool(int64_t buffers_per_unit) : per_unit_(buffers_per_unit) {}

  /// A contiguous 1-D tensor of `numel` elements, contents undefined: a kept buffer of the same
  /// size, dtype and device if there is one, else new memory. CUDA memory is never kept here (the
  /// caching allocator does that).
  at::Tensor take(int64_t numel, const at::TensorOptions& opts);
  /// Takes back a buffer from take() (and resets `t`). One that another tensor still references
  /// (a backend that has not released its work) is not kept: its memory goes with the last owner.
  void give_back(at::Tensor& t);
  /// A unit whose buffers are `bytes` large exists: the cap follows the largest.
  void note_unit(int64_t bytes);
  /// Frees every kept buffer.
  void release();

  int64_t cap() const { return per_unit_ * largest_; }
  BufferCacheStats stats() const { return {cached_, cap(), reused_, allocated_}; }

 private:
  int64_t per_unit_;
  int64_t largest_ = 0;
  int64_t cached_ = 0;
  int64_t reused_ = 0, allocated_ = 0;
  std::vector<at::Tensor> free_;  // oldest first
};

}  // namespace fsdp::detail
