#include "fsdp/internal/reduce.h"

#include <ATen/ops/_chunk_cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <utility>

namespace fsdp::detail {

void pack_grads(const std::vector<ParamSlot>& slots, bool full_views, int64_t W, int64_t shard_numel,
                const at::Tensor& packed, std::vector<bool>& has_grad) {
  // One copy into rank-major [W, shard_numel]: chunk-cat pads each parameter's W chunks.
  std::vector<at::Tensor> grads;
  grads.reserve(slots.size());
  has_grad.assign(slots.size(), false);
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& s = slots[i];
    has_grad[i] = full_grad_of(s, full_views).defined();
    if (s.padded_numel() == 0) continue;  // no elements (e.g. a [0, k] parameter): nothing to send
    at::Tensor g = full_grad_of(s, full_views);
    if (!g.defined()) g = at::zeros(s.shape, packed.options());
    grads.push_back(s.shape.empty() ? g.view({1}) : g);
  }
  at::Tensor out = packed.view({W, shard_numel});
  at::_chunk_cat_out(out, grads, 0, W);
}

void keep_local_grads(std::vector<ParamSlot>& slots, bool full_views, size_t first, size_t last) {
  for (size_t i = first; i < last; ++i) {
    auto& s = slots[i];
    at::Tensor full = std::exchange(full_grad_of(s, full_views), at::Tensor());
    if (!full.defined()) continue;
    at::Tensor& g = shard_grad_of(s, full_views);
    if (g.defined()) {
      g.add_(full.reshape(g.sizes()));  // accumulating across backward passes
    } else if (full.sizes() == s.sharded.sizes()) {
      g = std::move(full);  // what plain LibTorch's AccumulateGrad leaves on the parameter
    } else {
      g = alias_rows(full.contiguous(), 0, s.sharded.sizes());
    }
  }
}

void add_to_sharded_grads(std::vector<ParamSlot>& slots, bool full_views, const at::Tensor& reduced,
                          const std::vector<bool>& has_grad) {
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!has_grad[i]) continue;
    auto& s = slots[i];
    at::Tensor view = alias_rows(reduced, s.offset, s.sharded.sizes());
    at::Tensor& g = shard_grad_of(s, full_views);
    if (g.defined()) {
      g.add_(view);  // accumulating across backward passes
    } else {
      g = view;
    }
  }
}

void write_rows_into_full_grads(std::vector<ParamSlot>& slots, bool full_views, const at::Tensor& reduced,
                                const std::vector<bool>& has_grad, int64_t shard_rank) {
  for (size_t i = 0; i < slots.size(); ++i) {
    auto& s = slots[i];
    if (!has_grad[i]) continue;
    at::Tensor& full = full_grad_of(s, full_views);
    if (!full.is_contiguous()) full = full.contiguous();
    at::Tensor rows = flat_rows(full, s.layout.begin(shard_rank), s.local_rows, s.layout.row_numel);
    rows.copy_(reduced.narrow(0, s.offset, rows.numel()));
    // A gradient carried over from before this backward (see Unit::pre_backward) is added.
    at::Tensor& sharded = shard_grad_of(s, full_views);
    if (sharded.defined()) rows.add_(sharded.reshape({-1}));
    sharded = alias_rows(full, s.layout.begin(shard_rank) * s.layout.row_numel, s.sharded.sizes());
  }
}

}  // namespace fsdp::detail
