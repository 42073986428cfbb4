#include "fsdp/internal/unit_buffers.h"
#include "fsdp/internal/check.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>
#include <utility>

namespace fsdp::detail {
namespace {

// A tensor of `numel` elements whose storage has no memory yet: lend_memory() gives it some while
// the unit is gathered. (Allocating and freeing would cost a unit's size while building.)
at::Tensor unallocated(int64_t numel, const at::TensorOptions& opts) {
  at::Tensor like = at::empty({0}, opts);
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, like.storage().allocator(), /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), like.key_set(), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return t;
}

// A view of `base`'s storage with no bounds check: `base` may have no memory yet (above); the view
// sees the memory while lend_memory() gives it some.
at::Tensor unchecked_view(const at::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  t.unsafeGetTensorImpl()->set_storage_offset(offset);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

}  // namespace

void lend_memory(const at::Tensor& t, const at::Tensor& block) {
  // Every view of the storage, and every tensor autograd saved from those views, sees the new
  // memory: that is what lets a parameter be freed after forward and gathered again for backward
  // without autograd noticing. The pointer does not own the memory: `block` does.
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  TORCH_INTERNAL_ASSERT(s->nbytes() == 0, "lend_memory: the storage has memory already");
  s->set_data_ptr_noswap(c10::DataPtr(block.data_ptr(), block.device()));
  s->set_nbytes(block.storage().nbytes());
}

void take_memory_back(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

at::Tensor alias_rows(const at::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  at::Tensor t = at::empty({0}, base.options());
  t.set_(base.storage(), base.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  return t;
}

at::Tensor flat_rows(const at::Tensor& t, int64_t first, int64_t n, int64_t row_numel) {
  const int64_t start = std::min(t.numel(), first * row_numel);
  return t.reshape({-1}).narrow(0, start, n * row_numel);
}

int64_t lay_out(std::vector<ParamSlot>& slots, int64_t S, int64_t r) {
  // fsdp/shard_layout.h: per parameter, c = ceil(rows / S) rows per rank, padded.
  std::vector<RowLayout> layouts;
  for (auto& s : slots) {
    s.layout = row_layout(s.shape, S);
    s.local_rows = s.layout.local_rows(r);
    layouts.push_back(s.layout);
  }
  const std::vector<int64_t> offsets = flat_offsets(layouts);
  for (size_t i = 0; i < slots.size(); ++i) slots[i].offset = offsets[i];
  return offsets.back();
}

UnitBuffers make_buffers(std::vector<ParamSlot>& slots, int64_t shard_numel, int64_t S, int64_t r, BufferKind kind,
                         const at::TensorOptions& opts, const at::TensorOptions& full_opts) {
  UnitBuffers b;
  b.shard_numel = shard_numel;

  if (kind == BufferKind::kRowsOfFull) {
    // Full parameters stay, in one parameter-major buffer (as the gathered layout of the sharded
    // strategies); this rank's rows of each are a contiguous slice of it, which the optimizer
    // updates in place and the next forward all-gathers.
    b.unsharded = at::zeros({S * b.shard_numel}, opts);
    for (auto& s : slots) {
      s.unsharded = b.unsharded.narrow(0, S * s.offset, s.layout.numel()).view(s.shape);
      s.unsharded.copy_(s.param);
      s.param.set_data(s.unsharded);
      s.sharded = alias_rows(b.unsharded, S * s.offset + r * s.padded_numel(), local_shape(s.shape, s.layout, r));
    }
    return b;
  }
  // This rank's rows of every parameter, padded, in one flat buffer. Replicated (S = 1), that is
  // the whole unit and the parameters are views of it; sharded, they get an unsharded buffer
  // whose memory exists only while the unit is gathered.
  b.flat_shard = at::zeros({b.shard_numel}, opts);
  for (auto& s : slots) {
    at::Tensor p = s.param.detach().contiguous();
    b.flat_shard.narrow(0, s.offset, s.local_rows * s.layout.row_numel)
        .copy_(flat_rows(p, s.layout.begin(r), s.local_rows, s.layout.row_numel));
    s.sharded = alias_rows(b.flat_shard, s.offset, local_shape(s.shape, s.layout, r));
  }
  b.unsharded = kind == BufferKind::kWhole ? b.flat_shard : unallocated(S * b.shard_numel, full_opts);
  for (auto& s : slots) {
    s.unsharded = unchecked_view(b.unsharded, S * s.offset, s.shape);
    s.param.set_data(s.unsharded);  // the parameter's own storage is released here
  }
  return b;
}

void point_at_full_views(std::vector<ParamSlot>& slots) {
  for (auto& s : slots) {
    s.shard_grad = std::exchange(s.param.mutable_grad(), at::Tensor());
    s.param.set_data(s.unsharded);
    if (s.grad_accumulator) torch::autograd::impl::set_grad_accumulator(s.param, s.grad_accumulator);
    s.param.mutable_grad() = std::exchange(s.full_grad, at::Tensor());
  }
}

void point_at_shards(std::vector<ParamSlot>& slots) {
  for (auto& s : slots) {
    s.full_grad = std::exchange(s.param.mutable_grad(), at::Tensor());
    s.param.set_data(s.sharded);
    s.param.mutable_grad() = std::exchange(s.shard_grad, at::Tensor());
  }
}

bool adopt_replaced(std::vector<ParamSlot>& slots, int64_t shard_rank, const ErrorContext& context,
                    const std::string& unit) {
  bool replaced = false;
  for (auto& s : slots) {
    const at::Tensor& p = s.param;
    const bool same = p.has_storage() &&
                      p.storage().unsafeGetStorageImpl() == s.sharded.storage().unsafeGetStorageImpl() &&
                      p.storage_offset() == s.sharded.storage_offset() && p.sizes() == s.sharded.sizes() &&
                      p.dtype() == s.sharded.dtype();
    if (same) continue;
    FSDP_CHECK_IN(context, p.dtype() == s.sharded.dtype() && p.device() == s.sharded.device(), "parameter '", s.name,
                  "' of unit '", unit, "' was converted to ", p.dtype(), " on ", p.device(),
                  " after fsdp::fully_shard (it is sharded as ", s.sharded.dtype(), " on ", s.sharded.device(),
                  "). Convert the model (model->to(...)) before wrapping it; a wrapped model's dtype and device are "
                  "fixed. To go on with this one, convert it back: model->to(torch::Device(\"",
                  s.sharded.device(), "\"), torch::k", s.sharded.scalar_type(), ").");
    FSDP_CHECK_IN(context, p.sizes() == s.sharded.sizes(), "parameter '", s.name, "' of unit '", unit, "' has shape ",
                  p.sizes(), ", but this rank's shard is ", s.sharded.sizes(), " (rows [", s.layout.begin(shard_rank),
                  ", ", s.layout.end(shard_rank), ") of ", s.layout.rows, ", split over ", s.layout.shards,
                  s.layout.shards == 1 ? " rank" : " ranks",
                  "), seen as the unit read its shards again (its forward, or full_state_dict). Something replaced "
                  "the parameter with a tensor of another shape, such as torch::load of a file saved at another "
                  "world size or strategy, or of a full (unwrapped) model. Load what this rank "
                  "saved from the same wrapped model, or gather full weights with model.full_state_dict().");
    {
      at::NoGradGuard no_grad;
      s.sharded.copy_(p);
    }
    s.param.set_data(s.sharded);
    replaced = true;
  }
  return replaced;
}

bool is_on(const at::Device& actual, const at::Device& wanted) {
  // torch::kCUDA (no index) names the current device's type, as LibTorch's own .to() takes it.
  return actual.type() == wanted.type() && (!wanted.has_index() || actual.index() == wanted.index());
}

void check_conversion(const std::vector<ParamSlot>& slots, const std::optional<at::Device>& device,
                      const std::optional<at::ScalarType>& dtype, const ErrorContext& context, const std::string& unit,
                      bool converting) {
  for (const auto& s : slots) {
    const bool same_device = !device || is_on(s.sharded.device(), *device);
    const bool same_dtype = !dtype || *dtype == s.sharded.scalar_type();
    if (same_device && same_dtype) continue;
    std::ostringstream call;
    call << ".to(" << (device ? device->str() : std::string()) << (device && dtype ? ", " : "")
         << (dtype ? c10::toString(*dtype) : "") << ") on the wrapped model";
    FSDP_CHECK_IN(context, converting, call.str(), ": parameter '", s.name, "' of unit '", unit, "' is ",
                  s.sharded.scalar_type(), " on ", s.sharded.device(),
                  ". A wrapped model's dtype and device are fixed; nothing was converted. To train in another dtype "
                  "or on another device, convert the model before wrapping it (model->to(...), then "
                  "fsdp::fully_shard), or see fsdp::MixedPrecisionPolicy.");
    FSDP_CHECK_IN(context, false, call.str(), " would convert parameter '", s.name, "' of unit '", unit, "' (",
                  s.sharded.scalar_type(), " on ", s.sharded.device(),
                  ") after fsdp::fully_shard. A wrapped model's dtype and device are fixed: convert the model "
                  "before wrapping it (model->to(...), then fsdp::fully_shard). Parameters converted before this "
                  "unit was reached (the root's own, earlier modules) are converted already: convert them back, "
                  "model->to(torch::Device(\"",
                  s.sharded.device(), "\"), torch::k", s.sharded.scalar_type(), "), before the next forward.");
  }
}

at::Tensor flat_grad(const std::vector<ParamSlot>& slots, const at::Tensor& flat_shard, int64_t shard_numel,
                     bool full_views) {
  if (!flat_shard.defined() || shard_numel == 0) return {};
  const at::Tensor* first = nullptr;  // the first gradient with elements, and where the flat base is
  int64_t base = 0;
  for (const auto& s : slots) {
    if (s.padded_numel() == 0) continue;
    const at::Tensor& g = shard_grad_of(s, full_views);
    if (!g.defined() || !g.is_contiguous() || g.scalar_type() != flat_shard.scalar_type()) return {};
    if (first == nullptr) {
      first = &g;
      base = g.storage_offset() - s.offset;
    }
    if (!g.is_alias_of(*first) || g.storage_offset() != base + s.offset) return {};
  }
  const int64_t bytes = (base + shard_numel) * flat_shard.element_size();
  if (first == nullptr || base < 0 || static_cast<int64_t>(first->storage().nbytes()) < bytes) return {};
  return alias_rows(*first, base - first->storage_offset(), {shard_numel});
}

}  // namespace fsdp::detail
