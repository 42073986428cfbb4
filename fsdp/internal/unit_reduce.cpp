// The unit's gradient reduction: once backward has produced a unit's gradients, they are packed
// and reduce-scattered (or all-reduced in buckets, kNoShard; then across groups, hybrid), and the
// result becomes the sharded gradients; a unit only partly used is reduced at the end of backward,
// and a backward that threw leaves nothing half done. The unit's gathering and hooks are in
// unit.cpp, the packing and the placement of the result in reduce.cpp.
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"

namespace fsdp::detail {

void Unit::launch_buckets(bool all) {
  // Buckets go out in one fixed order on every rank (Gloo pairs collectives by order): bucket b
  // only after b - 1, and only once backward produced all of its gradients (or at the end).
  while (next_bucket_ < buckets_.size()) {
    const Bucket& b = buckets_[next_bucket_];
    if (!all) {
      for (size_t i = b.first; i < b.last; ++i) {
        if (slots_[i].requires_grad && !slots_[i].grad_ready) return;
      }
    }
    if (world_size_ == 1 && !casts_grads()) {
      // Alone: the gradients are final as autograd left them (counted as issued).
      run_->comm.record(Comm::Op::kAllReduce, b.numel, reduce_what_);
      keep_local_grads(slots_, is_unsharded(), b.first, b.last);
    } else {
      if (next_bucket_ == 0) {
        reduce_out_ = at::empty({shard_numel()}, buffers_.flat_shard.options().dtype(reduce_dtype_));
        reduce_has_grad_.assign(slots_.size(), false);
        bucket_work_.clear();
      }
      pack_bucket(slots_, is_unsharded(), b, reduce_out_, reduce_has_grad_);
      run_->sample_state();  // the bucket's gradients and their copy, both alive
      for (size_t i = b.first; i < b.last; ++i) full_grad(slots_[i]) = at::Tensor();  // the bucket holds it now
      at::Tensor chunk = reduce_out_.narrow(0, b.offset, b.numel);
      if (world_size_ == 1) {  // alone, packed only for the cast to reduce_dtype (see casts_grads)
        run_->comm.record(Comm::Op::kAllReduce, b.numel, reduce_what_);
      } else {
        bucket_work_.push_back(run_->comm.all_reduce_async(chunk, c10d::ReduceOp::SUM, reduce_what_));
      }
    }
    ++next_bucket_;
    if (next_bucket_ == buckets_.size()) {
      reducing_ = true;
      run_->after_reduce_issued(*this);
    }
  }
}

void Unit::reduce_grads() {
  merge_unsynced();  // mixed precision: the micro-batches summed without sync (unit_precision.cpp)
  if (shard_numel() == 0) {
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
  run_->finish_reduces();
  if (world_size_ == 1 && !shards_are_rows_of_full() && !casts_grads() && !offload_) {
    // Alone: the gradients are final as autograd left them, and become the sharded ones (the
    // shard is the whole parameter) without a copy; counted as issued. (Offload packs them even
    // so: they go to the host.)
    shard_comm_->record(Comm::Op::kReduceScatter, shard_numel(), reduce_what_);
    keep_local_grads(slots_, is_unsharded(), 0, slots_.size());
    return;
  }
  // Packed in reduce_dtype: the cast of mixed precision's gradients happens in this copy.
  const auto opts = buffers_.unsharded.options().dtype(reduce_dtype_);
  // Sharded over one rank but replicated (hybrid groups of one): the packed gradients are this
  // rank's shard already, and become the reduced gradients (no pool: they outlive the step).
  reduce_in_ = S_ == 1 ? at::empty({shard_numel()}, opts) : run_->pool.take(S_ * shard_numel(), opts);
  pack_grads(slots_, is_unsharded(), S_, shard_numel(), reduce_in_, reduce_has_grad_);
  run_->sample_state();  // the unsharded gradients and their packed copy, both alive
  if (shards_are_rows_of_full()) {
    holds_reduced_ = true;  // the full gradients stay; they are no longer pending
  } else {
    for (auto& s : slots_) full_grad(s) = at::Tensor();  // unsharded gradients freed here
  }
  if (S_ == 1) {
    shard_comm_->record(Comm::Op::kReduceScatter, shard_numel(), reduce_what_);
    reduce_ = Pending{};
    reduce_out_ = std::move(reduce_in_);
  } else {
    // The reduce-scatter writes this rank's summed rows straight into the flat gradient shard.
    reduce_out_ = at::empty({shard_numel()}, opts);
    reduce_ = shard_comm_->reduce_scatter_sum_async(reduce_out_, reduce_in_, reduce_what_);
  }
  reducing_ = true;
  // Runs while the rest of backward computes; the run state bounds how many are in flight.
  run_->after_reduce_issued(*this);
}

void Unit::finish_reduce() {
  if (!reducing_) return;
  reducing_ = false;
  try {
    if (buckets()) {
      for (auto& p : bucket_work_) run_->comm.wait(p);
    } else {
      shard_comm_->wait(reduce_);
      run_->pool.give_back(reduce_in_);
      if (replicate_comm_ != nullptr && replicate_comm_->world_size() > 1) {
        // Hybrid: the group's sum of this shard, summed again over the groups holding it.
        replicate_comm_->all_reduce(reduce_out_, c10d::ReduceOp::SUM,
                                    describe("all-reduce of gradients across groups"));
      }
    }
  } catch (const std::exception& e) {
    bucket_work_.clear();  // before the buffers (see Unit::gather_)
    reduce_ = Pending{};
    reduce_in_ = at::Tensor();
    reduce_out_ = at::Tensor();
    next_bucket_ = 0;
    run_->mark_broken(error_text(e));
    throw;
  }
  bucket_work_.clear();
  next_bucket_ = 0;
  at::Tensor reduced = std::move(reduce_out_);
  if (!reduced.defined()) return;  // alone: the gradients were kept where they were (launch_buckets)
  reduced.div_(static_cast<double>(run_->comm.world_size()));
  // Mixed precision: the sum is in reduce_dtype; the optimizer steps the master dtype.
  if (reduced.scalar_type() != master_dtype_) reduced = reduced.to(master_dtype_);
  if (offload_) reduced = copy_grads_out(reduced);  // unit_offload.cpp
  if (shards_are_rows_of_full()) {
    stale_ = true;  // the optimizer steps the shards next
    write_rows_into_full_grads(slots_, is_unsharded(), reduced, reduce_has_grad_, shard_rank_);
  } else {
    add_to_sharded_grads(slots_, is_unsharded(), reduced, reduce_has_grad_);
  }
}

void Unit::reset_after_failed_backward() {
  // Reductions of the failed backward still in flight: waited for (the backend uses their
  // buffers) and thrown away. This runs at the next forward, after the user's zero_grad(), which
  // they must not undo.
  if (reducing_ || next_bucket_ > 0) {
    reducing_ = false;
    try {
      shard_comm_->wait(reduce_);
      for (auto& p : bucket_work_) run_->comm.wait(p);
    } catch (const std::exception& e) {
      run_->mark_broken(error_text(e));
    }
    bucket_work_.clear();
    next_bucket_ = 0;
    reduce_in_ = at::Tensor();
    reduce_out_ = at::Tensor();
  }
  try {
    wait_host_copies();  // offload: a gradient copy to the host may still be writing
  } catch (const std::exception& e) {
    run_->mark_broken(error_text(e));
  }
  if (backward_ != BackwardPhase::kRunning) return;
  backward_ = BackwardPhase::kIdle;
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

void Unit::finalize_backward() {
  // Gradients not reduced yet: a unit only partly used in this backward, or one that accumulated
  // without sync in earlier micro-batches and was not used in this one. (kShardOptimizerState
  // keeps its full gradients after reducing them; those are not pending.)
  if (!run_->sync_gradients) accumulate_unsynced();  // a unit partly used without sync
  if (run_->sync_gradients && !holds_reduced_) {
    // kNoShard: buckets launched while others wait for gradients that never came (unused
    // parameters) are pending too; the rest go out now, with zeros for the missing ones.
    const bool pending = (next_bucket_ > 0 && next_bucket_ < buckets_.size()) || holds_unsynced_grads();
    if (pending) reduce_grads();
  }
  backward_ = BackwardPhase::kIdle;
  reshard();
}

}  // namespace fsdp::detail
