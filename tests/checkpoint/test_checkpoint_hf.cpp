// fsdp::checkpoint::load_safetensors: Hugging Face-style weights written by Python (one file, and
// shards with an index) load into a sharded model at 1-4 ranks, each with another strategy, every
// tensor equal to the file's, each rank reading exactly the bytes of its rows; names are mapped
// (a prefix stripped, a tensor skipped), and without the map the mismatch is refused.
#include "tests/checkpoint_helpers.h"

#include <cstdlib>
#include <memory>

namespace fsdp::testing {
namespace {

std::string hf_name(const std::string& name) {
  if (name == "model.unused") return "";
  return name.rfind("model.", 0) == 0 ? name.substr(6) : name;
}

void load_hf(Rank& r) {
  const std::string root = root_dir();
  const auto cases = saved_cases(r.world_size);
  const Case& c = cases[static_cast<size_t>(r.world_size) % cases.size()];
  // The file's tensors, read here whole, by the model's names.
  const std::string single = root + "/single/model.safetensors";
  torch::OrderedDict<std::string, at::Tensor> want;
  for (const auto& t : checkpoint::read_safetensors_header(single).tensors) {
    if (!hf_name(t.name).empty()) want.insert(hf_name(t.name), checkpoint::read_tensor(single, t));
  }
  for (const std::string& path : {single, root + "/sharded", root + "/sharded/model.safetensors.index.json"}) {
    SCOPED_TRACE(path + " as " + c.label);
    auto model = wrap(c, r, 1234);
    const auto res = checkpoint::load_safetensors(path, model, {}, hf_name);
    int64_t mine = 0;
    for (const auto& s : model.shard_specs()) mine += s.local.numel() * s.local.element_size();
    for (const auto& b : model.buffers()) mine += b.numel() * b.element_size();
    EXPECT_EQ(res.bytes_needed, mine);
    EXPECT_EQ(res.bytes_read, mine) << "no checksum blocks: exactly the bytes needed";
    expect_bit_exact(model.full_state_dict(), want, path);
  }
  // Without the name map nothing fits, and the model is left as it was.
  auto model = wrap(c, r, 1234);
  const auto before = model.full_state_dict();
  const std::string msg = error_of([&] { checkpoint::load_safetensors(single, model); });
  EXPECT_NE(msg.find("does not fit the model; nothing was loaded. In the model, not in the checkpoint (9)"),
            std::string::npos)
      << msg;
  expect_bit_exact(model.full_state_dict(), before, "untouched");
}

TEST(CheckpointHuggingFace, SafetensorsFromPythonLoadIntoShardsAtOneToFourRanks) {
#ifndef FSDP_PYTHON
  GTEST_SKIP() << "no Python virtualenv configured";
#else
  CheckpointRoot root;
  if (!in_rank_process()) {
    const std::string cmd = std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/checkpoint/make_hf_checkpoint.py " +
                            root.path() + "/hf > " + root.path() + "/python.log 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    root.options.env["FSDP_TEST_CKPT_ROOT"] = root.path() + "/hf";
  }
  for (int M = 1; M <= 4; ++M) run_ranks(M, load_hf, root.options);
#endif
}

}  // namespace
}  // namespace fsdp::testing
