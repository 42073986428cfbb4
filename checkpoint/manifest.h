// A checkpoint's manifest read back (docs/checkpoint-format.md, "Manifest"): what was saved, by
// how many ranks, and where each tensor's rows are. The reader checks it before anything uses it.
#pragma once

#include "data/distributed_sampler.h"
#include "fsdp/export.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::checkpoint {

/// The format version this library writes and reads; a manifest of a newer one is refused. 2 added
/// "data" (a sampler's state; version 1 manifests read as having none), 3 the manifest's own
/// checksum, 4 chunks that hold part of a tensor's width ("inner": tensor-parallel parts).
inline constexpr int kFormatVersion = 4;

/// A chunk's extent along a tensor's dimensions from 1 on: [offsets[d], offsets[d] + lengths[d])
/// along dimension d + 1. Empty: the whole extent (every chunk before format version 4).
struct InnerBox {
  std::vector<int64_t> offsets, lengths;
  bool whole() const { return offsets.empty(); }
  /// Its offset and length along dimension d + 1 of a tensor of `shape` (a whole box: 0 and the
  /// dimension's size).
  int64_t offset(size_t d) const { return whole() ? 0 : offsets.at(d); }
  int64_t length(size_t d, const std::vector<int64_t>& shape) const {
    return whole() ? shape.at(d + 1) : lengths.at(d);
  }
  /// Elements of one row (dimension 0) of the box, in a tensor of `shape`.
  int64_t row_numel(const std::vector<int64_t>& shape) const;
  bool operator==(const InnerBox& o) const { return offsets == o.offsets && lengths == o.lengths; }
  bool operator<(const InnerBox& o) const { return offsets != o.offsets ? offsets < o.offsets : lengths < o.lengths; }
};

/// A chunk: rows [row_begin, row_end) of a tensor, within `inner` along the other dimensions, laid
/// out row-major as a tensor of its own (a tensor-parallel part split along dimension 1 is
/// contiguous in its file, never strided).
struct ManifestChunk {
  int64_t row_begin = 0, row_end = 0;  ///< global rows [row_begin, row_end)
  InnerBox inner;                      ///< along dimensions 1 and on (format 4)
  size_t file = 0;                     ///< index into Manifest::files
  uint64_t begin = 0, end = 0;         ///< bytes [begin, end) of that file
  uint64_t block_bytes = 0;            ///< the checksum block (at most Manifest::block_bytes)
  std::vector<uint32_t> crc32c;        ///< per block of block_bytes from begin
};

/// Checks bytes [at, at + n) of chunk `c`'s file, held at `data`, against the chunk's checksums:
/// `at` is on one of its block boundaries and the bytes are whole blocks (the chunk's last one may
/// be short). Returns the index of the first block that differs, its CRC32C in `got`; -1 when all
/// match.
int64_t first_bad_block(const ManifestChunk& c, uint64_t at, const uint8_t* data, uint64_t n, uint32_t& got);

struct ManifestTensor {
  std::string key;   ///< "model/<name>", "optim/<parameter name>/<state name>"
  std::string kind;  ///< "parameter", "buffer", "optimizer"
  std::string dtype;
  std::vector<int64_t> shape;
  /// Grouped by InnerBox (ordered), each group in row order and covering every row once; the
  /// groups' boxes tile the dimensions from 1 on (one group, the whole width, before format 4).
  std::vector<ManifestChunk> chunks;
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  uint64_t bytes() const;  ///< of the whole tensor
};

struct ManifestFile {
  std::string name;  ///< "rank-00000.safetensors"
  int rank = 0;
  uint64_t bytes = 0;  ///< the file's size
};

struct ManifestParamGroup {
  std::map<std::string, double> options;  ///< hyperparameters (betas as beta1, beta2; flags 0/1)
  std::vector<std::string> params;        ///< its parameters' names, in the group's order
};

/// The optimizer a checkpoint was saved with (present when it was saved with one).
struct ManifestOptimizer {
  std::string type;  ///< "SGD", "Adam", "AdamW"
  std::vector<ManifestParamGroup> param_groups;
  std::map<std::string, int64_t> steps;  ///< per parameter name (Adam, AdamW)
};

struct Manifest {
  std::string dir;  ///< the checkpoint's directory
  int format_version = 0;
  std::string library_version, name;
  int64_t step = 0;
  int world_size = 0;
  uint64_t block_bytes = 0;  ///< the largest checksum block
  std::map<std::string, std::string> strategies, metadata;
  bool has_optimizer = false;
  ManifestOptimizer optimizer;
  std::optional<data::SamplerState> data;  ///< the sampler's state saved with it, if any
  std::vector<ManifestFile> files;
  std::vector<ManifestTensor> tensors;  ///< by key
};

/// Reads `dir`/manifest.json and checks it: JSON, format version (a newer one is refused), dtypes,
/// each tensor's chunks covering it exactly once (boxes inside its shape, per box every row once,
/// the boxes tiling the other dimensions) with bytes that match their extent, files referenced by
/// index. Errors name the file and the tensor. Reads no data.
Manifest read_manifest(const std::string& dir);

/// The text of manifest.json as rank 0 of a save assembles it from the part each rank sends it, for
/// timing that at more ranks than a machine runs (benchmarks/ckpt_bench simulate); a save does it
/// itself. `header`: a JSON object with the manifest's "name", "step", "world_size", "block_bytes",
/// "strategies", "metadata", "optimizer" ({"type", "param_groups"} or null), "data" (optional: a
/// sampler's state or null) and "tensors" (the
/// model's: key -> {"kind", "dtype", "shape"}, in the model's order). `parts`, in rank order: JSON
/// objects {"rank", "file", "bytes" (its size), "tensors" (the others it wrote, as above), "steps"
/// (optimizer steps by parameter name), "chunks" ([{"tensor", "rows", "bytes", "block_bytes",
/// "crc32c", and "inner" ([[offset, length], ...] along dimensions 1 and on) for part of a row)}])}. Checks that the
/// chunks cover every tensor's rows once and that the ranks' steps agree; `bytes_total` gets the bytes of all chunks.
std::string manifest_from_parts(const std::string& header, const std::vector<std::string>& parts, int64_t& bytes_total);

}  // namespace fsdp::checkpoint

FSDP_PUBLIC_END
