// ckpt_bench's baseline: the same bytes as a checkpoint written and read with plain POSIX calls,
// as a writer and reader of large files would (8 MiB blocks shared by the same number of threads,
// optionally O_DIRECT), so that a save or load and its baseline differ by the library's work only.
// And the files under a directory: their bytes, dropping them from the page cache, removing them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ckpt {

constexpr uint64_t kIoBlock = uint64_t{8} << 20;

/// The baseline's file of `rank` under `dir` (dir/raw/rank-R.bin).
std::string raw_file(const std::string& dir, int rank);

/// `src` written as the file `path` (created or truncated) in blocks of kIoBlock shared by
/// `threads` threads at their offsets (with `direct`, O_DIRECT through aligned buffers, the last
/// block padded and the file truncated to its size), then fsynced.
void raw_write(const std::string& path, const std::vector<char>& src, int threads, bool direct);

/// `bytes` of the baseline's files under `dir` (rank 0's, rank 1's, ... of `files` ranks, taken as
/// one stream) from `offset` on, into `dst`, in preads of kIoBlock shared by `threads` threads.
void raw_read(const std::string& dir, int files, int64_t offset, int64_t bytes, std::vector<char>& dst, int threads);

/// Every regular file under `dir`, recursively.
std::vector<std::string> files_under(const std::string& dir);
/// Their bytes.
int64_t bytes_under(const std::string& dir);
/// Drops them from the page cache (posix_fadvise DONTNEED), so that the next read goes to the disk.
void drop_cache(const std::string& dir);

}  // namespace ckpt
