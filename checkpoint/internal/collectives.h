// The collective a checkpoint needs beside the model's own (FSDPModule::all_reduce, which it uses
// to agree on success): gathering each rank's part of the manifest to rank 0, on the model's
// process group, bounded by the model's timeout. Internal to the checkpoint library.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

/// Every rank's `text`, on rank 0 in rank order (empty elsewhere): each rank sends its own only.
std::vector<std::string> gather_to_rank0(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& text,
                                         std::chrono::milliseconds timeout, const std::string& what);

}  // namespace fsdp::checkpoint::detail
