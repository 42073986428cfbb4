// LocalSGD over hybrid sharding's replicas: each replica (a shard group of S ranks) trains alone
// with its own optimizer, and every H inner steps the replicas' parameters are averaged, on each
// rank its own shard (one all-reduce over the ranks holding the same shard, never a gather of full
// parameters). Nothing else crosses replicas, so they exchange H-fold less than hybrid sharding's
// all-reduce of gradients at every step (CommStats::replica_bytes counts it).
//
//   auto model = fsdp::fully_shard(GPT(cfg), pg, fsdp::FullyShardOptions()
//                    .strategy(fsdp::ShardingStrategy::kHybridShard).shard_group_size(2));
//   torch::optim::AdamW inner(model.parameters(), torch::optim::AdamWOptions(3e-4));
//   fsdp::optim::LocalSGD local(model, inner, fsdp::optim::LocalSGDOptions(/*sync_every=*/10));
//   for (...) { model(x, y).backward(); local.step(); inner.zero_grad(); }
//
// See docs/local-sgd.md: what runs per replica, streaming fragments, bytes, checkpoints.
#pragma once

#include "fsdp/export.h"
#include "fsdp/fully_shard.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>

FSDP_PUBLIC_BEGIN

namespace fsdp::optim {
namespace detail {
class FSDP_HIDDEN ReplicaSync;
}

struct LocalSGDOptions {
  /* implicit */ LocalSGDOptions(int64_t sync_every) : sync_every_(sync_every) {}
  /// H: the inner steps between two averages of a fragment.
  TORCH_ARG(int64_t, sync_every);
  /// Streaming: F fragments (runs of consecutive units, units() order, of about equal size)
  /// averaged in turn, one every H / F inner steps (fragment f after steps t with t % H == (f + 1) H / F mod H): the
  /// same bytes per period, F-fold less at once. F must divide H and be at most the units holding parameters.
  TORCH_ARG(int64_t, fragments) = 1;
  /// The overlapped variant: the average is begun at its step and left in flight while the next
  /// inner step computes, then applied after it as p += mean - p_then (the replicas' mean of the
  /// parameters as they were when it began, plus this replica's own last inner step): one step
  /// stale. flush() applies one still in flight (at the end of training).
  TORCH_ARG(bool, overlap) = false;
};

class LocalSGD {
 public:
  /// Sets the model's replicas to train apart from now on (refused unless it is hybrid-sharded:
  /// every unit kHybridShard, or a DeviceMesh with dp_replicate and dp_shard) and gives every
  /// replica the first replica's shards. `inner` steps the model's parameters (any optimizer; it
  /// must outlive this object). Every data-parallel rank must construct it with the same options.
  LocalSGD(const FSDPModule& model, torch::optim::Optimizer& inner, const LocalSGDOptions& options);
  ~LocalSGD();
  LocalSGD(const LocalSGD&) = delete;  // checkpoints refer to it (its flush)
  LocalSGD& operator=(const LocalSGD&) = delete;

  /// The inner step (inner.step()), then the average of each fragment whose turn it is. Call it
  /// where the optimizer's step() would be, on every rank, once per step.
  void step();
  /// The same with `inner_step` instead of inner.step() (e.g. [&] { scaler.step(inner); }).
  void step(const std::function<void()>& inner_step);

  /// Overlapped: applies the average in flight now, if any (waits for it); else nothing.
  void flush();

  /// step() calls so far (a checkpoint keeps it, so that a resumed run averages on schedule).
  int64_t inner_steps() const;
  /// The replicas (the replicate group's size) and this rank's.
  int replicas() const;
  int replica() const;
  const LocalSGDOptions& options() const { return options_; }

 private:
  torch::optim::Optimizer& inner_;
  LocalSGDOptions options_;
  std::unique_ptr<detail::ReplicaSync> sync_;
};

}  // namespace fsdp::optim

FSDP_PUBLIC_END
