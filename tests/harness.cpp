#include "tests/harness.h"

#include "fsdp/process_group.h"
#include "programs/launch.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

extern char** environ;

namespace fsdp::testing {
namespace {

const char* env_or_null(const char* n) {
  const char* v = std::getenv(n);
  return (v && *v) ? v : nullptr;
}

std::string current_test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

// Not std::filesystem: libtorch.so exports a copy of its symbols that crashes when called.
void remove_dir(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      // Subdirectories (the flight recorder's) are removed too.
      if (n != "." && n != ".." && unlink((dir + "/" + n).c_str()) != 0) remove_dir(dir + "/" + n);
    }
    closedir(d);
  }
  rmdir(dir.c_str());
}

int g_calls_in_this_process = 0;

void run_as_rank(const std::function<void(Rank&)>& body, const RunOptions& options) {
  at::set_num_threads(1);  // 4 ranks share 2 cores
  Rank r;
  const char* rank = env_or_null("FSDP_TEST_RANK");
  const char* world_size = env_or_null("FSDP_TEST_WORLD_SIZE");
  TORCH_CHECK(rank != nullptr && world_size != nullptr, "a rank process needs FSDP_TEST_RANK and FSDP_TEST_WORLD_SIZE");
  r.rank = std::atoi(rank);
  r.world_size = std::atoi(world_size);
  if (options.init_process_group) {
    auto init = InitOptions().timeout(collective_timeout()).gloo_interface("lo").nccl(options.nccl);
    if (options.rendezvous != "env") init.rank(r.rank).world_size(r.world_size);
    if (const char* store = env_or_null("FSDP_TEST_STORE")) init.init_method(std::string("file://") + store);
    r.pg = init_process_group(init);
    ASSERT_EQ(r.pg->getRank(), r.rank);
    ASSERT_EQ(r.pg->getSize(), r.world_size);
  }
  body(r);
  // Proof that the body ran to its end: a rank that exits 0 without it fails the test.
  if (const char* done = env_or_null("FSDP_TEST_DONE_FILE")) std::ofstream(done) << "done\n";
}

}  // namespace

bool in_rank_process() {
  return env_or_null("FSDP_TEST_RANK") != nullptr;
}

std::string shared_dir() {
  const char* d = env_or_null("FSDP_TEST_DIR");
  TORCH_CHECK(d != nullptr, "shared_dir() is for the body of run_ranks");
  return d;
}

std::chrono::milliseconds collective_timeout() {
  const char* v = env_or_null("FSDP_TEST_COLLECTIVE_TIMEOUT_MS");
  return std::chrono::milliseconds(v ? std::atol(v) : 30000);
}

void all_reduce_sum(Rank& r, at::Tensor& t) {
  std::vector<at::Tensor> ts{t};
  r.pg->getBackend(c10::DeviceType::CPU)->allreduce(ts)->wait(collective_timeout());
}

void run_ranks(int world_size, const std::function<void(Rank&)>& body, const RunOptions& options) {
  if (in_rank_process()) {
    // The test body runs from its start in every rank process: the launch this process belongs
    // to runs its body, the others (before and after it) return at once.
    const char* launch = env_or_null("FSDP_TEST_LAUNCH");
    if (g_calls_in_this_process++ == (launch ? std::atoi(launch) : 0)) run_as_rank(body, options);
    return;
  }
  static std::map<std::string, int> launches;  // per test: run_ranks calls so far
  const int launch = launches[current_test_name()]++;
  char tmpl[] = "/tmp/fsdp-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string filter = "--gtest_filter=" + current_test_name();
  const int port = options.rendezvous == "env" ? fsdp::programs::free_port() : 0;

  // Whatever happens below, no rank outlives this function and the directory is removed.
  std::vector<pid_t> pids(world_size, -1);
  struct Cleanup {
    std::vector<pid_t>& pids;
    std::string dir;
    ~Cleanup() {
      for (pid_t& p : pids) {
        if (p <= 0) continue;
        kill(-p, SIGKILL);
        waitpid(p, nullptr, 0);
        p = -1;
      }
      remove_dir(dir);
    }
  } cleanup{pids, dir};

  std::vector<std::string> logs(world_size), done_files(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    std::map<std::string, std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      auto eq = kv.find('=');
      // GTEST_* (sharding, output files, repeats) is for the parent run, never for a rank.
      if (eq != std::string::npos && kv.rfind("GTEST_", 0) != 0) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    env["FSDP_TEST_RANK"] = std::to_string(rank);
    env["FSDP_TEST_WORLD_SIZE"] = std::to_string(world_size);
    env["FSDP_TEST_COLLECTIVE_TIMEOUT_MS"] =
        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(options.collective_timeout).count());
    env["OMP_NUM_THREADS"] = "1";
    env["FSDP_TEST_DIR"] = dir;
    // A failed collective writes the flight recorder's file: into this test's directory (removed
    // with it), not /tmp/fsdp-trace, where tests running in parallel would overwrite each other's.
    env["FSDP_FLIGHT_RECORDER_DIR"] = dir + "/flight-recorder";
    env["FSDP_TEST_LAUNCH"] = std::to_string(launch);
    if (options.rendezvous == "env") {
      for (const auto& [k, v] : fsdp::programs::rank_env(rank, world_size, port)) env[k] = v;
    } else {
      env["FSDP_TEST_STORE"] = dir + "/store";
    }
    done_files[rank] = dir + "/rank" + std::to_string(rank) + ".done";
    env["FSDP_TEST_DONE_FILE"] = done_files[rank];
    for (const auto& kv : options.env) env[kv.first] = kv.second;
    std::vector<std::string> env_strings;
    for (const auto& kv : env) env_strings.push_back(kv.first + "=" + kv.second);
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);

    logs[rank] = dir + "/rank" + std::to_string(rank) + ".log";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, logs[rank].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);  // its own process group: killed as a whole
    std::string exe = "/proc/self/exe";
    std::vector<char*> argv{exe.data(), const_cast<char*>(filter.c_str()), nullptr};
    int rc = posix_spawn(&pids[rank], exe.c_str(), &actions, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) pids[rank] = -1;
    ASSERT_EQ(rc, 0) << "posix_spawn failed for rank " << rank << ": " << strerror(rc);
  }

  // Wait for every rank; once one fails, the others get a short grace period (they should fail
  // on their collective timeout or finish), then everything left is killed.
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto deadline = start + options.timeout;
  auto may_die = [&](int r) {
    return std::find(options.may_die.begin(), options.may_die.end(), r) != options.may_die.end();
  };
  std::vector<int> status(world_size, 0);
  std::vector<bool> done(world_size, false);
  std::vector<std::string> verdict(world_size);
  int remaining = world_size;
  bool any_failed = false;
  while (remaining > 0) {
    for (int r = 0; r < world_size; ++r) {
      if (done[r]) continue;
      if (waitpid(pids[r], &status[r], WNOHANG) == pids[r]) {
        pids[r] = -1;  // reaped
        done[r] = true;
        --remaining;
        if (may_die(r) && !(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)) continue;
        if (WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) {
          if (access(done_files[r].c_str(), F_OK) == 0) continue;
          verdict[r] = "exited 0 without running the test body";
        } else {
          verdict[r] = WIFSIGNALED(status[r]) ? "killed by signal " + std::to_string(WTERMSIG(status[r]))
                                              : "exited with status " + std::to_string(WEXITSTATUS(status[r]));
        }
        if (!any_failed) {
          any_failed = true;
          deadline = std::min(deadline, clock::now() + options.collective_timeout + std::chrono::seconds(5));
        }
      }
    }
    if (remaining == 0) break;
    // Ranks that may die may also be stopped (SIGSTOP) or hang on purpose: once every other rank
    // is done, they are killed without blame.
    bool others_done = true;
    for (int r = 0; r < world_size; ++r) others_done = others_done && (done[r] || may_die(r));
    if (others_done || clock::now() > deadline) {
      for (int r = 0; r < world_size; ++r) {
        if (done[r]) continue;
        kill(-pids[r], SIGKILL);
        waitpid(pids[r], &status[r], 0);
        pids[r] = -1;
        done[r] = true;
        if (!others_done) verdict[r] = "did not finish in time (killed)";
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  std::ostringstream report;
  bool ok = true;
  for (int r = 0; r < world_size; ++r) ok = ok && verdict[r].empty();
  if (!ok || env_or_null("FSDP_TEST_SHOW_OUTPUT")) {
    for (int r = 0; r < world_size; ++r) {
      report << "===== rank " << r << " of " << world_size << ": " << (verdict[r].empty() ? "ok" : verdict[r])
             << " =====\n"
             << fsdp::programs::file_text(logs[r]) << "\n";
    }
  }
  if (ok && !report.str().empty()) std::cout << report.str();
  ASSERT_TRUE(ok) << "ranks of " << current_test_name() << " failed after "
                  << std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start).count() << " ms:\n"
                  << report.str();
}

}  // namespace fsdp::testing
