#include "checkpoint/internal/reader.h"

#include "checkpoint/internal/parallel_io.h"
#include "fsdp/internal/check.h"

#include "checkpoint/safetensors.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <utility>

namespace fsdp::checkpoint::detail {

struct ShardReader::Piece {
  size_t target = 0;
  const ManifestTensor* tensor = nullptr;
  const ManifestChunk* chunk = nullptr;
  int64_t row_begin = 0, row_end = 0;  // global rows copied
  // Along the dimensions from 1: the part copied (absolute), and the chunk's and the target's
  // extents it is cut from and put into.
  std::vector<int64_t> offsets, lengths, chunk_offsets, chunk_lengths, target_offsets;
  uint64_t lo = 0, hi = 0;    // file bytes read: the chunk's rows copied from, rounded out to blocks
  uint64_t copy_begin = 0;    // file offset of the first of those rows
  uint64_t copy_bytes = 0;    // bytes of those rows (all of the chunk's width)
  size_t range = 0;           // the read that holds it (staged pieces)
  uint8_t* direct = nullptr;  // in place: the destination's first byte, read straight into
};

// Host memory for one read: mapped directly, in huge pages where the kernel gives them (a load
// fills hundreds of MB at once, and faulting them in 4 KiB pages costs as much as the read), not
// zeroed by us (every byte is read into).
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    reset();
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
    return *this;
  }
  ~HostBuffer() { reset(); }
  void allocate(size_t n) {
    reset();
    if (n == 0) return;
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    FSDP_CHECK(p != MAP_FAILED, "cannot map ", n,
               " bytes of host memory for a checkpoint read: ", std::strerror(errno));
    if (n >= (size_t{2} << 20)) ::madvise(p, n, MADV_HUGEPAGE);
    p_ = static_cast<uint8_t*>(p);
    n_ = n;
  }
  void reset() {
    if (p_ != nullptr) ::munmap(p_, n_);
    p_ = nullptr;
    n_ = 0;
  }
  uint8_t* get() const { return p_; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

struct ShardReader::Range {
  size_t file = 0;
  uint64_t begin = 0, end = 0;
  HostBuffer data;
};

namespace {

std::string hex(uint32_t v) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", v);
  return text;
}

}  // namespace

ShardReader::ShardReader(const Manifest& manifest, std::vector<ReadTarget> targets, bool in_place)
    : m_(manifest), targets_(std::move(targets)), fds_(manifest.files.size(), -1) {
  for (size_t i = 0; i < targets_.size(); ++i) {
    const ReadTarget& t = targets_[i];
    const ManifestTensor& mt = m_.tensors.at(t.tensor);
    const uint64_t element = c10::elementSize(scalar_type_of(mt.dtype, mt.key));
    const size_t inner_dims = mt.shape.empty() ? 0 : mt.shape.size() - 1;
    stats_.bytes_needed +=
        static_cast<uint64_t>(t.row_end - t.row_begin) * static_cast<uint64_t>(t.inner.row_numel(mt.shape)) * element;
    for (const ManifestChunk& c : mt.chunks) {
      const int64_t a = std::max(t.row_begin, c.row_begin), b = std::min(t.row_end, c.row_end);
      const uint64_t row_bytes = static_cast<uint64_t>(c.inner.row_numel(mt.shape)) * element;
      if (a >= b || row_bytes == 0) continue;
      Piece p;
      bool overlaps = true, same_width = true;
      for (size_t d = 0; d < inner_dims; ++d) {
        const int64_t t0 = t.inner.offset(d), t1 = t0 + t.inner.length(d, mt.shape);
        const int64_t c0 = c.inner.offset(d), c1 = c0 + c.inner.length(d, mt.shape);
        overlaps = overlaps && std::max(t0, c0) < std::min(t1, c1);
        same_width = same_width && t0 == c0 && t1 == c1;
        p.offsets.push_back(std::max(t0, c0));
        p.lengths.push_back(std::min(t1, c1) - std::max(t0, c0));
        p.chunk_offsets.push_back(c0);
        p.chunk_lengths.push_back(c1 - c0);
        p.target_offsets.push_back(t0);
      }
      if (!overlaps) continue;
      p.target = i;
      p.tensor = &mt;
      p.chunk = &c;
      p.row_begin = a;
      p.row_end = b;
      const uint64_t from = static_cast<uint64_t>(a - c.row_begin) * row_bytes;
      const uint64_t to = static_cast<uint64_t>(b - c.row_begin) * row_bytes;
      p.copy_begin = c.begin + from;
      p.copy_bytes = to - from;
      if (c.crc32c.empty()) {  // no checksums (a Hugging Face file): the needed bytes alone
        p.lo = p.copy_begin;
        p.hi = p.copy_begin + p.copy_bytes;
      } else {  // whole checksum blocks only, counted from the chunk's first byte
        p.lo = c.begin + from / c.block_bytes * c.block_bytes;
        p.hi = std::min(c.end, c.begin + (to + c.block_bytes - 1) / c.block_bytes * c.block_bytes);
      }
      if (in_place && same_width && p.lo == p.copy_begin && p.hi == p.copy_begin + p.copy_bytes) {
        const at::Tensor dst = t.dst.dim() == 0 ? t.dst : t.dst.narrow(0, a - t.row_begin, b - a);
        if (dst.is_cpu() && dst.is_contiguous() && dst.scalar_type() == scalar_type_of(mt.dtype, mt.key) &&
            dst.nbytes() == p.copy_bytes) {
          p.direct = static_cast<uint8_t*>(dst.data_ptr());
        }
      }
      pieces_.push_back(std::move(p));
    }
  }
  // Sorted by file and offset; ranges that touch or overlap are merged into one read.
  std::sort(pieces_.begin(), pieces_.end(), [](const Piece& x, const Piece& y) {
    return std::tie(x.chunk->file, x.lo) < std::tie(y.chunk->file, y.lo);
  });
  for (Piece& p : pieces_) {
    if (p.direct != nullptr) {
      stats_.bytes_read += p.hi - p.lo;
      stats_.preads += (p.hi - p.lo + kReadBlock - 1) / kReadBlock;
      continue;
    }
    if (ranges_.empty() || ranges_.back().file != p.chunk->file || p.lo > ranges_.back().end) {
      Range r;
      r.file = p.chunk->file;
      r.begin = p.lo;
      r.end = p.hi;
      ranges_.push_back(std::move(r));
    } else {
      ranges_.back().end = std::max(ranges_.back().end, p.hi);
    }
    p.range = ranges_.size() - 1;
  }
  for (const Range& r : ranges_) {
    stats_.bytes_read += r.end - r.begin;
    stats_.preads += (r.end - r.begin + kReadBlock - 1) / kReadBlock;  // read() splits a range so
  }
}

ShardReader::~ShardReader() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

void ShardReader::open_files() {
  for (const Piece& p : pieces_) {
    const size_t f = p.chunk->file;
    if (fds_[f] >= 0) continue;
    const std::string path = m_.dir + "/" + m_.files[f].name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    FSDP_CHECK(fd >= 0, "cannot open '", path, "' (", std::strerror(errno), "), which holds rows ", p.row_begin, " to ",
               p.row_end, " of tensor '", p.tensor->key,
               "': the checkpoint is incomplete. Restore the file, or load an earlier checkpoint.");
    fds_[f] = fd;
    ++stats_.files;
    struct stat st {};
    FSDP_CHECK(::fstat(fd, &st) == 0, "cannot stat '", path, "': ", std::strerror(errno));
    FSDP_CHECK(static_cast<uint64_t>(st.st_size) == m_.files[f].bytes, "'", path, "' has ", st.st_size,
               " bytes but the manifest says ", m_.files[f].bytes, ": it was truncated or replaced (needed for rows ",
               p.row_begin, " to ", p.row_end, " of tensor '", p.tensor->key,
               "'). Restore the file, or load an earlier checkpoint.");
  }
}

namespace {

[[noreturn]] void corrupt_block(const Manifest& m, const ManifestTensor& t, const ManifestChunk& c, int64_t block,
                                uint32_t got, bool in_place) {
  const uint64_t at = c.begin + static_cast<uint64_t>(block) * c.block_bytes;
  const uint64_t n = std::min(c.block_bytes, c.end - at);
  FSDP_CHECK(false, "tensor '", t.key, "' rows ", c.row_begin, " to ", c.row_end, " in '", m.dir, "/",
             m.files[c.file].name, "', bytes ", at, " to ", at + n, " (checksum block ", block, "): CRC32C ", hex(got),
             " but the manifest says ", hex(c.crc32c[static_cast<size_t>(block)]), ". The file is corrupt; ",
             in_place ? "it was read in place (LoadOptions::in_place), so this rank's shards now hold part of it"
                      : "nothing was loaded",
             in_place ? ". Build the model and optimizer again, then restore the file or load an earlier checkpoint"
                      : ". Restore it or load an earlier checkpoint",
             " ('fsdp-ckpt verify ", m.dir, "' lists every fault).",
             t.kind == "rng" ? " This tensor is a rank's random generator state, not the model's: "
                               "LoadOptions().rng_states(false) loads the rest without it."
                             : "");
}

}  // namespace

void ShardReader::read(int threads) {
  std::vector<std::string> paths;
  for (const auto& f : m_.files) paths.push_back(m_.dir + "/" + f.name);
  std::vector<ReadRequest> requests;
  for (Range& r : ranges_) {
    const int fd = fds_[r.file];
    FSDP_CHECK(fd >= 0, "ShardReader::read before open_files");
    const uint64_t size = r.end - r.begin;
    r.data.allocate(size);
    requests.push_back({fd, &paths[r.file], r.begin, size, r.data.get(), {}});
  }
  // In place: each read of at most kReadBlock (whole checksum blocks) goes into the destination
  // and is verified by its thread at once, while the other threads' reads are in flight.
  for (const Piece& p : pieces_) {
    if (p.direct == nullptr) continue;
    const ManifestChunk& c = *p.chunk;
    const int fd = fds_[c.file];
    FSDP_CHECK(fd >= 0, "ShardReader::read before open_files");
    const uint64_t step =
        c.crc32c.empty() ? kReadBlock : std::max<uint64_t>(1, kReadBlock / c.block_bytes) * c.block_bytes;
    for (uint64_t at = p.lo; at < p.hi; at += step) {
      const uint64_t n = std::min(step, p.hi - at);
      uint8_t* dst = p.direct + (at - p.lo);
      std::function<void()> check = [this, &p, at, dst, n] {
        if (p.chunk->crc32c.empty()) return;  // nothing to verify against
        uint32_t got = 0;
        const int64_t block = first_bad_block(*p.chunk, at, dst, n, got);
        if (block >= 0) corrupt_block(m_, *p.tensor, *p.chunk, block, got, true);
      };
      requests.push_back({fd, &paths[c.file], at, n, dst, std::move(check)});
    }
  }
  read_parallel(requests, threads, kReadBlock);
  // Every block read, against the manifest (pieces share no block: each is one tensor's chunk).
  for (const Piece& p : pieces_) {
    const ManifestChunk& c = *p.chunk;
    if (c.crc32c.empty() || p.direct != nullptr) continue;  // nothing to verify against, or done
    const Range& r = ranges_[p.range];
    uint32_t got = 0;
    const int64_t block = first_bad_block(c, p.lo, r.data.get() + (p.lo - r.begin), p.hi - p.lo, got);
    if (block >= 0) corrupt_block(m_, *p.tensor, c, block, got, false);
  }
}

bool ShardReader::reads_in_place() const {
  return std::any_of(pieces_.begin(), pieces_.end(), [](const Piece& p) { return p.direct != nullptr; });
}

void ShardReader::apply() {
  at::NoGradGuard no_grad;  // the targets are often parameters
  for (const Piece& p : pieces_) {
    if (p.direct != nullptr) continue;  // read in place
    const ReadTarget& t = targets_[p.target];
    const Range& r = ranges_[p.range];
    const at::ScalarType type = scalar_type_of(p.tensor->dtype, p.tensor->key);
    // The chunk's rows, as they lie in the file (all of its width) ...
    std::vector<int64_t> shape{p.row_end - p.row_begin};
    shape.insert(shape.end(), p.chunk_lengths.begin(), p.chunk_lengths.end());
    if (t.dst.dim() == 0) shape.clear();
    const uint8_t* src = r.data.get() + (p.copy_begin - r.begin);
    at::Tensor rows;
    if (reinterpret_cast<uintptr_t>(src) % c10::elementSize(type) == 0) {
      rows = at::from_blob(const_cast<uint8_t*>(src), shape, at::TensorOptions().dtype(type));
    } else {  // a tensor after one of an odd number of 2-byte elements: copied to aligned memory
      rows = at::empty(shape, at::TensorOptions().dtype(type));
      std::memcpy(rows.data_ptr(), src, p.copy_bytes);
    }
    FSDP_CHECK(static_cast<uint64_t>(rows.numel()) * rows.element_size() == p.copy_bytes, "tensor '", p.tensor->key,
               "' rows ", p.row_begin, " to ", p.row_end, " do not fit their destination");
    // ... cut to the part the target needs, into its place there.
    at::Tensor dst = t.dst.dim() == 0 ? t.dst : t.dst.narrow(0, p.row_begin - t.row_begin, p.row_end - p.row_begin);
    for (size_t d = 0; d < p.offsets.size() && t.dst.dim() > 0; ++d) {
      const auto dim = static_cast<int64_t>(d + 1);
      rows = rows.narrow(dim, p.offsets[d] - p.chunk_offsets[d], p.lengths[d]);
      dst = dst.narrow(dim, p.offsets[d] - p.target_offsets[d], p.lengths[d]);
    }
    dst.copy_(rows);
  }
  for (Range& r : ranges_) r.data.reset();
}

}  // namespace fsdp::checkpoint::detail
