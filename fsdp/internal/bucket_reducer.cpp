#include "fsdp/internal/bucket_reducer.h"

#include "fsdp/internal/reduce.h"

#include <ATen/ops/empty.h>

#include <utility>

namespace fsdp::detail {
namespace {

// Copies bucket `b`'s full gradients into `flat` at their offsets (zeros where none), recording
// which had one.
void pack_bucket(const std::vector<ParamSlot>& slots, bool full_views, const Bucket& b, const at::Tensor& flat,
                 std::vector<bool>& has_grad) {
  for (size_t i = b.first; i < b.last; ++i) {
    const auto& s = slots[i];
    at::Tensor dst = flat.narrow(0, s.offset, s.padded_numel());
    const at::Tensor& g = full_grad_of(s, full_views);
    has_grad[i] = g.defined();
    if (has_grad[i]) {
      dst.view(s.shape).copy_(g);
    } else {
      dst.zero_();
    }
  }
}

}  // namespace

std::vector<Bucket> make_buckets(const std::vector<ParamSlot>& slots, int64_t cap) {
  std::vector<Bucket> out;
  size_t last = slots.size();
  while (last > 0) {
    Bucket b;
    b.last = last;
    b.first = last;
    int64_t numel = 0;
    // At least one parameter per bucket; then add earlier ones while the bucket stays under the cap.
    do {
      --b.first;
      numel += slots[b.first].padded_numel();
    } while (b.first > 0 && numel + slots[b.first - 1].padded_numel() <= cap);
    b.offset = slots[b.first].offset;
    b.numel = numel;
    out.push_back(b);
    last = b.first;
  }
  return out;
}

bool BucketReducer::launch(std::vector<ParamSlot>& slots, bool full_views, bool all, const std::string& what) {
  const bool alone = ctx_.comm->world_size() == 1;
  while (next_ < buckets_.size()) {
    const Bucket& b = buckets_[next_];
    if (!all) {
      for (size_t i = b.first; i < b.last; ++i) {
        if (slots[i].requires_grad && !slots[i].grad_ready) return false;
      }
    }
    if (ctx_.in_place) {
      // Alone: the gradients are final as autograd left them (counted as issued).
      ctx_.comm->record(Call::kAllReduce, b.numel, what);
      keep_local_grads(slots, full_views, b.first, b.last);
    } else {
      if (next_ == 0) {
        out_ = at::empty({ctx_.numel}, ctx_.options);
        has_grad_.assign(slots.size(), false);
        work_.clear();
      }
      pack_bucket(slots, full_views, b, out_, has_grad_);
      if (ctx_.sample) ctx_.sample();  // the bucket's gradients and their copy, both alive
      for (size_t i = b.first; i < b.last; ++i) full_grad_of(slots[i], full_views) = at::Tensor();
      at::Tensor chunk = out_.narrow(0, b.offset, b.numel);
      if (alone) {  // packed only for the cast to the reduction's dtype
        ctx_.comm->record(Call::kAllReduce, b.numel, what);
      } else {
        work_.push_back(ctx_.comm->all_reduce_async(chunk, c10d::ReduceOp::SUM, what));
      }
    }
    ++next_;
    if (next_ == buckets_.size()) return true;
  }
  return false;
}

at::Tensor BucketReducer::finish(std::vector<bool>& has_grad) {
  for (auto& p : work_) ctx_.comm->wait(p);
  work_.clear();
  next_ = 0;
  has_grad = std::move(has_grad_);
  has_grad_.clear();
  return std::exchange(out_, at::Tensor());
}

void BucketReducer::abandon() {
  work_.clear();  // before the buffers
  next_ = 0;
  out_ = at::Tensor();
  has_grad_.clear();
}

}  // namespace fsdp::detail
