#include "checkpoint/internal/manifest_builder.h"

#include "checkpoint/manifest.h"
#include "fsdp/internal/check.h"
#include "fsdp_version.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>

namespace fsdp::checkpoint::detail {

std::string RankPart::dump(int rank) const {
  return ordered_json{{"rank", rank},       {"file", file},   {"bytes", file_bytes},
                      {"tensors", tensors}, {"steps", steps}, {"chunks", chunks}}
      .dump();
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

std::string assemble_manifest(const ManifestHeader& header, ordered_json model_tensors,
                              const std::vector<std::string>& parts, int64_t& bytes_total) {
  using json = ordered_json;
  bytes_total = 0;
  json tensors = std::move(model_tensors);
  // ordered_json finds keys by a linear scan: an index keeps the assembly linear in chunks.
  std::unordered_map<std::string, json*> index;
  for (auto& [key, t] : tensors.items()) {
    t["chunks"] = json::array();
    index[key] = &t;
  }
  json files = json::array();
  json steps = json::object();
  std::unordered_map<std::string, int64_t> step_of;
  for (size_t r = 0; r < parts.size(); ++r) {
    json part = json::parse(parts[r]);
    files.push_back({{"name", part["file"]}, {"rank", r}, {"bytes", part["bytes"]}});
    for (auto& [key, t] : part["tensors"].items()) {  // optimizer and generator states, as written
      if (index.count(key) != 0) continue;
      json meta = t;
      meta["chunks"] = json::array();
      tensors[key] = std::move(meta);
      index[key] = &tensors[key];
      // Adding to `tensors` may move its elements: the index is rebuilt (rare: once per new key
      // kind per rank at most, and only for tensors the model does not have).
      for (auto& [k, v] : tensors.items()) index[k] = &v;
    }
    for (auto& c : part["chunks"]) {
      const auto& bytes = c["bytes"];
      bytes_total += bytes[1].get<int64_t>() - bytes[0].get<int64_t>();
      json& chunks = (*index.at(c["tensor"].get<std::string>()))["chunks"];
      chunks.push_back({{"rows", std::move(c["rows"])},
                        {"file", r},
                        {"bytes", bytes},
                        {"block_bytes", std::move(c["block_bytes"])},
                        {"crc32c", std::move(c["crc32c"])}});
    }
    for (const auto& [name, step] : part["steps"].items()) {
      const int64_t s = step.get<int64_t>();
      const auto [it, fresh] = step_of.emplace(name, s);
      FSDP_CHECK(fresh || it->second == s, "the optimizer's step of parameter '", name, "' is ", it->second,
                 " on one rank but ", s, " on rank ", r,
                 ": every rank must step the optimizer the same number of times.");
      if (fresh) steps[name] = s;
    }
  }
  for (auto& [key, t] : tensors.items()) {
    auto& chunks = t["chunks"];
    std::sort(chunks.begin(), chunks.end(),
              [](const json& a, const json& b) { return a["rows"][0].get<int64_t>() < b["rows"][0].get<int64_t>(); });
    // Every row once: an optimizer state that some of its writers lack (a rank that never
    // stepped) leaves rows without a chunk.
    const auto shape = t["shape"].get<std::vector<int64_t>>();
    int64_t next = 0;
    for (const auto& c : chunks) {
      if (c["rows"][0].get<int64_t>() != next) break;
      next = c["rows"][1].get<int64_t>();
    }
    const bool empty = std::find(shape.begin(), shape.end(), 0) != shape.end();
    FSDP_CHECK(empty || next == (shape.empty() ? 1 : shape[0]), "tensor '", key, "' has rows ", next,
               " and on without a writer: the ranks that hold them have no such state. Step the optimizer on "
               "every rank before saving.");
  }
  json optimizer = header.optimizer;
  if (!optimizer.is_null()) optimizer["steps"] = std::move(steps);
  const json manifest = {{"format", "libtorch-fsdp checkpoint"},
                         {"format_version", kFormatVersion},
                         {"library_version", FSDP_VERSION},
                         {"name", header.name},
                         {"step", header.step},
                         {"world_size", header.world_size},
                         {"block_bytes", header.block_bytes},
                         {"strategies", header.strategies},
                         {"metadata", header.metadata},
                         {"optimizer", optimizer},
                         {"data", header.data},
                         {"files", files},
                         {"tensors", tensors}};
  return manifest.dump(1);
}

}  // namespace fsdp::checkpoint::detail
