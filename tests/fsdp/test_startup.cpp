// Start-up: every way of not reaching the job ends within the timeout, with a message naming the
// address, the port and what was found there; a process of another job is told so; the timeout
// comes from the option, else FSDP_TIMEOUT, else 10 minutes. Unreachable peers are closed
// loopback ports, a port held by a silent listener of the test's own, or a network namespace the
// test creates (as root).
#include "fsdp/internal/nccl_device.h"
#include "programs/launch.h"
#include "tests/models.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

/// A TCP socket bound to 127.0.0.1 on a port the kernel picked (programs/launch.h); listening (connections are
/// accepted by the kernel and never answered) unless `listen_too` is false.
struct LoopbackPort {
  explicit LoopbackPort(bool listen_too) {
    const auto s = fsdp::programs::loopback_socket(listen_too);
    fd = s.fd;
    port = s.port;
  }
  ~LoopbackPort() { close_now(); }
  void close_now() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  int fd = -1;
  int port = 0;
};

class Startup : public LauncherEnv {
 protected:
  static void master(const std::string& addr, int port) {
    setenv("MASTER_ADDR", addr.c_str(), 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  }
  static InitOptions rank_of(int rank, int world) {
    return InitOptions().rank(rank).world_size(world).gloo_interface("lo").nccl(false);
  }
};

// A service holds the store's port and never speaks (with Slurm's default port this is what every
// rank but rank 0 used to meet, and hang on forever in the store's handshake).
TEST_F(Startup, SilentServiceOnTheStorePortFailsWithinTheTimeout) {
  LoopbackPort silent(/*listen_too=*/true);
  master("127.0.0.1", silent.port);
  const auto start = Clock::now();
  auto msg = error_of([] { init_process_group(rank_of(1, 2).timeout(std::chrono::seconds(3))); });
  const double took = seconds_since(start);
  std::cout << "after " << took << " s: " << msg << std::endl;
  EXPECT_LT(took, 3.5) << msg;
  EXPECT_NE(msg.find("rank 1 of 2 could not join its job through the store at 127.0.0.1:" +
                     std::to_string(silent.port) + " within 3000 ms"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("accepted the connection but did not answer as a c10d store"), std::string::npos) << msg;
}

// Nothing listens on the port (a closed loopback port): within 1.2 x the timeout, which comes from
// FSDP_TIMEOUT here (no explicit option).
TEST_F(Startup, UnreachableStoreFailsWithinTheTimeoutFromTheEnvironment) {
  LoopbackPort closed(/*listen_too=*/false);
  closed.close_now();
  master("127.0.0.1", closed.port);
  setenv("FSDP_TIMEOUT", "3", 1);
  const auto start = Clock::now();
  auto msg = error_of([] { init_process_group(rank_of(1, 2)); });
  const double took = seconds_since(start);
  std::cout << "after " << took << " s: " << msg << std::endl;
  EXPECT_LT(took, 1.2 * 3) << msg;
  EXPECT_GT(took, 2.5) << "it waits for the store to come up, until the timeout: " << msg;
  EXPECT_NE(msg.find("within 3000 ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nothing listens on 127.0.0.1:" + std::to_string(closed.port) + " (connection refused)"),
            std::string::npos)
      << msg;
}

// Rank 0 hosts the store (no torchrun agent), but another process holds the port.
TEST_F(Startup, StorePortHeldByAnotherProcess) {
  LoopbackPort held(/*listen_too=*/true);
  master("127.0.0.1", held.port);
  const auto start = Clock::now();
  auto msg = error_of([] { init_process_group(rank_of(0, 2).timeout(std::chrono::seconds(3))); });
  std::cout << "after " << seconds_since(start) << " s: " << msg << std::endl;
  EXPECT_LT(seconds_since(start), 3.5) << msg;
  EXPECT_NE(msg.find("rank 0 of 2 could not host the job's store on 127.0.0.1:" + std::to_string(held.port)),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("choose a free MASTER_PORT"), std::string::npos) << msg;
}

// The other ranks never come: rank 0 says which ones it waited for.
TEST_F(Startup, RanksThatNeverJoinAreNamed) {
  LoopbackPort free_port(/*listen_too=*/false);
  free_port.close_now();
  master("127.0.0.1", free_port.port);
  const auto start = Clock::now();
  auto msg = error_of([] { init_process_group(rank_of(0, 3).timeout(std::chrono::seconds(3))); });
  std::cout << "after " << seconds_since(start) << " s: " << msg << std::endl;
  EXPECT_LT(seconds_since(start), 3.5) << msg;
  EXPECT_NE(msg.find("1 of 3 joined, missing: 1, 2"), std::string::npos) << msg;
}

// MASTER_ADDR that does not resolve: inside a network namespace of the test's own (no interface
// up, so no name server is reachable and nothing leaves this machine), within the timeout.
TEST_F(Startup, UnresolvableAddressFailsWithinTheTimeout) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root for a network namespace of its own";
  const int original = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(original, 0);
  if (unshare(CLONE_NEWNET) != 0) {
    ::close(original);
    GTEST_SKIP() << "unshare(CLONE_NEWNET) is not allowed here";
  }
  master("no-such-host.invalid", 29500);
  const auto start = Clock::now();
  auto msg = error_of([] { init_process_group(rank_of(1, 2).timeout(std::chrono::seconds(3))); });
  const double took = seconds_since(start);
  EXPECT_EQ(setns(original, CLONE_NEWNET), 0);  // this thread back in the machine's namespace
  ::close(original);
  std::cout << "after " << took << " s: " << msg << std::endl;
  EXPECT_LT(took, 1.2 * 3) << msg;
  EXPECT_NE(msg.find("no-such-host.invalid:29500"), std::string::npos) << msg;
}

TEST_F(Startup, TimeoutPrecedence) {
  using std::chrono::milliseconds;
  EXPECT_EQ(InitOptions().timeout(), std::chrono::minutes(10));
  EXPECT_EQ(FullyShardOptions().timeout(), std::chrono::minutes(10));
  setenv("FSDP_TIMEOUT", "2.5", 1);
  EXPECT_EQ(InitOptions().timeout(), milliseconds(2500));
  EXPECT_EQ(FullyShardOptions().timeout(), milliseconds(2500));
  EXPECT_EQ(InitOptions().timeout(std::chrono::seconds(7)).timeout(), milliseconds(7000));  // explicit wins
  EXPECT_EQ(FullyShardOptions().timeout(std::chrono::seconds(7)).timeout(), milliseconds(7000));
  for (const char* bad : {"abc", "0", "-1", "nan", "inf", "10s"}) {
    setenv("FSDP_TIMEOUT", bad, 1);
    auto msg = error_of([] { InitOptions().timeout(); });
    EXPECT_NE(msg.find(std::string("FSDP_TIMEOUT='") + bad + "' is not a timeout"), std::string::npos) << msg;
  }
}

// A process of another job reaching this job's store: told that its rank is taken (same job id),
// or that the store belongs to another job (different FSDP_JOB_ID), within seconds; the running
// job is not disturbed.
TEST(JobIdentity, SecondJobOnTheSamePortIsTold) {
  RunOptions opts;
  opts.rendezvous = "env";
  opts.init_process_group = false;
  run_ranks(
      3,
      [](Rank& r) {
        auto init = [](int rank) {
          return init_process_group(
              InitOptions().rank(rank).world_size(2).timeout(collective_timeout()).gloo_interface("lo").nccl(false));
        };
        if (r.rank < 2) {  // the job: ranks 0 and 1
          auto pg = init(r.rank);
          std::this_thread::sleep_for(std::chrono::seconds(5));  // the stranger comes meanwhile
          auto t = torch::ones({1});
          fsdp::all_reduce(pg, t);
          EXPECT_EQ(t.item<float>(), 2.0f);
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        auto start = Clock::now();
        auto taken = error_of([&] { init(1); });
        std::cout << "after " << seconds_since(start) << " s: " << taken << std::endl;
        EXPECT_LT(seconds_since(start), 3.0) << taken;
        EXPECT_NE(taken.find("rank 1 of 2 (process "), std::string::npos) << taken;
        EXPECT_NE(taken.find("is already taken by process"), std::string::npos) << taken;
        setenv("FSDP_JOB_ID", "the-other-job", 1);
        start = Clock::now();
        auto other = error_of([&] { init(1); });
        std::cout << "after " << seconds_since(start) << " s: " << other << std::endl;
        EXPECT_LT(seconds_since(start), 3.0) << other;
        EXPECT_NE(other.find("(job 'the-other-job' of 2 ranks) reached the store at 127.0.0.1:"), std::string::npos)
            << other;
        EXPECT_NE(other.find("which belongs to another job (job '(no id)' of 2 ranks)"), std::string::npos) << other;
      },
      opts);
}

// A file store is removed when its last user is gone, as c10d intends, although the library keeps
// connections of its own to it (heartbeat, peer check): they are released at exit. A file left
// behind would make the next run with the same path fail ("rank already taken").
TEST(FileStore, RemovedAfterANormalRun) {
  const std::string path = "/tmp/fsdp-test-filestore-" + std::to_string(getpid());
  if (!in_rank_process()) ::unlink(path.c_str());
  RunOptions opts;
  opts.init_process_group = false;
  opts.env["FSDP_TEST_OWN_STORE"] = path;
  run_ranks(
      2,
      [](Rank& r) {
        auto pg = init_process_group(InitOptions()
                                         .init_method(std::string("file://") + std::getenv("FSDP_TEST_OWN_STORE"))
                                         .rank(r.rank)
                                         .world_size(2)
                                         .timeout(collective_timeout())
                                         .gloo_interface("lo")
                                         .nccl(false));
        auto t = torch::ones({1});
        fsdp::all_reduce(pg, t);
        EXPECT_EQ(t.item<float>(), 2.0f);
      },
      opts);
  if (!in_rank_process()) EXPECT_NE(::access(path.c_str(), F_OK), 0) << path << " was left behind";
}

// NCCL cannot run two ranks on one GPU: a rank whose GPU (by its PCI id on its host) another rank
// of the group took first gets no NCCL backend, and a reason naming the GPU, the count and the
// remedies, before NCCL's own "Duplicate GPU detected". From fake counts, without a GPU.
TEST(NcclDevice, TwoRanksOnOneGpuAreRefused) {
  LaunchEnv env;
  env.launcher = "torchrun";
  env.rank = 3;
  env.world_size = 4;
  env.local_rank = 1;
  // The device a local rank binds to: its own with one device per rank (Slurm's
  // --gpus-per-task=1), local_rank % count otherwise.
  EXPECT_EQ(detail::nccl_device_index(env, 1), 0);
  EXPECT_EQ(detail::nccl_device_index(env, 2), 1);
  EXPECT_EQ(detail::nccl_device_index(env, 8), 1);
  const std::string why = detail::nccl_shared_gpu_refusal(env, "node7", "0000:1b:00.0", 0, 1, 2);
  EXPECT_NE(why.find("global rank 3 of 4 (local rank 1) would share its GPU, cuda:0 (PCI 0000:1b:00.0) of host "
                     "'node7', with 1 other rank(s) of this group"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("Duplicate GPU detected"), std::string::npos) << why;
  EXPECT_NE(why.find("This process sees 1 CUDA device(s)"), std::string::npos) << why;
  EXPECT_NE(why.find("torchrun --nproc-per-node 1"), std::string::npos) << why;
  EXPECT_NE(why.find("FSDP_TEST_GLOO_CUDA=1 runs them all on cuda:0 over Gloo, a testing mode"), std::string::npos)
      << why;
  // The first rank on a GPU keeps it.
  EXPECT_EQ(detail::nccl_shared_gpu_refusal(env, "node7", "0000:1b:00.0", 0, 1, 1), "");
}

}  // namespace
}  // namespace fsdp::testing
