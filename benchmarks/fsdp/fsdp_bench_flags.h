// fsdp_bench's command line: its flags with their defaults, the usage text, and the parse that
// checks them all before any run starts (the run flags shared with train_gpt: examples/run_flags.h).
#pragma once

#include "benchmarks/bench_run.h"

#include <string>
#include <vector>

#ifndef FSDP_BENCH_PYTHON
#define FSDP_BENCH_PYTHON ""
#endif

namespace bench {

struct Args {
  RunOptions run;
  std::vector<int> world_sizes = {1, 2, 4};  // and 8 where it fits (8 cores or more, and memory)
  bool world_sizes_given = false;
  std::vector<std::string> strategies = {"full", "grad-op", "optimizer", "replicate", "hybrid"};
  /// fp32, and mixed precision's param_dtype (bf16, fp16; fp32 master weights): each strategy at
  /// each world size in each, side by side (strategies that refuse mixed precision are left out).
  std::vector<std::string> precisions = {"fp32"};
  bool precisions_given = false;
  bool fsdp2 = true;
  std::string python = FSDP_BENCH_PYTHON;
  bool json = false;
  std::string out, plot;
  int run_timeout_s = 0;  // wall clock per run; 0: 900 s, or 3600 s simulated (70B at 1024 ranks: 29 minutes here)
  bool simulate = false;
  std::vector<std::string> sim_models = {"7b", "70b"};
  std::vector<int> sim_world_sizes = {8, 64, 1024};
  std::string device = "cpu";  // --simulate's rank: cpu, or cuda (run.device, bench_run.h)
  std::string worker;          // "" | "rank" | "sim": this process is one rank of a run
  std::string report;          // worker: where to write the report
};

/// The flags of argv, all checked; --help prints the usage on stdout and exits 0, a bad flag or
/// value throws fsdp::programs::UsageError (programs/flags.h).
Args parse(int argc, char** argv);

}  // namespace bench
