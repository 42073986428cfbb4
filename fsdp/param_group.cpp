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

#include <sstream>

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

}  // namespace

ParamGroup::ParamGroup(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
                       std::shared_ptr<FSDPState> state, bool is_root, ShardingStrategy strategy)
    : name_(std::move(name)), state_(std::move(state)), is_root_(is_root), strategy_(strategy) {
  for (auto& [pname, p] : params) {
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
    s.shape = p.sizes().vec();
    s.requires_grad = p.requires_grad();
    slots_.push_back(std::move(s));
  }
}

std::string ParamGroup::describe(const char* op) const {
  std::ostringstream os;
  os << op << " of unit '" << (is_root_ ? "<root>" : name_) << "' (" << slots_.size() << " parameters, " << shard_numel_
     << " elements per rank)";
  return os.str();
}

void ParamGroup::init() {
  Comm& comm = state_->comm;
  const int64_t W = comm.world_size();
  const int64_t r = comm.rank();
  if (slots_.empty()) {
    unsharded_now_ = false;
    return;
  }
  const auto opts = slots_.front().param.options().requires_grad(false);

  // Layout: per parameter, c = ceil(rows / W) rows per rank, padded at the tail.
  for (auto& s : slots_) {
    s.rows = s.shape.empty() ? 1 : s.shape[0];
    s.row_numel = 1;
    for (size_t d = 1; d < s.shape.size(); ++d) s.row_numel *= s.shape[d];
    s.chunk_rows = (s.rows + W - 1) / W;
    s.local_rows = std::max<int64_t>(0, std::min(s.chunk_rows, s.rows - r * s.chunk_rows));
    s.offset = shard_numel_;
    shard_numel_ += s.padded_numel();
  }

  // Named once: every all-gather and reduce-scatter carries its description for error messages.
  gather_what_ = describe("all-gather");
  reduce_what_ = describe("reduce-scatter of gradients");

  // The unsharded buffer is parameter-major: parameter i owns [W*offset_i, W*(offset_i+padded_i)),
  // which viewed as [W, padded_i] has rank r's rows in row r. The full parameter is its prefix.
  unsharded_ = at::zeros({W * shard_numel_}, opts);
  {
    at::NoGradGuard no_grad;
    for (auto& s : slots_) {
      s.unsharded = unsharded_.narrow(0, W * s.offset, s.param.numel()).view(s.shape);
      s.unsharded.copy_(s.param);
    }
  }
  if (state_->options.sync_module_states()) comm.broadcast(unsharded_, 0, describe("broadcast of rank 0's weights"));

  flat_shard_ = at::empty({shard_numel_}, opts);
  for (auto& s : slots_) {
    auto mine = unsharded_.narrow(0, W * s.offset, W * s.padded_numel()).view({W, s.padded_numel()})[r];
    flat_shard_.narrow(0, s.offset, s.padded_numel()).copy_(mine);
    std::vector<int64_t> local_shape = s.shape;
    if (local_shape.empty()) {
      if (s.local_rows == 0) local_shape = {0};
    } else {
      local_shape[0] = s.local_rows;
    }
    s.sharded = alias_rows(flat_shard_, s.offset, local_shape);
    s.sharded.set_requires_grad(s.requires_grad);
  }

  // Point each parameter at its view once; its old storage is released here.
  std::weak_ptr<ParamGroup> self = weak_from_this();
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& s = slots_[i];
    s.param.set_data(s.unsharded);
    s.param.mutable_grad() = at::Tensor();  // a gradient from before wrapping is not this model's
    if (s.requires_grad) {
      // Created now, while the parameter has its full shape, and kept (see ParamSlot).
      s.grad_accumulator = torch::autograd::impl::grad_accumulator(s.param);
      s.grad_accumulator->add_post_hook(std::make_unique<GradReadyHook>(self, i));
      ++grads_expected_;
    }
  }
  placeholder_ = at::empty({0}, opts);
  unsharded_now_ = true;
  reshard();
}

void ParamGroup::begin_unshard() {
  if (unsharded_now_ || gathering_ || shard_numel_ == 0) return;
  // Only the all-gather output is allocated now; the unsharded storage is allocated when the
  // gather is waited for, so a unit in flight costs its size once, not twice.
  gathered_ = at::empty({state_->comm.world_size() * shard_numel_}, flat_shard_.options());
  gather_ = state_->comm.all_gather_async(gathered_, flat_shard_, gather_what_);
  gathering_ = true;
}

void ParamGroup::unshard() {
  if (unsharded_now_ || slots_.empty()) return;
  if (shard_numel_ == 0) {  // only empty parameters: nothing to gather (same on every rank)
    for (auto& s : slots_) s.param.set_data(s.unsharded);
    unsharded_now_ = true;
    return;
  }
  const int64_t W = state_->comm.world_size();
  begin_unshard();
  wait_gather();
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
  for (auto& s : slots_) s.param.set_data(s.unsharded);
  unsharded_now_ = true;
}

void ParamGroup::reshard() {
  if (gathering_) {  // prefetched but not used: Gloo may still be writing into the buffer
    wait_gather();
    gathered_ = at::Tensor();
  }
  if (!unsharded_now_) return;
  // The parameter itself points at an empty tensor, so code that reaches it around the wrapper
  // gets a shape error instead of reading freed memory.
  for (auto& s : slots_) s.param.set_data(placeholder_);
  resize_storage(unsharded_, 0);
  unsharded_now_ = false;
}

void ParamGroup::pre_forward() {
  unshard();
  state_->after_unit_unsharded(*this, /*backward=*/false);
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
  const bool reshard_now = !grad || (!is_root_ && strategy_ == ShardingStrategy::kFullShard);
  if (reshard_now) reshard();
}

void ParamGroup::pre_backward() {
  if (!awaiting_backward_) return;
  awaiting_backward_ = false;
  state_->on_backward_begin();
  unshard();
  state_->after_unit_unsharded(*this, /*backward=*/true);
  in_backward_ = true;
  grads_ready_ = 0;
  for (auto& s : slots_) s.grad_ready = false;
}

void ParamGroup::on_grad_ready(size_t slot) {
  ParamSlot& s = slots_[slot];
  TORCH_CHECK(in_backward_, "fsdp (rank ", state_->comm.rank(), "): parameter '", s.name,
              "' received a gradient although the backward of its unit '", is_root_ ? "<root>" : name_,
              "' never began. Was the module called directly instead of through its fsdp::Sharded wrapper "
              "(or the root through the handle fsdp::fully_shard returned)?");
  if (s.grad_ready) return;
  s.grad_ready = true;
  if (++grads_ready_ == grads_expected_) {
    // Without gradient sync (all but the last micro-batch of an accumulation) the unsharded
    // gradients stay on the parameters and keep accumulating; nothing is communicated.
    if (state_->sync_gradients) reduce_grads();
    in_backward_ = false;
    // A frozen parameter's last reader may still be ahead in the graph (autograd runs gradient
    // accumulation as soon as it can): such a unit stays gathered until the end of backward.
    if (grads_expected_ == slots_.size()) reshard();
  }
}

void ParamGroup::reduce_grads() {
  if (shard_numel_ == 0) {
    for (auto& s : slots_) s.param.mutable_grad() = at::Tensor();
    return;
  }
  finish_reduce();  // a unit reduced twice in one backward (partly used, then flushed)
  Comm& comm = state_->comm;
  const int64_t W = comm.world_size();
  const auto opts = flat_shard_.options();
  // One copy into rank-major [W, shard_numel] (chunk-cat pads each parameter's chunks), then the
  // reduce-scatter writes this rank's summed rows straight into the flat gradient shard.
  std::vector<at::Tensor> grads;
  grads.reserve(slots_.size());
  reduce_has_grad_.assign(slots_.size(), false);
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& s = slots_[i];
    reduce_has_grad_[i] = s.param.grad().defined();
    if (s.padded_numel() == 0) continue;  // no elements (e.g. a [0, k] parameter): nothing to send
    at::Tensor g = s.param.grad();
    if (!g.defined()) g = at::zeros(s.shape, opts);
    grads.push_back(s.shape.empty() ? g.view({1}) : g);
  }
  reduce_in_ = at::empty({W, shard_numel_}, opts);
  at::_chunk_cat_out(reduce_in_, grads, 0, W);
  grads.clear();
  for (auto& s : slots_) s.param.mutable_grad() = at::Tensor();  // unsharded gradients freed here
  reduce_out_ = at::empty({shard_numel_}, opts);
  at::Tensor flat_in = reduce_in_.view({-1});
  reduce_ = comm.reduce_scatter_sum_async(reduce_out_, flat_in, reduce_what_);
  reducing_ = true;
  // Runs while the rest of backward computes; the state bounds how many are in flight.
  state_->after_reduce_issued(*this);
}

void ParamGroup::wait_gather() {
  gathering_ = false;
  try {
    state_->comm.wait(gather_);
  } catch (const std::exception& e) {
    // The backend keeps its own reference to the buffer; ours is dropped so that nothing ever
    // reads a gather that did not complete, and the state refuses further steps.
    gathered_ = at::Tensor();
    state_->mark_broken(e.what());
    throw;
  }
}

void ParamGroup::drop_prefetch() {
  if (!gathering_) return;
  wait_gather();
  gathered_ = at::Tensor();
}

void ParamGroup::finish_reduce() {
  if (!reducing_) return;
  reducing_ = false;
  try {
    state_->comm.wait(reduce_);
  } catch (const std::exception& e) {
    reduce_in_ = at::Tensor();
    reduce_out_ = at::Tensor();
    state_->mark_broken(e.what());
    throw;
  }
  reduce_in_ = at::Tensor();
  at::Tensor flat_grad = std::move(reduce_out_);
  flat_grad.div_(static_cast<double>(state_->comm.world_size()));
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!reduce_has_grad_[i]) continue;
    auto& s = slots_[i];
    at::Tensor view = alias_rows(flat_grad, s.offset, s.sharded.sizes());
    at::Tensor& g = s.sharded.mutable_grad();
    if (g.defined()) {
      g.add_(view);  // accumulating across backward passes
    } else {
      g = view;
    }
  }
}

void ParamGroup::reset_after_failed_backward() {
  finish_reduce();
  if (!in_backward_) return;
  in_backward_ = false;
  grads_ready_ = 0;
  for (auto& s : slots_) {
    s.grad_ready = false;
    s.param.mutable_grad() = at::Tensor();
  }
  if (!is_root_) reshard();
}

void ParamGroup::finalize_backward() {
  // Gradients not reduced yet: a unit only partly used in this backward, or one that accumulated
  // without sync in earlier micro-batches and was not used in this one.
  if (state_->sync_gradients) {
    bool pending = false;
    for (const auto& s : slots_) pending = pending || s.param.grad().defined();
    if (pending) reduce_grads();
  }
  in_backward_ = false;
  awaiting_backward_ = false;
  reshard();
}

}  // namespace fsdp::detail
