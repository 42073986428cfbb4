// fsdp::checkpoint::load's faults: each its own error on every rank (the rank that finds it says
// what, with file and tensor; the others that it failed elsewhere), the model and the optimizer
// left as they were; Python reads each rank's file; misuse (a load inside a step, another model,
// other optimizers, edited manifests) refused with its reason.
#include "tests/checkpoint_helpers.h"
#include "tests/temp_dir.h"

#include <torch/optim/rmsprop.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>

namespace fsdp::testing {
namespace {

struct Fault {
  const char* name;
  std::function<void(const std::string& dir)> make;  // on rank 0, on a copy of the good checkpoint
  // Said by the ranks that find it (the others say it failed on another rank).
  std::string message;
  std::vector<int> found_by;
};

// At 2 ranks: a good checkpoint, then each fault on a copy of it. Every rank's load throws (the
// rank that finds the fault says what, file and tensor; the other says it failed elsewhere) and
// leaves the model bit for bit as it was.
void check_faults(Rank& r) {
  const std::string root = shared_dir() + "/ckpts";
  const Case full{"full", ShardingStrategy::kFullShard, 0, false};
  auto saved = wrap(full, r, 7);
  auto sgd = make_opt(Opt::kSGD, saved);
  train_step(saved, *sgd, r, 0);
  checkpoint::save(root, saved, *sgd, checkpoint::SaveOptions().name("good").step(3));
  checkpoint::save(root, saved, checkpoint::SaveOptions().name("model-only").step(3));
  const std::string good = root + "/good";
  const auto m = checkpoint::read_manifest(good);
  const checkpoint::ManifestTensor* fc1 = nullptr;
  for (const auto& t : m.tensors) {
    if (t.key == "model/fc1.weight") fc1 = &t;
  }
  ASSERT_NE(fc1, nullptr);
  ASSERT_EQ(fc1->chunks.size(), 2u);  // rows 0-6 by rank 0, 7-12 by rank 1: each rank reads its own
  const uint64_t in_rank1s_rows = fc1->chunks[1].begin + 5;
#ifdef FSDP_PYTHON
  {
    // Each rank's file opens with Python's safetensors; what Python loaded (written back by it and
    // read here) equals this rank's C++ shards, bit for bit.
    char file[64];
    std::snprintf(file, sizeof(file), "/rank-%05d.safetensors", r.rank);
    const std::string back = shared_dir() + "/python-" + std::to_string(r.rank) + ".safetensors";
    const std::string cmd = std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                            "/tests/checkpoint/check_safetensors_in_python.py " + good + file + " " + back + " > " +
                            back + ".log 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const auto rec = checkpoint::read_safetensors_header(back);
    int compared = 0;
    for (const auto& s : saved.shard_specs()) {
      for (const auto& t : rec.tensors) {
        const std::string prefix = "model/" + s.name + "[";
        if (t.name.rfind(prefix, 0) != 0) continue;
        const int64_t b = std::stoll(t.name.substr(prefix.size())), e = std::stoll(t.name.substr(t.name.find(':') + 1));
        const at::Tensor rows = s.local.dim() == 0 ? s.local : s.local.narrow(0, b - s.row_begin, e - b);
        EXPECT_TRUE(checkpoint::read_tensor(back, t).equal(rows.detach())) << t.name;
        ++compared;
      }
    }
    EXPECT_GT(compared, 2) << "rank " << r.rank << " wrote rows of several parameters";
  }
#endif
  auto barrier = [&] {
    auto t = torch::zeros({1});
    all_reduce_sum(r, t);
  };

  const std::vector<Fault> faults = {
      {"flipped",
       [&](const std::string& d) { flip_byte(d + "/rank-00001.safetensors", in_rank1s_rows); },
       "tensor 'model/fc1.weight' rows 7 to 13 in '",
       {1}},
      {"truncated",
       [&](const std::string& d) { ::truncate((d + "/rank-00000.safetensors").c_str(), m.files[0].bytes - 100); },
       "/rank-00000.safetensors' has " + std::to_string(m.files[0].bytes - 100) + " bytes but the manifest says " +
           std::to_string(m.files[0].bytes) + ": it was truncated or replaced",
       {0, 1}},
      {"deleted",
       [&](const std::string& d) { ::unlink((d + "/rank-00001.safetensors").c_str()); },
       "/rank-00001.safetensors' (No such file or directory), which holds rows",
       {0, 1}},  // rank 0 reads a buffer's rows from it
      {"renamed",
       [&](const std::string& d) {
         edit_manifest(d, [](nlohmann::json& j) {
           j["tensors"]["model/fc2.biass"] = j["tensors"]["model/fc2.bias"];
           j["tensors"].erase("model/fc2.bias");
         });
       },
       "In the model, not in the checkpoint (1): model/fc2.bias (parameter, F32 [5]). In the checkpoint, not in the "
       "model (1): model/fc2.biass.",
       {0, 1}},
      {"newer",
       [&](const std::string& d) {
         edit_manifest(d, [](nlohmann::json& j) { j["format_version"] = fsdp::checkpoint::kFormatVersion + 1; });
       },
       "has format version " + std::to_string(fsdp::checkpoint::kFormatVersion + 1) + ", newer than this library's (" +
           std::to_string(fsdp::checkpoint::kFormatVersion) + ")",
       {0, 1}},
      {"no manifest",
       [&](const std::string& d) { ::unlink((d + "/" + checkpoint::kManifest).c_str()); },
       "is neither a checkpoint (no manifest.json) nor a root with a 'latest' pointer",
       {0, 1}},
      {"gone",
       [&](const std::string& d) { ASSERT_EQ(::rename(d.c_str(), (d + "-moved").c_str()), 0); },
       "' does not exist: give a checkpoint directory",
       {0, 1}},
  };
  for (const Fault& f : faults) {
    SCOPED_TRACE(f.name);
    const std::string dir = root + "/fault-" + std::to_string(&f - faults.data());
    if (r.rank == 0) {
      copy_checkpoint(good, dir);
      f.make(dir);
    }
    barrier();
    auto model = wrap(full, r, 1234);
    const auto before = model.full_state_dict();
    ErrorContext where;  // what the error carries beside its text
    const std::string msg = error_of([&] {
      try {
        checkpoint::load(dir, model);
      } catch (const fsdp::Error& e) {
        where = e.where();
        throw;
      }
    });
    EXPECT_EQ(where.api(), "fsdp::checkpoint::load") << msg;
    EXPECT_EQ(where.path(), dir) << msg;
    std::cout << f.name << ": " << msg << std::endl;  // shown with FSDP_TEST_SHOW_OUTPUT=1
    const bool finds = std::find(f.found_by.begin(), f.found_by.end(), r.rank) != f.found_by.end();
    EXPECT_NE(msg.find("fsdp::checkpoint::load (rank " + std::to_string(r.rank) + " of 2, '" + dir + "'): "),
              std::string::npos)
        << msg;
    // The call is named once: the inner check's own "fsdp::checkpoint: " is not repeated.
    EXPECT_EQ(msg.find("fsdp::checkpoint", 1), std::string::npos) << msg;
    std::string finders;  // the ranks whose errors say why, named by the others
    for (int q : f.found_by) finders += (finders.empty() ? "" : ", ") + std::to_string(q);
    EXPECT_NE(msg.find(finds ? f.message
                             : "failed on another rank: rank" + std::string(f.found_by.size() > 1 ? "s " : " ") +
                                   finders + " (its error says why); the model was left as it was"),
              std::string::npos)
        << msg;
    expect_bit_exact(model.full_state_dict(), before, std::string(f.name) + ": the model is untouched");
  }

  // A model of another dtype, and one without the buffers (strict: refused; not strict: loaded).
  {
    torch::manual_seed(1);
    auto net = std::make_shared<BufferedMLPImpl>();
    net->to(torch::kDouble);
    auto model = fsdp::fully_shard(net, r.pg, test_options());
    const std::string msg = error_of([&] { checkpoint::load(good, model); });
    EXPECT_NE(msg.find("Different (9): model/scale: parameter F32 [] in the checkpoint, parameter F64 [] in the "
                       "model; model/head.weight: parameter F32 [3, 5] in the checkpoint, parameter F64 [3, 5]"),
              std::string::npos)
        << msg;
  }
  {
    torch::manual_seed(1);
    auto model = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
    const std::string msg = error_of([&] { checkpoint::load(good, model); });
    EXPECT_NE(msg.find("In the checkpoint, not in the model (2): model/count; model/running. Load it into the model "
                       "it was saved from (same architecture, names and dtypes), or pass LoadOptions().strict(false)"),
              std::string::npos)
        << msg;
    checkpoint::load(good, model, checkpoint::LoadOptions().strict(false));
    auto want = saved.full_state_dict();
    want.erase("running");
    want.erase("count");
    expect_bit_exact(model.full_state_dict(), want, "not strict");
  }
  // The optimizer: another type, another param group, none saved; an optimizer the format does
  // not support is refused by the save on every rank.
  {
    auto model = wrap(full, r, 1234);
    const auto before = model.full_state_dict();
    auto adamw = make_opt(Opt::kAdamW, model);
    std::string msg = error_of([&] { checkpoint::load(good, model, *adamw); });
    EXPECT_NE(
        msg.find("holds SGD state, but the optimizer is AdamW: load it into the optimizer type it was saved from"),
        std::string::npos)
        << msg;
    msg = error_of([&] { checkpoint::load(root + "/model-only", model, *adamw); });
    EXPECT_NE(msg.find("was saved without an optimizer: load the model alone"), std::string::npos) << msg;
    auto params = model->parameters();
    params.pop_back();
    torch::optim::SGD fewer(params, torch::optim::SGDOptions(0.5).momentum(0.9));
    msg = error_of([&] { checkpoint::load(good, model, fewer); });
    EXPECT_NE(msg.find("param group 0 of the optimizer does not hold the parameters it was saved with (6 now, 7 "
                       "saved; saved, not in the group: "),
              std::string::npos)
        << msg;
    EXPECT_EQ(fewer.param_groups()[0].options().get_lr(), 0.5);  // untouched
    EXPECT_TRUE(fewer.state().empty());
    expect_bit_exact(model.full_state_dict(), before, "optimizer faults: the model is untouched");
    // A load between a forward and its backward is refused (the backward would find its weights
    // changed), and the backward then runs.
    {
      torch::manual_seed(3);
      auto loss = model(torch::randn({kGlobalBatch / 2, 7})).square().mean();
      msg = error_of([&] { checkpoint::load(good, model); });
      EXPECT_NE(msg.find("a step is under way (a forward ran with gradients and its backward has not"),
                std::string::npos)
          << msg;
      loss.backward();
      model->zero_grad();
    }
    // Another model with its optimizer: the model's difference is what is reported.
    {
      auto other = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
      auto other_sgd = make_opt(Opt::kSGD, other);
      msg = error_of([&] { checkpoint::load(good, other, *other_sgd); });
      EXPECT_NE(msg.find("does not fit the model; nothing was loaded. In the checkpoint, not in the model (2)"),
                std::string::npos)
          << msg;
    }
    // Edited optimizer steps and world size: refused, each with its reason.
    {
      auto adamw_model = wrap(full, r, 5);
      auto adam = make_opt(Opt::kAdamW, adamw_model);
      train_step(adamw_model, *adam, r, 0);
      checkpoint::save(root, adamw_model, *adam, checkpoint::SaveOptions().name("adamw"));
      const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> edits = {
          {[](nlohmann::json& j) { j["optimizer"]["steps"].erase("scale"); },
           "holds AdamW state of parameter 'scale' but no step for it"},
          {[](nlohmann::json& j) { j["optimizer"]["steps"]["scale"] = -5; },
           "gives parameter 'scale' the optimizer step -5, not a whole number from 0"},
          {[](nlohmann::json& j) { j["optimizer"]["steps"]["scale"] = 2.5; },
           "gives parameter 'scale' the optimizer step 2.5, not a whole number from 0"},
          {[](nlohmann::json& j) { j["world_size"] = 7; }, "says 7 ranks saved it but lists 2 files"}};
      for (size_t e = 0; e < edits.size(); ++e) {
        const std::string dir = root + "/edited-" + std::to_string(e);
        if (r.rank == 0) {
          copy_checkpoint(root + "/adamw", dir);
          edit_manifest(dir, edits[e].first);
        }
        barrier();
        auto target = wrap(full, r, 1234);
        auto target_opt = make_opt(Opt::kAdamW, target);
        const auto before_edit = target.full_state_dict();
        const std::string m2 = error_of([&] { checkpoint::load(dir, target, *target_opt); });
        EXPECT_NE(m2.find(edits[e].second), std::string::npos) << m2;
        EXPECT_TRUE(target_opt->state().empty());
        expect_bit_exact(target.full_state_dict(), before_edit, "edited optimizer: untouched");
      }
    }
    torch::optim::RMSprop rmsprop(model->parameters());
    msg = error_of([&] { checkpoint::save(root, model, rmsprop, checkpoint::SaveOptions().name("rmsprop")); });
    EXPECT_NE(msg.find("optimizer type torch::optim::RMSprop is not supported (torch::optim::SGD, Adam, AdamW and "
                       "fsdp::optim::FusedAdamW are)"),
              std::string::npos)
        << msg;
    EXPECT_EQ(checkpoint::latest_checkpoint(root), root + "/adamw");
    EXPECT_FALSE(::access((root + "/.staging-rmsprop").c_str(), F_OK) == 0) << "refused before the disk";
  }
  // LoadOptions::in_place: the model and the optimizer state bit for bit as a staged load's (one
  // step after it too, which reads SGD's momentum); the flipped byte found after reading began
  // leaves the model refusing to run or save, on every rank, saying why.
  {
    auto staged = wrap(full, r, 99);
    auto staged_sgd = make_opt(Opt::kSGD, staged);
    train_step(staged, *staged_sgd, r, 5);  // existing state tensors, overwritten by the load
    const auto res_staged = checkpoint::load(good, staged, *staged_sgd);
    auto direct = wrap(full, r, 98);
    auto direct_sgd = make_opt(Opt::kSGD, direct);
    train_step(direct, *direct_sgd, r, 6);
    const auto res_direct = checkpoint::load(good, direct, *direct_sgd, checkpoint::LoadOptions().in_place(true));
    EXPECT_EQ(res_direct.bytes_read, res_staged.bytes_read);
    expect_bit_exact(direct.full_state_dict(), staged.full_state_dict(), "in place: loaded");
    train_step(staged, *staged_sgd, r, 7);
    train_step(direct, *direct_sgd, r, 7);
    expect_bit_exact(direct.full_state_dict(), staged.full_state_dict(), "in place: one step later");

    const std::string msg =
        error_of([&] { checkpoint::load(root + "/fault-0", direct, checkpoint::LoadOptions().in_place(true)); });
    EXPECT_NE(msg.find(r.rank == 1 ? "it was read in place (LoadOptions::in_place), so this rank's shards now hold "
                                     "part of it"
                                   : "this rank's shards were partly overwritten (LoadOptions::in_place), so the model "
                                     "is now unusable"),
              std::string::npos)
        << msg;
    for (const std::string& refused :
         {error_of([&] { train_step(direct, *direct_sgd, r, 8); }),
          error_of([&] { checkpoint::save(root, direct, checkpoint::SaveOptions().name("after-in-place")); })}) {
      EXPECT_NE(refused.find("a load with LoadOptions::in_place failed after reading into this model's shards"),
                std::string::npos)
          << refused;
    }
  }
  // The plain path: the same checks, and a flipped byte leaves the module as it was.
  if (r.rank == 0) {
    auto plain = std::make_shared<PlainMLPImpl>();
    torch::OrderedDict<std::string, at::Tensor> before;
    for (const auto& kv : state_of(*plain)) before.insert(kv.key(), kv.value().clone());
    const std::string msg = error_of([&] { checkpoint::load(root + "/fault-0", *plain); });
    EXPECT_NE(msg.find("' into a plain module: tensor 'model/fc1.weight' rows 7 to 13"), std::string::npos) << msg;
    expect_bit_exact(state_of(*plain), before, "plain: untouched");
    const std::string staging = error_of([&] { checkpoint::load(root + "/.staging-x", *plain); });
    EXPECT_NE(staging.find("is a staging directory of a save that did not finish: it is never loaded"),
              std::string::npos)
        << staging;
  }
  barrier();
  if (r.rank == 0) ASSERT_TRUE(remove_tree(root));
}

TEST(CheckpointLoad, EachFaultItsOwnErrorOnEveryRankAndTheModelUntouched) {
  run_ranks(2, check_faults);
}

}  // namespace
}  // namespace fsdp::testing
