// Rank 0's assembly of a checkpoint's manifest from every rank's part (docs/checkpoint-format.md,
// "Manifest"): each part lists the chunks its rank wrote (tensor, rows, bytes, checksums), the
// optimizer and generator tensors it wrote and the optimizer steps it holds. Linear in the total
// number of chunks: tensors found through an index, chunks sorted per tensor. Parts travel between
// ranks in a compact binary form (RankPart::encode) and the manifest is written as text without a
// JSON document tree: a save every step spends its CPU on the data, not on building and parsing
// JSON (a tree of the parts and the manifest took 4.5 ms of rank 0's 11 ms per save of train_gpt's
// default model). Internal to the checkpoint library (save_steps.cpp; manifest.cpp's
// manifest_from_parts, which the checkpoint benchmark times at 1024 simulated ranks).
#pragma once

#include "fsdp/export.h"
#include "checkpoint/manifest.h"
#include "data/distributed_sampler.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
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

/// A tensor of the manifest without its chunks: key ("model/...", "optim/...", "rng/..."), kind
/// ("parameter", "buffer", "optimizer", "rng"), safetensors dtype and global shape.
struct TensorMeta {
  std::string key, kind, dtype;
  std::vector<int64_t> shape;
  /// `key`'s {"kind", "dtype", "shape"} as a manifest or a part holds them.
  static TensorMeta from_json(const std::string& key, const ordered_json& j);
};

/// Rows [row_begin, row_end) of `tensor` within `inner` (the whole width when empty), at bytes
/// [begin, end) of its rank's file, with the CRC32C of each block of `block_bytes`.
struct ChunkRecord {
  std::string tensor;
  int64_t row_begin = 0, row_end = 0;
  InnerBox inner;
  uint64_t begin = 0, end = 0, block_bytes = 0;
  std::vector<uint32_t> crc32c;
};

/// One rank's part: its file (name, size), its chunks in file order, the tensors it wrote that are
/// not the model's (optimizer and generator states), and its optimizer steps by parameter name.
struct FSDP_TESTING_API RankPart {
  std::string file;
  uint64_t file_bytes = 0;
  std::vector<TensorMeta> tensors;
  std::vector<std::pair<std::string, int64_t>> steps;
  std::vector<ChunkRecord> chunks;
  /// Bytes to send to rank 0: every rank runs the same build, so the byte order is the same.
  std::string encode() const;
  /// A part that encode() made; a malformed one (not from this build) is refused, naming `rank`.
  static RankPart decode(const std::string& bytes, int rank);
  /// A part as manifest_from_parts documents it (checkpoint/manifest.h): a JSON object.
  static RankPart from_json(const ordered_json& j);
};

/// A chunk's extent, for coverage_fault.
struct ChunkExtent {
  int64_t row_begin = 0, row_end = 0;
  const InnerBox* inner = nullptr;
};

/// Why `chunks` do not cover a tensor of `shape` exactly once, as a sentence; "" when they do. The
/// rule (docs/checkpoint-format.md, "Chunks"): each chunk's box lies inside the shape; the chunks of
/// one inner box cover every row once; the distinct inner boxes tile the dimensions from 1 on
/// (volumes sum to the whole, no two overlap). Linear in the chunks but for the distinct boxes,
/// which are compared pairwise (one per tensor-parallel part). A tensor without elements needs none.
FSDP_TESTING_API std::string coverage_fault(const std::vector<int64_t>& shape, std::vector<ChunkExtent> chunks);

/// A chunk's "inner" member ([[offset, length], ...]); a malformed one is refused naming `what`.
InnerBox inner_from_json(const nlohmann::json& j, const std::string& what);

/// `inner` as text: "[0:8, 4:8]" (offset:end per dimension from 1), "whole width" when empty.
std::string inner_text(const InnerBox& inner);

/// A sampler's state as the manifest's "data" object, and back (refusing a malformed one, named
/// with the manifest's `path`).
ordered_json sampler_state_json(const data::SamplerState& s);
data::SamplerState sampler_state_from_json(const nlohmann::json& j, const std::string& path);

/// The manifest's last member, "manifest_crc32c" (format 3 on): the CRC32C of every byte before
/// the comma that precedes it, so that a reader finds a manifest edited or corrupted anywhere
/// (a learning rate, a step, a sampler position), as the data's checksums find a flipped byte in
/// a rank file. `open` is the manifest's text without its closing "\n}\n"; returns the whole text.
FSDP_TESTING_API std::string seal_manifest(std::string open);

/// Checks `text` (a manifest of format 3 or later) against its seal: "" when it holds, else why not
/// (a sentence that names no file).
std::string check_manifest_seal(const std::string& text, uint32_t sealed_crc32c);

/// The manifest's text from `header`, the model's tensors (in the model's order) and every rank's
/// part, in rank order. Checks that every tensor's chunks cover it once (coverage_fault) and that the
/// ranks agree on each optimizer step; `bytes_total` gets the tensor bytes of all chunks.
FSDP_TESTING_API std::string assemble_manifest(const ManifestHeader& header, const std::vector<TensorMeta>& model_tensors,
                              const std::vector<RankPart>& parts, int64_t& bytes_total);

}  // namespace fsdp::checkpoint::detail
