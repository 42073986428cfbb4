// The collectives of a save or a load, bounded by the model's timeout: agreeing that a phase
// succeeded on every rank, and gathering each rank's part of the manifest to rank 0. A synchronous
// call runs them on the model's process group (through FSDPModule::all_reduce, which checks that
// every rank is at the same call); a background save on a side group of the same ranks, because
// its collectives would otherwise interleave with the training's own on the training group.
// Internal to the checkpoint library.
#pragma once

#include "fsdp/fully_shard.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

/// The ranks a save or a load agrees over.
struct Group {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::chrono::milliseconds timeout{0};
  /// Set: agreements go through model->all_reduce (the caller's thread, between steps); unset:
  /// straight over `pg` (a side group, used by nothing else).
  const FSDPModule* model = nullptr;
  static Group of(const FSDPModule& model) { return {model.process_group(), model.options().timeout(), &model}; }
  int rank() const { return pg->getRank(); }
  int size() const { return pg->getSize(); }
};

/// Runs `fn` here, then agrees with every rank of `model` that it succeeded, so that a failure on
/// one rank is every rank's error and no rank goes on alone (or waits for it in vain): this rank's
/// error gives its own reason, the others' name the phase and say `consequence` ("nothing was
/// committed"). `phase` and `call` must be equal on every rank; `where` names this rank.
void agree(const Group& group, const std::string& call, const std::string& where, const std::string& phase,
           const std::string& consequence, const std::function<void()>& fn);

/// Every rank's `text`, on rank 0 in rank order (empty elsewhere): each rank sends its own only.
std::vector<std::string> gather_to_rank0(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& text,
                                         std::chrono::milliseconds timeout, const std::string& what);

}  // namespace fsdp::checkpoint::detail
