// The ranks of one benchmark run (programs/launch.h starts them) and their results: fsdp_bench's
// (each rank writes a report file) and ckpt_bench compare's (rank 0 prints JSON lines).
#pragma once

#include "benchmarks/bench_run.h"
#include "programs/launch.h"

#include <string>
#include <vector>

namespace bench {

using Launch = fsdp::programs::RankLaunch;
using fsdp::programs::self_exe;

/// Runs the ranks (programs/launch.h's launch_ranks); each writes its report to the path that
/// replaces "{out}". Returns the reports in rank order.
std::vector<Report> launch(const Launch& l, const std::string& progress);

/// The same, for programs that print their results: each rank's stdout, in rank order.
std::vector<std::string> launch_stdout(const Launch& l, const std::string& progress);

}  // namespace bench
