// The checkpoint's file I/O (checkpoint/internal/parallel_io.h): several writer threads and
// O_DIRECT give the same bytes as one buffered writer, whatever the pieces' sizes (odd ones leave
// an unaligned tail, which direct I/O writes padded and then truncates); parallel preads read the
// same bytes back.
#include "checkpoint/internal/parallel_io.h"
#include "checkpoint/safetensors.h"
#include "tests/temp_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <iterator>

namespace fsdp::testing {
namespace {

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(CheckpointIo, ThreadsAndDirectIoWriteTheSameBytesAsOneBufferedWriter) {
  TempDir tmp;
  // Pieces of odd sizes around the block size (3 x 4096 here), and empty ones.
  torch::manual_seed(0);
  const std::vector<int64_t> sizes = {8, 4088, 0, 12288, 1, 30000, 0, 12287, 5};
  std::vector<at::Tensor> data;
  std::vector<checkpoint::detail::IoPiece> pieces;
  int64_t total = 0;
  for (int64_t n : sizes) {
    data.push_back(torch::randint(0, 256, {n}, torch::kByte));
    pieces.push_back({data.back().data_ptr(), static_cast<uint64_t>(n)});
    total += n;
  }
  ASSERT_NE(total % 4096, 0) << "the test needs an unaligned tail";
  std::string want;
  for (const auto& t : data) want.append(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
  for (int threads : {1, 2, 5}) {
    for (bool direct : {false, true}) {
      checkpoint::detail::IoOptions io;
      io.threads = threads;
      io.direct = direct;
      io.block_bytes = 3 * 4096;
      const std::string path = tmp.path + "/f" + std::to_string(threads) + (direct ? "d" : "b");
      checkpoint::detail::write_pieces(path, pieces, io);
      EXPECT_EQ(contents(path), want) << threads << " threads, direct " << direct;
      // Read back in blocks of 4096 on 3 threads.
      std::string got(want.size(), '\0');
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      ASSERT_GE(fd, 0);
      checkpoint::detail::read_parallel({{fd, &path, 0, want.size(), got.data()}}, 3, 4096);
      ::close(fd);
      EXPECT_EQ(got, want);
    }
  }
}

// Direct I/O writes the whole aligned units of a piece whose memory is aligned as its place in the
// file straight from it (AsyncSaver's snapshot), the rest through a buffer: the bytes are the same
// whichever way each unit goes. An aligned arena's slices back to back after a header of a whole
// unit (straight), after none (straight), after 100 bytes (the arena misaligned for the file:
// buffered throughout); slices of odd sizes, so that units are shared by pieces.
TEST(CheckpointIo, DirectWritesStraightFromAlignedMemoryTheSameBytes) {
  TempDir tmp;
  torch::manual_seed(2);
  const std::vector<int64_t> sizes = {4096, 3, 8192, 4093, 20000, 0, 12289, 7};
  int64_t arena_bytes = 0;
  for (int64_t n : sizes) arena_bytes += n;
  const at::Tensor arena_storage = torch::randint(0, 256, {arena_bytes + 4096}, torch::kByte);
  const auto address = reinterpret_cast<uintptr_t>(arena_storage.data_ptr());
  const char* arena = static_cast<const char*>(arena_storage.data_ptr()) + (4096 - address % 4096) % 4096;
  for (int64_t header_bytes : {int64_t{4096}, int64_t{0}, int64_t{100}}) {
    const at::Tensor header = torch::randint(0, 256, {header_bytes}, torch::kByte);
    std::vector<checkpoint::detail::IoPiece> pieces;
    std::string want;
    if (header_bytes > 0) {
      pieces.push_back({header.data_ptr(), static_cast<uint64_t>(header_bytes)});
      want.append(static_cast<const char*>(header.data_ptr()), static_cast<size_t>(header_bytes));
    }
    const char* at = arena;
    for (int64_t n : sizes) {
      pieces.push_back({at, static_cast<uint64_t>(n)});
      at += n;
    }
    want.append(arena, static_cast<size_t>(arena_bytes));
    for (int threads : {1, 3}) {
      checkpoint::detail::IoOptions io;
      io.threads = threads;
      io.direct = true;
      io.block_bytes = 3 * 4096;
      const std::string path = tmp.path + "/h" + std::to_string(header_bytes) + "t" + std::to_string(threads);
      checkpoint::detail::write_pieces(path, pieces, io);
      EXPECT_EQ(contents(path), want) << "header " << header_bytes << ", " << threads << " threads";
    }
  }
}

TEST(CheckpointIo, SafetensorsFilesAreTheSameWithThreadsAndDirectIo) {
  TempDir tmp;
  torch::manual_seed(1);
  // Larger than the 8 MiB write block, with an odd number of bytes at the end.
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"w", torch::randn({2100001})}, {"b", torch::randn({3})}, {"ids", torch::arange(7, torch::kByte)}};
  const auto buffered = checkpoint::write_safetensors(tmp.path + "/a.safetensors", tensors);
  const auto direct = checkpoint::write_safetensors(tmp.path + "/b.safetensors", tensors, {},
                                                    checkpoint::WriteOptions().threads(3).direct(true));
  EXPECT_NE(buffered.size % 4096, 0u);
  EXPECT_EQ(contents(tmp.path + "/a.safetensors"), contents(tmp.path + "/b.safetensors"));
  for (size_t i = 0; i < tensors.size(); ++i) EXPECT_EQ(buffered.tensors[i].crc32c, direct.tensors[i].crc32c);
  EXPECT_THROW(
      checkpoint::write_safetensors(tmp.path + "/c.safetensors", tensors, {}, checkpoint::WriteOptions().threads(0)),
      c10::Error);
}

}  // namespace
}  // namespace fsdp::testing
