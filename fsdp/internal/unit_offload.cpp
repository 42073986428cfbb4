// A unit's CPU offload (fsdp/options.h: CPUOffloadPolicy): the flat shard and the sharded
// gradients live in host memory (pinned when the model is on a CUDA device), the gathered
// parameters on the device. The data moves in two places only:
// - in: the host shard is copied into the all-gather's input on the device (begin_unshard), or
//   over one rank straight into the unsharded storage (copy_alone, also when the gather is
//   issued), cast on the way with mixed precision, on the all-gather's side stream (the all-gather
//   follows it there; the compute stream waits in gather());
// - out: the reduced gradients (the reduce-scatter's output, divided, in the master dtype) are
//   copied into a new pinned host buffer that the sharded gradients alias (finish_reduce), on the
//   reduction's side stream.
// Both copies are asynchronous from pinned memory (side streams off: on the current stream). The
// CPU must not read the host gradients, or write the host shard (the optimizer's step), before they
// have passed: wait_host_copies() blocks on the last of them, and the run state calls it where
// backward ends (RunState::finalize_backward, after which an optimizer may step) and after a
// forward without gradients. Accumulating into host gradients that exist already waits at once
// (the CPU adds). Buffers need no other care: PyTorch's pinned-memory allocator keeps a host block
// in use until the copies queued on it have passed, and a device buffer freed on the stream that
// copies it is reused only after the copy.
#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"
#include "fsdp/strategy.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>

#include <algorithm>

namespace fsdp::detail {

void Unit::resolve_offload() {
  const auto& policy = run_->options.offload_policy();
  if (!policy || slots_.empty()) return;
  const at::Device device = slots_.front().param.device();
  TORCH_CHECK(traits_.params_sharded, "fsdp::fully_shard (rank ", run_->comm.rank(), "): unit '", label(), "' is ",
              to_string(strategy_),
              " with FullyShardOptions::offload_policy; offload keeps the shards in host memory and gathers them "
              "to the device for each use, which needs a strategy that gathers the parameters from their shards: "
              "kFullShard, kShardGradOp or kHybridShard (at world size 1 they hold what kNoShard does). "
              "Choose one of those, or remove offload_policy.");
  offload_ = true;
  pin_ = policy->pin_memory() && device.is_cuda();
}

at::TensorOptions Unit::host_options(const at::TensorOptions& compute) const {
  return compute.device(at::kCPU).pinned_memory(pin_);
}

void Unit::copy_shard_in(const at::Tensor& shard) {
  auto copy = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    shard.copy_(buffers_.flat_shard, /*non_blocking=*/pin_);
    if (offload_) shard_copied_ = record_host_sync(shard.device());
  };
  if (!pin_) {  // mixed precision's cast on the device, or a synchronous copy from pageable memory
    copy();
    return;
  }
  // On the all-gather's side stream (FSDP2's all-gather copy-in stream), so that a prefetched
  // unit's copy overlaps the compute of the unit before it; the all-gather follows on that stream,
  // and gather() makes the compute stream wait (wait_shard_in).
  shard_in_ = shard_comm_->on_side(shard.device(), SideStream::kAllGather, copy);
}

void Unit::wait_shard_in() {
  if (auto done = std::move(shard_in_)) done->block_current();
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

}  // namespace fsdp::detail
