// fsdp::checkpoint::consolidate (fsdp-ckpt consolidate): a checkpoint saved at 2 ranks (a mix of
// strategies, AdamW) becomes one model.safetensors, or Hugging Face-style shards with an index and
// the optimizer's state, each tensor equal to the model's full weights bit for bit; Python's
// safetensors loads both forms, and tools/read_checkpoint.py reads the sharded checkpoint itself;
// the consolidated files load back into models sharded another way, at 2, 3 and 1 ranks
// (load_safetensors).
#include "checkpoint/consolidate.h"
#include "tests/checkpoint_helpers.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>

namespace fsdp::testing {
namespace {

void check_consolidate(Rank& r) {
  const std::string root = root_dir() + "/ckpts";
  auto model = wrap({"mixed", ShardingStrategy::kFullShard, 0, true}, r, 7);
  auto opt = make_opt(Opt::kAdamW, model);
  train_step(model, *opt, r, 0);
  const auto res = checkpoint::save(root, model, *opt, checkpoint::SaveOptions().step(1));
  const auto full = model.full_state_dict();
  const std::string single = root_dir() + "/single", sharded = root_dir() + "/sharded";
  checkpoint::ConsolidateResult one;
  if (r.rank == 0) one = checkpoint::consolidate(root, single);
  auto t = torch::zeros({1});
  all_reduce_sum(r, t);
  // The round trip: the consolidated file loads into a model sharded another way, bit for bit.
  auto other = wrap({"zero1", ShardingStrategy::kShardOptimizerState, 0, false}, r, 99);
  checkpoint::load_safetensors(single + "/model.safetensors", other);
  expect_bit_exact(other.full_state_dict(), full, "consolidated, loaded as ZeRO-1");
  if (r.rank != 0) return;

  ASSERT_EQ(one.files, std::vector<std::string>{single + "/model.safetensors"});
  const auto rec = checkpoint::read_safetensors_header(one.files[0]);
  ASSERT_EQ(rec.tensors.size(), full.size());
  uint64_t bytes = 0;
  for (const auto& t : rec.tensors) {
    const at::Tensor* want = full.find(t.name);
    ASSERT_NE(want, nullptr) << t.name;
    EXPECT_TRUE(checkpoint::read_tensor(one.files[0], t).equal(*want)) << t.name;
    bytes += t.end - t.begin;
  }
  EXPECT_EQ(one.tensor_bytes, bytes);

  // Files of at most 200 bytes of data (a larger tensor alone), with the index and the optimizer.
  const auto many =
      checkpoint::consolidate(root, sharded, checkpoint::ConsolidateOptions().max_shard_bytes(200).optimizer(true));
  EXPECT_GT(many.files.size(), 4u);
  std::ifstream index_file(sharded + "/model.safetensors.index.json");
  const auto index = nlohmann::json::parse(index_file);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), bytes);
  EXPECT_EQ(index["weight_map"].size(), full.size());
  for (const auto& [name, file] : index["weight_map"].items()) {
    const auto part = checkpoint::read_safetensors_header(sharded + "/" + file.get<std::string>());
    int found = 0;
    for (const auto& t : part.tensors) {
      if (t.name != name) continue;
      ++found;
      EXPECT_TRUE(checkpoint::read_tensor(part.path, t).equal(*full.find(name))) << name;
    }
    EXPECT_EQ(found, 1) << name << " in " << file;
    if (part.tensors.size() > 1) EXPECT_LE(part.size - part.data_start, 200u) << part.path;
  }

  // Refused: an existing directory; a corrupt checkpoint (and nothing is left behind).
  std::string msg = error_of([&] { checkpoint::consolidate(root, single); });
  EXPECT_NE(msg.find("exists; give a new directory"), std::string::npos) << msg;
  const std::string bad = shared_dir() + "/bad", out = shared_dir() + "/out";
  copy_checkpoint(res.path, bad);
  const auto m = checkpoint::read_manifest(bad);
  flip_byte(bad + "/" + m.files[m.tensors[0].chunks[0].file].name, m.tensors[0].chunks[0].begin);
  msg = error_of([&] { checkpoint::consolidate(bad, out); });
  EXPECT_NE(msg.find("tensor '" + m.tensors[0].key + "' rows"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not match the manifest: the file is corrupt"), std::string::npos) << msg;
  struct stat st {};
  EXPECT_NE(::stat(out.c_str(), &st), 0) << "no output after a failure";
  msg = error_of([&] { checkpoint::consolidate(root, out, checkpoint::ConsolidateOptions().optimizer(true)); });
  EXPECT_EQ(msg, "");  // an optimizer was saved: no error

#ifdef FSDP_PYTHON
  // Python: both forms with safetensors.torch.load_file, and the sharded checkpoint itself.
  expect_python_reads(full, root, single, sharded);
#endif
}

// The round trip at other world sizes: both consolidated forms (one file; shards with an index)
// load into models sharded over 3 and 1 ranks, each equal bit for bit to the checkpoint itself
// (loaded whole into a plain module).
void load_consolidated_elsewhere(Rank& r) {
  PlainMLPImpl plain;
  checkpoint::load(root_dir() + "/ckpts", plain);
  const auto want = state_of(plain);
  for (const char* form : {"/single/model.safetensors", "/sharded/model.safetensors.index.json"}) {
    const Case c = r.world_size == 3 ? Case{"full", ShardingStrategy::kFullShard, 0, false}
                                     : Case{"mixed", ShardingStrategy::kShardGradOp, 0, true};
    auto model = wrap(c, r, 55);
    const auto res = checkpoint::load_safetensors(root_dir() + form, model);
    expect_bit_exact(model.full_state_dict(), want,
                     std::string(form) + " at " + std::to_string(r.world_size) + " ranks");
    EXPECT_EQ(res.bytes_read, res.bytes_needed) << form;
  }
}

TEST(CheckpointConsolidate, OneFileOrHuggingFaceShardsEqualTheModelAndLoadInPython) {
  CheckpointRoot root;
  run_ranks(2, check_consolidate, root.options);
  run_ranks(3, load_consolidated_elsewhere, root.options);
  run_ranks(1, load_consolidated_elsewhere, root.options);
}

}  // namespace
}  // namespace fsdp::testing
