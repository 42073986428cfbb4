// ckpt_bench's command line: the mode, its flags with their defaults, and the usage text. Parsed
// strictly (programs/flags.h): a bad value or an unknown flag is a usage error naming it.
#pragma once

#include "examples/gpt.h"

#include <string>
#include <vector>

namespace ckpt {

struct Flags {
  std::string mode;                             // compare | save | load | async | simulate
  std::string dir;                              // the checkpoints' directory (compare: a temporary one by default)
  std::string strategy = "full";                // full | grad-op | optimizer | replicate | hybrid (groups of 2)
  gpt::Config model;                            // GPT 8 blocks x 512, 8 heads
  int reps = 6;                                 // save, load (and compare's runs of them): repetitions
  int async_reps = 20;                          // async: saves
  int io_threads = 1;                           // threads writing and reading, the library's and the raw baseline's
  bool direct = false;                          // O_DIRECT, the library's and the raw baseline's
  bool json = false;                            // compare: JSON rows instead of the table
  int run_timeout_s = 3600;                     // compare: wall clock of each run, then its ranks are stopped
  std::vector<int> worlds{1, 2, 4};             // compare: world sizes
  std::vector<int> ranks{128, 256, 512, 1024};  // simulate: ranks
};

/// The flags of `argv` (argv[1] the mode); --help prints the help and exits 0. Throws
/// fsdp::programs::UsageError for a missing or unknown mode, an unknown flag, a missing or bad
/// value, or save/load/async without --dir.
Flags parse_flags(int argc, char** argv);

}  // namespace ckpt
