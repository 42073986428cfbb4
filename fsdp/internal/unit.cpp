#include "fsdp/internal/unit.h"

#include "fsdp/activation_checkpoint.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/gather.h"
#include "fsdp/internal/run_state.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <bitset>
#include <memory>
#include <sstream>
#include <utility>

namespace fsdp::detail {
namespace {

// Runs after autograd accumulated a parameter's gradient into its .grad.
class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<Unit> unit, size_t slot) : unit_(std::move(unit)), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto u = unit_.lock()) u->on_grad_ready(slot_);
    return outputs;
  }

 private:
  std::weak_ptr<Unit> unit_;
  size_t slot_;
};

}  // namespace

Unit::Unit(std::string name, const std::vector<std::pair<std::string, at::Tensor>>& params,
           std::shared_ptr<RunState> run, bool is_root, ShardingStrategy strategy,
           const MixedPrecisionPolicy& mixed_precision)
    : name_(std::move(name)),
      run_(std::move(run)),
      is_root_(is_root),
      strategy_(strategy),
      traits_(traits(strategy)),
      mp_(mixed_precision) {
  for (const auto& [pname, p] : params) {
    if (!slots_.empty()) {
      const at::Tensor& first = slots_.front().param;
      FSDP_CHECK_IN(error_in("fsdp::fully_shard"), p.dtype() == first.dtype() && p.device() == first.device(), "unit '",
                    name_, "' mixes parameter '", slots_.front().name, "' (", first.dtype(), ", ", first.device(),
                    ") with '", pname, "' (", p.dtype(), ", ", p.device(),
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
  resolve_precision();  // unit_config.cpp
  resolve_offload();
}

std::string Unit::describe(const char* op) const {
  std::ostringstream os;
  os << op << " of unit '" << label() << "' (" << to_string(strategy_) << ", " << slots_.size() << " parameters, "
     << shard_numel() << " elements per rank)";
  return os.str();
}

ErrorContext Unit::error_context(const std::string& operation) const {
  return run_->comm().error_context(operation).unit(label());
}

std::string Unit::label() const {
  if (is_root_) return "<root>";
  return name_.empty() && !built_label_.empty() ? built_label_ : name_;
}

std::string unit_name(const std::vector<std::string>& member_paths) {
  std::string name;
  for (const auto& p : member_paths) name += (name.empty() ? "" : "+") + p;
  return name;
}

bool Unit::wrapped() const {
  return std::any_of(run_->units().begin(), run_->units().end(),
                     [&](const std::weak_ptr<Unit>& w) { return w.lock().get() == this; });
}

void Unit::set_members(int count, std::vector<int> slot_member) {
  FSDP_CHECK_IN(error_in("fsdp::fully_shard"), count <= 64, "unit '", name_, "' has ", count,
                " modules (share_unit_with); a unit can have at most 64. Join fewer modules, or make their parent "
                "the unit.");
  TORCH_INTERNAL_ASSERT(count >= 1 && (slot_member.empty() || slot_member.size() == slots_.size()));
  members_ = count;
  slot_member_ = std::move(slot_member);
}

void Unit::rename(const std::vector<std::string>& member_paths) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(member_paths.size()) == members_);
  const std::string name = unit_name(member_paths);
  if (name.empty() || name_ == name) return;
  name_ = name;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const std::string& path = member_paths[slot_member_.empty() ? 0 : slot_member_[i]];
    if (!path.empty()) slots_[i].name = path + "." + slots_[i].name;
  }
  name_collectives();
}

void Unit::name_collectives() {
  gather_what_ = describe("all-gather");
  reduce_what_ = buckets() ? describe("all-reduce of gradients") : describe("reduce-scatter of gradients");
}

void Unit::init() {
  Comm& world = run_->comm();
  const bool grouped = traits_.shard_over == ShardOver::kGroup;
  shard_comm_ = grouped ? run_->shard_comm() : &world;
  replicate_comm_ = grouped ? run_->replicate_comm() : nullptr;
  TORCH_INTERNAL_ASSERT(shard_comm_ != nullptr, "hybrid sharding without its process groups");
  S_ = traits_.shard_over == ShardOver::kNone ? 1 : shard_comm_->world_size();
  shard_rank_ = traits_.shard_over == ShardOver::kNone ? 0 : shard_comm_->rank();
  world_size_ = world.world_size();
  if (slots_.empty()) {
    state_ = UnitState::kSharded;
    return;
  }
  buffers_.shard_numel = lay_out(slots_, S_, shard_rank_);
  name_collectives();  // every collective carries its description, for error messages

  at::NoGradGuard no_grad;
  // Rank 0's weights everywhere, one parameter at a time and in place: no flat copy, so that
  // sharding a unit costs its own size once (what lets a model be sharded while it is built).
  if (run_->options().sync_module_states() && world.world_size() > 1) {
    const std::string what = describe("broadcast of rank 0's weights");
    for (auto& s : slots_) world.broadcast(s.param.detach(), 0, what);
  }
  // Sharded over one rank (world size 1, or hybrid groups of one), the shard is the whole unit:
  // its storage serves as the unsharded one, as when replicated, and gathering moves nothing.
  // With mixed precision the gathered parameters are a cast copy even then (kShards over one rank).
  // With offload the shard is in host memory and the gathered parameters on the device, apart even
  // over one rank.
  kind_ = shards_are_rows_of_full()                                ? BufferKind::kRowsOfFull
          : (buckets() || S_ == 1) && !casts_params() && !offload_ ? BufferKind::kWhole
                                                                   : BufferKind::kShards;
  const at::TensorOptions compute = slots_.front().param.options().requires_grad(false);
  buffers_ = make_buffers(slots_, buffers_.shard_numel, S_, shard_rank_, kind_,
                          offload_ ? host_options(compute) : compute, compute.dtype(param_dtype_));
  if (kind_ != BufferKind::kWhole &&
      (S_ > 1 || casts_params() || offload_)) {  // its buffers from the pool, at most this size
    run_->pool().note_unit(S_ * shard_numel() * static_cast<int64_t>(buffers_.unsharded.element_size()));
  }
  if (buckets()) {
    const int64_t cap = std::max<int64_t>(1, run_->options().bucket_bytes() / buffers_.flat_shard.element_size());
    RunState* run = run_.get();
    buckets_ = BucketReducer(make_buckets(slots_, cap),
                             {&run_->comm(), buffers_.flat_shard.options().dtype(reduce_dtype_), shard_numel(),
                              world_size_ == 1 && !casts_grads(), [run] { run->sample_state(); }});
  }

  std::weak_ptr<Unit> self = weak_from_this();
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
  state_ = UnitState::kUnsharded;  // make_buffers pointed the parameters at their full views
  reshard();
  // kShardOptimizerState: the program may write the shards (this rank's rows of the full
  // parameters) before the first forward, as between steps: that forward gathers them.
  stale_ = shards_are_rows_of_full();
}

void Unit::reshard() {
  members_run_ = 0;
  if (state_ == UnitState::kGathering) {  // prefetched but not used: Gloo may still be writing into the buffer
    drop_prefetch();
    return;
  }
  use_shard_views();
  free_unsharded_memory();
  enter(UnitState::kSharded);
}

void Unit::pre_forward(int member) {
  // A unit called inside fsdp::activation_checkpoint runs again in backward, where its forward
  // hooks would gather it a second time outside any forward: the unit itself must be checkpointed.
  FSDP_CHECK_IN(error_in("fsdp"), !in_activation_recompute(), "unit '", label(),
                "' ran its forward in the recompute of an fsdp::activation_checkpoint (in backward). A sharded unit "
                "cannot be called inside fsdp::activation_checkpoint: checkpoint the unit instead, "
                "unit->set_activation_checkpointing(true) or FullyShardOptions::activation_checkpointing_every, "
                "which recomputes it while it is gathered for its backward.");
  // A unit's forward belongs inside the handle's: called around it, the root's own parameters are
  // its shards (a silently wrong result under NoGradGuard) and nothing is prepared for backward.
  const bool outside = !run_->in_root_forward();
  const bool direct = outside && run_->direct_access() > 0;
  run_->access_error_explained() = direct;  // said here: no second hint as the error leaves the handle
  FSDP_CHECK_IN(error_in("fsdp"), !outside, "unit '", label(), "' ran its forward ",
                direct ? "inside a call through the handle's operator-> (such as model->forward(x)), which calls the "
                         "module's own forward around the wrapper"
                       : "outside the wrapped model's forward: the module given to fsdp::fully_shard (or one of its "
                         "units) was called itself, net(x), net->forward(x) or (*model).forward(x), around the wrapper",
                ": the root's parameters stay sharded and nothing is prepared for backward. Call the handle itself: "
                "model(x) or model.forward(x).");
  // Modules sharing the unit: the first of them to run gathers it; the others find it gathered.
  const bool first = members_run_ == 0;
  members_run_ |= uint64_t{1} << member;
  if (!first && state_ == UnitState::kUnsharded) return;
  unshard();
  run_->after_unit_unsharded(*this, /*backward=*/false);
  run_->sample_state();
}

void Unit::post_forward(const std::vector<at::Tensor>& outputs, int member) {
  const bool grad = c10::GradMode::is_enabled();
  if (grad) {
    std::weak_ptr<Unit> self = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      if (!forward_token_) {  // this forward's first hooked output: one more backward to come
        forward_token_ = std::make_shared<ForwardToken>();
        awaiting_.erase(std::remove_if(awaiting_.begin(), awaiting_.end(),
                                       [](const std::weak_ptr<ForwardToken>& w) { return w.expired(); }),
                        awaiting_.end());
        awaiting_.push_back(forward_token_);
      }
      // Fires when the gradient w.r.t. this output is complete, i.e. right before this unit's
      // backward: the unit's pre-backward. It fires once per backward: a second time is a second
      // backward through this forward (retain_graph), whose gathered parameters the first freed
      // (LibTorch would fail on their empty storage, saying nothing of why): refused here.
      auto fired = std::make_shared<bool>(false);
      const_cast<at::Tensor&>(t).register_hook([self, fired, token = forward_token_](const at::Tensor&) {
        auto u = self.lock();
        if (!u) return;
        // Gathered still (a pipeline's weight-gradient pass, FSDPModule::unshard): nothing to do.
        if (*fired && u->is_unsharded()) return;
        FSDP_CHECK_IN(u->error_context("backward").api("fsdp"), !*fired,
                      "a second backward through the forward of unit '", u->label(),
                      "' (retain_graph=true, or torch::autograd::grad after a backward): the first backward "
                      "freed its gathered parameters and reduced its gradients. Run the forward again for each "
                      "backward; to use one loss twice, add the losses and call backward once.");
        *fired = true;
        u->pre_backward(*token);
      });
      if (backward_ == BackwardPhase::kIdle) backward_ = BackwardPhase::kAwaiting;
    }
  }
  // Modules sharing the unit: it stays gathered until each has run (one that never runs in this
  // forward: until the end of the model's forward, RunState::end_forward).
  if (static_cast<int>(std::bitset<64>(members_run_ | (uint64_t{1} << member)).count()) < members_) return;
  finish_forward();
}

void Unit::finish_forward() {
  members_run_ = 0;
  forward_token_.reset();  // the next forward hooks its outputs with a token of its own
  const bool grad = c10::GradMode::is_enabled();
  // The root keeps its gathered memory into its backward (it is the first to need it again).
  if (!grad || (!is_root_ && traits_.reshard_after_forward && run_->reshard_after_forward())) {
    reshard();
  } else {
    keep_gathered();
  }
}

void Unit::keep_gathered() {
  if (state_ != UnitState::kUnsharded) return;
  // Gathered memory kept, but the parameters are the shards again: between forward and backward
  // (or a pipeline's passes) a user may zero the gradients or step (a forward whose backward
  // never comes), and must find the shards. Autograd saved the parameter itself, whose full view
  // pre_backward() (or the next forward, or unshard) restores before it is used.
  use_shard_views();
  enter(UnitState::kKeptForBackward);
}

bool Unit::awaits_backward() const {
  return std::any_of(awaiting_.begin(), awaiting_.end(), [](const std::weak_ptr<ForwardToken>& w) {
    const auto t = w.lock();
    return t && !t->started;
  });
}

void Unit::pre_backward(ForwardToken& token) {
  // Once per forward: the first of its outputs' hooks to fire (the others find it started). The
  // backward of another forward of this unit (a pipeline's next microbatch) begins afresh; two
  // forwards whose outputs meet in one loss share one backward.
  if (token.started) return;
  token.started = true;  // also when another forward's backward runs: one backward through both
  if (backward_ == BackwardPhase::kRunning) return;
  backward_ = BackwardPhase::kIdle;
  run_->on_backward_begin();
  unshard();
  run_->after_unit_unsharded(*this, /*backward=*/true);
  run_->sample_state();
  backward_ = BackwardPhase::kRunning;
  grads_ready_ = 0;
  for (auto& s : slots_) s.grad_ready = false;
  stale_ = false;  // kShardOptimizerState: the shards were gathered by the forward that led here
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

void Unit::on_grad_ready(size_t slot) {
  ParamSlot& s = slots_[slot];
  FSDP_CHECK_IN(error_in("fsdp"), backward_ == BackwardPhase::kRunning, "parameter '", s.name,
                "' received a gradient although the backward of its unit '", label(),
                "' never began. Was the module called directly instead of through its fsdp::Sharded wrapper "
                "(or the root through the handle fsdp::fully_shard returned)?");
  if (s.grad_ready) return;
  s.grad_ready = true;
  ++grads_ready_;
  advance_backward();
}

void Unit::checkpoint_backward_done() {
  if (checkpoints_pending_ > 0) --checkpoints_pending_;
  if (backward_ == BackwardPhase::kRunning) advance_backward();  // what the recomputes held back
}

void Unit::advance_backward() {
  if (checkpoints_pending_ > 0) return;  // a recompute to come may add to any gradient
  // Replicated: each bucket goes out as soon as its gradients are complete (all of them are out
  // once the unit's last gradient arrives).
  if (buckets() && run_->sync_gradients()) launch_buckets(/*all=*/false);
  if (grads_ready_ == grads_expected_) grads_complete();
}

void Unit::grads_complete() {
  // Without gradient sync (all but the last micro-batch of an accumulation) the unsharded
  // gradients keep accumulating beside the parameters; nothing is communicated.
  if (run_->sync_gradients() && !buckets()) reduce_grads();
  if (!run_->sync_gradients()) accumulate_unsynced();
  backward_ = idle_or_awaiting();
  // A frozen parameter's last reader may still be ahead in the graph (autograd runs gradient
  // accumulation as soon as it can): such a unit stays gathered until the end of backward.
  if (grads_expected_ == slots_.size()) reshard_after_backward();
}

void Unit::reshard_after_backward() {
  if (run_->reshard_after_backward()) {
    reshard();
  } else {
    keep_gathered();  // for a pipeline's next microbatch
  }
}

void Unit::finalize_backward() {
  // Gradients not reduced yet: a unit only partly used in this backward, or one that accumulated
  // without sync in earlier micro-batches and was not used in this one. (kShardOptimizerState
  // keeps its full gradients after reducing them; those are not pending.)
  if (!run_->sync_gradients()) accumulate_unsynced();  // a unit partly used without sync
  if (run_->sync_gradients() && !holds_reduced_) {
    // kNoShard: buckets launched while others wait for gradients that never came (unused
    // parameters) are pending too; the rest go out now, with zeros for the missing ones.
    if (buckets_.partly_launched() || holds_unsynced_grads()) reduce_grads();
  }
  backward_ = idle_or_awaiting();
  checkpoints_pending_ = 0;  // a checkpointed forward whose output backward never reached
  reshard_after_backward();
}

void Unit::reset_after_failed_backward() {
  checkpoints_pending_ = 0;
  // Reductions of the failed backward still in flight: waited for (the backend uses their
  // buffers) and thrown away. This runs at the next forward, after the user's zero_grad(), which
  // they must not undo.
  if (reducing_ || buckets_.partly_launched()) {
    reducing_ = false;
    run_->breaks_on_failure(
        [&] {
          shard_comm_->wait(reduce_);
          std::vector<bool> ignored;
          buckets_.finish(ignored);
        },
        {}, RunState::Rethrow::kNo);
    abandon_reduction();
  }
  // Offload: a gradient copy to the host may still be writing.
  run_->breaks_on_failure([&] { wait_host_copies(); }, {}, RunState::Rethrow::kNo);
  if (backward_ != BackwardPhase::kRunning) return;
  backward_ = idle_or_awaiting();
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
    if (zeroed && is_unsharded() && s.shard_grad.defined()) {
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

void Unit::append_held_tensors(std::vector<at::Tensor>& out) const {
  for (const at::Tensor* t :
       {&buffers_.flat_shard, &buffers_.unsharded, &gathered_, &gather_in_, &reduce_in_, &reduce_out_}) {
    out.push_back(*t);
  }
  for (const auto& s : slots_) {
    for (const at::Tensor* t : {&s.param, &s.sharded, &s.shard_grad, &s.full_grad, &s.unsynced}) out.push_back(*t);
    out.push_back(s.param.grad());
  }
}

bool Unit::holds_unsynced_grads() const {
  if (holds_reduced_) return false;  // kShardOptimizerState's full gradients after their reduction
  return std::any_of(slots_.begin(), slots_.end(), [&](const ParamSlot& s) {
    return full_grad_of(s, is_unsharded()).defined() || s.unsynced.defined();
  });
}

void Unit::check_conversion(const std::optional<at::Device>& device, const std::optional<at::ScalarType>& dtype,
                            bool converting) const {
  if (offload_ && device) {
    // Offload: the model is on its device although the shards are in host memory.
    const at::Device model = buffers_.unsharded.device();
    FSDP_CHECK_IN(error_in("fsdp"), is_on(model, *device), ".to(", device->str(), ") on the wrapped model: unit '",
                  label(), "' is on ", model,
                  " with its shards offloaded to host memory (FullyShardOptions::offload_policy). A wrapped model's "
                  "device is fixed: wrap a model built on ",
                  *device, " without offload_policy instead.");
  }
  // The device was checked above when offloading: the shards' (host) device is not the model's.
  detail::check_conversion(slots_, offload_ ? std::nullopt : device, dtype, error_in("fsdp"), label(), converting);
}

}  // namespace fsdp::detail
