// The unit's reduce path, FSDP2's foreach_reduce: once backward has produced a unit's gradients
// they are packed into one buffer in reduce_dtype (the cast of mixed precision happens in this
// copy), reduce-scattered over the unit's shard ranks (kNoShard: all-reduced in buckets, see
// bucket_reducer.h), all-reduced across hybrid's groups (unless its replicas train apart:
// fsdp::optim::LocalSGD), divided by the ranks that summed them, cast back to the master dtype,
// copied to host memory with offload, and made the sharded gradients (ZeRO-1: written into the
// full gradients' rows). The strategy's traits decide which. A unit only partly
// used is reduced at the end of backward (Unit::finalize_backward); without gradient sync, nothing
// is sent and the micro-batches accumulate (in the master dtype with mixed precision).
//
// CPU offload's copy out runs on the reduction's side stream into a new pinned host buffer per
// unit, asynchronously; the CPU must not read the host gradients, or write the host shard (the
// optimizer's step), before the copies have passed: wait_host_copies() blocks on the last of them,
// and the run state calls it where backward ends (after which an optimizer may step) and after a
// forward without gradients. Accumulating into host gradients that exist already waits at once (the
// CPU adds). PyTorch's pinned-memory allocator keeps a host block in use until the copies queued on
// it have passed, and a device buffer freed on the stream that copies it is reused only after the copy.
#include "fsdp/internal/check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace fsdp::detail {

void Unit::reduce_grads() {
  merge_unsynced();  // mixed precision: the micro-batches summed without sync
  if (shard_numel() == 0) {
    for (auto& s : slots_) full_grad(s) = at::Tensor();
    return;
  }
  if (buckets()) {
    if (buckets_.all_launched()) finish_reduce();  // reduced once already in this backward
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
    shard_comm_->record(Call::kReduceScatter, shard_numel(), reduce_what_);
    keep_local_grads(slots_, is_unsharded(), 0, slots_.size());
    return;
  }
  const auto opts = buffers_.unsharded.options().dtype(reduce_dtype_);
  // Sharded over one rank but replicated (hybrid groups of one): the packed gradients are this
  // rank's shard already, and become the reduced gradients (no pool: they outlive the step).
  reduce_in_ = S_ == 1 ? at::empty({shard_numel()}, opts) : run_->pool().take(S_ * shard_numel(), opts);
  pack_grads(slots_, is_unsharded(), S_, shard_numel(), reduce_in_, reduce_has_grad_);
  run_->sample_state();  // the unsharded gradients and their packed copy, both alive
  if (shards_are_rows_of_full()) {
    holds_reduced_ = true;  // the full gradients stay; they are no longer pending
  } else {
    for (auto& s : slots_) full_grad(s) = at::Tensor();  // unsharded gradients freed here
  }
  if (S_ == 1) {
    shard_comm_->record(Call::kReduceScatter, shard_numel(), reduce_what_);
    reduce_ = Pending{};
    reduce_out_ = std::move(reduce_in_);
  } else {
    // The reduce-scatter writes this rank's summed rows straight into the flat gradient shard.
    reduce_out_ = at::empty({shard_numel()}, opts);
    run_->breaks_on_failure(
        [&] { reduce_ = shard_comm_->reduce_scatter_sum_async(reduce_out_, reduce_in_, reduce_what_); });
  }
  reduction_issued();
}

void Unit::launch_buckets(bool all) {
  bool launched = false;
  run_->breaks_on_failure([&] { launched = buckets_.launch(slots_, is_unsharded(), all, reduce_what_); });
  if (launched) reduction_issued();
}

void Unit::reduction_issued() {
  reducing_ = true;
  // Runs while the rest of backward computes; the run state bounds how many are in flight.
  run_->after_reduce_issued(*this);
}

void Unit::finish_reduce() {
  if (!reducing_) return;
  reducing_ = false;
  at::Tensor reduced;
  run_->breaks_on_failure(
      [&] {
        if (buckets()) {
          reduced = buckets_.finish(reduce_has_grad_);
          return;
        }
        shard_comm_->wait(reduce_);
        run_->pool().give_back(reduce_in_);
        reduced = std::move(reduce_out_);
        if (replicate_comm_ != nullptr && replicate_comm_->world_size() > 1 && !run_->replicas_apart()) {
          // Hybrid: the group's sum of this shard, summed again over the groups holding it (not
          // while the replicas train apart: LocalSGD / DiLoCo average them at their outer step).
          replicate_comm_->all_reduce(reduced, c10d::ReduceOp::SUM, describe("all-reduce of gradients across groups"));
        }
      },
      [&] { abandon_reduction(); });
  // Undefined: alone, the gradients were kept where they were (BucketReducer's in_place).
  if (reduced.defined()) place_reduced(std::move(reduced));
}

void Unit::place_reduced(at::Tensor reduced) {
  // The mean over the ranks whose gradients were summed: the data-parallel group's, or the shard
  // group's while the replicas train apart.
  reduced.div_(static_cast<double>(run_->step_comm().world_size()));
  if (reduced.scalar_type() != master_dtype_) reduced = reduced.to(master_dtype_);  // the optimizer's dtype
  if (offload_) reduced = copy_grads_out(reduced);
  if (shards_are_rows_of_full()) {
    stale_ = true;  // the optimizer steps the shards next
    write_rows_into_full_grads(slots_, is_unsharded(), reduced, reduce_has_grad_, shard_rank_);
  } else {
    add_to_sharded_grads(slots_, is_unsharded(), reduced, reduce_has_grad_);
  }
}

at::Tensor Unit::copy_grads_out(const at::Tensor& reduced) {
  // Pinned like the shard (options() keeps dtype and device, not pinning), so the copy is
  // asynchronous; on the reduction's side stream, after the sum and its division.
  at::Tensor host = at::empty({shard_numel()}, buffers_.flat_shard.options().pinned_memory(pin_));
  auto copy = [&] {
    host.copy_(reduced, /*non_blocking=*/pin_);
    grads_copied_ = record_host_sync(reduced.device());
  };
  if (pin_) {
    grads_out_ = shard_comm_->on_side(reduced.device(), SideStream::kReduce, copy);
    grads_src_ = reduced;  // read by the copy on the side stream: freed after it (wait_host_copies)
  } else {
    copy();
  }
  // Gradients from an earlier backward (accumulation) are added on the CPU: the copy must be there.
  const bool accumulates =
      std::any_of(slots_.begin(), slots_.end(), [&](const ParamSlot& s) { return shard_grad(s).defined(); });
  if (accumulates) wait_host_copies();
  return host;
}

void Unit::wait_host_copies() {
  if (auto sync = std::move(shard_copied_)) sync->synchronize();
  if (auto sync = std::move(grads_copied_)) sync->synchronize();
  grads_out_.reset();  // passed (the CPU waited): the stream's wait on it costs nothing
  grads_src_ = at::Tensor();
}

void Unit::abandon_reduction() {
  buckets_.abandon();  // the Pendings before the buffers (see Unit::gather_)
  reduce_ = Pending{};
  reduce_in_ = at::Tensor();
  reduce_out_ = at::Tensor();
}

void Unit::accumulate_unsynced() {
  // FSDP2 likewise accumulates unsynced gradients in a wider dtype (its reduce_dtype); here the
  // master dtype, so that the sum of M micro-batches rounds once per addition in fp32, as plain
  // LibTorch accumulating fp32 gradients would, whatever reduce_dtype is.
  if (!casts_params()) return;
  at::NoGradGuard no_grad;
  for (auto& s : slots_) {
    at::Tensor& g = full_grad(s);
    if (!g.defined()) continue;
    if (s.unsynced.defined()) {
      s.unsynced.add_(g);
    } else {
      s.unsynced = g.to(master_dtype_);
    }
    g = at::Tensor();
  }
}

void Unit::merge_unsynced() {
  at::NoGradGuard no_grad;
  for (auto& s : slots_) {
    if (!s.unsynced.defined()) continue;
    at::Tensor& g = full_grad(s);
    g = g.defined() ? s.unsynced.add_(g) : s.unsynced;
    s.unsynced = at::Tensor();
  }
}

}  // namespace fsdp::detail
