// Rank 0's assembly of a checkpoint's manifest from every rank's part (docs/checkpoint-format.md,
// "Manifest"): each part lists the chunks its rank wrote (tensor, rows, bytes, checksums), the
// optimizer and generator tensors it wrote and the optimizer steps it holds. Linear in the total
// number of chunks: parts are parsed once, tensors found through an index, chunks sorted per
// tensor. Internal to the checkpoint library (save.cpp; the checkpoint benchmark times it at 1024
// simulated ranks).
#pragma once

#include "data/distributed_sampler.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

using ordered_json = nlohmann::ordered_json;

struct ManifestHeader {
  std::string name;
  int64_t step = 0;
  int world_size = 0;
  uint64_t block_bytes = 0;
  ordered_json strategies = ordered_json::object();
  ordered_json metadata = ordered_json::object();
  /// {"type", "param_groups"} of the optimizer saved, or null; the steps come from the parts.
  ordered_json optimizer = nullptr;
  /// The sampler state (sampler_state_json), or null; the save compared the ranks' before writing.
  ordered_json data = nullptr;
};

/// One rank's part: its file (name, size), its chunks, the kind/dtype/shape of the tensors it wrote
/// that are not the model's (optimizer and generator states), and its optimizer steps.
struct RankPart {
  std::string file;
  uint64_t file_bytes = 0;
  ordered_json chunks = ordered_json::array();  // {"tensor", "rows", "bytes", "block_bytes", "crc32c"}
  ordered_json tensors = ordered_json::object();
  ordered_json steps = ordered_json::object();
  std::string dump(int rank) const;
};

/// A sampler's state as the manifest's "data" object, and back (refusing a malformed one, named
/// with the manifest's `path`).
ordered_json sampler_state_json(const data::SamplerState& s);
data::SamplerState sampler_state_from_json(const nlohmann::json& j, const std::string& path);

/// The manifest's text from `header`, the model's tensors (`model_tensors`: key -> kind, dtype,
/// shape, in the model's order) and every rank's part text (RankPart::dump), in rank order. Checks
/// that every tensor's chunks cover its rows once and that the ranks agree on each optimizer step;
/// `bytes_total` gets the tensor bytes of all chunks.
std::string assemble_manifest(const ManifestHeader& header, ordered_json model_tensors,
                              const std::vector<std::string>& parts, int64_t& bytes_total);

}  // namespace fsdp::checkpoint::detail
