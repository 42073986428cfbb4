#include "checkpoint/manifest.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/crc32c.h"
#include "checkpoint/internal/manifest_builder.h"
#include "checkpoint/safetensors.h"
#include "fsdp/internal/check.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iterator>

namespace fsdp::checkpoint {

int64_t first_bad_block(const ManifestChunk& c, uint64_t at, const uint8_t* data, uint64_t n, uint32_t& got) {
  for (uint64_t b = 0; b < n; b += c.block_bytes) {
    const size_t block = (at + b - c.begin) / c.block_bytes;
    got = crc32c(data + b, std::min(c.block_bytes, n - b));
    if (got != c.crc32c.at(block)) return static_cast<int64_t>(block);
  }
  return -1;
}

int64_t InnerBox::row_numel(const std::vector<int64_t>& shape) const {
  int64_t n = 1;
  for (size_t d = 0; d + 1 < shape.size(); ++d) n *= length(d, shape);
  return n;
}

uint64_t ManifestTensor::bytes() const {
  uint64_t n = c10::elementSize(scalar_type_of(dtype, key));
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

Manifest read_manifest(const std::string& dir) {
  Manifest m;
  m.dir = dir;
  const std::string path = dir + "/" + kManifest;
  std::ifstream f(path, std::ios::binary);
  FSDP_CHECK(f, "fsdp::checkpoint: '", dir, "' has no readable ", kManifest,
             ": it is not a committed checkpoint (a save that did not finish leaves none).");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    FSDP_CHECK(false, "fsdp::checkpoint: '", path, "' is not valid JSON (", e.what(), ").");
  }
  try {
    m.format_version = j.at("format_version").get<int>();
    FSDP_CHECK(m.format_version <= kFormatVersion, "fsdp::checkpoint: '", path, "' has format version ",
               m.format_version, ", newer than this library's (", kFormatVersion,
               "): read it with the newer libtorch-fsdp that wrote it.");
    FSDP_CHECK(m.format_version >= 1, "fsdp::checkpoint: '", path, "' has format version ", m.format_version, ".");
    if (m.format_version >= 3) {  // sealed: nothing in it changed since it was written
      const std::string broken =
          detail::check_manifest_seal(text, j.contains("manifest_crc32c") ? j["manifest_crc32c"].get<uint32_t>() : 0);
      FSDP_CHECK(broken.empty(), "fsdp::checkpoint: '", path, "' does not match its own checksum (", broken,
                 "): the manifest is corrupt or was edited, and nothing of it can be trusted. Restore it, or load an "
                 "earlier checkpoint ('fsdp-ckpt verify' checks each).");
    }
    m.library_version = j.at("library_version").get<std::string>();
    m.name = j.at("name").get<std::string>();
    m.step = j.at("step").get<int64_t>();
    m.world_size = j.at("world_size").get<int>();
    m.block_bytes = j.at("block_bytes").get<uint64_t>();
    FSDP_CHECK(m.block_bytes > 0, "fsdp::checkpoint: '", path, "' has block_bytes 0.");
    m.strategies = j.at("strategies").get<std::map<std::string, std::string>>();
    m.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    if (j.contains("optimizer") && !j["optimizer"].is_null()) {
      const auto& o = j["optimizer"];
      m.has_optimizer = true;
      m.optimizer.type = o.at("type").get<std::string>();
      for (const auto& g : o.at("param_groups")) {
        m.optimizer.param_groups.push_back(
            {g.at("options").get<std::map<std::string, double>>(), g.at("params").get<std::vector<std::string>>()});
      }
      for (const auto& [name, step] : o.at("steps").items()) {
        FSDP_CHECK(step.is_number_integer() && step.get<int64_t>() >= 0, "fsdp::checkpoint: '", path,
                   "' gives parameter '", name, "' the optimizer step ", step.dump(),
                   ", not a whole number from 0: the manifest is corrupt.");
        m.optimizer.steps[name] = step.get<int64_t>();
      }
    }
    if (j.contains("data") && !j["data"].is_null()) m.data = detail::sampler_state_from_json(j["data"], path);
    for (const auto& fe : j.at("files")) {
      m.files.push_back({fe.at("name").get<std::string>(), fe.at("rank").get<int>(), fe.at("bytes").get<uint64_t>()});
      FSDP_CHECK(m.files.back().name.find('/') == std::string::npos, "fsdp::checkpoint: '", path,
                 "' names a file outside its directory ('", m.files.back().name, "').");
    }
    FSDP_CHECK(m.world_size >= 1 && m.files.size() == static_cast<size_t>(m.world_size), "fsdp::checkpoint: '", path,
               "' says ", m.world_size, " ranks saved it but lists ", m.files.size(),
               " files: the manifest is corrupt.");
    for (size_t i = 0; i < m.files.size(); ++i) {
      FSDP_CHECK(m.files[i].rank == static_cast<int>(i), "fsdp::checkpoint: '", path, "' lists file ", i, " ('",
                 m.files[i].name, "') as rank ", m.files[i].rank, "'s: the manifest is corrupt.");
    }
    for (const auto& [key, t] : j.at("tensors").items()) {
      ManifestTensor mt;
      mt.key = key;
      mt.kind = t.at("kind").get<std::string>();
      mt.dtype = t.at("dtype").get<std::string>();
      mt.shape = t.at("shape").get<std::vector<int64_t>>();
      const uint64_t element = c10::elementSize(scalar_type_of(mt.dtype, key));
      for (const auto& c : t.at("chunks")) {
        ManifestChunk ch;
        const auto rows = c.at("rows").get<std::vector<int64_t>>();
        const auto bytes = c.at("bytes").get<std::vector<uint64_t>>();
        FSDP_CHECK(rows.size() == 2 && bytes.size() == 2, "fsdp::checkpoint: tensor '", key, "' in '", path,
                   "' has a chunk whose rows or bytes are not a pair.");
        ch.row_begin = rows[0];
        ch.row_end = rows[1];
        if (c.contains("inner")) {
          FSDP_CHECK(m.format_version >= 4, "fsdp::checkpoint: tensor '", key, "' in '", path,
                     "' has a chunk with an \"inner\" box, which format version ", m.format_version,
                     " does not have: the manifest is corrupt.");
          ch.inner = detail::inner_from_json(c["inner"], "tensor '" + key + "' in '" + path + "'");
        }
        ch.file = c.at("file").get<size_t>();
        ch.begin = bytes[0];
        ch.end = bytes[1];
        ch.block_bytes = c.at("block_bytes").get<uint64_t>();
        ch.crc32c = c.at("crc32c").get<std::vector<uint32_t>>();
        mt.chunks.push_back(std::move(ch));
      }
      // The chunks together: every element once (their boxes checked before their sizes).
      std::vector<detail::ChunkExtent> extents;
      extents.reserve(mt.chunks.size());
      for (const auto& ch : mt.chunks) extents.push_back({ch.row_begin, ch.row_end, &ch.inner});
      const std::string fault = detail::coverage_fault(mt.shape, std::move(extents));
      FSDP_CHECK(fault.empty(), "fsdp::checkpoint: tensor '", key, "' (shape ", c10::IntArrayRef(mt.shape), ") in '",
                 path, "': its chunks do not hold it once: ", fault, ". The manifest is corrupt.");
      for (const auto& ch : mt.chunks) {
        const uint64_t row_bytes = static_cast<uint64_t>(ch.inner.row_numel(mt.shape)) * element;
        FSDP_CHECK(ch.file < m.files.size() && ch.end >= ch.begin &&
                       ch.end - ch.begin == static_cast<uint64_t>(ch.row_end - ch.row_begin) * row_bytes &&
                       ch.block_bytes > 0 && ch.block_bytes <= m.block_bytes &&
                       ch.crc32c.size() == (ch.end - ch.begin + ch.block_bytes - 1) / ch.block_bytes,
                   "fsdp::checkpoint: tensor '", key, "' in '", path, "' has a chunk (rows ", ch.row_begin, " to ",
                   ch.row_end, ", inner ", detail::inner_text(ch.inner), ", file ", ch.file, ", bytes ", ch.begin,
                   " to ", ch.end, ", checksum block ", ch.block_bytes,
                   ") whose bytes do not fit its extent, or that names no file: the manifest is corrupt.");
      }
      // Grouped by inner box, each group in row order: what consolidate streams and the reader plans.
      std::sort(mt.chunks.begin(), mt.chunks.end(), [](const ManifestChunk& a, const ManifestChunk& b) {
        return a.inner == b.inner ? a.row_begin < b.row_begin : a.inner < b.inner;
      });
      m.tensors.push_back(std::move(mt));
    }
  } catch (const nlohmann::json::exception& e) {
    FSDP_CHECK(false, "fsdp::checkpoint: '", path, "' is not a checkpoint manifest (", e.what(), ").");
  }
  return m;
}

std::string manifest_from_parts(const std::string& header, const std::vector<std::string>& parts,
                                int64_t& bytes_total) {
  detail::ManifestHeader h;
  std::vector<detail::TensorMeta> tensors;
  std::vector<detail::RankPart> rank_parts;
  try {
    auto j = detail::ordered_json::parse(header);
    h.name = j.at("name").get<std::string>();
    h.step = j.at("step").get<int64_t>();
    h.world_size = j.at("world_size").get<int>();
    h.block_bytes = j.at("block_bytes").get<uint64_t>();
    h.strategies = j.at("strategies");
    h.metadata = j.at("metadata");
    h.optimizer = j.at("optimizer");
    h.data = j.value("data", detail::ordered_json());
    for (const auto& [key, t] : j.at("tensors").items()) tensors.push_back(detail::TensorMeta::from_json(key, t));
  } catch (const nlohmann::json::exception& e) {
    FSDP_CHECK(false, "fsdp::checkpoint: the header of a manifest to assemble is not valid (", e.what(), ").");
  }
  for (size_t r = 0; r < parts.size(); ++r) {
    try {
      rank_parts.push_back(detail::RankPart::from_json(detail::ordered_json::parse(parts[r])));
    } catch (const nlohmann::json::exception& e) {
      FSDP_CHECK(false, "fsdp::checkpoint: the part of rank ", r, " of a manifest to assemble is not valid (", e.what(),
                 ").");
    }
  }
  return detail::assemble_manifest(h, tensors, rank_parts, bytes_total);
}

}  // namespace fsdp::checkpoint
