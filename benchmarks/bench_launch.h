// Starting the ranks of one benchmark run as processes (the environment torchrun would give them),
// waiting with a deadline and a progress line, and reading their results: the one launcher of
// fsdp_bench (each rank writes a report file) and ckpt_bench compare (rank 0 prints JSON lines).
#pragma once

#include "benchmarks/bench_run.h"

#include <string>
#include <vector>

namespace bench {

struct Launch {
  std::string label;              ///< for the progress line and errors, e.g. "libtorch-fsdp full N=4"
  std::vector<std::string> argv;  ///< the program and its arguments; "{out}" is replaced per rank
  int world_size = 1;
  int threads_per_rank = 1;  ///< OMP_NUM_THREADS
  int run_timeout_s = 900;   ///< wall clock: past it, every rank is stopped (--run-timeout)
};

/// Runs world_size copies of argv with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and a free
/// MASTER_PORT set; each rank writes its report to the path that replaces "{out}". Returns the
/// reports in rank order. On a failed rank or the deadline, stops every rank and throws with each
/// rank's last output. `progress` prefixes the progress line written to stderr.
std::vector<Report> launch(const Launch& l, const std::string& progress);

/// The same, for programs that print their results: each rank's stdout is kept apart from its
/// stderr (which goes to its log, shown on failure) and returned, in rank order.
std::vector<std::string> launch_stdout(const Launch& l, const std::string& progress);

/// This executable's path (for starting itself as a worker).
std::string self_exe();

}  // namespace bench
