// What a load reads and where it goes, checked against the manifest before any byte of data is
// read: the model's tensors (Wanted, match), the optimizer's state and hyperparameters
// (plan_optimizer, install), DiLoCo's outer state, the generators and the sampler. The wrapped
// model's load, the plain module's and the pipelined stages' (checkpoint/pipelined.h) share them.
// Internal to the checkpoint library.
#pragma once

#include "checkpoint/checkpoint.h"
#include "checkpoint/internal/collectives.h"
#include "checkpoint/internal/reader.h"
#include "checkpoint/internal/replicas.h"
#include "checkpoint/manifest.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <set>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

/// One tensor of the model: where its rows go.
struct Wanted {
  std::string key;   ///< "model/<name>"
  std::string kind;  ///< "parameter", "buffer"
  at::ScalarType dtype;
  std::vector<int64_t> shape;  ///< global
  int64_t row_begin = 0, row_end = 0;
  at::Tensor dst;
  InnerBox inner;  ///< along the dimensions from 1 (a tensor-parallel part); whole otherwise
};

/// Where a parameter's rows on this rank go (its tensor-parallel part's place in the whole tensor).
Wanted wanted_of(const ShardSpec& s, const std::string& key, const std::string& kind, const at::Tensor& dst);

/// A buffer of the model, whole on every rank.
Wanted wanted_buffer(const std::string& name, const at::Tensor& b);

/// Checks `wanted` against the manifest (all of it, so that one error lists every difference) and
/// turns it into the reader's targets. No byte of data is read. `strict`: no tensor under `prefix`
/// the model lacks ("model/", or a replica's "replica<r>/model/"); `hint` ends the error.
std::vector<ReadTarget> match(const Manifest& m, const std::vector<Wanted>& wanted, bool strict,
                              const std::string& hint, const std::string& prefix = "model/");

/// What a load says of itself from the manifest and the reader's counts (this rank's).
LoadResult result_of(const Manifest& m, const ReadStats& s);
double since(std::chrono::steady_clock::time_point t0);

/// A load's plan for the optimizer: per parameter of it, the saved state's names, where they go and
/// the step; per param group the saved hyperparameters.
struct OptimizerPlan {
  std::string type;
  struct Param {
    at::Tensor param;
    std::vector<std::string> names;
    std::vector<at::Tensor> dst;
    int64_t step = -1;
  };
  std::vector<Param> params;
};

/// Checks the saved optimizer against `opt` (type, param groups by parameter name, state names)
/// and adds the state tensors to `wanted`. Nothing of the optimizer changes. `prefix` and `kind`:
/// where its state is ("optim/", or a replica's "replica<r>/optim/"). `within`, when given: the
/// names of the parameters this model holds of a larger one (a pipeline stage's), so that each
/// saved param group is compared with the optimizer's over those alone.
OptimizerPlan plan_optimizer(const Manifest& m, const std::vector<ShardSpec>& specs, const torch::optim::Optimizer& opt,
                             std::vector<Wanted>& wanted, const std::string& prefix, const std::string& kind,
                             const std::set<std::string>* within = nullptr);

/// DiLoCo's outer optimizer over its global shards (internal/replicas.h): its state from
/// "outer/<name>/<state>", its steps from the metadata; its hyperparameters are the program's.
OptimizerPlan plan_outer(const Manifest& m, const std::vector<ShardSpec>& specs, const ReplicaLoad& r,
                         std::vector<Wanted>& wanted);

/// Installs what plan_optimizer planned (after the reader applied the bytes): states, steps, and
/// each group's saved hyperparameters.
void install(const Manifest& m, torch::optim::Optimizer& opt, const OptimizerPlan& plan);

/// This rank's generator states to load, or the checksum its own derive from.
struct RngPlan {
  std::vector<std::pair<std::string, at::Tensor>> states;  ///< name, destination
  bool saved = false;                                      ///< the checkpoint has generator states
  uint32_t base = 0;                                       ///< rank 0's CPU state's first checksum
};
/// Global rank `rank`'s generators, added to `wanted`.
RngPlan plan_rng(const Manifest& m, int rank, std::vector<Wanted>& wanted);
/// Restores them (or derives a new rank's): "restored", "derived" or "not saved".
std::string apply_rng(const RngPlan& plan, int rank);

/// What a failed read phase says of the models it read into: the consequence when the shards were
/// left as they were, when they were partly overwritten, and the remedy their next use gives.
struct ReadFailure {
  const char* left;
  const char* overwritten;
  const char* remedy;
};

/// A load's second phase, "reading and verifying this rank's rows", agreed by every rank of
/// `group`. In place (LoadOptions::in_place), the reads go into the shards: a failure anywhere
/// leaves this rank's a mix (when it read any in place), so `models` are then marked unusable,
/// with `failure`'s remedy. The phase's name, compared across ranks, says whether the load is in
/// place; what this rank's error says of its shards is its own.
void read_rows(const Group& group, const std::string& call, const ErrorContext& caller, ShardReader& reader,
               const LoadOptions& options, const std::vector<FSDPModule>& models, const ReadFailure& failure);

/// Checks that `sampler` (when given) can resume at the checkpoint's state, leaving it unchanged.
void check_sampler(const Manifest& m, const data::DistributedSampler* sampler);

}  // namespace fsdp::checkpoint::detail
