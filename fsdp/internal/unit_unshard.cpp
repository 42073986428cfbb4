// The unit's unshard path, FSDP2's foreach_all_gather: the all-gather's input is the flat shard
// itself, or a buffer it is copied into first (ZeRO-1's rows packed, the shard cast to param_dtype
// with mixed precision, copied from host memory to the device with offload); the all-gather is
// issued ahead of use when prefetched; its output is copied out into the unsharded storage, whose
// memory the buffer pool lends only while the unit is gathered; the parameters then point at their
// full views. Over one rank nothing moves, or (mixed precision, offload) one copy stands in for the
// all-gather. The strategy's traits decide what is gathered and when (needs_gather).
//
// CPU offload's copy in runs on the all-gather's side stream when the gather is issued, so that a
// prefetched unit's copy overlaps the compute of the unit before it; the compute stream waits for
// it in gather() (wait_shard_in). Its way back, and the CPU's waits, are in unit_reduce.cpp.
#include "fsdp/internal/check.h"
#include "fsdp/internal/gather.h"
#include "fsdp/internal/race_delay.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"

#include <ATen/core/LegacyTypeDispatch.h>

namespace fsdp::detail {

bool Unit::needs_gather() const {
  if (shard_numel() == 0 || traits_.shard_over == ShardOver::kNone) return false;
  if (shards_are_rows_of_full()) {
    // The optimizer steps the shards after a reduction (and a program may write them after
    // wrapping), so every forward until the next backward gathers (the step may come after any of
    // them). Never in backward: the unit is gathered already. The decision must be the same on
    // every rank, so it rests on this flag, never on whether this rank's shards changed (a rank
    // may own no rows, and torch::optim::SGD steps through .data(), which no version counter sees).
    if (backward_ == BackwardPhase::kRunning || run_->in_backward()) return false;
    return stale_;
  }
  return !memory_gathered();
}

void Unit::begin_unshard() {
  if (state_ == UnitState::kGathering || state_ == UnitState::kUnsharded || !needs_gather()) return;
  adopt_replaced_shards();  // the gather reads the shards
  if (S_ == 1) {
    // One rank: the unsharded storage is the shard's (or, ZeRO-1, the full parameters are the
    // rows), so there is nothing to move; with mixed precision or offload a copy stands in for
    // the gather. Counted as issued, as the algorithm has it.
    shard_comm_->record(Call::kAllGather, shard_numel(), gather_what_);
    if (casts_params() || offload_) copy_alone();
    enter(UnitState::kGathering);
    return;
  }
  // Only the all-gather output is taken now; the unsharded storage when the gather is waited for,
  // so a unit in flight costs its size once, not twice.
  gathered_ = run_->pool().take(S_ * shard_numel(), buffers_.unsharded.options());
  at::Tensor in = gather_input();
  // A launch that fails (or a call that differs between ranks, under verify_collectives) leaves
  // the ranks at different collectives, as a failed wait does.
  run_->breaks_on_failure([&] { gather_ = shard_comm_->all_gather_async(gathered_, in, gather_what_); });
  enter(UnitState::kGathering);
}

at::Tensor Unit::gather_input() {
  if (!shards_are_rows_of_full() && !casts_params() && !offload_) return buffers_.flat_shard;
  gather_in_ = run_->pool().take(shard_numel(), buffers_.unsharded.options());
  if (shards_are_rows_of_full()) {
    pack_rows(slots_, gather_in_);
  } else {
    copy_shard_in(gather_in_);  // the all-gather moves param_dtype bytes, on the device
  }
  return gather_in_;
}

void Unit::copy_shard_in(const at::Tensor& dst) {
  auto copy = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    dst.copy_(buffers_.flat_shard, /*non_blocking=*/pin_);
    if (offload_) shard_copied_ = record_host_sync(dst.device());
  };
  if (!pin_) {  // mixed precision's cast on the device, or a synchronous copy from pageable memory
    copy();
    return;
  }
  // On the all-gather's side stream (FSDP2's all-gather copy-in stream); the all-gather follows on
  // that stream, and gather() makes the compute stream wait (wait_shard_in).
  shard_in_ = shard_comm_->on_side(dst.device(), SideStream::kAllGather, copy);
}

void Unit::copy_alone() {
  // Over one rank the gathered parameters would be the shard itself; with mixed precision they are
  // its cast copy, with offload its copy on the device, in the unsharded storage, which exists only
  // while the unit is gathered (from the moment the gather is issued, as a gather's output).
  unsharded_memory_ = run_->pool().take(shard_numel(), buffers_.unsharded.options());
  lend_memory(buffers_.unsharded, unsharded_memory_);
  copy_shard_in(buffers_.unsharded);
}

void Unit::wait_shard_in() {
  if (auto done = std::move(shard_in_)) done->block_current();
}

void Unit::unshard() {
  if (slots_.empty() || state_ == UnitState::kUnsharded) return;
  if (state_ != UnitState::kGathering) adopt_replaced_shards();
  // Only empty parameters (shard_numel == 0, the same on every rank): nothing to gather.
  if (shard_numel() > 0 && (state_ == UnitState::kGathering || needs_gather())) gather();
  use_full_views();
}

void Unit::gather() {
  begin_unshard();
  if (S_ == 1) {  // nothing was moved (begin_unshard); with mixed precision a cast, with offload a copy
    wait_shard_in();
    return;
  }
  auto complete = [&] {
    wait_gather();
    wait_shard_in();  // offload: before the all-gather on the same side stream, so passed already
    run_->pool().give_back(gather_in_);
    // The race switch's delay of the compute side (a GPU's compute stream; nothing on CPU, where
    // compute is the caller's thread and a delay there would only hide races).
    if (race_delay_seed() != 0) {
      sleep_current_stream(gathered_.device(), next_race_delay(RaceSide::kCompute, shard_comm_->global_rank()));
    }
  };
  // Tests only: the output read before the wait, the missing wait that the race switch must show.
  const bool early = reads_gathers_before_wait();
  if (!early) complete();
  if (kind_ == BufferKind::kShards) {
    unsharded_memory_ = run_->pool().take(S_ * shard_numel(), buffers_.unsharded.options());
    lend_memory(buffers_.unsharded, unsharded_memory_);
  }
  // One copy-out fills every parameter, and the output goes back to the pool right after, before
  // any further prefetch is issued.
  copy_out(gathered_, buffers_.unsharded, slots_, S_, shard_numel());
  if (early) complete();
  run_->pool().give_back(gathered_);
}

void Unit::wait_gather() {
  // A failed gather is dropped so that nothing ever reads it (Gloo and NCCL's own stream keep
  // their reference; on a side stream the wait was queued before the error was seen).
  run_->breaks_on_failure([&] { shard_comm_->wait(gather_); },
                          [&] {
                            shard_in_.reset();  // the current stream waits for the copy before the buffers go
                            gathered_ = at::Tensor();
                            gather_in_ = at::Tensor();
                            enter(UnitState::kSharded);
                          });
}

void Unit::drop_prefetch() {
  if (state_ != UnitState::kGathering) return;
  if (S_ > 1) wait_gather();
  wait_shard_in();
  run_->pool().give_back(gathered_);
  run_->pool().give_back(gather_in_);  // kShardOptimizerState: not copied out, so the unit stays due
  free_unsharded_memory();             // over one rank: the copy made when the gather was issued
  enter(UnitState::kSharded);
}

void Unit::free_unsharded_memory() {
  if (!unsharded_memory_.defined()) return;
  take_memory_back(buffers_.unsharded);
  run_->pool().give_back(unsharded_memory_);
}

void Unit::use_full_views() {
  if (state_ == UnitState::kUnsharded) return;
  point_at_full_views(slots_);
  enter(UnitState::kUnsharded);
}

void Unit::use_shard_views() {
  if (state_ == UnitState::kUnsharded) point_at_shards(slots_);
}

void Unit::adopt_replaced_shards() {
  if (state_ == UnitState::kUnsharded) return;  // the parameters are the full views
  if (adopt_replaced(slots_, shard_rank_, error_in("fsdp"), label())) mark_shards_written();
}

void Unit::gather_full(std::vector<at::Tensor>& out, const at::Device& device) {
  TORCH_INTERNAL_ASSERT(state_ == UnitState::kSharded, "gather_full of unit '", label(), "' while it is ",
                        to_string(state_));
  adopt_replaced_shards();
  run_->breaks_on_failure([&] {
    detail::gather_full(slots_, buffers_, shards_are_rows_of_full(), S_, *shard_comm_,
                        describe("all-gather of full weights"), device, out);
  });
}

}  // namespace fsdp::detail
