#include "checkpoint/internal/manifest_builder.h"

#include "checkpoint/internal/crc32c.h"
#include "checkpoint/manifest.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/json_text.h"
#include "fsdp_version.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <unordered_map>

namespace fsdp::checkpoint::detail {
namespace {

using fsdp::detail::append_json_array;
using fsdp::detail::append_json_number;
using fsdp::detail::append_json_string;

constexpr std::string_view kPartMagic = "fsdp-manifest-part-2";
constexpr std::string_view kSealKey = ",\n \"manifest_crc32c\": ";

// RankPart's bytes: fixed-width integers in the machine's order, strings and arrays after their
// length.
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
};

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
};

}  // namespace

InnerBox inner_from_json(const nlohmann::json& j, const std::string& what) {
  InnerBox box;
  FSDP_CHECK(j.is_array(), "fsdp::checkpoint: ", what,
             " has an \"inner\" box that is not a list of [offset, length] "
             "pairs: the manifest is corrupt.");
  for (const auto& pair : j) {
    FSDP_CHECK(pair.is_array() && pair.size() == 2 && pair[0].is_number_integer() && pair[1].is_number_integer(),
               "fsdp::checkpoint: ", what, " has an \"inner\" box entry ", pair.dump(),
               " that is not an [offset, length] pair of integers: the manifest is corrupt.");
    box.offsets.push_back(pair[0].get<int64_t>());
    box.lengths.push_back(pair[1].get<int64_t>());
  }
  return box;
}

std::string inner_text(const InnerBox& inner) {
  if (inner.whole()) return "whole width";
  std::string out = "[";
  for (size_t d = 0; d < inner.offsets.size(); ++d) {
    out += (d ? ", " : "") + std::to_string(inner.offsets[d]) + ":" +
           std::to_string(inner.offsets[d] + (d < inner.lengths.size() ? inner.lengths[d] : 0));
  }
  return out + "]";
}

std::string coverage_fault(const std::vector<int64_t>& shape, std::vector<ChunkExtent> chunks) {
  int64_t numel = 1;
  for (const int64_t d : shape) numel *= d;
  if (numel == 0) return "";
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const size_t inner_dims = shape.empty() ? 0 : shape.size() - 1;
  static const InnerBox kWhole;
  for (auto& c : chunks) {
    if (c.inner == nullptr) c.inner = &kWhole;
    const InnerBox& b = *c.inner;
    std::string bad;
    if (c.row_begin < 0 || c.row_end <= c.row_begin || c.row_end > rows) {
      bad = "rows outside the tensor's " + std::to_string(rows) + " (or none)";
    } else if (!b.whole() && (b.offsets.size() != inner_dims || b.lengths.size() != inner_dims)) {
      bad = "a box of " + std::to_string(b.offsets.size()) + " dimension(s) where the tensor has " +
            std::to_string(inner_dims) + " after its rows";
    } else {
      for (size_t d = 0; d < b.offsets.size() && bad.empty(); ++d) {
        if (b.offsets[d] < 0 || b.lengths[d] <= 0 || b.offsets[d] + b.lengths[d] > shape[d + 1]) {
          bad = "dimension " + std::to_string(d + 1) + " outside its extent " + std::to_string(shape[d + 1]);
        }
      }
    }
    if (!bad.empty()) {
      return "a chunk (rows " + std::to_string(c.row_begin) + " to " + std::to_string(c.row_end) + ", inner " +
             inner_text(b) + ") lies outside the tensor: " + bad;
    }
  }
  // Per inner box, every row once.
  std::sort(chunks.begin(), chunks.end(), [](const ChunkExtent& a, const ChunkExtent& b) {
    return *a.inner == *b.inner ? a.row_begin < b.row_begin : *a.inner < *b.inner;
  });
  std::vector<const InnerBox*> boxes;
  for (size_t i = 0; i < chunks.size();) {
    const InnerBox& box = *chunks[i].inner;
    int64_t next = 0;
    for (; i < chunks.size() && *chunks[i].inner == box; ++i) {
      if (chunks[i].row_begin != next) break;
      next = chunks[i].row_end;
    }
    if (next != rows) {
      return "its chunks in inner box " + inner_text(box) + " cover rows up to " + std::to_string(next) + " of " +
             std::to_string(rows) + " (rows missing, or written twice)";
    }
    boxes.push_back(&box);
  }
  // The boxes tile the other dimensions: no two overlap, and together they are the whole.
  int64_t inner_numel = 1, covered = 0;
  for (size_t d = 0; d < inner_dims; ++d) inner_numel *= shape[d + 1];
  for (size_t i = 0; i < boxes.size(); ++i) {
    covered += boxes[i]->row_numel(shape);
    for (size_t k = 0; k < i; ++k) {
      bool overlap = true;
      for (size_t d = 0; d < inner_dims && overlap; ++d) {
        const int64_t a0 = boxes[i]->offset(d), a1 = a0 + boxes[i]->length(d, shape);
        const int64_t b0 = boxes[k]->offset(d), b1 = b0 + boxes[k]->length(d, shape);
        overlap = a0 < b1 && b0 < a1;
      }
      if (overlap) return "its inner boxes " + inner_text(*boxes[k]) + " and " + inner_text(*boxes[i]) + " overlap";
    }
  }
  if (covered != inner_numel) {
    return "its inner boxes cover " + std::to_string(covered) + " of the " + std::to_string(inner_numel) +
           " elements of a row";
  }
  return "";
}

std::string RankPart::encode() const {
  Encoder e;
  e.str(kPartMagic);
  e.str(file);
  e.u64(file_bytes);
  e.u64(tensors.size());
  for (const auto& t : tensors) {
    e.str(t.key);
    e.str(t.kind);
    e.str(t.dtype);
    e.shape(t.shape);
  }
  e.u64(steps.size());
  for (const auto& [name, step] : steps) {
    e.str(name);
    e.i64(step);
  }
  e.u64(chunks.size());
  for (const auto& c : chunks) {
    e.str(c.tensor);
    e.i64(c.row_begin);
    e.i64(c.row_end);
    e.shape(c.inner.offsets);
    e.shape(c.inner.lengths);
    e.u64(c.begin);
    e.u64(c.end);
    e.u64(c.block_bytes);
    e.u64(c.crc32c.size());
    e.out.append(reinterpret_cast<const char*>(c.crc32c.data()), c.crc32c.size() * sizeof(uint32_t));
  }
  return std::move(e.out);
}

RankPart RankPart::decode(const std::string& bytes, int rank) {
  Decoder d{bytes, rank};
  FSDP_CHECK(bytes.size() >= 8 && d.str() == kPartMagic, "fsdp::checkpoint: the manifest part rank ", rank,
             " sent is not one this build of the library makes (every rank must run the same build).");
  RankPart p;
  p.file = d.str();
  p.file_bytes = d.u64();
  p.tensors.resize(d.count(4 * sizeof(uint64_t)));
  for (auto& t : p.tensors) {
    t.key = d.str();
    t.kind = d.str();
    t.dtype = d.str();
    t.shape = d.shape();
  }
  p.steps.resize(d.count(2 * sizeof(uint64_t)));
  for (auto& [name, step] : p.steps) {
    name = d.str();
    step = d.i64();
  }
  p.chunks.resize(d.count(9 * sizeof(uint64_t)));
  for (auto& c : p.chunks) {
    c.tensor = d.str();
    c.row_begin = d.i64();
    c.row_end = d.i64();
    c.inner.offsets = d.shape();
    c.inner.lengths = d.shape();
    c.begin = d.u64();
    c.end = d.u64();
    c.block_bytes = d.u64();
    c.crc32c.resize(d.count(sizeof(uint32_t)));
    std::memcpy(c.crc32c.data(), bytes.data() + d.at, c.crc32c.size() * sizeof(uint32_t));
    d.at += c.crc32c.size() * sizeof(uint32_t);
  }
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

ordered_json sampler_state_json(const data::SamplerState& s) {
  return {{"sampler", "fsdp::data::DistributedSampler"},
          {"seed", s.seed},
          {"shuffle", s.shuffle},
          {"dataset_size", s.dataset_size},
          {"epoch", s.epoch},
          {"position", s.position},
          {"samples_consumed", s.samples_consumed}};
}

data::SamplerState sampler_state_from_json(const nlohmann::json& j, const std::string& path) {
  data::SamplerState s;
  try {
    s.seed = j.at("seed").get<uint64_t>();
    s.shuffle = j.at("shuffle").get<bool>();
    s.dataset_size = j.at("dataset_size").get<int64_t>();
    s.epoch = j.at("epoch").get<int64_t>();
    s.position = j.at("position").get<int64_t>();
    s.samples_consumed = j.at("samples_consumed").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    FSDP_CHECK(false, "fsdp::checkpoint: '", path, "' has a \"data\" entry that is not a sampler's state (", e.what(),
               "): the manifest is corrupt.");
  }
  FSDP_CHECK(data::possible(s), "fsdp::checkpoint: '", path, "' has a sampler state (", data::to_string(s),
             ") that no sampler can be in: the manifest is corrupt.");
  return s;
}

std::string assemble_manifest(const ManifestHeader& header, const std::vector<TensorMeta>& model_tensors,
                              const std::vector<RankPart>& parts, int64_t& bytes_total) {
  bytes_total = 0;
  // Every tensor in the manifest's order (the model's, then the others as the ranks wrote them),
  // its chunks as (file, chunk); found by key through an index, so that assembly stays linear.
  struct Entry {
    const TensorMeta* meta;
    std::vector<std::pair<size_t, const ChunkRecord*>> chunks;
  };
  std::vector<Entry> tensors;
  std::unordered_map<std::string_view, size_t> index;
  auto add = [&](const TensorMeta& t) {
    if (index.emplace(t.key, tensors.size()).second) tensors.push_back({&t, {}});
  };
  for (const auto& t : model_tensors) add(t);
  std::vector<std::pair<std::string_view, int64_t>> steps;
  std::unordered_map<std::string_view, int64_t> step_of;
  for (size_t r = 0; r < parts.size(); ++r) {
    for (const auto& t : parts[r].tensors) add(t);
    for (const auto& c : parts[r].chunks) {
      const auto it = index.find(c.tensor);
      FSDP_CHECK(it != index.end(), "fsdp::checkpoint: rank ", r, " wrote a chunk of tensor '", c.tensor,
                 "', which neither the model nor that rank's part names.");
      bytes_total += static_cast<int64_t>(c.end - c.begin);
      tensors[it->second].chunks.emplace_back(r, &c);
    }
    for (const auto& [name, s] : parts[r].steps) {
      const auto [it, fresh] = step_of.emplace(name, s);
      FSDP_CHECK(fresh || it->second == s, "the optimizer's step of parameter '", name, "' is ", it->second,
                 " on one rank but ", s, " on rank ", r,
                 ": every rank must step the optimizer the same number of times.");
      if (fresh) steps.emplace_back(name, s);
    }
  }

  std::string out;
  out.reserve(4096 + 160 * tensors.size() + [&] {
    size_t n = 0;
    for (const auto& p : parts) {
      for (const auto& c : p.chunks) n += 100 + 12 * c.crc32c.size();
    }
    return n;
  }());
  auto field = [&](const char* name) {
    out += ",\n ";
    append_json_string(out, name);
    out += ": ";
  };
  out += "{\n \"format\": \"libtorch-fsdp checkpoint\"";
  field("format_version");
  append_json_number(out, kFormatVersion);
  field("library_version");
  append_json_string(out, FSDP_VERSION);
  field("name");
  append_json_string(out, header.name);
  field("step");
  append_json_number(out, header.step);
  field("world_size");
  append_json_number(out, header.world_size);
  field("block_bytes");
  append_json_number(out, header.block_bytes);
  field("strategies");
  out += header.strategies.dump();
  field("metadata");
  out += header.metadata.dump();
  field("optimizer");
  if (header.optimizer.is_null()) {
    out += "null";
  } else {
    ordered_json optimizer = header.optimizer;
    ordered_json& by_name = optimizer["steps"] = ordered_json::object();
    for (const auto& [name, s] : steps) by_name[std::string(name)] = s;
    out += optimizer.dump();
  }
  field("data");
  out += header.data.dump();
  field("files");
  out += "[";
  for (size_t r = 0; r < parts.size(); ++r) {
    out += r == 0 ? "\n  {\"name\": " : ",\n  {\"name\": ";
    append_json_string(out, parts[r].file);
    out += ", \"rank\": ";
    append_json_number(out, r);
    out += ", \"bytes\": ";
    append_json_number(out, parts[r].file_bytes);
    out += "}";
  }
  out += "\n ]";
  field("tensors");
  out += "{";
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto& [meta, chunks] = tensors[i];
    std::sort(chunks.begin(), chunks.end(), [](const auto& a, const auto& b) {
      const ChunkRecord &x = *a.second, &y = *b.second;
      return x.inner == y.inner ? x.row_begin < y.row_begin : x.inner < y.inner;
    });
    // Every element once: an optimizer state that some of its writers lack (a rank that never
    // stepped) leaves rows without a chunk.
    std::vector<ChunkExtent> extents;
    extents.reserve(chunks.size());
    for (const auto& c : chunks) extents.push_back({c.second->row_begin, c.second->row_end, &c.second->inner});
    const auto& shape = meta->shape;
    const std::string fault = coverage_fault(shape, std::move(extents));
    FSDP_CHECK(fault.empty(), "tensor '", meta->key, "' is not written once in all by the ranks: ", fault,
               ". An optimizer state some ranks lack: step the optimizer on every rank before saving; otherwise the "
               "ranks' tensor-parallel parts do not tile the tensor.");
    out += i == 0 ? "\n  " : ",\n  ";
    append_json_string(out, meta->key);
    out += ": {\"kind\": ";
    append_json_string(out, meta->kind);
    out += ", \"dtype\": ";
    append_json_string(out, meta->dtype);
    out += ", \"shape\": ";
    append_json_array(out, shape);
    out += ", \"chunks\": [";
    for (size_t k = 0; k < chunks.size(); ++k) {
      const ChunkRecord& c = *chunks[k].second;
      out += k == 0 ? "\n   {\"rows\": " : ",\n   {\"rows\": ";
      append_json_array(out, std::array<int64_t, 2>{c.row_begin, c.row_end});
      if (!c.inner.whole()) {
        out += ", \"inner\": [";
        for (size_t d = 0; d < c.inner.offsets.size(); ++d) {
          out += d == 0 ? "" : ", ";
          append_json_array(out, std::array<int64_t, 2>{c.inner.offsets[d], c.inner.lengths[d]});
        }
        out += "]";
      }
      out += ", \"file\": ";
      append_json_number(out, chunks[k].first);
      out += ", \"bytes\": ";
      append_json_array(out, std::array<uint64_t, 2>{c.begin, c.end});
      out += ", \"block_bytes\": ";
      append_json_number(out, c.block_bytes);
      out += ", \"crc32c\": ";
      append_json_array(out, c.crc32c);
      out += "}";
    }
    out += chunks.empty() ? "]}" : "\n  ]}";
  }
  out += "\n }";
  return seal_manifest(std::move(out));
}

std::string seal_manifest(std::string open) {
  const uint32_t crc = crc32c(open.data(), open.size());
  open += kSealKey;
  append_json_number(open, crc);
  open += "\n}\n";
  return open;
}

std::string check_manifest_seal(const std::string& text, uint32_t sealed_crc32c) {
  const size_t at = text.rfind(kSealKey);
  if (at == std::string::npos) return "it has no \"manifest_crc32c\" as its last member";
  const uint32_t got = crc32c(text.data(), at);
  if (got == sealed_crc32c) return "";
  char buf[160];
  std::snprintf(buf, sizeof(buf), "its first %zu bytes have CRC32C 0x%08x, but its manifest_crc32c says 0x%08x", at,
                got, sealed_crc32c);
  return buf;
}

}  // namespace fsdp::checkpoint::detail
