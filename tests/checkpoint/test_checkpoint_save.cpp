// fsdp::checkpoint::save at 1-4 ranks, every strategy and a mix: the committed directory holds one
// valid safetensors file per rank and a manifest whose chunks cover every row of every parameter
// and buffer exactly once; the bytes they point at equal the full weights bit for bit, their
// checksums hold, and the chunks add up to the model's unique bytes.
#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"
#include "checkpoint/internal/crc32c.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "tests/models.h"
#include "tests/temp_dir.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

namespace fsdp::testing {
namespace {

using nlohmann::json;

/// UnevenMLP with two buffers (one a scalar), which every rank holds whole.
struct BufferedMLPImpl : UnevenMLPImpl<true> {
  BufferedMLPImpl() {
    running = register_buffer("running", torch::arange(5.0) * 0.5);
    count = register_buffer("count", torch::tensor(7, torch::kLong));
  }
  torch::Tensor running, count;
};

struct SaveCase {
  ShardingStrategy strategy;
  int group;
  bool mixed;
};

void check_save(Rank& r, const SaveCase& c, const std::string& root, int64_t step) {
  const std::string label = strategy_case_label(c.strategy, r.world_size, c.group) + (c.mixed ? "_Mixed" : "");
  SCOPED_TRACE(label);
  torch::manual_seed(0);
  auto net = std::make_shared<BufferedMLPImpl>();
  if (c.mixed) net->fc1->set_sharding_strategy(ShardingStrategy::kNoShard);
  auto model = fsdp::fully_shard(net, r.pg, test_options(c.strategy, c.group));
  torch::optim::SGD opt(model->parameters(), 0.1);
  torch::manual_seed(9);
  auto x = torch::randn({kGlobalBatch, 7});
  model(local_rows(x, r.rank, r.world_size)).square().mean().backward();
  opt.step();
  const auto full = model.full_state_dict();

  const uint64_t block = 64;  // small blocks, so that chunks span several
  const auto res = checkpoint::save(
      root, model,
      checkpoint::SaveOptions().step(step).block_bytes(block).metadata({{"case", label}}).rng_states(false));
  EXPECT_EQ(res.path, root + "/" + checkpoint::step_name(step));
  EXPECT_EQ(checkpoint::latest_checkpoint(root), res.path);

  std::ifstream f(res.path + "/" + checkpoint::kManifest);
  const json m = json::parse(f);
  EXPECT_EQ(m["format_version"], fsdp::checkpoint::kFormatVersion);
  EXPECT_EQ(m["world_size"], r.world_size);
  EXPECT_EQ(m["step"], step);
  EXPECT_EQ(m["metadata"]["case"], label);
  ASSERT_EQ(m["files"].size(), static_cast<size_t>(r.world_size));
  std::vector<std::string> files;
  for (const auto& fe : m["files"]) {
    files.push_back(res.path + "/" + fe["name"].get<std::string>());
    const auto header = checkpoint::read_safetensors_header(files.back());
    EXPECT_EQ(header.size, fe["bytes"].get<uint64_t>()) << files.back();
    EXPECT_EQ(header.metadata.at("format"), "pt");
  }

  ASSERT_EQ(m["tensors"].size(), full.size());
  int64_t unique = 0, chunk_bytes = 0;
  std::vector<int64_t> per_file(files.size(), 0);
  for (const auto& kv : full) {
    const at::Tensor& want = kv.value();
    const std::string key = "model/" + kv.key();
    ASSERT_TRUE(m["tensors"].contains(key)) << key;
    const json& t = m["tensors"][key];
    EXPECT_EQ(t["dtype"], checkpoint::safetensors_dtype(want.scalar_type())) << key;
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), want.sizes().vec()) << key;
    const int64_t rows = want.dim() == 0 ? 1 : want.size(0);
    const int64_t row_bytes = want.dim() == 0 ? want.element_size() : want.numel() / rows * want.element_size();
    unique += want.numel() * want.element_size();
    int64_t next = 0;  // chunks in row order, back to back: every row once
    for (const json& ch : t["chunks"]) {
      const auto rr = ch["rows"].get<std::vector<int64_t>>();
      const auto bytes = ch["bytes"].get<std::vector<uint64_t>>();
      ASSERT_EQ(rr[0], next) << key;
      ASSERT_GT(rr[1], rr[0]) << key;
      next = rr[1];
      const int64_t n = static_cast<int64_t>(bytes[1] - bytes[0]);
      ASSERT_EQ(n, (rr[1] - rr[0]) * row_bytes) << key;
      chunk_bytes += n;
      per_file[ch["file"].get<size_t>()] += n;
      std::vector<uint8_t> got(n);
      checkpoint::read_bytes(files[ch["file"].get<size_t>()], bytes[0], n, got.data());
      const at::Tensor rows_want = (want.dim() == 0 ? want : want.narrow(0, rr[0], rr[1] - rr[0])).contiguous();
      EXPECT_EQ(std::memcmp(got.data(), rows_want.data_ptr(), n), 0) << key << " rows " << rr[0] << "-" << rr[1];
      const auto crcs = ch["crc32c"].get<std::vector<uint32_t>>();
      // Chunks here are small: their blocks are the save's block_bytes (checksum_block).
      ASSERT_EQ(ch["block_bytes"].get<int64_t>(), block) << key;
      ASSERT_EQ(crcs.size(), static_cast<size_t>((n + block - 1) / block)) << key;
      for (size_t b = 0; b < crcs.size(); ++b) {
        EXPECT_EQ(crcs[b], checkpoint::crc32c(got.data() + b * block, std::min<int64_t>(block, n - b * block))) << key;
      }
    }
    EXPECT_EQ(next, rows) << key << ": rows not all written";
  }
  EXPECT_EQ(chunk_bytes, unique) << "each unique byte once";
  if (r.rank == 0) {
    const double mean = static_cast<double>(unique) / r.world_size;
    std::cout << label << ": " << unique << " unique bytes; per rank";
    for (int64_t b : per_file) std::cout << " " << b;
    std::cout << "; max/mean " << *std::max_element(per_file.begin(), per_file.end()) / mean << std::endl;
    EXPECT_EQ(res.bytes_total, unique);
  }
}

void check_all(Rank& r) {
  const std::string root = shared_dir() + "/ckpts";
  const int W = r.world_size;
  std::vector<SaveCase> cases = {
      {ShardingStrategy::kFullShard, 0, false},           {ShardingStrategy::kShardGradOp, 0, false},
      {ShardingStrategy::kShardOptimizerState, 0, false}, {ShardingStrategy::kNoShard, 0, false},
      {ShardingStrategy::kHybridShard, 1, false},         {ShardingStrategy::kFullShard, 0, true}};
  if (W == 4) cases.push_back({ShardingStrategy::kHybridShard, 2, false});
  for (size_t i = 0; i < cases.size(); ++i) check_save(r, cases[i], root, static_cast<int64_t>(i + 1));

  // A save that fails on one rank (rank 0 finds the name is the latest checkpoint's) fails on
  // every rank, each saying where, and leaves the latest checkpoint as it was.
  const std::string latest = checkpoint::latest_checkpoint(root);
  const std::string latest_name = latest.substr(root.size() + 1);
  auto model = fsdp::fully_shard(std::make_shared<BufferedMLPImpl>(), r.pg, test_options());
  const std::string msg = error_of([&] { checkpoint::save(root, model, checkpoint::SaveOptions().name(latest_name)); });
  const std::string where = "fsdp::checkpoint::save (rank " + std::to_string(r.rank) + " of " + std::to_string(W) +
                            ", '" + latest + "'): creating the staging directory failed ";
  EXPECT_NE(msg.find(where + (r.rank == 0 ? "on this rank: "
                                          : "on another rank: rank 0 (its error says why); nothing was committed.")),
            std::string::npos)
      << msg;
  if (r.rank == 0)
    EXPECT_NE(msg.find("exists already and is the latest checkpoint; a save never writes into it"), std::string::npos)
        << msg;
  EXPECT_EQ(checkpoint::latest_checkpoint(root), latest);
  // The harness removes only the files of its directory: the checkpoint tree goes here.
  auto t = torch::zeros({1});
  all_reduce_sum(r, t);
  if (r.rank == 0) ASSERT_TRUE(remove_tree(root));
}

TEST(CheckpointSave, EveryRowOnceBitExactAtOneRank) {
  run_ranks(1, check_all);
}
TEST(CheckpointSave, EveryRowOnceBitExactAtTwoRanks) {
  run_ranks(2, check_all);
}
TEST(CheckpointSave, EveryRowOnceBitExactAtThreeRanks) {
  run_ranks(3, check_all);
}
TEST(CheckpointSave, EveryRowOnceBitExactAtFourRanks) {
  run_ranks(4, check_all);
}

}  // namespace
}  // namespace fsdp::testing
