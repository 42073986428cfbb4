// Options of fsdp::fully_shard, in LibTorch's chained-setter style:
//   fsdp::FullyShardOptions().timeout(std::chrono::seconds(60)).sync_module_states(false)
#pragma once

#include "fsdp/env.h"
#include "fsdp/export.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/strategy.h"

#include <c10/core/Device.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// CPU offload (PyTorch FSDP2's CPUOffloadPolicy, DeepSpeed's ZeRO-Offload): a CUDA model's
/// shards, sharded gradients and optimizer state live in host memory (pinned, so that copies to
/// and from the GPU run asynchronously); each unit's shard is copied to the GPU just before its
/// all-gather (cast there with mixed precision), its reduced gradients back just after the
/// reduce-scatter, and the optimizer steps on the CPU (fsdp::optim::FusedAdamW: one vectorized,
/// multi-threaded pass per unit). The GPU holds only the units gathered at the moment and the
/// gradients in transit.
///
/// What the program sees: between steps the parameters are CPU tensors (their shards) with CPU
/// gradients, so an optimizer built on model->parameters() after wrapping keeps its state on the
/// CPU; inside forward and backward they are the full CUDA tensors. Inputs stay on the GPU.
/// For the strategies that gather parameters from shards (kFullShard, kShardGradOp, kHybridShard);
/// kNoShard and kShardOptimizerState keep full parameters on the GPU and refuse it. Only for models
/// on a CUDA device: a CPU model has nothing to offload and is refused.
struct CPUOffloadPolicy {
  /// Page-locked host memory for the shards and gradients: copies overlap compute. False: pageable
  /// memory, each copy synchronous (less pinned memory, slower).
  TORCH_ARG(bool, pin_memory) = true;
};

struct FullyShardOptions {
  /// Bound on every collective the library issues, whatever the backend does with it: a peer that
  /// does not answer in time makes this rank throw an error naming the operation, the unit, the
  /// group and (where known) the peer, instead of hanging. Precedence: this option when set, else
  /// $FSDP_TIMEOUT (seconds), else 10 minutes (as c10d and NCCL). Lower it for interactive runs:
  ///   fsdp::FullyShardOptions().timeout(std::chrono::seconds(60))
  FullyShardOptions& timeout(std::chrono::milliseconds t) {
    timeout_ = t;
    return *this;
  }
  std::chrono::milliseconds timeout() const { return timeout_ ? *timeout_ : default_timeout(); }
  /// Broadcast rank 0's initial weights to every rank when wrapping, so that ranks seeded
  /// differently still start from one model.
  TORCH_ARG(bool, sync_module_states) = true;
  /// What is sharded and when it is gathered: fsdp/strategy.h's table (kStrategies) says it per
  /// strategy, with its memory and communication; docs/strategies.md says when to choose which.
  /// The root unit's gathered memory always stays from its forward to its backward.
  TORCH_ARG(ShardingStrategy, strategy) = ShardingStrategy::kFullShard;
  /// Units whose all-gather is issued ahead of use: the next units in forward order during
  /// forward, the previous ones during backward. 0 gathers each unit only when it runs. Each unit
  /// in flight costs its unsharded size in memory.
  TORCH_ARG(int, prefetch) = 1;
  /// kHybridShard: ranks per sharding group (S); must divide the world size. Groups are
  /// consecutive ranks ([0, S), [S, 2S), ...), so with one node of S processes each, sharding
  /// traffic stays inside a node.
  TORCH_ARG(int, shard_group_size) = 0;
  /// kNoShard: gradients are all-reduced in buckets of about this many bytes, each issued as soon
  /// as backward has produced all of its gradients (PyTorch DDP's bucket_cap_mb, 25 MiB).
  TORCH_ARG(int64_t, bucket_bytes) = 25 * 1024 * 1024;
  /// Mixed precision for every unit (fsdp/mixed_precision.h); a unit's own policy
  /// (ShardedUnit::set_mixed_precision) overrides it. Default: none, everything in the model's dtype.
  TORCH_ARG(MixedPrecisionPolicy, mixed_precision);
  /// Keep the shards, gradients and optimizer state in host memory (see CPUOffloadPolicy). Unset:
  /// everything stays on the model's device.
  TORCH_ARG(std::optional<CPUOffloadPolicy>, offload_policy) = std::nullopt;
  /// Where the model's parameters and buffers live once wrapped (PyTorch FSDP1's device_id):
  /// fsdp::fully_shard moves them there before sharding, and inside a ShardingScope each unit moves
  /// as soon as it is built, so that a model built on the CPU never holds more than one unit in
  /// host memory on its way to the GPU:
  ///   fsdp::FullyShardOptions().device(fsdp::cuda_device())
  /// Unset: they stay where the model put them. A CPU model, or a CUDA one, only (a CUDA device
  /// this process cannot see is refused before anything moves).
  TORCH_ARG(std::optional<c10::Device>, device) = std::nullopt;
  /// CUDA (NCCL): all-gathers on one side stream and gradient reductions on another, as FSDP2, so
  /// that a prefetched all-gather does not queue behind a reduce-scatter; the compute stream waits
  /// for each on a CUDA event, the CPU never does. False: every collective on NCCL's own stream
  /// (one queue). Ignored on CPU.
  TORCH_ARG(bool, comm_streams) = true;
  /// Activation checkpointing (fsdp/activation_checkpoint.h) of every k-th unit: the units that
  /// contain no other unit, counted in module order from 1, checkpoint when their number is a
  /// multiple of k (1: every one; 2: the 2nd, 4th, ...). 0 (default): none. A unit's own
  /// ShardedUnit::set_activation_checkpointing overrides it. A checkpointed unit's forward keeps
  /// only its inputs and runs again in backward, while the unit is gathered for its backward: the
  /// collectives stay the same, activation memory drops, each step costs one more forward of it.
  TORCH_ARG(int, activation_checkpointing_every) = 0;

 public:
  /// Before every collective, all ranks first exchange a fingerprint of it (operation, unit, size)
  /// and compare: a rank that took another code path then fails every rank with an error naming
  /// what each rank was about to do, instead of pairing mismatched collectives. Costs one small
  /// collective per collective, so it is a debugging aid (like TORCH_DISTRIBUTED_DEBUG=DETAIL);
  /// without it the library still compares ranks at every forward, backward and clipping call.
  /// Default: $FSDP_VERIFY_COLLECTIVES=1 turns it on.
  FullyShardOptions& verify_collectives(bool on) {
    verify_collectives_ = on;
    return *this;
  }
  bool verify_collectives() const { return verify_collectives_ ? *verify_collectives_ : verify_collectives_from_env(); }

 private:
  std::optional<std::chrono::milliseconds> timeout_;
  std::optional<bool> verify_collectives_;
};

}  // namespace fsdp

FSDP_PUBLIC_END
