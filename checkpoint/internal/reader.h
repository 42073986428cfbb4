// Reading the rows a rank needs out of a checkpoint, whatever number of ranks saved it: the byte
// ranges of the chunks that overlap each destination's rows, rounded out to their checksum blocks
// only (never whole chunks or files; a chunk's rows whole when it and the destination hold
// different parts of the width, as tensor-parallel parts on another number of ranks do: what is
// read beyond the need is then at most the chunk's width over the overlap's), read with sorted preads through one
// descriptor per file, every block checked against the manifest's CRC32C before a byte is applied. A chunk without
// checksums (a Hugging Face file's tensor) is read for exactly the bytes needed, unverified. Internal to the
// checkpoint library (checkpoint/load.cpp).
#pragma once

#include "checkpoint/manifest.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

/// Rows [row_begin, row_end) of the manifest's tensor `tensor`, within `inner` along its other
/// dimensions (the whole width when empty), go into `dst` (that extent, any device and strides; a
/// scalar tensor's one row is the scalar).
struct ReadTarget {
  size_t tensor = 0;
  int64_t row_begin = 0, row_end = 0;
  at::Tensor dst;
  InnerBox inner;
};

struct ReadStats {
  uint64_t bytes_needed = 0;  ///< tensor bytes the targets need
  uint64_t bytes_read = 0;    ///< tensor bytes read: the needed ones and their blocks rounded out
  uint64_t preads = 0;        ///< reads (ranges of one file back to back merged, then split into kReadBlock)
  uint64_t files = 0;         ///< files opened
};

/// One load's reads, in three steps so that nothing is applied before every rank has read and
/// checked its part: plan (constructor: pure arithmetic), open_files (each needed file opened once
/// and its size checked against the manifest: no data read), read (every range, on threads, every block
/// verified, into host memory), apply (copies into the targets). Errors name the file, the tensor
/// and the rows; the caller adds which call and rank.
///
/// `in_place` (LoadOptions::in_place): a piece whose bytes are exactly whole checksum blocks and
/// whose destination rows are contiguous CPU memory of the saved dtype is read straight into the
/// destination and verified there, by the thread that read it; the rest as above. No host copy,
/// no second pass over the bytes, but a failed read leaves those destinations overwritten
/// (reads_in_place()).
class ShardReader {
 public:
  ShardReader(const Manifest& manifest, std::vector<ReadTarget> targets, bool in_place = false);
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  void open_files();
  /// `threads`: preads at once (each at most kReadBlock bytes).
  void read(int threads = 1);
  static constexpr uint64_t kReadBlock = uint64_t{8} << 20;
  void apply();
  const ReadStats& stats() const { return stats_; }
  /// Some pieces are read straight into their destinations: once read() has begun, a failure
  /// (here or on another rank) leaves those destinations a mix.
  bool reads_in_place() const;

 private:
  struct Piece;  // one target's rows out of one chunk
  struct Range;  // bytes of one file read by one pread
  const Manifest& m_;
  std::vector<ReadTarget> targets_;
  std::vector<Piece> pieces_;
  std::vector<Range> ranges_;
  std::vector<int> fds_;  // per manifest file, -1 when not needed
  ReadStats stats_;
};

}  // namespace fsdp::checkpoint::detail
