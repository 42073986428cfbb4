#include "fsdp/internal/buffer_pool.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace fsdp::detail {

at::Tensor BufferPool::take(int64_t numel, const at::TensorOptions& opts) {
  const int64_t bytes = numel * static_cast<int64_t>(opts.dtype().itemsize());
  // Newest first: the buffer given back last is the likeliest still in the CPU's caches.
  for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
    const at::Tensor& t = *it;
    if (static_cast<int64_t>(t.storage().nbytes()) == bytes && t.dtype() == opts.dtype() &&
        t.device() == opts.device()) {
      at::Tensor out = std::move(*it);
      free_.erase(std::next(it).base());
      cached_ -= bytes;
      ++reused_;
      return out;
    }
  }
  ++allocated_;
  return at::empty({numel}, opts);
}

void BufferPool::give_back(at::Tensor& t) {
  at::Tensor buffer = std::move(t);
  t = at::Tensor();
  if (!buffer.defined() || buffer.is_cuda() || buffer.storage().use_count() > 1 || buffer.use_count() > 1) return;
  const auto bytes = static_cast<int64_t>(buffer.storage().nbytes());
  // Full: this one is freed and those kept stay. (Freeing the oldest instead would, for a model
  // whose units' buffers do not all fit, evict each just before the next step needs it.)
  if (bytes == 0 || cached_ + bytes > cap()) return;
  cached_ += bytes;
  free_.push_back(std::move(buffer));
}

void BufferPool::note_unit(int64_t bytes) {
  largest_ = std::max(largest_, bytes);
}

void BufferPool::release() {
  free_.clear();
  cached_ = 0;
}

}  // namespace fsdp::detail
