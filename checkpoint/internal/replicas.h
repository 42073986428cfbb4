// Checkpoints of replicas that train apart (fsdp::optim::LocalSGD, DiLoCo; docs/local-sgd.md).
// Between outer steps the replicas hold different values of the same rows, so a save must never
// split those rows over the replicas as it does replicated rows. It writes:
//   - "model/<name>": the global state, once (its rows split over the replicas, which hold it alike):
//     DiLoCo's global shards (the last outer step), LocalSGD's replicas' mean at the save. What
//     every other reader of the checkpoint (a plain load, consolidate, Hugging Face export) sees.
//   - "replica<r>/model/<name>" (kind "replica") and "replica<r>/optim/<name>/<state>" (kind
//     "replica-optimizer"): replica r's own shards and inner optimizer state, written by its ranks.
//   - "outer/<name>/<state>" (kind "outer"): DiLoCo's outer optimizer state, once.
//   - metadata "fsdp/replicas", "fsdp/inner_steps", "fsdp/sync_every", "fsdp/outer", and for
//     DiLoCo "fsdp/outer_optimizer" and "fsdp/outer_steps" (each parameter's outer step count).
// A load on the same number of replicas gives each replica its own state back; on another, every
// replica starts from the global state, the inner step count at its last outer step. Internal to
// the checkpoint library.
#pragma once

#include "checkpoint/checkpoint.h"
#include "checkpoint/manifest.h"
#include "fsdp/shard_spec.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

/// What a save of `model` writes beyond the usual while its replicas train apart (nullopt
/// otherwise). Applies an outer exchange still in flight first; LocalSGD's global state is the
/// replicas' mean, taken now (a collective over the replicate groups: every rank calls this).
struct ReplicaSave {
  int replicas = 1, replica = 0;
  std::string prefix;              ///< "replica<r>/"
  std::vector<at::Tensor> global;  ///< per parameter (shard_specs() order): the global rows
  const torch::optim::Optimizer* outer = nullptr;
  std::string outer_type;  ///< the outer optimizer's checkpoint type ("SGD", ...), when there is one
  Metadata metadata;       ///< the "fsdp/" keys above
};
std::optional<ReplicaSave> replica_save(const FSDPModule& model, const std::vector<ShardSpec>& specs);

/// How a load maps the checkpoint's keys onto `model` (replicas training apart or not).
struct ReplicaLoad {
  int saved_replicas = 0;  ///< 0: a checkpoint of replicas that did not train apart
  bool own_state = false;  ///< each replica loads its own state (same number of replicas)
  std::string model_prefix = "model/", model_kind = "parameter";  ///< where the shards come from
  std::string optim_prefix = "optim/", optim_kind = "optimizer";  ///< the (inner) optimizer's state
  /// While the model's replicas train apart: its outer state's global shards (DiLoCo; empty for
  /// LocalSGD), loaded from "model/", and the outer optimizer, from "outer/" (when saved).
  std::vector<at::Tensor> global;
  torch::optim::Optimizer* outer = nullptr;
  std::string outer_type;
  std::map<std::string, int64_t> outer_steps;
  int64_t inner_steps = -1;  ///< what the outer state's count becomes (-1: not apart)
  std::string outcome;       ///< LoadResult::replicas
};
ReplicaLoad replica_load(const Manifest& m, FSDPModule& model, const std::vector<ShardSpec>& specs);
/// After the load applied its bytes: the outer state's inner step count.
void finish_replica_load(const ReplicaLoad& plan, FSDPModule& model);

}  // namespace fsdp::checkpoint::detail
