// A sharded checkpoint as one set of Hugging Face-style safetensors files (docs/checkpoint-format.md,
// "Consolidated"): `model.safetensors`, or shards `model-00001-of-0000N.safetensors` with
// `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}), each tensor whole
// under its LibTorch name; optionally the optimizer's state the same way (`optimizer*.safetensors`,
// tensors named "<parameter>/<state>"). Streamed chunk by chunk, every checksum verified: memory
// stays a few MiB whatever the model's size (a tensor saved as parts of its width, by a
// tensor-parallel model, is assembled a few MiB of rows at a time).
//
//   fsdp::checkpoint::consolidate("ckpts", "export");        // ckpts' latest -> export/model.safetensors
//   build/tools/fsdp-ckpt consolidate ckpts export [--max-shard-bytes N] [--optimizer]
#pragma once

#include "fsdp/export.h"

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::checkpoint {

struct ConsolidateOptions {
  /// Split the tensors into files of at most this many bytes of data (a larger tensor gets a file
  /// of its own), with an index; 0: one file.
  TORCH_ARG(uint64_t, max_shard_bytes) = 0;
  /// Also write the optimizer's state into optimizer*.safetensors.
  TORCH_ARG(bool, optimizer) = false;
};

struct ConsolidateResult {
  std::string dir;                 ///< the output directory
  std::vector<std::string> files;  ///< written, in order (indexes included)
  uint64_t tensor_bytes = 0;       ///< tensor data written
  uint64_t buffer_bytes = 0;       ///< the one read buffer used
};

/// Writes the checkpoint at `checkpoint` (a checkpoint directory, or a root: its latest) into `out`,
/// a directory that must not exist yet: written under a temporary name next to it, fsynced, then
/// renamed, so `out` appears complete or not at all. One process; reads each chunk once, verifying
/// its checksums (a fault is an error naming file, tensor and rows, and leaves no `out`).
ConsolidateResult consolidate(const std::string& checkpoint, const std::string& out,
                              const ConsolidateOptions& options = {});

}  // namespace fsdp::checkpoint

FSDP_PUBLIC_END
