#include "fsdp/param_group.h"

#include "fsdp/state.h"

#include <ATen/ops/_chunk_cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/split_with_sizes_copy.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <sstream>
#include <utility>

namespace fsdp::detail {
namespace {

// Gives a tensor's storage `nbytes` of fresh memory (0 frees it). Every view of the storage, and
// every tensor autograd saved from those views, sees the new memory: that is what lets a
// parameter be freed after forward and gathered again for backward without autograd noticing.
void resize_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == nbytes) return;
  c10::DeviceGuard guard(t.device());
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

// Runs after autograd accumulated a parameter's gradient into its .grad.
class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<ParamGroup> group, size_t slot) : group_(std::move(group)), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto g = group_.lock()) g->on_grad_ready(slot_);
    return outputs;
  }

 private:
  std::weak_ptr<ParamGroup> group_;
  size_t slot_;
};

// A tensor over `flat`'s storage that is not an autograd view: optimizers call detach_() on
// gradients (illegal on views), and a parameter should be a plain leaf.
at::Tensor alias_rows(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  return t;
}

// A tensor of `numel` elements whose storage has no memory yet: resize_storage() gives it some when
// the unit is first gathered. (Allocating and freeing would cost a unit's size while building.)
at::Tensor unallocated(int64_t numel, const at::TensorOptions& opts) {
  at::Tensor like = at::empty({0}, opts);
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, like.storage().allocator(), /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), like.key_set(), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return t;
}

// A view of `base`'s storage with no bounds check: `base` may have no memory yet (above); the view
// sees the memory once resize_storage() gave it some.
at::Tensor unchecked_view(const at::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  t.unsafeGetTensorImpl()->set_storage_offset(offset);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

// Rows [first, first + n) of a contiguous tensor, flattened (empty when past the end).
at::Tensor flat_rows(const at::Tensor& t, int64_t first, int64_t n, int64_t row_numel) {
  const int64_t start = std::min(t.numel(), first * row_numel);
  return t.reshape({-1}).narrow(0, start, n * row_numel);
}

}  // namespace

ParamGroup::ParamGroup(std::string name, const std::vector<std::pair<std::string, at::Tensor>>& params,
                       std::shared_ptr<FSDPState> state, bool is_root, ShardingStrategy strategy)
    : name_(std::move(name)),
      state_(std::move(state)),
      is_root_(is_root),
      strategy_(strategy),
      traits_(traits(strategy)) {
  for (const auto& [pname, p] : params) {
    if (!slots_.empty()) {
      const at::Tensor& first = slots_.front().param;
      TORCH_CHECK(p.dtype() == first.dtype() && p.device() == first.device(), "fsdp::fully_shard (rank ",
                  state_->comm.rank(), "): unit '", name_, "' mixes parameter '", slots_.front().name, "' (",
                  first.dtype(), ", ", first.device(), ") with '", pname, "' (", p.dtype(), ", ", p.device(),
                  "). A unit's parameters share one flat buffer: give them one dtype and device, or put them in "
                  "separate fsdp::Sharded units.");
    }
    ParamSlot s;
    s.name = pname;
    s.param = p;
    s.shape = s.param.sizes().vec();
    s.requires_grad = s.param.requires_grad();
    slots_.push_back(std::move(s));
  }
}

std::string ParamGroup::describe(const char* op) const {
  std::ostringstream os;
  os << op << " of unit '" << (is_root_ ? "<root>" : name_) << "' (" << to_string(strategy_) << ", " << slots_.size()
     << " parameters, " << shard_numel_ << " elements per rank)";
  return os.str();
}

void ParamGroup::rename(const std::string& path) {
  if (path.empty() || name_ == path) return;
  name_ = path;
  for (auto& s : slots_) s.name = path + "." + s.name;
  name_collectives();
}

void ParamGroup::name_collectives() {
  gather_what_ = describe("all-gather");
  reduce_what_ = buckets() ? describe("all-reduce of gradients") : describe("reduce-scatter of gradients");
}

int64_t ParamGroup::replication() const {
  return state_->comm.world_size() / S_;
}

void ParamGroup::init() {
  Comm& world = state_->comm;
  shard_comm_ = traits_.shard_over == ShardOver::kGroup ? state_->shard_comm.get() : &world;
  replicate_comm_ = traits_.shard_over == ShardOver::kGroup ? state_->replicate_comm.get() : nullptr;
  TORCH_INTERNAL_ASSERT(shard_comm_ != nullptr, "hybrid sharding without its process groups");
  S_ = traits_.shard_over == ShardOver::kNone ? 1 : shard_comm_->world_size();
  shard_rank_ = traits_.shard_over == ShardOver::kNone ? 0 : shard_comm_->rank();
  if (slots_.empty()) {
    unsharded_now_ = false;
    return;
  }
  const auto opts = slots_.front().param.options().requires_grad(false);
  const int64_t S = S_;
  const int64_t r = shard_rank_;

  // Layout (fsdp/shard_layout.h): per parameter, c = ceil(rows / S) rows per rank, padded.
  std::vector<RowLayout> layouts;
  for (auto& s : slots_) {
    s.layout = row_layout(s.shape, S);
    s.local_rows = s.layout.local_rows(r);
    layouts.push_back(s.layout);
  }
  const std::vector<int64_t> offsets = flat_offsets(layouts);
  for (size_t i = 0; i < slots_.size(); ++i) slots_[i].offset = offsets[i];
  shard_numel_ = offsets.back();

  // Named once: every collective carries its description for error messages.
  name_collectives();

  at::NoGradGuard no_grad;
  // Rank 0's weights everywhere, one parameter at a time and in place: no flat copy, so that
  // sharding a unit costs its own size once (what lets a model be sharded while it is built).
  if (state_->options.sync_module_states() && world.world_size() > 1) {
    const std::string what = describe("broadcast of rank 0's weights");
    for (auto& s : slots_) world.broadcast(s.param.detach(), 0, what);
  }

  if (shards_are_rows_of_full()) {
    // Full parameters stay, in one parameter-major buffer (as the gathered layout of the sharded
    // strategies); this rank's rows of each are a contiguous slice of it, which the optimizer
    // updates in place and the next forward all-gathers.
    unsharded_ = at::zeros({S * shard_numel_}, opts);
    for (auto& s : slots_) {
      s.unsharded = unsharded_.narrow(0, S * s.offset, s.layout.numel()).view(s.shape);
      s.unsharded.copy_(s.param);
      s.param.set_data(s.unsharded);
      s.sharded = alias_rows(unsharded_, S * s.offset + r * s.padded_numel(), local_shape(s.shape, s.layout, r));
    }
  } else {
    // This rank's rows of every parameter, padded, in one flat buffer. Replicated (S = 1), that is
    // the whole unit and the parameters are views of it; sharded, they get an unsharded buffer
    // whose memory exists only while the unit is gathered.
    flat_shard_ = at::zeros({shard_numel_}, opts);
    for (auto& s : slots_) {
      at::Tensor p = s.param.detach().contiguous();
      flat_shard_.narrow(0, s.offset, s.local_rows * s.layout.row_numel)
          .copy_(flat_rows(p, s.layout.begin(r), s.local_rows, s.layout.row_numel));
      s.sharded = alias_rows(flat_shard_, s.offset, local_shape(s.shape, s.layout, r));
    }
    if (buckets()) {
      unsharded_ = flat_shard_;
      make_buckets();
    } else {
      unsharded_ = unallocated(S * shard_numel_, opts);
    }
    for (auto& s : slots_) {
      s.unsharded = unchecked_view(unsharded_, S * s.offset, s.shape);
      s.param.set_data(s.unsharded);  // the parameter's own storage is released here
    }
  }

  std::weak_ptr<ParamGroup> self = weak_from_this();
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& s = slots_[i];
    s.param.mutable_grad() = at::Tensor();  // a gradient from before wrapping is not this model's
    if (s.requires_grad) {
      // Created now, while the parameter has its full shape, and kept (see ParamSlot).
      s.grad_accumulator = torch::autograd::impl::grad_accumulator(s.param);
      s.grad_accumulator->add_post_hook(std::make_unique<GradReadyHook>(self, i));
      ++grads_expected_;
    }
  }
  unsharded_now_ = true;
  full_views_ = true;
  reshard();
}

void ParamGroup::make_buckets() {
  const int64_t cap = std::max<int64_t>(1, state_->options.bucket_bytes() / flat_shard_.element_size());
  size_t last = slots_.size();
  while (last > 0) {
    Bucket b;
    b.last = last;
    b.first = last;
    int64_t numel = 0;
    // At least one parameter per bucket; then add earlier ones while the bucket stays under the cap.
    do {
      --b.first;
      numel += slots_[b.first].padded_numel();
    } while (b.first > 0 && numel + slots_[b.first - 1].padded_numel() <= cap);
    b.offset = slots_[b.first].offset;
    b.numel = numel;
    buckets_.push_back(b);
    last = b.first;
  }
}

bool ParamGroup::needs_gather() const {
  if (shard_numel_ == 0) return false;
  if (traits_.shard_over == ShardOver::kNone) return false;
  if (shards_are_rows_of_full()) {
    // After a reduction the optimizer steps the shards, so every forward until the next
    // backward gathers (the step may come after any of them). Never in backward: the unit is
    // gathered already. The decision must be the same on every rank, so it rests on this
    // flag, never on whether this rank's shards changed (a rank may own no rows, and
    // torch::optim::SGD steps through .data(), which no version counter sees).
    if (in_backward_ || state_->in_backward()) return false;
    return stale_;
  }
  return !unsharded_now_;
}

void ParamGroup::begin_unshard() {
  if (gathering_ || !needs_gather()) return;
  if (!full_views_) adopt_replaced_shards();  // the gather reads the shards
  // Only the all-gather output is allocated now; the unsharded storage is allocated when the
  // gather is waited for, so a unit in flight costs its size once, not twice.
  gathered_ = at::empty({S_ * shard_numel_}, unsharded_.options());
  at::Tensor in = flat_shard_;
  if (shards_are_rows_of_full()) {
    gather_in_ = at::zeros({shard_numel_}, unsharded_.options());
    for (auto& s : slots_) {
      gather_in_.narrow(0, s.offset, s.sharded.numel()).copy_(s.sharded.reshape({-1}));
    }
    in = gather_in_;
  }
  gather_ = shard_comm_->all_gather_async(gathered_, in, gather_what_);
  gathering_ = true;
}

void ParamGroup::unshard() {
  if (slots_.empty()) return;
  if (!full_views_) adopt_replaced_shards();
  // Only empty parameters (shard_numel_ == 0, the same on every rank): nothing to gather.
  if (shard_numel_ > 0 && (gathering_ || needs_gather())) gather();
  if (!keeps_full_params()) unsharded_now_ = true;
  use_full_views();
}

void ParamGroup::gather() {
  const int64_t W = S_;
  begin_unshard();
  wait_gather();
  gather_in_ = at::Tensor();
  resize_storage(unsharded_, static_cast<size_t>(W * shard_numel_) * unsharded_.element_size());
  {
    // The all-gather output is rank-major [W, shard_numel]; one copy-out fills every parameter,
    // and the output is freed right after, before any further prefetch is issued.
    std::vector<int64_t> sizes;
    std::vector<at::Tensor> outs;
    for (auto& s : slots_) {
      sizes.push_back(s.padded_numel());
      outs.push_back(unsharded_.narrow(0, W * s.offset, W * s.padded_numel()).view({W, s.padded_numel()}));
    }
    // Below autograd: these copies must not bump version counters of tensors autograd saved.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::split_with_sizes_copy_out(outs, gathered_.view({W, shard_numel_}), sizes, 1);
  }
  gathered_ = at::Tensor();
}

void ParamGroup::reshard() {
  if (gathering_) {  // prefetched but not used: Gloo may still be writing into the buffer
    wait_gather();
    gathered_ = at::Tensor();
    gather_in_ = at::Tensor();
  }
  use_shard_views();
  if (!unsharded_now_ || keeps_full_params()) return;
  resize_storage(unsharded_, 0);
  unsharded_now_ = false;
}

void ParamGroup::use_full_views() {
  if (full_views_) return;
  for (auto& s : slots_) {
    s.shard_grad = std::exchange(s.param.mutable_grad(), at::Tensor());
    s.param.set_data(s.unsharded);
    s.param.mutable_grad() = std::exchange(s.full_grad, at::Tensor());
  }
  full_views_ = true;
}

void ParamGroup::use_shard_views() {
  if (!full_views_) return;
  for (auto& s : slots_) {
    s.full_grad = std::exchange(s.param.mutable_grad(), at::Tensor());
    s.param.set_data(s.sharded);
    s.param.mutable_grad() = std::exchange(s.shard_grad, at::Tensor());
  }
  full_views_ = false;
}

void ParamGroup::adopt_replaced_shards() {
  bool replaced = false;
  for (auto& s : slots_) {
    const at::Tensor& p = s.param;
    const bool same = p.has_storage() &&
                      p.storage().unsafeGetStorageImpl() == s.sharded.storage().unsafeGetStorageImpl() &&
                      p.storage_offset() == s.sharded.storage_offset() && p.sizes() == s.sharded.sizes() &&
                      p.dtype() == s.sharded.dtype();
    if (same) continue;
    TORCH_CHECK(p.dtype() == s.sharded.dtype() && p.device() == s.sharded.device(), "fsdp (rank ", state_->comm.rank(),
                "): parameter '", s.name, "' of unit '", is_root_ ? "<root>" : name_, "' was converted to ", p.dtype(),
                " on ", p.device(), " after fsdp::fully_shard (it is sharded as ", s.sharded.dtype(), " on ",
                s.sharded.device(),
                "). Convert the model (model->to(...)) before wrapping it; a wrapped model's dtype and device are "
                "fixed.");
    TORCH_CHECK(p.sizes() == s.sharded.sizes(), "fsdp (rank ", state_->comm.rank(), "): parameter '", s.name,
                "' of unit '", is_root_ ? "<root>" : name_, "' has shape ", p.sizes(), ", but this rank's shard is ",
                s.sharded.sizes(), " (rows ", s.layout.begin(shard_rank_), " to ", s.layout.end(shard_rank_), " of ",
                s.layout.rows, " over ", S_,
                " ranks). Something replaced the parameter with a tensor of another shape, such as torch::load of a "
                "file saved at another world size or strategy, or of a full (unwrapped) model. Load what this rank "
                "saved from the same wrapped model, or gather full weights with model.full_state_dict().");
    {
      at::NoGradGuard no_grad;
      s.sharded.copy_(p);
    }
    s.param.set_data(s.sharded);
    replaced = true;
  }
  if (replaced) mark_shards_written();
}

void ParamGroup::pre_forward() {
  const bool direct = state_->direct_access > 0 && !state_->in_root_forward;
  state_->direct_call_refused = direct;  // said here: no second hint as the error leaves the handle
  TORCH_CHECK(!direct, "fsdp (rank ", state_->comm.rank(), "): unit '", is_root_ ? "<root>" : name_,
              "' ran its forward inside a call through the handle's operator-> (such as model->forward(x)), which "
              "calls the module's own forward around the wrapper: the root's parameters stay sharded and nothing "
              "is prepared for backward. Call the handle itself: model(x) or model.forward(x).");
  unshard();
  state_->after_unit_unsharded(*this, /*backward=*/false);
  state_->sample_state();
}

void ParamGroup::post_forward(const std::vector<at::Tensor>& outputs) {
  const bool grad = c10::GradMode::is_enabled();
  if (grad) {
    std::weak_ptr<ParamGroup> self = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      // Fires when the gradient w.r.t. this output is complete, i.e. right before this unit's
      // backward: the unit's pre-backward.
      const_cast<at::Tensor&>(t).register_hook([self](const at::Tensor&) {
        if (auto g = self.lock()) g->pre_backward();
      });
      awaiting_backward_ = true;
    }
  }
  // The root stays gathered into its backward (it is the first to need its parameters again).
  const bool regather = traits_.reshard_after_forward;
  const bool reshard_now = !grad || (!is_root_ && regather);
  if (reshard_now) {
    reshard();
  } else {
    // Gathered memory kept for backward, but the parameters are the shards again: between
    // forward and backward a user may zero the gradients or step (a forward whose backward never
    // comes), and must find the shards. Autograd saved the parameter itself, whose full view
    // pre_backward() restores before any of the unit's gradients are computed.
    use_shard_views();
  }
}

void ParamGroup::pre_backward() {
  if (!awaiting_backward_) return;
  awaiting_backward_ = false;
  state_->on_backward_begin();
  unshard();
  state_->after_unit_unsharded(*this, /*backward=*/true);
  state_->sample_state();
  in_backward_ = true;
  grads_ready_ = 0;
  for (auto& s : slots_) s.grad_ready = false;
  // kShardOptimizerState: the shards were gathered by the forward that led here.
  stale_ = false;
  if (holds_reduced_) {
    // kShardOptimizerState: the full gradients hold the last reduction (this rank's rows) and
    // stale local values (the other rows). Rows the optimizer has not consumed (no zero_grad)
    // become a gradient of their own (a copy, so the old full gradients are freed) that the next
    // reduction adds to; the full gradients start from nothing, as for an unwrapped model.
    holds_reduced_ = false;
    finish_reduce();
    for (auto& s : slots_) {
      if (s.shard_grad.defined()) s.shard_grad = s.shard_grad.clone();
      s.param.mutable_grad() = at::Tensor();
    }
  }
}

void ParamGroup::on_grad_ready(size_t slot) {
  ParamSlot& s = slots_[slot];
  TORCH_CHECK(in_backward_, "fsdp (rank ", state_->comm.rank(), "): parameter '", s.name,
              "' received a gradient although the backward of its unit '", is_root_ ? "<root>" : name_,
              "' never began. Was the module called directly instead of through its fsdp::Sharded wrapper "
              "(or the root through the handle fsdp::fully_shard returned)?");
  if (s.grad_ready) return;
  s.grad_ready = true;
  ++grads_ready_;
  // Replicated: each bucket goes out as soon as its gradients are complete (all of them are out
  // once the unit's last gradient arrives).
  const bool buckets = this->buckets();
  if (buckets && state_->sync_gradients) launch_buckets(/*all=*/false);
  if (grads_ready_ == grads_expected_) {
    // Without gradient sync (all but the last micro-batch of an accumulation) the unsharded
    // gradients stay on the parameters and keep accumulating; nothing is communicated.
    if (state_->sync_gradients && !buckets) reduce_grads();
    in_backward_ = false;
    // A frozen parameter's last reader may still be ahead in the graph (autograd runs gradient
    // accumulation as soon as it can): such a unit stays gathered until the end of backward.
    if (grads_expected_ == slots_.size()) reshard();
  }
}

void ParamGroup::launch_buckets(bool all) {
  // Buckets go out in one fixed order on every rank (Gloo pairs collectives by order): bucket b
  // only after b - 1, and only once backward produced all of its gradients (or at the end).
  while (next_bucket_ < buckets_.size()) {
    const Bucket& b = buckets_[next_bucket_];
    if (!all) {
      for (size_t i = b.first; i < b.last; ++i) {
        if (slots_[i].requires_grad && !slots_[i].grad_ready) return;
      }
    }
    if (next_bucket_ == 0) {
      reduce_out_ = at::empty({shard_numel_}, flat_shard_.options());
      reduce_has_grad_.assign(slots_.size(), false);
      bucket_work_.clear();
    }
    for (size_t i = b.first; i < b.last; ++i) {
      auto& s = slots_[i];
      at::Tensor dst = reduce_out_.narrow(0, s.offset, s.padded_numel());
      reduce_has_grad_[i] = full_grad(s).defined();
      if (reduce_has_grad_[i]) {
        dst.view(s.shape).copy_(full_grad(s));
      } else {
        dst.zero_();
      }
    }
    state_->sample_state();  // the bucket's gradients and their copy, both alive
    for (size_t i = b.first; i < b.last; ++i) {
      full_grad(slots_[i]) = at::Tensor();  // the bucket holds it now
    }
    at::Tensor chunk = reduce_out_.narrow(0, b.offset, b.numel);
    bucket_work_.push_back(state_->comm.all_reduce_async(chunk, c10d::ReduceOp::SUM, reduce_what_));
    ++next_bucket_;
    if (next_bucket_ == buckets_.size()) {
      reducing_ = true;
      state_->after_reduce_issued(*this);
    }
  }
}

void ParamGroup::reduce_grads() {
  if (shard_numel_ == 0) {
    for (auto& s : slots_) full_grad(s) = at::Tensor();
    return;
  }
  if (buckets()) {
    if (next_bucket_ == buckets_.size()) finish_reduce();  // reduced once already in this backward
    launch_buckets(/*all=*/true);
    return;
  }
  finish_reduce();  // a unit reduced twice in one backward (partly used, then flushed)
  // The previous unit's reduction had this unit's whole backward to complete; finishing it before
  // packing frees its buffers first, so one unit's packed gradients are in flight at a time (as in
  // FSDP2), not two.
  state_->finish_reduces();
  const int64_t W = S_;
  const auto opts = unsharded_.options();
  // One copy into rank-major [W, shard_numel] (chunk-cat pads each parameter's chunks), then the
  // reduce-scatter writes this rank's summed rows straight into the flat gradient shard.
  std::vector<at::Tensor> grads;
  grads.reserve(slots_.size());
  reduce_has_grad_.assign(slots_.size(), false);
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& s = slots_[i];
    reduce_has_grad_[i] = full_grad(s).defined();
    if (s.padded_numel() == 0) continue;  // no elements (e.g. a [0, k] parameter): nothing to send
    at::Tensor g = full_grad(s);
    if (!g.defined()) g = at::zeros(s.shape, opts);
    grads.push_back(s.shape.empty() ? g.view({1}) : g);
  }
  reduce_in_ = at::empty({W, shard_numel_}, opts);
  at::_chunk_cat_out(reduce_in_, grads, 0, W);
  grads.clear();
  state_->sample_state();  // the unsharded gradients and their packed copy, both alive
  if (shards_are_rows_of_full()) {
    holds_reduced_ = true;  // the full gradients stay; they are no longer pending
  } else {
    for (auto& s : slots_) full_grad(s) = at::Tensor();  // unsharded gradients freed here
  }
  reduce_out_ = at::empty({shard_numel_}, opts);
  at::Tensor flat_in = reduce_in_.view({-1});
  reduce_ = shard_comm_->reduce_scatter_sum_async(reduce_out_, flat_in, reduce_what_);
  reducing_ = true;
  // Runs while the rest of backward computes; the state bounds how many are in flight.
  state_->after_reduce_issued(*this);
}

void ParamGroup::append_held_tensors(std::vector<at::Tensor>& out) const {
  for (const at::Tensor* t : {&flat_shard_, &unsharded_, &gathered_, &gather_in_, &reduce_in_, &reduce_out_}) {
    out.push_back(*t);
  }
  for (const auto& s : slots_) {
    for (const at::Tensor* t : {&s.param, &s.sharded, &s.shard_grad, &s.full_grad}) out.push_back(*t);
    out.push_back(s.param.grad());
  }
}

void ParamGroup::wait_gather() {
  gathering_ = false;
  try {
    shard_comm_->wait(gather_);
  } catch (const std::exception& e) {
    // The backend keeps its own reference to the buffer; ours is dropped so that nothing ever
    // reads a gather that did not complete, and the state refuses further steps.
    gathered_ = at::Tensor();
    gather_in_ = at::Tensor();
    state_->mark_broken(error_text(e));
    throw;
  }
}

void ParamGroup::drop_prefetch() {
  if (!gathering_) return;
  wait_gather();
  gathered_ = at::Tensor();
  gather_in_ = at::Tensor();  // kShardOptimizerState: not copied out, so the unit stays due
}

void ParamGroup::finish_reduce() {
  if (!reducing_) return;
  reducing_ = false;
  try {
    if (buckets()) {
      for (auto& p : bucket_work_) state_->comm.wait(p);
    } else {
      shard_comm_->wait(reduce_);
      reduce_in_ = at::Tensor();
      if (replicate_comm_ != nullptr && replicate_comm_->world_size() > 1) {
        // Hybrid: the group's sum of this shard, summed again over the groups holding it.
        replicate_comm_->all_reduce(reduce_out_, c10d::ReduceOp::SUM,
                                    describe("all-reduce of gradients across groups"));
      }
    }
  } catch (const std::exception& e) {
    reduce_in_ = at::Tensor();
    reduce_out_ = at::Tensor();
    bucket_work_.clear();
    next_bucket_ = 0;
    state_->mark_broken(error_text(e));
    throw;
  }
  bucket_work_.clear();
  next_bucket_ = 0;
  at::Tensor flat_grad = std::move(reduce_out_);
  flat_grad.div_(static_cast<double>(state_->comm.world_size()));
  if (shards_are_rows_of_full()) {
    set_full_grad_rows(flat_grad);
  } else {
    set_sharded_grads(flat_grad);
  }
}

void ParamGroup::set_sharded_grads(const at::Tensor& flat_grad) {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!reduce_has_grad_[i]) continue;
    auto& s = slots_[i];
    at::Tensor view = alias_rows(flat_grad, s.offset, s.sharded.sizes());
    at::Tensor& g = shard_grad(s);
    if (g.defined()) {
      g.add_(view);  // accumulating across backward passes
    } else {
      g = view;
    }
  }
}

void ParamGroup::set_full_grad_rows(const at::Tensor& flat_grad) {
  stale_ = true;  // the optimizer steps the shards next
  // kShardOptimizerState: the reduced rows go back into the full gradients (which every rank
  // keeps), and the sharded gradients are views of them: no second copy of this rank's rows.
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& s = slots_[i];
    if (!reduce_has_grad_[i]) continue;
    at::Tensor& full = full_grad(s);
    if (!full.is_contiguous()) full = full.contiguous();
    at::Tensor rows = flat_rows(full, s.layout.begin(shard_rank_), s.local_rows, s.layout.row_numel);
    rows.copy_(flat_grad.narrow(0, s.offset, rows.numel()));
    // A gradient carried over from before this backward (see pre_backward) is added.
    if (shard_grad(s).defined()) rows.add_(shard_grad(s).reshape({-1}));
    const int64_t start = s.layout.begin(shard_rank_) * s.layout.row_numel;
    shard_grad(s) = alias_rows(full, start, s.sharded.sizes());
  }
}

at::Tensor ParamGroup::flat_grad() const {
  if (!flat_shard_.defined() || shard_numel_ == 0) return {};
  const at::Tensor* first = nullptr;  // the first gradient with elements, and where the flat base is
  int64_t base = 0;
  for (const auto& s : slots_) {
    if (s.padded_numel() == 0) continue;
    const at::Tensor& g = shard_grad(s);
    if (!g.defined() || !g.is_contiguous() || g.scalar_type() != flat_shard_.scalar_type()) return {};
    if (first == nullptr) {
      first = &g;
      base = g.storage_offset() - s.offset;
    }
    if (!g.is_alias_of(*first) || g.storage_offset() != base + s.offset) return {};
  }
  const int64_t bytes = (base + shard_numel_) * flat_shard_.element_size();
  if (first == nullptr || base < 0 || static_cast<int64_t>(first->storage().nbytes()) < bytes) return {};
  return alias_rows(*first, base - first->storage_offset(), {shard_numel_});
}

bool ParamGroup::holds_unsynced_grads() const {
  if (holds_reduced_) return false;  // kShardOptimizerState's full gradients after their reduction
  return std::any_of(slots_.begin(), slots_.end(),
                     [&](const ParamSlot& s) { return (full_views_ ? s.param.grad() : s.full_grad).defined(); });
}

void ParamGroup::check_conversion(const std::optional<at::Device>& device,
                                  const std::optional<at::ScalarType>& dtype) const {
  for (const auto& s : slots_) {
    const bool same_device = !device || *device == s.sharded.device();
    const bool same_dtype = !dtype || *dtype == s.sharded.scalar_type();
    TORCH_CHECK(same_device && same_dtype, "fsdp (rank ", state_->comm.rank(), "): .to(",
                device ? device->str() : std::string(), device && dtype ? ", " : "", dtype ? c10::toString(*dtype) : "",
                ") on the wrapped model would convert parameter '", s.name, "' of unit '", is_root_ ? "<root>" : name_,
                "' (", s.sharded.scalar_type(), " on ", s.sharded.device(),
                ") after fsdp::fully_shard. A wrapped model's dtype and device are fixed: convert the model "
                "before wrapping it (model->to(...), then fsdp::fully_shard).");
  }
}

void ParamGroup::gather_full(std::vector<at::Tensor>& out, const at::Device& device) {
  TORCH_INTERNAL_ASSERT(!full_views_ && !gathering_, "gather_full of unit '", name_, "' while it is unsharded");
  adopt_replaced_shards();
  at::NoGradGuard no_grad;
  auto copy_out = [&](const at::Tensor& t) { out.push_back(t.to(device, t.scalar_type(), false, /*copy=*/true)); };
  if (shard_numel_ == 0 || S_ == 1) {  // nothing to gather: the shard is the whole parameter
    for (const auto& s : slots_) copy_out(s.sharded.reshape(s.shape));
    return;
  }
  at::Tensor in = flat_shard_;
  if (shards_are_rows_of_full()) {
    in = at::zeros({shard_numel_}, unsharded_.options());
    for (auto& s : slots_) in.narrow(0, s.offset, s.sharded.numel()).copy_(s.sharded.reshape({-1}));
  }
  at::Tensor gathered = at::empty({S_ * shard_numel_}, in.options());
  Pending p = shard_comm_->all_gather_async(gathered, in, describe("all-gather of full weights"));
  try {
    shard_comm_->wait(p);
  } catch (const std::exception& e) {
    state_->mark_broken(error_text(e));
    throw;
  }
  const at::Tensor rank_major = gathered.view({S_, shard_numel_});
  for (const auto& s : slots_) {
    copy_out(
        rank_major.narrow(1, s.offset, s.padded_numel()).reshape({-1}).narrow(0, 0, s.layout.numel()).view(s.shape));
  }
}

void ParamGroup::reset_after_failed_backward() {
  // Reductions of the failed backward still in flight: waited for (the backend uses their
  // buffers) and thrown away. This runs at the next forward, after the user's zero_grad(), which
  // they must not undo.
  if (reducing_ || next_bucket_ > 0) {
    reducing_ = false;
    try {
      shard_comm_->wait(reduce_);
      for (auto& p : bucket_work_) state_->comm.wait(p);
    } catch (const std::exception& e) {
      state_->mark_broken(error_text(e));
    }
    bucket_work_.clear();
    next_bucket_ = 0;
    reduce_in_ = at::Tensor();
    reduce_out_ = at::Tensor();
  }
  if (!in_backward_) return;
  in_backward_ = false;
  grads_ready_ = 0;
  // The failed backward left the parameters full, with partial full gradients that the user saw
  // (and may have zeroed) instead of the sharded ones, which wait aside. Those follow what the
  // user did: kept if some partial gradient is still there and not zero, dropped otherwise (the
  // documented recovery is zero_grad() before the next backward).
  bool zeroed = true;
  for (auto& s : slots_) {
    const at::Tensor& g = full_grad(s);
    zeroed = zeroed && (!g.defined() || !g.any().item<bool>());
  }
  for (auto& s : slots_) {
    s.grad_ready = false;
    if (zeroed && full_views_ && s.shard_grad.defined()) {
      if (full_grad(s).defined()) {
        s.shard_grad.zero_();  // zero_grad(set_to_none=false)
      } else {
        s.shard_grad = at::Tensor();
      }
    }
    full_grad(s) = at::Tensor();
  }
  reshard();
}

void ParamGroup::finalize_backward() {
  // Gradients not reduced yet: a unit only partly used in this backward, or one that accumulated
  // without sync in earlier micro-batches and was not used in this one. (kShardOptimizerState
  // keeps its full gradients after reducing them; those are not pending.)
  if (state_->sync_gradients && !holds_reduced_) {
    // kNoShard: buckets launched while others wait for gradients that never came (unused
    // parameters) are pending too; the rest go out now, with zeros for the missing ones.
    bool pending = next_bucket_ > 0 && next_bucket_ < buckets_.size();
    pending = pending || holds_unsynced_grads();
    if (pending) reduce_grads();
  }
  in_backward_ = false;
  awaiting_backward_ = false;
  reshard();
}

}  // namespace fsdp::detail
