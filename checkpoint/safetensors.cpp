#include "checkpoint/safetensors.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/crash_point.h"
#include "checkpoint/internal/crc32c.h"
#include "checkpoint/internal/parallel_io.h"
#include "fsdp/internal/check.h"
#include "fsdp/util/json_text.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <set>

namespace fsdp::checkpoint {
namespace {

constexpr const char* kMetadataKey = "__metadata__";
// A header longer than this is not a checkpoint's (safetensors itself refuses 100 MB and more).
constexpr uint64_t kMaxHeader = uint64_t{100} << 20;

const std::vector<std::pair<at::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<at::ScalarType, const char*>> names = {{at::kDouble, "F64"},
                                                                            {at::kFloat, "F32"},
                                                                            {at::kHalf, "F16"},
                                                                            {at::kBFloat16, "BF16"},
                                                                            {at::kLong, "I64"},
                                                                            {at::kInt, "I32"},
                                                                            {at::kShort, "I16"},
                                                                            {at::kChar, "I8"},
                                                                            {at::kByte, "U8"},
                                                                            {at::kBool, "BOOL"},
                                                                            {at::kUInt16, "U16"},
                                                                            {at::kUInt32, "U32"},
                                                                            {at::kUInt64, "U64"},
                                                                            {at::kFloat8_e4m3fn, "F8_E4M3"},
                                                                            {at::kFloat8_e5m2, "F8_E5M2"}};
  return names;
}

std::string system_error() {
  return std::strerror(errno);
}

// A file descriptor closed on every path out.
struct Fd {
  int fd = -1;
  Fd(const std::string& path, int flags, mode_t mode = 0644) : fd(::open(path.c_str(), flags | O_CLOEXEC, mode)) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// Sequential writes through a buffer: small tensors are gathered into large writes, a large one
// goes straight from its memory.
class SequentialWriter {
 public:
  SequentialWriter(int fd, std::string path) : fd_(fd), path_(std::move(path)) { buffer_.reserve(kBuffer); }
  void append(const void* data, size_t n, const std::string& what) {
    if (buffer_.size() + n > kBuffer) flush(what);
    if (n >= kBuffer) {
      write_all(static_cast<const char*>(data), n, what);
      return;
    }
    const auto* p = static_cast<const char*>(data);
    buffer_.insert(buffer_.end(), p, p + n);
  }
  void flush(const std::string& what) {
    write_all(buffer_.data(), buffer_.size(), what);
    buffer_.clear();
  }

 private:
  static constexpr size_t kBuffer = size_t{8} << 20;
  void write_all(const char* p, size_t n, const std::string& what) {
    const int injected = detail::injected_write_error(path_);
    while (n > 0) {
      errno = injected;
      const ssize_t w = injected != 0 ? -1 : ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      FSDP_CHECK(w > 0, "fsdp::checkpoint: writing ", what, " to '", path_, "' failed: ", system_error());
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  int fd_;
  std::string path_;
  std::vector<char> buffer_;
};

uint64_t numel_of(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace

std::string safetensors_dtype(at::ScalarType type) {
  for (const auto& [t, name] : dtype_names()) {
    if (t == type) return name;
  }
  FSDP_CHECK(false, "fsdp::checkpoint: dtype ", type,
             " has no safetensors name; save tensors of a supported dtype (float64/32/16, bfloat16, float8, "
             "integers, bool).");
}

at::ScalarType scalar_type_of(const std::string& dtype, const std::string& where) {
  for (const auto& [t, name] : dtype_names()) {
    if (dtype == name) return t;
  }
  FSDP_CHECK(false, "fsdp::checkpoint: ", where, " has dtype '", dtype, "', which this library does not read.");
}

uint64_t checksum_block(uint64_t bytes, uint64_t max_block, uint64_t min_blocks) {
  constexpr uint64_t kPage = 4096;
  if (min_blocks <= 1 || bytes >= max_block * min_blocks) return max_block;
  const uint64_t share = (bytes + min_blocks - 1) / min_blocks;
  return std::min(max_block, std::max(kPage, (share + kPage - 1) / kPage * kPage));
}

struct SafetensorsWriter::Impl {
  FileRecord rec;
  Fd fd;
  SequentialWriter out;
  size_t tensor = 0;     // the tensor being written
  uint64_t written = 0;  // bytes of the data buffer so far
  Impl(const std::string& path) : fd(path, O_WRONLY | O_CREAT | O_TRUNC), out(fd.fd, path) {}
};

namespace {

// The file's first bytes (the header's length, then its JSON padded with spaces so that the data
// starts at a multiple of `alignment`), from the tensors' names, dtypes and shapes; `rec` gets the
// file's layout, offsets absolute.
std::string header_of(const std::string& path, std::vector<TensorRecord> tensors,
                      std::map<std::string, std::string> metadata, uint64_t alignment, FileRecord& rec) {
  FSDP_CHECK(alignment >= 8, "fsdp::checkpoint: the alignment of '", path, "' must be at least 8");
  metadata["format"] = "pt";
  // Written as text (fsdp/util/json_text.h), as nlohmann's compact dump would: a tree of a few
  // hundred tensors is rebuilt at every save, and its keys are found by a linear scan.
  std::string text = "{";
  fsdp::util::append_json_string(text, kMetadataKey);
  text += ":{";
  bool first = true;
  for (const auto& [k, v] : metadata) {
    if (!first) text += ',';
    first = false;
    fsdp::util::append_json_string(text, k);
    text += ':';
    fsdp::util::append_json_string(text, v);
  }
  text += '}';
  std::set<std::string> names;
  uint64_t offset = 0;
  for (auto& tr : tensors) {
    FSDP_CHECK(tr.name != kMetadataKey && names.insert(tr.name).second, "fsdp::checkpoint: tensor name '", tr.name,
               "' is reserved or given twice for '", path, "'.");
    const uint64_t bytes = numel_of(tr.shape) * c10::elementSize(scalar_type_of(tr.dtype, "tensor '" + tr.name + "'"));
    tr.begin = offset;
    tr.end = offset + bytes;
    offset = tr.end;
    text += ',';
    fsdp::util::append_json_string(text, tr.name);
    text += ":{\"dtype\":";
    fsdp::util::append_json_string(text, tr.dtype);
    text += ",\"shape\":";
    fsdp::util::append_json_array(text, tr.shape, ",");
    text += ",\"data_offsets\":";
    fsdp::util::append_json_array(text, std::array<uint64_t, 2>{tr.begin, tr.end}, ",");
    text += '}';
  }
  text += '}';
  const uint64_t padded = (8 + text.size() + alignment - 1) / alignment * alignment - 8;
  text.append(padded - text.size(), ' ');
  rec.path = path;
  rec.metadata = std::move(metadata);
  rec.data_start = 8 + text.size();
  rec.size = rec.data_start + offset;
  for (auto& tr : tensors) {
    tr.begin += rec.data_start;
    tr.end += rec.data_start;
  }
  rec.tensors = std::move(tensors);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(text.size() >> (8 * i));  // little-endian
  return out + text;
}

}  // namespace

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<TensorRecord> tensors,
                                     std::map<std::string, std::string> metadata, uint64_t alignment) {
  FileRecord rec;
  const std::string header = header_of(path, std::move(tensors), std::move(metadata), alignment, rec);
  impl_ = std::make_unique<Impl>(path);
  FSDP_CHECK(impl_->fd.fd >= 0, "fsdp::checkpoint: cannot create '", path, "': ", system_error());
  impl_->rec = std::move(rec);
  impl_->out.append(header.data(), header.size(), "the header");
}

SafetensorsWriter::~SafetensorsWriter() = default;

const FileRecord& SafetensorsWriter::record() const {
  return impl_->rec;
}

void SafetensorsWriter::write(const void* data, uint64_t n) {
  Impl& w = *impl_;
  const uint64_t total = w.rec.size - w.rec.data_start;
  FSDP_CHECK(w.written + n <= total, "fsdp::checkpoint: ", n, " more bytes for '", w.rec.path, "', whose tensors hold ",
             total - w.written, " more.");
  while (w.tensor < w.rec.tensors.size() && w.rec.data_start + w.written >= w.rec.tensors[w.tensor].end) ++w.tensor;
  const std::string what =
      w.tensor < w.rec.tensors.size() ? "tensor '" + w.rec.tensors[w.tensor].name + "'" : std::string("the data");
  w.out.append(data, n, what);
  w.written += n;
}

FileRecord SafetensorsWriter::finish(bool fsync) {
  Impl& w = *impl_;
  FSDP_CHECK(w.rec.data_start + w.written == w.rec.size, "fsdp::checkpoint: '", w.rec.path, "' got ", w.written,
             " bytes of data, but its tensors hold ", w.rec.size - w.rec.data_start, ".");
  w.out.flush("the data");
  if (fsync) {
    FSDP_CHECK(::fsync(w.fd.fd) == 0, "fsdp::checkpoint: fsync of '", w.rec.path, "' failed: ", system_error());
  }
  return w.rec;
}

FileRecord write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             std::map<std::string, std::string> metadata, const WriteOptions& options) {
  FSDP_CHECK(options.alignment() >= 8 && options.block_bytes() > 0 && options.min_blocks() > 0,
             "fsdp::checkpoint::write_safetensors: the alignment must be at least 8, the block size and the "
             "number of blocks positive");
  std::vector<TensorRecord> records;
  std::vector<at::Tensor> data;
  for (const auto& [name, t] : tensors) {
    FSDP_CHECK(t.defined() && t.device().is_cpu(), "fsdp::checkpoint: tensor '", name, "' for '", path,
               "' is undefined or not on the CPU; copy it to the CPU first.");
    TensorRecord tr;
    tr.name = name;
    tr.dtype = safetensors_dtype(t.scalar_type());
    tr.shape = t.sizes().vec();
    records.push_back(std::move(tr));
    data.push_back(t.contiguous());
  }
  FileRecord rec;
  const std::string header = header_of(path, std::move(records), std::move(metadata), options.alignment(), rec);
  std::vector<detail::IoPiece> pieces{{header.data(), header.size()}};
  for (size_t i = 0; i < data.size(); ++i) {
    TensorRecord& tr = rec.tensors[i];
    const auto* p = static_cast<const uint8_t*>(data[i].data_ptr());
    const uint64_t bytes = tr.end - tr.begin;
    tr.block_bytes = checksum_block(bytes, options.block_bytes(), options.min_blocks());
    for (uint64_t b = 0; b < bytes; b += tr.block_bytes) {
      tr.crc32c.push_back(crc32c(p + b, std::min(tr.block_bytes, bytes - b)));
    }
    pieces.push_back({p, bytes});
  }
  detail::IoOptions io;
  io.threads = options.threads();
  io.direct = options.direct();
  detail::write_pieces(path, pieces, io);
  if (options.fsync()) fsync_path(path);
  return rec;
}

FileRecord read_safetensors_header(const std::string& path) {
  FileRecord rec;
  rec.path = path;
  struct stat st {};
  FSDP_CHECK(::stat(path.c_str(), &st) == 0, "fsdp::checkpoint: cannot open '", path, "': ", system_error());
  rec.size = static_cast<uint64_t>(st.st_size);
  FSDP_CHECK(rec.size >= 8, "fsdp::checkpoint: '", path, "' has ", rec.size,
             " bytes, fewer than a safetensors header's length field (8): it is truncated or not a safetensors file.");
  uint8_t length[8];
  read_bytes(path, 0, 8, length);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  FSDP_CHECK(n <= kMaxHeader && 8 + n <= rec.size, "fsdp::checkpoint: '", path, "' says its header has ", n,
             " bytes, but the file has ", rec.size, ": it is truncated or not a safetensors file.");
  std::string text(n, '\0');
  read_bytes(path, 8, n, text.data());
  rec.data_start = 8 + n;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    FSDP_CHECK(false, "fsdp::checkpoint: the header of '", path, "' is not valid JSON (", e.what(), ").");
  }
  FSDP_CHECK(header.is_object(), "fsdp::checkpoint: the header of '", path, "' is not a JSON object.");
  try {
    for (const auto& [key, value] : header.items()) {
      if (key == kMetadataKey) {
        for (const auto& [k, v] : value.items()) rec.metadata[k] = v.get<std::string>();
        continue;
      }
      TensorRecord tr;
      tr.name = key;
      tr.dtype = value.at("dtype").get<std::string>();
      tr.shape = value.at("shape").get<std::vector<int64_t>>();
      const auto offsets = value.at("data_offsets").get<std::vector<uint64_t>>();
      FSDP_CHECK(offsets.size() == 2, "fsdp::checkpoint: tensor '", key, "' in '", path, "' has data_offsets of ",
                 offsets.size(), " numbers, not 2.");
      tr.begin = rec.data_start + offsets[0];
      tr.end = rec.data_start + offsets[1];
      const at::ScalarType type = scalar_type_of(tr.dtype, "tensor '" + key + "' in '" + path + "'");
      for (int64_t d : tr.shape) {
        FSDP_CHECK(d >= 0, "fsdp::checkpoint: tensor '", key, "' in '", path, "' has a negative dimension.");
      }
      FSDP_CHECK(offsets[0] <= offsets[1] && offsets[1] - offsets[0] == numel_of(tr.shape) * c10::elementSize(type),
                 "fsdp::checkpoint: tensor '", key, "' in '", path, "' has bytes [", offsets[0], ", ", offsets[1],
                 ") of the data buffer, which do not hold its shape ", c10::IntArrayRef(tr.shape), " of ", tr.dtype,
                 ".");
      rec.tensors.push_back(std::move(tr));
    }
  } catch (const nlohmann::json::exception& e) {
    FSDP_CHECK(false, "fsdp::checkpoint: the header of '", path, "' is not a safetensors header (", e.what(), ").");
  }
  // The data buffer is covered exactly, in order: no hole, no overlap, and it ends with the file.
  std::sort(rec.tensors.begin(), rec.tensors.end(), [](const TensorRecord& x, const TensorRecord& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t at = rec.data_start;
  for (const auto& t : rec.tensors) {
    FSDP_CHECK(t.begin == at, "fsdp::checkpoint: tensor '", t.name, "' in '", path, "' starts at byte ", t.begin,
               " of the file, but the previous tensor ends at ", at, ": the header is corrupt.");
    at = t.end;
  }
  FSDP_CHECK(at == rec.size, "fsdp::checkpoint: the tensors of '", path, "' end at byte ", at, " but the file has ",
             rec.size, " bytes: it is ", at > rec.size ? "truncated." : "longer than its header says.");
  return rec;
}

void pread_exactly(int fd, const std::string& path, uint64_t offset, uint64_t n, void* dst) {
  auto* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    FSDP_CHECK(r >= 0, "fsdp::checkpoint: reading bytes [", offset, ", ", offset + n, ") of '", path,
               "' failed: ", system_error());
    FSDP_CHECK(r > 0, "fsdp::checkpoint: '", path, "' ends at byte ", offset + done, ", before byte ", offset + n,
               " that is needed: it is truncated.");
    done += static_cast<uint64_t>(r);
  }
}

void read_bytes(const std::string& path, uint64_t offset, uint64_t n, void* dst) {
  Fd f(path, O_RDONLY);
  FSDP_CHECK(f.fd >= 0, "fsdp::checkpoint: cannot open '", path, "': ", system_error());
  pread_exactly(f.fd, path, offset, n, dst);
}

at::Tensor read_tensor(const std::string& path, const TensorRecord& record) {
  at::Tensor t = at::empty(record.shape, at::TensorOptions().dtype(scalar_type_of(record.dtype, path)));
  read_bytes(path, record.begin, record.end - record.begin, t.data_ptr());
  return t;
}

}  // namespace fsdp::checkpoint
