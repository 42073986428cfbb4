// The collectives of a save or a load, on the model's process group and bounded by its timeout:
// agreeing that a phase succeeded on every rank (through the model's own FSDPModule::all_reduce),
// and gathering each rank's part of the manifest to rank 0. Internal to the checkpoint library.
#pragma once

#include "fsdp/fully_shard.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

/// Runs `fn` here, then agrees with every rank of `model` that it succeeded, so that a failure on
/// one rank is every rank's error and no rank goes on alone (or waits for it in vain): this rank's
/// error gives its own reason, the others' name the phase and say `consequence` ("nothing was
/// committed"). `phase` and `call` must be equal on every rank; `where` names this rank.
void agree(const FSDPModule& model, const std::string& call, const std::string& where, const std::string& phase,
           const std::string& consequence, const std::function<void()>& fn);

/// Every rank's `text`, on rank 0 in rank order (empty elsewhere): each rank sends its own only.
std::vector<std::string> gather_to_rank0(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& text,
                                         std::chrono::milliseconds timeout, const std::string& what);

}  // namespace fsdp::checkpoint::detail
