#include "checkpoint/internal/parallel_io.h"

#include "checkpoint/internal/crash_point.h"
#include "checkpoint/safetensors.h"
#include "fsdp/internal/check.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace fsdp::checkpoint::detail {
namespace {

constexpr uint64_t kDefaultAlign = 4096;

struct AlignedBuffer {
  void* p = nullptr;
  uint64_t align = 0, n = 0;
  AlignedBuffer(uint64_t align_, uint64_t n_) : align(align_), n(n_) {
    FSDP_CHECK(::posix_memalign(&p, align, n) == 0, "fsdp::checkpoint: cannot allocate ", n, " bytes for I/O");
  }
  ~AlignedBuffer() { std::free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

// Direct I/O's alignment for `fd`: offsets, lengths and memory (statx's STATX_DIOALIGN, else 4096).
uint64_t direct_alignment(int fd, const std::string& path) {
  struct statx stx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0 || (stx.stx_mask & STATX_DIOALIGN) == 0) {
    return kDefaultAlign;
  }
  FSDP_CHECK(stx.stx_dio_offset_align != 0, "fsdp::checkpoint: the filesystem of '", path,
             "' does not support direct I/O (statx gives no alignment for it): save without direct_io.");
  return std::max<uint64_t>({stx.stx_dio_offset_align, stx.stx_dio_mem_align, 512});
}

// Writes pieces of memory that follow each other in the file at `offset`, without copying them
// together first (at most IOV_MAX at a time), through partial writes and EINTR; an error names the
// file and the bytes.
void pwritev_all(int fd, const std::string& path, std::vector<iovec> iov, uint64_t offset) {
  const int injected = injected_write_error(path);
  const uint64_t first = offset;
  uint64_t total = 0;
  for (const auto& v : iov) total += v.iov_len;
  for (size_t i = 0;;) {
    while (i < iov.size() && iov[i].iov_len == 0) ++i;  // written, or empty
    if (i == iov.size()) return;
    errno = injected;
    const int count = static_cast<int>(std::min<size_t>(iov.size() - i, IOV_MAX));
    const ssize_t w = injected != 0 ? -1 : ::pwritev(fd, iov.data() + i, count, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    FSDP_CHECK(w > 0, "fsdp::checkpoint: writing bytes ", first, " to ", first + total, " of '", path,
               "' failed at byte ", offset, ": ", std::strerror(errno));
    offset += static_cast<uint64_t>(w);
    for (auto left = static_cast<uint64_t>(w); left > 0; ++i) {  // what was written, off the front
      const uint64_t done = std::min<uint64_t>(left, iov[i].iov_len);
      iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + done;
      iov[i].iov_len -= done;
      left -= done;
      if (iov[i].iov_len > 0) break;
    }
  }
}

// Direct I/O's aligned buffers, kept between files (a save every step would otherwise map, fault in
// and unmap one per thread each time): at most kKept, each freed when its size or alignment no
// longer fits.
class BufferPool {
 public:
  std::unique_ptr<AlignedBuffer> take(uint64_t align, uint64_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (!kept_.empty()) {
        std::unique_ptr<AlignedBuffer> b = std::move(kept_.back());
        kept_.pop_back();
        if (b->align == align && b->n == n) return b;
      }
    }
    return std::make_unique<AlignedBuffer>(align, n);
  }
  void give_back(std::unique_ptr<AlignedBuffer> b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (b && kept_.size() < kKept) kept_.push_back(std::move(b));
  }

 private:
  static constexpr size_t kKept = 4;
  std::mutex mu_;
  std::vector<std::unique_ptr<AlignedBuffer>> kept_;
};

BufferPool& buffer_pool() {
  static BufferPool* pool = new BufferPool();  // never destroyed: saves may run at exit
  return *pool;
}

}  // namespace

void run_parallel(size_t n, int threads, const std::function<void(int, size_t)>& work) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::string error;
  std::mutex mu;
  auto loop = [&](int worker) {
    try {
      for (size_t i = next++; i < n && !failed; i = next++) work(worker, i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!failed.exchange(true)) error = error_text(std::current_exception());
    }
  };
  const int extra = static_cast<int>(std::min<size_t>(n, static_cast<size_t>(std::max(threads, 1)))) - 1;
  std::vector<std::thread> pool;
  for (int t = 1; t <= extra; ++t) pool.emplace_back(loop, t);
  loop(0);
  for (auto& t : pool) t.join();
  FSDP_CHECK(!failed, error);
}

void write_pieces(const std::string& path, const std::vector<IoPiece>& pieces, const IoOptions& options) {
  FSDP_CHECK(options.threads >= 1 && options.block_bytes > 0, "fsdp::checkpoint: ", options.threads,
             " I/O threads and blocks of ", options.block_bytes, " bytes: both must be positive.");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (options.direct ? O_DIRECT : 0), 0644);
  FSDP_CHECK(fd >= 0, "fsdp::checkpoint: cannot create '", path, "'", options.direct ? " with O_DIRECT" : "", ": ",
             std::strerror(errno),
             errno == EINVAL && options.direct
                 ? " (this filesystem does not support direct I/O: save without direct_io)"
                 : "");
  struct Closer {  // closes on every path out, but the last one's checked close
    int fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{fd};
  const uint64_t align = options.direct ? direct_alignment(fd, path) : kDefaultAlign;
  const uint64_t block = std::max(align, options.block_bytes / align * align);
  // Where each piece starts in the file.
  std::vector<uint64_t> starts;
  uint64_t size = 0;
  for (const auto& p : pieces) {
    starts.push_back(size);
    size += p.n;
  }
  const size_t blocks = static_cast<size_t>((size + block - 1) / block);
  const int threads = options.threads;
  // Direct I/O: one aligned buffer per thread, taken at its first block and given back after.
  std::vector<std::unique_ptr<AlignedBuffer>> buffers(static_cast<size_t>(threads));
  struct GiveBack {
    std::vector<std::unique_ptr<AlignedBuffer>>& buffers;
    ~GiveBack() {
      for (auto& b : buffers) buffer_pool().give_back(std::move(b));
    }
  } give_back{buffers};
  run_parallel(blocks, threads, [&](int worker, size_t b) {
    const uint64_t lo = b * block, hi = std::min(size, lo + block);
    // The pieces this block overlaps: the first is the last piece starting at or before lo.
    size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin()) - 1;
    while (k < pieces.size() && pieces[k].n == 0) ++k;
    if (!options.direct) {  // straight from the pieces' memory, gathered by the kernel
      std::vector<iovec> iov;
      for (uint64_t at = lo; at < hi; ++k) {
        const uint64_t end = std::min(hi, starts[k] + pieces[k].n);
        if (end <= at) continue;
        iov.push_back({const_cast<char*>(static_cast<const char*>(pieces[k].data)) + (at - starts[k]), end - at});
        at = end;
      }
      pwritev_all(fd, path, std::move(iov), lo);
      return;
    }
    // Direct: whole aligned units of a piece whose memory is aligned as its place in the file go
    // straight from that memory (AsyncSaver's snapshot is laid out so); every other byte through
    // this thread's aligned buffer, at the same place in it as in the block. One pwritev of the
    // block, each of its iovecs aligned in address and length.
    auto& mine = buffers[static_cast<size_t>(worker)];
    if (!mine) mine = buffer_pool().take(align, block);
    auto* buf = static_cast<char*>(mine->p);
    std::vector<iovec> iov;
    uint64_t run = lo;  // the buffer holds [run, at): bytes not yet in `iov`
    for (uint64_t at = lo; at < hi; ++k) {
      const uint64_t end = std::min(hi, starts[k] + pieces[k].n);
      if (end <= at) continue;
      const char* src = static_cast<const char*>(pieces[k].data) + (at - starts[k]);
      const uint64_t ua = (at + align - 1) / align * align, ub = end / align * align;
      const bool straight = ua < ub && (reinterpret_cast<uintptr_t>(src) + (ua - at)) % align == 0;
      if (!straight) {
        std::memcpy(buf + (at - lo), src, end - at);
        at = end;
        continue;
      }
      std::memcpy(buf + (at - lo), src, ua - at);  // the end of a unit begun by earlier pieces
      if (ua > run) iov.push_back({buf + (run - lo), ua - run});
      iov.push_back({const_cast<char*>(src) + (ua - at), ub - ua});
      std::memcpy(buf + (ub - lo), src + (ub - at), end - ub);  // the start of the next unit
      run = ub;
      at = end;
    }
    if (hi > run) {
      uint64_t n = hi - run;
      if (n % align != 0) {  // the file's tail: padded to the alignment, truncated below
        const uint64_t padded = (n + align - 1) / align * align;
        std::memset(buf + (hi - lo), 0, padded - n);
        n = padded;
      }
      iov.push_back({buf + (run - lo), n});
    }
    pwritev_all(fd, path, std::move(iov), lo);
  });
  if (options.direct && size % align != 0) {
    FSDP_CHECK(::ftruncate(fd, static_cast<off_t>(size)) == 0, "fsdp::checkpoint: truncating '", path, "' to ", size,
               " bytes failed: ", std::strerror(errno));
  }
  closer.fd = -1;
  FSDP_CHECK(::close(fd) == 0 || errno == EINTR, "fsdp::checkpoint: closing '", path,
             "' failed: ", std::strerror(errno));
}

void read_parallel(const std::vector<ReadRequest>& requests, int threads, uint64_t block_bytes) {
  std::vector<ReadRequest> parts;
  for (const auto& r : requests) {
    if (r.after) {
      parts.push_back(r);
      continue;
    }
    for (uint64_t at = 0; at < r.n; at += block_bytes) {
      ReadRequest p = r;
      p.offset = r.offset + at;
      p.n = std::min(block_bytes, r.n - at);
      p.dst = static_cast<char*>(r.dst) + at;
      parts.push_back(p);
    }
  }
  run_parallel(parts.size(), threads, [&](int, size_t i) {
    pread_exactly(parts[i].fd, *parts[i].path, parts[i].offset, parts[i].n, parts[i].dst);
    if (parts[i].after) parts[i].after();
  });
}

}  // namespace fsdp::checkpoint::detail
