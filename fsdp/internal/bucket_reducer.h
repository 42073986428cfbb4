// kNoShard's gradient reduction, as PyTorch DDP's: a unit's gradients in buckets of about
// FullyShardOptions::bucket_bytes, each all-reduced as soon as backward has produced every gradient
// in it. Buckets go out in one fixed order on every rank (Gloo pairs collectives by order): bucket b
// only after b - 1. The summed flat gradients then take the unit's common path (divide, cast back,
// become the sharded gradients: Unit::finish_reduce). Internal to the library.
#pragma once

#include "fsdp/internal/comm.h"
#include "fsdp/internal/unit_buffers.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Contiguous slots [first, last) at [offset, offset + numel) of the flat gradient, in reverse
/// parameter order (the order backward produces them), each at most `cap` elements unless one
/// parameter alone is larger.
struct Bucket {
  size_t first = 0, last = 0;
  int64_t offset = 0, numel = 0;
};
std::vector<Bucket> make_buckets(const std::vector<ParamSlot>& slots, int64_t cap);

class BucketReducer {
 public:
  /// What the buckets are reduced with: the world's Comm, the flat gradient's options (the
  /// reduction's dtype), its size (the flat shard's), and whether the gradients are final as autograd leaves them
  /// (one rank, no cast: nothing is packed or sent, only counted). `sample` is called where a
  /// bucket's gradients and their packed copy are both alive (state tracking).
  struct Context {
    Comm* comm = nullptr;
    at::TensorOptions options;
    int64_t numel = 0;
    bool in_place = false;
    std::function<void()> sample;
  };

  BucketReducer() = default;
  BucketReducer(std::vector<Bucket> buckets, Context context)
      : buckets_(std::move(buckets)), ctx_(std::move(context)) {}

  /// Launches every bucket whose gradients are all ready, in order (`all`: every remaining one,
  /// zeros for gradients that never came). Returns true when this call launched the last one: the
  /// unit's reduction is then in flight. `what` names the all-reduces in errors.
  bool launch(std::vector<ParamSlot>& slots, bool full_views, bool all, const std::string& what);
  /// Some but not all buckets were launched in this backward (unused parameters hold the rest).
  bool partly_launched() const { return next_ > 0 && next_ < buckets_.size(); }
  bool all_launched() const { return next_ == buckets_.size(); }
  /// Waits for every launched bucket and returns the summed flat gradients (undefined when they
  /// stayed in place, Context::in_place), with which slots had a gradient; resets for the next backward.
  at::Tensor finish(std::vector<bool>& has_grad);
  /// Forgets what a failed backward launched (after the caller waited, or gave up on, the work).
  void abandon();

 private:
  std::vector<Bucket> buckets_;
  Context ctx_;
  size_t next_ = 0;
  at::Tensor out_;
  std::vector<bool> has_grad_;
  // Declared last, destroyed first (see Unit's Pendings).
  std::vector<Pending> work_;
};

}  // namespace fsdp::detail
