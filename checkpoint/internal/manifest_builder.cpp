#include "checkpoint/internal/manifest_builder.h"

#include "checkpoint/internal/crc32c.h"
#include "checkpoint/manifest.h"
#include "fsdp/internal/check.h"
#include "fsdp/util/json_text.h"
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

using fsdp::util::append_json_array;
using fsdp::util::append_json_number;
using fsdp::util::append_json_string;

constexpr std::string_view kSealKey = ",\n \"manifest_crc32c\": ";

// A tensor of the manifest, with its chunks as (file, chunk).
struct Entry {
  const TensorMeta* meta;
  std::vector<std::pair<size_t, const ChunkRecord*>> chunks;
};

// The ranks' parts taken together, for the text: every tensor in the manifest's order (the
// model's, then the others as the ranks wrote them) with its chunks, found by key through an
// index so that assembly stays linear, and the optimizer steps the ranks agree on.
struct PartsIndex {
  std::vector<Entry> tensors;
  std::unordered_map<std::string_view, size_t> index;
  std::vector<std::pair<std::string_view, int64_t>> steps;  // in the order first met
  std::unordered_map<std::string_view, int64_t> step_of;

  // A tensor where it is first named: the manifest lists it there.
  void add(const TensorMeta& t) {
    if (index.emplace(t.key, tensors.size()).second) tensors.push_back({&t, {}});
  }

  // Rank r's part: its tensors, then its chunks, each under a tensor named by now, then its
  // steps, each equal to any other rank's of the same parameter.
  void take(size_t r, const RankPart& part, int64_t& bytes_total) {
    for (const auto& t : part.tensors) add(t);
    for (const auto& c : part.chunks) {
      const auto it = index.find(c.tensor);
      FSDP_CHECK(it != index.end(), "fsdp::checkpoint: rank ", r, " wrote a chunk of tensor '", c.tensor,
                 "', which neither the model nor that rank's part names.");
      bytes_total += static_cast<int64_t>(c.end - c.begin);
      tensors[it->second].chunks.emplace_back(r, &c);
    }
    for (const auto& [name, s] : part.steps) {
      const auto [it, fresh] = step_of.emplace(name, s);
      FSDP_CHECK(fresh || it->second == s, "the optimizer's step of parameter '", name, "' is ", it->second,
                 " on one rank but ", s, " on rank ", r,
                 ": every rank must step the optimizer the same number of times.");
      if (fresh) steps.emplace_back(name, s);
    }
  }
};

// About the room the text takes, reserved at once so that the text is not regrown as it is written.
size_t text_bytes(size_t tensors, const std::vector<RankPart>& parts) {
  size_t n = 4096 + 160 * tensors;
  for (const auto& p : parts) {
    for (const auto& c : p.chunks) n += 100 + 12 * c.crc32c.size();
  }
  return n;
}

// The start of a member after the manifest's first: ",\n \"<name>\": ".
void append_field(std::string& out, const char* name) {
  out += ",\n ";
  append_json_string(out, name);
  out += ": ";
}

// The members before the files: the format, what the header gives, and the optimizer's record
// with the steps the ranks agreed on.
void append_header(std::string& out, const ManifestHeader& header,
                   const std::vector<std::pair<std::string_view, int64_t>>& steps) {
  out += "{\n \"format\": \"libtorch-fsdp checkpoint\"";
  append_field(out, "format_version");
  append_json_number(out, kFormatVersion);
  append_field(out, "library_version");
  append_json_string(out, FSDP_VERSION);
  append_field(out, "name");
  append_json_string(out, header.name);
  append_field(out, "step");
  append_json_number(out, header.step);
  append_field(out, "world_size");
  append_json_number(out, header.world_size);
  append_field(out, "block_bytes");
  append_json_number(out, header.block_bytes);
  append_field(out, "strategies");
  out += header.strategies.dump();
  append_field(out, "metadata");
  out += header.metadata.dump();
  append_field(out, "optimizer");
  if (header.optimizer.is_null()) {
    out += "null";
  } else {
    ordered_json optimizer = header.optimizer;
    ordered_json& by_name = optimizer["steps"] = ordered_json::object();
    for (const auto& [name, s] : steps) by_name[std::string(name)] = s;
    out += optimizer.dump();
  }
  append_field(out, "data");
  out += header.data.dump();
}

// "files": each rank's file, in rank order (a chunk names its file by its place here).
void append_files(std::string& out, const std::vector<RankPart>& parts) {
  append_field(out, "files");
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
}

// Puts a tensor's chunks in the manifest's order (by inner box, then row) and refuses chunks that
// do not hold every element once: an optimizer state that some of its writers lack (a rank that
// never stepped) leaves rows without a chunk.
void sort_and_check_coverage(Entry& entry) {
  auto& chunks = entry.chunks;
  std::sort(chunks.begin(), chunks.end(), [](const auto& a, const auto& b) {
    const ChunkRecord &x = *a.second, &y = *b.second;
    return x.inner == y.inner ? x.row_begin < y.row_begin : x.inner < y.inner;
  });
  std::vector<ChunkExtent> extents;
  extents.reserve(chunks.size());
  for (const auto& c : chunks) extents.push_back({c.second->row_begin, c.second->row_end, &c.second->inner});
  const std::string fault = coverage_fault(entry.meta->shape, std::move(extents));
  FSDP_CHECK(fault.empty(), "tensor '", entry.meta->key, "' is not written once in all by the ranks: ", fault,
             ". An optimizer state some ranks lack: step the optimizer on every rank before saving; otherwise the "
             "ranks' tensor-parallel parts do not tile the tensor.");
}

// One chunk of a tensor's "chunks" (the first when `first`): its rows, inner box, file, bytes and
// checksums.
void append_chunk(std::string& out, const ChunkRecord& c, size_t file, bool first) {
  out += first ? "\n   {\"rows\": " : ",\n   {\"rows\": ";
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
  append_json_number(out, file);
  out += ", \"bytes\": ";
  append_json_array(out, std::array<uint64_t, 2>{c.begin, c.end});
  out += ", \"block_bytes\": ";
  append_json_number(out, c.block_bytes);
  out += ", \"crc32c\": ";
  append_json_array(out, c.crc32c);
  out += "}";
}

// "tensors": each tensor's kind, dtype, shape and chunks, each tensor checked before it is written.
void append_tensors(std::string& out, std::vector<Entry>& tensors) {
  append_field(out, "tensors");
  out += "{";
  for (size_t i = 0; i < tensors.size(); ++i) {
    sort_and_check_coverage(tensors[i]);
    const auto& [meta, chunks] = tensors[i];
    out += i == 0 ? "\n  " : ",\n  ";
    append_json_string(out, meta->key);
    out += ": {\"kind\": ";
    append_json_string(out, meta->kind);
    out += ", \"dtype\": ";
    append_json_string(out, meta->dtype);
    out += ", \"shape\": ";
    append_json_array(out, meta->shape);
    out += ", \"chunks\": [";
    for (size_t k = 0; k < chunks.size(); ++k) append_chunk(out, *chunks[k].second, chunks[k].first, k == 0);
    out += chunks.empty() ? "]}" : "\n  ]}";
  }
  out += "\n }";
}

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
  PartsIndex all;
  for (const auto& t : model_tensors) all.add(t);
  for (size_t r = 0; r < parts.size(); ++r) all.take(r, parts[r], bytes_total);
  std::string out;
  out.reserve(text_bytes(all.tensors.size(), parts));
  append_header(out, header, all.steps);
  append_files(out, parts);
  append_tensors(out, all.tensors);
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
