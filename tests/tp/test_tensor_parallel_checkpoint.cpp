// Checkpoints of tensor-parallel models (format version 4: chunks that hold part of a tensor's
// width). TPNet trained 3 steps on FSDP 2 x TP 2 with AdamW and clipping, saved (synchronously and
// by an AsyncSaver), then loaded on other meshes: FSDP 2 x TP 2 again, FSDP 3 (ranks 0-2), TP 4 and
// one rank, and into the plain net. Every parameter bit-exact, every element written once (bytes
// from shapes), training continuing as the uninterrupted one-process run (1e-5 relative), the read
// amplification of a load at another TP size within the ratio of the TP sizes; consolidation,
// Python's reader and fsdp-ckpt verify/inspect read the parts; corrupt inner boxes are refused
// with their own messages.
#include "checkpoint/checkpoint.h"
#include "checkpoint/consolidate.h"
#include "fsdp/fsdp.h"
#include "tests/checkpoint_helpers.h"
#include "tests/harness.h"
#include "tests/tp/tp_models.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>

namespace fsdp::testing {
namespace {

constexpr int kSaved = 3;  // steps before the save

// Every parameter of `model` (this rank's tensor-parallel part, gathered over its data-parallel
// ranks) equals the plain net's, bit for bit.
void expect_parts_of(FSDPModule& model, PlainNet& plain, const std::string& label) {
  const auto full = model.full_state_dict();
  const auto ref = plain->named_parameters();
  for (const ShardSpec& s : model.shard_specs()) {
    const torch::Tensor r = part_of(ref[s.name], s);
    EXPECT_TRUE(full[s.name].sizes() == r.sizes() && full[s.name].equal(r)) << label << ": " << s.name;
  }
}

// Loads `path` into a fresh model (other weights) and AdamW over `mesh`, checks the weights against
// the plain net loaded from the same checkpoint and trains the remaining steps against `want`.
// Returns the load's bytes read over bytes needed, over all ranks.
double continue_on(const DeviceMesh& mesh, const std::string& path, PlainNet& plain, const Trace& want) {
  const std::string label = "loaded on mesh " + mesh.shape_text() + " at " + mesh.coordinates_text();
  tp::Group blocks(mesh), vocab(mesh);
  torch::manual_seed(1234);
  auto model = fully_shard(TPNet(blocks, vocab), mesh);
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
  const auto res = checkpoint::load(path, model, opt);
  EXPECT_EQ(res.step, kSaved) << label;
  EXPECT_EQ(res.saved_world_size, 4) << label;
  expect_parts_of(model, plain, label);
  for (int s = kSaved; s < kSteps; ++s) {
    const double loss = tp_step(model, opt, mesh, s).first;
    EXPECT_NEAR(loss, want.losses[s], 1e-5 * want.losses[s]) << label << ", step " << s;
  }
  const double ratio = static_cast<double>(res.bytes_read_total) / static_cast<double>(res.bytes_needed_total);
  if (mesh.rank() == 0) {
    std::printf("[reshard] (dp_shard 2, tp 2) -> %s: read %lld bytes for %lld needed over all ranks: x%.4f\n",
                mesh.shape_text().c_str(), static_cast<long long>(res.bytes_read_total),
                static_cast<long long>(res.bytes_needed_total), ratio);
  }
  return ratio;
}

void save_and_reshard(Rank& r) {
  const std::string root = shared_dir() + "/ckpt", path = root + "/tp2dp2";
  torch::manual_seed(3);
  PlainNet reference;
  const Trace want = train_plain(reference);  // kSteps steps in one process
  int64_t psi = 0;
  for (const auto& p : reference->parameters()) psi += p.numel();

  const DeviceMesh mesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}});
  tp::Group blocks(mesh), vocab(mesh);
  torch::manual_seed(3);
  auto model = fully_shard(TPNet(blocks, vocab), mesh);
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < kSaved; ++s) {
    const double loss = tp_step(model, opt, mesh, s).first;
    ASSERT_NEAR(loss, want.losses[s], 1e-5 * want.losses[s]) << "step " << s;
  }
  const auto saved = checkpoint::save(root, model, opt, checkpoint::SaveOptions().name("tp2dp2").step(kSaved));
  // Every element once over the 4 ranks: the parameters and AdamW's two moments (fp32), whatever
  // the tensor-parallel ranks hold alike, and each rank's generator states.
  if (r.rank == 0) EXPECT_EQ(saved.bytes_total, 3 * 4 * psi + 4 * rng_bytes());  // rank 0 assembles
  checkpoint::AsyncSaver saver(model);
  saver.save(root, opt, checkpoint::SaveOptions().name("async").step(kSaved));
  saver.wait();

  // The plain net from the checkpoint (every rank reads it whole) holds the model's parts.
  torch::manual_seed(99);
  PlainNet plain;
  checkpoint::load(path, *plain);
  expect_parts_of(model, plain, "the saved model");
  for (int s = kSaved; s < kSteps; ++s) {  // uninterrupted, for comparison
    const double loss = tp_step(model, opt, mesh, s).first;
    EXPECT_NEAR(loss, want.losses[s], 1e-5 * want.losses[s]) << "uninterrupted, step " << s;
  }

  if (r.rank == 0) {
    // The background save wrote the same tensors; read whole (each chunk into its box), they are
    // the plain net's.
    const auto sync = read_all(path), async = read_all(root + "/async");
    for (const auto& [key, t] : sync) {
      if (key.rfind("rng/", 0) == 0) continue;
      EXPECT_TRUE(async.at(key).equal(t)) << key;
    }
    for (const auto& kv : plain->named_parameters()) EXPECT_TRUE(sync.at("model/" + kv.key()).equal(kv.value()));
    // Consolidated (one file; shards with the optimizer), and through Python's reader.
    const std::string single = shared_dir() + "/single", sharded = shared_dir() + "/sharded";
    const auto one = checkpoint::consolidate(path, single);
    checkpoint::consolidate(path, sharded, checkpoint::ConsolidateOptions().max_shard_bytes(2048).optimizer(true));
    const auto rec = checkpoint::read_safetensors_header(one.files[0]);
    for (const auto& t : rec.tensors) {
      EXPECT_TRUE(checkpoint::read_tensor(one.files[0], t).equal(plain->named_parameters()[t.name])) << t.name;
    }
#ifdef FSDP_PYTHON
    expect_python_reads(plain->named_parameters(), path, single, sharded);
#endif
    // The command-line tool: every block verified; the row-parallel weights listed in 2 parts.
    EXPECT_EQ(run_logged(std::string(FSDP_CKPT_TOOL) + " verify " + path).first, 0);
    const auto [rc, listing] = run_logged(std::string(FSDP_CKPT_TOOL) + " inspect " + path);
    EXPECT_EQ(rc, 0) << listing;
    for (const char* key : {"model/h0.down.weight", "model/h1.down.weight", "optim/h0.down.weight/exp_avg"}) {
      const size_t at = listing.find(key);
      ASSERT_NE(at, std::string::npos) << listing;
      EXPECT_NE(listing.substr(at, listing.find('\n', at) - at).find("in 2 parts of its width"), std::string::npos)
          << listing;
    }
    // Damaged copies: a box outside the tensor, boxes that overlap, a box in a format-3 manifest.
    auto edit_box = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
      copy_checkpoint(path, root + "/" + name);
      edit_manifest(root + "/" + name, [&](nlohmann::json& j) { edit(j["tensors"]["model/h0.down.weight"]); });
    };
    edit_box("outside", [](nlohmann::json& t) { t["chunks"][0]["inner"][0][0] = 24; });  // [24, 40) of 32
    edit_box("overlap", [](nlohmann::json& t) {
      for (auto& c : t["chunks"]) {
        if (c["inner"][0][0] == 16) c["inner"][0] = {8, 24};
      }
    });
    copy_checkpoint(path, root + "/v3");
    edit_manifest(root + "/v3", [](nlohmann::json& j) { j["format_version"] = 3; });
  }
  at::Tensor sync = at::zeros({1});
  all_reduce_sum(r, sync);  // rank 0's copies are written
  for (const auto& [name, expect] : std::vector<std::pair<std::string, std::string>>{
           {"outside", "lies outside the tensor: dimension 1 outside its extent 32"},
           {"overlap", "its inner boxes [0:16] and [8:32] overlap"},
           {"v3", "has a chunk with an \"inner\" box, which format version 3 does not have"}}) {
    const auto before = model.full_state_dict();
    const std::string dir = root + "/" + name;  // (a lambda may not capture a structured binding)
    const std::string msg = error_of([&] { checkpoint::load(dir, model, opt); });
    EXPECT_NE(msg.find(expect), std::string::npos) << name << ": " << msg;
    EXPECT_NE(msg.find("manifest is corrupt"), std::string::npos) << name << ": " << msg;
    expect_bit_exact(model.full_state_dict(), before, name);
  }

  // Other meshes: a change of data-parallel size at TP 1, TP 4 (each dimension-1 chunk row read
  // whole where half of it is needed: at most the ratio of the TP sizes), one rank. This model's
  // chunks are under the smallest checksum block (4 KiB), so a partial read takes whole chunks:
  // what a load reads beyond its need at real sizes is measured by benchmarks/tp/llama_bench.py.
  // Loads at the saving mesh and on one rank read exactly what they need.
  if (r.rank < 3) {
    const DeviceMesh three(new_subgroup(r.pg, {0, 1, 2}, "three"), {{kShardDim, 3}});
    EXPECT_LE(continue_on(three, path, plain, want), 2.0);
  }
  EXPECT_LE(continue_on(DeviceMesh(r.pg, {{kTensorDim, 4}}), path, plain, want), 4.0 / 2.0);
  if (r.rank == 0) {
    EXPECT_EQ(continue_on(DeviceMesh(new_subgroup(r.pg, {0}, "one"), {{kShardDim, 1}}), path, plain, want), 1.0);
  }
  EXPECT_EQ(continue_on(mesh, root + "/async", plain, want), 1.0);

  // A parameter held alike over the TP ranks (the final norm's weight) changed on one of them: the
  // save refuses on every rank, naming it, before a file is written.
  {
    torch::NoGradGuard no_grad;
    for (const auto& s : model.shard_specs()) {
      if (s.name == "lnf.weight" && r.rank == 1) s.local.add_(1.0);
    }
  }
  const std::string msg =
      error_of([&] { checkpoint::save(root, model, opt, checkpoint::SaveOptions().name("mixed")); });
  EXPECT_NE(msg.find("parameter 'lnf.weight' differs between global ranks"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nothing was committed"), std::string::npos) << msg;
  struct stat st {};
  EXPECT_NE(::stat((root + "/mixed").c_str(), &st), 0) << "nothing committed";
}

TEST(TensorParallelFSDP, CheckpointsLoadOnAnyMesh) {
  RunOptions o;
  o.timeout = std::chrono::seconds(240);
  run_ranks(4, save_and_reshard, o);
}

}  // namespace
}  // namespace fsdp::testing
