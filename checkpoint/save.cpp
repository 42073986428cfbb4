// fsdp::checkpoint::save: each rank writes its rows into its own file in the staging directory;
// rank 0 gathers each rank's list of chunks (not the data), writes the manifest and commits.
#include "checkpoint/checkpoint.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/collectives.h"
#include "checkpoint/manifest.h"
#include "checkpoint/plan.h"
#include "checkpoint/safetensors.h"
#include "fsdp_version.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>

namespace fsdp::checkpoint {
namespace {

using json = nlohmann::ordered_json;

// A chunk of fewer than this many blocks of block_bytes gets smaller blocks (checksum_block): a
// load on another number of ranks reads at most about 1/64th of a chunk beyond its need at each
// end of what it needs, so that what it reads stays within 1.05 x what it needs.
constexpr uint64_t kMinBlocks = 64;

std::string rank_file(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "rank-%05d.safetensors", rank);
  return buf;
}

// Rows [first, first + n) of a tensor's dim 0 (a scalar is its one row).
at::Tensor rows_of(const at::Tensor& t, int64_t first, int64_t n) {
  return t.dim() == 0 ? t : t.narrow(0, first, n);
}

// What this rank writes: (manifest key, global rows, the rows' tensor); and, into `tensors_meta`
// when given (rank 0), each key's kind, dtype and global shape.
struct Planned {
  std::vector<std::string> keys;
  std::vector<std::pair<int64_t, int64_t>> rows;
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // file entry name -> data
};

Planned plan_model(const FSDPModule& model, json* tensors_meta) {
  Planned p;
  auto add = [&](const std::string& key, int64_t b, int64_t e, const at::Tensor& data) {
    p.keys.push_back(key);
    p.rows.emplace_back(b, e);
    p.tensors.emplace_back(key + "[" + std::to_string(b) + ":" + std::to_string(e) + "]", data);
  };
  const auto specs = model.shard_specs();
  if (tensors_meta != nullptr) {
    for (const auto& s : specs) {
      (*tensors_meta)["model/" + s.name] = {{"kind", "parameter"},
                                            {"dtype", safetensors_dtype(s.dtype)},
                                            {"shape", s.global_shape},
                                            {"chunks", json::array()}};
    }
  }

  for (const auto& w : plan_writes(specs)) {
    const ShardSpec& s = specs[w.spec];
    add("model/" + s.name, w.row_begin, w.row_end, rows_of(s.local.detach(), w.local_row, w.row_end - w.row_begin));
  }
  // Buffers: every rank holds them whole; their rows are split over all ranks like replicas'.
  size_t index = specs.size();
  for (const auto& kv : model.named_buffers()) {
    const at::Tensor& b = kv.value();
    const std::string key = "model/" + kv.key();
    const int64_t rows = b.dim() == 0 ? 1 : b.size(0);
    if (tensors_meta != nullptr)
      (*tensors_meta)[key] = {{"kind", "buffer"},
                              {"dtype", safetensors_dtype(b.scalar_type())},
                              {"shape", b.sizes().vec()},
                              {"chunks", json::array()}};
    const auto [first, last] = replica_part(rows, model.world_size(), model.rank(), index++);
    if (last > first) add(key, first, last, rows_of(b.detach(), first, last - first));
  }
  return p;
}

}  // namespace

SaveResult save(const std::string& root, const FSDPModule& model, const SaveOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& pg = model.process_group();
  const auto timeout = model.options().timeout();
  const int rank = model.rank(), W = model.world_size();
  const std::string name = options.name().empty() ? step_name(options.step()) : options.name();
  const std::string where = "fsdp::checkpoint::save (rank " + std::to_string(rank) + " of " + std::to_string(W) +
                            ", '" + root + "/" + name + "')";
  // Each phase ends with every rank agreeing that it went well: a failure anywhere is every
  // rank's error, and nothing is committed.
  const std::string call = "fsdp::checkpoint::save of '" + root + "/" + name + "'";  // the same on every rank
  auto phase = [&](const char* what, const std::function<void()>& fn) {
    detail::agree(model, call, where, what, "nothing was committed", fn);
  };

  const std::string staging = staging_path(root, name);
  phase("creating the staging directory", [&] {
    if (rank == 0) begin_staging(root, name);
  });

  json tensors_meta = json::object();  // rank 0's: every tensor's dtype, shape and (below) chunks
  std::string part;                    // this rank's chunks, for the manifest
  SaveResult result;
  phase("writing this rank's file", [&] {
    Planned p = plan_model(model, rank == 0 ? &tensors_meta : nullptr);
    const FileRecord file =
        write_safetensors(staging + "/" + rank_file(rank), p.tensors, {{"rank", std::to_string(rank)}},
                          WriteOptions().block_bytes(options.block_bytes()).min_blocks(kMinBlocks));
    for (const auto& t : file.tensors) result.bytes_written += static_cast<int64_t>(t.end - t.begin);
    // This rank's part of the manifest: its chunks, in the file's order.
    json mine = {{"rank", rank}, {"file", rank_file(rank)}, {"bytes", file.size}, {"chunks", json::array()}};
    for (size_t i = 0; i < p.keys.size(); ++i) {
      const auto& t = file.tensors[i];
      mine["chunks"].push_back({{"tensor", p.keys[i]},
                                {"rows", {p.rows[i].first, p.rows[i].second}},
                                {"bytes", {t.begin, t.end}},
                                {"block_bytes", t.block_bytes},
                                {"crc32c", t.crc32c}});
    }
    part = mine.dump();
  });
  const auto parts = detail::gather_to_rank0(pg, part, timeout, "gathering the manifest's parts for " + where);

  phase("writing the manifest and committing", [&] {
    if (rank != 0) return;
    json units = json::object();
    for (const auto& u : model.units()) units[u.name.empty() ? "<root>" : u.name] = to_string(u.strategy);
    json files = json::array();
    for (int r = 0; r < W; ++r) {
      const json mine = json::parse(parts[r]);
      files.push_back({{"name", mine["file"]}, {"rank", r}, {"bytes", mine["bytes"]}});
      for (const auto& c : mine["chunks"]) {
        json chunk = {{"rows", c["rows"]},
                      {"file", r},
                      {"bytes", c["bytes"]},
                      {"block_bytes", c["block_bytes"]},
                      {"crc32c", c["crc32c"]}};
        tensors_meta.at(c["tensor"].get<std::string>())["chunks"].push_back(std::move(chunk));
        result.bytes_total += c["bytes"][1].get<int64_t>() - c["bytes"][0].get<int64_t>();
      }
    }
    for (auto& [key, t] : tensors_meta.items()) {
      auto& chunks = t["chunks"];
      std::sort(chunks.begin(), chunks.end(),
                [](const json& a, const json& b) { return a["rows"][0].get<int64_t>() < b["rows"][0].get<int64_t>(); });
    }
    const json manifest = {{"format", "libtorch-fsdp checkpoint"},
                           {"format_version", kFormatVersion},
                           {"library_version", FSDP_VERSION},
                           {"name", name},
                           {"step", options.step()},
                           {"world_size", W},
                           {"block_bytes", options.block_bytes()},
                           {"strategies", units},
                           {"metadata", options.metadata()},
                           {"files", files},
                           {"tensors", tensors_meta}};
    write_atomically(staging, kManifest, manifest.dump(1));
    commit(root, staging, name);
    keep_last(root, options.keep_last());
  });
  result.path = root + "/" + name;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace fsdp::checkpoint
