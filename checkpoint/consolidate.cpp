#include "checkpoint/consolidate.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/reader.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "fsdp/internal/check.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace fsdp::checkpoint {
namespace {

// Reads are at most this large (whole checksum blocks), so memory stays bounded.
constexpr uint64_t kPiece = uint64_t{8} << 20;

struct Picked {
  const ManifestTensor* tensor;
  std::string name;  // in the output
};

// The output files of one kind ("model", "optimizer"): tensors in manifest order, split greedily.
std::vector<std::vector<Picked>> split(const std::vector<Picked>& tensors, uint64_t max_bytes) {
  std::vector<std::vector<Picked>> files(1);
  uint64_t in_file = 0;
  for (const auto& p : tensors) {
    const uint64_t b = p.tensor->bytes();
    if (max_bytes > 0 && in_file > 0 && in_file + b > max_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(p);
    in_file += b;
  }
  return files;
}

std::string shard_name(const std::string& kind, size_t i, size_t n) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%s-%05zu-of-%05zu.safetensors", kind.c_str(), i + 1, n);
  return buf;
}

class Consolidator {
 public:
  Consolidator(const Manifest& m) : m_(m), fds_(m.files.size(), -1), buf_(new uint8_t[kPiece]) {}
  ~Consolidator() {
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }
  Consolidator(const Consolidator&) = delete;
  Consolidator& operator=(const Consolidator&) = delete;

  // Streams `t`'s chunks, in row order, into `w`, verifying every block.
  void copy(const ManifestTensor& t, SafetensorsWriter& w) {
    if (std::any_of(t.chunks.begin(), t.chunks.end(), [](const ManifestChunk& c) { return !c.inner.whole(); })) {
      copy_parts(t, w);
      return;
    }
    for (const ManifestChunk& c : t.chunks) {
      const int fd = open_file(c.file, t);
      const std::string path = m_.dir + "/" + m_.files[c.file].name;
      const uint64_t piece = std::max<uint64_t>(1, kPiece / c.block_bytes) * c.block_bytes;
      FSDP_CHECK(piece <= kPiece, "fsdp::checkpoint::consolidate: a checksum block of ", c.block_bytes, " bytes in '",
                 path, "' is larger than the read buffer: the manifest is corrupt.");
      for (uint64_t at = c.begin; at < c.end; at += piece) {
        const uint64_t n = std::min(piece, c.end - at);
        pread_exactly(fd, path, at, n, buf_.get());
        uint32_t got = 0;
        const int64_t block = first_bad_block(c, at, buf_.get(), n, got);
        FSDP_CHECK(block < 0, "fsdp::checkpoint::consolidate: tensor '", t.key, "' rows ", c.row_begin, " to ",
                   c.row_end, " in '", path, "', checksum block ", block,
                   " does not match the manifest: the file is corrupt ('fsdp-ckpt verify ", m_.dir,
                   "' lists every fault). Nothing was written.");
        w.write(buf_.get(), n);
      }
    }
  }

 private:
  // A tensor held as parts of its width (tensor-parallel parts): its rows are assembled a block of
  // at most kPiece bytes at a time by the load's reader (every checksum block verified), and
  // written in order.
  void copy_parts(const ManifestTensor& t, SafetensorsWriter& w) {
    const int64_t rows = t.rows();
    const uint64_t row_bytes = t.bytes() / static_cast<uint64_t>(std::max<int64_t>(rows, 1));
    const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(kPiece / std::max<uint64_t>(row_bytes, 1)));
    const size_t index = static_cast<size_t>(&t - m_.tensors.data());
    std::vector<int64_t> shape = t.shape;
    for (int64_t r = 0; r < rows; r += step) {
      const int64_t n = std::min(step, rows - r);
      shape[0] = n;
      const at::Tensor block = at::empty(shape, at::TensorOptions().dtype(scalar_type_of(t.dtype, t.key)));
      try {
        detail::ShardReader reader(m_, {detail::ReadTarget{index, r, r + n, block, {}}});
        reader.open_files();
        reader.read();
        reader.apply();
      } catch (const c10::Error& e) {
        FSDP_CHECK(false, "fsdp::checkpoint::consolidate: ", e.what_without_backtrace(), " Nothing was written.");
      }
      w.write(static_cast<const uint8_t*>(block.data_ptr()), block.nbytes());
    }
  }

  int open_file(size_t f, const ManifestTensor& t) {
    if (fds_[f] >= 0) return fds_[f];
    const std::string path = m_.dir + "/" + m_.files[f].name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    FSDP_CHECK(fd >= 0, "fsdp::checkpoint::consolidate: cannot open '", path, "' (", std::strerror(errno),
               "), which holds rows of tensor '", t.key, "': the checkpoint is incomplete.");
    fds_[f] = fd;
    struct stat st {};
    FSDP_CHECK(::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) == m_.files[f].bytes,
               "fsdp::checkpoint::consolidate: '", path, "' has ", st.st_size, " bytes but the manifest says ",
               m_.files[f].bytes, ": it was truncated or replaced.");
    return fd;
  }

  const Manifest& m_;
  std::vector<int> fds_;
  std::unique_ptr<uint8_t[]> buf_;
};

}  // namespace

ConsolidateResult consolidate(const std::string& checkpoint, const std::string& out,
                              const ConsolidateOptions& options) {
  const Manifest m = read_manifest(resolve_checkpoint(checkpoint));
  struct stat st {};
  FSDP_CHECK(!out.empty() && ::lstat(out.c_str(), &st) != 0, "fsdp::checkpoint::consolidate: '", out,
             "' exists; give a new directory (nothing is written into an existing one).");
  std::string parent = ".", base = out;
  const size_t slash = out.find_last_of('/');
  if (slash != std::string::npos) {
    parent = slash == 0 ? "/" : out.substr(0, slash);
    base = out.substr(slash + 1);
  }
  const std::string tmp = parent + "/." + base + ".partial-" + std::to_string(::getpid());
  FSDP_CHECK(::mkdir(tmp.c_str(), 0755) == 0, "fsdp::checkpoint::consolidate: cannot create '", tmp,
             "': ", std::strerror(errno));
  ConsolidateResult result;
  result.dir = out;
  result.buffer_bytes = kPiece;
  try {
    std::vector<Picked> model, optim;
    for (const auto& t : m.tensors) {
      if (t.kind == "parameter" || t.kind == "buffer") model.push_back({&t, t.key.substr(6)});   // "model/"
      if (t.kind == "optimizer" && options.optimizer()) optim.push_back({&t, t.key.substr(6)});  // "optim/"
    }
    FSDP_CHECK(!options.optimizer() || !optim.empty(), "fsdp::checkpoint::consolidate: '", m.dir,
               "' holds no optimizer state (it was saved without an optimizer, or before its first step).");
    Consolidator reader(m);
    std::vector<std::string> names;
    for (const auto& [kind, tensors] : {std::pair<std::string, const std::vector<Picked>*>{"model", &model},
                                        std::pair<std::string, const std::vector<Picked>*>{"optimizer", &optim}}) {
      if (tensors->empty()) continue;
      const auto files = split(*tensors, options.max_shard_bytes());
      nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
      uint64_t total = 0;
      for (size_t i = 0; i < files.size(); ++i) {
        const std::string name = files.size() == 1 ? kind + ".safetensors" : shard_name(kind, i, files.size());
        std::vector<TensorRecord> records;
        for (const auto& p : files[i]) {
          TensorRecord r;
          r.name = p.name;
          r.dtype = p.tensor->dtype;
          r.shape = p.tensor->shape;
          records.push_back(std::move(r));
          weight_map[p.name] = name;
          total += p.tensor->bytes();
        }
        SafetensorsWriter w(
            tmp + "/" + name, std::move(records),
            {{"source", "libtorch-fsdp checkpoint '" + m.name + "' (step " + std::to_string(m.step) + ")"}});
        for (const auto& p : files[i]) reader.copy(*p.tensor, w);
        w.finish();
        names.push_back(name);
      }
      result.tensor_bytes += total;
      if (files.size() > 1) {
        const std::string index = kind + ".safetensors.index.json";
        const nlohmann::ordered_json j = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
        write_atomically(tmp, index, j.dump(2) + "\n");
        names.push_back(index);
      }
    }
    fsync_path(tmp);
    FSDP_CHECK(::rename(tmp.c_str(), out.c_str()) == 0, "fsdp::checkpoint::consolidate: cannot rename '", tmp, "' to '",
               out, "': ", std::strerror(errno));
    fsync_path(parent);
    for (const auto& n : names) result.files.push_back(out + "/" + n);
  } catch (...) {
    (void)remove_tree(tmp);  // the error being thrown says more than a failed clean-up
    throw;
  }
  return result;
}

}  // namespace fsdp::checkpoint
