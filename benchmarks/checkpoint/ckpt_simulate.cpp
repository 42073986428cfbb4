// ckpt_bench simulate: rank 0's assembly of the manifest from the parts of N ranks of a fully
// sharded GPT with AdamW (parts built from shapes, the save plan and the checksum blocks, as the
// ranks would send them: fsdp::checkpoint::manifest_from_parts), and a reader's read_manifest of
// the result; one JSON line per N, in one process.
#include "benchmarks/checkpoint/ckpt_modes.h"
#include "checkpoint/commit.h"
#include "checkpoint/manifest.h"
#include "checkpoint/plan.h"
#include "checkpoint/safetensors.h"

#include <unistd.h>

#include <fstream>

namespace ckpt {
namespace {

using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// The part fully sharded rank r of N would send for `shapes` with AdamW's two moments and its
// generator state (checkpoint/manifest.h, manifest_from_parts).
std::string simulated_part(const Shapes& shapes, int r, int N) {
  namespace ck = fsdp::checkpoint;
  std::vector<fsdp::ShardSpec> specs;
  for (const auto& [name, shape] : shapes) {
    fsdp::ShardSpec s;
    s.name = name;
    s.global_shape = shape;
    s.layout = fsdp::row_layout(shape, N);
    s.shard_rank = r;
    s.shard_world_size = N;
    s.row_begin = s.layout.begin(r);
    s.row_end = s.layout.end(r);
    specs.push_back(s);
  }
  ordered_json chunks = ordered_json::array(), tensors = ordered_json::object(), steps = ordered_json::object();
  uint64_t at = 4096;  // after the safetensors header
  auto chunk = [&](const std::string& key, int64_t b, int64_t e, uint64_t bytes) {
    const uint64_t block = ck::checksum_block(bytes, uint64_t{1} << 20, 64);
    std::vector<uint32_t> crcs((bytes + block - 1) / block, 0x9E3779B9u);
    chunks.push_back(
        {{"tensor", key}, {"rows", {b, e}}, {"bytes", {at, at + bytes}}, {"block_bytes", block}, {"crc32c", crcs}});
    at += bytes;
  };
  for (const auto& w : ck::plan_writes(specs)) {
    const auto& s = specs[w.spec];
    const auto bytes = static_cast<uint64_t>(w.bytes(s));
    chunk("model/" + s.name, w.row_begin, w.row_end, bytes);
    for (const char* m : {"exp_avg", "exp_avg_sq"}) {
      const std::string key = "optim/" + s.name + "/" + m;
      tensors[key] = {{"kind", "optimizer"}, {"dtype", "F32"}, {"shape", s.global_shape}};
      chunk(key, w.row_begin, w.row_end, bytes);
    }
  }
  for (const auto& s : specs) steps[s.name] = 1;
  const std::string rng = "rng/rank-" + std::to_string(r) + "/cpu";
  tensors[rng] = {{"kind", "rng"}, {"dtype", "U8"}, {"shape", {5056}}};
  chunk(rng, 0, 5056, 5056);
  return ordered_json{{"rank", r},      {"file", "rank-" + std::to_string(r) + ".safetensors"},
                      {"bytes", at},    {"tensors", tensors},
                      {"steps", steps}, {"chunks", chunks}}
      .dump();
}

}  // namespace

int simulate_mode(const Flags& f) {
  namespace ck = fsdp::checkpoint;
  auto plain = gpt::make_gpt<false>(f.model);
  Shapes shapes;
  ordered_json model_tensors = ordered_json::object();
  for (const auto& kv : plain->named_parameters()) {
    shapes.emplace_back(kv.key(), kv.value().sizes().vec());
    model_tensors["model/" + kv.key()] = {{"kind", "parameter"}, {"dtype", "F32"}, {"shape", kv.value().sizes().vec()}};
  }
  char tmpl[] = "/tmp/ckpt-bench-XXXXXX";
  TORCH_CHECK(::mkdtemp(tmpl) != nullptr, "mkdtemp failed");
  const std::string dir = tmpl;
  for (int N : f.ranks) {
    std::vector<std::string> parts;
    size_t part_bytes = 0;
    for (int r = 0; r < N; ++r) {
      parts.push_back(simulated_part(shapes, r, N));
      part_bytes += parts.back().size();
    }
    const std::string header = ordered_json{
        {"name", "simulated"},
        {"step", 0},
        {"world_size", N},
        {"block_bytes", uint64_t{1} << 20},
        {"strategies", ordered_json::object()},
        {"metadata", ordered_json::object()},
        {"optimizer", {{"type", "AdamW"}, {"param_groups", ordered_json::array()}}},
        {"tensors", model_tensors}}.dump();
    int64_t total = 0;
    const auto t0 = Clock::now();
    const std::string text = ck::manifest_from_parts(header, parts, total);
    const double assemble_s = seconds_since(t0);
    std::ofstream(dir + "/" + ck::kManifest) << text;
    const auto t1 = Clock::now();
    const auto m = ck::read_manifest(dir);
    const double read_s = seconds_since(t1);
    size_t chunks = 0;
    for (const auto& t : m.tensors) chunks += t.chunks.size();
    fsdp::programs::print_row({{"mode", "simulate"},
                               {"ranks", N},
                               {"params", shapes.size()},
                               {"tensors", m.tensors.size()},
                               {"chunks", chunks},
                               {"parts_bytes", part_bytes},
                               {"manifest_bytes", text.size()},
                               {"assemble_s", round_to(assemble_s, 4)},
                               {"read_manifest_s", round_to(read_s, 4)},
                               {"assemble_us_per_chunk", round_to(assemble_s * 1e6 / static_cast<double>(chunks), 3)}});
  }
  ::unlink((dir + "/" + ck::kManifest).c_str());
  ::rmdir(dir.c_str());
  return 0;
}

}  // namespace ckpt
