// The example's data: a text file read as byte tokens, and its samples, the windows of
// block_size + 1 tokens starting at every position (sample i: inputs tokens[i, i + T), targets
// tokens[i + 1, i + T + 1)), which fsdp::data::DistributedSampler orders and splits over the ranks.
#pragma once

#include "programs/flags.h"

#include <torch/torch.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace corpus {

inline const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

[[noreturn]] inline void data_error(const std::string& path, const std::string& why) {
  throw fsdp::programs::UsageError(
      "--data '" + path + "' " + why + ". Pass --data FILE, a text file (each byte is a token).", false);
}

/// The corpus as byte tokens: a regular file only (a directory, a FIFO or a device such as
/// /dev/zero is refused before it is read), of at most --max-data-mb MiB, read with that bound.
inline torch::Tensor load(const std::string& path, double max_data_mb, int64_t block_size) {
  const int64_t max_bytes = static_cast<int64_t>(max_data_mb * 1024 * 1024);
  char limit[160];
  std::snprintf(limit, sizeof(limit),
                "over the limit of --max-data-mb %g (%lld bytes; each byte becomes an 8-byte token): raise "
                "--max-data-mb, or pass a smaller file",
                max_data_mb, static_cast<long long>(max_bytes));
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) data_error(path, std::string("cannot be read: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) data_error(path, std::string("is ") + file_kind(st.st_mode) + ", not a regular file");
  if (st.st_size > max_bytes) data_error(path, "has " + std::to_string(st.st_size) + " bytes, " + limit);
  // O_NONBLOCK: should the path have become a FIFO since stat(), opening it does not wait.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) data_error(path, std::string("cannot be opened: ") + std::strerror(errno));
  std::string text;
  std::string error;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) error = "is no longer a regular file";
  text.reserve(static_cast<size_t>(std::min<int64_t>(st.st_size, max_bytes)));
  char buf[1 << 16];
  while (error.empty()) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) error = std::string("cannot be read: ") + std::strerror(errno);
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(text.size()) > max_bytes) error = std::string("has grown while read, ") + limit;
  }
  ::close(fd);
  if (!error.empty()) data_error(path, error);
  const int64_t T = block_size;
  if (static_cast<int64_t>(text.size()) <= T + 1) {
    data_error(path, "has " + std::to_string(text.size()) + " bytes; it needs more than --block-size + 1 = " +
                         std::to_string(T + 1) + " (or lower --block-size)");
  }
  auto bytes = torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8);
  return bytes.to(torch::kLong);  // byte-level tokens, vocabulary 256
}

/// Samples of `tokens` at block size T: the windows that have T + 1 tokens.
inline int64_t samples(const torch::Tensor& tokens, int64_t T) {
  return tokens.size(0) - T;
}

/// The inputs and targets of samples `indices` (rows, in their order): [rows, T] each.
inline std::pair<torch::Tensor, torch::Tensor> batch(const torch::Tensor& tokens, const std::vector<int64_t>& indices,
                                                     int64_t T) {
  auto starts = torch::tensor(indices, torch::kLong);
  auto idx = torch::arange(T, torch::kLong).unsqueeze(0) + starts.unsqueeze(1);
  return {tokens.index({idx}), tokens.index({idx + 1})};
}

}  // namespace corpus
