// Starting the ranks of a job on this machine as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, a free MASTER_PORT), for the C++ benchmarks (fsdp_bench, ckpt_bench compare) and the
// tests' harness (tests/harness.cpp): the one free port finder and the one rank environment.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace fsdp::programs {

/// A TCP socket bound to a port the kernel picked on 127.0.0.1, listening with `listen`
/// (connections are then accepted by the kernel and never answered): its fd, which the caller
/// closes, and its port. Throws when no port can be had.
struct LoopbackSocket {
  int fd = -1;
  int port = 0;
};
LoopbackSocket loopback_socket(bool listen);

/// A port the kernel just handed out on 127.0.0.1 and released (bind to port 0): another process
/// could take it before rank 0's TCPStore binds it, but the kernel cycles through the ephemeral
/// range, so that is rare. Throws when no port can be had.
int free_port();

/// The variables torchrun gives rank `rank` of `world_size` ranks on this machine, its store at
/// 127.0.0.1:`port`.
std::map<std::string, std::string> rank_env(int rank, int world_size, int port);

/// This executable's path (for starting itself as a worker).
std::string self_exe();

struct RankLaunch {
  std::string label;              ///< for the progress line and errors, e.g. "libtorch-fsdp full N=4"
  std::vector<std::string> argv;  ///< the program and its arguments; "{out}" is replaced per rank
  int world_size = 1;
  int threads_per_rank = 1;   ///< OMP_NUM_THREADS
  int run_timeout_s = 900;    ///< wall clock: past it, every rank is stopped (--run-timeout)
  bool split_stdout = false;  ///< each rank's stdout in a file of its own, apart from its log
};

/// One finished run's files: each rank's "{out}" path, its log (stderr, and stdout unless split)
/// and, with split_stdout, its stdout. remove() deletes them.
struct RankFiles {
  std::string dir;
  std::vector<std::string> outs, logs, stdouts;
  void remove() const;
};

/// Runs world_size copies of argv with rank_env() and OMP_NUM_THREADS set, their output in files,
/// waiting with a deadline and a progress line on stderr (prefixed by `progress`). On a failed rank
/// or the deadline, stops every rank and throws with each rank's last output.
RankFiles launch_ranks(const RankLaunch& l, const std::string& progress);

/// The whole of a text file ("" when it cannot be read).
std::string file_text(const std::string& path);

}  // namespace fsdp::programs
