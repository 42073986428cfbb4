// Large-file I/O for checkpoints on parallel filesystems (docs/checkpoint-format.md, "I/O"): a
// file written from pieces of memory by several threads at once, each writing whole blocks of
// `block_bytes` at their offsets, optionally with O_DIRECT (no page cache: the data goes to the
// storage servers as it is written, and the copy into the cache is saved) through aligned buffers;
// and many preads of one file spread over threads. Internal to the checkpoint library.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include "fsdp/export.h"

namespace fsdp::checkpoint::detail {

struct IoOptions {
  int threads = 1;                           ///< threads writing (or reading) at once
  bool direct = false;                       ///< O_DIRECT
  uint64_t block_bytes = uint64_t{8} << 20;  ///< bytes per write call (rounded to the alignment)
};

/// Runs work(worker, i) for i in [0, n) on `threads` threads (this one among them; worker: 0 to
/// threads - 1, each taking the next item as it is free); the first error is rethrown here once
/// every thread has stopped, the others stopping at their next item.
void run_parallel(size_t n, int threads, const std::function<void(int, size_t)>& work);

/// A piece of the file: `n` bytes at `data`; the pieces follow each other in the file.
struct IoPiece {
  const void* data = nullptr;
  uint64_t n = 0;
};

/// Writes the pieces as the file `path` (created or truncated), block by block: the blocks are
/// shared by `threads` threads. Buffered, each block goes straight from the pieces' memory (one
/// pwritev). With `direct`, the file is opened with O_DIRECT, the alignment taken from statx
/// (STATX_DIOALIGN) where the kernel gives it and 4096 otherwise: the whole aligned units of a
/// piece whose memory is aligned as its place in the file go straight from it, the other bytes
/// through an aligned buffer per thread; the last block is written padded to the alignment and
/// the file then truncated to its size. No fsync (the caller's, once per file). A filesystem that refuses
/// O_DIRECT is an error that says so. Errors name the file, the bytes and the system's reason.
FSDP_TESTING_API void write_pieces(const std::string& path, const std::vector<IoPiece>& pieces,
                                   const IoOptions& options);

/// One pread: `n` bytes at `offset` of the file open as `fd` (`path`, for errors) into `dst`;
/// then `after`, when set, on the same thread (a check of the bytes while they are in its cache
/// and the other threads' reads are in flight).
struct ReadRequest {
  int fd = -1;
  const std::string* path = nullptr;
  uint64_t offset = 0, n = 0;
  void* dst = nullptr;
  std::function<void()> after;
};

/// The requests, each split into reads of at most `block_bytes` (a request with `after` is never
/// split), shared by `threads` threads; the first error is rethrown once all have stopped.
FSDP_TESTING_API void read_parallel(const std::vector<ReadRequest>& requests, int threads, uint64_t block_bytes);

}  // namespace fsdp::checkpoint::detail
