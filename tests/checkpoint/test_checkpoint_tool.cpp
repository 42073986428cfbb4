// build/tools/fsdp-ckpt on a checkpoint saved here: `verify` passes a good one and names each
// fault of a damaged one (a flipped byte, a truncated or missing file, an edited manifest, a newer
// format version) with a non-zero exit; `inspect` lists what was saved.
#include "checkpoint/checkpoint.h"
#include "checkpoint/manifest.h"
#include "tests/models.h"
#include "tests/temp_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace fsdp::testing {
namespace {

struct ToolRun {
  int rc;
  std::string out;
};

ToolRun tool(const std::string& args, const std::string& dir) {
  const std::string log = dir + "/tool.log";
  const int status = std::system((std::string(FSDP_CKPT_TOOL) + " " + args + " > " + log + " 2>&1").c_str());
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
void spill(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(CheckpointTool, VerifiesAGoodCheckpointAndNamesEachFault) {
  run_ranks(1, [](Rank& r) {
    TempDir tmp;
    const std::string root = tmp.path + "/ckpts";
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
    const auto res = checkpoint::save(root, model, checkpoint::SaveOptions().step(5).block_bytes(32));
    const std::string file = res.path + "/rank-00000.safetensors", manifest = res.path + "/manifest.json";

    auto ok = tool("verify " + root, tmp.path);  // a root: its latest checkpoint
    EXPECT_EQ(ok.rc, 0) << ok.out;
    // 7 parameters and the one rank's CPU generator state.
    EXPECT_NE(ok.out.find("OK (1 files, 8 tensors"), std::string::npos) << ok.out;
    auto listing = tool("inspect " + res.path, tmp.path);
    EXPECT_EQ(listing.rc, 0) << listing.out;
    EXPECT_NE(listing.out.find("step 5, saved by 1 ranks"), std::string::npos) << listing.out;
    EXPECT_NE(listing.out.find("model/fc1.weight"), std::string::npos) << listing.out;
    EXPECT_NE(listing.out.find("[13, 7]"), std::string::npos) << listing.out;
    EXPECT_EQ(tool("frobnicate " + root, tmp.path).rc, 2);

    // One byte of fc1.weight's data flipped: its block's checksum, named.
    const std::string good = slurp(file), good_manifest = slurp(manifest);
    const auto m = checkpoint::read_manifest(res.path);
    const auto it =
        std::find_if(m.tensors.begin(), m.tensors.end(), [](const auto& t) { return t.key == "model/fc1.weight"; });
    ASSERT_NE(it, m.tensors.end());
    std::string bad = good;
    bad[it->chunks[0].begin + 40] ^= 0x01;  // in the second 32-byte block
    spill(file, bad);
    auto flipped = tool("verify " + res.path, tmp.path);
    EXPECT_EQ(flipped.rc, 1) << flipped.out;
    EXPECT_NE(
        flipped.out.find("tensor 'model/fc1.weight' rows 0 to 13, bytes " + std::to_string(it->chunks[0].begin + 32) +
                         " to " + std::to_string(it->chunks[0].begin + 64) + ": checksum"),
        std::string::npos)
        << flipped.out;
    EXPECT_NE(flipped.out.find("1 fault(s)"), std::string::npos) << flipped.out;

    spill(file, good.substr(0, good.size() - 1));  // truncated
    auto truncated = tool("verify " + res.path, tmp.path);
    EXPECT_EQ(truncated.rc, 1);
    EXPECT_NE(truncated.out.find("it is truncated"), std::string::npos) << truncated.out;

    ::unlink(file.c_str());  // missing
    auto missing = tool("verify " + res.path, tmp.path);
    EXPECT_EQ(missing.rc, 1);
    EXPECT_NE(missing.out.find("cannot open '" + file + "'"), std::string::npos) << missing.out;
    spill(file, good);
    EXPECT_EQ(tool("verify " + res.path, tmp.path).rc, 0);

    std::string newer = good_manifest;  // a newer format
    const std::string version = "\"format_version\": " + std::to_string(checkpoint::kFormatVersion);
    newer.replace(newer.find(version), version.size(), "\"format_version\": 99");
    spill(manifest, newer);
    auto v = tool("verify " + res.path, tmp.path);
    EXPECT_EQ(v.rc, 1);
    EXPECT_NE(v.out.find("has format version 99, newer than this library's (" +
                         std::to_string(checkpoint::kFormatVersion) + ")"),
              std::string::npos)
        << v.out;

    std::string edited = good_manifest;             // a chunk's rows edited
    const auto at = edited.find("\"rows\": [0, ");  // a tensor's first chunk now starts at row 1
    ASSERT_NE(at, std::string::npos) << edited.substr(0, 400);
    edited.replace(at + 9, 1, "1");
    spill(manifest, edited);
    auto e = tool("verify " + res.path, tmp.path);
    EXPECT_EQ(e.rc, 1);
    EXPECT_NE(e.out.find("the manifest is corrupt"), std::string::npos) << e.out;

    // A value that parses and makes sense edited (the step, as a flipped bit would): the manifest's
    // own checksum refuses it, and so does a load.
    std::string stepped = good_manifest;
    const auto step_at = stepped.find("\"step\": 5");
    ASSERT_NE(step_at, std::string::npos);
    stepped.replace(step_at, 9, "\"step\": 4");
    spill(manifest, stepped);
    auto s = tool("verify " + res.path, tmp.path);
    EXPECT_EQ(s.rc, 1);
    EXPECT_NE(s.out.find("does not match its own checksum"), std::string::npos) << s.out;
    EXPECT_THROW(checkpoint::read_manifest(res.path), c10::Error);
  });
}

}  // namespace
}  // namespace fsdp::testing
