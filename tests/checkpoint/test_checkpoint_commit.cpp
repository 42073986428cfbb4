// The commit protocol's filesystem steps (checkpoint/commit.h): only a complete checkpoint is
// committed and named by `latest`, an interrupted save is never seen and is cleaned up by the next,
// a committed checkpoint is never written into, and keep_last keeps the newest.
#include "checkpoint/commit.h"
#include "tests/temp_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <string>

namespace fsdp::testing {
namespace {

using namespace fsdp::checkpoint;

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

void put(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

// A save: staging, a rank file and the manifest, committed.
std::string save(const std::string& root, const std::string& name) {
  const std::string staging = begin_staging(root, name);
  put(staging + "/rank-00000.safetensors", "data");
  write_atomically(staging, kManifest, "{}");
  const std::string done = commit(root, staging, name);
  end_staging(root, name);
  return done;
}

TEST(CheckpointCommit, OnlyACompleteCheckpointIsCommittedAndNamedLatest) {
  TempDir t;
  const std::string root = t.path + "/ckpts";  // created by the first save
  EXPECT_EQ(latest_checkpoint(root), "");
  const std::string staging = begin_staging(root, step_name(1));
  EXPECT_EQ(staging, root + "/.staging-step-000001");
  put(staging + "/rank-00000.safetensors", "data");
  EXPECT_EQ(latest_checkpoint(root), "") << "nothing is committed while staging";
  EXPECT_NE(error_of([&] { commit(root, staging, step_name(1)); }).find("only a complete checkpoint is committed"),
            std::string::npos);
  write_atomically(staging, kManifest, "{}");
  const std::string done = commit(root, staging, step_name(1));
  EXPECT_EQ(done, root + "/step-000001");
  EXPECT_FALSE(exists(staging));
  EXPECT_TRUE(exists(done + "/rank-00000.safetensors"));
  EXPECT_EQ(latest_checkpoint(root), done);
  EXPECT_EQ(committed_checkpoints(root), std::vector<std::string>{done});
  end_staging(root, step_name(1));
}

TEST(CheckpointCommit, AnInterruptedSaveIsNeverSeenAndTheNextOneCleansUp) {
  TempDir t;
  const std::string first = save(t.path, step_name(100));
  // A save that died after writing its files, before its commit.
  const std::string dead = begin_staging(t.path, step_name(200));
  put(dead + "/rank-00000.safetensors", "half");
  end_staging(t.path, step_name(200));          // its process died
  put(t.path + "/.latest.tmp", "step-000200");  // and a pointer update it never finished
  // And a keep_last that died while deleting a checkpoint it had taken out of the committed set.
  ::mkdir((t.path + "/.deleting-step-000050").c_str(), 0755);
  put(t.path + "/.deleting-step-000050/" + kManifest, "{}");
  EXPECT_EQ(latest_checkpoint(t.path), first);
  EXPECT_EQ(committed_checkpoints(t.path), std::vector<std::string>{first});
  const std::string next = save(t.path, step_name(300));
  EXPECT_FALSE(exists(dead)) << "leftover staging removed by the next save";
  EXPECT_FALSE(exists(t.path + "/.latest.tmp"));
  EXPECT_FALSE(exists(t.path + "/.deleting-step-000050"));
  EXPECT_EQ(latest_checkpoint(t.path), next);
}

// A save in flight in this process (an AsyncSaver's) keeps its staging directory while another
// save starts (a synchronous one on the same root): only a crashed save's is a leftover. Its name
// is refused until it ends; then its directory is a leftover like any other.
TEST(CheckpointCommit, ASaveInFlightKeepsItsStagingWhileAnotherStarts) {
  TempDir t;
  const std::string flying = begin_staging(t.path, step_name(1));
  put(flying + "/rank-00000.safetensors", "being written");
  const std::string other = begin_staging(t.path, step_name(2));
  EXPECT_TRUE(exists(flying + "/rank-00000.safetensors")) << "removed under a save in flight";
  EXPECT_NE(error_of([&] { begin_staging(t.path, step_name(1)); }).find("is still in flight in this process"),
            std::string::npos);
  end_staging(t.path, step_name(1));
  end_staging(t.path, step_name(2));
  begin_staging(t.path, step_name(3));
  EXPECT_FALSE(exists(flying)) << "ended: a leftover";
  EXPECT_FALSE(exists(other));
  end_staging(t.path, step_name(3));
}

TEST(CheckpointCommit, ACommittedCheckpointIsNeverWrittenInto) {
  TempDir t;
  save(t.path, "warmup");
  const std::string msg = error_of([&] { begin_staging(t.path, "warmup"); });
  EXPECT_NE(msg.find("exists already and is the latest checkpoint; a save never writes into it"), std::string::npos)
      << msg;
  ::mkdir((t.path + "/other").c_str(), 0755);  // not a checkpoint: never replaced either
  EXPECT_NE(error_of([&] { begin_staging(t.path, "other"); }).find("exists already and is not a checkpoint"),
            std::string::npos);
  for (const std::string bad : {"", "a/b", ".hidden", "latest"}) {
    EXPECT_NE(error_of([&] { begin_staging(t.path, bad); }).find("cannot name a checkpoint"), std::string::npos)
        << "'" << bad << "'";
  }
}

TEST(CheckpointCommit, ACommittedCheckpointLatestDoesNotNameIsReplacedWhole) {
  // A save that died after renaming its directory, before `latest`: the previous one stays the
  // latest, and the next save of the same name (a job resumed from the latest) replaces it.
  TempDir t;
  const std::string first = save(t.path, step_name(10));
  const std::string orphan = begin_staging(t.path, step_name(20));
  end_staging(t.path, step_name(20));
  put(orphan + "/" + kManifest, "{\"old\": 1}");
  ASSERT_EQ(::rename(orphan.c_str(), (t.path + "/" + step_name(20)).c_str()), 0);
  EXPECT_EQ(latest_checkpoint(t.path), first);
  const std::string again = save(t.path, step_name(20));
  EXPECT_EQ(latest_checkpoint(t.path), again);
  EXPECT_TRUE(exists(again + "/rank-00000.safetensors")) << "the new one's files";
  std::ifstream m(again + "/" + kManifest);
  std::string text((std::istreambuf_iterator<char>(m)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.find("old"), std::string::npos) << "nothing of the old one left";
  EXPECT_FALSE(exists(t.path + "/.replaced-" + step_name(20)));
}

TEST(CheckpointCommit, KeepLastKeepsTheNewest) {
  TempDir t;
  for (int64_t s : {1, 2, 3, 4}) save(t.path, step_name(s));
  keep_last(t.path, 2);
  EXPECT_EQ(committed_checkpoints(t.path),
            (std::vector<std::string>{t.path + "/step-000003", t.path + "/step-000004"}));
  // Nothing of the two removed is left, under their names or while being deleted.
  for (const char* gone : {"step-000001", "step-000002", ".deleting-step-000001", ".deleting-step-000002"}) {
    EXPECT_FALSE(exists(t.path + "/" + gone)) << gone;
  }
  EXPECT_EQ(latest_checkpoint(t.path), t.path + "/step-000004");
  keep_last(t.path, 0);  // 0 keeps all
  EXPECT_EQ(committed_checkpoints(t.path).size(), 2u);
}

TEST(CheckpointCommit, ALatestThatNamesNoCheckpointIsAnError) {
  TempDir t;
  save(t.path, step_name(1));
  put(t.path + "/latest", "step-000009\n");
  const std::string msg = error_of([&] { latest_checkpoint(t.path); });
  EXPECT_NE(msg.find("names 'step-000009', which is not a committed checkpoint"), std::string::npos) << msg;
  // A byte no name has (a NUL, a control character) is shown escaped, never cutting the message.
  put(t.path + "/latest", std::string("step-00\0001\n", 10));
  const std::string nul = error_of([&] { latest_checkpoint(t.path); });
  EXPECT_NE(nul.find("does not name a checkpoint (it holds \"step-00\\u00001\")"), std::string::npos) << nul;
  EXPECT_NE(nul.find("load one by its directory"), std::string::npos) << nul;
}

}  // namespace
}  // namespace fsdp::testing
