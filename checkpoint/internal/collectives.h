// The collectives of a save or a load: agreeing that a phase succeeded on every rank, and
// gathering each rank's part of the manifest to rank 0. Both are the communication context's
// (fsdp/internal/comm.h: Comm::agree, Comm::exchange_strings), bounded by the model's timeout
// through the wait every collective uses. A synchronous call agrees at the model's step boundary
// (its agreement also compares the model's collectives since the last one); a background save
// over a group of its own, the same ranks, because its collectives would otherwise interleave with
// the training's on the model's group. Internal to the checkpoint library.
#pragma once

#include "fsdp/fully_shard.h"
#include "fsdp/internal/core_access.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

/// The process group a checkpoint of `model` spans: the model's own, or for a tensor-parallel model
/// (wrapped over a DeviceMesh with a "tp" dimension) the mesh's whole world, since its
/// tensor-parallel ranks hold different parts of the parameters.
const c10::intrusive_ptr<c10d::ProcessGroup>& checkpoint_group(const FSDPModule& model);

/// The global ranks of `model`'s tensor-parallel group, in part order (empty without tensor
/// parallelism).
std::vector<int> tensor_parallel_ranks(const FSDPModule& model);

/// The ranks a save or a load agrees over.
class Group {
 public:
  Group() = default;
  /// The model's checkpoint_group, on the caller's thread between steps: its agreements are the
  /// model's step-boundary agreements (over a mesh's world, or while replicas train apart, those of
  /// the step's group first, then the checkpoint group's).
  static Group of(const FSDPModule& model);
  /// The whole world of `mesh`, on the caller's thread between steps (a pipelined model's save or
  /// load: its stages' models span their stages' ranks only), bounded by the mesh's timeout.
  static Group world(const DeviceMesh& mesh);
  /// A group used by nothing else (an asynchronous saver's), bounded by `timeout`.
  static Group own(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, std::chrono::milliseconds timeout);
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->world_size(); }
  /// Each group rank's global rank.
  const std::vector<int>& global_ranks() const { return comm_->global_ranks(); }
  /// Agrees that a phase went well: see agree() below. Returns whether any rank voted `failed`.
  /// The global ranks that voted `failed`, in order (empty: none).
  std::vector<int> agree(const std::string& what, bool failed) const;
  /// What an error of this group carries: this process's global rank, the group, `operation`.
  ErrorContext error_context(const std::string& operation) const { return comm_->error_context(operation); }
  /// The same for an error of the call `caller` names (its api and path): the message begins
  /// "<api> (rank r of N, '<path>'): " and the error's api() is the call's.
  ErrorContext error_in(const std::string& operation, const ErrorContext& caller) const {
    return error_context(operation).api(caller.api()).path(caller.path());
  }
  /// Every rank's `text`, on rank 0 in rank order (empty elsewhere): each rank sends its own only.
  std::vector<std::string> gather_to_rank0(const std::string& text, const std::string& what) const;
  /// Every rank's `text` on every rank, in rank order.
  std::vector<std::string> all_gather(const std::string& text, const std::string& what) const;

 private:
  std::vector<std::string> exchange(const std::string& text, const std::string& what, int root) const;
  const FSDPModule* model_ = nullptr;  // set: agreements are the model's step-boundary agreements
  bool wider_than_step_ = false;       // comm_ spans more ranks than the model's step agreements
  std::shared_ptr<fsdp::detail::Comm> comm_;
};

/// Runs `fn` here, then agrees with every rank of `group` that it succeeded, so that a failure on
/// one rank is every rank's error and no rank goes on alone (or waits for it in vain): this rank's
/// error gives its own reason, the others' name the phase and say `consequence` ("nothing was
/// committed"). `phase` and `call` must be equal on every rank (the agreement checks it); the
/// errors are `caller`'s (Group::error_in).
void agree(const Group& group, const std::string& call, const ErrorContext& caller, const std::string& phase,
           const std::string& consequence, const std::function<void()>& fn);

}  // namespace fsdp::checkpoint::detail
