// Hugging Face safetensors weights (one file, or shards with model.safetensors.index.json) seen
// as a checkpoint manifest, so that fsdp::checkpoint::load_safetensors reads them with the same
// reader: each tensor one chunk of all its rows, without checksums. Internal to the checkpoint
// library.
#pragma once

#include "checkpoint/manifest.h"

#include <functional>
#include <set>
#include <string>

namespace fsdp::checkpoint::detail {

/// The manifest of the weights at `path` (a .safetensors file, an index .json, or a directory with
/// either), each file's header read and checked; tensors renamed by `name_map` ("" skips one),
/// keyed "model/<name>", kind "buffer" for the names in `buffers`, else "parameter".
Manifest safetensors_manifest(const std::string& path, const std::set<std::string>& buffers,
                              const std::function<std::string(const std::string&)>& name_map);

}  // namespace fsdp::checkpoint::detail
