// Crash safety: a rank SIGKILLed at each step of a save's commit protocol (the library's crash
// points, FSDP_CHECKPOINT_CRASH_AT). Afterwards the latest checkpoint loads whole, and is the
// previous one or, once `latest` was renamed, the new one, bit for bit, never a mix; and the next
// save of the same step succeeds and leaves nothing behind.
#include "checkpoint/async_save.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"
#include "tests/models.h"
#include "tests/temp_dir.h"

#include <dirent.h>

#include <chrono>
#include <iostream>
#include <memory>

namespace fsdp::testing {
namespace {

std::string root_dir() {
  const char* d = std::getenv("FSDP_TEST_CKPT_ROOT");
  TORCH_CHECK(d != nullptr, "FSDP_TEST_CKPT_ROOT is not set");
  return d;
}

// The model saved at step `step`: its weights come from the seed 100 + step.
FullyShardedModule<UnevenMLPImpl<true>> model_of_step(Rank& r, int64_t step) {
  torch::manual_seed(100 + step);
  return fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
}

torch::OrderedDict<std::string, at::Tensor> plain_of_step(int64_t step) {
  torch::manual_seed(100 + step);
  UnevenMLPImpl<false> plain;
  auto out = plain.named_parameters();
  for (auto& kv : out) kv.value() = kv.value().detach().clone();
  return out;
}

// A save of `step` at 2 ranks; with a crash point set, one rank dies on reaching it and the other
// fails at its next collective (a save that was cut).
void save_step(Rank& r) {
  const char* step_env = std::getenv("FSDP_TEST_STEP");
  ASSERT_NE(step_env, nullptr);
  const int64_t step = std::atoll(step_env);
  auto model = model_of_step(r, step);
  const char* crash = std::getenv("FSDP_CHECKPOINT_CRASH_AT");
  try {
    checkpoint::save(root_dir(), model, checkpoint::SaveOptions().step(step));
    // The rank to be killed never gets here, and the other one sees the save fail.
    EXPECT_EQ(crash, nullptr) << "the save completed on rank " << r.rank << " although " << crash << " was set";
  } catch (const c10::Error& e) {
    ASSERT_NE(crash, nullptr) << "a save without a crash failed: " << e.what_without_backtrace();
    std::cout << "the save was cut as expected: " << e.what_without_backtrace() << std::endl;
  }
}

std::vector<std::string> dot_entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = d ? ::readdir(d) : nullptr) {
    const std::string n = e->d_name;
    if (n[0] == '.' && n != "." && n != "..") out.push_back(n);
  }
  if (d) ::closedir(d);
  return out;
}

// The latest checkpoint under `root` loads whole into a plain module and equals step `want`'s.
void expect_latest(const std::string& root, int64_t want, const std::string& what) {
  torch::manual_seed(1);
  UnevenMLPImpl<false> plain;
  const auto res = checkpoint::load(root, plain);
  EXPECT_EQ(res.step, want) << what;
  const auto ref = plain_of_step(want);
  for (const auto& kv : ref) {
    EXPECT_TRUE(plain.named_parameters()[kv.key()].equal(kv.value())) << what << ": " << kv.key();
  }
}

TEST(CheckpointCrash, ARankKilledAtEachStepOfTheCommitLeavesTheOldOrTheNewWhole) {
  struct Point {
    const char* at;
    int rank;
    bool new_is_latest;  // the crash came after `latest` was renamed
  };
  const std::vector<Point> points = {{"staged", 0, false},
                                     {"data-written", 1, false},
                                     {"data-fsynced", 0, false},
                                     {"agreed", 1, false},
                                     {"manifest-written", 0, false},
                                     {"manifest-renamed", 0, false},
                                     {"directory-renamed", 0, false},
                                     {"latest-written", 0, false},
                                     {"latest-renamed", 0, true}};
  std::unique_ptr<TempDir> tmp;
  std::string base;
  if (!in_rank_process()) {
    tmp = std::make_unique<TempDir>();
    base = tmp->path;
  }
  auto options = [&](const std::string& root, int64_t step, const std::string& crash, int dies) {
    RunOptions o;
    o.env["FSDP_TEST_CKPT_ROOT"] = root;
    o.env["FSDP_TEST_STEP"] = std::to_string(step);
    o.collective_timeout = std::chrono::seconds(5);
    if (!crash.empty()) {
      o.env["FSDP_CHECKPOINT_CRASH_AT"] = crash;
      o.may_die = {dies};
    }
    return o;
  };
  for (size_t i = 0; i < points.size(); ++i) {
    const Point& p = points[i];
    const std::string root = base + "/" + p.at, what = std::string("killed at ") + p.at;
    SCOPED_TRACE(what);
    run_ranks(2, save_step, options(root, 1, "", 0));  // the previous checkpoint
    run_ranks(2, save_step, options(root, 2, std::string(p.at) + "@" + std::to_string(p.rank), p.rank));
    if (!in_rank_process()) expect_latest(root, p.new_is_latest ? 2 : 1, what);
    // The next save (a resumed job's: of step 2 again, unless step 2 is the latest) completes,
    // replacing a step 2 that was renamed but never named latest, and leaves nothing behind.
    const int64_t next = p.new_is_latest ? 3 : 2;
    run_ranks(2, save_step, options(root, next, "", 0));
    if (!in_rank_process()) {
      expect_latest(root, next, what + ", then saved again");
      EXPECT_EQ(dot_entries(root), std::vector<std::string>{}) << what;
    }
  }
}

// A peer that hangs (SIGSTOP at the crash point "data-fsynced") while the other rank waits in the
// agreement that follows the write: the waiting rank fails within the model's timeout (3 s; the
// process group's own is 60 s), with an fsdp::Error naming the agreement and the timeout. Once in
// a synchronous save (the agreement on the training thread, over the model's group) and once in an
// asynchronous save's background thread (over the saver's own group; the error comes out of wait()).
void stopped_peer_in_agreement(Rank& r) {
  const bool async = std::getenv("FSDP_TEST_ASYNC") != nullptr;
  torch::manual_seed(1);
  auto model = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg,
                                 FullyShardOptions().timeout(std::chrono::seconds(3)));
  const auto start = std::chrono::steady_clock::now();
  std::string msg;
  try {
    if (async) {
      checkpoint::AsyncSaver saver(model);
      saver.save(root_dir(), checkpoint::SaveOptions().step(1));
      saver.wait();
    } else {
      checkpoint::save(root_dir(), model, checkpoint::SaveOptions().step(1));
    }
  } catch (const fsdp::Error& e) {
    msg = e.what_without_backtrace();
    EXPECT_EQ(e.rank(), 0) << msg;
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.rank, 0) << "rank 1 stops at the crash point and never gets here";
  std::cout << (async ? "async" : "sync") << ": error after " << waited << " s: " << msg << std::endl;
  ASSERT_FALSE(msg.empty()) << "the save did not fail with an fsdp::Error";
  EXPECT_GT(waited, 2.5) << msg;
  EXPECT_LT(waited, 3.0 + 3.0) << "the model's 3 s timeout, plus the write and the peer check\n" << msg;
  EXPECT_NE(msg.find("(timeout 3000 ms)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("writing this rank's file"), std::string::npos) << msg;
  EXPECT_NE(msg.find(async ? "AsyncSaver's background save" : "fsdp::checkpoint::save"), std::string::npos) << msg;
}

TEST(CheckpointCrash, AStoppedPeerFailsTheAgreementWithinTheTimeout) {
  std::unique_ptr<TempDir> tmp;
  std::string base;
  if (!in_rank_process()) {
    tmp = std::make_unique<TempDir>();
    base = tmp->path;
  }
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "asynchronous save" : "synchronous save");
    RunOptions o;
    o.env["FSDP_TEST_CKPT_ROOT"] = base + (async ? "/async" : "/sync");
    if (async) o.env["FSDP_TEST_ASYNC"] = "1";
    o.env["FSDP_CHECKPOINT_CRASH_AT"] = "data-fsynced@1:stop";
    o.collective_timeout = std::chrono::seconds(60);  // the process group's: the model's 3 s must bound the wait
    o.timeout = std::chrono::seconds(60);
    o.may_die = {1};
    run_ranks(2, stopped_peer_in_agreement, o);
  }
}

}  // namespace
}  // namespace fsdp::testing
