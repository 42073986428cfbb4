// One rank's checkpoint file: a safetensors file (https://github.com/huggingface/safetensors), so
// that Python's `safetensors` opens it as is. Layout (docs/checkpoint-format.md): an 8-byte
// little-endian header length N, N bytes of JSON (each tensor's dtype, shape and [begin, end)
// offsets into the data buffer; `__metadata__` with "format": "pt"), padded with spaces so that
// the data buffer starts at a multiple of 4096 bytes, then the tensors' bytes, contiguous, in
// header order, with no holes.
#pragma once

#include "fsdp/export.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::checkpoint {

/// safetensors' name of a LibTorch dtype ("F32", "BF16", "I64", "BOOL", ...); one it has none
/// for (complex, quantized) is refused, naming it.
std::string safetensors_dtype(at::ScalarType type);
/// The LibTorch dtype of a safetensors name; an unknown name is refused, naming `where`.
at::ScalarType scalar_type_of(const std::string& dtype, const std::string& where);

/// A tensor in a safetensors file.
struct TensorRecord {
  std::string name;
  std::string dtype;  ///< safetensors' name
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  ///< absolute byte offsets in the file
  /// CRC32C of each block of `block_bytes` bytes from `begin`, the last one possibly shorter
  /// (written files only).
  uint64_t block_bytes = 0;
  std::vector<uint32_t> crc32c;
};

/// A safetensors file: where its data starts, its tensors in file order, its metadata.
struct FileRecord {
  std::string path;
  uint64_t size = 0;        ///< bytes of the whole file
  uint64_t data_start = 0;  ///< 8 + the header's length
  std::vector<TensorRecord> tensors;
  std::map<std::string, std::string> metadata;  ///< "__metadata__"
};

struct WriteOptions {
  /// The data buffer starts at a multiple of this many bytes (the header is padded with spaces).
  TORCH_ARG(uint64_t, alignment) = 4096;
  /// Each tensor's CRC32C is taken per block of at most this many bytes from its first byte ...
  TORCH_ARG(uint64_t, block_bytes) = uint64_t{1} << 20;
  /// ... and of fewer bytes, in multiples of 4 KiB, for a tensor of fewer than `min_blocks` such
  /// blocks, so that it has about that many (see checksum_block).
  TORCH_ARG(uint64_t, min_blocks) = 1;
  /// fsync the file before returning.
  TORCH_ARG(bool, fsync) = true;
  /// Threads writing the file at once, each 8 MiB blocks at their offsets.
  TORCH_ARG(int, threads) = 1;
  /// Write with O_DIRECT, bypassing the page cache, through aligned buffers (the alignment from
  /// statx, 4096 where the kernel does not say). A filesystem without direct I/O is an error.
  TORCH_ARG(bool, direct) = false;
};

/// The checksum block of a tensor of `bytes` bytes: `max_block`, or, when that gives fewer than
/// `min_blocks` blocks, bytes / min_blocks rounded up to a multiple of 4 KiB (never under 4 KiB,
/// never over `max_block`). A reader that needs part of a tensor reads whole blocks, so a smaller
/// block bounds what it reads beyond its need (docs/checkpoint-format.md, "Checksums").
uint64_t checksum_block(uint64_t bytes, uint64_t max_block, uint64_t min_blocks);

/// Writes `tensors` (on CPU, any strides: their elements in row-major order) as one safetensors file
/// at `path`, created or truncated, in large writes (WriteOptions: threads, O_DIRECT), with `metadata` ("format": "pt"
/// added), and fsyncs it. Names must be unique and not "__metadata__". Returns what was written,
/// checksums included. Errors name the file, the tensor and the system's reason.
FileRecord write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             std::map<std::string, std::string> metadata = {}, const WriteOptions& options = {});

/// A safetensors file written piece by piece, for data that is never in memory whole (a tensor
/// assembled from many ranks' chunks): the header comes from the tensors' names, dtypes and shapes,
/// then write() takes the data buffer's bytes in order, in pieces of any size, through large
/// sequential writes. finish() checks that every byte came and fsyncs.
class SafetensorsWriter {
 public:
  /// `tensors`: name, dtype (safetensors' name) and shape of each, in file order.
  SafetensorsWriter(const std::string& path, std::vector<TensorRecord> tensors,
                    std::map<std::string, std::string> metadata = {}, uint64_t alignment = 4096);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  /// The file as it will be: offsets of every tensor (no checksums).
  const FileRecord& record() const;
  void write(const void* data, uint64_t n);
  FileRecord finish(bool fsync = true);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Reads and checks a safetensors file's header: its length against the file's size, the JSON,
/// known dtypes, each tensor's bytes against its shape, offsets that cover the data buffer exactly
/// (no hole, no overlap) and end where the file ends. Errors name the file and what is wrong.
FileRecord read_safetensors_header(const std::string& path);

/// Reads bytes [offset, offset + n) of the file at `path` into `dst` (pread until done); a short
/// file or a failed read is an error naming the file and the range.
void read_bytes(const std::string& path, uint64_t offset, uint64_t n, void* dst);
/// The same through an open descriptor `fd` of `path` (for readers that keep one per file).
void pread_exactly(int fd, const std::string& path, uint64_t offset, uint64_t n, void* dst);

/// A tensor of a file read whole into a new CPU tensor.
at::Tensor read_tensor(const std::string& path, const TensorRecord& record);

}  // namespace fsdp::checkpoint

FSDP_PUBLIC_END
