// A rank's part of the manifest (manifest_builder.h, RankPart) in its two forms: the bytes that
// cross ranks on every save, and the JSON object manifest_from_parts takes.
#include "checkpoint/internal/manifest_builder.h"

#include "fsdp/internal/check.h"

#include <cstring>
#include <string_view>

namespace fsdp::checkpoint::detail {
namespace {

constexpr std::string_view kPartMagic = "fsdp-manifest-part-2";

// RankPart's bytes: fixed-width integers in the machine's order, strings and lists after their
// length. A record is put field by field, so that the bytes read as the record's fields in order.
struct Encoder {
  std::string out;
  void u64(uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
  void i64(int64_t v) { u64(static_cast<uint64_t>(v)); }
  void str(std::string_view s) {
    u64(s.size());
    out.append(s);
  }
  void shape(const std::vector<int64_t>& v) {
    u64(v.size());
    for (const int64_t x : v) i64(x);
  }
  // A list of records: its length, then each record.
  template <typename Record>
  void list(const std::vector<Record>& records) {
    u64(records.size());
    for (const Record& r : records) put(r);
  }
  void put(const TensorMeta& t) {
    str(t.key);
    str(t.kind);
    str(t.dtype);
    shape(t.shape);
  }
  void put(const std::pair<std::string, int64_t>& step) {
    str(step.first);
    i64(step.second);
  }
  void put(const ChunkRecord& c) {
    str(c.tensor);
    i64(c.row_begin);
    i64(c.row_end);
    shape(c.inner.offsets);
    shape(c.inner.lengths);
    u64(c.begin);
    u64(c.end);
    u64(c.block_bytes);
    u64(c.crc32c.size());
    out.append(reinterpret_cast<const char*>(c.crc32c.data()), c.crc32c.size() * sizeof(uint32_t));
  }
};

// Encoder's bytes read back, refusing (naming the rank that sent them) any that run short.
struct Decoder {
  const std::string& in;
  int rank;
  size_t at = 0;
  void need(uint64_t n) const {
    FSDP_CHECK(n <= in.size() - at, "fsdp::checkpoint: the manifest part rank ", rank, " sent ends at byte ", in.size(),
               " where ", n,
               " more were expected: it was not made by this build of the library (every rank must "
               "run the same build).");
  }
  uint64_t u64() {
    need(sizeof(uint64_t));
    uint64_t v = 0;
    std::memcpy(&v, in.data() + at, sizeof(v));
    at += sizeof(v);
    return v;
  }
  int64_t i64() { return static_cast<int64_t>(u64()); }
  // A count of items of at least `item_bytes` each: bounded by what is left, so that a malformed
  // part cannot make us reserve memory it does not hold.
  uint64_t count(uint64_t item_bytes) {
    const uint64_t n = u64();
    FSDP_CHECK(n <= (in.size() - at) / item_bytes, "fsdp::checkpoint: the manifest part rank ", rank, " sent counts ",
               n, " items where at most ", (in.size() - at) / item_bytes,
               " fit: it was not made by this build of the library (every rank must run the same build).");
    return n;
  }
  std::string str() {
    const uint64_t n = count(1);
    std::string s = in.substr(at, n);
    at += n;
    return s;
  }
  std::vector<int64_t> shape() {
    std::vector<int64_t> v(count(sizeof(int64_t)));
    for (auto& x : v) x = i64();
    return v;
  }
  // A list of records of at least `record_bytes` each.
  template <typename Record>
  void list(std::vector<Record>& records, uint64_t record_bytes) {
    records.resize(count(record_bytes));
    for (Record& r : records) get(r);
  }
  void get(TensorMeta& t) {
    t.key = str();
    t.kind = str();
    t.dtype = str();
    t.shape = shape();
  }
  void get(std::pair<std::string, int64_t>& step) {
    step.first = str();
    step.second = i64();
  }
  void get(ChunkRecord& c) {
    c.tensor = str();
    c.row_begin = i64();
    c.row_end = i64();
    c.inner.offsets = shape();
    c.inner.lengths = shape();
    c.begin = u64();
    c.end = u64();
    c.block_bytes = u64();
    c.crc32c.resize(count(sizeof(uint32_t)));
    std::memcpy(c.crc32c.data(), in.data() + at, c.crc32c.size() * sizeof(uint32_t));
    at += c.crc32c.size() * sizeof(uint32_t);
  }
};

}  // namespace

std::string RankPart::encode() const {
  Encoder e;
  e.str(kPartMagic);
  e.str(file);
  e.u64(file_bytes);
  e.list(tensors);
  e.list(steps);
  e.list(chunks);
  return std::move(e.out);
}

RankPart RankPart::decode(const std::string& bytes, int rank) {
  Decoder d{bytes, rank};
  FSDP_CHECK(bytes.size() >= 8 && d.str() == kPartMagic, "fsdp::checkpoint: the manifest part rank ", rank,
             " sent is not one this build of the library makes (every rank must run the same build).");
  RankPart p;
  p.file = d.str();
  p.file_bytes = d.u64();
  d.list(p.tensors, 4 * sizeof(uint64_t));
  d.list(p.steps, 2 * sizeof(uint64_t));
  d.list(p.chunks, 9 * sizeof(uint64_t));
  FSDP_CHECK(d.at == bytes.size(), "fsdp::checkpoint: the manifest part rank ", rank, " sent has ", bytes.size() - d.at,
             " bytes after its end (every rank must run the same build).");
  return p;
}

TensorMeta TensorMeta::from_json(const std::string& key, const ordered_json& j) {
  return {key, j.at("kind").get<std::string>(), j.at("dtype").get<std::string>(),
          j.at("shape").get<std::vector<int64_t>>()};
}

RankPart RankPart::from_json(const ordered_json& j) {
  RankPart p;
  p.file = j.at("file").get<std::string>();
  p.file_bytes = j.at("bytes").get<uint64_t>();
  for (const auto& [key, t] : j.at("tensors").items()) p.tensors.push_back(TensorMeta::from_json(key, t));
  for (const auto& [name, step] : j.at("steps").items()) p.steps.emplace_back(name, step.get<int64_t>());
  for (const auto& c : j.at("chunks")) {
    ChunkRecord r;
    r.tensor = c.at("tensor").get<std::string>();
    const auto rows = c.at("rows").get<std::vector<int64_t>>();
    const auto bytes = c.at("bytes").get<std::vector<uint64_t>>();
    FSDP_CHECK(rows.size() == 2 && bytes.size() == 2, "fsdp::checkpoint: a chunk of tensor '", r.tensor,
               "' in a manifest part has rows or bytes that are not a pair.");
    r.row_begin = rows[0];
    r.row_end = rows[1];
    r.begin = bytes[0];
    r.end = bytes[1];
    r.block_bytes = c.at("block_bytes").get<uint64_t>();
    r.crc32c = c.at("crc32c").get<std::vector<uint32_t>>();
    if (c.contains("inner"))
      r.inner = inner_from_json(nlohmann::json(c["inner"]), "a manifest part's chunk of tensor '" + r.tensor + "'");
    p.chunks.push_back(std::move(r));
  }
  return p;
}

}  // namespace fsdp::checkpoint::detail
