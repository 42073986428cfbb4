// The raw-disk baseline of ckpt_bench save and load (ckpt_raw_io.h), in plain POSIX I/O: what any
// program writing or reading the same bytes in large blocks gets from the disk.
#include "benchmarks/checkpoint/ckpt_raw_io.h"

#include <c10/util/Exception.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <thread>

namespace ckpt {
namespace {

// work(worker, i) for i in [0, n): worker t takes i = t, t + threads, ... (the raw baseline
// splits blocks statically); the first worker's error, if any, is rethrown after all have joined.
void run_parallel(size_t n, int threads, const std::function<void(int, size_t)>& work) {
  const int count = static_cast<int>(std::min<size_t>(n, static_cast<size_t>(std::max(threads, 1))));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(std::max(count, 1)));
  std::vector<std::thread> workers;
  for (int t = 0; t < count; ++t) {
    workers.emplace_back([&, t] {
      try {
        for (size_t i = static_cast<size_t>(t); i < n; i += static_cast<size_t>(count)) work(t, i);
      } catch (...) {
        errors[static_cast<size_t>(t)] = std::current_exception();
      }
    });
  }
  for (auto& w : workers) w.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// O_DIRECT's alignment of offsets, lengths and memory for `fd` (statx, else 4096).
uint64_t direct_alignment(int fd) {
  struct statx stx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0 || (stx.stx_mask & STATX_DIOALIGN) == 0 ||
      stx.stx_dio_offset_align == 0) {
    return 4096;
  }
  return std::max<uint64_t>({stx.stx_dio_offset_align, stx.stx_dio_mem_align, 512});
}

void pwrite_all(int fd, const std::string& path, const char* p, uint64_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, "ckpt_bench: writing '", path, "' at ", offset, " failed: ", std::strerror(errno));
    p += w, n -= static_cast<uint64_t>(w), offset += static_cast<uint64_t>(w);
  }
}

void pread_all(int fd, const std::string& path, char* p, uint64_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    TORCH_CHECK(r > 0, "ckpt_bench: reading '", path, "' at ", offset,
                " failed: ", r == 0 ? "end of file" : std::strerror(errno));
    p += r, n -= static_cast<uint64_t>(r), offset += static_cast<uint64_t>(r);
  }
}

struct Aligned {
  void* p = nullptr;
  Aligned(uint64_t align, uint64_t n) {
    TORCH_CHECK(::posix_memalign(&p, align, n) == 0, "ckpt_bench: cannot allocate ", n, " bytes");
  }
  ~Aligned() { std::free(p); }
};

}  // namespace

std::string raw_file(const std::string& dir, int rank) {
  return dir + "/raw/rank-" + std::to_string(rank) + ".bin";
}

void raw_write(const std::string& path, const std::vector<char>& src, int threads, bool direct) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
  TORCH_CHECK(fd >= 0, "ckpt_bench: cannot create '", path, "'", direct ? " with O_DIRECT" : "", ": ",
              std::strerror(errno));
  const uint64_t align = direct ? direct_alignment(fd) : 1, size = src.size();
  const uint64_t block = std::max(align, kIoBlock / align * align);
  std::vector<std::unique_ptr<Aligned>> buffers(static_cast<size_t>(std::max(threads, 1)));
  try {
    run_parallel(static_cast<size_t>((size + block - 1) / block), threads, [&](int worker, size_t b) {
      const uint64_t lo = b * block, n = std::min(size, lo + block) - lo;
      if (!direct) return pwrite_all(fd, path, src.data() + lo, n, lo);
      auto& buf = buffers[static_cast<size_t>(worker)];
      if (!buf) buf = std::make_unique<Aligned>(align, block);
      const uint64_t padded = (n + align - 1) / align * align;
      std::memcpy(buf->p, src.data() + lo, n);
      std::memset(static_cast<char*>(buf->p) + n, 0, padded - n);
      pwrite_all(fd, path, static_cast<const char*>(buf->p), padded, lo);
    });
    TORCH_CHECK(!direct || size % align == 0 || ::ftruncate(fd, static_cast<off_t>(size)) == 0,
                "ckpt_bench: truncating '", path, "' failed: ", std::strerror(errno));
    TORCH_CHECK(::fsync(fd) == 0, "ckpt_bench: fsync of '", path, "' failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

void raw_read(const std::string& dir, int files, int64_t offset, int64_t bytes, std::vector<char>& dst, int threads) {
  struct Read {
    int fd;
    const std::string* path;
    uint64_t offset, n;
    char* dst;
  };
  std::vector<std::string> paths;
  std::vector<int> fds;
  std::vector<Read> reads;
  paths.reserve(static_cast<size_t>(files));
  char* out = dst.data();
  for (int f = 0; f < files && bytes > 0; ++f) {
    paths.push_back(raw_file(dir, f));
    struct stat st {};
    TORCH_CHECK(::stat(paths.back().c_str(), &st) == 0, "no ", paths.back(), ": run ckpt_bench save first");
    if (offset >= st.st_size) {
      offset -= st.st_size;
      continue;
    }
    fds.push_back(::open(paths.back().c_str(), O_RDONLY | O_CLOEXEC));
    TORCH_CHECK(fds.back() >= 0, "ckpt_bench: cannot open '", paths.back(), "': ", std::strerror(errno));
    const int64_t n = std::min<int64_t>(bytes, st.st_size - offset);
    for (int64_t at = 0; at < n; at += static_cast<int64_t>(kIoBlock)) {  // 8 MiB preads
      const uint64_t len = std::min<uint64_t>(kIoBlock, static_cast<uint64_t>(n - at));
      reads.push_back({fds.back(), &paths.back(), static_cast<uint64_t>(offset + at), len, out + at});
    }
    out += n;
    bytes -= n;
    offset = 0;
  }
  try {
    run_parallel(reads.size(), threads, [&](int, size_t i) {
      pread_all(reads[i].fd, *reads[i].path, reads[i].dst, reads[i].n, reads[i].offset);
    });
  } catch (...) {
    for (int fd : fds) ::close(fd);
    throw;
  }
  for (int fd : fds) ::close(fd);
}

std::vector<std::string> files_under(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = d ? ::readdir(d) : nullptr) {
    const std::string n = e->d_name, p = dir + "/" + n;
    if (n == "." || n == "..") continue;
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      for (const auto& x : files_under(p)) out.push_back(x);
    } else {
      out.push_back(p);
    }
  }
  if (d) ::closedir(d);
  return out;
}

int64_t bytes_under(const std::string& dir) {
  int64_t n = 0;
  for (const auto& f : files_under(dir)) {
    struct stat st {};
    if (::stat(f.c_str(), &st) == 0) n += st.st_size;
  }
  return n;
}

void drop_cache(const std::string& dir) {
  for (const auto& f : files_under(dir)) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

}  // namespace ckpt
