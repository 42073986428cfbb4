// Asynchronous save (checkpoint/async_save.h): the same files as a synchronous save while training
// changes the model during the background write; the snapshot's memory reused (RSS flat over many
// saves); a disk error in the background thrown by the next call with the previous checkpoint
// still the latest; a rank killed during its background write leaving the previous one the latest.
#include "checkpoint/async_save.h"
#include "tests/checkpoint_helpers.h"

#include <malloc.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <thread>

namespace fsdp::testing {
namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Resident memory, after handing the allocator's free pages back (malloc_trim): what is live, not
// what glibc's arenas keep for reuse after the training's and the writer's temporaries.
int64_t rss_bytes() {
  ::malloc_trim(0);
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

const Case kMixed{"mixed", ShardingStrategy::kFullShard, 0, true};

void same_files_as_sync(Rank& r) {
  const std::string root = root_dir();
  auto model = wrap(kMixed, r, 3);
  auto opt = make_opt(Opt::kAdamW, model);
  train_step(model, *opt, r, 1);
  checkpoint::AsyncSaver saver(model);
  const auto opts = checkpoint::SaveOptions().step(1).name("a").metadata({{"k", "v"}});
  checkpoint::save(root + "/sync", model, *opt, opts);
  auto direct = opts;  // the same files through three writer threads and O_DIRECT
  checkpoint::save(root + "/direct", model, *opt, direct.io_threads(3).direct_io(true));
  const auto started = saver.save(root + "/async", *opt, opts);
  EXPECT_TRUE(saver.in_flight());
  // And through O_DIRECT straight from the snapshot (laid out as the file's data), on another saver.
  checkpoint::AsyncSaver direct_saver(model);
  direct_saver.save(root + "/async-direct", *opt, direct);
  EXPECT_GT(started.snapshot_bytes, 0);
  // The model changes at once, before the background thread (which agrees first) can have written
  // it, and training goes on (its collectives on the model's group) while that thread writes and
  // agrees on the saver's own group: the snapshot keeps the saved values.
  {
    at::NoGradGuard no_grad;
    for (auto& p : model.parameters()) p.mul_(-3);
  }
  train_step(model, *opt, r, 2);
  train_step(model, *opt, r, 3);
  const auto res = saver.wait();
  EXPECT_FALSE(saver.in_flight());
  direct_saver.wait();
  EXPECT_EQ(res.path, root + "/async/a");
  EXPECT_EQ(res.bytes_written, started.snapshot_bytes);
  const std::string rank_file = "/rank-0000" + std::to_string(r.rank) + ".safetensors";
  for (const char* other : {"/async/a", "/direct/a", "/async-direct/a"}) {
    EXPECT_EQ(file_bytes(root + other + rank_file), file_bytes(root + "/sync/a" + rank_file))
        << "rank " << r.rank << "'s file in " << other << " differs from the synchronous, buffered save's";
    if (r.rank == 0) {
      EXPECT_EQ(file_bytes(root + other + "/manifest.json"), file_bytes(root + "/sync/a/manifest.json")) << other;
    }
  }
  // Loaded with preads on three threads, every block verified: the saved values.
  auto loaded = wrap(kMixed, r, 99);
  checkpoint::load(root + "/direct/a", loaded, checkpoint::LoadOptions().io_threads(3));
  auto reference = wrap(kMixed, r, 98);
  checkpoint::load(root + "/sync/a", reference);
  expect_bit_exact(loaded.full_state_dict(), reference.full_state_dict(), "rank " + std::to_string(r.rank));
  // A save the saver's destructor waits for: committed when it returns.
  saver.save(root + "/async", *opt, checkpoint::SaveOptions().step(3));
}

TEST(CheckpointAsync, SameFilesAsASynchronousSaveWhileTrainingGoesOn) {
  CheckpointRoot root;
  run_ranks(2, same_files_as_sync, root.options);
  if (!in_rank_process()) {
    PlainMLPImpl plain;
    EXPECT_EQ(checkpoint::load(root.path() + "/async", plain).step, 3);  // the destructor's wait
  }
}

// Wide enough that a snapshot that leaked each save would show in the RSS.
struct WideImpl : torch::nn::Module {
  WideImpl()
      : a(register_module("a", torch::nn::Linear(1536, 1536))),
        b(register_module("b", torch::nn::Linear(1536, 1536))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a, b;
};

TEST(CheckpointAsync, SnapshotMemoryIsReusedOverManySaves) {
  CheckpointRoot root;
  run_ranks(
      2,
      [](Rank& r) {
        torch::manual_seed(0);
        auto model = fsdp::fully_shard(std::make_shared<WideImpl>(), r.pg, test_options());
        torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-3));
        checkpoint::AsyncSaver saver(model);
        int64_t rss_after_10 = 0, capacity = 0;
        for (int step = 1; step <= 25; ++step) {
          auto loss = model(torch::randn({4, 1536})).square().mean();
          loss.backward();
          opt.step();
          opt.zero_grad();
          saver.save(root_dir(), opt, checkpoint::SaveOptions().step(step).keep_last(2));
          if (step == 10) {  // after the allocators' warm-up (while saves overlap steps, it takes a few)
            saver.wait();
            rss_after_10 = rss_bytes();
            capacity = saver.snapshot_capacity();
          }
        }
        saver.wait();
        // The snapshot: this rank's parameters and AdamW's two moments, allocated once.
        const int64_t params = 2 * (1536 * 1536 + 1536);
        EXPECT_GE(capacity, 3 * params * 4 / r.world_size);
        EXPECT_EQ(saver.snapshot_capacity(), capacity);
        const int64_t growth = rss_bytes() - rss_after_10;
        std::cout << "rank " << r.rank << ": snapshot " << capacity << " bytes, RSS growth over the last 15 saves "
                  << growth << " bytes" << std::endl;
        // A snapshot kept per save would add 15 of them. Between saves RSS moves by up to two
        // gathered copies of the model's parameters (the model's all-gather and gradient buffers,
        // which its buffer cache keeps or frees), about one snapshot here: so the bound is three.
        EXPECT_LT(growth, 3 * capacity) << "host memory grew over 15 saves by more than three snapshots";
      },
      root.options);
}

// With IfBusy::kSkip and a save tried every step, each try is started on every rank or skipped
// on every rank (the ranks agree); IfBusy::kThrow refuses the same way with an error. Without the
// agreement this fails: the ranks start different saves, which then pair up wrongly.
TEST(CheckpointAsync, SkippingABusySaveIsAgreedByEveryRank) {
  CheckpointRoot root;
  run_ranks(
      2,
      [](Rank& r) {
        torch::manual_seed(0);
        auto model = fsdp::fully_shard(std::make_shared<WideImpl>(), r.pg, test_options());
        torch::optim::AdamW opt_(model.parameters(), torch::optim::AdamWOptions(1e-3));
        auto* opt = &opt_;
        checkpoint::AsyncSaver saver(model, checkpoint::AsyncSaveOptions().if_busy(checkpoint::IfBusy::kSkip));
        checkpoint::AsyncSaver thrower(model, checkpoint::AsyncSaveOptions().if_busy(checkpoint::IfBusy::kThrow));
        constexpr int kSteps = 30;
        at::Tensor started = torch::zeros({kSteps}, torch::kLong);
        for (int step = 0; step < kSteps; ++step) {
          auto loss = model(torch::randn({4, 1536})).square().mean();
          loss.backward();
          opt->step();
          opt->zero_grad();
          // The ranks reach save() at different times (one of them waits a little, alternately),
          // so that one rank's previous save has often ended while another's has not.
          if (step % 2 == r.rank) std::this_thread::sleep_for(std::chrono::milliseconds(60));
          if (step % 3 != 2) {
            const auto s = saver.save(root_dir(), *opt, checkpoint::SaveOptions().step(step).keep_last(2));
            started[step] = s.skipped ? 0 : 1;
            EXPECT_EQ(s.path.empty(), s.skipped);
          } else {
            try {
              thrower.save(root_dir() + "/other", *opt, checkpoint::SaveOptions().step(step).keep_last(2));
              started[step] = 1;
            } catch (const c10::Error& e) {
              const std::string msg = e.what_without_backtrace();
              EXPECT_NE(msg.find("nothing was started on any rank"), std::string::npos) << msg;
            }
          }
        }
        saver.wait();
        thrower.wait();
        at::Tensor sum = started.clone();
        all_reduce_sum(r, sum);
        EXPECT_TRUE(sum.eq(0).logical_or(sum.eq(r.world_size)).all().item<bool>())
            << "started on some ranks only: " << sum;
        std::cout << "rank " << r.rank << ": " << started.sum().item<int64_t>() << " of " << kSteps << " saves started"
                  << std::endl;
      },
      root.options);
}

// The second launch: a good save, then one whose background write fails on rank 1 (an injected
// ENOSPC), reported by the next call on every rank; then the same save again succeeds.
void disk_error(Rank& r) {
  const std::string root = root_dir();
  auto model = wrap(kMixed, r, 5);
  auto opt = make_opt(Opt::kAdamW, model);
  train_step(model, *opt, r, 1);
  checkpoint::AsyncSaver saver(model);
  saver.save(root, *opt, checkpoint::SaveOptions().step(1));
  saver.wait();
  saver.save(root, *opt, checkpoint::SaveOptions().step(2));  // fails in the background
  train_step(model, *opt, r, 2);
  try {
    saver.save(root, *opt, checkpoint::SaveOptions().step(3));
    ADD_FAILURE() << "rank " << r.rank << ": the failed save's error was not thrown by the next save";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    std::cout << "rank " << r.rank << ": " << msg << std::endl;
    EXPECT_NE(msg.find("nothing was started, because the previous save failed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("step-000002"), std::string::npos) << msg;
    EXPECT_NE(msg.find(r.rank == 1 ? "No space left on device" : "failed on another rank"), std::string::npos) << msg;
  }
  EXPECT_FALSE(saver.in_flight());
  EXPECT_EQ(checkpoint::latest_checkpoint(root), root + "/step-000001");
  saver.wait();  // reported once: nothing more to throw
  saver.save(root, *opt, checkpoint::SaveOptions().step(3));
  EXPECT_EQ(saver.wait().path, root + "/step-000003");
}

TEST(CheckpointAsync, ABackgroundDiskErrorIsThrownByTheNextCall) {
  CheckpointRoot root;
  root.options.env["FSDP_CHECKPOINT_FAIL_WRITE"] = "ENOSPC:.staging-step-000002/rank-00001";
  run_ranks(2, disk_error, root.options);
  if (!in_rank_process()) {
    PlainMLPImpl plain;
    EXPECT_EQ(checkpoint::load(root.path() + "/step-000001", plain).step, 1);
  }
}

void killed_mid_write(Rank& r) {
  auto model = wrap(kMixed, r, 7);
  auto opt = make_opt(Opt::kSGD, model);
  train_step(model, *opt, r, 1);
  checkpoint::AsyncSaver saver(model);
  const int64_t step = std::atoll(std::getenv("FSDP_TEST_STEP"));
  saver.save(root_dir(), *opt, checkpoint::SaveOptions().step(step));
  if (std::getenv("FSDP_CHECKPOINT_CRASH_AT") == nullptr) {
    train_step(model, *opt, r, 2);
    saver.wait();
    return;
  }
  // Rank 1 dies in its background write; rank 0 learns it from the saver's group, and the error
  // wait() throws carries the background error's context, as a synchronous save's would.
  try {
    saver.wait();
    ADD_FAILURE() << "rank " << r.rank << ": wait() returned";
  } catch (const fsdp::Error& e) {
    EXPECT_EQ(e.rank(), r.rank);
    EXPECT_NE(e.operation().find("fsdp::checkpoint::AsyncSaver's background save"), std::string::npos)
        << "'" << e.operation() << "': " << e.what();
  }
}

TEST(CheckpointAsync, ARankKilledDuringItsBackgroundWriteLeavesThePreviousLatest) {
  CheckpointRoot root;
  root.options.collective_timeout = std::chrono::seconds(5);
  root.options.env["FSDP_TEST_STEP"] = "1";
  run_ranks(2, killed_mid_write, root.options);
  root.options.env["FSDP_TEST_STEP"] = "2";
  root.options.env["FSDP_CHECKPOINT_CRASH_AT"] = "data-written@1";
  root.options.may_die = {1};
  run_ranks(2, killed_mid_write, root.options);
  if (!in_rank_process()) {
    PlainMLPImpl plain;
    EXPECT_EQ(checkpoint::load(root.path(), plain).step, 1);
  }
}

}  // namespace
}  // namespace fsdp::testing
