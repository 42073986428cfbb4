// Before sharding, every rank compares its model and options with rank 0's: a difference would
// pair collectives of different sizes or order later. Internal to the library.
#pragma once

#include "fsdp/internal/comm.h"
#include "fsdp/options.h"

#include <torch/nn/module.h>

#include <string>

namespace fsdp::detail {

/// One line per option that changes the sequence or sizes of collectives: "option <name> <value>".
std::string describe_options(const FullyShardOptions& options);
/// "option offload_policy set" when it is set, else nothing: appended last to a description.
std::string describe_offload(const FullyShardOptions& options);

/// One line per buffer of `root`, in module order: "buffer <name> <dtype> <shape> (<device type>)".
std::string describe_buffers(torch::nn::Module& root);

/// Throws on every rank alike, naming the first line of `description` that differs between rank 0
/// and another rank. `description` holds one "<kind> <name> <details>" line each (kind: param,
/// buffer, option): every rank gathers every description and reaches the same verdict. `api` is
/// the call the error names; `unit`, when not empty, the unit being checked (a ShardingScope's
/// unit as it is built, whose parameters' names are its own).
void check_same_model_on_all_ranks(Comm& comm, const std::string& description, const char* api = "fsdp::fully_shard",
                                   const std::string& unit = "");

/// Broadcasts rank 0's buffers of `root` to every rank (FullyShardOptions::sync_module_states).
void broadcast_buffers(Comm& comm, torch::nn::Module& root);

}  // namespace fsdp::detail
